"""The L2 prefetch of the next projection's weight (docs/perf.md v0.77): the kernel's build and
PTX, its segment plan, the op's byte range and launch (kernel faked), and the plugin's plan of
what follows what. No GPU, no vLLM (the plugin's layers with vLLM's classes:
tests/test_vllm_plugin.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from epilora_cute import prefetch
from epilora_cute.compile_cache import dsl_version, get_artifact
from epilora_cute.kernel_abi import check_params
from epilora_cute.metadata import build_meta
from epilora_cute.reference import lora_linear, quantize_fp8_per_tensor
from kernels_dsl import l2_prefetch
from vllm_adapter import custom_op, prefetch_plan

ROOT = Path(__file__).resolve().parents[1]
DSL46_PYTHON = ROOT / ".venv-dsl46" / "bin" / "python"
needs_dsl = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")


# ----------------------------------------------------------------------------- the kernel

def _check_ptx(ptx: str) -> None:
    lines = ptx.splitlines()
    at = lambda pat: [i for i, ln in enumerate(lines) if re.search(pat, ln)]  # noqa: E731
    trig, wait = at(r"griddepcontrol\.launch_dependents"), at(r"griddepcontrol\.wait")
    pf = at(r"cp\.async\.bulk\.prefetch\.L2\.global")
    # one request per lane, issued only after the kernel before has completed; the trigger first,
    # so a chained next kernel keeps its overlap
    assert len(trig) == 1 and len(wait) == 1 and len(pf) == 1
    assert trig[0] < wait[0] < pf[0]
    # a hint: nothing read from or written to global memory
    assert not at(r"\bld\.global") and not at(r"\bst\.global") and not at(r"\bred\.|\batom\.")


@needs_dsl
@pytest.mark.parametrize("cfg", l2_prefetch.prebuild_configs(), ids=lambda c: c.name())
def test_kernel_compiles_with_one_prefetch_per_lane_after_the_wait(cfg, isolated_cache):
    art = get_artifact(l2_prefetch, cfg, "sm_90a")
    check_params(l2_prefetch.params(cfg), art.param_sizes, art.kernel_name)
    ptx = (art.path / "kernel.ptx").read_text()
    assert ".target sm_90a" in ptx and art.cubin[:4] == b"\x7fELF"
    _check_ptx(ptx)


@pytest.mark.skipif(not DSL46_PYTHON.exists(), reason="no .venv-dsl46 (nvidia-cutlass-dsl 4.6.0) venv")
def test_kernel_compiles_with_dsl_4_6(tmp_path):
    env = dict(os.environ, EPILORA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT), EPILORA_QUIET_BUILD="1")
    r = subprocess.run([str(DSL46_PYTHON), "-m", "epilora_cute.prebuild", "--arch", "sm_90a", "--family",
                        "l2_prefetch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metas = list(tmp_path.rglob("meta.json"))
    assert len(metas) == len(l2_prefetch.prebuild_configs())
    for m in metas:
        assert json.loads(m.read_text())["dsl_version"] == "4.6.0"
        _check_ptx((m.parent / "kernel.ptx").read_text())


def _requests(nbytes: int, ctas: int, segment: int) -> list[tuple[int, int]]:
    """(start, size) of every lane's request, as the kernel computes them."""
    out = []
    for lane in range(ctas * l2_prefetch.LANES):
        start = lane * segment
        if start < nbytes:
            out.append((start, min(segment, nbytes - start)))
    return out


@pytest.mark.parametrize("sm_count", [132, 114, 78, 1])
@pytest.mark.parametrize("nbytes", [16, 4096, 4112, 65536 - 16, 1 << 20, 16 * 4096 * 4096 // 16,
                                    25_165_824, 100_663_296, 33_554_432 + 48, 484_442_112])
def test_segments_cover_the_bytes_once_with_aligned_requests(nbytes, sm_count):
    ctas, segment = l2_prefetch.plan_segments(nbytes, sm_count)
    assert 1 <= ctas <= sm_count and segment % 16 == 0 and segment > 0
    reqs = _requests(nbytes, ctas, segment)
    assert reqs[0][0] == 0 and sum(size for _, size in reqs) == nbytes
    assert all(a + s == b for (a, s), (b, _) in zip(reqs, reqs[1:]))  # contiguous, no overlap
    assert all(s % 16 == 0 and s > 0 for _, s in reqs)
    assert len(reqs) > (ctas - 1) * l2_prefetch.LANES  # the last CTA has work
    # big ranges spread over every SM; small ones keep requests of at least MIN_SEGMENT
    if nbytes >= sm_count * l2_prefetch.LANES * l2_prefetch.MIN_SEGMENT:
        assert ctas == sm_count
    else:
        assert segment >= min(nbytes, l2_prefetch.MIN_SEGMENT)


@pytest.mark.parametrize("nbytes", [0, -16, 8, 4100])
def test_segments_refuse_unaligned_or_empty_ranges(nbytes):
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch.plan_segments(nbytes, 132)


# ----------------------------------------------------------------------------- the op

