"""The plugin against vLLM's real classes, on the CPU (skips cleanly without vLLM).

vLLM comes from tools/install_vllm_cpu.sh (.venv-vllm: vLLM's wheel without its CUDA stack,
torch CPU). Real objects throughout: vLLM's base linear layers with its Fp8Config quant
methods and their process_weights_after_loading, vllm.lora.utils.from_layer choosing the LoRA
class, the stock classes' create_lora_weights / set_lora, vLLM's CPU punica wrapper and its
update_metadata, vLLM's plugin loader. Only the device differs: the layer computes with the
reference math (EPILORA_REFERENCE=1), and the activation quant key is set to per-token, which is
what vLLM picks on Hopper (cutlass_fp8_supported()) and cannot pick on a CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import tempfile
import types

import pytest
import torch

from epilora_cute.metadata import build_meta
from epilora_cute.reference import lora_linear

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (tools/install_vllm_cpu.sh makes .venv-vllm)")]

BF16 = torch.bfloat16
K = 64
RANK = 8
MAX_LORAS = 2


@pytest.fixture(scope="module")
def vcfg():
    """A vLLM config and a world-size-1 gloo process group on the CPU platform."""
    try:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform
        import vllm.utils.torch_utils as torch_utils
    except Exception as e:  # broken install: say why instead of failing every test
        pytest.skip(f"vllm is not importable: {type(e).__name__}: {e}")
    # Without a GPU and without a CPU build tag vLLM resolves UnspecifiedPlatform; the CPU
    # platform has to be in place before the layer modules bind current_platform.
    if type(platforms._current_platform).__name__ != "CpuPlatform":
        platforms._current_platform = CpuPlatform()
    torch_utils.PIN_MEMORY = False  # computed at import under UnspecifiedPlatform
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    # vLLM 0.34's CpuPlatform.check_and_update_config refuses an x86 CPU without triton-cpu (its
    # model runner needs it); the layers tested here do not: pass that check, then restore.
    import vllm.triton_utils as triton_utils
    has_triton = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        cfg = VllmConfig()
    finally:
        triton_utils.HAS_TRITON = has_triton
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
            initialize_model_parallel(1, 1)
    # Layers only read the model dtype (and MoE-ness; the logits processor its head dtype) from the
    # model config.
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(dtype=BF16, is_moe=False, head_dtype=None))
    _cpu_scaled_fp8_quant()
    return cfg


def _cpu_scaled_fp8_quant():
    """vLLM's static-scale scaled_fp8_quant is a CUDA kernel (vllm._C); weight post-processing
    (requantizing fused shards to one scale) calls it. Give it the torch equivalent on CPU."""
    from vllm import _custom_ops as ops

    from epilora_cute.reference import quantize_fp8_per_tensor

    def scaled_fp8_quant(input, scale=None, *args, **kwargs):
        if scale is None:
            return quantize_fp8_per_tensor(input)
        q = (input.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, scale

    ops.scaled_fp8_quant = scaled_fp8_quant


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int(os.environ.get("EPILORA_TEST_SEED", "0")))


@pytest.fixture
def plugin_on(vcfg, monkeypatch):
    """The plugin registered as vLLM would, removed afterwards."""
    from vllm_adapter import plugin

    monkeypatch.delenv("EPILORA_DISABLE", raising=False)
    monkeypatch.setenv("EPILORA_REFERENCE", "1")  # CPU: compute with the reference math
    assert plugin.register() is True
    yield plugin
    plugin.unregister()


@pytest.fixture
def log():
    records: list[logging.LogRecord] = []
    h = logging.Handler()
    h.emit = records.append
    lg = logging.getLogger("vllm.epilora")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    yield records
    lg.removeHandler(h)
    lg.setLevel(old)


def _lora_config(**kw):
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_lora_rank=RANK, max_loras=MAX_LORAS, lora_dtype=BF16, **kw)


# ----------------------------------------------------------------------------- registration

def test_vllm_version_supported():
    import vllm

    from vllm_adapter import versions

    assert versions.is_supported(vllm.__version__), vllm.__version__


def test_entry_point_loaded_by_vllm(vcfg, monkeypatch):
    """vLLM's own loader finds the entry point and the plugin puts our classes first."""
    from importlib.metadata import entry_points

    import vllm.lora.utils as lu
    import vllm.plugins

    from vllm_adapter import plugin

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    if names.get("epilora_cute") != "vllm_adapter.plugin:register":
        pytest.skip("project not installed in this venv (pip install -e . --no-deps)")
    monkeypatch.delenv("EPILORA_DISABLE", raising=False)
    stock = tuple(lu._all_lora_classes)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        vllm.plugins.load_general_plugins()
        assert plugin.is_registered()
        now = lu._all_lora_classes
        assert now[len(now) - len(stock):] == stock  # vLLM's tuple kept, in order, after ours
        ours = now[: len(now) - len(stock)]
        assert [c.__name__ for c in ours] == ["EpiLoRA" + c.__name__ for c in stock
                                             if c.__name__ in _linear_names()]
    finally:
        plugin.unregister()
    assert lu._all_lora_classes == stock


def _linear_names():
    from vllm_adapter.layers import STOCK_LINEAR_CLASSES

    return STOCK_LINEAR_CLASSES


def test_register_idempotent_and_reversible(plugin_on):
    import vllm.lora.utils as lu

    first = lu._all_lora_classes
    assert plugin_on.register() is True and plugin_on.register() is True
    assert lu._all_lora_classes is first  # nothing added twice
    assert len({c.__name__ for c in first}) == len(first)
    assert len([c for c in first if c.__name__.startswith("EpiLoRA")]) == 12


