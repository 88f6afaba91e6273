"""Timed dispatch on the CPU: the table, and the dispatcher behind lora_linear_fp8(path="auto") with
injected fake timers and paths."""

import json
import logging

import pytest
import torch

from epilora_cute import dispatch as d
from epilora_cute import ops, reference
from epilora_cute.metadata import build_meta


def key(**kw):
    base = dict(device="H200", k=4096, slices=(4096, 1024, 1024), rank=64, tokens=d.token_bucket(7),
                adapters=d.adapter_bucket(1), mode="graph")
    base.update(kw)
    return d.DispatchKey(**base)


def test_buckets():
    assert [d.token_bucket(n) for n in (1, 2, 3, 32, 33, 8192, 9000)] == [1, 2, 4, 32, 64, 8192, 8192]
    assert [d.adapter_bucket(n) for n in (0, 1, 3, 8, 32, 100)] == ["0", "1", "2-4", "5-8", "9-32", "33-inf"]


def test_fastest_is_kept_persisted_and_reused(tmp_path):
    t = d.DispatchTable(tmp_path / "dispatch.json")
    times = {"decode": 50.0, "hybrid": 70.0, "vllm": 90.0}
    calls = []
    timer = lambda fn, mode: calls.append(fn) or times[fn()]
    cands = {p: (lambda p=p: p) for p in times}
    assert d.choose(t, key(), cands, timer) == "decode"
    assert len(calls) == 3
    assert d.choose(t, key(), cands, timer) == "decode" and len(calls) == 3  # remembered
    t2 = d.DispatchTable(tmp_path / "dispatch.json")  # the next start reads the file
    assert t2.get(key()) == "decode"
    saved = json.loads((tmp_path / "dispatch.json").read_text())
    assert saved[key().text()]["times_us"]["hybrid"] == 70.0
    # Eager and graph modes are decided separately.
    assert d.choose(t, key(mode="eager"), cands, lambda fn, m: {"decode": 9, "hybrid": 5, "vllm": 7}[fn()]) == "hybrid"


def test_force_env_and_failing_candidates(tmp_path, monkeypatch):
    t = d.DispatchTable(tmp_path / "x.json")
    cands = {"a": lambda: "a", "b": lambda: "b"}

    def timer(fn, mode):
        if fn() == "a":
            raise RuntimeError("kernel refused this shape")
        return 1.0
    assert d.choose(t, key(), cands, timer) == "b"
    monkeypatch.setenv(d.FORCE_ENV, "a")
    assert d.choose(t, key(tokens=64), cands, timer) == "a"
    monkeypatch.setenv(d.FORCE_ENV, "zzz")
    with pytest.raises(ValueError, match="EPILORA_FORCE_PATH"):
        d.choose(t, key(), cands, timer)