def test_byte_view_is_the_tensors_storage_range():
    w = torch.zeros(64, 48, dtype=torch.float8_e4m3fn)
    v = prefetch.byte_view(w)
    assert v.dtype == torch.uint8 and v.numel() == 64 * 48 and v.data_ptr() == w.data_ptr()
    # vLLM's FP8 weight as the op sees it: weight.t() of a contiguous [K, N]
    assert prefetch.byte_view(w.t()).data_ptr() == w.data_ptr() and prefetch.byte_view(w.t()).numel() == 64 * 48
    assert prefetch.byte_view(w, 1000).numel() == 992  # rounded down to 16
    assert prefetch.byte_view(w, 1 << 30).numel() == 64 * 48  # at most the tensor
    assert prefetch.byte_view(torch.zeros(4, 16, dtype=torch.bfloat16), 100).numel() == 96
    assert prefetch.byte_view(w, 15) is None and prefetch.byte_view(w, 0) is None
    assert prefetch.byte_view(w[:, :40]) is None  # not one block of memory
    assert prefetch.byte_view(w.reshape(-1)[1:]) is None  # not 16-byte aligned


def test_prefetch_is_skipped_off_sm90a():
    assert prefetch.prefetch_l2(torch.zeros(1024, dtype=torch.uint8)) == 0  # a CPU tensor


class _FakeKernel:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, grid, smem, pdl):
        self.calls.append((args, grid, smem, pdl))


def test_prefetch_launches_the_planned_grid_as_a_pdl_dependent(monkeypatch):
    k = _FakeKernel()
    monkeypatch.setattr(prefetch, "_target_arch", lambda t: "sm_90a")
    monkeypatch.setattr(prefetch, "_sm_count", lambda t: 132)
    monkeypatch.setattr(prefetch, "get_kernel", lambda mod, cfg, arch: k if mod is l2_prefetch else None)
    w = torch.zeros(4096, 1024, dtype=torch.float8_e4m3fn)
    assert prefetch.prefetch_l2(w.t(), 1 << 20) == 1 << 20
    (flat, segment), grid, smem, pdl = k.calls[0]
    assert flat.data_ptr() == w.data_ptr() and flat.numel() == 1 << 20 and flat.dtype == torch.uint8
    assert (grid[0], segment) == l2_prefetch.plan_segments(1 << 20, 132) and grid[1:] == (1, 1)
    assert smem == 0 and pdl is True
    assert prefetch.prefetch_l2(w, pdl=False) == w.numel() and k.calls[1][3] is False
    assert prefetch.prefetch_l2(w[:, :100]) == 0 and len(k.calls) == 2  # not a range: skipped


def test_prefetch_without_a_build_is_skipped_with_one_warning(monkeypatch, caplog):
    from epilora_cute.compile_cache import KernelUnavailable

    def unavailable(*a):
        raise KernelUnavailable("no build")

    monkeypatch.setattr(prefetch, "_target_arch", lambda t: "sm_90a")
    monkeypatch.setattr(prefetch, "_sm_count", lambda t: 132)
    monkeypatch.setattr(prefetch, "get_kernel", unavailable)
    monkeypatch.setattr(prefetch, "_warned", set())
    w = torch.zeros(1 << 16, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="epilora_cute"):
        assert prefetch.prefetch_l2(w) == 0 and prefetch.prefetch_l2(w) == 0
    assert sum("prefetch_l2 skipped" in r.getMessage() for r in caplog.records) == 1


# ----------------------------------------------------------------------------- the plugin's plan

@pytest.mark.parametrize("name,want", [
    ("model.layers.0.self_attn.qkv_proj", ("model.layers.0.self_attn.o_proj", "attention")),
    ("model.layers.7.self_attn.o_proj", ("model.layers.7.mlp.gate_up_proj", "other")),
    ("model.layers.7.mlp.gate_up_proj", ("model.layers.7.mlp.down_proj", "other")),
    ("model.layers.9.mlp.down_proj", ("model.layers.10.self_attn.qkv_proj", "other")),
    ("language_model.model.layers.35.mlp.down_proj", ("language_model.model.layers.36.self_attn.qkv_proj", "other")),
    ("model.layers.0.self_attn.q_proj", None),
    ("model.layers.0.mlp.experts.down_proj", None),
    ("lm_head", None),
    ("", None),
])
def test_successor_by_module_name(name, want):
    assert prefetch_plan.successor(name) == want


@pytest.mark.parametrize("value,want", [
    (None, None), ("", None), ("0", None), ("1", prefetch_plan.DEFAULT_BUDGET_MB), ("24,4", (24.0, 4.0)),
    (" 16 , 0 ", (16.0, 0.0)), ("yes", None), ("1,2,3", None), ("-1,4", None),
])
def test_budgets_from_the_environment(monkeypatch, value, want):
    monkeypatch.setattr(prefetch_plan, "_warned", set())
    if value is None:
        monkeypatch.delenv(prefetch_plan.ENV, raising=False)
    else:
        monkeypatch.setenv(prefetch_plan.ENV, value)
    assert prefetch_plan.budgets() == want


class _Base(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, 16, dtype=torch.float8_e4m3fn), requires_grad=False)