def test_register_makes_the_bucket_warmup_the_default(plugin_on, monkeypatch):
    """In an engine every token bucket settles at a projection's first call (vLLM's profile run),
    not on a request's first contact with a batch size; unregister() restores the library default."""
    from epilora_cute import bucket_warmup

    monkeypatch.delenv(bucket_warmup.ENV, raising=False)
    assert plugin_on.register() is True and bucket_warmup.enabled()
    monkeypatch.setenv(bucket_warmup.ENV, "0")
    assert not bucket_warmup.enabled()
    monkeypatch.delenv(bucket_warmup.ENV)
    plugin_on.unregister()
    assert not bucket_warmup.enabled()
    plugin_on.register()


def test_disable_env_var(vcfg, monkeypatch, log):
    import vllm.lora.utils as lu

    from vllm_adapter import plugin

    before = lu._all_lora_classes
    monkeypatch.setenv("EPILORA_DISABLE", "1")
    assert plugin.register() is False
    assert lu._all_lora_classes is before
    assert "EpiLoRA plugin disabled by EPILORA_DISABLE" in [r.getMessage() for r in log]


@pytest.mark.parametrize("version", ["0.25.1", "0.35.0", "0.9.2"])
def test_unsupported_version_leaves_vllm_alone(vcfg, monkeypatch, log, version):
    import vllm.lora.utils as lu

    from vllm_adapter import plugin, versions

    monkeypatch.delenv("EPILORA_DISABLE", raising=False)
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: version)
    before = lu._all_lora_classes
    assert plugin.register() is False
    assert lu._all_lora_classes is before
    assert any(f"vLLM {version} is outside the supported range" in r.getMessage() for r in log)


def test_tp_methods_are_vllms(plugin_on):
    """Adapter loading and TP slicing are inherited, not reimplemented."""
    import vllm.lora.layers as vl

    from vllm_adapter.layers import EpiLoRALinearMixin, STOCK_LINEAR_CLASSES

    for name in STOCK_LINEAR_CLASSES:
        stock = getattr(vl, name)
        epi = next(c for c in plugin_on._State.classes if c._stock_cls is stock)
        assert issubclass(epi, stock) and issubclass(epi, EpiLoRALinearMixin)
        for meth in ("slice_lora_a", "slice_lora_b", "set_lora", "reset_lora", "forward"):
            assert getattr(epi, meth) is getattr(stock, meth), (name, meth)
        overridden = {m for m in vars(EpiLoRALinearMixin) if callable(getattr(EpiLoRALinearMixin, m))
                      and not m.startswith("__")}
        assert overridden == {"can_replace_layer", "create_lora_weights", "set_mapping", "apply"}


# ----------------------------------------------------------------------------- real layers

# kind -> (constructor, packed modules, stock LoRA class vLLM picks, output widths)
def _kinds():
    from vllm.model_executor.layers import linear as L

    return {
        "column": (lambda **kw: L.ColumnParallelLinear(K, 48, bias=True, **kw), [],
                   "ColumnParallelLinearWithLoRA", (48,)),
        "merged_single": (lambda **kw: L.MergedColumnParallelLinear(K, [32, 32], bias=False, **kw),
                          ["gate_up_proj"], "ColumnParallelLinearWithLoRA", (64,)),
        "gate_up": (lambda **kw: L.MergedColumnParallelLinear(K, [32, 32], bias=False, **kw),
                    ["gate_proj", "up_proj"], "MergedColumnParallelLinearWithLoRA", (32, 32)),
        "variable": (lambda **kw: L.MergedColumnParallelLinear(K, [16, 16, 32], bias=False, **kw),
                     [], "MergedColumnParallelLinearVariableSliceWithLoRA", (16, 16, 32)),
        "qkv_packed": (lambda **kw: L.QKVParallelLinear(K, 16, 4, 2, bias=True, **kw), ["qkv_proj"],
                       "QKVParallelLinearWithLoRA", (128,)),
        "qkv": (lambda **kw: L.QKVParallelLinear(K, 16, 4, 2, bias=False, **kw),
                ["q_proj", "k_proj", "v_proj"], "MergedQKVParallelLinearWithLoRA", (64, 32, 32)),
        "row": (lambda **kw: L.RowParallelLinear(K, 48, bias=True, **kw), [],
                "RowParallelLinearWithLoRA", (48,)),
        "replicated": (lambda **kw: L.ReplicatedLinear(K, 48, bias=True, **kw), [],
                       "ReplicatedLinearWithLoRA", (48,)),
    }


def _fp8_layer(vcfg, kind, *, params_dtype=BF16, per_token=True, seed=0, prefix=None, **fp8_kw):
    """A vLLM base layer with FP8 weights as loaded from an FP8 checkpoint (one fused scale)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym

    ctor = _kinds()[kind][0]
    g = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(vcfg):
        qc = Fp8Config(is_checkpoint_fp8_serialized=True, **fp8_kw)
        layer = ctor(quant_config=qc, params_dtype=params_dtype, prefix=prefix or f"model.layers.0.{kind}")
        if fp8_kw:  # block / static variants: the selection reads the method, no loading needed
            return layer
        with torch.no_grad():
            layer.weight.copy_((torch.randn(layer.weight.shape, generator=g) * 100).to(torch.float8_e4m3fn))
            # one scale per logical shard (q/k/v, gate/up), as FP8 checkpoints store them:
            # vLLM requantizes the fused weight to their max
            scales = 1e-3 * (1 + torch.arange(layer.weight_scale.numel(), dtype=torch.float32))
            layer.weight_scale.copy_(scales)
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g).to(params_dtype))
        layer.quant_method.process_weights_after_loading(layer)
        if per_token:
            layer.quant_method.activation_quant_key = kFp8DynamicTokenSym
    return layer


def _from_layer(vcfg, layer, kind, lora_config=None):
    import vllm.lora.utils as lu
    from vllm.config import set_current_vllm_config

    packed = _kinds()[kind][1]
    with set_current_vllm_config(vcfg):
        return lu.from_layer(layer, MAX_LORAS, lora_config or _lora_config(), packed, None)


def _load_adapters(lora_layer, kind, seed=1):
    """Random adapters in both slots, passed the way vLLM's model manager passes them."""
    g = torch.Generator().manual_seed(seed)
    widths = _kinds()[kind][3]
    for slot in range(MAX_LORAS):
        a = [(torch.randn(RANK, K, generator=g) * 0.2).to(BF16) for _ in widths]
        b = [(torch.randn(n, RANK, generator=g) * 0.2).to(BF16) for n in widths]
        if len(widths) == 1:
            lora_layer.set_lora(slot, a[0], b[0])
        else:
            lora_layer.set_lora(slot, a, b)