def test_unwritable_table_still_decides(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    t = d.DispatchTable(ro / "sub" / "dispatch.json")
    assert d.choose(t, key(), {"a": lambda: 1}, lambda fn, m: 1.0) == "a"


def test_print_table(tmp_path, capsys):
    t = d.DispatchTable(tmp_path / "t.json")
    t.record(key(), {"decode": 1.0, "hybrid": 2.0})
    d.main(["--path", str(tmp_path / "t.json")])
    assert "-> decode" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The dispatcher behind lora_linear_fp8(path="auto"), with fake paths and timers (no GPU).

OPT_INS = ("EPILORA_DECODE_PATH", "EPILORA_HYBRID_PATH", "EPILORA_PREFILL_PATH", d.FORCE_ENV, d.NO_LORA_ENV)
SHIPPED_VERIFIED = d.VERIFIED_PATHS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in OPT_INS:
        monkeypatch.delenv(v, raising=False)
    # The dispatcher's tests model a world where only "triton" is verified and the other paths are
    # opted in by their variables; test_candidates_follow_applicability_and_opt_in checks the
    # shipped set.
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton"}))
    d.set_dispatcher(None)
    yield
    d.set_dispatcher(None)


def call(**kw):
    base = dict(device="H200", arch="sm_90a", k=4096, slices=(4096, 1024, 1024), rank=64, tokens=12,
                max_loras=8, host_adapters=None, decode_reason=None)
    base.update(kw)
    return d.Call(**base)


class FakeTimer:
    """Microseconds per (path, mode); counts every timing."""

    def __init__(self, graph=None, eager=None):
        self.us = {"graph": graph or {"decode": 10.0, "hybrid": 30.0, "triton": 20.0, "no_adapter": 5.0},
                   "eager": eager or {"decode": 40.0, "hybrid": 60.0, "triton": 35.0, "no_adapter": 50.0}}
        self.calls = []

    def __call__(self, fn, mode):
        path = fn()
        self.calls.append((path, mode))
        if isinstance(self.us[mode].get(path), Exception):
            raise self.us[mode][path]
        return self.us[mode][path]


def run(path):  # a candidate run: returns its name so the fake timer knows it
    return path


@pytest.fixture(autouse=True)
def _without_hybrid_par(monkeypatch):
    """The tests written before hybrid_par (v0.34) time fixed candidate sets with fake timers:
    keep it out of them; the tests about it take the variable away."""
    monkeypatch.setenv("EPILORA_HYBRID_PAR_PATH", "0")


def test_candidates_follow_applicability_and_opt_in(monkeypatch):
    monkeypatch.delenv("EPILORA_HYBRID_PAR_PATH")
    # decode_sq / decode_fh: the decode path's 1..8-token variants (the default call has 12 tokens).
    H = ("hybrid", "hybrid_par", "hybrid_par_q")
    G = ("hybrid_g", "hybrid_par_g")  # 33..512 tokens
    SQ = ("decode_sq", "decode_fh")
    assert d.applicable_paths(call(tokens=7)) == ("decode", *SQ, *H, "triton")
    assert d.applicable_paths(call()) == ("decode", *H, "triton")
    assert d.applicable_paths(call(tokens=7, k=4096 + 64)) == ("decode", *H, "triton")  # K % 128
    assert d.applicable_paths(call(tokens=7, host_adapters=0)) == ("base", "decode", *SQ, "no_adapter",
                                                                   *H, "triton")
    assert d.applicable_paths(call(tokens=64, decode_reason="64 tokens")) == (*H, *G, "triton")
    assert d.applicable_paths(call(arch=None, decode_reason="needs sm_90a")) == ("triton",)
    assert d.applicable_paths(call(arch=None, decode_reason="needs sm_90a", host_adapters=0)) == ("base", "triton")
    # Verified on the H200 (run6; base: run9; decode_sq: run12): every applicable path is a
    # candidate without a variable.
    assert SHIPPED_VERIFIED == {"triton", "decode", "decode_sq", "no_adapter", "hybrid", "hybrid_par", "hybrid_par_q",
                                "hybrid_st", "hybrid_par_st", "base"}
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    allowed = lambda c: [p for p in d.applicable_paths(c) if d.path_allowed(p)]  # noqa: E731
    assert allowed(call(tokens=7, host_adapters=0)) == ["base", "decode", "decode_sq", "no_adapter", *H, "triton"]
    assert list(d._allowed(d.applicable_paths(call(host_adapters=0)))) == allowed(call(host_adapters=0))
    # A variable set to "0" keeps its paths out ("decode_sq" and "no_adapter" follow the decode path's).
    monkeypatch.setenv("EPILORA_DECODE_PATH", "0")
    assert allowed(call(tokens=7, host_adapters=0)) == ["base", *H, "triton"]
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "0")
    monkeypatch.setenv("EPILORA_HYBRID_PAR_PATH", "0")
    assert allowed(call()) == ["triton"]
    assert list(d._allowed(d.applicable_paths(call()))) == ["triton"]
    monkeypatch.delenv("EPILORA_HYBRID_PAR_PATH")
    # "1" lets in a path that is not (or no longer) verified.
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton"}))
    monkeypatch.delenv("EPILORA_HYBRID_PATH")
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    assert allowed(call(tokens=7, host_adapters=0)) == ["decode", *SQ, "no_adapter", "triton"]
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    assert allowed(call()) == ["decode", "hybrid", "triton"]
    assert "reference" not in d.applicable_paths(call())
    assert d.OPT_IN_ENV["decode"] == d.OPT_IN_ENV["decode_sq"] == d.OPT_IN_ENV["decode_fh"] == ops.DECODE_PATH_ENV
    # hybrid_par (v0.34, run13) and hybrid_par_q (v0.58, run22) have a variable of their own:
    # "0" keeps them out
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    monkeypatch.delenv("EPILORA_HYBRID_PATH")
    assert allowed(call()) == ["decode", "hybrid", "hybrid_par", "hybrid_par_q", "triton"]
    monkeypatch.setenv("EPILORA_HYBRID_PAR_PATH", "0")
    assert allowed(call()) == ["decode", "hybrid", "triton"]


def test_prefill_is_a_candidate_where_it_applies_and_only_opted_in(monkeypatch):
    monkeypatch.delenv("EPILORA_HYBRID_PAR_PATH")
    monkeypatch.delenv("EPILORA_PREFILL_PATH", raising=False)
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    H = ("hybrid", "hybrid_par", "hybrid_par_q")
    monkeypatch.delenv("EPILORA_HYBRID_STREAM_PATH", raising=False)
    ST = ("hybrid_st", "hybrid_par_st")
    big = call(tokens=2048, decode_reason="2048 tokens", prefill_reason=None)
    assert d.applicable_paths(big) == (*H, *ST, "prefill", "triton")
    assert d.applicable_paths(call(tokens=2048, decode_reason="2048 tokens")) == (*H, *ST, "triton")  # not described
    # Not GPU-verified through the op yet: out unless opted in, and "0" keeps it out again.
    assert "prefill" not in d.VERIFIED_PATHS and d.OPT_IN_ENV["prefill"] == "EPILORA_PREFILL_PATH"
    assert "prefill" not in d._allowed(d.applicable_paths(big))
    monkeypatch.setenv("EPILORA_PREFILL_PATH", "1")
    assert d._allowed(d.applicable_paths(big)) == (*H, *ST, "prefill", "triton")
    assert d.DEFAULT_ORDER.index("prefill") > d.DEFAULT_ORDER.index("hybrid_par_q")


