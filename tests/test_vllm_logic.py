"""The vLLM plugin's logic that needs no vLLM: version gate, FP8 eligibility, the custom ops,
the metadata bridge, plugin switches. Runs in every environment (CI's default venv included).
The same code against vLLM's real classes: tests/test_vllm_plugin.py."""

from __future__ import annotations

import logging
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from epilora_cute.metadata import LoRABatchMeta, build_meta
from epilora_cute.reference import lora_linear, quantize_fp8_per_tensor
from vllm_adapter import custom_op, eligibility, engine_config, fused, meta_bridge, plugin, versions

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- versions

@pytest.mark.parametrize("v,ok", [
    ("0.26.0", True), ("0.26.0+cu129", True), ("0.27.1", True), ("0.30.0rc1", True),
    ("0.33.0", True), ("0.34.0", True), ("0.34.0rc1", True), ("0.34.9.dev12+gabc", True), ("v0.28.0", True),
    ("0.25.1", False), ("0.35.0", False), ("0.35.0rc1", False), ("1.0.0", False), ("0.9.2", False),
    ("", False), ("dev", False),
])
def test_version_range(v, ok):
    assert versions.is_supported(v) is ok
    supported, msg = versions.check(v)
    assert supported is ok
    assert ("outside the supported range" in msg) is (not ok)


def test_version_range_matches_pyproject_extra():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == ["vllm" + versions.SUPPORTED_SPEC]


def test_entry_point_declared():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"epilora_cute": "vllm_adapter.plugin:register"}


def test_version_check_without_vllm(monkeypatch):
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: None)
    assert versions.check() == (False, "vllm is not installed")


# ----------------------------------------------------------------------------- plugin switches