def _punica(lora_layer, lora_ids):
    """vLLM's CPU punica wrapper, updated as the model manager does for one step."""
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    pw = get_punica_wrapper(32, 8, "cpu", lora_config=_lora_config())
    lora_layer.set_mapping(pw)
    # lora ids 1..MAX_LORAS live in slots 0..; 0 means no adapter
    pw.update_metadata(LoRAMapping(tuple(lora_ids), tuple(lora_ids), is_prefill=True),
                       [1, 2], MAX_LORAS + 1, 32000)
    return pw


def test_layer_creation_tells_the_dispatch_vllms_graph_sizes(vcfg, plugin_on):
    """v1.01: building a LoRA layer (inside vLLM's current configuration, as the worker does) hands
    the dispatch the largest batch vLLM captures CUDA graphs for, read from vLLM's own config."""
    from epilora_cute import dispatch
    from vllm_adapter import engine_config

    want = engine_config.graph_max_tokens_of(vcfg)
    assert want is not None, vars(vcfg.compilation_config)  # vLLM's config states its capture sizes
    before = dispatch.set_graph_max_tokens(None)
    try:
        _from_layer(vcfg, _fp8_layer(vcfg, "qkv"), "qkv")
        assert dispatch._graph_max_tokens == want
        assert engine_config.current_vllm_config() is None  # outside vLLM's context: nothing to read
    finally:
        dispatch.set_graph_max_tokens(before)


@pytest.mark.parametrize("kind", ["column", "merged_single", "gate_up", "variable", "qkv_packed", "qkv",
                                  "row", "replicated"])
def test_fp8_layers_taken_over_and_compute_the_reference(vcfg, plugin_on, log, kind):
    import vllm.lora.layers as vl

    layer = _fp8_layer(vcfg, kind)
    lora_layer = _from_layer(vcfg, layer, kind)
    stock_name = _kinds()[kind][2]
    assert type(lora_layer).__name__ == "EpiLoRA" + stock_name
    assert isinstance(lora_layer, getattr(vl, stock_name))
    assert lora_layer._epilora_active
    assert not any("stays on" in r.getMessage() for r in log)
    # vLLM's own buffers, as vLLM made them: nothing copied into ours
    assert [tuple(b.shape[2:]) for b in lora_layer.lora_b_stacked] == [(n, RANK) for n in _kinds()[kind][3]]
    _load_adapters(lora_layer, kind)
    ids = [1, 0, 2, 2, 1, 0, 1]
    pw = _punica(lora_layer, ids)
    x = torch.randn(len(ids), K).to(BF16)
    out = lora_layer(x)
    y = out[0] if isinstance(out, tuple) else out

    slots = torch.tensor([i - 1 for i in ids])
    assert torch.equal(lora_layer._epilora_state.meta.token_lora_mapping[: len(ids)].long(), slots)
    w = layer.weight.t()  # vLLM's storage viewed as [N, K]
    want = lora_linear(x, w, layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                       lora_layer.lora_b_stacked, slots).to(BF16)
    if layer.bias is not None and not layer.skip_bias_add:
        want = want + layer.bias
    assert torch.equal(y, want)

    # The same buffers through vLLM's own LoRA math (punica CPU shrink/expand): the adapter
    # layout (slices, orientation, slots) agrees. Rows without an adapter are left out: vLLM's
    # CPU wrapper indexes slot -1 there (its GPU kernels skip such rows).
    base = lora_linear(x, w, layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                       lora_layer.lora_b_stacked, torch.full_like(slots, -1))
    delta_ref = lora_linear(x, w, layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                            lora_layer.lora_b_stacked, slots) - base
    delta_vllm = torch.zeros(len(ids), sum(lora_layer.output_slices), dtype=BF16)
    pw.add_lora_linear(delta_vllm, x, lora_layer.lora_a_stacked, lora_layer.lora_b_stacked, 1.0,
                       lora_layer.output_slices)
    rows = slots >= 0
    torch.testing.assert_close(delta_vllm.float()[rows], delta_ref[rows], rtol=2e-2, atol=2e-2)
    # and vLLM's FP8 GEMM on the CPU (per-tensor activation scale there) agrees with the base
    base_vllm = layer.quant_method.apply(layer, x, None).float()
    assert (base_vllm - base).abs().max() <= 0.06 * base.abs().max()
    del pw


def test_shadow_mode_runs_the_stock_class_on_the_same_input(vcfg, plugin_on, monkeypatch, log):
    """EPILORA_SHADOW_STOCK=1 (vllm_adapter/shadow.py): each eager apply also runs the stock
    class's apply (vLLM's FP8 path + its punica shrink/expand) and records how far apart they are;
    on the CPU vLLM quantizes per tensor and our reference per token, so they differ by rounding."""
    from vllm_adapter import shadow

    monkeypatch.setenv(shadow.ENV_SHADOW, "1")
    monkeypatch.setattr(shadow, "STATS", shadow.ShadowStats())
    shadow.enabled.cache_clear()
    try:
        layer = _fp8_layer(vcfg, "qkv")
        lora_layer = _from_layer(vcfg, layer, "qkv")
        _load_adapters(lora_layer, "qkv")
        ids = [1, 2, 2, 1]  # every row with an adapter: vLLM's CPU wrapper indexes slot -1 otherwise
        _punica(lora_layer, ids)
        x = torch.randn(len(ids), K).to(BF16)
        lora_layer.apply(x)
    finally:
        shadow.enabled.cache_clear()
    assert shadow.STATS.calls == {"none": 0, "adapters": 1}
    assert shadow.STATS.max_rel["adapters"] < 0.06


