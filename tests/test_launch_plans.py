"""Launch plans (epilora_cute/launch_plans.py, launcher.LaunchPlan): a planned launch is the family
entry's launch, bit for bit — same kernel, grid, cluster, shared memory and every parameter byte —
for the calls the hybrid paths make; what a plan does not cover goes to the family's entry.

The GPU is faked as in tools/host_cpu.py (CPU tensors, the driver's launch recorded instead of
run); the kernels' parameter declarations come from the real prebuilt artifacts."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from epilora_cute import launch_plans, launcher
from epilora_cute.metadata import build_meta
from kernels_dsl import expand_add as ea
from kernels_dsl import k1_shrink as k1
from tools import host_cpu

QKV = (4096, (4096, 1024, 1024))  # K, slice widths (Qwen3-8B's qkv)
DOWN = (12288, (4096,))


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (family, config name, grid, cluster, smem, parameter bytes), GPU faked."""
    rec = []

    def record(self, ptrs_addr, grid, smem, pdl, cluster, stream):
        ptrs = (ctypes.c_void_p * len(self.params)).from_address(ptrs_addr)
        blobs = tuple(ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(self.params))
        rec.append((self.artifact.family, self.artifact.kernel_name, tuple(grid), cluster, smem, blobs))

    launch_plans.clear()
    with host_cpu.gpu_faked():
        monkeypatch.setattr(launcher.Kernel, "_launch", record)
        yield rec
    launch_plans.clear()


class Case:
    """A projection's adapter buffers and a metadata capacity, as an engine holds them."""

    def __init__(self, shape, rank=64, max_loras=8, capacity=512, adapters=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.k, self.widths = shape
        self.a = [torch.randn(max_loras, 1, rank, self.k, generator=g).bfloat16() for _ in self.widths]
        self.b = [torch.randn(max_loras, 1, n, rank, generator=g).bfloat16() for n in self.widths]
        mapping = torch.arange(capacity, dtype=torch.int32) % adapters - 1  # slot -1 included
        self.full_meta = build_meta(mapping, max_loras)
        self.g = g

    def meta(self, m: int):
        """The step's view: the persistent tensors, this step's token count (what the plugin builds)."""
        return dataclasses.replace(self.full_meta, num_tokens=m)

    def x(self, m: int):
        return torch.randn(m, self.k, generator=self.g).bfloat16()


def _family_k1(c, x, meta, codes, scales, h, slot_ranks):
    return k1.k1_quant_shrink(x, c.a, meta, codes, scales, h, slot_ranks=slot_ranks)


def _planned_cases(test):
    """The cases both families' planned launches are checked on: qkv / down, 1..300 tokens, with
    and without slot ranks, bf16 / fp32 h."""
    for mark in (pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float32]),
                 pytest.mark.parametrize("ranks", [False, True]),
                 pytest.mark.parametrize("m", [1, 7, 64, 300]),
                 pytest.mark.parametrize("shape", [QKV, DOWN])):
        test = mark(test)
    return test


def _slot_ranks(on: bool):
    return torch.tensor([64, 16, 0, 64, 64, 8, 64, 64], dtype=torch.int32) if on else None


@_planned_cases
def test_k1_planned_launch_is_the_family_entrys(launches, shape, m, ranks, h_dtype):
    c = Case(shape)
    slot_ranks = _slot_ranks(ranks)
    meta = c.meta(m)
    launch_plans.k1_quant_shrink(c.x(m), c.a, meta, slot_ranks=slot_ranks, h_dtype=h_dtype)  # makes the plan
    for _ in range(2):  # fresh activations and outputs each call, as in an engine
        x = c.x(m)
        meta = c.meta(m)  # a new metadata object over the same tensors
        codes, scales, h = launch_plans.k1_quant_shrink(x, c.a, meta, slot_ranks=slot_ranks, h_dtype=h_dtype)
        assert h.dtype == h_dtype and codes.shape == (m, c.k) and scales.shape == (m, 1)
        assert h.shape == (len(c.widths), m, 64)
        _family_k1(c, x, meta, codes, scales, h, slot_ranks)
        planned, family = launches[-2:]
        assert planned == family
    assert launch_plans._k1_plans.lookup(*launch_plans._k1_key(x, c.a, meta, slot_ranks, h_dtype is torch.bfloat16)[:2])


@pytest.mark.parametrize("m", [1, 64, 300])
def test_k1_planned_with_given_outputs(launches, m):
    """hybrid_par passes its scratch outputs: the planned launch writes them, bit for bit the family's."""
    c = Case(QKV)
    outs = lambda: (torch.empty(m, c.k, dtype=torch.float8_e4m3fn), torch.empty(m, 1),  # noqa: E731
                    torch.empty(3, m, 64, dtype=torch.bfloat16))
    launch_plans.k1_quant_shrink(c.x(m), c.a, c.meta(m), *outs())
    x, o = c.x(m), outs()
    assert launch_plans.k1_quant_shrink(x, c.a, c.meta(m), *o) == o
    _family_k1(c, x, c.meta(m), *o, None)
    assert launches[-2] == launches[-1]


