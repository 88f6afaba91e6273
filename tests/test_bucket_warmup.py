"""The bucket warm-up (epilora_cute/bucket_warmup.py) with a fake dispatcher timer: no GPU."""

import pytest

from epilora_cute import bucket_warmup as W
from epilora_cute.dispatch import MODES, TOKEN_BUCKETS, Call, Dispatcher, DispatchTable, key_for
from epilora_cute.ops import DECODE_MAX_TOKENS


def _call(tokens=16384, host_adapters=None):
    return Call(device="FakeGPU", arch="sm_90a", k=4096, slices=(4096, 1024, 1024), rank=64,
                tokens=tokens, max_loras=8, host_adapters=host_adapters,
                decode_reason=None if tokens <= DECODE_MAX_TOKENS else
                f"{tokens} tokens: the decode path takes 1..{DECODE_MAX_TOKENS}")


def _case(runner):
    """make_case for the fake: b's own call (as dispatch.describe builds it) and ``runner(b)``."""
    return lambda b: (_call(tokens=b), runner(b))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(W.ENV, raising=False)
    monkeypatch.delenv("EPILORA_FORCE_PATH", raising=False)
    W.reset()
    W.enable_by_default(False)
    yield
    W.reset()
    W.enable_by_default(False)


def _dispatcher(tmp_path, timer=lambda fn, mode: (fn(), 1.0)[1]):
    """A dispatcher with its table in tmp_path; ``timer`` runs the candidate and returns µs."""
    return Dispatcher(DispatchTable(tmp_path / "dispatch.json"), timer=timer)


def test_buckets_to_settle():
    assert W.buckets_to_settle(16384, 16384) == list(TOKEN_BUCKETS[:-1])  # all but its own (8192)
    assert W.buckets_to_settle(3, 512) == [1, 2, 8, 16, 32, 64, 128, 256, 512]
    assert W.buckets_to_settle(1, 1) == []


def test_settles_every_bucket_in_both_modes_and_runs_each_choice(tmp_path):
    runs = []

    def runner(b):
        def run(path):
            runs.append((b, path))
        return run

    # The timer reads which path just ran: hybrid is the fastest from 64 tokens on, the slowest below.
    d = _dispatcher(tmp_path, lambda fn, mode: (fn(), 1.0 if (runs[-1][1] == "hybrid") == (runs[-1][0] >= 64) else 2.0)[1])
    settled = W.settle_buckets(_call(), 512, d, _case(runner))
    assert sorted(settled) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    for b, paths in settled.items():
        assert set(paths) == set(MODES)
        assert all(p in ("decode", "triton", "hybrid") for p in paths.values())
        # each bucket's own candidates: the decode kernels compete up to 64 tokens only (run10, 7db3128:
        # the live 16384-token call's view left them out of every bucket)
        key = key_for(_call(tokens=b), "graph")
        timed = set(d.table.entries()[key.text()]["times_us"])
        assert ("decode" in timed) == (b <= DECODE_MAX_TOKENS), (b, timed)
        for m in MODES:  # decided and remembered in the process and the table file
            key = key_for(_call(tokens=b), m)
            assert d.decisions()[key] == paths[m]
            assert d.table.get(key) == paths[m]
        assert (b, paths["graph"]) in runs  # the choice ran once outside its timing
        assert (paths["graph"] == "hybrid") == (b >= 64)


@pytest.fixture
def graph_limit():
    """dispatch.set_graph_max_tokens for one test, put back after it."""
    from epilora_cute import dispatch

    before = dispatch.set_graph_max_tokens(None)
    yield dispatch.set_graph_max_tokens
    dispatch.set_graph_max_tokens(before)


def test_buckets_above_the_graph_sizes_are_settled_eager_only(tmp_path, graph_limit):
    """v1.01: with the engine's largest CUDA-graph batch known (128 tokens), the buckets above it
    are timed and decided in eager mode only, nothing is timed as a graph replay there; up to it
    both modes as before. Without graphs at all (0, enforce_eager) every bucket is eager only."""
    timed, last = [], []
    d = _dispatcher(tmp_path, lambda fn, mode: (fn(), timed.append((mode, last[-1])), 1.0)[2])
    graph_limit(100)  # bucket 128 holds it
    settled = W.settle_buckets(_call(), 512, d, _case(lambda b: (lambda path: last.append(b))))
    assert sorted(settled) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    for b, paths in settled.items():
        assert set(paths) == (set(MODES) if b <= 128 else {"eager"}), (b, paths)
        assert (key_for(_call(tokens=b), "graph") in d.decisions()) == (b <= 128)
        assert (key_for(_call(tokens=b), "graph").text() in d.table.entries()) == (b <= 128)
    graph_timed = {b for m, b in timed if m == "graph"}
    assert graph_timed == {1, 2, 4, 8, 16, 32, 64, 128} and {b for m, b in timed if m == "eager"} == set(settled)
    graph_limit(0)
    W.reset()
    d0 = _dispatcher(tmp_path / "none", lambda fn, mode: (fn(), timed.append((mode, last[-1])), 1.0)[2])
    timed.clear()
    settled = W.settle_buckets(_call(), 64, d0, _case(lambda b: (lambda path: last.append(b))))
    assert settled and all(set(p) == {"eager"} for p in settled.values())
    assert timed and all(m == "eager" for m, _ in timed)