def test_stream_paths_apply_from_their_token_count_and_only_opted_in(monkeypatch):
    """v0.88's hybrid_st / hybrid_par_st: sm_90a, token buckets from STREAM_MIN_TOKENS, compiled ranks;
    GPU-verified (run40), so in unless EPILORA_HYBRID_STREAM_PATH=0."""
    monkeypatch.delenv("EPILORA_HYBRID_PAR_PATH")
    monkeypatch.delenv("EPILORA_HYBRID_STREAM_PATH", raising=False)
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    ST = ("hybrid_st", "hybrid_par_st")
    at = lambda **kw: d.applicable_paths(call(decode_reason="many tokens", **kw))  # noqa: E731
    assert all(p in at(tokens=d.STREAM_MIN_TOKENS) for p in ST)
    # a whole token bucket: every call of one dispatch key has the same candidates
    first = d.STREAM_MIN_TOKENS // 2 + 1
    assert d.token_bucket(first) == d.STREAM_MIN_TOKENS
    assert d.stream_bucket(first) and not d.stream_bucket(first - 1)
    assert all(p in at(tokens=first) for p in ST)
    assert not any(p in at(tokens=first - 1) for p in ST)
    assert not any(p in at(tokens=4096, rank=48) for p in ST)  # no build of that rank
    assert not any(p in at(tokens=4096, arch=None) for p in ST)
    # GPU-verified in run40: candidates unless switched off
    assert all(p in d._allowed(at(tokens=4096)) for p in ST)
    monkeypatch.setenv("EPILORA_HYBRID_STREAM_PATH", "0")
    assert not any(p in d._allowed(at(tokens=4096)) for p in ST)
    assert d.DEFAULT_ORDER.index("hybrid_par_st") > d.DEFAULT_ORDER.index("hybrid_par_q")


def test_grouped_paths_apply_in_their_token_buckets_and_only_opted_in(monkeypatch):
    """v0.90's hybrid_g / hybrid_par_g: sm_90a, the token buckets 64..512 (whole buckets),
    compiled ranks; not GPU-verified yet, so out unless EPILORA_HYBRID_GROUPED_PATH=1."""
    monkeypatch.delenv("EPILORA_HYBRID_PAR_PATH")
    monkeypatch.delenv("EPILORA_HYBRID_GROUPED_PATH", raising=False)
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    G = ("hybrid_g", "hybrid_par_g")
    at = lambda **kw: d.applicable_paths(call(decode_reason="many tokens", **kw))  # noqa: E731
    for m, applies in ((32, False), (33, True), (64, True), (300, True), (512, True), (513, False), (4096, False)):
        assert all((p in at(tokens=m)) == applies for p in G), m
        assert d.grouped_bucket(m) == applies
    assert not any(p in at(tokens=256, rank=48) for p in G)  # no build of that rank
    assert not any(p in at(tokens=256, arch=None) for p in G)
    assert not any(p in d._allowed(at(tokens=256)) for p in G)
    monkeypatch.setenv("EPILORA_HYBRID_GROUPED_PATH", "1")
    assert all(p in d._allowed(at(tokens=256)) for p in G)
    assert d.DEFAULT_ORDER.index("hybrid_g") > d.DEFAULT_ORDER.index("hybrid_par_st")


def test_describe_asks_the_prefill_reason_only_when_it_could_be_a_candidate(monkeypatch):
    import torch

    from epilora_cute.metadata import build_meta

    asked = []
    monkeypatch.setattr(ops, "_on_gpu", lambda t: True)
    monkeypatch.setattr(ops, "_decode_reason", lambda *a: "64 tokens")
    monkeypatch.setattr(ops, "_prefill_reason", lambda *a: asked.append(a) or None)
    monkeypatch.setattr(d, "_device_name", lambda i: "H200")
    monkeypatch.setattr("epilora_cute.arch.arch_of", lambda t: "sm_90a")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    meta = build_meta(torch.zeros(64, dtype=torch.int32), 4)
    monkeypatch.delenv("EPILORA_PREFILL_PATH", raising=False)
    c = d.describe(x, None, (128,), 16, [None], [None], meta)
    assert not asked and c.prefill_reason.startswith("not a candidate")
    monkeypatch.setenv("EPILORA_PREFILL_PATH", "1")
    c = d.describe(x, None, (128,), 16, [None], [None], meta)
    assert len(asked) == 1 and c.prefill_reason is None and c.tokens == 64


def test_batches_without_adapters_take_vllms_path(tmp_path, monkeypatch, caplog):
    """No token has an adapter (host count 0): "base" only, untimed, unless the policy is "timed";
    with adapters (or an unknown count) "base" is never a candidate: it would drop them."""
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED)
    timer = FakeTimer(graph={"base": 9.0, "decode": 10.0, "hybrid": 30.0, "triton": 20.0, "no_adapter": 5.0},
                      eager={"base": 30.0, "decode": 40.0, "hybrid": 60.0, "triton": 35.0, "no_adapter": 50.0})
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    assert d.candidates_for(call(host_adapters=0)) == ("base",)
    with caplog.at_level(logging.INFO, logger="epilora_cute.dispatch"):
        for mode, capturing in (("graph", True), ("eager", False), ("graph", False)):
            assert disp.path_for(call(host_adapters=0), run, mode=mode, capturing=capturing) == "base"
    assert timer.calls == []
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)  # not a capture default
    for host in (None, 1, 5):
        assert "base" not in d.candidates_for(call(host_adapters=host))
    monkeypatch.setenv(d.NO_LORA_ENV, "timed")
    assert d.candidates_for(call(host_adapters=0)) == ("base", "decode", "no_adapter", "hybrid", "triton")
    assert disp.path_for(call(host_adapters=0, tokens=24), run, mode="graph", capturing=False) == "no_adapter"
    assert {p for p, _ in timer.calls} == {"base", "decode", "no_adapter", "hybrid", "triton"}
    monkeypatch.setenv(d.NO_LORA_ENV, "fastest")
    with pytest.raises(ValueError, match="EPILORA_NO_LORA_PATH"):
        d.candidates_for(call(host_adapters=0))
    # With "base" not allowed (taken out of the verified set), the other paths compete as before.
    monkeypatch.delenv(d.NO_LORA_ENV)
    monkeypatch.setattr(d, "VERIFIED_PATHS", SHIPPED_VERIFIED - {"base"})
    assert d.candidates_for(call(host_adapters=0)) == ("decode", "no_adapter", "hybrid", "triton")


