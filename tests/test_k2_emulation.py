"""CPU emulation of the decode path (shrink+quant, K2) against the reference semantics.

The emulation reproduces the kernels' CTA decomposition (split-K ranges, adapter-group items
dealt round-robin over a cluster, masked bf16 h chunks, fixed-order split sums), so these tests
check the grouping logic, the slice/rank bookkeeping and order-independence without a GPU.
"""

import itertools

import pytest
import torch

from epilora_cute.metadata import build_meta
from epilora_cute.reference import lora_linear, lora_shrink, quantize_fp8_per_tensor
from kernels_dsl.emulate import emulate_k2, emulate_shrink, k2_items, k_range, lora_items


def _problem(M, widths, K, rank, n_adapters, max_loras, seed, slot_ranks=None, none_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(sum(widths), K, generator=g) * 0.05
    w_codes, w_scale = quantize_fp8_per_tensor(w)
    if slot_ranks is None:
        slot_ranks = [rank] * max_loras
    lora_a, lora_b = [], []
    for wd in widths:
        a = torch.randn(max_loras, 1, rank, K, generator=g) * 0.05
        b = torch.randn(max_loras, 1, wd, rank, generator=g) * 0.05
        for l, r in enumerate(slot_ranks):  # zero-padded smaller effective ranks
            a[l, :, r:] = 0
            b[l, :, :, r:] = 0
        lora_a.append(a.to(torch.bfloat16))
        lora_b.append(b.to(torch.bfloat16))
    slots = torch.randint(0, n_adapters, (M,), generator=g)
    none = torch.rand(M, generator=g) < none_frac
    tok = torch.where(none, torch.full_like(slots, -1), slots).to(torch.int32)
    return x, w_codes, w_scale, lora_a, lora_b, tok, slot_ranks


def _run(x, w_codes, w_scale, lora_a, lora_b, tok, slot_ranks, rank, max_loras, bm, bn, split_s, split_k,
         order_seed=None):
    meta = build_meta(tok, max_loras)
    active = meta.active_lora_ids.tolist()
    na = int(meta.num_active)
    h, xq, sx = emulate_shrink(x, lora_a, tok, active, na, slot_ranks, rank, split_s, order_seed=order_seed)
    y = emulate_k2(xq, sx, w_codes, w_scale, h, lora_b, tok, active, na, slot_ranks, rank, bm, bn, split_k,
                   order_seed=order_seed)
    return y, h


CASES = [
    # M, widths, K, rank, adapters, max_loras, bm, bn, split_shrink, split_k2
    (1, (256, 128, 128), 512, 64, 1, 4, 128, 8, 4, 3),
    (3, (256, 128, 128), 448, 16, 2, 4, 128, 8, 2, 2),  # K tail (448 = 3.5 k-blocks)
    (7, (192, 192), 384, 8, 3, 4, 64, 8, 3, 5),  # bm 64 (slices not multiples of 128), rank 8
    (16, (256,), 512, 128, 4, 8, 128, 16, 8, 4),
    (31, (128, 128), 256, 256, 8, 8, 128, 32, 2, 2),
    (32, (256, 128, 128), 512, 32, 5, 8, 128, 32, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}_r{c[3]}_a{c[4]}_s{c[8]}x{c[9]}")
def test_emulation_matches_reference(case):
    M, widths, K, rank, na, L, bm, bn, ss, sk = case
    x, wc, ws, la, lb, tok, sr = _problem(M, widths, K, rank, na, L, seed=M * 7 + rank)
    y, h = _run(x, wc, ws, la, lb, tok, sr, rank, L, bm, bn, ss, sk)
    ref = lora_linear(x, wc, ws, la, lb, tok)
    # bf16 output rounding (2^-8 relative) plus bf16 h in the epilogue WGMMA.
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    href = lora_shrink(x, la, tok)
    for s in range(len(widths)):
        for m in range(M):
            if tok[m] >= 0:
                torch.testing.assert_close(h[s, m], href[s][m], rtol=1e-5, atol=1e-5)
            else:  # never written: K2 must never read it
                assert torch.isnan(h[s, m]).all()


def test_mixed_effective_ranks_and_no_adapter_tokens():
    M, widths, K, rank, L = 12, (256, 128, 128), 512, 128, 6
    sr = [128, 8, 64, 16, 0, 100]
    x, wc, ws, la, lb, tok, _ = _problem(M, widths, K, rank, L, L, seed=3, slot_ranks=sr, none_frac=0.25)
    tok[0] = -1
    tok[1] = 4  # a slot with effective rank 0: adds nothing
    y, h = _run(x, wc, ws, la, lb, tok, sr, rank, L, 128, 16, 4, 3)
    ref = lora_linear(x, wc, ws, la, lb, tok)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_order_independent_bits():
    """CTAs finishing in any order give the same bits (fixed-order split sums)."""
    M, widths, K, rank, L = 9, (256, 128, 128), 512, 64, 4
    x, wc, ws, la, lb, tok, sr = _problem(M, widths, K, rank, 3, L, seed=11)
    y0, h0 = _run(x, wc, ws, la, lb, tok, sr, rank, L, 128, 16, 4, 3)
    for seed in range(3):
        y1, h1 = _run(x, wc, ws, la, lb, tok, sr, rank, L, 128, 16, 4, 3, order_seed=seed)
        assert torch.equal(y0.view(torch.int16), y1.view(torch.int16))
        assert torch.equal(torch.nan_to_num(h0, 7.0), torch.nan_to_num(h1, 7.0))


def test_no_adapter_variant():
    M, widths, K = 5, (256,), 384
    x, wc, ws, la, lb, tok, sr = _problem(M, widths, K, 16, 1, 2, seed=5)
    xq, sx = __import__("epilora_cute.reference", fromlist=["x"]).quantize_fp8_per_token(x)
    y = emulate_k2(xq, sx.reshape(-1), wc, ws, None, None, tok, [], 0, [], 16, 128, 8, 3, lora=False)
    ref = (xq.float() * sx) @ (wc.float() * ws).t()
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_split_ranges_partition_k():
    for nk, s in itertools.product(range(1, 40), range(1, 17)):
        rs = [k_range(i, s, nk) for i in range(s)]
        assert rs[0][0] == 0 and rs[-1][1] == nk
        assert all(rs[i][1] == rs[i + 1][0] for i in range(s - 1))


def test_items_cover_each_group_chunk_once():
    items = lora_items([-1, 0, 3, 5, -1], 4, [64, 0, 0, 200, 0, 17], 256, 64)
    assert items == [(0, 0), (3, 0), (3, 1), (3, 2), (3, 3), (5, 0)]


def test_k2_items_follow_first_tokens():
    # Groups in the order of each slot's first token; slots of rank 0 give no item; -1 none.
    items = k2_items([3, -1, 0, 3, 5, 0], [64, 0, 0, 200, 0, 17], 256, 64)
    assert items == [(3, 0), (3, 1), (3, 2), (3, 3), (0, 0), (5, 0)]


@pytest.mark.parametrize("M,K,S,Y", [(1, 4096, 8, 3), (1, 12288, 8, 1), (1, 12288, 16, 1), (2, 4096, 8, 3),
                                     (3, 4096, 5, 3), (1, 16, 8, 1), (1, 29568, 7, 2), (4, 12288, 8, 2),
                                     (8, 12288, 8, 1), (32, 4096, 7, 1), (31, 1040, 2, 4)])
def test_quant_planes_match_reference(M, K, S, Y):
    """The quantization planes' decomposition (rows split over a cluster at M <= Y, one token per
    CTA otherwise; batched clamped loads, predicated stores) gives vLLM's codes and scales, every
    vector of x_q stored exactly once, in any CTA order."""
    from epilora_cute.reference import quantize_fp8_per_token
    from kernels_dsl.emulate import emulate_quant_planes

    g = torch.Generator().manual_seed(M * 7 + K + S)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 5).bfloat16()
    x[0, K - 1] = 40.0  # the row maximum in the last vector (the clamped loads' target)
    xq, sx, writes = emulate_quant_planes(x, S, Y, order_seed=M + S)
    ref_q, ref_s = quantize_fp8_per_token(x)
    assert torch.equal(writes, torch.ones_like(writes))
    assert torch.equal(sx, ref_s.reshape(-1))
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))


