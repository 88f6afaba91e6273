"""Public ops on the CPU: reference fallback and clear errors for bad input."""

import dataclasses

import pytest
import torch

from epilora_cute import ops, reference


def test_cpu_quant_equals_reference():
    x = torch.randn(5, 64).bfloat16()
    c, s = ops.quantize_fp8_per_token(x)
    rc, rs = reference.quantize_fp8_per_token(x)
    assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(s, rs)


def test_quant_writes_into_given_buffers():
    x = torch.randn(3, 16).bfloat16()
    c = torch.empty(3, 16, dtype=torch.float8_e4m3fn)
    s = torch.full((3, 1), float("nan"))
    c2, s2 = ops.quantize_fp8_per_token(x, c, s)
    assert c2 is c and s2 is s and not torch.isnan(s).any()


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: torch.randn(4, 8), TypeError, "bfloat16"),
    (lambda: torch.randn(4, 8).half(), TypeError, "bfloat16"),
    (lambda: torch.randn(2, 4, 8).bfloat16(), ValueError, "2-D"),
    (lambda: [[1.0]], TypeError, "torch.Tensor"),
])
def test_quant_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        ops.quantize_fp8_per_token(bad())


def test_quant_bad_output_buffers():
    x = torch.randn(3, 16).bfloat16()
    with pytest.raises(ValueError, match="codes must be"):
        ops.quantize_fp8_per_token(x, torch.empty(3, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="float32"):
        ops.quantize_fp8_per_token(x, None, torch.empty(3, 1, dtype=torch.float16))


def _linear_case(m=5, k=64, widths=(32, 16, 16), rank=8, loras=3, seed=0, mapping_all=None):
    from epilora_cute.metadata import build_meta

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    wq, ws = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g))
    a = [torch.randn(loras, 1, rank, k, generator=g).bfloat16() for _ in widths]
    b = [torch.randn(loras, 1, n, rank, generator=g).bfloat16() for n in widths]
    mapping = torch.randint(-1, loras, (m,), generator=g, dtype=torch.int32)
    if mapping_all is not None:
        mapping.fill_(mapping_all)
    return x, wq, ws, a, b, build_meta(mapping, loras), mapping


def test_lora_linear_cpu_is_the_reference():
    x, wq, ws, a, b, meta, mapping = _linear_case()
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, reference.lora_linear(x, wq, ws, a, b, mapping).bfloat16())


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda c: c.update(x=c["x"].float()), TypeError, "bfloat16"),
    (lambda c: c.update(wq=c["wq"].float()), TypeError, "float8"),
    (lambda c: c.update(ws=torch.ones(2)), TypeError, "one-element"),
    (lambda c: c.update(b=c["b"][:2]), ValueError, "A slices"),
    (lambda c: c.update(b=[c["b"][0][:, :, :16]] + c["b"][1:]), ValueError, "add up"),
    (lambda c: c.update(a=[c["a"][0][:, :, :4]] + c["a"][1:]), ValueError, "ranks disagree"),
    (lambda c: c.update(a=[t.float() for t in c["a"]]), TypeError, "bfloat16"),
    (lambda c: c.update(x=c["x"][:3]), ValueError, "metadata prepared"),
    (lambda c: c.update(out=torch.empty(5, 7, dtype=torch.bfloat16)), ValueError, "out must be"),
    (lambda c: c.update(path="fastest"), ValueError, "path must be"),
    (lambda c: c.update(path="decode"), ValueError, "does not apply"),
])
@pytest.mark.parametrize("warm", [False, True])
def test_lora_linear_bad_input(mutate, exc, match, warm):
    """warm: the good buffers were used first, so their facts are memoized (_layer_facts): a bad
    buffer or activation given next must still be caught."""
    x, wq, ws, a, b, meta, _ = _linear_case()
    if warm:
        ops.lora_linear_fp8(x, wq, ws, a, b, meta)
    c = dict(x=x, wq=wq, ws=ws, a=a, b=b, out=None, path="auto")
    mutate(c)
    with pytest.raises(exc, match=match):
        ops.lora_linear_fp8(c["x"], c["wq"], c["ws"], c["a"], c["b"], meta, out=c["out"], path=c["path"])


def test_plugin_hooks():
    assert ops.supports_device(torch.device("cpu")) is False
    assert ops.lora_linear_fp8_unsupported(6144, 4096, 64, 3) is None
    assert "rank" in ops.lora_linear_fp8_unsupported(6144, 4096, 1024, 3)
    assert "multiple of 8" in ops.lora_linear_fp8_unsupported(6144, 4100, 64, 3)