@pytest.mark.parametrize("kind,stock_name", [
    ("column", "ColumnParallelLinearWithShardedLoRA"), ("qkv_packed", "QKVParallelLinearWithShardedLoRA"),
    ("qkv", "MergedQKVParallelLinearWithShardedLoRA"), ("row", "RowParallelLinearWithShardedLoRA"),
    ("gate_up", "MergedColumnParallelLinearWithLoRA"),  # vLLM keeps the plain class at TP 1
])
def test_fully_sharded_lora_at_tp1(vcfg, plugin_on, kind, stock_name):
    """fully_sharded_loras: vLLM picks its sharded classes; at TP 1 their math is the plain one."""
    layer = _fp8_layer(vcfg, kind)
    lora_layer = _from_layer(vcfg, layer, kind, _lora_config(fully_sharded_loras=True))
    assert type(lora_layer).__name__ == "EpiLoRA" + stock_name
    _load_adapters(lora_layer, kind)
    ids = [2, 0, 1, 2]
    _punica(lora_layer, ids)
    x = torch.randn(len(ids), K).to(BF16)
    out = lora_layer(x)
    y = out[0] if isinstance(out, tuple) else out
    want = lora_linear(x, layer.weight.t(), layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                       lora_layer.lora_b_stacked, torch.tensor([i - 1 for i in ids])).to(BF16)
    if layer.bias is not None:
        want = want + layer.bias
    assert torch.equal(y, want)


def test_padded_batch_cuda_graph_shape(vcfg, plugin_on):
    """More rows than mapped tokens (vLLM pads batches for CUDA graphs): mapped rows exact."""
    layer = _fp8_layer(vcfg, "qkv")
    lora_layer = _from_layer(vcfg, layer, "qkv")
    _load_adapters(lora_layer, "qkv")
    ids = [2, 1, 0]
    _punica(lora_layer, ids)
    x = torch.randn(6, K).to(BF16)  # 3 tokens + 3 padding rows
    y = lora_layer(x)[0]
    meta = lora_layer._epilora_state.meta
    slots = meta.token_lora_mapping[:6].long()  # padding rows: whatever the buffer held, or -1
    assert slots[:3].tolist() == [1, 0, -1]
    # (same row count as the layer: the reference's matmuls are not bitwise batch-invariant)
    want = lora_linear(x, layer.weight.t(), layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                       lora_layer.lora_b_stacked, slots).to(BF16)
    assert torch.equal(y[:3], want[:3])
    assert meta.num_tokens == 6
    assert sorted(meta.token_indices_sorted_by_lora_ids[:6].tolist()) == list(range(6))


def test_follower_layers_share_one_metadata(vcfg, plugin_on):
    layers = [_from_layer(vcfg, _fp8_layer(vcfg, k, seed=i), k) for i, k in enumerate(("qkv", "row"))]
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    pw = get_punica_wrapper(32, 8, "cpu", lora_config=_lora_config())
    for lay in layers:
        lay.set_mapping(pw)
    assert layers[0]._epilora_state is layers[1]._epilora_state
    assert layers[0]._epilora_state.leader() is layers[0]


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
def test_kernel_tables_prepared_when_vllm_makes_the_buffers(vcfg, plugin_on, monkeypatch, kind):
    """The Triton kernels' device tables (slice pointers, column tiles for every block_n,
    split-K counters) are built in create_lora_weights, long before vLLM captures CUDA graphs:
    a capture must not build them (the first H200 run failed there), whatever token count it is."""
    from vllm_adapter import fused
    from vllm_adapter import triton_path as tp

    monkeypatch.setattr(fused, "kernel_path", lambda device: "triton")  # what a GPU gets
    for name, value in (("_GRAPH_TABLES", {}), ("_TABLE_CACHE", tp.OrderedDict()), ("_COUNTERS", {}),
                        ("_RETIRED_COUNTERS", [])):
        monkeypatch.setattr(tp, name, value)
    lora_layer = _from_layer(vcfg, _fp8_layer(vcfg, kind), kind)
    assert lora_layer._epilora_active
    a = [t[:, 0] for t in lora_layer.lora_a_stacked]
    b = [t[:, 0] for t in lora_layer.lora_b_stacked]
    dev = a[0].device
    for bufs in (a, b):
        assert tp._GRAPH_TABLES[tp._pointer_key(bufs, dev)].tolist() == [t.data_ptr() for t in bufs]
    widths = [t.shape[1] for t in b]
    assert widths == list(_kinds()[kind][3])
    for block_n in tp.COL_BLOCK_NS:
        assert tp._col_key(widths, block_n, dev) in tp._GRAPH_TABLES
    assert tp._COUNTERS[str(dev)].numel() >= tp._MIN_COUNTERS
    assert len(tp._GRAPH_TABLES) == 2 + len(tp.COL_BLOCK_NS)


def test_table_preparation_failure_keeps_vllm_math(vcfg, plugin_on, log, monkeypatch):
    from vllm_adapter import fused

    def boom(*a):
        raise RuntimeError("no device memory")

    monkeypatch.setattr(fused, "prepare_layer", boom)
    lora_layer = _from_layer(vcfg, _fp8_layer(vcfg, "row"), "row")
    assert type(lora_layer).__name__ == "EpiLoRARowParallelLinearWithLoRA" and not lora_layer._epilora_active
    assert any("computes with vLLM's kernels: could not prepare the kernels' tables (RuntimeError: no device "
               "memory)" in r.getMessage() for r in log)