def test_keys_bucket_tokens_and_adapters():
    assert d.key_for(call(tokens=7, host_adapters=3), "graph").text() == \
        "H200|K=4096|N=4096+1024+1024|r=64|M<=8|A=2-4|graph"
    assert d.key_for(call(tokens=33, host_adapters=0), "eager").text().endswith("M<=64|A=0|eager")
    # Unknown on the host: bucketed by max_loras (an upper bound), and said so in the key.
    assert d.key_for(call(host_adapters=None, max_loras=8), "graph").adapters == "<=5-8"
    assert d.key_for(call(host_adapters=None, max_loras=64), "graph").adapters == "<=33-inf"


def test_host_adapter_count_from_a_host_mapping():
    assert build_meta(torch.tensor([2, -1, 0, 2, 0], dtype=torch.int32), 4).host_num_adapters == 2
    assert build_meta(torch.tensor([-1, -1], dtype=torch.int32), 4).host_num_adapters == 0
    # Out-of-range slots are "no adapter" in the metadata, so they are not counted either.
    assert build_meta(torch.tensor([7, 1, -5], dtype=torch.int32), 4).host_num_adapters == 1
    from epilora_cute.metadata import LoRABatchMeta
    assert LoRABatchMeta.make(4, 16).host_num_adapters is None


def test_one_timing_per_key_both_modes_then_lookups(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    timer = FakeTimer()
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    with caplog.at_level(logging.INFO, logger="epilora_cute.dispatch"):
        assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"
    # Both modes of the bucket were timed at this first call outside capture, every candidate once.
    assert sorted(timer.calls) == sorted((p, m) for p in ("decode", "hybrid", "triton") for m in d.MODES)
    assert any("-> triton (µs: triton 35.0, decode 40.0, hybrid 60.0)" in r.getMessage() for r in caplog.records)
    assert any("|graph -> decode" in r.getMessage() for r in caplog.records)
    n = len(timer.calls)
    for tokens in (10, 13, 16):  # same bucket
        assert disp.path_for(call(tokens=tokens), run, mode="eager", capturing=False) == "triton"
        assert disp.path_for(call(tokens=tokens), run, mode="graph", capturing=True) == "decode"
    assert len(timer.calls) == n
    disp.path_for(call(tokens=17), run, mode="graph", capturing=False)  # a new bucket: timed
    assert len(timer.calls) == 2 * n


def test_table_is_reused_by_a_new_dispatcher(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    t1 = FakeTimer()
    d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), t1).path_for(call(), run, mode="eager", capturing=False)
    t2 = FakeTimer()
    disp2 = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), t2)  # the next start
    with caplog.at_level(logging.INFO, logger="epilora_cute.dispatch"):
        assert disp2.path_for(call(), run, mode="graph", capturing=True) == "triton"
        assert disp2.path_for(call(), run, mode="eager", capturing=False) == "triton"
    assert t2.calls == []
    assert any("(from " in r.getMessage() for r in caplog.records)
    # Opting a path in later: the remembered decision did not time it, so the key is timed again.
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    disp3 = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), t2)
    assert disp3.path_for(call(), run, mode="graph", capturing=False) == "decode"
    assert {p for p, _ in t2.calls} == {"decode", "hybrid", "triton"}


def test_force_env(tmp_path, monkeypatch):
    timer = FakeTimer()
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    monkeypatch.setenv(d.FORCE_ENV, "decode")  # applicable; forcing needs no opt-in
    assert disp.path_for(call(), run, mode="graph", capturing=True) == "decode"
    monkeypatch.setenv(d.FORCE_ENV, "reference")
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "reference"
    monkeypatch.setenv(d.FORCE_ENV, "no_adapter")  # adapters unknown: it would drop them
    with pytest.raises(ValueError, match="EPILORA_FORCE_PATH=no_adapter"):
        disp.path_for(call(), run, mode="eager", capturing=False)
    assert timer.calls == []