@pytest.fixture
def epilora_log():
    """Records of the plugin's logger (vLLM's logging config stops propagation to root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    lg = logging.getLogger("vllm.epilora")
    old = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    yield records
    lg.removeHandler(handler)
    lg.setLevel(old)


def _messages(records):
    return [r.getMessage() for r in records]


def test_disable_env(monkeypatch, epilora_log):
    monkeypatch.setenv("EPILORA_DISABLE", "1")
    assert plugin.register() is False
    assert any("disabled by EPILORA_DISABLE" in m for m in _messages(epilora_log))


@pytest.mark.parametrize("value,on", [("", False), ("0", False), ("false", False), ("1", True),
                                      ("yes", True), ("true", True)])
def test_env_flag(monkeypatch, value, on):
    monkeypatch.setenv("EPILORA_X_TEST", value)
    assert eligibility.env_flag("EPILORA_X_TEST") is on


def test_unsupported_version_does_nothing(monkeypatch, epilora_log):
    monkeypatch.delenv("EPILORA_DISABLE", raising=False)
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.25.1")
    calls = []
    monkeypatch.setattr(plugin, "_install", lambda: calls.append(1))
    was = plugin._State.registered
    plugin._State.registered = False
    try:
        assert plugin.register() is False
    finally:
        plugin._State.registered = was
    assert calls == []
    assert any("0.25.1 is outside the supported range" in m for m in _messages(epilora_log))


def test_register_never_raises(monkeypatch, epilora_log):
    monkeypatch.delenv("EPILORA_DISABLE", raising=False)
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.26.0")

    def boom():
        raise AttributeError("module 'vllm.lora.utils' has no attribute '_all_lora_classes'")

    monkeypatch.setattr(plugin, "_install", boom)
    was = plugin._State.registered
    plugin._State.registered = False
    try:
        assert plugin.register() is False
    finally:
        plugin._State.registered = was
    assert any("could not hook" in m for m in _messages(epilora_log))


# ----------------------------------------------------------------------------- eligibility (fakes)

def _named(name, **attrs):
    return type(name, (), {})() if not attrs else type(name, (), dict(attrs))()


def _key(static=False, shape=(1, -1)):
    return types.SimpleNamespace(scale=types.SimpleNamespace(static=static, group_shape=shape))


def _fp8_layer(n=32, k=64, method="Fp8LinearMethod", scale_shape=(), act_key=None, dtype=torch.bfloat16,
               weight=None, **method_attrs):
    """A base layer as vLLM leaves it after process_weights_after_loading (per-tensor FP8)."""
    w = weight if weight is not None else torch.randn(n, k).to(torch.float8_e4m3fn).t()  # [K, N] view
    qm = _named(method, activation_quant_key=act_key or _key(), use_marlin=False, block_quant=False,
                weight_block_size=None, act_q_static=False, **method_attrs)
    return types.SimpleNamespace(quant_method=qm, weight=w, weight_scale=torch.ones(scale_shape),
                                 input_scale=None, input_size_per_partition=k, output_size_per_partition=n,
                                 orig_dtype=dtype, tp_size=1)


LORA_CFG = types.SimpleNamespace(lora_dtype=torch.bfloat16, fully_sharded_loras=False)
ANY_DEVICE = lambda d: (True, "")  # noqa: E731


def test_accepts_fp8_per_tensor_methods():
    for name in ("Fp8LinearMethod", "Fp8PerTensorOnlineLinearMethod"):
        v = eligibility.check_layer(_fp8_layer(method=name), LORA_CFG, ANY_DEVICE)
        assert v.ok, v.reason
    # compressed-tensors W8A8 FP8, tensor strategy
    layer = _fp8_layer(method="CompressedTensorsLinearMethod")
    layer.scheme = _named("CompressedTensorsW8A8Fp8", strategy=types.SimpleNamespace(value="tensor"),
                          activation_quant_key=_key(), weight_block_size=None, is_static_input_scheme=False)
    assert eligibility.check_layer(layer, LORA_CFG, ANY_DEVICE).ok


@pytest.mark.parametrize("mutate,reason", [
    (lambda l: setattr(l, "quant_method", _named("UnquantizedLinearMethod")), "not FP8 (unquantized)"),
    (lambda l: setattr(l, "quant_method", _named("AWQLinearMethod")), "AWQLinearMethod is not per-tensor FP8"),
    (lambda l: setattr(l.quant_method, "weight_block_size", [128, 128]), "block-scaled"),
    (lambda l: setattr(l.quant_method, "use_marlin", True), "Marlin"),
    (lambda l: setattr(l.quant_method, "act_q_static", True), "static activation scale"),
    (lambda l: setattr(l.quant_method, "activation_quant_key", _key(shape=(-1, -1))), "dynamic per-tensor"),
    (lambda l: setattr(l.quant_method, "activation_quant_key", _key(shape=(1, 128))), "group (1, 128)"),
    (lambda l: setattr(l, "weight_scale", torch.ones(32)), "not per-tensor"),
    (lambda l: setattr(l, "weight_scale", torch.ones((), dtype=torch.bfloat16)), "not float32"),
    (lambda l: setattr(l, "input_scale", torch.ones(())), "static activation scale"),
    (lambda l: setattr(l, "weight", torch.randn(32, 64).to(torch.float8_e4m3fn)), "layout"),
    (lambda l: setattr(l, "weight", torch.randn(64, 32).to(torch.float8_e4m3fn)), "layout"),  # not a view
    (lambda l: setattr(l, "weight", torch.randn(32, 64, dtype=torch.bfloat16).t()), "not float8_e4m3fn"),
    (lambda l: setattr(l, "orig_dtype", torch.float16), "activation dtype torch.float16"),
    (lambda l: setattr(l, "tp_size", 2), None),  # TP alone is fine
])
def test_rejections(mutate, reason):
    layer = _fp8_layer()
    mutate(layer)
    v = eligibility.check_layer(layer, LORA_CFG, ANY_DEVICE)
    if reason is None:
        assert v.ok, v.reason
    else:
        assert not v.ok and reason in v.reason, v.reason


def test_compressed_tensors_channel_and_int8_rejected():
    layer = _fp8_layer(method="CompressedTensorsLinearMethod")
    layer.scheme = _named("CompressedTensorsW8A8Fp8", strategy=types.SimpleNamespace(value="channel"))
    assert "strategy 'channel'" in eligibility.check_layer(layer, LORA_CFG, ANY_DEVICE).reason
    layer.scheme = _named("CompressedTensorsW8A8Int8")
    assert "not W8A8 FP8" in eligibility.check_layer(layer, LORA_CFG, ANY_DEVICE).reason


def test_lora_dtype_and_fully_sharded():
    cfg = types.SimpleNamespace(lora_dtype=torch.float32, fully_sharded_loras=False)
    assert "LoRA dtype torch.float32" in eligibility.check_layer(_fp8_layer(), cfg, ANY_DEVICE).reason
    cfg = types.SimpleNamespace(lora_dtype="auto", fully_sharded_loras=True)
    assert eligibility.check_layer(_fp8_layer(), cfg, ANY_DEVICE).ok  # TP 1: same math
    layer = _fp8_layer()
    layer.tp_size = 2
    assert "fully sharded LoRA at TP>1" in eligibility.check_layer(layer, cfg, ANY_DEVICE).reason


def test_device_check_and_reference_override(monkeypatch):
    monkeypatch.delenv(eligibility.ENV_REFERENCE, raising=False)
    v = eligibility.check_layer(_fp8_layer(), LORA_CFG, fused.device_ok)
    assert not v.ok and "weights are on cpu" in v.reason
    monkeypatch.setenv(eligibility.ENV_REFERENCE, "1")
    assert eligibility.check_layer(_fp8_layer(), LORA_CFG, fused.device_ok).ok


def test_weight_view_is_vllms_storage():
    layer = _fp8_layer()
    w = eligibility.fp8_weight_view(layer)
    assert w.shape == (32, 64) and w.is_contiguous() and w.data_ptr() == layer.weight.data_ptr()


# ----------------------------------------------------------------------------- fused dispatch + custom ops

def _problem(m=7, k=64, widths=(32, 16, 16), r=8, loras=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g) * 0.05)
    a = tuple((torch.randn(loras, 1, r, k, generator=g) * 0.1).to(torch.bfloat16) for _ in widths)
    b = tuple((torch.randn(loras, 1, n, r, generator=g) * 0.1).to(torch.bfloat16) for n in widths)
    ids = torch.randint(-1, loras, (m,), generator=g)
    return x, w_q, w_s, a, b, ids


def test_fused_reference_path_matches_reference():
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    bias = torch.randn(w_q.shape[0]).to(torch.bfloat16)
    y = fused.lora_linear_fp8(x, w_q, w_s.reshape(()), a, b, meta, bias)
    want = (lora_linear(x, w_q, w_s, list(a), list(b), ids).to(torch.bfloat16) + bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_custom_op_matches_reference_and_opcheck():
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    y = custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta)
    assert torch.equal(y, lora_linear(x, w_q, w_s, list(a), list(b), ids).to(torch.bfloat16))
    args = (x, w_q, w_s, list(a), list(b), *(getattr(meta, f) for f in custom_op.META_FIELDS), None)
    before = [t.clone() for t in (x, w_q.view(torch.uint8), w_s, *a, *b)]
    # (opcheck's test_schema compares tensors with ops FP8 lacks on CPU: checked by hand below)
    torch.library.opcheck(torch.ops.epilora_vllm.lora_linear_fp8.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    after = [x, w_q.view(torch.uint8), w_s, *a, *b]
    assert all(torch.equal(p, q) for p, q in zip(before, after))  # inputs untouched
    assert y.data_ptr() not in {t.data_ptr() for t in after}  # a fresh output


def test_out_variant_writes_the_same_values_into_the_given_buffer():
    """lora_linear_fp8_out: the fused op's values, written into ``out`` (bias included), nothing
    returned, inputs untouched; opcheck's fake and AOT-dispatch checks on the mutating schema."""
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    bias = torch.randn(w_q.shape[0]).to(torch.bfloat16)
    out = torch.full((x.shape[0], w_q.shape[0]), float("nan"), dtype=torch.bfloat16)
    assert custom_op.lora_linear_fp8_out(out, x, w_q, w_s, a, b, meta, bias) is out
    assert torch.equal(out, custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, bias))
    args = (out, x, w_q, w_s, list(a), list(b), *(getattr(meta, f) for f in custom_op.META_FIELDS), None)
    before = [t.clone() for t in (x, w_q.view(torch.uint8), w_s, *a, *b)]
    torch.library.opcheck(torch.ops.epilora_vllm.lora_linear_fp8_out.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    assert all(torch.equal(p, q) for p, q in zip(before, [x, w_q.view(torch.uint8), w_s, *a, *b]))


def test_out_variant_under_inductor_writes_an_inductor_buffer():
    """Compiled with Inductor (CPU), the out variant's buffer is one Inductor allocates and passes
    straight to the op (auto-functionalization re-inplaced: no copy of the result), and the values
    equal the eager op's."""
    from torch._inductor.utils import run_and_get_code

    custom_op.register()  # outside the traced function (Dynamo does not trace library setup)
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)

    def step(x):
        y = torch.empty((x.shape[0], w_q.shape[0]), dtype=x.dtype)
        custom_op.lora_linear_fp8_out(y, x * 2, w_q, w_s, a, b, meta)
        return y + 1

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), x)
    assert torch.equal(got, custom_op.lora_linear_fp8(x * 2, w_q, w_s, a, b, meta) + 1)
    code = "\n".join(codes)
    assert "epilora_vllm.lora_linear_fp8_out" in code
    assert "clone" not in code and ".copy_(" not in code, code


