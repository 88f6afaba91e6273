"""The eager memo (epilora_cute/eager_memo.py, v1.02): a settled eager "auto" call on the hybrid
path is replayed from one lookup, with the normal path's launches byte for byte; anything the
memo's key does not cover goes the normal way (and gets its errors).

The GPU is faked as in tools/host_cpu.py (CPU tensors, each launch recorded with its parameter
bytes); the kernels' parameter declarations come from the real prebuilt artifacts; the dispatch
has decided every key for "hybrid" (host_cpu.dispatch_decided); the vendor GEMM is faked."""

from __future__ import annotations

import ctypes

import pytest
import torch

from epilora_cute import dispatch, eager_memo, launch_plans, launcher, ops
from kernels_dsl import k1_shrink
from tests.test_launch_plans import DOWN, QKV, Case
from tools import host_cpu


@pytest.fixture
def rec(monkeypatch):
    """Every launch as (family, kernel, grid, cluster, smem, parameter bytes); the calls to
    auto_path counted; K1's outputs the same tensors on every call of a shape (so that two calls'
    launches can be compared byte for byte)."""
    launches, auto_calls, fixed = [], [], {}

    def record(self, ptrs_addr, grid, smem, pdl, cluster, stream):
        ptrs = (ctypes.c_void_p * len(self.params)).from_address(ptrs_addr)
        blobs = tuple(ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(self.params))
        launches.append((self.artifact.family, self.artifact.kernel_name, tuple(grid), cluster, smem, blobs))

    real_outputs, real_auto = k1_shrink.outputs, dispatch.auto_path

    def outputs(x, num_slices, rank, codes, scales, h, h_dtype=torch.float32):
        key = (tuple(x.shape), num_slices, rank, h_dtype)
        if key not in fixed:
            fixed[key] = real_outputs(x, num_slices, rank, codes, scales, h, h_dtype)
        return fixed[key]

    def auto_path(*a, **kw):
        auto_calls.append(1)
        return real_auto(*a, **kw)

    launch_plans.clear()
    monkeypatch.setattr(k1_shrink, "outputs", outputs)
    monkeypatch.setattr(dispatch, "auto_path", auto_path)
    monkeypatch.setattr(ops, "vendor_fp8_gemm", host_cpu._vendor_gemm_faked)
    with host_cpu.gpu_faked(), host_cpu.dispatch_decided("hybrid"):
        monkeypatch.setattr(launcher.Kernel, "_launch", record)
        yield launches, auto_calls
    launch_plans.clear()


class Layer(Case):
    """test_launch_plans' projection (adapter buffers, a metadata capacity, the step's views) with
    its FP8 weight, called through the op's "auto" path as the plugin calls it."""

    def __init__(self, shape, seed=0):
        super().__init__(shape, seed=seed)
        self.w_q = torch.empty(sum(self.widths), self.k, dtype=torch.float8_e4m3fn)
        self.w_s = torch.ones(1)

    def call(self, x, out=None, slot_ranks=None, meta=None):
        return ops.lora_linear_fp8(x, self.w_q, self.w_s.reshape(1), self.a, self.b,
                                   meta if meta is not None else self.meta(x.shape[0]), out=out,
                                   slot_ranks=slot_ranks)


def settled(shape=QKV, m: int = 64) -> tuple[Layer, torch.Tensor]:
    """A layer and activations whose eager call the dispatch has settled and the memo holds."""
    layer = Layer(shape)
    x = layer.x(m)
    layer.call(x)
    return layer, x


def _slot_ranks(on: bool):
    return torch.tensor([64, 16, 0, 64, 64, 8, 64, 64], dtype=torch.int32) if on else None