@pytest.mark.parametrize("path", ["hybrid", "hybrid_par", "hybrid_par_q", "hybrid_st", "hybrid_par_st"])
def test_hybrid_paths_need_a_gpu(path):
    x, wq, ws, a, b, meta, _ = _linear_case()
    with pytest.raises(ValueError, match=f"path='{path}' does not apply"):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path)


@pytest.mark.parametrize("host_adapters", [0, None, 2])
def test_hybrid_path_without_adapters_is_quantization_plus_the_vendor_gemm(monkeypatch, host_adapters):
    """With vLLM's no-LoRA flag (host_num_adapters 0) the hybrid path is exactly vLLM's FP8 path:
    no K1, no expand-add. Otherwise (unknown or adapters present) the three kernels run."""
    from kernels_dsl import expand_add, k1_shrink

    x, wq, ws, a, b, meta, _ = _linear_case(mapping_all=-1)
    meta.host_num_adapters = host_adapters
    calls = []
    monkeypatch.setattr(ops, "arch_of", lambda t: "sm_90a")
    monkeypatch.setattr(ops, "vendor_fp8_gemm", lambda codes, scales, w_q, w_scale, out=None:
                        calls.append("gemm") or out.copy_(reference.fp8_scaled_mm(codes, scales, w_q, w_scale)))
    monkeypatch.setattr(k1_shrink, "k1_quant_shrink", lambda x, a, meta, slot_ranks=None, h_dtype=None:
                        calls.append("k1") or (*reference.quantize_fp8_per_token(x), None))
    monkeypatch.setattr(expand_add, "expand_add", lambda out, h, b, meta, slot_ranks=None: calls.append("expand") or out)
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="hybrid")
    assert calls == (["gemm"] if host_adapters == 0 else ["k1", "gemm", "expand"])
    codes, scales = reference.quantize_fp8_per_token(x)
    assert torch.equal(y, reference.fp8_scaled_mm(codes, scales, wq, ws).bfloat16())


@pytest.fixture(autouse=True)
def _fresh_hybrid_h_reading():
    """ops.hybrid_h_dtype reads EPILORA_HYBRID_H once per process: each test starts and ends
    with that reading cleared, so a test's environment never leaks into another's."""
    ops.hybrid_h_dtype.cache_clear()
    yield
    ops.hybrid_h_dtype.cache_clear()


@pytest.mark.parametrize("env,want", [(None, ops.HYBRID_H_DEFAULT), ("bf16", "bf16"), ("fp32", "fp32"),
                                      (" BF16 ", "bf16"), ("half", ops.HYBRID_H_DEFAULT)])
def test_hybrid_h_dtype_from_the_environment(monkeypatch, env, want):
    """EPILORA_HYBRID_H picks h's dtype between K1 and the expand-add; an unknown value falls back
    to the default (a warning, not an error inside a serving engine)."""
    if env is None:
        monkeypatch.delenv(ops.HYBRID_H_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.HYBRID_H_ENV, env)
    assert ops.hybrid_h_dtype() == {"fp32": torch.float32, "bf16": torch.bfloat16}[want]
    monkeypatch.setenv(ops.HYBRID_H_ENV, "fp32" if want == "bf16" else "bf16")
    assert ops.hybrid_h_dtype() == {"fp32": torch.float32, "bf16": torch.bfloat16}[want]  # read once