# ----------------------------------------------------------------------------- fallbacks

def _unquantized(vcfg, kind="column"):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vcfg):
        return _kinds()[kind][0](quant_config=None, params_dtype=BF16, prefix="model.layers.0.unquantized")


@pytest.mark.parametrize("case,reason", [
    ("unquantized", "base layer is not FP8 (unquantized)"),
    ("block", "block-scaled FP8 weights"),
    ("static", "static activation scale"),
    ("fp16", "activation dtype torch.float16 unsupported"),
    ("per_tensor_act", "activation quantization is dynamic per-tensor"),
    ("cpu_no_reference", "weights are on cpu"),
    ("lora_fp32", "LoRA dtype torch.float32 unsupported"),
])
def test_fallback_to_stock_class_with_one_log_line(vcfg, plugin_on, log, monkeypatch, case, reason):
    kind = "gate_up"
    lora_config = None
    if case == "unquantized":
        layer = _unquantized(vcfg, kind)
    elif case == "block":
        import vllm.model_executor.layers.quantization.fp8 as fp8_mod

        # the CPU has no block-scaled FP8 GEMM for vLLM to pick; the selection never runs it
        monkeypatch.setattr(fp8_mod, "init_fp8_linear_kernel", lambda **kw: types.SimpleNamespace())
        layer = _fp8_layer(vcfg, kind, weight_block_size=[16, 16])
        assert hasattr(layer, "weight_scale_inv")
    elif case == "static":
        layer = _fp8_layer(vcfg, kind, activation_scheme="static")
    elif case == "fp16":
        layer = _fp8_layer(vcfg, kind, params_dtype=torch.float16)
    elif case == "per_tensor_act":
        layer = _fp8_layer(vcfg, kind, per_token=False)  # what vLLM picks without CUTLASS FP8
    elif case == "cpu_no_reference":
        monkeypatch.delenv("EPILORA_REFERENCE")
        layer = _fp8_layer(vcfg, kind)
    else:
        layer = _fp8_layer(vcfg, kind)
        from vllm.config.lora import LoRAConfig

        lora_config = LoRAConfig(max_lora_rank=RANK, max_loras=MAX_LORAS, lora_dtype=torch.float32)
    lora_layer = _from_layer(vcfg, layer, kind, lora_config)
    assert type(lora_layer).__name__ == "MergedColumnParallelLinearWithLoRA"  # vLLM's own
    lines = [r.getMessage() for r in log if "stays on" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"EpiLoRA: {layer.prefix} stays on vLLM's MergedColumnParallelLinearWithLoRA: ")
    assert reason in lines[0], lines


def test_kernel_shape_limit_keeps_vllm_math(vcfg, plugin_on, log, monkeypatch):
    """Shapes the kernel can't take (asked once the buffers exist): vLLM's kernels compute."""
    import vllm.lora.layers as vl

    from vllm_adapter import fused

    monkeypatch.setattr(fused, "shape_reason", lambda *a: "rank 8 unsupported here")
    layer = _fp8_layer(vcfg, "row")
    lora_layer = _from_layer(vcfg, layer, "row")
    assert type(lora_layer).__name__ == "EpiLoRARowParallelLinearWithLoRA" and not lora_layer._epilora_active
    assert any("computes with vLLM's kernels: rank 8 unsupported here" in r.getMessage() for r in log)
    _load_adapters(lora_layer, "row")
    _punica(lora_layer, [1, 2])
    x = torch.randn(2, K).to(BF16)
    assert lora_layer._epilora_state is None
    assert torch.equal(lora_layer(x)[0], vl.RowParallelLinearWithLoRA.forward(lora_layer, x)[0])


def test_non_linear_layers_untouched_and_silent(vcfg, plugin_on, log):
    import vllm.lora.utils as lu
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    with set_current_vllm_config(vcfg):
        emb = VocabParallelEmbedding(128, K, params_dtype=BF16)
        wrapped = lu.from_layer(emb, MAX_LORAS, _lora_config(), [], None)
    assert type(wrapped).__name__ == "VocabParallelEmbeddingWithLoRA"
    assert not [r for r in log if "stays on" in r.getMessage()]


def test_subclass_with_own_forward_stays_stock(vcfg, plugin_on, log):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    class GateLike(ReplicatedLinear):  # e.g. a router that changes the output dtype
        def forward(self, x):
            return super().forward(x)

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    with set_current_vllm_config(vcfg):
        layer = GateLike(K, 48, bias=False, quant_config=Fp8Config(is_checkpoint_fp8_serialized=True),
                         params_dtype=BF16, prefix="model.layers.0.mlp.gate")
    lora_layer = _from_layer(vcfg, layer, "replicated")
    assert type(lora_layer).__name__ == "ReplicatedLinearWithLoRA"
    assert any("GateLike overrides ReplicatedLinear.forward" in r.getMessage() for r in log)