def test_capture_takes_a_logged_default_and_times_later(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    timer = FakeTimer(graph={"hybrid": 1.0, "triton": 2.0})
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    with caplog.at_level(logging.INFO, logger="epilora_cute.dispatch"):
        assert disp.path_for(call(), run, mode="graph", capturing=True) == "triton"
        assert disp.path_for(call(), run, mode="graph", capturing=True) == "triton"
    assert timer.calls == []
    warn = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "not timed during CUDA-graph capture" in warn[0].getMessage()
    assert not (tmp_path / "t.json").exists()  # a default is not a measurement
    # The next call outside capture times the bucket; later captures get the measured path.
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"
    assert len(timer.calls) == 4
    assert disp.path_for(call(), run, mode="graph", capturing=True) == "hybrid"
    # With the decode path opted in, the capture default is the decode path (what "auto" took).
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    assert d.Dispatcher(d.DispatchTable(tmp_path / "u.json"), timer).path_for(
        call(), run, mode="graph", capturing=True) == "decode"
    assert d.default_path(("hybrid", "triton")) == "triton"


def test_failures_are_dropped_recorded_and_printed(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    timer = FakeTimer(graph={"hybrid": RuntimeError("cannot capture"), "triton": 2.0},
                      eager={"hybrid": 1.0, "triton": 2.0})
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    assert disp.path_for(call(), run, mode="graph", capturing=False) == "triton"
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "hybrid"
    saved = json.loads((tmp_path / "t.json").read_text())
    graph_key = d.key_for(call(), "graph").text()
    assert saved[graph_key]["failed"] == {"hybrid": "RuntimeError: cannot capture"}
    # The failure counts as covered: a new start reuses the decision without timing again.
    t2 = FakeTimer()
    assert d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), t2).path_for(
        call(), run, mode="graph", capturing=True) == "triton" and t2.calls == []
    d.main(["--path", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert "-> triton" in out and "failed: hybrid" in out and "-> hybrid" in out
    # Every candidate failing: the default, with a warning, and still only one timing per key.
    bad = FakeTimer(graph={"hybrid": RuntimeError("x"), "triton": RuntimeError("y")},
                    eager={"hybrid": RuntimeError("x"), "triton": RuntimeError("y")})
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "v.json"), bad)
    with caplog.at_level(logging.WARNING, logger="epilora_cute.dispatch"):
        assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"
        assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"
    assert len(bad.calls) == 4
    assert any("every candidate path failed" in r.getMessage() for r in caplog.records)


def test_single_candidate_is_not_timed(tmp_path):
    timer = FakeTimer()
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)  # no opt-in: triton only
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"
    assert timer.calls == [] and not (tmp_path / "t.json").exists()


def test_a_decision_that_does_not_apply_to_this_call(tmp_path, monkeypatch):
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    timer = FakeTimer()
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    assert disp.path_for(call(), run, mode="graph", capturing=False) == "decode"
    # Same key, but these inputs rule the decode path out (say, a misaligned x): the default.
    assert disp.path_for(call(decode_reason="buffers must be 16-byte aligned"), run, mode="graph",
                         capturing=True) == "triton"


def test_call_mode():
    assert d.current_mode(False) == "eager" and d.current_mode(True) == "graph"
    with d.call_mode("graph"):
        assert d.current_mode(False) == "graph"
    assert d.current_mode(False) == "eager"
    with pytest.raises(ValueError):
        with d.call_mode("replay"):
            pass


def test_decisions_of_other_code_are_not_reused(tmp_path, capsys):
    """An entry timed with another fingerprint (other kernels, DSL / vLLM version or switches) or
    written before fingerprints existed is neither reused nor listed as a decision: the key is
    timed again, and the new decision is stored beside the stale one."""
    path = tmp_path / "t.json"
    old = d.DispatchTable(path, fingerprint="aaaa")
    old.record(key(), {"decode": 1.0, "hybrid": 2.0})
    raw = json.loads(path.read_text())
    raw[key(tokens=2).text()] = {"path": "decode", "times_us": {"decode": 1.0, "hybrid": 2.0}}  # pre-fingerprint
    path.write_text(json.dumps(raw))

    new = d.DispatchTable(path, fingerprint="bbbb")
    assert new.get(key()) is None and new.get(key(tokens=2)) is None and new.entries() == {}
    assert set(new.stale_entries()) == {key().text(), key(tokens=2).text()}
    calls = []
    timer = lambda fn, mode: calls.append(fn()) or {"decode": 5.0, "hybrid": 3.0}[fn()]
    cands = {"decode": lambda: "decode", "hybrid": lambda: "hybrid"}
    assert d.choose(new, key(), cands, timer) == "hybrid" and len(calls) == 2  # timed again
    assert d.DispatchTable(path, fingerprint="bbbb").get(key()) == "hybrid"
    assert d.DispatchTable(path, fingerprint="aaaa").get(key()) is None  # one entry per key: the latest
    d.main(["--path", str(path)])
    assert "not used" in capsys.readouterr().out


def _fingerprint_with(monkeypatch, **env) -> str:
    from epilora_cute import ops

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    d.code_fingerprint.cache_clear()
    ops.hybrid_h_dtype.cache_clear()
    ops.set_stream_priority(None)  # read once per process: read again
    ops.base_quant.cache_clear()
    try:
        return d.code_fingerprint()
    finally:
        d.code_fingerprint.cache_clear()
        ops.hybrid_h_dtype.cache_clear()
        ops.set_stream_priority(None)
        ops.base_quant.cache_clear()


