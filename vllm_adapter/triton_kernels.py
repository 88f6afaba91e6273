"""Portable Triton kernels for multi-tenant LoRA on FP8 linears (the Ada / sm_89 fallback).

Two launches serve every tenant of a batch (vLLM needs four: quant, shrink, GEMM, expand):

* ``quant_shrink_kernel`` (K1): vLLM-exact per-token FP8 quantization of bf16 ``x`` (codes and
  fp32 scales, bit-identical to ``reference.quantize_fp8_per_token``) and the LoRA shrink
  ``h_s = x @ A_s^T`` (fp32, from bf16 x) for every adapter group and every output slice, with
  split-K reduced in a fixed order.
* ``gemm_lora_kernel`` (K2): the FP8 GEMM over tokens sorted by adapter with the grouped LoRA
  expand ``h_s @ B_s^T`` added in the epilogue; bf16 ``y`` written once, in token order. The W8A16
  variant widens FP8 weights to bf16 in registers and multiplies bf16 activations.

Reads of x: K1's quantizer programs split each row tile's rows between them and read their rows
twice (amax over the whole row, then codes; the second read hits L1/L2); each shrink program
reads its K chunk of the rows of each adapter group once. So x comes from DRAM about once, but it
is not read once per tile in one pass: the per-token amax needs the full row before any code.

Layouts (all row-major, last dim contiguous):

* ``x`` [M, K] bf16; codes [M, K] stored as uint8 (the bits of float8_e4m3fn); scales [M] fp32.
* ``h`` [S, M, R] fp32, original token order; rows of tokens without adapter, and rank columns at
  or beyond a slot's effective rank, hold 0.
* split-K partials [SPLIT_K, S, M, R] fp32 plus one int32 arrival counter per (row tile, slice,
  rank block); the last program to arrive sums the partials in split order 0, 1, ... (integer
  atomics only: no float atomics, so the result does not depend on arrival order). Counters are
  reset by that last program, so the buffer stays zero between launches (CUDA-graph safe).
* adapter buffers: one pointer per slice in an int64 table (slices are separate allocations in
  vLLM); each is contiguous, A [L, 1, R, K] (same shape for every slice) and B [L, 1, n_s, R].
* ``BF16_DOT_VIA_FP32`` (set for CPU tensors): the Triton interpreter (3.9) multiplies bf16 dot
  operands as their raw uint16 bits, so there both operands are widened to fp32 first; bf16
  products are exact in fp32, so the sums are the tensor-core bf16 dot's up to summation order.
* K2 column tiles never straddle a slice: ``col_tiles`` [T, 4] int32 holds, per column tile, its
  slice, first column within the slice, the slice's first column in y, and the slice's width.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
# reference.MIN_SCALE = fp32(1 / (448 * 512)); this literal is that fp32 value exactly.
FP8_MIN_SCALE = tl.constexpr(4.359654017479625e-06)
# Smallest normal e4m3 magnitude; below it codes are multiples of 2^-9.
E4M3_MIN_NORMAL = tl.constexpr(0.015625)


# ----------------------------------------------------------------------------- small helpers

@triton.jit
def _fp8_e4m3_rne_bits(q):
    """Bits of float8_e4m3fn nearest to q (ties to even), for NaN-free |q| <= 448.

    Done with fp32 adds and integer ops instead of ``q.to(tl.float8e4nv)`` because the Triton
    interpreter's fp8 cast rounds half away from zero and ignores sticky bits (47 of 4096 random
    values came out wrong); this one code path is bit-exact on the interpreter and on GPUs alike.
    """
    q_bits = q.to(tl.int32, bitcast=True)
    sign = (q_bits >> 31) & 1
    mag = tl.abs(q)
    # e4m3 spacing near mag is 2^(e-3) for normals (e = floor(log2 mag)), 2^-9 below 2^-6.
    pow2_e = (mag.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    pow2_e = tl.maximum(pow2_e, E4M3_MIN_NORMAL)
    # Adding 2^(e+20) leaves the fp32 sum an ulp of exactly 2^(e-3): the IEEE add rounds mag to
    # the e4m3 grid with ties to even, and subtracting it back is exact.
    magic = pow2_e * 1048576.0
    rounded = (mag + magic) - magic
    r_bits = rounded.to(tl.int32, bitcast=True)
    normal_code = (((r_bits >> 23) - 120) << 3) | ((r_bits >> 20) & 7)  # 120 = 127 - 7 (biases)
    subnormal_code = (rounded * 512.0).to(tl.int32)  # k * 2^-9 -> k
    code = tl.where(rounded >= E4M3_MIN_NORMAL, normal_code, subnormal_code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _row_tile_groups(row_group_ptr, row0, M, BLOCK_M: tl.constexpr):
    """First and last adapter group met by sorted rows [row0, min(row0 + BLOCK_M, M))."""
    g_first = tl.load(row_group_ptr + row0)
    g_last = tl.load(row_group_ptr + tl.minimum(row0 + BLOCK_M, M) - 1)
    return g_first, g_last


@triton.jit
def _effective_rank(slot_ranks_ptr, lora, R, HAS_SLOT_RANKS: tl.constexpr):
    """Rank to compute for a slot: its slot_ranks entry clamped to [0, R], or R; 0 for id -1."""
    if HAS_SLOT_RANKS:
        eff = tl.load(slot_ranks_ptr + tl.maximum(lora, 0))
        eff = tl.minimum(tl.maximum(eff, 0), R)
    else:
        eff = R
    return tl.where(lora >= 0, eff, 0)


@triton.jit
def _slice_ptr(table_ptr, s):
    """Base pointer of slice s's bf16 adapter buffer (vLLM keeps each slice in its own tensor)."""
    ptr = tl.load(table_ptr + s).to(tl.pointer_type(tl.bfloat16))
    return tl.multiple_of(ptr, 16)  # torch allocations are 256-byte aligned; lets loads vectorize