def test_compressed_tensors_fp8_scheme(vcfg, plugin_on):
    """compressed-tensors W8A8 FP8 (tensor strategy) on a real layer: selected; channel: not."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8

    from vllm_adapter import layers as epi_layers

    for strategy, taken in ((QuantizationStrategy.TENSOR, True), (QuantizationStrategy.CHANNEL, False)):
        layer = _fp8_layer(vcfg, "column")
        with set_current_vllm_config(vcfg):
            args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
            layer.scheme = CompressedTensorsW8A8Fp8(weight_quant=args, is_static_input_scheme=False)
        layer.quant_method = CompressedTensorsLinearMethod.__new__(CompressedTensorsLinearMethod)
        d = epi_layers.decide(layer, _lora_config(), [], None)
        assert (d.epi is not None) is taken, d.reason


# ----------------------------------------------------------------------------- metadata vs vLLM

@pytest.mark.parametrize("ids", [[1, -1, 0, 1, 1, -1], [0, 0, 0], [-1, -1], [1, 0, 1, 0, 1, 0, 1, 0]])
def test_batch_meta_fields_match_lora_kernel_meta(vcfg, ids):
    """The five fields LoRABatchMeta shares with vLLM's LoRAKernelMeta mean the same."""
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    mapping = torch.tensor(ids, dtype=torch.long)
    theirs = LoRAKernelMeta.make(MAX_LORAS, 16, "cpu")
    theirs.prepare_tensors(mapping)
    ours = build_meta(mapping, MAX_LORAS, 16)
    n = len(ids)
    if theirs.no_lora_flag_cpu.item():
        # vLLM returns early (kernels skip the batch): no groups. Ours keeps the -1 group.
        assert ids == [-1] * n and theirs.active_lora_ids.tolist() == [-1] * (MAX_LORAS + 1)
        assert ours.active_lora_ids.tolist()[:1] == [-1] and ours.num_tokens_per_lora[0] == n
        return
    assert torch.equal(ours.active_lora_ids, theirs.active_lora_ids)
    assert torch.equal(ours.num_tokens_per_lora, theirs.num_tokens_per_lora)
    num_active = int(ours.num_active)
    assert torch.equal(ours.lora_token_start_loc[: num_active + 1], theirs.lora_token_start_loc[: num_active + 1])
    assert torch.equal(ours.token_lora_mapping[:n], theirs.token_lora_mapping[:n])
    assert torch.equal(ours.token_indices_sorted_by_lora_ids[:n], theirs.token_indices_sorted_by_lora_ids[:n])


def test_punica_mapping_is_slot_per_token(vcfg):
    """What the bridge reads: vLLM's per-token slot buffer after update_metadata."""
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    from vllm_adapter import meta_bridge

    pw = get_punica_wrapper(32, 8, "cpu", lora_config=_lora_config())
    assert meta_bridge.capacity(pw) == 32
    pw.update_metadata(LoRAMapping((7, 0, 3, 7), (7, 0, 3, 7), is_prefill=True), [3, 7], MAX_LORAS + 1, 100)
    assert pw.token_lora_indices.tolist() == [1, -1, 0, 1]
    assert pw._token_lora_indices[:4].tolist() == [1, -1, 0, 1]


# ----------------------------------------------------------------------------- tensor parallelism