def test_code_fingerprint_follows_the_switches(monkeypatch):
    """The switches that change what a path launches are part of the fingerprint."""
    a = _fingerprint_with(monkeypatch, EPILORA_HYBRID_H="fp32")
    assert len(a) == 16 and a == _fingerprint_with(monkeypatch, EPILORA_HYBRID_H="fp32")
    assert _fingerprint_with(monkeypatch, EPILORA_HYBRID_H="bf16") != a
    assert _fingerprint_with(monkeypatch, EPILORA_HYBRID_H="fp32", EPILORA_K2_PUSH="none") != a
    monkeypatch.delenv("EPILORA_K2_PUSH")
    assert _fingerprint_with(monkeypatch, EPILORA_STREAM_PRIORITY="1") != a
    monkeypatch.delenv("EPILORA_STREAM_PRIORITY")
    assert _fingerprint_with(monkeypatch, EPILORA_BASE_QUANT="vllm") != a
    monkeypatch.delenv("EPILORA_BASE_QUANT")
    assert _fingerprint_with(monkeypatch) == a


def test_code_fingerprint_hashes_the_effective_settings(monkeypatch):
    """Spellings the parsers read alike share stored decisions; a value a parser rejects still
    gives a fingerprint (its raw text), so the dispatch never fails before the op's own error."""
    base = _fingerprint_with(monkeypatch, EPILORA_HYBRID_H="bf16", EPILORA_K2_PUSH="maxima,partials",
                             EPILORA_K2_SQ_WIDE="1")
    assert _fingerprint_with(monkeypatch, EPILORA_HYBRID_H=" BF16 ", EPILORA_K2_PUSH="partials, maxima",
                             EPILORA_K2_SQ_WIDE="on") == base
    monkeypatch.delenv("EPILORA_HYBRID_H")
    default = _fingerprint_with(monkeypatch)
    assert _fingerprint_with(monkeypatch, EPILORA_HYBRID_H=ops.HYBRID_H_DEFAULT) == default  # spelled out
    bad = _fingerprint_with(monkeypatch, EPILORA_K2_PUSH="bogus")
    assert len(bad) == 16 and bad != default
    assert d.effective_switches()["EPILORA_K2_PUSH"] == "raw:bogus"


def test_concurrent_writers_merge(tmp_path):
    a, b = d.DispatchTable(tmp_path / "t.json"), d.DispatchTable(tmp_path / "t.json")
    a.record(key(tokens=1), {"x": 1.0, "y": 2.0})
    b.record(key(tokens=2), {"x": 2.0, "y": 1.0})  # b never read a's entry, and must not drop it
    t = d.DispatchTable(tmp_path / "t.json")
    assert t.get(key(tokens=1)) == "x" and t.get(key(tokens=2)) == "y"


def _linear_case(m=5, k=64, widths=(32, 16, 16), rank=8, loras=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    wq, ws = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g))
    a = [torch.randn(loras, 1, rank, k, generator=g).bfloat16() for _ in widths]
    b = [torch.randn(loras, 1, n, rank, generator=g).bfloat16() for n in widths]
    mapping = torch.tensor([0, -1, 2, 0, 1][:m], dtype=torch.int32)
    return x, wq, ws, a, b, build_meta(mapping, loras), mapping


def test_auto_on_cpu_is_the_reference_and_never_dispatches():
    class Refuse:
        def path_for(self, *a, **kw):
            raise AssertionError("the dispatcher must not be asked off CUDA")
    d.set_dispatcher(Refuse())
    x, wq, ws, a, b, meta, mapping = _linear_case()
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="auto")
    assert torch.equal(y, reference.lora_linear(x, wq, ws, a, b, mapping).bfloat16())


def test_auto_through_the_op_times_into_scratch(tmp_path, monkeypatch):
    """ops.lora_linear_fp8(path="auto") as on an sm_90a GPU (device facts faked): the candidates
    run through the op into a scratch output; the final call writes ``out``."""
    import vllm_adapter.triton_path as tp

    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")  # on the CPU the hybrid path raises: dropped
    x, wq, ws, a, b, meta, mapping = _linear_case()
    seen = []

    def fake_triton(x_, wq_, ws_, a_, b_, meta_, out):
        seen.append(out)
        return out.copy_(reference.lora_linear(x_, wq_, ws_, a_, b_, meta_.token_lora_mapping[:x_.shape[0]]))
    monkeypatch.setattr(tp, "triton_lora_linear", fake_triton)
    monkeypatch.setattr(d, "describe", lambda x_, w_, widths, rank, a_, b_, meta_: call(
        k=x_.shape[1], slices=tuple(widths), rank=rank, tokens=x_.shape[0], max_loras=meta_.max_loras,
        host_adapters=meta_.host_num_adapters, decode_reason="fake: no decode kernels"))
    calls = []

    def fake_timer(fn, mode):
        calls.append(mode)
        fn()
        return 1.0
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), fake_timer)
    d.set_dispatcher(disp)
    out = torch.full((5, 64), float("nan"), dtype=torch.bfloat16)
    with d.call_mode("graph"):
        y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="auto")
    assert y is out and torch.equal(out, reference.lora_linear(x, wq, ws, a, b, mapping).bfloat16())
    assert sorted(calls) == ["eager", "eager", "graph", "graph"]  # hybrid and triton, both modes
    assert len(seen) == 3 and seen[-1] is out and all(s is not out for s in seen[:-1])  # timed runs: scratch
    entries = json.loads((tmp_path / "t.json").read_text())
    key_text = "H200|K=64|N=32+16+16|r=8|M<=8|A=2-4|graph"  # 3 adapters, counted on the host
    assert entries[key_text]["path"] == "triton" and "hybrid" in entries[key_text]["failed"]
    ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="auto")  # decided: no more timing
    assert len(calls) == 4