@pytest.mark.parametrize("path", ["hybrid", "hybrid_par"])
@pytest.mark.parametrize("env", ["fp32", "bf16"])
def test_hybrid_paths_hand_h_of_the_chosen_dtype_to_the_expand_add(monkeypatch, path, env):
    """Both hybrid forms give K1 and the expand-add one h of EPILORA_HYBRID_H's dtype."""
    import contextlib

    from kernels_dsl import expand_add, k1_shrink

    monkeypatch.setenv(ops.HYBRID_H_ENV, env)  # read fresh: the autouse fixture cleared the reading
    seen = {}

    def fake_k1(x, a, meta, codes=None, scales=None, h=None, slot_ranks=None, h_dtype=torch.float32):
        if h is None:
            h = torch.empty(len(a), x.shape[0], a[0].shape[-2], dtype=h_dtype)
        seen["k1"] = h
        return (*reference.quantize_fp8_per_token(x), h)

    def fake_expand(out, h, b, meta, slot_ranks=None):
        seen["expand"] = h
        return out

    monkeypatch.setattr(ops, "quantize_fp8_per_token", lambda x, *bufs: reference.quantize_fp8_per_token(x))
    monkeypatch.setattr(ops, "vendor_fp8_gemm", lambda codes, scales, w_q, w_scale, out=None: out)
    monkeypatch.setattr(ops, "_side_stream", lambda dev: torch.cuda.current_stream(dev))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: type("S", (), {
        "wait_stream": lambda self, o: None, "wait_event": lambda self, e: None})())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(k1_shrink, "k1_quant_shrink", fake_k1)
    monkeypatch.setattr(expand_add, "expand_add", fake_expand)
    x, wq, ws, a, b, meta, _ = _linear_case()
    out = torch.empty(x.shape[0], wq.shape[0], dtype=torch.bfloat16)
    if path == "hybrid":
        ops._hybrid_path(x, wq, ws, a, b, meta, out, None)
    else:
        ops._hybrid_par_path(x, wq, ws, a, b, meta, out, None)
    assert seen["k1"] is seen["expand"]
    assert seen["k1"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[env]


def _fake_streams(monkeypatch, log: list) -> list:
    """Fake CUDA streams and events that record what each stream was asked to do, in order, as
    (stream, action[, at]) entries of ``log``; returns the stack whose top is the current stream.
    The quantization and the vendor GEMM are faked to log themselves too."""
    import contextlib

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append((self.name, "wait", ev.at))

        def wait_stream(self, other):
            log.append((self.name, "wait", f"{other.name}@now"))

    class FakeEvent:
        def record(self, stream):
            self.at = f"{stream.name}@{sum(1 for e in log if e[0] == stream.name)}"
            log.append((stream.name, "record", self.at))

    main, side, crit = FakeStream("main"), FakeStream("side"), FakeStream("crit")
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(ops, "_side_stream", lambda dev: side)
    monkeypatch.setattr(ops, "_critical_streams", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", type("FakeStreamType", (), {
        "__new__": lambda cls, dev, priority=0: crit if priority <= -5 else pytest.fail("not the highest priority")}))
    monkeypatch.setattr(ops, "quantize_fp8_per_token", lambda x, *bufs: log.append((current[-1].name, "quant")) or
                        reference.quantize_fp8_per_token(x))
    monkeypatch.setattr(ops, "vendor_fp8_gemm", lambda codes, scales, w_q, w_scale, out=None:
                        log.append((current[-1].name, "gemm")) or out)
    return current


@pytest.fixture
def priority(monkeypatch, request):
    """EPILORA_STREAM_PRIORITY for one test (the setting is read once per process)."""
    monkeypatch.setenv(ops.STREAM_PRIORITY_ENV, request.param)
    ops.set_stream_priority(None)
    yield request.param == "1"
    monkeypatch.delenv(ops.STREAM_PRIORITY_ENV)
    ops.set_stream_priority(None)


def _hybrid_par_log(monkeypatch, quant_first: bool) -> list:
    """What each fake stream was asked to do by one hybrid_par (hybrid_par_q) call, K1 and the
    expand-add logging themselves (``_fake_streams``)."""
    from kernels_dsl import expand_add, k1_shrink

    log = []
    current = _fake_streams(monkeypatch, log)
    monkeypatch.setattr(k1_shrink, "k1_quant_shrink", lambda x, a, meta, codes, scales, h, slot_ranks=None:
                        log.append((current[-1].name, "k1")))
    monkeypatch.setattr(expand_add, "expand_add", lambda out, h, b, meta, slot_ranks=None:
                        log.append((current[-1].name, "expand")) or out)
    x, wq, ws, a, b, meta, _ = _linear_case()
    out = torch.empty(x.shape[0], wq.shape[0], dtype=torch.bfloat16)
    ops._hybrid_par_path(x, wq, ws, a, b, meta, out, None, quant_first=quant_first)
    return log


@pytest.mark.parametrize("priority", ["0"], indirect=True)
@pytest.mark.parametrize("quant_first", [False, True])
def test_hybrid_par_launch_order(monkeypatch, quant_first, priority):
    """hybrid_par: the side branch (K1) forks from the caller's stream before the quantization;
    hybrid_par_q (v0.58): after it, K1 issued after the GEMM; expand-add waits for the join either
    way."""
    log = _hybrid_par_log(monkeypatch, quant_first)
    if quant_first:
        assert log == [("main", "quant"), ("main", "record", "main@1"), ("main", "gemm"),
                       ("side", "wait", "main@1"), ("side", "k1"), ("main", "wait", "side@now"), ("main", "expand")]
    else:
        assert log == [("side", "wait", "main@now"), ("side", "k1"), ("main", "quant"), ("main", "gemm"),
                       ("main", "wait", "side@now"), ("main", "expand")]


