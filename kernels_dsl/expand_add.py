"""Hybrid-path expand-add (issue 4, 33..8192 tokens): y[M, N] += concat_s(h_s . B_s[slot]^T), CuTe-DSL.

y already holds the base GEMM's bf16 output (e.g. vLLM's CUTLASS FP8 GEMM); h is the shrink's fp32
[num_slices, M, R] (or K1's bf16 h, v0.71: the same bf16 operand without the conversion); B_s are
vLLM's per-slice buffers [max_loras, 1, n_s, R] bf16. The result is
bf16(fp32(y) + sum_k bf16(h)[m, k] * B[n, k]) (fp32 accumulation, one rounding), rows of tokens
without an adapter (slot -1) are neither read nor written.

Tiling: the CONCATENATED output. blockIdx.x enumerates column tiles of BN columns slice by slice
(a tile never straddles two slices: each slice has ceil(n_s / BN) tiles), blockIdx.y row tiles of
BM rows in the adapter-sorted token order (metadata.token_indices_sorted_by_lora_ids), so a row
tile meets the few adapter groups row_group[r0] .. row_group[r1 - 1]. The slice widths are
kernel arguments (int32 scalars), not loads: the slice, its column offset and the B row of a
tile are a few integer ops on values already in registers (the paper's account of vLLM's expand
cost is exactly the memory-read, unspecializable slice offsets/strides).

MMA: warp-level mma.sync m16n8k16 bf16 -> fp32 (sm80 atom, runs at full rate on Hopper's tensor
cores for this shape class). Why not WGMMA: the operands are tiny (K = rank <= 256), so the kernel
is bound by reading/writing y (4 bytes per output element) and the MMA is a few percent of the
time; what matters is skipping work per adapter group, and mma.sync does that per 16-row warp
tile (a warp whose rows do not meet a group issues nothing for it) with A masked in registers,
where WGMMA would force 64-row granularity. Warp w owns rows [16w, 16w + 16) of the tile and all
BN columns.

Per CTA (v0.96: each step's loads are requested together, before the first of them is waited
for, as their dependencies allow: row_group and the rows' token indices and slots; then the first
group's slot, the groups' bounds and h into registers; then that group's B):
  1. h rows of the tile (gathered by token index, slice s) -> bf16 -> smem sA [BM, R].
  2. for each adapter group g meeting the tile (slot lid = active_lora_ids[g], rows
     [start_loc[g], start_loc[g+1]) n tile): B_s[lid] rows [c0, c0 + BN) -> smem (cp.async, double
     buffered across groups: group g+1's B is in flight while g computes); each warp whose rows
     meet g: ldmatrix A, zero the rows outside g, ldmatrix B, mma into the warp's accumulator.
     Rank skipping: with slot_ranks (has_ranks != 0) only the k16 steps below the slot's
     effective rank are loaded and multiplied (vLLM zero-pads B beyond it, so this is exact).
  3. accumulator -> smem (fp32, reusing the B buffers) -> each thread: one 16-byte y load, 8 fp32
     adds, one rounding, one 16-byte store, for rows with an adapter.
Every output element is computed by exactly one thread in a fixed order: bitwise deterministic.

B pointers: one tensor parameter per slice (compile-time num_slices <= 4). vLLM keeps one buffer
per slice (lora_b_stacked is a tuple), so the plugin passes the views as they are; a pointer
array would cost a dependent load per tile and a host-side table to keep valid under CUDA graphs.
"""

from __future__ import annotations

import sys
import functools
import dataclasses
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import ScalarParam, TensorParam
from epilora_cute.reference import adapter_view

try:  # the DSL is needed to compile, not to launch a cached build
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync, warp

    from . import _dsl
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "expand_add"
RUNTIME_CONTRACT = True

RANKS = (8, 16, 32, 64, 128, 256)
C_PAD = 4  # fp32 words of padding per row of the epilogue staging tile (16-byte rows, fewer conflicts)
COLUMN_TILES_PER_CTA = (1, 2, 4, 8)
B_RING_DEPTHS = (2, 3, 4)


@dataclass(frozen=True)
class Config:
    """rank: the buffers' rank R (vLLM's max_lora_rank). num_slices: 1..4 B buffers.
    bm: token rows per CTA (16 per warp). bn: output columns per CTA (multiple of 16).
    h_bf16: h arrives as bf16 (K1's h_bf16 store): staged into smem as it is, half the bytes and
    no conversion; the MMA operand is the same bf16 value either way (v0.71).
    ct: column tiles per CTA (v0.72). A CTA stages its rows' h once and sweeps ct consecutive
    column tiles of one slice; the B tile of the next (tile, group) is in flight during the
    current MMAs and epilogue, and the epilogue tile has its own smem. 1: one tile per CTA.
    nb: depth of the B ring (v0.75): nb - 1 (tile, group) B tiles in flight ahead of the MMAs
    (2: the double buffer); with ct = 1 the epilogue tile still reuses the ring."""

    rank: int = 64
    num_slices: int = 1
    bm: int = 64
    bn: int = 128
    h_bf16: bool = False
    ct: int = 1
    nb: int = 2

    def __post_init__(self):
        if self.rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}")
        if not 1 <= self.num_slices <= 4:
            raise ValueError("num_slices must be 1..4")
        if self.bm not in (32, 64, 128):
            raise ValueError("bm must be 32, 64 or 128")
        if self.bn not in (64, 128, 256):
            raise ValueError("bn must be 64, 128 or 256")
        if self.threads // (self.rank_pad // 8) > self.bn:
            raise ValueError("the B tile copy needs threads / (rank_pad / 8) <= bn")
        if self.ct not in COLUMN_TILES_PER_CTA:
            raise ValueError(f"ct must be one of {COLUMN_TILES_PER_CTA}")
        if self.nb not in B_RING_DEPTHS:
            raise ValueError(f"nb must be one of {B_RING_DEPTHS}")

    @property
    def rank_pad(self) -> int:
        """K of the MMA: the rank rounded up to the k16 step (rank 8 is zero-padded to 16)."""
        return max(16, self.rank)

    @property
    def threads(self) -> int:
        return self.bm // 16 * 32

    def name(self) -> str:
        hb = "_hb" if self.h_bf16 else ""
        ct = f"_ct{self.ct}" if self.ct > 1 else ""
        nb = f"_nb{self.nb}" if self.nb != 2 else ""
        return f"r{self.rank}_s{self.num_slices}_bm{self.bm}_bn{self.bn}{hb}{ct}{nb}"

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @functools.cached_property  # launches ask for it on every call
    def smem_bytes(self) -> int:
        """Dynamic smem, the kernel's struct field by field: sA (bf16 [bm, Rp]) then the B ring
        (nb tiles), which the fp32 epilogue tile [bm, bn + C_PAD] reuses (the larger of the two) —
        or, sweeping columns (ct > 1), follows: the next tile's B flies while the epilogue runs."""
        a = self.bm * self.rank_pad * 2
        b = self.nb * self.bn * self.rank_pad * 2
        c = self.bm * (self.bn + C_PAD) * 4
        if self.ct == 1:
            return _align(_align(a, 1024) + max(b, c), 1024)
        return _align(_align(_align(a, 1024) + b, 1024) + c, 1024)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    i32, f32, bf16 = torch.int32, torch.float32, torch.bfloat16
    p = [
        TensorParam("y", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, N]
        TensorParam("h", bf16 if config.h_bf16 else f32, 3, dynamic_shape=(1,), dynamic_stride=(0,),
                    align=16),  # [S, M, R]
        TensorParam("token_indices_sorted", i32, 1, dynamic_shape=(0,), align=4),  # [>= M]
        TensorParam("sorted_lora_ids", i32, 1, dynamic_shape=(0,), align=4),  # [>= M]
        TensorParam("row_group", i32, 1, dynamic_shape=(0,), align=4),  # [>= M]
        TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras + 1]
        TensorParam("lora_token_start_loc", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras + 2]
        TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras] (or a dummy)
    ]
    for s in range(config.num_slices):  # B_s viewed as [max_loras * n_s, R], R compiled in
        p.append(TensorParam(f"b{s}", bf16, 2, dynamic_shape=(0,), align=16))
    for s in range(config.num_slices):
        p.append(ScalarParam(f"n{s}", "i"))  # slice widths
    p.append(ScalarParam("has_ranks", "i"))
    return p