# ----------------------------------------------------------------------------- K1

@triton.jit
def _quantize_rows(x_ptr, stride_xm, codes_ptr, scales_ptr, row_lo, row_hi, K,
                   ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Scales and codes of rows [row_lo, min(row_lo + ROWS, row_hi)), all K columns.

    Two passes over the rows: amax, then codes (the second read hits L1/L2). Both loops are
    latency bound (a load, then a reduction), so tiles are wide and rows few: the quantizer
    programs of a row tile split its rows between them rather than its columns.
    """
    rows = row_lo + tl.arange(0, ROWS)
    row_ok = rows < row_hi
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xf = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0).to(tl.float32)
        # fmaxf from 0: NaN never wins, +inf does; max is exact, so any order gives the same bits.
        amax = tl.maximum(amax, tl.max(tl.where(xf != xf, 0.0, tl.abs(xf)), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FP8_MIN_SCALE)  # IEEE division, as CUDA's '/'
    tl.store(scales_ptr + rows, scale, mask=row_ok)
    code_rows = codes_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks[None, :] < K)
        xf = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.math.div_rn(xf, scale[:, None])  # x / scale, not x * (1 / scale): vLLM divides
        q = tl.where(q != q, FP8_MAX, q)  # fminf(NaN, 448) = 448
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(code_rows + ks[None, :], _fp8_e4m3_rne_bits(q), mask=mask)


@triton.jit
def _shrink_partial(x_ptr, stride_xm, a_base, stride_al, stride_ar, tok, row_ok, row_lora,
                    g_first, g_last, active_ids_ptr, slot_ranks_ptr, R, rank_lo, k_lo, k_hi,
                    HAS_SLOT_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_R: tl.constexpr, BF16_DOT_VIA_FP32: tl.constexpr):
    """sum over k in [k_lo, k_hi) of x[tok, k] * A[lora(tok), rank_lo + j, k], fp32 [BLOCK_M, BLOCK_R].

    One adapter group at a time: its rows are loaded (others masked to 0) against its A tile, so
    every row gets exactly its own adapter's products and the rest add exact zeros.
    """
    ranks = rank_lo + tl.arange(0, BLOCK_R)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for g in range(g_first, g_last + 1):
        lora = tl.load(active_ids_ptr + g)
        eff = _effective_rank(slot_ranks_ptr, lora, R, HAS_SLOT_RANKS)
        if rank_lo < eff:  # also skips id -1 (eff 0) and rank blocks past the slot's rank
            in_group = row_ok & (row_lora == lora)
            a_rows = a_base + lora.to(tl.int64) * stride_al + ranks[None, :] * stride_ar
            rank_ok = ranks[None, :] < eff
            for k0 in range(k_lo, k_hi, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_hi
                xt = tl.load(x_rows + ks[None, :], mask=in_group[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_rows + ks[:, None], mask=rank_ok & k_ok[:, None], other=0.0)  # [BK, BR]
                if BF16_DOT_VIA_FP32:  # see the module docstring: interpreter bf16 dot
                    acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xt, at, acc)
    return acc


@triton.jit
def _store_h(acc, h_ptr, ws_ptr, counter_ptr, split, offs, mask, split_stride, SPLIT_K: tl.constexpr):
    """Write h; with split-K, park the partial and let the last split to arrive sum them all.

    The sum runs in split order 0, 1, ... whatever the arrival order, so h is bitwise
    reproducible; only the arrival counter is atomic (integers, no float atomics).
    """
    if SPLIT_K == 1:
        tl.store(h_ptr + offs, acc, mask=mask)
    else:
        tl.store(ws_ptr + split * split_stride + offs, acc, mask=mask)
        # Every thread's partial must be written before the single release below publishes it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            # Unrolled, so that all loads are in flight together (a rolled loop waits on each).
            # .cg reads L2, where the other programs' partials are, never a stale L1 line.
            for i in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + i * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(h_ptr + offs, total, mask=mask)
            tl.atomic_xchg(counter_ptr, 0)  # zero again for the next launch / graph replay


@triton.jit(do_not_specialize=["M"])
def quant_shrink_kernel(
        x_ptr, stride_xm, codes_ptr, scales_ptr,
        a_table_ptr, stride_al, stride_ar,
        h_ptr, ws_ptr, counters_ptr,
        sorted_idx_ptr, sorted_lora_ptr, row_group_ptr, active_ids_ptr, slot_ranks_ptr,
        M, K, R, k_per_split,
        NUM_SLICES: tl.constexpr, NUM_RANK_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr,
        QUANTIZE: tl.constexpr, HAS_SLOT_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, QUANT_ROWS: tl.constexpr,
        QUANT_BLOCK_K: tl.constexpr, BF16_DOT_VIA_FP32: tl.constexpr):
    """K1. Grid: (roles, SPLIT_K, row tiles); roles = slices x rank blocks (+1 quantizer).

    Roles run side by side on the same x tile (role is the fastest grid axis, so they share L2).
    Shrink roles walk rows sorted by adapter, each split over a K chunk; the quantizer role walks
    rows in token order, each split over QUANT_ROWS rows (all of K: the amax needs the full row).
    """
    role = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    num_shrink_roles: tl.constexpr = NUM_SLICES * NUM_RANK_BLOCKS
    if role == num_shrink_roles:  # only launched when QUANTIZE
        if QUANTIZE:
            # The SPLIT_K quantizer programs of this row tile take QUANT_ROWS rows each.
            q_row0 = row0 + split * QUANT_ROWS
            row_hi = tl.minimum(row0 + BLOCK_M, M)
            if q_row0 < row_hi:
                _quantize_rows(x_ptr, stride_xm, codes_ptr, scales_ptr, q_row0, row_hi, K,
                               QUANT_ROWS, QUANT_BLOCK_K)
    else:
        s = role // NUM_RANK_BLOCKS
        rank_lo = (role % NUM_RANK_BLOCKS) * BLOCK_R
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        tok = tl.load(sorted_idx_ptr + rows, mask=row_ok, other=0)
        row_lora = tl.load(sorted_lora_ptr + rows, mask=row_ok, other=-1)
        g_first, g_last = _row_tile_groups(row_group_ptr, row0, M, BLOCK_M)
        acc = _shrink_partial(x_ptr, stride_xm, _slice_ptr(a_table_ptr, s), stride_al, stride_ar,
                              tok, row_ok, row_lora, g_first, g_last, active_ids_ptr, slot_ranks_ptr,
                              R, rank_lo, k_lo, k_hi, HAS_SLOT_RANKS, BLOCK_M, BLOCK_K, BLOCK_R,
                              BF16_DOT_VIA_FP32)
        ranks = rank_lo + tl.arange(0, BLOCK_R)
        out_mask = row_ok[:, None] & (ranks[None, :] < R)
        offs = s.to(tl.int64) * M * R + tok.to(tl.int64)[:, None] * R + ranks[None, :]
        counter = counters_ptr + tl.program_id(2) * num_shrink_roles + role
        _store_h(acc, h_ptr, ws_ptr, counter, split, offs, out_mask, NUM_SLICES * M.to(tl.int64) * R, SPLIT_K)


# ----------------------------------------------------------------------------- K2

@triton.jit
def _grouped_tile(pid, num_row_tiles, num_col_tiles, GROUP_M: tl.constexpr):
    """Map a linear program id to (row tile, col tile), GROUP_M row tiles at a time (L2 reuse of W)."""
    per_group = GROUP_M * num_col_tiles
    group = pid // per_group
    first_row_tile = group * GROUP_M
    rows_in_group = tl.minimum(num_row_tiles - first_row_tile, GROUP_M)
    row_tile = first_row_tile + (pid % per_group) % rows_in_group
    col_tile = (pid % per_group) // rows_in_group
    return row_tile, col_tile


@triton.jit
def _base_gemm(a_ptr, stride_am, w_ptr, tok, row_ok, cols, col_ok, K,
               W8A16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BF16_DOT_VIA_FP32: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = A[tok, :] @ W[cols, :]^T (A FP8 codes, or bf16 x for W8A16)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_rows = a_ptr + tok.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0)
        w = w.to(tl.float8e4nv, bitcast=True)  # [BK, BN]; zero byte = +0.0
        if W8A16:
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if BF16_DOT_VIA_FP32:  # see the module docstring: interpreter bf16 dot
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(tl.bfloat16), acc)  # e4m3 -> bf16 is exact
        else:
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
            acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), w, acc)
    return acc


@triton.jit
def _lora_expand_into(acc, h_ptr, b_base, width, s, tok, row_ok, row_lora,
                      n_local, col_ok, g_first, g_last, active_ids_ptr, slot_ranks_ptr, M, R,
                      HAS_SLOT_RANKS: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc += h_s[tok] @ B_s[lora(tok)][n_local]^T, one adapter group of the row tile at a time.

    B_s is a contiguous [L, width, R] buffer, so its strides follow from the slice's width.
    """
    h_rows = h_ptr + s.to(tl.int64) * M * R + tok.to(tl.int64)[:, None] * R
    for g in range(g_first, g_last + 1):
        lora = tl.load(active_ids_ptr + g)
        eff = _effective_rank(slot_ranks_ptr, lora, R, HAS_SLOT_RANKS)  # 0 for id -1: no work
        in_group = row_ok & (row_lora == lora)
        b_cols = b_base + (tl.maximum(lora, 0).to(tl.int64) * width + n_local[None, :]) * R
        for r0 in range(0, eff, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < eff
            ht = tl.load(h_rows + ranks[None, :], mask=in_group[:, None] & rank_ok[None, :], other=0.0)
            bt = tl.load(b_cols + ranks[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
            # tf32 operands: bf16 B is exact in tf32, h loses bits below 2^-11 relative.
            acc = tl.dot(ht, bt.to(tl.float32), acc, input_precision="tf32")
    return acc


@triton.jit(do_not_specialize=["M"])
def gemm_lora_kernel(
        a_ptr, stride_am, scales_ptr, w_ptr, w_scale_ptr,
        y_ptr, stride_ym, h_ptr, b_table_ptr, col_tiles_ptr,
        sorted_idx_ptr, sorted_lora_ptr, row_group_ptr, active_ids_ptr, slot_ranks_ptr,
        M, K, R, num_col_tiles,
        W8A16: tl.constexpr, HAS_SLOT_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP_M: tl.constexpr, BF16_DOT_VIA_FP32: tl.constexpr):
    """K2. 1-D grid over (sorted row tiles x column tiles); every y element is stored once."""
    num_row_tiles = tl.cdiv(M, BLOCK_M)
    row_tile, col_tile = _grouped_tile(tl.program_id(0), num_row_tiles, num_col_tiles, GROUP_M)
    row0 = row_tile * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    tok = tl.load(sorted_idx_ptr + rows, mask=row_ok, other=0)
    row_lora = tl.load(sorted_lora_ptr + rows, mask=row_ok, other=-1)

    tile_info = col_tiles_ptr + col_tile * 4
    s = tl.load(tile_info)
    n_local = tl.load(tile_info + 1) + tl.arange(0, BLOCK_N)
    width = tl.load(tile_info + 3)
    col_ok = n_local < width
    cols = tl.load(tile_info + 2) + n_local

    acc = _base_gemm(a_ptr, stride_am, w_ptr, tok, row_ok, cols, col_ok, K, W8A16, BLOCK_M, BLOCK_N, BLOCK_K,
                     BF16_DOT_VIA_FP32)
    if W8A16:
        acc = acc * tl.load(w_scale_ptr)
    else:
        x_scale = tl.load(scales_ptr + tok, mask=row_ok, other=0.0)
        acc = acc * (x_scale[:, None] * tl.load(w_scale_ptr))
    g_first, g_last = _row_tile_groups(row_group_ptr, row0, M, BLOCK_M)
    acc = _lora_expand_into(acc, h_ptr, _slice_ptr(b_table_ptr, s), width, s, tok, row_ok,
                            row_lora, n_local, col_ok, g_first, g_last, active_ids_ptr, slot_ranks_ptr, M, R,
                            HAS_SLOT_RANKS, BLOCK_R)
    y_offs = tok.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptr + y_offs, acc.to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])