@pytest.mark.parametrize("priority", ["1"], indirect=True)
@pytest.mark.parametrize("quant_first", [False, True])
def test_hybrid_par_with_stream_priority(monkeypatch, quant_first, priority):
    """v0.91: the quantization + GEMM on the high-priority stream, after the caller's work so far and
    joined back before the expand-add (hybrid_par_q's side branch still waits for the
    quantization); the side branch as without priority."""
    log = _hybrid_par_log(monkeypatch, quant_first)
    critical = [("crit", "wait", "main@now"), ("crit", "quant")]
    if quant_first:
        critical += [("crit", "record", "crit@2")]
    critical += [("crit", "gemm"), ("main", "wait", "crit@now")]
    if quant_first:
        assert log == critical + [("side", "wait", "crit@2"), ("side", "k1"), ("main", "wait", "side@now"),
                                  ("main", "expand")]
    else:
        assert log == [("side", "wait", "main@now"), ("side", "k1")] + critical + [
            ("main", "wait", "side@now"), ("main", "expand")]
    assert ops.stream_priority_enabled()


@pytest.mark.parametrize("priority", ["1"], indirect=True)
@pytest.mark.parametrize("shrink", ["stream", "grouped"])
def test_side_shrink_par_paths_with_stream_priority(monkeypatch, shrink, priority):
    """v0.91 on hybrid_par_st / hybrid_par_g: the shrink forks first, the quantization + GEMM run on
    the high-priority stream, both join before the expand-add."""
    from kernels_dsl import expand_add, shrink_grouped, shrink_stream

    log = []
    current = _fake_streams(monkeypatch, log)
    mod, fn = (shrink_stream, "stream_shrink") if shrink == "stream" else (shrink_grouped, "grouped_shrink")
    monkeypatch.setattr(mod, fn, lambda x, a, meta, h, slot_ranks=None: log.append((current[-1].name, "shrink")))
    monkeypatch.setattr(expand_add, "expand_add", lambda out, h, b, meta, slot_ranks=None:
                        log.append((current[-1].name, "expand")) or out)
    x, wq, ws, a, b, meta, _ = _linear_case()
    out = torch.empty(x.shape[0], wq.shape[0], dtype=torch.bfloat16)
    ops._hybrid_side_shrink_path(x, wq, ws, a, b, meta, a[0].shape[-2], out, None, shrink, True)
    assert log == [("side", "wait", "main@now"), ("side", "shrink"), ("crit", "wait", "main@now"),
                   ("crit", "quant"), ("crit", "gemm"), ("main", "wait", "crit@now"),
                   ("main", "wait", "side@now"), ("main", "expand")]


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), ("yes", False)])
def test_stream_priority_setting(monkeypatch, value, on):
    """EPILORA_STREAM_PRIORITY: "1" on, "0" / unset off, anything else off with a warning (a typo
    must not stop an engine); set_stream_priority overrides it for a bench and restores it."""
    monkeypatch.setenv(ops.STREAM_PRIORITY_ENV, value)
    ops.set_stream_priority(None)
    try:
        assert ops.stream_priority_enabled() is on
        assert ops.set_stream_priority(not on) is on
        assert ops.stream_priority_enabled() is (not on)
        ops.set_stream_priority(None)
        assert ops.stream_priority_enabled() is on
    finally:
        monkeypatch.delenv(ops.STREAM_PRIORITY_ENV)
        ops.set_stream_priority(None)