def test_custom_op_register_idempotent():
    custom_op.register()
    custom_op.register()
    assert hasattr(torch.ops.epilora_vllm, "lora_linear_fp8")
    assert hasattr(torch.ops.epilora_vllm, "lora_linear_fp8_out")
    assert hasattr(torch.ops.epilora_vllm, "prepare_meta")


def test_prepare_meta_op_equals_prepare():
    ids = torch.tensor([2, -1, 0, 2, 1, -1, 0], dtype=torch.long)
    want = build_meta(ids, max_loras=3, max_num_tokens=16)
    got = LoRABatchMeta.make(3, 16)
    custom_op.prepare_meta(ids, got)
    for f in custom_op.META_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    args = (ids, *(getattr(LoRABatchMeta.make(3, 16), f) for f in custom_op.META_FIELDS))
    torch.library.opcheck(torch.ops.epilora_vllm.prepare_meta.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_ops_trace_under_torch_compile_fullgraph():
    """Dynamo traces both ops through their fake implementations without a graph break."""
    x, w_q, w_s, a, b, ids = _problem()
    meta = LoRABatchMeta.make(3, 16)

    def step(x, ids):
        custom_op.prepare_meta(ids, meta)
        return custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    want = lora_linear(x, w_q, w_s, list(a), list(b), ids).to(torch.bfloat16) * 2
    assert torch.equal(compiled(x, ids), want)
    x2, _, _, _, _, ids2 = _problem(m=5, seed=3)
    want2 = lora_linear(x2, w_q, w_s, list(a), list(b), ids2).to(torch.bfloat16) * 2
    assert torch.equal(compiled(x2, ids2), want2)  # new batch, new size: prepared inside the graph


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w_q, w_s, a, b, ids = _problem()
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fargs = [mode.from_tensor(t) for t in (w_q, w_s)]
        fa = [mode.from_tensor(t) for t in a]
        fb = [mode.from_tensor(t) for t in b]
        meta = LoRABatchMeta.make(3, 16)
        fm = [mode.from_tensor(getattr(meta, f)) for f in custom_op.META_FIELDS]
        y = torch.ops.epilora_vllm.lora_linear_fp8(fx, *fargs, fa, fb, *fm, None)
        assert tuple(y.shape) == (7, 64) and y.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- metadata bridge (fake wrapper)

class FakePunica:
    """The parts of vLLM's PunicaWrapperBase the bridge reads."""

    def __init__(self, cap=16):
        self._token_lora_indices = torch.full((cap,), 7, dtype=torch.long)  # stale garbage
        self.indices_len = [None] * 4
        self.device = torch.device("cpu")

    def update(self, ids):
        self._token_lora_indices[: len(ids)] = torch.tensor(ids)
        self.indices_len[0] = len(ids)


def test_bridge_leader_prepares_for_padded_rows():
    pw = FakePunica()
    leader, follower = torch.nn.Module(), torch.nn.Module()  # layers are modules
    st = meta_bridge.attach(pw, leader, max_loras=3)
    assert meta_bridge.attach(pw, follower, max_loras=3) is st
    assert st.leader() is leader and st.meta.max_num_tokens == 16
    pw.update([2, -1, 0])
    meta = meta_bridge.meta_for(pw, st, leader, rows=5)  # CUDA-graph padding: 5 rows, 3 tokens
    assert meta.num_tokens == 5
    # the sorted rows are a permutation of all 5 rows; stale slot 7 is out of range -> -1
    assert sorted(meta.token_indices_sorted_by_lora_ids[:5].tolist()) == [0, 1, 2, 3, 4]
    assert meta.token_lora_mapping[:5].tolist() == [2, -1, 0, -1, -1]
    # a follower on the same rows reuses it; on other rows (eager) it prepares itself
    pw.update([1, 1, 1, 1, 1, 1])
    assert meta_bridge.meta_for(pw, st, follower, rows=5).token_lora_mapping[:5].tolist() == [2, -1, 0, -1, -1]
    assert meta_bridge.meta_for(pw, st, follower, rows=6).token_lora_mapping[:6].tolist() == [1] * 6
    with pytest.raises(ValueError):
        meta_bridge.attach(pw, follower, max_loras=4)


def test_pure_modules_do_not_import_vllm():
    """Loading the plugin module must not pull vLLM in (it runs in every vLLM process)."""
    import subprocess

    code = ("import sys; import vllm_adapter.plugin, vllm_adapter.fused, vllm_adapter.custom_op, "
            "vllm_adapter.meta_bridge; assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_kernel_path(monkeypatch):
    monkeypatch.delenv(eligibility.ENV_REFERENCE, raising=False)
    assert fused.kernel_path("cpu") == "reference"
    monkeypatch.setattr(fused, "_cute_applies", lambda d: True)
    fused._kernel_path.cache_clear()
    fused._kernel_path_for.cache_clear()
    try:
        assert fused.kernel_path("cuda:0") == "cute"
        assert fused.device_ok(torch.device("cuda:0")) == (True, "")
        monkeypatch.setenv(eligibility.ENV_REFERENCE, "1")  # forces the reference math
        assert fused.kernel_path("cuda:0") == "reference"
        assert fused.device_ok(torch.device("cuda:0")) == (True, "")
    finally:
        fused._kernel_path.cache_clear()
        fused._kernel_path_for.cache_clear()


def test_shape_reason(monkeypatch):
    assert fused.shape_reason("cpu", 64, 64, 8, 3) is None  # the reference takes anything
    monkeypatch.setattr(fused, "kernel_path", lambda d: "triton")
    assert "rank 1024" in fused.shape_reason("cuda", 64, 64, 1024, 1)
    assert fused.shape_reason("cuda", 64, 64, 16, 1) is None
    monkeypatch.setattr(fused, "kernel_path", lambda d: "cute")
    ops = types.SimpleNamespace(lora_linear_fp8_unsupported=lambda n, k, r, s: "K % 16" if k % 16 else None)
    monkeypatch.setattr(fused, "_ops_module", lambda: ops)
    assert fused.shape_reason("cuda", 64, 72, 16, 1) == "K % 16"
    assert fused.shape_reason("cuda", 64, 64, 16, 1) is None


def test_call_contract_with_epilora_cute_ops():
    """The arguments the plugin hands epilora_cute.ops.lora_linear_fp8 (on the CPU it takes its
    reference path): vLLM-shaped buffers, a [1] scale view, metadata rebuilt inside the custom op."""
    op = fused.fused_op()
    if op is None:
        pytest.skip("epilora_cute.ops.lora_linear_fp8 not present")
    x, w_q, w_s, a, b, ids = _problem()
    meta = custom_op._meta_from_tensors(x, [getattr(build_meta(ids, 3, 16), f) for f in custom_op.META_FIELDS])
    assert meta.num_tokens == x.shape[0] and meta.max_loras == 3
    y = op(x, w_q, w_s.reshape(()).reshape(1), list(a), list(b), meta)
    assert torch.equal(y, lora_linear(x, w_q, w_s, list(a), list(b), ids).to(torch.bfloat16))


def test_bridge_says_when_it_prepared():
    pw = FakePunica()
    leader, follower = torch.nn.Module(), torch.nn.Module()
    st = meta_bridge.attach(pw, leader, max_loras=3)
    meta_bridge.attach(pw, follower, max_loras=3)
    pw.update([2, -1, 0])
    assert meta_bridge.meta_and_prepared(pw, st, leader, rows=3)[1] is True
    assert meta_bridge.meta_and_prepared(pw, st, follower, rows=3)[1] is False
    assert meta_bridge.meta_and_prepared(pw, st, follower, rows=2)[1] is True  # eager, other rows


def test_chain_pdl_reaches_the_cute_op_unless_turned_off(monkeypatch):
    """custom op -> fused -> epilora_cute.ops: chain_pdl passes through on the CuTe path (off by
    default, and off everywhere with EPILORA_CHAIN_PDL=0, read once)."""
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    seen = []

    def fake_op(x, w_q, w_scale, lora_a, lora_b, meta, *, chain_pdl):
        seen.append(chain_pdl)
        return x.new_zeros(x.shape[0], w_q.shape[0])

    monkeypatch.setattr(fused, "kernel_path", lambda d: "cute")
    monkeypatch.setattr(fused, "fused_op", lambda: fake_op)
    monkeypatch.delenv(fused.ENV_CHAIN_PDL, raising=False)
    fused.chain_pdl_enabled.cache_clear()
    try:
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta)
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, chain_pdl=True)
        monkeypatch.setenv(fused.ENV_CHAIN_PDL, "0")
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, chain_pdl=True)  # read once: still on
        fused.chain_pdl_enabled.cache_clear()
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, chain_pdl=True)
    finally:
        fused.chain_pdl_enabled.cache_clear()
    assert seen == [False, True, True, False]