@pytest.fixture
def plan(monkeypatch):
    prefetch_plan.reset()
    monkeypatch.setenv(prefetch_plan.ENV, "1")
    monkeypatch.delenv(prefetch_plan.ENV_MAX_TOKENS, raising=False)
    yield prefetch_plan
    prefetch_plan.reset()


def test_targets_resolve_to_the_successors_weight_when_the_op_runs(plan, monkeypatch):
    names = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
             "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    layers = [_Base(64 * (i + 1)) for i in range(4)]
    ids = [plan.register(n, lyr) for n, lyr in zip(names, layers)]
    assert ids == [0, 1, 2, 3] and plan.register("", _Base(8)) == -1
    mb = plan.MB
    assert plan.target(ids[0], 1) == (layers[1].weight, 32 * mb)  # across the attention
    assert plan.target(ids[1], 1) == (layers[2].weight, 8 * mb)
    assert plan.target(ids[2], 32) == (layers[3].weight, 8 * mb)
    assert plan.target(ids[3], 1) is None  # layer 1's qkv is not registered (yet)
    nxt = _Base(8)
    assert plan.register("model.layers.1.self_attn.qkv_proj", nxt) == 4
    assert plan.target(ids[3], 1) == (nxt.weight, 8 * mb)  # resolved when the op runs
    assert plan.target(ids[0], 33) is None  # above EPILORA_L2_PREFETCH_MAX_TOKENS' default
    monkeypatch.setenv(plan.ENV_MAX_TOKENS, "64")
    assert plan.target(ids[0], 33) is not None
    monkeypatch.setenv(plan.ENV, "0")
    assert plan.target(ids[0], 1) is None
    monkeypatch.setenv(plan.ENV, "12,0")
    assert plan.target(ids[0], 1) == (layers[1].weight, 12 * mb) and plan.target(ids[1], 1) is None
    assert plan.target(-1, 1) is None and plan.target(99, 1) is None


def test_a_name_registered_again_keeps_its_id_and_a_dead_layer_prefetches_nothing(plan):
    a, b = _Base(8), _Base(16)
    assert plan.register("m.layers.0.self_attn.qkv_proj", a) == 0
    assert plan.register("m.layers.0.self_attn.o_proj", b) == 1
    b2 = _Base(32)
    assert plan.register("m.layers.0.self_attn.o_proj", b2) == 1  # a second engine's layer
    assert plan.target(0, 1)[0] is b2.weight
    del b2
    import gc

    gc.collect()
    assert plan.target(0, 1) is None


def _problem():
    g = torch.Generator().manual_seed(3)
    k, n, rank = 32, 48, 8
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(n, k, generator=g))
    a = [torch.randn(3, 1, rank, k, generator=g).to(torch.bfloat16)]
    b = [torch.randn(3, 1, n, rank, generator=g).to(torch.bfloat16)]
    ids = torch.tensor([0, -1, 2, 2, 1])
    return x, w_q, w_s, a, b, ids


def test_the_op_prefetches_after_computing_and_its_result_is_unchanged(plan, monkeypatch):
    """The custom op with a prefetch id: the same y, then prefetch_l2 of the successor's weight;
    also through torch.compile (the id is a constant of the graph, the weight found at run time)."""
    from epilora_cute import prefetch as pf

    calls = []
    monkeypatch.setattr(pf, "prefetch_l2", lambda t, nbytes=None, pdl=True: calls.append((t, nbytes)) or 0)
    x, w_q, w_s, a, b, ids = _problem()
    meta = build_meta(ids, max_loras=3, max_num_tokens=16)
    me = plan.register("model.layers.3.self_attn.qkv_proj", _Base(8))
    succ = _Base(8)
    plan.register("model.layers.3.self_attn.o_proj", succ)
    want = lora_linear(x, w_q, w_s, list(a), list(b), ids).to(torch.bfloat16)
    y = custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, prefetch_id=me)
    assert torch.equal(y, want) and calls == [(succ.weight, 32 * plan.MB)]
    out = torch.empty_like(y)
    custom_op.lora_linear_fp8_out(out, x, w_q, w_s, a, b, meta, prefetch_id=me)
    assert torch.equal(out, want) and len(calls) == 2
    assert torch.equal(custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta), want) and len(calls) == 2  # no id

    custom_op.register()
    torch._dynamo.reset()
    step = torch.compile(lambda x: custom_op.lora_linear_fp8(x, w_q, w_s, a, b, meta, prefetch_id=me) + 1,
                         backend="aot_eager", fullgraph=True)
    assert torch.equal(step(x), want + 1) and calls[-1] == (succ.weight, 32 * plan.MB)


def test_beside_prefetch_forks_nothing_where_the_prefetch_is_skipped():
    """A CPU tensor (or any skipped prefetch) makes no side stream and leaves nothing to join."""
    beside = prefetch.BesidePrefetch()
    assert beside.launch(torch.zeros(64, 64, dtype=torch.float8_e4m3fn), 1 << 20) == 0
    assert beside.pending == 0 and not beside._side
    beside.join()  # nothing forked: a no-op