@pytest.mark.parametrize("priority", ["0"], indirect=True)
@pytest.mark.parametrize("shrink", ["stream", "grouped"])
@pytest.mark.parametrize("env", ["fp32", "bf16"])
@pytest.mark.parametrize("par", [False, True])
def test_side_shrink_paths_launch_order_and_h(monkeypatch, par, env, shrink, priority):
    """hybrid_par_st (v0.88) / hybrid_par_g (v0.90): the streamed / grouped shrink forks onto the
    side stream before the quantization + GEMM, expand-add after the join; hybrid_st / hybrid_g:
    all on the caller's stream, the shrink after the GEMM. Either way one h of EPILORA_HYBRID_H's
    dtype goes from the shrink to the expand-add, and no K1 runs."""
    from kernels_dsl import expand_add, k1_shrink, shrink_grouped, shrink_stream

    monkeypatch.setenv(ops.HYBRID_H_ENV, env)
    log, seen = [], {}
    current = _fake_streams(monkeypatch, log)
    mod, fn = (shrink_stream, "stream_shrink") if shrink == "stream" else (shrink_grouped, "grouped_shrink")
    other = "grouped_shrink" if shrink == "stream" else "stream_shrink"
    monkeypatch.setattr(mod, fn, lambda x, a, meta, h, slot_ranks=None:
                        log.append((current[-1].name, "shrink")) or seen.setdefault("shrink", h))
    monkeypatch.setattr(shrink_grouped if shrink == "stream" else shrink_stream, other,
                        lambda *a, **k: log.append(("?", "other shrink")))
    monkeypatch.setattr(k1_shrink, "k1_quant_shrink", lambda *a, **k: log.append(("?", "k1")))
    monkeypatch.setattr(expand_add, "expand_add", lambda out, h, b, meta, slot_ranks=None:
                        log.append((current[-1].name, "expand")) or seen.setdefault("expand", h) is None or out)
    x, wq, ws, a, b, meta, _ = _linear_case()
    out = torch.empty(x.shape[0], wq.shape[0], dtype=torch.bfloat16)
    ops._hybrid_side_shrink_path(x, wq, ws, a, b, meta, a[0].shape[-2], out, None, shrink, par)
    if par:
        assert log == [("side", "wait", "main@now"), ("side", "shrink"), ("main", "quant"), ("main", "gemm"),
                       ("main", "wait", "side@now"), ("main", "expand")]
    else:
        assert log == [("main", "quant"), ("main", "gemm"), ("main", "shrink"), ("main", "expand")]
    assert seen["shrink"] is seen["expand"]
    assert seen["shrink"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[env]
    assert tuple(seen["shrink"].shape) == (len(a), x.shape[0], a[0].shape[-2])


@pytest.mark.parametrize("host_adapters", [None, 1])
def test_base_path_refuses_a_batch_that_may_have_adapters(host_adapters):
    """"base" drops the adapters: without the host's word that no token has one it is an error,
    never a silent wrong answer (here even with every token mapped to -1: the count decides)."""
    x, wq, ws, a, b, meta, _ = _linear_case(mapping_all=-1 if host_adapters is None else 0)
    meta.host_num_adapters = host_adapters
    with pytest.raises(ValueError, match="host_num_adapters == 0"):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="base")


def test_base_path_needs_a_gpu():
    x, wq, ws, a, b, meta, _ = _linear_case(mapping_all=-1)
    assert meta.host_num_adapters == 0
    with pytest.raises(ValueError, match="CUDA"):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="base")


@pytest.mark.parametrize("setting,capturing,vendor", [("ours", False, False), ("vllm", False, True),
                                                      ("vllm", True, False)])
def test_base_path_quantizer_by_switch_and_capture(monkeypatch, setting, capturing, vendor):
    """EPILORA_BASE_QUANT=vllm (v0.98, opt-in): the base path's eager calls quantize with vLLM's
    own op (into fresh codes / scales, no scale bound), calls inside a CUDA-graph capture and the
    default with our kernel; the GEMM gets whichever codes and scales were made."""
    calls, seen = [], {}

    def vendor_op(codes, x, scales, ub):
        calls.append("vllm")
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and ub is None
        assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], 1)
        c, sc = reference.quantize_fp8_per_token(x)
        codes.copy_(c)
        scales.copy_(sc)

    def ours(x):
        calls.append("ours")
        return reference.quantize_fp8_per_token(x)

    monkeypatch.setattr(torch.ops, "_C", type("C", (), {"dynamic_per_token_scaled_fp8_quant": staticmethod(vendor_op)}),
                        raising=False)
    monkeypatch.setattr(ops, "_vllm_ops", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(ops, "quantize_fp8_per_token", ours)
    monkeypatch.setattr(ops, "vendor_fp8_gemm", lambda c, s, w, ws, out=None: seen.update(codes=c, scales=s) or out)
    monkeypatch.setenv(ops.BASE_QUANT_ENV, setting)
    ops.base_quant.cache_clear()
    try:
        x = torch.randn(5, 64).bfloat16()
        ops._base_path(x, None, None, torch.empty(5, 8))
    finally:
        ops.base_quant.cache_clear()
    assert calls == ["vllm" if vendor else "ours"]
    c, sc = reference.quantize_fp8_per_token(x)
    assert torch.equal(seen["codes"].view(torch.uint8), c.view(torch.uint8)) and torch.equal(seen["scales"], sc)


def test_base_quant_setting_is_validated(monkeypatch):
    monkeypatch.setenv(ops.BASE_QUANT_ENV, "cublas")
    ops.base_quant.cache_clear()
    try:
        assert ops.base_quant() == "ours"
    finally:
        monkeypatch.delenv(ops.BASE_QUANT_ENV)
        ops.base_quant.cache_clear()
    assert ops.base_quant() == "ours"


def test_prefill_path_needs_an_sm90a_gpu():
    x, wq, ws, a, b, meta, _ = _linear_case()
    with pytest.raises(ValueError, match="path='prefill' does not apply"):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="prefill")