@pytest.mark.parametrize("h_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("ranks", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [QKV, DOWN])
def test_replay_launches_the_normal_paths_bytes(rec, monkeypatch, shape, m, ranks, h_dtype):
    launches, auto_calls = rec
    monkeypatch.setenv("EPILORA_HYBRID_H", h_dtype)
    ops.hybrid_h_dtype.cache_clear()
    try:
        layer, sr = Layer(shape), _slot_ranks(ranks)
        x, y = layer.x(m), torch.empty(m, sum(shape[1]), dtype=torch.bfloat16)
        per_call = []

        def call():
            launches.clear()
            assert layer.call(x, out=y, slot_ranks=sr) is y
            per_call.append(list(launches))

        for _ in range(3):  # the normal path (the families' entries; the entry made), then the memo twice
            call()
        monkeypatch.setenv(eager_memo.ENV, "0")
        eager_memo.enabled.cache_clear()
        call()  # the normal path through the launch plans
        assert [f for f, *_ in per_call[0]] == ["k1_quant_shrink", "expand_add"]
        # kernel, grid, cluster, smem and every parameter byte
        assert per_call[1] == per_call[0] == per_call[2] == per_call[3]
        assert len(auto_calls) == 2  # the memo answered the second and third calls without the dispatch
        assert len(dispatch.dispatcher().eager_plans) == 1
        monkeypatch.delenv(eager_memo.ENV)
        eager_memo.enabled.cache_clear()
        out = layer.call(x, slot_ranks=sr)  # without out: a new [M, N] bf16 tensor
        assert out.shape == (m, sum(shape[1])) and out.dtype is torch.bfloat16 and len(auto_calls) == 2
    finally:
        ops.hybrid_h_dtype.cache_clear()
        eager_memo.enabled.cache_clear()


def test_entries_hold_no_tensors(rec):
    settled()
    (refs, entry), = dispatch.dispatcher().eager_plans._d.values()
    assert not any(isinstance(getattr(entry, s), torch.Tensor) for s in entry.__slots__)


def test_what_the_key_does_not_cover_takes_the_normal_path(rec, monkeypatch):
    launches, auto_calls = rec
    layer, x = settled()
    n = len(auto_calls)

    def served(fn) -> bool:
        before = len(auto_calls)
        fn()
        return len(auto_calls) == before

    assert served(lambda: layer.call(layer.x(64)))  # new activations, same everything else
    assert not served(lambda: layer.call(layer.x(65)))  # another token count: its own key
    xt = torch.randn(layer.k, 64).bfloat16().t()  # a non-contiguous x: another layout, the normal
    before = len(auto_calls)  # path's decision (here every key is decided "hybrid": K1's error)
    with pytest.raises(ValueError, match="unit column stride"):
        layer.call(xt)
    assert len(auto_calls) == before + 1
    monkeypatch.setenv(dispatch.FORCE_ENV, "reference")  # a switch the decision depends on
    assert not served(lambda: layer.call(x))
    monkeypatch.delenv(dispatch.FORCE_ENV)
    other = Layer(QKV, seed=1)  # another layer's buffers
    assert not served(lambda: other.call(x))
    assert served(lambda: layer.call(x))
    assert len(auto_calls) == n + 4


def test_bad_input_gets_the_normal_paths_errors(rec):
    layer, x = settled()
    with pytest.raises(ValueError, match="out must be"):
        layer.call(x, out=torch.empty(64, 100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="metadata prepared for 63 tokens"):
        layer.call(x, meta=layer.meta(63))
    with pytest.raises(ValueError, match="x has K=4095"):
        layer.call(torch.zeros(64, 4095, dtype=torch.bfloat16))


def test_off_switch_and_a_new_dispatcher(rec, monkeypatch):
    launches, auto_calls = rec
    layer, x = settled(DOWN, 33)
    layer.call(x)
    assert len(auto_calls) == 1
    monkeypatch.setenv(eager_memo.ENV, "0")
    eager_memo.enabled.cache_clear()
    try:
        layer.call(x)
        assert len(auto_calls) == 2
    finally:
        monkeypatch.delenv(eager_memo.ENV)
        eager_memo.enabled.cache_clear()
    layer.call(x)
    assert len(auto_calls) == 2
    d = dispatch.dispatcher()
    dispatch.set_dispatcher(dispatch.Dispatcher(d.table, d.timer))  # a new dispatcher starts empty
    try:
        layer.call(x)
        assert len(auto_calls) == 3
    finally:
        dispatch.set_dispatcher(d)