def test_a_capture_default_is_timed_by_the_next_eager_call_of_its_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "1")
    timer = FakeTimer(graph={"hybrid": 1.0, "triton": 2.0})
    disp = d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer)
    # An eager-mode call under capture (say, declared with call_mode("eager")): a default too.
    assert disp.path_for(call(), run, mode="eager", capturing=True) == "triton"
    assert disp.path_for(call(), run, mode="graph", capturing=True) == "triton"
    assert timer.calls == []
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton"  # times both modes
    assert len(timer.calls) == 4
    assert disp.path_for(call(), run, mode="graph", capturing=True) == "hybrid"
    assert disp.path_for(call(), run, mode="eager", capturing=False) == "triton" and len(timer.calls) == 4


def test_the_runtime_timer_is_its_own():
    import inspect

    from epilora_cute import timing
    for mod in (d, timing):
        src = inspect.getsource(mod)
        assert "from tools" not in src and "import tools" not in src
    with pytest.raises(ValueError, match="mode"):
        timing.cuda_timer(lambda: None, "bogus")


def test_l2_flush_mode(monkeypatch):
    """The timers empty the L2 by reading (no dirty lines left to write back during the timed
    run) unless EPILORA_L2_FLUSH=write asks for the pre-session-6 method; anything else is refused."""
    from epilora_cute import timing

    monkeypatch.delenv(timing.FLUSH_ENV, raising=False)
    assert timing.flush_mode() == "read"
    monkeypatch.setenv(timing.FLUSH_ENV, "write")
    assert timing.flush_mode() == "write"
    monkeypatch.setenv(timing.FLUSH_ENV, "zero")
    with pytest.raises(ValueError, match="EPILORA_L2_FLUSH"):
        timing.flush_mode()


@pytest.fixture
def settled_case(tmp_path, monkeypatch):
    """auto_path as on a GPU (device facts faked on CPU tensors), counting the descriptions: a
    call that finds its settled answer is not described. Returns (auto, described, x, meta)."""
    from epilora_cute import bucket_warmup

    monkeypatch.setattr(bucket_warmup, "enabled", lambda: False)
    monkeypatch.setattr(ops, "_on_gpu", lambda t: True)
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton", "base", "hybrid"}))
    monkeypatch.setattr(d, "capturing", lambda: False)
    for env in ("EPILORA_FORCE_PATH", "EPILORA_NO_LORA_PATH", "EPILORA_HYBRID_PATH"):
        monkeypatch.delenv(env, raising=False)
    x, wq, ws, a, b, meta, _ = _linear_case()
    described = []

    def fake_describe(x_, w_, widths, rank, a_, b_, meta_):
        described.append((x_.shape[0], meta_.host_num_adapters))
        return call(k=x_.shape[1], slices=tuple(widths), rank=rank, tokens=x_.shape[0], max_loras=meta_.max_loras,
                    host_adapters=meta_.host_num_adapters, decode_reason="fake: no decode kernels")
    monkeypatch.setattr(d, "describe", fake_describe)
    a_, b_, widths, rank = ops._validate_linear(x, wq, ws, a, b, meta, None)
    monkeypatch.setattr(ops, "lora_linear_fp8", lambda *args, **kw: None)  # the timed candidate runs
    us = {"graph": {"hybrid": 1.0, "triton": 2.0}, "eager": {"hybrid": 2.0, "triton": 1.0}}

    def timer(fn, mode):  # fn: functools.partial(run, path)
        return us[mode].get(fn.args[0], 3.0)
    d.set_dispatcher(d.Dispatcher(d.DispatchTable(tmp_path / "t.json"), timer))

    def auto(x_, meta_, mode="eager"):
        out = torch.empty(x_.shape[0], sum(widths), dtype=torch.bfloat16)
        with d.call_mode(mode):
            return d.auto_path(x_, wq, ws, a_, b_, meta_, widths=widths, rank=rank, out=out)
    yield auto, described, x, meta
    d.set_dispatcher(None)