def test_persistent_tensors_are_never_cached_from_inside_a_capture(monkeypatch):
    """A tensor made during CUDA-graph capture holds its value only once that graph replays: it
    must not be cached for other graphs / eager calls; a shared stand-in made outside is used."""
    from epilora_cute import ops

    p = ops._Persistent()
    made = []

    def make():
        made.append(torch.zeros(2, dtype=torch.int32))
        return made[-1]

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    a = p.get(("sync", 0, 111), make, shared=("sync", 0))
    b = p.get(("sync", 0, 111), make, shared=("sync", 0))
    assert a is not b and len(made) == 2  # graph-private, made again for each capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    eager = p.get(("sync", 0, 222), make, shared=("sync", 0))
    assert p.get(("sync", 0, 222), make, shared=("sync", 0)) is eager
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert p.get(("sync", 0, 111), make, shared=("sync", 0)) is eager  # the stand-in made outside


def test_slice_start_is_built_with_device_fills_only(monkeypatch):
    from epilora_cute import ops

    def no_host_copy(*a, **k):
        raise AssertionError("torch.tensor(...) is a host-to-device copy: not capturable")

    monkeypatch.setattr(ops.torch, "tensor", no_host_copy)
    t = ops._slice_start((4096, 1024, 1024), torch.device("cpu"))
    assert t.tolist() == [0, 4096, 5120, 6144] and t.dtype == torch.int32


def test_persistent_counts_only_the_tensors_it_makes(monkeypatch):
    """`made` (what decides whether a decode call may chain its shrink) counts fills launched,
    not cache hits nor the shared stand-in a capture gets."""
    p = ops._Persistent()
    make = lambda: torch.zeros(2, dtype=torch.int32)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    p.get(("sync", 0, 1), make, shared=("sync", 0))
    p.get(("sync", 0, 1), make, shared=("sync", 0))
    assert p.made == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    p.get(("sync", 0, 2), make, shared=("sync", 0))  # the stand-in: nothing launched
    assert p.made == 1
    p.get(("ranks", 0), make)  # graph-private: its fill is recorded right here
    assert p.made == 2


@pytest.mark.parametrize("m", [4, 48])
@pytest.mark.parametrize("path", ["decode", "no_adapter"])
def test_chain_pdl_launches_the_first_kernel_with_pdl(path, m, monkeypatch):
    """chain_pdl puts PDL on the shrink / quantization launch (with pdl only), never on a call
    that has just filled one of its cached tensors; K2 keeps pdl. Kernels faked, CPU tensors.
    At 48 tokens K2 is the token-tile build (two tiles per weight block) beside the 64-token shrink."""
    from kernels_dsl import k2_gemm, lora_shrink

    launches = []
    configs = []

    class FakeKernel:
        def __init__(self, mod, cfg):
            self.family = mod.FAMILY
            self.cfg = cfg

        def __call__(self, *args, grid, smem, pdl, cluster):
            launches.append((self.family, pdl))
            configs.append((self.family, self.cfg, grid))

    def fake_quant(x, codes=None, scales=None, *, pdl=False):
        launches.append(("fp8_quant", pdl))
        return reference.quantize_fp8_per_token(x)

    monkeypatch.setattr(ops, "_persistent", ops._Persistent())
    monkeypatch.setattr(ops, "get_kernel", lambda mod, cfg, arch: FakeKernel(mod, cfg))
    monkeypatch.setattr(ops, "_decode_reason", lambda *a: None)
    monkeypatch.setattr(ops, "_sync_buffer", lambda dev: torch.zeros(2, dtype=torch.int32))
    monkeypatch.setattr(ops, "quantize_fp8_per_token", fake_quant)
    x, wq, ws, a, b, meta, _ = _linear_case(m=m, k=128, widths=(128,), rank=16)
    first = lora_shrink.FAMILY if path == "decode" else "fp8_quant"

    def run(**kw):
        launches.clear()
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path, **kw)
        return list(launches)

    if path == "decode":  # the first call fills slot_ranks / slice_start: never chained
        assert run(chain_pdl=True) == [(first, False), (k2_gemm.FAMILY, True)]
    assert run(chain_pdl=True) == [(first, True), (k2_gemm.FAMILY, True)]
    assert run() == [(first, False), (k2_gemm.FAMILY, True)]
    assert run(chain_pdl=True, pdl=False) == [(first, False), (k2_gemm.FAMILY, False)]
    for family, cfg, grid in configs:
        if family == k2_gemm.FAMILY:
            assert cfg.token_tiles == (m > 32) and cfg.lora == (path == "decode")
            assert grid[1] == 128 // cfg.bm * (2 if m > 32 else 1)
        else:
            assert cfg.bn == (64 if m > 32 else 8)