@_planned_cases
def test_expand_planned_launch_is_the_family_entrys(launches, shape, m, ranks, h_dtype):
    c = Case(shape)
    slot_ranks = _slot_ranks(ranks)
    n = sum(c.widths)
    h = torch.randn(len(c.widths), m, 64).to(h_dtype)
    launch_plans.expand_add(torch.empty(m, n, dtype=torch.bfloat16), h, c.b, c.meta(m), slot_ranks)
    for _ in range(2):
        y = torch.empty(m, n, dtype=torch.bfloat16)
        h = torch.randn(len(c.widths), m, 64).to(h_dtype)
        assert launch_plans.expand_add(y, h, c.b, c.meta(m), slot_ranks) is y
        ea.expand_add(y, h, c.b, c.meta(m), slot_ranks=slot_ranks)
        assert launches[-2] == launches[-1]


def test_token_counts_and_buffers_select_their_own_plans(launches):
    """A plan is per (objects, build): other token counts (another configuration) and other
    buffer objects (a reloaded adapter buffer, new metadata tensors) launch with their own bytes."""
    c = Case(QKV)
    for m in (1, 300, 1, 300):
        x = c.x(m)
        out = launch_plans.k1_quant_shrink(x, c.a, c.meta(m), h_dtype=torch.bfloat16)
        _family_k1(c, x, c.meta(m), *out, None)
        assert launches[-2] == launches[-1]
    c.a = [a.clone() for a in c.a]  # new buffers: new addresses in the parameters
    x = c.x(300)
    out = launch_plans.k1_quant_shrink(x, c.a, c.meta(300), h_dtype=torch.bfloat16)
    _family_k1(c, x, c.meta(300), *out, None)
    assert launches[-2] == launches[-1]
    c.full_meta = build_meta(torch.zeros(512, dtype=torch.int32), 8)
    x = c.x(300)
    out = launch_plans.k1_quant_shrink(x, c.a, c.meta(300), h_dtype=torch.bfloat16)
    _family_k1(c, x, c.meta(300), *out, None)
    assert launches[-2] == launches[-1]


def test_a_planned_call_with_bad_input_gets_the_family_error(launches):
    """What a plan does not check per call is what it was made from; everything else still gets
    the family entry's error (not a launch with wrong bytes)."""
    c = Case(QKV)
    launch_plans.k1_quant_shrink(c.x(64), c.a, c.meta(64))
    launch_plans.expand_add(torch.empty(64, 6144, dtype=torch.bfloat16), torch.zeros(3, 64, 64), c.b, c.meta(64))
    n = len(launches)
    x = torch.zeros(64 * 4096 + 1, dtype=torch.bfloat16)[1:].view(64, 4096)
    with pytest.raises(ValueError, match="16-byte"):
        launch_plans.k1_quant_shrink(x, c.a, c.meta(64))
    with pytest.raises(ValueError, match="metadata describes"):
        launch_plans.k1_quant_shrink(c.x(64), c.a, c.meta(63))
    with pytest.raises(ValueError, match="h must be"):
        launch_plans.k1_quant_shrink(c.x(64), c.a, c.meta(64), h=torch.empty(3, 64, 32))
    with pytest.raises(ValueError, match="do not add up"):
        launch_plans.expand_add(torch.empty(64, 6000, dtype=torch.bfloat16), torch.zeros(3, 64, 64), c.b, c.meta(64))
    with pytest.raises(ValueError, match="h must be"):
        launch_plans.expand_add(torch.empty(64, 6144, dtype=torch.bfloat16), torch.zeros(3, 64, 32), c.b, c.meta(64))
    with pytest.raises(TypeError, match="y must be"):
        launch_plans.expand_add(torch.empty(64, 6144), torch.zeros(3, 64, 64), c.b, c.meta(64))
    assert len(launches) == n  # nothing launched


def test_plans_hold_no_tensors():
    """A plan lives in an identity memo: it must not keep the buffers it was made from alive."""
    import gc
    import weakref

    c = Case(QKV)
    with host_cpu.gpu_faked():
        launch_plans.clear()
        launch_plans.k1_quant_shrink(c.x(8), c.a, c.meta(8))
        launch_plans.expand_add(torch.empty(8, 6144, dtype=torch.bfloat16), torch.zeros(3, 8, 64), c.b, c.meta(8))
    refs = [weakref.ref(t) for t in (*c.a, *c.b)]
    del c
    gc.collect()
    assert all(r() is None for r in refs)
    launch_plans.clear()


def test_launch_plan_rejects_bad_indices_and_counts():
    from epilora_cute.kernels import get_kernel

    with host_cpu.gpu_faked():
        kern = get_kernel(ea, ea.select_for_h(1, 8, 64, True), "sm_90a")
        with pytest.raises(IndexError):
            kern.plan({len(kern.params): 0})
        plan = kern.plan({len(kern.params) - 1: 0})
        with pytest.raises(TypeError, match="dynamic arguments"):
            plan(1, grid=(1, 1, 1))


def test_plans_off_sends_every_call_to_the_family_entry(launches, monkeypatch):
    """EPILORA_LAUNCH_PLANS=0: no plan is made or used (the same launches, through the entries)."""
    monkeypatch.setenv(launch_plans.ENV, "0")
    launch_plans.enabled.cache_clear()
    try:
        c = Case(QKV)
        for _ in range(2):
            x = c.x(64)
            out = launch_plans.k1_quant_shrink(x, c.a, c.meta(64))
            launch_plans.expand_add(torch.empty(64, 6144, dtype=torch.bfloat16), out[2], c.b, c.meta(64))
        assert len(launch_plans._k1_plans) == 0 and len(launch_plans._expand_plans) == 0 and len(launches) == 4
    finally:
        monkeypatch.delenv(launch_plans.ENV)
        launch_plans.enabled.cache_clear()