if cute is not None:

    class _ExpandAddKernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.R = cfg.rank
            self.RP = cfg.rank_pad
            self.BM, self.BN = cfg.bm, cfg.bn
            self.threads = cfg.threads

        def _smem_ab_layout(self, rows: int, stages: int | None = None):
            """K-major bf16 tile [rows, RP] (x stages), 16-byte chunks swizzled across rows so that
            ldmatrix (8 rows x 16 bytes) and the 16-byte cp.async stores are conflict-free."""
            RP = self.RP
            width = min(RP, 64)  # elements per swizzle row (<= 128 bytes)
            bits = {16: 1, 32: 2, 64: 3}[width]
            # The swizzle ends up in the smem pointer and acts on byte addresses: M = 4 keeps the
            # 16-byte chunks whole (M = 3 split them, and 16-byte stores faulted as misaligned).
            atom = cute.make_composed_layout(cute.make_swizzle(bits, 4, 3), 0,
                                             cute.make_layout((8, width), stride=(width, 1)))
            shape = (rows, RP) if stages is None else (rows, RP, stages)
            order = (0, 1) if stages is None else (0, 1, 2)
            return cute.tile_to_shape(atom, shape, order)

        @cute.jit
        def __call__(self, y: cute.Tensor, h: cute.Tensor, tok: cute.Tensor, sorted_ids: cute.Tensor,
                     row_group: cute.Tensor, active: cute.Tensor, start_loc: cute.Tensor,
                     slot_ranks: cute.Tensor, n_widths: tuple, has_ranks: cutlass.Int32,
                     stream: cuda.CUstream, b_bufs: tuple):
            cfg = self.cfg
            sA_layout = self._smem_ab_layout(self.BM)
            sB_layout = self._smem_ab_layout(self.BN, cfg.nb)
            sC_layout = cute.make_layout((self.BM, self.BN), stride=(self.BN + C_PAD, 1))
            WM = self.BM // 16
            tiled_mma = cute.make_tiled_mma(
                warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)), (WM, 1, 1),
                permutation_mnk=(WM * 16, 16, 16))
            # B tile loads: 16-byte cp.async, a row of RP bf16 is RP/8 chunks.
            cpr = self.RP // 8
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                      cutlass.BFloat16, num_bits_per_copy=128)
            tiled_copy_b = cute.make_tiled_copy_tv(
                g2s, cute.make_layout((self.threads // cpr, cpr), stride=(cpr, 1)), cute.make_layout((1, 8)))
            c_elems = cute.cosize(sC_layout) * 2  # fp32 epilogue tile in bf16 units (it reuses sB)

            if cutlass.const_expr(cfg.ct == 1):
                @cute.struct
                class Storage:
                    sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sA_layout)], 1024]
                    sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, max(cute.cosize(sB_layout), c_elems)],
                                          1024]
            else:  # sweeping columns: the epilogue tile beside the B buffers (the next tile's B flies)
                @cute.struct
                class Storage:
                    sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sA_layout)], 1024]
                    sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sB_layout)], 1024]
                    sC: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sC_layout)], 1024]

            self.storage = Storage
            self.smem_size = Storage.size_in_bytes()
            self.kernel(y, h, tok, sorted_ids, row_group, active, start_loc, slot_ranks, b_bufs, n_widths,
                        has_ranks, sA_layout, sB_layout, sC_layout, tiled_mma, tiled_copy_b).launch(
                grid=(1, 1, 1), block=(self.threads, 1, 1), smem=cfg.smem_bytes, stream=stream)

        @cute.kernel
        def kernel(self, mY: cute.Tensor, mH: cute.Tensor, mTok: cute.Tensor, mSorted: cute.Tensor,
                   mRowGroup: cute.Tensor, mActive: cute.Tensor, mStart: cute.Tensor, mRanks: cute.Tensor,
                   mBs: tuple, n_widths: tuple, has_ranks: cutlass.Int32, sA_layout: cute.ComposedLayout,
                   sB_layout: cute.ComposedLayout, sC_layout: cute.Layout, tiled_mma: cute.TiledMma,
                   tiled_copy_b: cute.TiledCopy):
            cfg = self.cfg
            BM, BN, R, RP = self.BM, self.BN, self.R, self.RP
            S = cfg.num_slices
            NT = self.threads
            tidx, _, _ = cute.arch.thread_idx()
            bx, by, bz = cute.arch.block_idx()
            _, _, nz = cute.arch.grid_dim()
            warp_i = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            M = cute.size(mY, mode=[0])

            # ---- which slice / columns: tiles of each slice are consecutive in blockIdx.x --------
            # (ct > 1: blockIdx.x enumerates chunks of ct consecutive tiles of one slice)
            CT = cfg.ct
            sl = cutlass.Int32(-1)
            c0 = cutlass.Int32(0)  # first column of the (first) tile inside its slice
            col_base = cutlass.Int32(0)  # first column of the slice in y
            n_s = cutlass.Int32(0)
            n_tiles = cutlass.Int32(1)  # tiles of this CTA (ct > 1)
            t_start = cutlass.Int32(0)
            c_start = cutlass.Int32(0)
            for i in cutlass.range_constexpr(S):
                w_i = n_widths[i]
                nt = (w_i + BN - 1) // BN
                if cutlass.const_expr(CT == 1):
                    if bx >= t_start and bx < t_start + nt:
                        sl = cutlass.Int32(i)
                        c0 = (bx - t_start) * BN
                        col_base = c_start
                        n_s = w_i
                    t_start = t_start + nt
                else:
                    nch = (nt + CT - 1) // CT
                    if bx >= t_start and bx < t_start + nch:
                        sl = cutlass.Int32(i)
                        c0 = (bx - t_start) * (CT * BN)
                        col_base = c_start
                        n_s = w_i
                        n_tiles = cutlass.min(nt - (bx - t_start) * CT, CT)
                    t_start = t_start + nch
                c_start = c_start + w_i
            r0 = by * BM
            rows = cutlass.min(M - r0, BM)
            if sl >= 0 and rows > 0:
                ncols = cutlass.min(n_s - c0, BN)
                # Level 1 of the CTA's dependent loads, all requested before any is waited for (each
                # level is an HBM round trip while the metadata is cold; v0.96: run46's profile had
                # the warps wait for the group bounds before asking for the slot, and ask for the
                # token indices only once B was requested): the groups of the tile's first and last
                # rows, the token of every row whose h this thread stages, and the token and slot
                # of every row whose y it adds to.
                h_toks = self._row_values(mTok, r0, rows, tidx, self._h_vectors_per_row(), self._h_chunks())
                ep_toks = h_toks
                if cutlass.const_expr(self._h_vectors_per_row() != BN // 8):  # other rows per chunk
                    ep_toks = self._row_values(mTok, r0, rows, tidx, BN // 8, self._epilogue_chunks())
                ep_slots = self._row_values(mSorted, r0, rows, tidx, BN // 8, self._epilogue_chunks())
                g_tile = mRowGroup[r0]
                g_last = mRowGroup[r0 + rows - 1]

                # This CTA's adapter groups: the tile's groups cut into grid-z chunks (group split).
                # A row belongs to one group, so each y row is written by exactly one z-CTA; nz = 1
                # is the tile's whole group range (rows [0, rows)).
                ng_tile = g_last - g_tile + 1
                per_z = (ng_tile + nz - 1) // nz
                gz_lo = cutlass.min(bz * per_z, ng_tile)
                n_groups = cutlass.max(cutlass.min(per_z, ng_tile - gz_lo), 0)
                g_first = g_tile + gz_lo
                # Level 2, together: the first group's slot (B's rows; clamped to a group of the
                # tile, so in bounds for a z-CTA without groups too), the groups' row bounds, h.
                lid_first = mActive[cutlass.min(g_first, g_last)]
                start_lo = mStart[g_first]
                start_hi = mStart[g_first + n_groups]
                hs = self._load_h(mH, h_toks, sl, rows, n_groups > 0, tidx)

                st = _dsl.smem_allocator().allocate(self.storage)
                sA = st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
                sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
                if cutlass.const_expr(CT == 1):
                    # The epilogue tile reuses the B buffers (both are dead by then).
                    sC = cute.make_tensor(cute.recast_ptr(st.sB.data_ptr(), dtype=cutlass.Float32), sC_layout)
                else:
                    sC = st.sC.get_tensor(sC_layout)

                # ---- level 3: group 0's B, while h lands in registers -------------------------
                thr_cb = tiled_copy_b.get_slice(tidx)
                tBsB = thr_cb.partition_D(sB)
                tBcB = thr_cb.partition_D(cute.make_identity_tensor((BN, RP)))
                if n_groups > 0:
                    self._load_b_slot(lid_first, 0, mRanks, has_ranks, mBs, sl, n_s, c0, ncols, tiled_copy_b, tBsB,
                                      tBcB)
                cute.arch.cp_async_commit_group()

                row_lo = cutlass.max(start_lo - r0, 0)
                row_hi = cutlass.max(cutlass.min(start_hi - r0, rows), row_lo)
                if n_groups > 0:  # a z-CTA without groups only passes the barriers
                    self._store_h(hs, sA, tidx)
                # The epilogue's token per chunk, -1 for rows without an adapter (slot -1).
                ep_t = [cutlass.select_(ep_slots[i] >= 0, ep_toks[i], -1) for i in range(len(ep_slots))]

                # ---- MMA fragments -------------------------------------------------------------
                thr_mma = tiled_mma.get_slice(tidx)
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB[None, None, 0]))
                tCcA = thr_mma.partition_A(cute.make_identity_tensor((BM, RP)))
                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
                acc.fill(0.0)
                s2r_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4),
                                                                   cutlass.BFloat16), tiled_mma)
                s2r_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4),
                                                                   cutlass.BFloat16), tiled_mma)
                thr_a = s2r_a.get_slice(tidx)
                thr_b = s2r_b.get_slice(tidx)
                frags = (s2r_a, s2r_b, thr_a.partition_S(sA), thr_a.retile(tCrA), thr_b.partition_S(sB),
                         thr_b.retile(tCrB), tCrA, tCrB, tCcA, tiled_mma, acc)

                w_lo = warp_i * 16  # this warp's rows in the tile
                NB = cfg.nb
                if cutlass.const_expr(CT == 1 and NB == 2):
                    for gi in cutlass.range(n_groups, unroll=1):
                        buf = gi % 2
                        # Prefetch the next group's B into the other buffer (always commit a group so
                        # that "all but the newest" below is always this group's B).
                        if gi + 1 < n_groups:
                            self._load_b(g_first + gi + 1, 1 - buf, mActive, mRanks, has_ranks, mBs, sl, n_s, c0,
                                         ncols, tiled_copy_b, tBsB, tBcB)
                        cute.arch.cp_async_commit_group()
                        cute.arch.cp_async_wait_group(1)
                        cute.arch.barrier()
                        self._mma_group(g_first + gi, buf, mActive, mRanks, has_ranks, mStart, r0, rows, w_lo, frags)
                        cute.arch.barrier()  # buffer `buf` is refilled two iterations later

                    # ---- epilogue: acc -> smem (fp32) -> y += tile, one rounding, 16-byte accesses
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    self._epilogue(mY, ep_t, sC, acc, thr_mma, row_lo, row_hi, ncols, col_base, c0, tidx)
                else:
                    # (tile j, group gi) pairs in order through the ring of NB B tiles: pair p + NB - 1's
                    # B (across tiles: the next tile's first groups after a tile's last) is requested
                    # before pair p's MMAs, so it flies during them and during the tile's epilogue.
                    # Pairs 1 .. NB - 2 go out now, after pair 0 (requested above). Nested loops, the
                    # epilogue after each tile's groups: a flat pair loop with the epilogue inside
                    # compiled to 242 registers at bn 128 / nb 3 (nested: 168; ct = 1, nb = 2: 154).
                    n_pairs = n_groups * n_tiles
                    for q0 in cutlass.range_constexpr(1, NB - 1):
                        if q0 < n_pairs:
                            self._load_pair(q0, q0, n_groups, g_first, c0, mActive, mRanks, has_ranks, mBs, sl, n_s,
                                            tiled_copy_b, tBsB, tBcB)
                        cute.arch.cp_async_commit_group()
                    p = cutlass.Int32(0)
                    n_tiles_live = cutlass.Int32(cutlass.select_(n_groups > 0, n_tiles, 0))  # none: nothing to add
                    for j in cutlass.range(n_tiles_live, unroll=1):
                        for gi in cutlass.range(n_groups, unroll=1):
                            buf = p % NB
                            qn = p + NB - 1
                            if qn < n_pairs:
                                self._load_pair(qn, qn % NB, n_groups, g_first, c0, mActive, mRanks, has_ranks, mBs,
                                                sl, n_s, tiled_copy_b, tBsB, tBcB)
                            cute.arch.cp_async_commit_group()
                            cute.arch.cp_async_wait_group(NB - 1)  # pair p's B (all but the NB - 1 newest)
                            cute.arch.barrier()
                            self._mma_group(g_first + gi, buf, mActive, mRanks, has_ranks, mStart, r0, rows, w_lo,
                                            frags)
                            cute.arch.barrier()  # buffer `buf` is refilled by a later request
                            p = p + 1
                        # tile j is complete: its epilogue, then a fresh acc. sC's last readers (tile
                        # j - 1) passed this tile's barriers already.
                        cj = c0 + j * BN
                        if cutlass.const_expr(CT == 1):
                            cute.arch.cp_async_wait_group(0)  # sC is the ring: no B request left
                        self._epilogue(mY, ep_t, sC, acc, thr_mma, row_lo, row_hi, cutlass.min(n_s - cj, BN),
                                       col_base, cj, tidx)
                        acc.fill(0.0)
                    cute.arch.cp_async_wait_group(0)

        @cute.jit
        def _load_pair(self, q, buf, n_groups, g_first, c0, mActive, mRanks, has_ranks, mBs, sl, n_s, tiled_copy_b,
                       tBsB, tBcB):
            """The B tile of (tile, group) pair q (tile q // n_groups of this CTA, its group
            q % n_groups) into ring buffer buf."""
            jq = q // n_groups
            c0q = c0 + jq * self.BN
            self._load_b(g_first + q - jq * n_groups, buf, mActive, mRanks, has_ranks, mBs, sl, n_s, c0q,
                         cutlass.min(n_s - c0q, self.BN), tiled_copy_b, tBsB, tBcB)

        @cute.jit
        def _mma_group(self, g, buf, mActive, mRanks, has_ranks, mStart, r0, rows, w_lo, frags):
            """One adapter group's k16 steps into the warp's accumulator, B from buffer buf; a warp
            whose 16 rows miss the group issues nothing, rows of other groups are zeroed in A."""
            s2r_a, s2r_b, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, tCcA, tiled_mma, acc = frags
            lid = mActive[g]
            keff = _dsl.k_eff(lid, mRanks, has_ranks, self.RP)  # MMA K (0: nothing to do)
            lo = cutlass.max(mStart[g] - r0, 0)
            hi = cutlass.min(mStart[g + 1] - r0, rows)
            # Warp-uniform: does this warp's 16-row block meet the group?
            if keff > 0 and lo < w_lo + 16 and hi > w_lo:
                for kk in cutlass.range_constexpr(self.RP // 16):
                    if kk * 16 < keff:
                        cute.copy(s2r_a, tXsA[None, None, kk], tXrA[None, None, kk])
                        cute.copy(s2r_b, tXsB[None, None, kk, buf], tXrB[None, None, kk])
                        # Rows of other groups (or none) contribute exactly zero.
                        for i in cutlass.range_constexpr(cute.size(tCrA[None, None, kk])):
                            r = tCcA[None, None, kk][i][0]
                            if r < lo or r >= hi:
                                tCrA[None, None, kk][i] = cutlass.BFloat16(0.0)
                        cute.gemm(tiled_mma, acc, tCrA[None, None, kk], tCrB[None, None, kk], acc)

        @cute.jit
        def _epilogue(self, mY, ep_t, sC, acc, thr_mma, row_lo, row_hi, ncols, col_base, c0, tidx):
            """acc -> sC (fp32) -> y += tile for the rows [row_lo, row_hi) with an adapter and the
            tile's ncols columns from y's column col_base + c0: one rounding, 16-byte accesses.
            ep_t: the token of each of this thread's chunks' rows, -1 without an adapter (read at
            the CTA's start, _row_values)."""
            BM, BN, NT = self.BM, self.BN, self.threads
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                rc = tCcC[i]
                sC[rc[0], rc[1]] = acc[i]
            cute.arch.barrier()

            # Two passes over this thread's NIT chunks so that the y round trips overlap instead
            # of queueing chunk after chunk: (1) every chunk's 16-byte y load, (2) add, round once,
            # store. Same arithmetic per element as one pass; rows of slot -1 neither read nor
            # written.
            CPR = BN // 8
            NIT = self._epilogue_chunks()
            j0 = (col_base + c0) // 8
            toks = []
            for it in cutlass.range_constexpr(NIT):
                v = it * NT + tidx
                r = v // CPR
                cc = v - r * CPR
                t = cutlass.Int32(-1)
                if r >= row_lo and r < row_hi and cc * 8 < ncols:
                    t = ep_t[it]
                toks.append(t)
            ys = []
            for it in cutlass.range_constexpr(NIT):
                v = it * NT + tidx
                cc = v - (v // CPR) * CPR
                r_y = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
                if toks[it] >= 0:
                    cute.autovec_copy(cute.zipped_divide(mY[toks[it], None], (8,))[None, j0 + cc], r_y)
                ys.append(r_y)
            for it in cutlass.range_constexpr(NIT):
                v = it * NT + tidx
                r = v // CPR
                cc = v - r * CPR
                if toks[it] >= 0:
                    r_c = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                    cute.autovec_copy(cute.zipped_divide(sC[r, None], (8,))[None, cc], r_c)
                    r_o = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
                    r_o.store((ys[it].load().to(cutlass.Float32) + r_c.load()).to(cutlass.BFloat16))
                    cute.autovec_copy(r_o, cute.zipped_divide(mY[toks[it], None], (8,))[None, j0 + cc])

        @cute.jit
        def _load_b(self, g, buf, mActive, mRanks, has_ranks, mBs: tuple, sl, n_s, c0, ncols, tiled_copy_b,
                    tBsB, tBcB):
            """_load_b_slot for adapter group g (its slot read here)."""
            self._load_b_slot(mActive[g], buf, mRanks, has_ranks, mBs, sl, n_s, c0, ncols, tiled_copy_b, tBsB, tBcB)

        @cute.jit
        def _load_b_slot(self, lid, buf, mRanks, has_ranks, mBs: tuple, sl, n_s, c0, ncols, tiled_copy_b, tBsB,
                         tBcB):
            """cp.async B_sl[lid] rows [c0, c0 + ncols), the first keff columns, into buffer buf.
            Columns in [R, RP) (rank 8 only) are zero-filled: they meet zero A columns, and
            0 * garbage could be NaN. Rows beyond the slice are never stored, so left as they are."""
            keff = _dsl.k_eff(lid, mRanks, has_ranks, self.RP)  # MMA K (0: nothing to do)
            if keff > 0:
                row0 = lid * n_s + c0
                for m in cutlass.range_constexpr(cute.size(tBsB, mode=[1])):
                    for k in cutlass.range_constexpr(cute.size(tBsB, mode=[2])):
                        crd = tBcB[0, m, k]
                        n, col = crd[0], crd[1]
                        if n < ncols and col < keff:
                            if cutlass.const_expr(self.R < self.RP):
                                if col >= self.R:
                                    tBsB[None, m, k, buf].fill(0)
                                else:
                                    self._cp_b(mBs, sl, row0 + n, col, tiled_copy_b, tBsB[None, m, k, buf])
                            else:
                                self._cp_b(mBs, sl, row0 + n, col, tiled_copy_b, tBsB[None, m, k, buf])

        @cute.jit
        def _cp_b(self, mBs: tuple, sl, row, col, tiled_copy_b, dst):
            for i in cutlass.range_constexpr(self.cfg.num_slices):
                if sl == i:
                    src = cute.zipped_divide(mBs[i][row, None], (8,))[None, col // 8]
                    cute.copy(tiled_copy_b, src, dst)

        def _h_vec(self) -> int:
            """Elements of h per 16-byte vector: 4 fp32 (converted) or 8 bf16 (h_bf16)."""
            return 8 if self.cfg.h_bf16 else 4

        def _h_vectors_per_row(self) -> int:
            """16-byte vectors of h per row of sA."""
            return self.RP // self._h_vec()

        def _h_chunks(self) -> int:
            """h vectors each thread stages (chunk it: vector it * threads + tidx, row-major)."""
            return (self.BM * self._h_vectors_per_row() + self.threads - 1) // self.threads

        def _epilogue_chunks(self) -> int:
            """16-byte y chunks each thread adds (chunk it: it * threads + tidx, BN / 8 per row)."""
            return self.BM * (self.BN // 8) // self.threads

        @cute.jit
        def _row_values(self, mIdx, r0, rows, tidx, per_row: int, n_chunks: int):
            """mIdx[r0 + r] for the row r of each of this thread's n_chunks chunks (chunk it is item
            it * threads + tidx of a row-major tile with per_row items per row), r clamped to the
            tile's rows so that every load is in bounds (callers mask the rows beyond them)."""
            vals = []
            for it in cutlass.range_constexpr(n_chunks):
                r = (it * self.threads + tidx) // per_row
                vals.append(mIdx[r0 + cutlass.min(r, rows - 1)])
            return vals

        @cute.jit
        def _load_h(self, mH, h_toks, sl, rows, live, tidx):
            """This thread's chunks of bf16(h[sl, tok[r0 + r], :]) into registers, 16-byte loads
            (h_toks: _row_values of the token indices); zeros for rows past the batch, for the rank
            padding, and everywhere unless live (a z-CTA without groups stages nothing). The
            stores into sA are _store_h's, after B is requested."""
            R, BM, NT = self.R, self.BM, self.threads
            hb = self.cfg.h_bf16
            VEC, VPR = self._h_vec(), self._h_vectors_per_row()
            hs = []
            for it in cutlass.range_constexpr(self._h_chunks()):
                v = it * NT + tidx
                r = v // VPR
                cv = v - r * VPR
                r_h = cute.make_rmem_tensor(cute.make_layout(VEC), cutlass.BFloat16 if hb else cutlass.Float32)
                r_h.fill(0.0)
                if live and v < BM * VPR and r < rows and cv * VEC < R:
                    cute.autovec_copy(cute.zipped_divide(mH[sl, h_toks[it], None], (VEC,))[None, cv], r_h)
                hs.append(r_h)
            return hs

        @cute.jit
        def _store_h(self, hs, sA, tidx):
            """sA[r, :] = _load_h's chunks, the row order the sorted one: fp32 converted element by
            element, or (h_bf16) one 16-byte smem store (the swizzle moves whole 16-byte chunks,
            so a chunk stays contiguous)."""
            BM, NT = self.BM, self.threads
            hb = self.cfg.h_bf16
            VEC, VPR = self._h_vec(), self._h_vectors_per_row()
            for it in cutlass.range_constexpr(self._h_chunks()):
                v = it * NT + tidx
                if v < BM * VPR:
                    r = v // VPR
                    cv = v - r * VPR
                    if cutlass.const_expr(hb):
                        cute.autovec_copy(hs[it], cute.zipped_divide(sA[r, None], (VEC,))[None, cv])
                    else:
                        for j in cutlass.range_constexpr(VEC):
                            sA[r, cv * VEC + j] = hs[it][j].to(cutlass.BFloat16)


def _fake_args(cfg: Config):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def rowmajor(dtype, shape, align=16):
        n = len(shape)
        return make_fake_compact_tensor(dtype, tuple(shape), stride_order=tuple(range(n - 1, -1, -1)),
                                        assumed_align=align)

    i32, f32, bf16 = cutlass.Int32, cutlass.Float32, cutlass.BFloat16
    y = cute.runtime.make_fake_tensor(bf16, (cute.sym_int32(), cute.sym_int32(divisibility=8)),
                                      stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
    h = rowmajor(bf16 if cfg.h_bf16 else f32, (cfg.num_slices, cute.sym_int32(), cfg.rank))
    vec = lambda: rowmajor(i32, (cute.sym_int32(),), align=4)  # noqa: E731
    bufs = tuple(rowmajor(bf16, (cute.sym_int32(), cfg.rank)) for _ in range(cfg.num_slices))
    widths = tuple(cutlass.Int32(128) for _ in range(cfg.num_slices))
    return (y, h, vec(), vec(), vec(), vec(), vec(), vec(), widths, cutlass.Int32(0),
            cute.runtime.make_fake_stream(), bufs)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """Compile for the target in ``options`` from fake tensors (no GPU needed). The result carries
    ``epilora_smem_bytes``: the DSL's own size of the kernel's shared-storage struct."""
    return _dsl.compile_with_smem(_ExpandAddKernel(config), _fake_args(config), options)


# ---------------------------------------------------------------------------------------------
# Host side: configuration choice, geometry, validation, launch
# ---------------------------------------------------------------------------------------------

SLICE_COUNTS = (1, 2, 3, 4)
WIDE_M = 2048  # token count from which select() takes the narrow (bn 64) tile


@functools.lru_cache(maxsize=8192)  # a pure function of its arguments, asked on every launch
def select(num_slices: int, m: int, rank: int) -> Config:
    """bm 64 at every M (v0.13: bm 128, taken from 2048 tokens before, compiles to ~146 registers x
    256 threads, one CTA per SM, and each CTA is a chain of round trips with nothing to overlap it:
    expand-add ran at 3-4.5x its y floor; bm 64 is ~154 x 128, three CTAs per SM). bn 128 below
    WIDE_M tokens, 64 from there (v0.37, run14's sweep: bn 64 is 1.25-1.5x faster on gate_up at
    8192 tokens and 4 % on the layer at 2048, but 3-9 % slower at 64-256 tokens) and at rank 256
    (the B double buffer stays at 64 KiB). From WIDE_M tokens, ranks <= 128, a CTA sweeps
    column_tiles_per_cta(num_slices) of those narrow tiles (v0.76)."""
    if rank not in RANKS:
        raise ValueError(f"adapter rank {rank} is not one of the compiled ranks {RANKS}")
    if m >= WIDE_M:
        ct = column_tiles_per_cta(num_slices) if rank <= 128 else 1
        return Config(rank=rank, num_slices=num_slices, bm=64, bn=64, ct=ct)
    return Config(rank=rank, num_slices=num_slices, bm=64, bn=64 if rank >= 256 else 128)


def column_tiles_per_cta(num_slices: int) -> int:
    """Config.ct from WIDE_M tokens (v0.76, run30's sweep at rank 64, 2048 tokens x 1 / 32
    adapters): one-slice projections (o, down: 64 column tiles) 4 (-13..-15 %; 8 leaves half the
    SMs idle, +11 %), merged ones 8 (gate_up -8 / -12 %, qkv -4 / -5 %, where 4 makes 1.5 waves
    of CTAs, +4 %)."""
    return 4 if num_slices == 1 else 8


@functools.lru_cache(maxsize=8192)  # asked on every launch (dataclasses.replace costs ~5 us)
def select_for_h(num_slices: int, m: int, rank: int, h_bf16: bool) -> Config:
    """select()'s tile reading h as bf16 (h_bf16) or fp32."""
    return dataclasses.replace(select(num_slices, m, rank), h_bf16=h_bf16)


def prebuild_configs() -> list[Config]:
    selected = {select(s, m, r) for s in SLICE_COUNTS for r in RANKS for m in (64, WIDE_M)}
    # select()'s tiles also for K1's bf16 h (the hybrid path's, v0.71).
    cfgs = selected | {dataclasses.replace(c, h_bf16=True) for c in selected}
    # The former prefill choice (bm 128 from 2048 tokens; rank 64, the bench's rank), not selected
    # since v0.13: tests/test_expand_add.py's GPU check compares against it, and the GPU machine
    # (no DSL) runs only prebuilt configurations.
    cfgs |= {Config(rank=64, num_slices=s, bm=128, bn=128) for s in SLICE_COUNTS}
    for s in SWEEP_SLICES:
        cfgs.update(sweep_configs(s, 64).values())
    cfgs.update(CT_TEST_CONFIGS)
    return sorted(cfgs, key=lambda c: (c.num_slices, c.rank, c.bm, c.bn, c.h_bf16, c.ct, c.nb))


# The bench's expand-add sweep (`hybrid_stages` with EPILORA_BENCH_K1SWEEP=1), rank 64, Qwen3-8B's
# slice counts. run13's profile: bm 64 x bn 128 compiles to ~154 registers (64 fp32 accumulators a
# thread), three CTAs of 4 warps per SM, and the y loads wait (long scoreboard) with little else to
# issue; narrower tiles hold fewer accumulators.
SWEEP_SLICES = (1, 2, 3)


def sweep_configs(num_slices: int, rank: int) -> dict[str, Config]:
    """name -> an alternative tile to select()'s for the bench's sweep."""
    base = select(num_slices, WIDE_M, rank)
    out = {}
    for bm, bn in ((64, 128), (64, 64), (32, 128), (32, 64), (128, 64)):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=bm, bn=bn)
        except ValueError:
            continue
        if cfg != base:
            out[f"bm{bm}_bn{bn}"] = cfg
    # v0.72: the narrow tile sweeping ct column tiles per CTA, one also with v0.71's bf16 h (not the
    # bn 128 tile: its sweep builds compile to ~240 registers, two CTAs per SM instead of three)
    def tile(bn, **kw):
        return Config(rank=rank, num_slices=num_slices, bm=64, bn=bn, **kw)

    for ct in (2, 4, 8):
        out[f"bm64_bn64_ct{ct}"] = tile(64, ct=ct)
    out["bm64_bn64_hb_ct4"] = tile(64, h_bf16=True, ct=4)
    # v0.75: deeper B rings (many adapter groups per row tile: 256 x 32, 64 x 8), also with ct 4
    for bn, nb in ((128, 3), (128, 4), (64, 3)):
        out[f"bm64_bn{bn}_nb{nb}"] = tile(bn, nb=nb)
    out["bm64_bn64_ct4_nb3"] = tile(64, ct=4, nb=3)
    return out


# v0.72 / v0.75's GPU tests beyond the sweep's rank 64: rank 8 (its zero-filled rank padding) with
# a 3-deep ring and rank 256 with four slices, sweeping columns.
CT_TEST_CONFIGS = (Config(rank=8, num_slices=1, bm=64, bn=128, nb=3),
                   Config(rank=256, num_slices=4, bm=64, bn=64, ct=4))


def column_tiles(widths, bn: int) -> list[tuple[int, int, int]]:
    """(slice, first column inside the slice, first column of the slice in y) for every column
    tile in blockIdx.x order (ct = 1: one per CTA), as the kernel derives them from the widths."""
    out, base = [], 0
    for s, w in enumerate(widths):
        for c0 in range(0, w, bn):
            out.append((s, c0, base))
        base += w
    return out


def column_chunks(widths, bn: int, ct: int) -> list[list[tuple[int, int, int]]]:
    """The column tiles of each blockIdx.x when a CTA sweeps ct of them (Config.ct): ct
    consecutive tiles of one slice, the slice's last chunk possibly shorter; the kernel derives
    the same from the width scalars. ct = 1 is one tile per CTA (column_tiles)."""
    out, base = [], 0
    for s, w in enumerate(widths):
        tiles = [(s, c0, base) for c0 in range(0, w, bn)]
        out += [tiles[i:i + ct] for i in range(0, len(tiles), ct)]
        base += w
    return out


def _column_ctas(widths, cfg: Config) -> int:
    """blockIdx.x's extent: ceil(ceil(n_s / bn) / ct) summed over the slices."""
    return sum(-(-(-(-w // cfg.bn)) // cfg.ct) for w in widths)


# ~2 CTAs per SM (v0.20, run10's sweep: at 32 tokens x 32 adapters qkv / o / down ran 16 / 13 / 13 us
# at 8 groups per tile column against 21 / 17 / 17 at the old ~4 per SM; gate/up 32 at z 2, 35 at 4).
TARGET_CTAS = 256


def choose_zsplit(widths, m: int, cfg: Config, max_loras: int | None, target_ctas: int = TARGET_CTAS) -> int:
    """Grid z: how many CTAs share one (column tile, row tile)'s adapter groups (each takes
    ceil(groups / z) of them and writes only their rows). Without it a CTA loads one B tile per
    group of its row tile, one after another (32 adapters x 1 token: 32 round trips per CTA). z is
    the least power of two that brings the grid to target_ctas (an even share of a power-of-two
    group count), never more than a tile's possible groups."""
    from .k1_shrink import pow2_ceil

    if max_loras is None:
        return 1
    ctas = _column_ctas(widths, cfg) * -(-m // cfg.bm)
    want = pow2_ceil(-(-target_ctas // max(ctas, 1)))
    return max(1, min(want, cfg.bm, m, max_loras + 1, 65535))


def grid(widths, m: int, cfg: Config, max_loras: int | None = None, zsplit: int | None = None) -> tuple[int, int, int]:
    """The launch grid; max_loras (the B buffers' slot count) lets the group split (grid z) apply,
    zsplit forces it."""
    z = zsplit or choose_zsplit(widths, m, cfg, max_loras)
    return (_column_ctas(widths, cfg), -(-m // cfg.bm), z)


def as_3d(b: torch.Tensor, name: str) -> torch.Tensor:
    """A B stack ([max_loras, 1, n, rank], vLLM's) as the [max_loras, n, rank] view the kernel reads."""
    return adapter_view(b, name, "n, rank")


def _check_meta(meta, m: int, device) -> None:
    if meta.num_tokens != m:
        raise ValueError(f"metadata describes {meta.num_tokens} tokens, the tensors have {m}")
    for f in ("token_indices_sorted_by_lora_ids", "sorted_lora_ids", "row_group", "active_lora_ids",
              "lora_token_start_loc"):
        t = getattr(meta, f)
        if t.dtype != torch.int32 or t.device != device or t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"meta.{f} must be a contiguous int32 vector on {device}")


def check_slot_ranks(slot_ranks, max_loras: int, device):
    if slot_ranks is None:
        return
    if not isinstance(slot_ranks, torch.Tensor) or slot_ranks.dtype != torch.int32:
        raise TypeError("slot_ranks must be an int32 tensor")
    if slot_ranks.dim() != 1 or slot_ranks.numel() < max_loras or slot_ranks.stride(0) != 1:
        raise ValueError(f"slot_ranks must be a contiguous int32 vector of >= {max_loras} entries")
    if slot_ranks.device != device:
        raise ValueError("slot_ranks must be on the device of y")


def check_y(y) -> tuple[int, int]:
    """(M, N) of the expand-add's output, or the error the entry raises for it."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.dtype != torch.bfloat16:
        raise TypeError("y must be a 2-D bfloat16 tensor")
    if y.stride(1) != 1 or y.stride(0) % 8 or y.data_ptr() % 16:
        raise ValueError("y needs unit column stride, a row stride multiple of 8 and a 16-byte aligned base")
    return y.shape


def adapter_slices(lora_b_slices, y: torch.Tensor) -> list[torch.Tensor]:
    """The B slices as [max_loras, n_s, R] views, checked against y (the entry's errors)."""
    bs = [as_3d(b, f"lora_b_slices[{i}]") for i, b in enumerate(
        lora_b_slices if isinstance(lora_b_slices, (list, tuple)) else [lora_b_slices])]
    if not 1 <= len(bs) <= 4:
        raise ValueError(f"1..4 slices supported, got {len(bs)}")
    L, _, R = bs[0].shape
    widths = [int(b.shape[1]) for b in bs]
    for i, b in enumerate(bs):
        if b.dtype != torch.bfloat16 or b.device != y.device:
            raise TypeError(f"lora_b_slices[{i}] must be bfloat16 on {y.device}")
        if b.shape[0] != L or b.shape[2] != R:
            raise ValueError(f"lora_b_slices[{i}] is {tuple(b.shape)}: every slice needs [{L}, n, {R}]")
        if not b.is_contiguous() or b.data_ptr() % 16:
            raise ValueError(f"lora_b_slices[{i}] must be contiguous and 16-byte aligned")
        if widths[i] % 8:
            raise ValueError(f"slice widths must be multiples of 8, got {widths}")
    if sum(widths) != y.shape[1]:
        raise ValueError(f"slice widths {widths} do not add up to y's {y.shape[1]} columns")
    return bs


def check_h(h, num_slices: int, m: int, rank: int, device) -> None:
    """The entry's checks of h: [S, >= M, R] fp32 or bf16, row-major over [M, R], 16-byte aligned."""
    if not isinstance(h, torch.Tensor) or h.dtype not in (torch.float32, torch.bfloat16) or h.dim() != 3:
        raise TypeError("h must be a 3-D float32 or bfloat16 tensor [num_slices, M, rank]")
    if h.shape[0] != num_slices or h.shape[1] < m or h.shape[2] != rank or h.device != device:
        raise ValueError(f"h must be [{num_slices}, >= {m}, {rank}] on {device}, got {tuple(h.shape)}")
    if h.stride(2) != 1 or h.stride(1) != rank or h.stride(0) % rank or h.data_ptr() % 16:
        raise ValueError("h must be row-major over [M, rank] with a 16-byte aligned base")


DYNAMIC_PARAMS = 2  # y, h: the parameters before static_params'


def static_params(bs: list[torch.Tensor], meta, slot_ranks) -> list:
    """The kernel's parameters after the DYNAMIC_PARAMS, in its order (also what a launch plan
    packs once: epilora_cute/launch_plans.py)."""
    L, _, R = bs[0].shape
    widths = [int(b.shape[1]) for b in bs]
    ranks = slot_ranks if slot_ranks is not None else meta.active_lora_ids  # never read when has_ranks = 0
    return [meta.token_indices_sorted_by_lora_ids, meta.sorted_lora_ids, meta.row_group, meta.active_lora_ids,
            meta.lora_token_start_loc, ranks, *[b.reshape(L * w, R) for b, w in zip(bs, widths)], *widths,
            1 if slot_ranks is not None else 0]


def expand_add(y: torch.Tensor, h: torch.Tensor, lora_b_slices, meta, slot_ranks: torch.Tensor | None = None,
               *, config: Config | None = None, zsplit: int | None = None) -> torch.Tensor:
    """y[m, slice s] += h[s, m] . B_s[slot(m)]^T in place (fp32 accumulation, one bf16 rounding);
    tokens with slot -1 untouched. Returns y.

    y: [M, N] bf16, rows 16-byte aligned (row stride a multiple of 8, unit column stride).
    h: [S, >= M, R] fp32 (vLLM's shrink buffer) or bf16 (K1's h_bf16 store) with unit stride over
        R and row stride R; both give the same y bit for bit for the same bf16(h).
    lora_b_slices: S tensors [max_loras, 1, n_s, R] (or [max_loras, n_s, R]) bf16, contiguous,
        n_s a multiple of 8, sum(n_s) == N.
    meta: epilora_cute.metadata.LoRABatchMeta prepared for these M tokens.
    slot_ranks: optional int32 [>= max_loras]: per-slot effective rank; work beyond it is skipped
        (exact when the buffers are zero-padded beyond it, as vLLM keeps them).
    zsplit: force the group split (grid z, choose_zsplit); the result does not depend on it.
    """
    from epilora_cute.arch import arch_of
    from epilora_cute.kernels import get_kernel

    M, _ = check_y(y)
    bs = adapter_slices(lora_b_slices, y)
    S = len(bs)
    L, _, R = bs[0].shape
    widths = [int(b.shape[1]) for b in bs]
    check_h(h, S, M, R, y.device)
    _check_meta(meta, M, y.device)
    check_slot_ranks(slot_ranks, L, y.device)
    h_bf16 = h.dtype == torch.bfloat16
    cfg = config or select_for_h(S, max(M, 1), R, h_bf16)
    if cfg.rank != R or cfg.num_slices != S:
        raise ValueError(f"config {cfg.name()} does not match rank {R} / {S} slices")
    if cfg.h_bf16 != h_bf16:
        raise ValueError(f"config {cfg.name()} reads h as {'bfloat16' if cfg.h_bf16 else 'float32'}, "
                         f"the given h is {h.dtype}")
    if M == 0:
        return y
    arch = arch_of(y)  # None off CUDA (and on GPUs without a CuTe target)
    if arch is None:
        raise ValueError("expand_add runs on CUDA tensors only (reference.lora_expand / emulate() on the CPU)")
    if zsplit is not None and not 1 <= zsplit <= 65535:
        raise ValueError(f"zsplit must be 1..65535, got {zsplit}")
    kernel = get_kernel(sys.modules[__name__], cfg, arch)
    kernel(y, h, *static_params(bs, meta, slot_ranks), grid=grid(widths, M, cfg, max_loras=L, zsplit=zsplit),
           smem=cfg.smem_bytes)
    return y


def emulate(y: torch.Tensor, h: torch.Tensor, lora_b_slices, meta, slot_ranks=None,
            config: Config | None = None, zsplit: int | None = None) -> torch.Tensor:
    """Pure-torch model of the kernel's tiling and arithmetic (CPU): column tiles inside slices,
    BM-row tiles of the sorted tokens, the adapter groups of each tile, rows of other groups
    zeroed, k16 steps below the effective rank, bf16(h), fp32 accumulation, fp32 add to y and one
    rounding, rows with slot -1 untouched; with the group split (zsplit, default as the launch)
    each z-chunk of a tile's groups accumulates and writes only its groups' rows. Returns a new y."""
    from .emulate import z_group_slices

    bs = [as_3d(b, "b") for b in (lora_b_slices if isinstance(lora_b_slices, (list, tuple)) else [lora_b_slices])]
    M, _ = y.shape
    R = bs[0].shape[2]
    widths = [int(b.shape[1]) for b in bs]
    cfg = config or select(len(bs), M, R)
    nz = zsplit or choose_zsplit(widths, M, cfg, int(bs[0].shape[0]))
    RP = cfg.rank_pad
    out = y.clone()
    tok = meta.token_indices_sorted_by_lora_ids[:M].long()
    sorted_ids = meta.sorted_lora_ids[:M]
    rg = meta.row_group[:M]
    act, start = meta.active_lora_ids, meta.lora_token_start_loc
    hb = torch.zeros(h.shape[0], h.shape[1], RP)
    hb[:, :, :R] = h.float().to(torch.bfloat16).float()
    for (s, c0, base) in (t for chunk in column_chunks(widths, cfg.bn, cfg.ct) for t in chunk):
        ncols = min(widths[s] - c0, cfg.bn)
        bmat = torch.zeros(bs[0].shape[0], widths[s], RP)
        bmat[:, :, :R] = bs[s].float()
        for r0 in range(0, M, cfg.bm):
            rows = min(M - r0, cfg.bm)
            a_tile = torch.zeros(cfg.bm, RP)
            a_tile[:rows] = hb[s, tok[r0:r0 + rows]]
            for groups, row_lo, row_hi in z_group_slices(rg, start, r0, rows, nz):
                _emulate_tile(out, a_tile, bmat, act, start, sorted_ids, tok, slot_ranks, cfg, r0, rows, ncols,
                              base + c0, c0, groups, row_lo, row_hi)
    return out


def _emulate_tile(out, a_tile, bmat, act, start, sorted_ids, tok, slot_ranks, cfg, r0, rows, ncols, col0, c0,
                  groups, row_lo, row_hi):
    """One CTA of emulate(): its groups' MMAs into a fresh accumulator, then y += acc for the tile
    rows [row_lo, row_hi) that have an adapter."""
    RP = cfg.rank_pad
    acc = torch.zeros(cfg.bm, cfg.bn)
    for g in groups:
        lid = int(act[g])
        if lid < 0:
            continue
        keff = RP if slot_ranks is None else min((max(int(slot_ranks[lid]), 0) + 15) // 16 * 16, RP)
        if keff == 0:
            continue
        lo, hi = max(int(start[g]) - r0, 0), min(int(start[g + 1]) - r0, rows)
        a = torch.zeros_like(a_tile)
        a[lo:hi, :keff] = a_tile[lo:hi, :keff]
        b = torch.zeros(cfg.bn, RP)
        b[:ncols, :keff] = bmat[lid, c0:c0 + ncols, :keff]
        acc += a @ b.t()
    keep = sorted_ids[r0 + row_lo:r0 + row_hi] >= 0
    t = tok[r0 + row_lo:r0 + row_hi][keep]
    cols = slice(col0, col0 + ncols)
    out[t, cols] = (out[t, cols].float() + acc[row_lo:row_hi][keep][:, :ncols]).to(torch.bfloat16)