# --- push_partials' plan (Config.push_partials): owners, slots and byte counts ----------------


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("nsplit", list(range(1, 17)))
def test_push_plan_every_element_one_owner_one_slot(bm, nsplit):
    """The kernel's integer arithmetic (magic-number divisions) for every token count of every
    tile: each sender's element goes to exactly its reduction owner (the CTA whose share holds it),
    at a slot inside the owner's buffer (which fits the freed weight stages) used by no other push,
    and each owner's expect_tx equals the bytes pushed to it."""
    from kernels_dsl import k2_gemm

    for bn in (8, 16, 32):
        smallest_stages = min(k2_gemm.Config(bn=bn, bm=bm, stages=st).bm * 128 * st
                              for st in (3, 4) if (bm + k2_gemm.RED_PAD) * bn * 4 <= bm * 128 * st)
        for mv in range(1, bn + 1):
            n_el = bm * mv
            plan = k2_gemm.push_plan(bm, mv, nsplit)
            sh, share = plan["sh"], plan["share"]
            assert nsplit * sh * 4 <= smallest_stages
            got = [0] * nsplit
            seen = set()
            for q, e, o, slot in plan["pushes"]:
                lo, hi = share[o]
                assert o == k2_gemm.reduction_owner(e, n_el, nsplit)
                assert lo <= e < hi, (q, e, o)
                assert 0 <= slot < nsplit * sh and slot == q * sh + e - lo
                assert (o, slot) not in seen
                seen.add((o, slot))
                got[o] += 4
            assert got == plan["expect"], (bn, mv)
            assert len(plan["pushes"]) == nsplit * n_el