def test_vllm_no_lora_flag_makes_a_no_adapter_call(monkeypatch):
    """vLLM's host flag "no adapter in this batch" reaches the dispatch as host_num_adapters = 0
    (its adapter bucket 0: the no-adapter path may be chosen); unset, False, or the shortcut
    turned off (EPILORA_NO_LORA_SHORTCUT=0, read once): unknown (None)."""
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    seen = []

    def fake_op(x, w_q, w_scale, lora_a, lora_b, meta, *, chain_pdl):
        seen.append(meta.host_num_adapters)
        return x.new_zeros(x.shape[0], w_q.shape[0])

    monkeypatch.setattr(fused, "kernel_path", lambda d: "cute")
    monkeypatch.setattr(fused, "fused_op", lambda: fake_op)
    monkeypatch.delenv(fused.ENV_NO_LORA_SHORTCUT, raising=False)
    monkeypatch.setenv("EPILORA_NO_LORA_PATH", "timed")  # the dispatch decides (not vLLM's path directly)
    fused.no_lora_shortcut_enabled.cache_clear()
    yes, no = torch.tensor([True]), torch.tensor([False])
    try:
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta)
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=no)
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=yes)
        monkeypatch.setenv(fused.ENV_NO_LORA_SHORTCUT, "0")
        fused.no_lora_shortcut_enabled.cache_clear()
        custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=yes)
    finally:
        fused.no_lora_shortcut_enabled.cache_clear()
    assert seen == [None, None, 0, None]


