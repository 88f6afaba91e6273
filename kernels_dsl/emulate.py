"""Pure-torch emulation of the decode path's two kernels, CTA by CTA (CPU, no GPU).

It follows the kernels' decomposition exactly: the shrink grid's (split, slice*chunk, group)
CTAs and the quantization plane; K2's (split, tile) CTAs, each CTA's K range, the round-robin
assignment of (adapter group, rank chunk) items to the CTAs of a cluster, the bf16 masked h
chunks, the per-split partial partial = acc * s_x * s_w + acc_lora and the fixed-order split sum.
Inside one k-block the math is a plain fp32 matmul (WGMMA's internal order is the hardware's),
so the emulation checks the decomposition, the grouping and the bookkeeping, and that the
result does not depend on the order in which CTAs run, not the GPU's bits.
"""

from __future__ import annotations

import random

import torch

from epilora_cute.reference import adapter_view, quantize_fp8_per_token


def k_range(split: int, nsplit: int, nk: int) -> tuple[int, int]:
    """k-blocks [lo, hi) of cluster rank `split` (same integer formula as the kernels)."""
    return split * nk // nsplit, (split + 1) * nk // nsplit


def lora_items(active_ids: list[int], num_active: int, slot_ranks: list[int], rank: int, chunk: int):
    """The epilogue's items in enumeration order: (adapter slot, rank chunk index)."""
    items = []
    for g in range(num_active):
        lid = active_ids[g]
        if lid < 0:
            continue
        reff = max(min(slot_ranks[lid], rank), 0)
        for c in range(-(-reff // chunk)):
            items.append((lid, c))
    return items


def k2_items(token_lora, slot_ranks: list[int], rank: int, chunk: int):
    """K2's epilogue items in its enumeration order: the tile's adapter groups in the order of
    each slot's first token (K2 builds this table from token_lora itself), then rank chunks."""
    items, seen = [], set()
    for t in [int(v) for v in token_lora]:
        if t < 0 or t in seen:
            continue
        seen.add(t)
        reff = max(min(slot_ranks[t], rank), 0)
        items += [(t, c) for c in range(-(-reff // chunk))]
    return items


def z_group_slices(row_group, start, r0: int, rows: int, nz: int):
    """K1's and expand-add's group split: the adapter groups of the row tile [r0, r0 + rows) dealt
    to the nz CTAs along grid z (the kernels' own integer formula). Yields, per z, the group
    indices and the tile rows [row_lo, row_hi) they cover, relative to r0 (empty when z has none)."""
    g_tile = int(row_group[r0])
    ng_tile = int(row_group[r0 + rows - 1]) - g_tile + 1
    per_z = -(-ng_tile // nz)
    for z in range(nz):
        gz_lo = min(z * per_z, ng_tile)
        n_groups = max(min(per_z, ng_tile - gz_lo), 0)
        g_first = g_tile + gz_lo
        row_lo = max(int(start[g_first]) - r0, 0)
        row_hi = max(min(int(start[g_first + n_groups]) - r0, rows), row_lo)
        yield range(g_first, g_first + n_groups), row_lo, row_hi


def emulate_quant_planes(x, split: int, y_dim: int, threads: int = 128, qv: int = 8, order_seed=None):
    """The shrink kernel's quantization planes CTA by CTA, thread by thread: which CTA takes which
    token and which 16-byte vectors of its row (one token per CTA, or one per cluster with the row
    split over its `split` CTAs when M <= y_dim), each thread's batches of `qv` vectors with the
    loads clamped into the CTA's range and the stores predicated, the per-CTA maxima combined
    over the cluster. Returns (x_q [M, K] e4m3, s_x [M] fp32, writes [M, K/8]: how many times
    each vector was stored)."""
    from epilora_cute.reference import FP8_DTYPE, MIN_SCALE, FP8_MAX, _clamp_like_cuda

    M, K = x.shape
    nvec = K // 8
    xv = x.float().reshape(M, nvec, 8)
    per_plane = split * y_dim
    zq = max(1, -(-M // per_plane))
    rows_split = M <= y_dim
    xq = torch.zeros(M, K, dtype=torch.float32)
    sx = torch.full((M,), float("nan"))
    writes = torch.zeros(M, nvec, dtype=torch.int32)
    ctas = [(bx, by, bz) for bz in range(zq) for by in range(y_dim) for bx in range(split)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(ctas)

    def ranges(bx):
        return (bx * nvec // split, (bx + 1) * nvec // split) if rows_split else (0, nvec)

    def thread_vectors(lo, hi, t):  # (clamped load index, store index or None) per batch slot
        for j0 in range(lo + t, hi, threads * qv):
            for u in range(qv):
                j = j0 + threads * u
                yield min(j, hi - 1), (j if j < hi else None)

    memo = {}

    def cta_amax(m, lo, hi):  # every thread's clamped loads, then the max over the CTA
        if (m, lo, hi) not in memo:
            loaded = [jl for t in range(threads) for jl, _ in thread_vectors(lo, hi, t)]
            memo[m, lo, hi] = xv[m, loaded].abs().max() if loaded else torch.tensor(0.0)
        return memo[m, lo, hi]

    for bx, by, bz in ctas:
        m = by if rows_split else (bz * y_dim + by) * split + bx
        if m >= M:
            continue
        lo, hi = ranges(bx)
        amax = cta_amax(m, lo, hi)
        if rows_split:  # the cluster's maxima, from every CTA's own range
            for q in range(split):
                amax = torch.maximum(amax, cta_amax(m, *ranges(q)))
        scale = torch.maximum(amax / torch.tensor(FP8_MAX), torch.tensor(MIN_SCALE))
        if bx == 0 or not rows_split:
            sx[m] = scale
        for t in range(threads):
            for jl, js in thread_vectors(lo, hi, t):
                if js is not None:
                    xq[m, js * 8:(js + 1) * 8] = _clamp_like_cuda(xv[m, jl] / scale)
                    writes[m, js] += 1
    return xq.to(FP8_DTYPE), sx, writes


def emulate_shrink(x, lora_a, token_lora, active_ids, num_active, slot_ranks, rank, split, bk=64,
                   order_seed=None):
    """h [slices, M, R] fp32 (rows of tokens without adapter left NaN = never written),
    x_q [M, K] e4m3, s_x [M] fp32."""
    M, K = x.shape
    ns = len(lora_a)
    n_chunks = -(-rank // 64)
    h = torch.full((ns, M, rank), float("nan"), dtype=torch.float32)
    xq, sx = quantize_fp8_per_token(x)  # the quantization plane is bit-exact by construction
    nk = -(-K // bk)
    xf = x.float()
    ctas = [(sl, c, g) for sl in range(ns) for c in range(n_chunks) for g in range(min(M, len(active_ids)))]
    if order_seed is not None:
        random.Random(order_seed).shuffle(ctas)
    for sl, c, g in ctas:
        lid = active_ids[g] if g < num_active else -1
        reff = max(min(slot_ranks[lid], rank), 0) if lid >= 0 else 0
        if c * 64 >= reff:
            continue
        a = adapter_view(lora_a[sl])[lid].float()  # [R, K]
        rows = slice(c * 64, min(c * 64 + 64, rank))
        partials = []
        for s in range(split):
            lo, hi = k_range(s, split, nk)
            k0, k1 = lo * bk, min(hi * bk, K)
            acc = torch.zeros(rows.stop - rows.start, M)
            for kb in range(lo, hi):  # one WGMMA k-block at a time
                ka, kb_end = kb * bk, min((kb + 1) * bk, K)
                acc += a[rows, ka:kb_end] @ xf[:, ka:kb_end].t()
            partials.append(acc)
        tot = torch.zeros_like(partials[0])
        for p in partials:  # fixed order 0..S-1
            tot = tot + p
        for j in range(M):
            if int(token_lora[j]) == lid:
                h[sl, j, rows] = tot[:, j]
    return h, xq, sx.reshape(-1)


def emulate_k2(xq, sx, w_codes, w_scale, h, lora_b, token_lora, active_ids, num_active, slot_ranks,
               rank, bm, bn, split, bk=128, lora=True, order_seed=None):
    """y [M, N] bf16 as K2 computes it (M <= bn)."""
    M, K = xq.shape
    N = w_codes.shape[0]
    assert M <= bn and N % bm == 0
    widths = [adapter_view(b).shape[1] for b in lora_b] if lora else [N]
    starts = [0]
    for wd in widths:
        starts.append(starts[-1] + wd)
    assert starts[-1] == N and all(wd % bm == 0 for wd in widths)
    chunk = max(16, min(rank, 64))
    items = k2_items(token_lora, slot_ranks, rank, chunk) if lora else []
    nk = -(-K // bk)
    wf = w_codes.float()
    xf = xq.float()
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    scale = sx.reshape(-1)[:, None].t() * w_scale.reshape(())  # [1, M]
    tiles = list(range(N // bm))
    if order_seed is not None:
        random.Random(order_seed).shuffle(tiles)
    for t in tiles:
        n0 = t * bm
        sl = max(i for i in range(len(widths)) if starts[i] <= n0)
        partials = [None] * split
        order = list(range(split))
        if order_seed is not None:
            random.Random(order_seed + t).shuffle(order)
        for s in order:  # CTAs of the cluster, in any order
            lo, hi = k_range(s, split, nk)
            acc = torch.zeros(bm, M)
            for kb in range(lo, hi):
                ka, ke = kb * bk, min((kb + 1) * bk, K)
                acc += wf[n0:n0 + bm, ka:ke] @ xf[:, ka:ke].t()
            acc_l = torch.zeros(bm, M)
            for idx, (lid, c) in enumerate(items):
                if idx % split != s:
                    continue
                b = adapter_view(lora_b[sl])[lid].float()  # [n_s, R]
                cols = range(c * chunk, c * chunk + chunk)
                bchunk = torch.zeros(bm, chunk)
                hm = torch.zeros(M, chunk)
                for i, col in enumerate(cols):
                    if col < rank:
                        bchunk[:, i] = b[n0 - starts[sl]:n0 - starts[sl] + bm, col]
                        for j in range(M):
                            if int(token_lora[j]) == lid:
                                hm[j, i] = h[sl, j, col]
                hm = hm.to(torch.bfloat16).float()  # WGMMA B operand is bf16
                reff = max(min(slot_ranks[lid], rank), 0)
                n_steps = (min(reff - c * chunk, chunk) + 15) // 16
                acc_l += bchunk[:, :16 * n_steps] @ hm[:, :16 * n_steps].t()
            part = acc * scale
            if lora:
                part = part + acc_l
            partials[s] = part
        tot = torch.zeros(bm, M)
        for s in range(split):  # fixed order, whoever finished first
            tot = tot + partials[s]
        y[:, n0:n0 + bm] = tot.t().to(torch.bfloat16)
    return y