def test_decode_reason_takes_1_to_64_tokens(monkeypatch):
    """The decode pair's token limit (one token tile to 32, two to 64), as the dispatch sees it."""
    monkeypatch.setattr(ops, "arch_of", lambda x: "sm_90a")
    for m, ok in ((1, True), (32, True), (33, True), (64, True), (65, False)):
        x, wq, ws, a, b, meta, _ = _linear_case(m=m, k=128, widths=(128,), rank=16)
        reason = ops._decode_reason(x, wq, (128,), 16, a, b)
        assert (reason is None) == ok, (m, reason)
    assert reason == "65 tokens: the decode path takes 1..64"
    from kernels_dsl import k2_gemm

    assert ops.DECODE_MAX_TOKENS == k2_gemm.WIDE_MAX_TOKENS


def test_layer_key_survives_inductors_fresh_weight_tensors():
    """In vLLM's compiled graph the plugin's ``weight.t()`` reaches the op as a new tensor on the
    weight's storage on every call, without a ``_base`` (checked here with Inductor on the CPU): the
    layer's memos (validation, layout, the eager memo) must key it by plain values, or every engine
    call misses them (session 49: 109 against 81 µs of host per plugin call)."""
    from tools.host_cpu import engine_weight

    lib = torch.library.Library("epilora_test_fresh", "DEF")
    lib.define("op(Tensor x, Tensor w, Tensor s, Tensor[] a) -> Tensor")
    seen = []

    def impl(x, w, s, a):
        seen.append((id(w), w._base is None, ops._layer_key(w, s, list(a), [])))
        return x * 2

    lib.impl("op", impl, "CPU")
    torch.library.register_fake("epilora_test_fresh::op", lambda x, *args: torch.empty_like(x), lib=lib)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)  # vLLM: [K, N]
            self.scale = torch.ones(1)
            self.a = [torch.randn(2, 1, 4, 16)]

        def forward(self, x):
            return torch.relu(torch.ops.epilora_test_fresh.op(torch.relu(x), self.weight.t(), self.scale, self.a))

    layer = Layer()
    compiled = torch.compile(layer, dynamic=True)
    for n in (5, 6, 7):
        compiled(torch.randn(n, 16))
    # torch 2.11: a new weight tensor every call, not a view (identity or tensor_key would miss);
    # whatever a torch release does there, the key must be one
    assert len(seen) == 3 and len({k for _, _, k in seen}) == 1
    w = layer.weight.t()
    assert ops._layer_key(engine_weight(w), layer.scale, layer.a, []) == ops._layer_key(w, layer.scale, layer.a, [])
    other = torch.randn(8, 16)  # another weight: another key
    assert ops._layer_key(other, layer.scale, layer.a, []) != ops._layer_key(w, layer.scale, layer.a, [])