def test_a_flagged_batch_goes_straight_to_vllms_fp8_path(monkeypatch):
    """With vLLM's no-adapter flag set and the dispatch bound to take "base" for it (the default
    policy, no forced path), the op runs vLLM's FP8 path directly (fused.base_linear_fp8: no
    metadata, no dispatch — host time per eager call); the bias is added; a forced path, the
    "timed" policy or an unset flag go through the dispatch as before."""
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    base_calls, op_calls = [], []

    def fake_base(x_, w_q_, w_scale, out=None):
        base_calls.append(w_scale.shape)
        return x_.new_full((x_.shape[0], w_q_.shape[0]), 2.0)

    def fake_op(x_, w_q_, w_scale, lora_a, lora_b, meta_, *, chain_pdl):
        op_calls.append(meta_.host_num_adapters)
        return x_.new_zeros(x_.shape[0], w_q_.shape[0])

    from epilora_cute import ops

    monkeypatch.setattr(fused, "kernel_path", lambda d: "cute")
    monkeypatch.setattr(fused, "fused_op", lambda: fake_op)
    monkeypatch.setattr(ops, "base_linear_fp8", fake_base)
    for env in (fused.ENV_NO_LORA_SHORTCUT, "EPILORA_NO_LORA_PATH", "EPILORA_FORCE_PATH"):
        monkeypatch.delenv(env, raising=False)
    fused.no_lora_shortcut_enabled.cache_clear()
    yes, no = torch.tensor([True]), torch.tensor([False])
    bias = torch.ones(w_q.shape[0], dtype=torch.bfloat16)
    y = custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, bias=bias, no_lora_flag_cpu=yes)
    assert base_calls == [torch.Size([1])] and op_calls == [] and torch.equal(y, torch.full_like(y, 3.0))
    custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=no)
    assert len(base_calls) == 1 and op_calls == [None]
    monkeypatch.setenv("EPILORA_FORCE_PATH", "triton")
    custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=yes)
    monkeypatch.delenv("EPILORA_FORCE_PATH")
    monkeypatch.setenv("EPILORA_NO_LORA_PATH", "timed")
    custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=yes)
    assert len(base_calls) == 1 and op_calls == [None, 0, 0]
    monkeypatch.setattr(fused, "kernel_path", lambda d: "reference")  # no CuTe op here: never the shortcut
    monkeypatch.delenv("EPILORA_NO_LORA_PATH")
    y = custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, no_lora_flag_cpu=yes)
    assert len(base_calls) == 1 and y.shape == (x.shape[0], w_q.shape[0])