def test_settled_answers_skip_the_description(settled_case, monkeypatch):
    """Once a call's decision is final, the next calls with the same signature (device, exact
    token count, shape, adapter knowledge, mode, layout, switches) skip the description and the
    decision (host time per eager call); anything in the signature that changes is described."""
    auto, described, x, meta = settled_case
    meta.host_num_adapters = 0  # vLLM's path, the only candidate
    assert [auto(x, meta) for _ in range(3)] == ["base"] * 3 and described == [(5, 0)]
    assert auto(x[:3], meta) == "base" and described[-1] == (3, 0)  # another token count
    # The exact count, not its bucket (8 here): which kernels apply changes inside buckets
    # (the prefill K2's 16384 tokens lie in the top bucket).
    assert auto(torch.cat([x, x[:2]]), meta) == "base" and described[-1] == (7, 0)
    assert auto(x, meta, "graph") == "base" and len(described) == 4  # another mode
    monkeypatch.setenv("EPILORA_FORCE_PATH", "triton")  # a path forced later wins at once
    assert [auto(x, meta) for _ in range(2)] == ["triton"] * 2 and len(described) == 5
    monkeypatch.delenv("EPILORA_FORCE_PATH")
    assert auto(x, meta) == "base" and len(described) == 5  # back to the first signature
    monkeypatch.setenv("EPILORA_NO_LORA_PATH", "timed")
    auto(x, meta)
    assert len(described) == 6
    monkeypatch.delenv("EPILORA_NO_LORA_PATH")
    meta.host_num_adapters = None  # may have adapters: timed once, then settled
    assert auto(x, meta) == "triton" and auto(x, meta) == "triton" and len(described) == 7
    assert auto(x, meta, "graph") == "hybrid" and auto(x, meta, "graph") == "hybrid" and len(described) == 8
    xt = x.t().contiguous().t()  # same shape, not the layout the CuTe kernels take
    auto(xt, meta)
    assert len(described) == 9
    monkeypatch.setenv("EPILORA_HYBRID_PATH", "0")  # an opt-out set later
    assert auto(x, meta, "graph") == "triton" and len(described) == 10
    monkeypatch.delenv("EPILORA_HYBRID_PATH")
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton", "base"}))  # the allowed set
    assert auto(x, meta, "graph") == "triton" and len(described) == 11
    assert d.base_is_the_no_adapter_path()
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton"}))  # "base" not allowed: no shortcut
    assert not d.base_is_the_no_adapter_path()


def test_capture_defaults_are_not_settled_answers(settled_case, monkeypatch, tmp_path):
    """A default taken under capture (not timed) is no final answer: each call under capture
    is described, and the next call outside capture times the bucket, then settles it."""
    auto, described, x, meta = settled_case
    monkeypatch.setattr(d, "capturing", lambda: True)
    assert auto(x, meta, "graph") == "triton" and auto(x, meta, "graph") == "triton"  # default order
    assert len(described) == 2
    meta.host_num_adapters = 0  # one candidate: final even under capture, still not remembered there
    assert auto(x, meta, "graph") == "base" and auto(x, meta, "graph") == "base" and len(described) == 4
    meta.host_num_adapters = None
    described.clear()
    monkeypatch.setattr(d, "capturing", lambda: False)
    assert auto(x, meta, "graph") == "hybrid" and len(described) == 1  # timed now
    assert auto(x, meta, "graph") == "hybrid" and auto(x, meta) == "triton" and len(described) == 2
    d.set_dispatcher(d.Dispatcher(d.DispatchTable(tmp_path / "t2.json"), lambda fn, mode: 1.0))  # no memo
    auto(x, meta, "graph")
    assert len(described) == 3


def test_base_linear_refuses_what_the_vendor_gemm_cannot_take():
    x, wq, ws, *_ = _linear_case()
    with pytest.raises(ValueError, match="CUDA GPU"):
        ops.base_linear_fp8(x, wq, ws)  # CPU tensors
    with pytest.raises(ValueError, match=r"w_q must be \[N, 64\]"):
        ops.base_linear_fp8(x, wq[:, :32], ws)
    with pytest.raises(ValueError, match="w_q must be"):
        ops.base_linear_fp8(x, wq.float(), ws)
    with pytest.raises((TypeError, ValueError), match="bfloat16"):
        ops.base_linear_fp8(x.float(), wq, ws)


def test_base_shortcut_reads_the_switches_now(monkeypatch):
    """base_is_the_no_adapter_path (asked by every eager no-adapter call, read through
    epilora_cute.environ) follows EPILORA_FORCE_PATH and EPILORA_NO_LORA_PATH as they are set now."""
    monkeypatch.setattr(d, "VERIFIED_PATHS", frozenset({"triton", "base"}))
    monkeypatch.delenv(d.FORCE_ENV, raising=False)
    monkeypatch.delenv(d.NO_LORA_ENV, raising=False)
    assert d.base_is_the_no_adapter_path()
    monkeypatch.setenv(d.NO_LORA_ENV, "base")
    assert d.base_is_the_no_adapter_path()
    monkeypatch.setenv(d.NO_LORA_ENV, "timed")
    assert not d.base_is_the_no_adapter_path()
    monkeypatch.setenv(d.NO_LORA_ENV, "bogus")
    with pytest.raises(ValueError, match="EPILORA_NO_LORA_PATH"):
        d.base_is_the_no_adapter_path()
    monkeypatch.setenv(d.NO_LORA_ENV, "")
    assert d.base_is_the_no_adapter_path()
    monkeypatch.setenv(d.FORCE_ENV, "hybrid")
    assert not d.base_is_the_no_adapter_path()


def test_environ_reads_what_os_environ_holds(monkeypatch):
    from epilora_cute import environ

    ks = environ.keys(("EPILORA_TEST_A", "EPILORA_TEST_B"))
    monkeypatch.delenv("EPILORA_TEST_A", raising=False)
    monkeypatch.setenv("EPILORA_TEST_B", "x=ü")
    a, b = environ.values(ks)
    assert a is None and environ.text(a) is None and environ.text(b) == "x=ü"
    monkeypatch.setenv("EPILORA_TEST_A", "")
    assert environ.text(environ.values(ks)[0]) == ""