def test_a_graph_met_above_the_limit_is_still_settled(tmp_path, graph_limit):
    """A capture the limit did not foresee (a graph key above it) takes the default, provisional,
    and the next call outside capture times it as before: the limit only skips what never runs."""
    timed = []
    d = _dispatcher(tmp_path, lambda fn, mode: (fn(), timed.append(mode), 1.0)[2])
    graph_limit(128)
    call = _call(tokens=2048)
    run = lambda path: None  # noqa: E731
    d.path_for(call, run, mode="eager", capturing=False)
    assert "graph" not in timed and key_for(call, "graph") not in d.decisions()
    d.path_for(call, run, mode="graph", capturing=True)  # met under capture: a provisional default
    assert key_for(call, "graph") in d.decisions() and "graph" not in timed
    d.path_for(call, run, mode="eager", capturing=False)  # outside capture again: now timed
    assert "graph" in timed and d.table.get(key_for(call, "graph")) is not None


def test_known_buckets_are_not_timed_again_but_still_run(tmp_path):
    runs = []
    d = _dispatcher(tmp_path)
    W.settle_buckets(_call(), 64, d, _case(lambda b: (lambda p: runs.append((b, p)))))
    d2 = Dispatcher(DispatchTable(tmp_path / "dispatch.json"),
                    timer=lambda fn, mode: pytest.fail("a known key was timed again"))
    runs.clear()
    settled = W.settle_buckets(_call(), 64, d2, _case(lambda b: (lambda p: runs.append((b, p)))))
    assert sorted(settled) == [1, 2, 4, 8, 16, 32, 64]
    assert {b for b, _ in runs} == set(settled)  # each decided path still runs once


def test_a_failing_bucket_is_skipped_not_raised(tmp_path, caplog):
    d = _dispatcher(tmp_path)

    def runner(b):
        if b == 4:
            raise RuntimeError("out of memory")
        return lambda p: None

    settled = W.settle_buckets(_call(), 8, d, _case(runner))
    assert sorted(settled) == [1, 2, 8] and "bucket 4" in caplog.text


def test_once_per_shape_only_when_enabled_and_never_for_adapter_free_batches(tmp_path, monkeypatch):
    d = _dispatcher(tmp_path)
    seen = []

    def runner(b):
        seen.append(b)
        return lambda p: None

    make_run = _case(runner)
    assert not W.maybe_warm_up(_call(), 64, d, make_run)  # off by default outside an engine
    W.enable_by_default()
    assert not W.maybe_warm_up(_call(host_adapters=0), 64, d, make_run)  # one candidate: nothing to time
    assert W.maybe_warm_up(_call(tokens=16), 64, d, make_run)
    assert sorted(seen) == [1, 2, 4, 8, 32, 64]  # not its own bucket (16)
    assert not W.maybe_warm_up(_call(tokens=1), 64, d, make_run)  # same shape: done
    assert W.maybe_warm_up(_call()._replace(k=12288, slices=(4096,)), 64, d, make_run)  # another shape
    monkeypatch.setenv(W.ENV, "0")
    assert not W.maybe_warm_up(_call()._replace(k=14336, slices=(4096,)), 64, d, make_run)
    W.enable_by_default(False)
    monkeypatch.setenv(W.ENV, "1")
    assert W.maybe_warm_up(_call()._replace(k=14336, slices=(4096,)), 64, d, make_run)


def test_synthetic_runner_builds_a_full_batch_over_every_slot(monkeypatch):
    """The warm-up's candidate runner on the CPU (path "reference"): the call's rows repeated to
    the bucket's size, tokens dealt over all slots, the result the reference's for those inputs."""
    import torch

    from epilora_cute import dispatch, ops, reference
    from epilora_cute.metadata import build_meta

    g = torch.Generator().manual_seed(0)
    k, widths, rank, loras = 64, (32, 16), 8, 3
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    w_q, w_scale = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g))
    a = [torch.randn(loras, 1, rank, k, generator=g).to(torch.bfloat16) * 0.1 for _ in widths]
    b = [torch.randn(loras, 1, w, rank, generator=g).to(torch.bfloat16) * 0.1 for w in widths]
    meta = build_meta(torch.tensor([0, -1, 2], dtype=torch.int32), loras, max_num_tokens=64)
    seen = {}
    real = ops.lora_linear_fp8

    def spy(xb, *args, **kw):
        seen["x"], seen["meta"], seen["out"] = xb, args[4], kw["out"]
        return real(xb, *args, **kw)

    xs, run = dispatch._synthetic_runner(x, w_q, w_scale, a, b, meta, 8, sum(widths), slot_ranks=None, pdl=False)
    monkeypatch.setattr(ops, "lora_linear_fp8", spy)
    run("reference")
    xb, mb, out = seen["x"], seen["meta"], seen["out"]
    assert xb is xs and xb.shape == (8, k) and torch.equal(xb[3:6], x) and torch.equal(xb[6:8], x[:2])
    assert mb.token_lora_mapping[:8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # every slot, no token without
    want = reference.lora_linear(xb, w_q, w_scale, a, b, mb.token_lora_mapping[:8])
    assert torch.equal(out, want.to(out.dtype))