def test_host_flags_are_registered_once_and_found_by_id():
    """The op takes vLLM's flag as an id (custom_op: a CPU tensor input would make Inductor mark
    the op's output unaligned); the same tensor keeps its id, a non-flag gets -1."""
    flag, other = torch.tensor([False]), torch.tensor([True])
    fid = custom_op.host_flag_id(flag)
    assert fid >= 0 and custom_op.host_flag_id(flag) == fid and custom_op.host_flag(fid) is flag
    assert custom_op.host_flag_id(other) not in (-1, fid)
    assert custom_op.host_flag_id(None) == -1 and custom_op.host_flag_id(torch.tensor([True, False])) == -1
    assert custom_op.host_flag(-1) is None
    assert custom_op.host_flag(10_000) is None  # unknown id: the shortcut is off, the result the same
    assert "Tensor? no_lora_flag" not in custom_op.SCHEMA and "int no_lora_flag_id" in custom_op.SCHEMA


def test_a_dead_flags_id_goes_to_the_next_engines_flag():
    """A process that builds one engine after another keeps the first id (a compiled graph from
    vLLM's cache has it baked in)."""
    import gc

    flag = torch.tensor([False])
    fid = custom_op.host_flag_id(flag)
    del flag
    gc.collect()
    assert custom_op.host_flag(fid) is None
    gc.collect()
    dead = [i for i, ref in enumerate(custom_op._HOST_FLAGS) if ref() is None]
    known = len(custom_op._HOST_FLAGS)
    again = torch.tensor([True])
    # the first free id (fid, or a lower one another test's flag freed); no new id
    assert custom_op.host_flag_id(again) == dead[0] <= fid and len(custom_op._HOST_FLAGS) == known