def test_xgate_pair_on_chained_self_quant_calls(monkeypatch):
    """v1.03 (EPILORA_K2_XGATE): chained decode_sq calls launch the x-gated shrink and K2 (the
    shrink with PDL, K2 with PDL), both given the same half of the gate buffer, the halves taken in
    turn call by call, K2's count the shrink's publications; off by default, never on an unchained
    call, on a call that has just filled a cached tensor, at a rank without xgate builds or with
    pdl=False. Kernels faked, CPU tensors."""
    from kernels_dsl import k2_gemm, lora_shrink

    launches = []

    class FakeKernel:
        def __init__(self, mod, cfg):
            self.family, self.cfg = mod.FAMILY, cfg

        def __call__(self, *args, grid, smem, pdl, cluster):
            gates = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.numel() == 2
                     and a.data_ptr() in halves]
            counts = [a for a in args if type(a) is int]
            launches.append((self.family, self.cfg, pdl, gates[0].data_ptr() if gates else None, counts))

    monkeypatch.setattr(ops, "_persistent", ops._Persistent())
    monkeypatch.setattr(ops, "_xgate_turns", {})
    gate = torch.zeros(4, dtype=torch.int32)
    halves = {gate[0:2].data_ptr(), gate[2:4].data_ptr()}
    monkeypatch.setattr(ops, "_xgate_buffer", lambda dev: ops._persistent.get(("xgate-test",), lambda: gate))
    monkeypatch.setattr(ops, "get_kernel", lambda mod, cfg, arch: FakeKernel(mod, cfg))
    monkeypatch.setattr(ops, "_decode_reason", lambda *a: None)

    def run(rank=64, **kw):
        x, wq, ws, a, b, meta, _ = _linear_case(m=1, k=256, widths=(128, 128), rank=rank, seed=3)
        launches.clear()
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode_sq", **kw)
        return list(launches)

    monkeypatch.delenv(k2_gemm.XGATE_ENV, raising=False)
    run(chain_pdl=True)  # fills slot_ranks / slice_start
    assert not any(c.xgate for _, c, *_ in run(chain_pdl=True))  # off by default
    monkeypatch.setenv(k2_gemm.XGATE_ENV, "1")
    first = run(chain_pdl=True)  # fills the gate buffer: neither chained nor gated
    assert [(f, c.xgate, p) for f, c, p, *_ in first] == [(lora_shrink.FAMILY, False, False), (k2_gemm.FAMILY, False, True)]
    seen = []
    for _ in range(3):
        (fs, cs, ps, gs, _), (fk, ck, pk, gk, nk) = run(chain_pdl=True)
        assert (fs, fk, cs.xgate, ck.xgate, ps, pk) == (lora_shrink.FAMILY, k2_gemm.FAMILY, True, True, True, True)
        assert gs is not None and gs == gk and nk[-1] == lora_shrink.XGATE_COUNT
        assert ck == k2_gemm.xgate_variant(dataclasses.replace(ck, xgate=False))
        assert ck in k2_gemm.prebuild_configs() and cs in lora_shrink.prebuild_configs()  # prebuilt, carried
        seen.append(gs)
    assert seen[0] != seen[1] and seen[0] == seen[2]  # the halves in turn
    assert not any(c.xgate for _, c, *_ in run())  # unchained
    assert not any(c.xgate for _, c, *_ in run(chain_pdl=True, pdl=False))
    run(rank=16, chain_pdl=True)  # (fills rank 16's slot ranks: not chained)
    rank16 = run(rank=16, chain_pdl=True)
    assert [(c.xgate, p) for _, c, p, *_ in rank16] == [(False, True), (False, True)]  # chained, no xgate build
    monkeypatch.setenv(k2_gemm.XGATE_ENV, "maybe")
    with pytest.raises(ValueError, match=k2_gemm.XGATE_ENV):
        run(chain_pdl=True)


def test_xgate_configs_are_the_twins_of_the_selected_builds():
    """Every x-gated build differs from a self_quant adapter build select() returns (or its wide
    twin) by the flag alone, and the shrink's twins cover each slice count of those builds."""
    from kernels_dsl import k2_gemm, lora_shrink

    xs = k2_gemm.xgate_configs()
    assert xs and all(c.xgate and c.self_quant and c.lora and c.rank in k2_gemm.XGATE_RANKS for c in xs)
    plain = {dataclasses.replace(c, xgate=False) for c in xs}
    assert plain <= set(k2_gemm.prebuild_configs())
    assert set(xs) <= set(k2_gemm.prebuild_configs())
    shrinks = {c for c in lora_shrink.prebuild_configs() if c.xgate}
    assert {c.num_slices for c in xs} <= {c.num_slices for c in shrinks}
    for c in shrinks:
        assert lora_shrink.xgate_variant(dataclasses.replace(c, xgate=False)) == c
    with pytest.raises(ValueError, match="xgate"):
        k2_gemm.Config(bn=8, lora=False, self_quant=True, xgate=True)
    with pytest.raises(ValueError, match="xgate"):
        lora_shrink.Config(bn=8, rank=64, quant=True, xgate=True)