def test_vllm_tp_slicing_matches_kernel_shard_shapes(vcfg):
    """vLLM's slice_lora_a/b (inherited by our classes) cut adapters so that the reference on
    each rank's shard equals that rank's part of the unsharded result."""
    import vllm.lora.layers as vl

    tp, n_total, r = 2, 48, RANK
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, K, generator=g).to(BF16)
    w_full = (torch.randn(n_total, K, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.tensor([1e-3])
    a_full = (torch.randn(r, K, generator=g) * 0.2).to(BF16)
    b_full = (torch.randn(n_total, r, generator=g) * 0.2).to(BF16)
    ids = torch.tensor([0, -1, 0, 0, -1])
    full = lora_linear(x, w_full, s, a_full[None, None], b_full[None, None], ids, quantize_activations=False)

    # column parallel: B's output rows split, A whole; the base weight's rows split the same way
    parts = []
    for rank in range(tp):
        me = types.SimpleNamespace(tp_rank=rank, tp_size=tp, output_size=n_total // tp, is_merged_col_linear=False)
        a = vl.ColumnParallelLinearWithLoRA.slice_lora_a(me, a_full)
        b = vl.ColumnParallelLinearWithLoRA.slice_lora_b(me, b_full)
        w = w_full[rank * n_total // tp:(rank + 1) * n_total // tp]
        parts.append(lora_linear(x, w, s, a[None, None], b[None, None], ids, quantize_activations=False))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)

    # row parallel: A's input columns split, B whole; partial sums all-reduced
    total = 0
    for rank in range(tp):
        me = types.SimpleNamespace(tp_rank=rank, tp_size=tp, input_size=K // tp)
        a = vl.RowParallelLinearWithLoRA.slice_lora_a(me, a_full)
        b = vl.RowParallelLinearWithLoRA.slice_lora_b(me, b_full)
        cols = slice(rank * K // tp, (rank + 1) * K // tp)
        total = total + lora_linear(x[:, cols], w_full[:, cols], s, a[None, None], b[None, None], ids,
                                    quantize_activations=False)
    torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-4)


def test_no_lora_flag_is_no_graph_input_of_the_compiled_apply(vcfg, plugin_on):
    """vLLM's host no-adapter flag reaches our op as an id read at run time, not as a CPU tensor
    the compiled graph takes: Inductor marks CPU graph inputs unaligned and with them the output of
    an op that reads one, and the kernels after our op then lost their alignment hints (perf.md
    v0.49). The flag still decides: set, the call is a no-adapter one."""
    from types import SimpleNamespace

    from vllm_adapter import custom_op

    layer = _fp8_layer(vcfg, "qkv")
    lora_layer = _from_layer(vcfg, layer, "qkv")
    _load_adapters(lora_layer, "qkv")
    pw = _punica(lora_layer, [1, 2, 0, 2])
    flag = torch.tensor([False])
    pw.token_mapping_meta = SimpleNamespace(no_lora_flag_cpu=flag)  # as vLLM's GPU wrapper holds it
    lora_layer.set_mapping(pw)
    assert custom_op.host_flag(lora_layer._epilora_flag_id) is flag
    graph_inputs = []

    def capture(gm, example_inputs):
        graph_inputs.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lora_layer.apply, backend=capture, fullgraph=True)
    x = torch.randn(4, K).to(BF16)
    assert torch.equal(compiled(x), lora_layer.apply(x))
    assert graph_inputs and not any(t is flag for t in graph_inputs)


@pytest.mark.parametrize("out_variant", ["0", "1"])
def test_layer_apply_compiles_without_graph_break(vcfg, plugin_on, monkeypatch, out_variant):
    """The taken-over layer's apply traces as one graph (Dynamo + AOT autograd on the CPU), and
    the compiled graph prepares the metadata itself: a new batch needs no Python. Also with
    EPILORA_OUT_VARIANT=1 (the output allocated in the graph, lora_linear_fp8_out)."""
    monkeypatch.setenv("EPILORA_OUT_VARIANT", out_variant)
    layer = _fp8_layer(vcfg, "qkv")
    lora_layer = _from_layer(vcfg, layer, "qkv")
    _load_adapters(lora_layer, "qkv")
    pw = _punica(lora_layer, [1, 2, 0, 2])
    torch._dynamo.reset()
    compiled = torch.compile(lora_layer.apply, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, K).to(BF16)
    assert torch.equal(compiled(x), lora_layer.apply(x))
    from vllm.lora.layers import LoRAMapping

    pw.update_metadata(LoRAMapping((2, 2, 1, 0), (2, 2, 1, 0), is_prefill=True), [1, 2], MAX_LORAS + 1, 32000)
    want = lora_linear(x, layer.weight.t(), layer.weight_scale.reshape(1), lora_layer.lora_a_stacked,
                       lora_layer.lora_b_stacked, torch.tensor([1, 1, 0, -1])).to(BF16)
    assert torch.equal(compiled(x), want)


def test_layers_chain_except_right_after_preparing_the_metadata(vcfg, plugin_on, monkeypatch):
    """chain_pdl reaches the fused op: False for the leader (its op follows the metadata
    preparation's kernels), True for a follower on the same rows, False again for a follower
    that has to prepare for other rows (eager)."""
    from vllm_adapter import fused

    leader_layer, follower_layer = _fp8_layer(vcfg, "qkv"), _fp8_layer(vcfg, "qkv")
    leader, follower = _from_layer(vcfg, leader_layer, "qkv"), _from_layer(vcfg, follower_layer, "qkv")
    for lyr in (leader, follower):
        _load_adapters(lyr, "qkv")
    pw = _punica(leader, [1, 2, 0, 2])
    follower.set_mapping(pw)
    seen = []
    real = fused.lora_linear_fp8

    def spy(*a, chain_pdl=False, **kw):
        seen.append(chain_pdl)
        return real(*a, chain_pdl=chain_pdl, **kw)

    monkeypatch.setattr(fused, "lora_linear_fp8", spy)
    x = torch.randn(4, K).to(BF16)
    leader.apply(x)
    follower.apply(x)
    follower.apply(x[:3])
    assert seen == [False, True, False]


def test_layers_prefetch_the_next_projections_weight(vcfg, plugin_on, monkeypatch):
    """EPILORA_L2_PREFETCH on: a qkv layer's op ends with prefetch_l2 of the o layer's FP8 weight
    (its successor by vLLM's module names; the attention window's budget), eagerly and from the
    compiled apply (the layer's id is a constant of the graph); off, nothing is prefetched. The
    result is the same either way."""
    from epilora_cute import prefetch as pf
    from vllm_adapter import prefetch_plan

    prefetch_plan.reset()
    calls = []
    monkeypatch.setattr(pf, "prefetch_l2", lambda t, nbytes=None, pdl=True: calls.append((t, nbytes)) or 0)
    monkeypatch.setenv(prefetch_plan.ENV, "1")  # on while the layers are built: they register
    qkv = _from_layer(vcfg, _fp8_layer(vcfg, "qkv", prefix="model.layers.0.self_attn.qkv_proj"), "qkv")
    o_base = _fp8_layer(vcfg, "row", prefix="model.layers.0.self_attn.o_proj")
    o = _from_layer(vcfg, o_base, "row")
    assert (qkv._epilora_prefetch_id, o._epilora_prefetch_id) == (0, 1)
    _load_adapters(qkv, "qkv")
    _punica(qkv, [1, 2, 0, 2])
    x = torch.randn(4, K).to(BF16)
    monkeypatch.delenv(prefetch_plan.ENV, raising=False)
    y = qkv.apply(x)
    assert calls == []
    monkeypatch.setenv(prefetch_plan.ENV, "1")
    assert torch.equal(qkv.apply(x), y)
    assert len(calls) == 1 and calls[0][0] is o_base.weight and calls[0][1] == 32 * prefetch_plan.MB
    torch._dynamo.reset()
    compiled = torch.compile(qkv.apply, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), y)
    assert len(calls) >= 2 and calls[-1][0] is o_base.weight
    prefetch_plan.reset()


def test_decoder_layers_trace_to_the_same_graph(vcfg, plugin_on, monkeypatch):
    """vLLM compiles one decoder layer's graph piece and reuses it for every isomorphic one; a
    per-layer constant in our op's arguments defeats that (run32 / run33: Inductor 81–98 s instead
    of 19–25, the engine up 60–80 s after stock). Layers of different decoder layers, built with
    the L2 prefetch off (the default), trace to the same code; built with it on, their prefetch
    ids make the graphs differ (the documented cost of that experiment). The first layer traced
    in a step also prepares the step's metadata (its own graph, as in the engine's first piece)."""
    from vllm_adapter import prefetch_plan

    def graph_code(layer, pw, x):
        layer.set_mapping(pw)
        codes = []

        def record(gm, example_inputs):
            codes.append(gm.code)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(layer.apply, backend=record, fullgraph=True)(x)
        assert len(codes) == 1
        return codes[0]

    def layers(first):
        made = [_from_layer(vcfg, _fp8_layer(vcfg, "qkv", prefix=f"model.layers.{i}.self_attn.qkv_proj"), "qkv")
                for i in range(first, first + 3)]
        for layer in made:
            _load_adapters(layer, "qkv")
        return made

    prefetch_plan.reset()
    x = torch.randn(4, K).to(BF16)
    monkeypatch.delenv(prefetch_plan.ENV, raising=False)
    off = layers(0)
    pw = _punica(off[0], [1, 2, 0, 2])
    assert [layer._epilora_prefetch_id for layer in off] == [-1, -1, -1]
    first, second, third = (graph_code(layer, pw, x) for layer in off)
    assert "prepare_meta" in first and "prepare_meta" not in second
    assert second == third
    monkeypatch.setenv(prefetch_plan.ENV, "1")
    on = layers(3)
    assert [layer._epilora_prefetch_id for layer in on] == [0, 1, 2]
    codes = [graph_code(layer, pw, x) for layer in on]
    assert "prepare_meta" not in codes[1] and codes[1] != codes[2]
    torch._dynamo.reset()
    prefetch_plan.reset()


# ----------------------------------------------------------------------------- lm_head LoRA

VOCAB = 256


def _lm_head_wrapper(vcfg):
    """vLLM's logits processor + lm_head, wrapped by the model manager's builder (hooked when the
    plugin is on), with vLLM's CPU punica wrapper mapped one adapter per token."""
    import vllm.lora.model_manager as mm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    with set_current_vllm_config(vcfg):
        head = ParallelLMHead(VOCAB, K, params_dtype=BF16)
        with torch.no_grad():
            head.weight.copy_((torch.randn(head.weight.shape) * 0.2).to(BF16))
        head.cpu_linear = torch.nn.functional.linear  # what vLLM's CPU weight post-processing sets
        wrapper = mm.from_layer_logits_processor(LogitsProcessor(VOCAB), head, MAX_LORAS, _lora_config(), None)
    return wrapper, head


class _Spy:
    """A punica wrapper whose add_lora_logits counts its calls (the rest is vLLM's)."""

    def __init__(self, pw):
        self.pw, self.calls = pw, 0

    def add_lora_logits(self, *args, **kwargs):
        self.calls += 1
        return self.pw.add_lora_logits(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.pw, name)


def test_lm_head_lora_adopted_and_skipped_while_no_slot_has_weights(vcfg, plugin_on):
    """Installed, the model manager's lm_head wrapper is ours: while no slot holds lm_head weights
    (every B zero) the logits are the base layer's without vLLM's shrink / expand call; once a
    slot is filled, vLLM's own computation, equal to the stock class's; empty again after
    reset_lora."""
    import vllm.lora.layers as vl

    from vllm_adapter import logits

    wrapper, head = _lm_head_wrapper(vcfg)
    assert type(wrapper).__name__ == "EpiLoRALogitsProcessorWithLoRA"
    assert isinstance(wrapper, vl.LogitsProcessorWithLoRA) and logits.hook_problem(vl.LogitsProcessorWithLoRA) is None
    stock, _ = _lm_head_wrapper(vcfg)
    stock.__class__ = vl.LogitsProcessorWithLoRA  # the same buffers' math through vLLM's class
    pw = _punica(wrapper, [1, 2, 0, 1])
    spy = _Spy(pw)
    wrapper.set_mapping(spy)
    stock.set_mapping(pw)
    x = (torch.randn(4, K) * 0.5).to(BF16)
    base = wrapper._get_logits(x, head)
    assert spy.calls == 0 and wrapper.punica_wrapper is spy  # skipped, and the wrapper put back
    stock.lora_b_stacked.copy_(wrapper.lora_b_stacked)
    torch.testing.assert_close(base, stock._get_logits(x, head), rtol=0, atol=0)
    # An adapter with lm_head weights in slot 1: vLLM's path, the delta added.
    a = (torch.randn(RANK, K) * 0.2).to(BF16)
    b = (torch.randn(VOCAB, RANK) * 0.2).to(BF16)
    for m in (wrapper, stock):
        m.set_lora(1, a, b)
    with_delta = wrapper._get_logits(x, head)
    assert spy.calls == 1
    torch.testing.assert_close(with_delta, stock._get_logits(x, head), rtol=0, atol=0)
    assert not torch.equal(with_delta, base)
    # Slot 1 taken by an adapter without lm_head weights (vLLM resets the slot): skipped again.
    wrapper.reset_lora(1)
    torch.testing.assert_close(wrapper._get_logits(x, head), base, rtol=0, atol=0)
    assert spy.calls == 1


def test_lm_head_lora_stays_vllms_when_asked_or_unknown(vcfg, plugin_on, monkeypatch, log):
    import vllm.lora.layers as vl

    from vllm_adapter import logits

    monkeypatch.setenv(logits.ENV_SKIP, "0")
    wrapper, _ = _lm_head_wrapper(vcfg)
    assert type(wrapper) is vl.LogitsProcessorWithLoRA
    monkeypatch.delenv(logits.ENV_SKIP)

    class Other(vl.LogitsProcessorWithLoRA):
        def _get_logits(self, *args, **kwargs):  # a layout this module does not know
            return None

    assert logits.hook_problem(Other) is not None
    module = Other.__new__(Other)
    assert logits.adopt(module) is module and type(module) is Other
    assert any("lm_head LoRA stays on vLLM's Other" in r.getMessage() for r in log)


def test_unregister_restores_the_lm_head_builder(vcfg):
    import vllm.lora.model_manager as mm

    from vllm_adapter import plugin

    before = mm.from_layer_logits_processor
    assert plugin.register() is True
    assert mm.from_layer_logits_processor is not before
    plugin.unregister()
    assert mm.from_layer_logits_processor is before