def test_layer_finds_vllms_no_lora_flag():
    from types import SimpleNamespace

    from vllm_adapter import layers

    flag = torch.tensor([False])
    assert layers._vllm_no_lora_flag(SimpleNamespace(token_mapping_meta=SimpleNamespace(no_lora_flag_cpu=flag))) is flag
    assert layers._vllm_no_lora_flag(FakePunica()) is None  # no token metadata: unknown
    assert layers._vllm_no_lora_flag(SimpleNamespace(token_mapping_meta=SimpleNamespace(
        no_lora_flag_cpu=torch.tensor([True, False])))) is None  # not vLLM's one-element flag


# ----------------------------------------------------------------------------- engine configuration

def _vcfg(**cc):
    return types.SimpleNamespace(compilation_config=types.SimpleNamespace(**cc))


def test_graph_max_tokens_of_vllm_config():
    """v1.01: the largest batch vLLM captures CUDA graphs for, from its compilation config: the
    capture sizes' maximum; 0 without graphs (mode NONE, as enforce_eager sets it, or no sizes);
    None where the configuration does not say (every bucket then settles in both modes)."""
    none, full = types.SimpleNamespace(name="NONE"), types.SimpleNamespace(name="FULL_AND_PIECEWISE")
    f = engine_config.graph_max_tokens_of
    assert f(_vcfg(cudagraph_mode=full, cudagraph_capture_sizes=[1, 2, 4, 128, 64], max_cudagraph_capture_size=128)) == 128
    assert f(_vcfg(cudagraph_mode=none, cudagraph_capture_sizes=[1, 2], max_cudagraph_capture_size=2)) == 0
    assert f(_vcfg(cudagraph_mode=full, cudagraph_capture_sizes=[])) == 0
    assert f(_vcfg(cudagraph_mode=full, cudagraph_capture_sizes=None, max_cudagraph_capture_size=512)) == 512
    assert f(_vcfg(cudagraph_mode=full, cudagraph_capture_sizes=None, max_cudagraph_capture_size=None)) is None
    assert f(_vcfg()) is None and f(None) is None and f(types.SimpleNamespace()) is None


def test_note_graph_limit_sets_the_dispatch_limit():
    from epilora_cute import dispatch

    before = dispatch.set_graph_max_tokens(None)
    try:
        full = types.SimpleNamespace(name="PIECEWISE")
        assert engine_config.note_graph_limit(_vcfg(cudagraph_mode=full, cudagraph_capture_sizes=[8, 96])) == 96
        assert dispatch.graph_mode_used(128) and not dispatch.graph_mode_used(256)
        assert dispatch.modes_to_settle(256) == ("eager",) and dispatch.modes_to_settle(64) == dispatch.MODES
        assert engine_config.note_graph_limit(types.SimpleNamespace()) is None  # unknown: left as it was
        assert dispatch.graph_mode_used(128) and not dispatch.graph_mode_used(256)
        assert engine_config.note_graph_limit(_vcfg(cudagraph_mode=types.SimpleNamespace(name="NONE"))) == 0
        assert not dispatch.graph_mode_used(1)
        with pytest.raises(ValueError, match="int >= 0 or None"):
            dispatch.set_graph_max_tokens(-1)
    finally:
        dispatch.set_graph_max_tokens(before)
        assert dispatch.graph_mode_used(8192) == (before is None or before >= 8192)