def test_push_plan_sums_like_the_dsmem_reduction():
    """The owner's sum over the received slots, in sender order 0..S-1 from +0.0, is bitwise the
    DSMEM reduction's (every split's value of the element, same order), -0.0 partials included."""
    import numpy as np
    from kernels_dsl import k2_gemm

    rng = np.random.default_rng(0)
    bm, mv, S = 64, 3, 5
    n_el = bm * mv
    parts = rng.standard_normal((S, n_el)).astype(np.float32) * np.float32(1e3)
    parts[:, 7] = -0.0
    plan = k2_gemm.push_plan(bm, mv, S)
    bufs = [np.full(S * plan["sh"], np.nan, dtype=np.float32) for _ in range(S)]
    for q, e, o, slot in plan["pushes"]:
        bufs[o][slot] = parts[q, e]
    for o, (lo, hi) in enumerate(plan["share"]):
        for e in range(lo, hi):
            a = np.float32(0.0)
            b = np.float32(0.0)
            for q in range(S):
                a = np.float32(a + bufs[o][q * plan["sh"] + e - lo])
                b = np.float32(b + parts[q, e])
            assert a.tobytes() == b.tobytes()


def test_self_quant_units_cover_every_chunk_at_the_launch_splits():
    """The self-quantizing K2's quantization work units (thread ctid's units ctid + 128 u, u <
    SQ_UNITS, over the CTA's M x k-block x 8 chunks) cover every chunk once, and its k-blocks fit
    x_q's smem room, at every split launch() accepts: the default builds and the wide ones
    (Config.sq_xblocks) whose bound depends on M."""
    from kernels_dsl import k2_gemm

    builds = [k2_gemm.default_config(8, 128, lora=False, self_quant=True)]
    builds += [k2_gemm.wide_config(builds[0])]
    for cfg in builds:
        for K in (128, 2560, 4096, 12288, 14336, 29568 // 128 * 128):
            nk = K // 128
            for M in range(1, cfg.bn + 1):
                lo_split = k2_gemm.min_split(cfg, K, M)
                for split in range(lo_split, min(16, nk) + 1):
                    for rank in range(split):
                        lo, hi = k_range(rank, split, nk)
                        nunits = M * (hi - lo) * 8
                        covered = sorted(t + 128 * u for t in range(128) for u in range(k2_gemm.SQ_UNITS)
                                         if t + 128 * u < nunits)
                        assert covered == list(range(nunits)), (cfg.name(), K, M, split)
                        assert hi - lo <= cfg.x_kblocks
                if lo_split > 1:  # one less: some CTA would leave chunks unquantized or overflow x_q
                    most = max(hi - lo for lo, hi in (k_range(r, lo_split - 1, nk) for r in range(lo_split - 1)))
                    assert M * most * 8 > 128 * k2_gemm.SQ_UNITS or most > cfg.x_kblocks
