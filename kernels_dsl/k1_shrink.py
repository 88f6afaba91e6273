"""K1 for large batches (issue 4, 33..8192 tokens): FP8 per-token quantization of x fused with the
LoRA down-projection h_s = x . A_s[slot]^T of every adapter group and slice, CuTe-DSL, Hopper.

Outputs: codes [M, K] e4m3 and scales [M] fp32 bit-identical to reference.quantize_fp8_per_token
(= vLLM's dynamic per-token quantization), and h [S, M, R] fp32 from the bf16 x (zeros for tokens
without an adapter and for ranks beyond a slot's effective rank).

One launch, grid (splits, row tiles * S, group chunks), cluster (splits, 1, 1): the splits CTAs
of a cluster share one tile of BM adapter-sorted rows and one slice s (grid y = tile * S + s, so a
tile's slices run side by side; v0.10: before, one CTA ran the slices one after another) and own
disjoint K ranges (k-blocks of 64). Each CTA keeps its whole x chunk [BM, <= KC] resident in
shared memory (read from DRAM once, the other slices' CTAs of the tile find it in L2) and it feeds
both consumers:

  * shrink: for its slice s and every adapter group g of its chunk (dynamic), the
    A_s[lid] k-blocks stream through a cp.async ring (up to 8 stages: 7 blocks in flight) and meet the resident x chunk in warp-level
    mma.sync m16n8k16 (bf16 -> fp32). Warp (wm, wn) owns rows [16 wm, 16 wm + 16) and a 1/WN share
    of the rank columns; a warp whose rows miss g issues nothing, rows of other groups are zeroed
    in registers, rank columns at or beyond the slot's effective rank (slot_ranks) are neither
    loaded nor multiplied. x's k-blocks ride in the same pipeline stages as the first pass's
    A-blocks, so loading x overlaps the first MMAs.
  * split-K reduction, deterministic: each CTA writes its fp32 partial [BM, R] to smem; after a
    cluster barrier every element is summed over the cluster in the fixed order split 0..S-1
    (DSMEM loads), by exactly one CTA, and stored once. No workspace, no atomics.
  * quantization: in slice 0's CTAs of group chunk 0, each CTA publishes the per-row NaN-ignoring abs-max of
    its chunk; after the same cluster barrier every CTA folds the cluster's partial maxima (max is
    exact, so order does not matter), computes scale = fmax(amax / 448, 1 / (448 * 512)) with
    IEEE division, and quantizes its own chunk straight from smem: codes = cvt.rn.satfinite.e4m3x2
    of fmax(-448, fmin(x / scale, 448)) (NaN -> +448), 8 codes per 8-byte store. Split 0 writes
    the scale.

Why mma.sync rather than WGMMA: the adapter groups cut the tile into row ranges at arbitrary
rows; mma.sync's 16-row warp tiles let each warp skip groups it does not meet and mask rows in
registers, and it needs no warpgroup-wide descriptors for a B operand that changes every group.
Split-K over a cluster rather than a workspace: the partials never leave the chip and the
reduction needs no second launch or counters that must be reset for CUDA-graph replays.

Capacity: K <= splits * KC with splits <= 8 (a portable cluster); the configurations trade BM
(rows per CTA, reuse of each A block) against KC (the resident chunk).
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
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warp

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "k1_quant_shrink"
RUNTIME_CONTRACT = True

BK = 64  # K elements per k-block (one 128-byte swizzle row of bf16)
P_PAD = 4  # fp32 words of padding per row of the partial tile
MAX_SPLITS = 8  # portable cluster size
MAX_STAGES = 8  # depth of the A-block ring
RANKS = (8, 16, 32, 64, 128, 256)
WGMMA_RANKS = (64, 128)  # Config.wgmma: whole 64-row M tiles of A's rank rows, <= 2 warpgroups


@dataclass(frozen=True)
class Config:
    """rank: buffer rank R. num_slices: A buffers (1..4). bm: sorted rows per CTA (16/32/64).
    kc: resident K capacity per CTA (multiple of 64). stages: depth of the A-block ring.
    h_bf16: store h as bf16 (RN of the same fp32 sum) instead of fp32 — what the expand-add and
    the prefill K2 feed their MMA anyway, so their outputs are bit for bit the same (v0.71).
    wn_x: 2 doubles the warps across the rank (v0.73: 8 warps instead of 4 at bm 32 / 64, each
    with half the rank columns), for twice the warps per SM to hide the chain's latencies.
    wgmma: the shrink on WGMMA (v0.74, ranks 64 / 128): swap-AB, the A block's rank rows on M (one
    warpgroup per 64), the tile's tokens on N; every group's product covers the whole tile and only
    the group's token columns are kept (stored into the partial tile after the group)."""

    rank: int = 64
    num_slices: int = 1
    bm: int = 64
    kc: int = 512
    stages: int = 3
    h_bf16: bool = False
    wn_x: int = 1
    wgmma: bool = False

    def __post_init__(self):
        if self.rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}")
        if not 1 <= self.num_slices <= 4:
            raise ValueError("num_slices must be 1..4")
        if self.bm not in (16, 32, 64):
            raise ValueError("bm must be 16, 32 or 64")
        if self.kc % BK or not BK <= self.kc <= 4096:
            raise ValueError("kc must be a multiple of 64 in 64..4096")
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be 2..{MAX_STAGES}")
        if self.wn_x not in (1, 2):
            raise ValueError("wn_x must be 1 or 2")
        if self.wgmma and (self.rank not in WGMMA_RANKS or self.wn_x != 1):
            raise ValueError(f"wgmma builds take ranks {WGMMA_RANKS} and wn_x = 1")
        if self.wn * 16 > self.rank_pad or self.threads > 256:
            raise ValueError("wn_x = 2 needs >= 16 rank columns per warp and <= 8 warps")
        if self.threads // (BK // 8) > min(self.bm, self.rank_pad):
            raise ValueError("the tile copies need threads / 8 <= min(bm, rank_pad) rows")

    @property
    def rank_pad(self) -> int:
        return max(16, self.rank)

    @property
    def wm(self) -> int:
        return self.bm // 16

    @property
    def wn(self) -> int:
        """Warps across the rank: fill 4 warps when the rows are few, keep <= 64 accumulators
        per thread, and never split below 16 columns per warp."""
        rp = self.rank_pad
        return max(min(max(4 // self.wm, 1), rp // 16), rp // 128, 1) * self.wn_x

    @property
    def threads(self) -> int:
        if self.wgmma:
            return 128 * (self.rank_pad // 64)  # a warpgroup per 64 rank rows
        return self.wm * self.wn * 32

    @property
    def nkb(self) -> int:
        return self.kc // BK

    @property
    def max_k(self) -> int:
        return MAX_SPLITS * self.kc

    def name(self) -> str:
        hb = "_hb" if self.h_bf16 else ""
        wx = "_wn2" if self.wn_x == 2 else ""
        wg = "_wg" if self.wgmma else ""
        return f"r{self.rank}_s{self.num_slices}_bm{self.bm}_kc{self.kc}_st{self.stages}{hb}{wx}{wg}"

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @functools.cached_property  # launches ask for it on every call
    def smem_bytes(self) -> int:
        """sX [bm, kc] bf16, the A ring [RP, 64, stages] bf16, the partial [bm, R + pad] fp32 and
        the per-row partial maxima [bm] fp32, each 1024-aligned (the DSL allocator's order)."""
        parts = [self.bm * self.kc * 2, self.rank_pad * BK * self.stages * 2,
                 self.bm * (self.rank_pad + P_PAD) * 4, self.bm * 4]
        off = 0
        for p in parts:
            off = _align(off, 1024) + p
        return _align(off, 1024)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    i32, i16, f32, bf16 = torch.int32, torch.int16, torch.float32, torch.bfloat16
    p = [
        TensorParam("x", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K]
        TensorParam("codes16", i16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K/2]
        TensorParam("scales", f32, 1, dynamic_shape=(0,), align=4),  # [M]
        TensorParam("h", h_dtype_of(config), 3, dynamic_shape=(1,), dynamic_stride=(0,), align=16),  # [S, M, R]
        TensorParam("token_indices_sorted", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("row_group", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("lora_token_start_loc", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),
    ]
    for s in range(config.num_slices):  # A_s viewed as [max_loras * R, K]
        p.append(TensorParam(f"a{s}", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16))
    p.append(ScalarParam("has_ranks", "i"))
    p.append(ScalarParam("sorted_codes", "i"))  # 1: codes / scales rows in adapter-sorted order
    return p


def h_dtype_of(config: Config) -> torch.dtype:
    """The dtype of the h the configuration writes."""
    return torch.bfloat16 if config.h_bf16 else torch.float32


if cute is not None:

    def _unit_modes(t, k: int):
        """t with k trailing size-1 modes (cute.gemm wants (V, M) / (V, N) / (V, M, N) operands)."""
        lay = t.layout
        for _ in range(k):
            lay = cute.append(lay, cute.make_layout(1))
        return cute.make_tensor(t.iterator, lay)

    class _K1Kernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.R, self.RP = cfg.rank, cfg.rank_pad
            self.BM, self.NKB, self.ST = cfg.bm, cfg.nkb, cfg.stages
            self.WM, self.WN = cfg.wm, cfg.wn
            self.NT = cfg.threads

        @cute.jit
        def __call__(self, x: cute.Tensor, codes16: cute.Tensor, scales: cute.Tensor, h: cute.Tensor,
                     tok: cute.Tensor, row_group: cute.Tensor, active: cute.Tensor, start_loc: cute.Tensor,
                     slot_ranks: cute.Tensor, has_ranks: cutlass.Int32, sorted_codes: cutlass.Int32,
                     stream: cuda.CUstream, a_bufs: tuple):
            cfg = self.cfg
            sX_layout = D.kmajor_layout(self.BM, self.NKB)
            sW_layout = D.kmajor_layout(self.RP, self.ST)
            sP_layout = cute.make_layout((self.BM, self.RP), stride=(self.RP + P_PAD, 1))
            # (the WGMMA build makes its own inside the kernel: a tiled MMA passed in carries its
            # ACCUMULATE field as a kernel parameter)
            tiled_mma = cute.make_tiled_mma(
                warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)), (self.WM, self.WN, 1),
                permutation_mnk=(self.WM * 16, self.WN * 16, 16))
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                      cutlass.BFloat16, num_bits_per_copy=128)
            cpr = BK // 8  # 16-byte chunks per k-block row
            tiled_copy = cute.make_tiled_copy_tv(
                g2s, cute.make_layout((self.NT // cpr, cpr), stride=(cpr, 1)), cute.make_layout((1, 8)))
            bm = self.BM

            @cute.struct
            class Storage:
                sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sX_layout)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sW_layout)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sP_layout)], 1024]
                sAmax: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 1024]

            self.storage = Storage
            self.smem_size = Storage.size_in_bytes()
            self.kernel(x, codes16, scales, h, tok, row_group, active, start_loc, slot_ranks, a_bufs, has_ranks, sorted_codes,
                        sX_layout, sW_layout, sP_layout, tiled_mma, tiled_copy).launch(
                grid=(1, 1, 1), block=(self.NT, 1, 1), cluster=(1, 1, 1), smem=cfg.smem_bytes, stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mQ16: cute.Tensor, mScale: cute.Tensor, mH: cute.Tensor,
                   mTok: cute.Tensor, mRowGroup: cute.Tensor, mActive: cute.Tensor, mStart: cute.Tensor,
                   mRanks: cute.Tensor, mAs: tuple, has_ranks: cutlass.Int32, sorted_codes: cutlass.Int32,
                   sX_layout: cute.ComposedLayout,
                   sW_layout: cute.ComposedLayout, sP_layout: cute.Layout, tiled_mma: cute.TiledMma,
                   tiled_copy: cute.TiledCopy):
            cfg = self.cfg
            BM, R, RP, ST, NT = self.BM, self.R, self.RP, self.ST, self.NT
            S = cfg.num_slices
            tidx, _, _ = cute.arch.thread_idx()
            _, by_, bz = cute.arch.block_idx()
            # grid y = row tile * S + slice: each CTA computes one slice (a tile's S slice CTAs are
            # neighbours in the launch order, so x's later reads hit L2)
            by = by_ // S
            sl = by_ - by * S
            _, _, nz = cute.arch.grid_dim()
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[0])
            nsplit = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_dim()[0])
            warp_i = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            M = cute.size(mX, mode=[0])
            K = cute.size(mX, mode=[1])

            # ---- this CTA's rows (sorted order) and K range ----------------------------------------
            r0 = by * BM
            rows = cutlass.min(M - r0, BM)
            nkb_total = (K + BK - 1) // BK
            per = (nkb_total + nsplit - 1) // nsplit
            kb_lo = split * per
            # (the host keeps per <= NKB; the clamp only guards shared memory against a bad launch)
            nkb = cutlass.max(cutlass.min(cutlass.min(per, nkb_total - kb_lo), self.NKB), 0)
            k0 = kb_lo * BK
            # ---- this CTA's adapter groups: the tile's groups cut into grid-z chunks (group split) -
            # Every row belongs to one group, so each row's h is computed and stored by exactly one
            # z-CTA; z = 0 also quantizes the tile. nz = 1 is the tile's whole group range.
            g_tile = mRowGroup[r0]
            ng_tile = mRowGroup[r0 + rows - 1] - g_tile + 1
            per_z = (ng_tile + nz - 1) // nz
            gz_lo = cutlass.min(bz * per_z, ng_tile)
            n_groups = cutlass.max(cutlass.min(per_z, ng_tile - gz_lo), 0)  # 0: nothing but the barriers
            g_first = g_tile + gz_lo
            row_lo = cutlass.max(mStart[g_first] - r0, 0)  # the rows of these groups in the tile
            row_hi = cutlass.max(cutlass.min(mStart[g_first + n_groups] - r0, rows), row_lo)

            st_ = D.smem_allocator().allocate(self.storage)
            sX = st_.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
            sW = st_.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
            # raw (unswizzled) shared addresses of the x chunk and the A ring: _issue addresses
            # their 16-byte chunks itself (D.swizzle_128b of the layout's byte offset)
            smem_bases = (st_.sX.data_ptr().toint(), st_.sW.data_ptr().toint())
            sP = st_.sP.get_tensor(sP_layout)
            sAmax = st_.sAmax.get_tensor(cute.make_layout(BM))

            thr_cp = tiled_copy.get_slice(tidx)
            tXsX = thr_cp.partition_D(sX)  # (atom, rows, 1, NKB)
            tXcX = thr_cp.partition_D(cute.make_identity_tensor((BM, BK)))
            tWsW = thr_cp.partition_D(sW)  # (atom, RP rows, 1, ST)
            tWcW = thr_cp.partition_D(cute.make_identity_tensor((RP, BK)))

            # ---- MMA fragments ---------------------------------------------------------------------
            if cutlass.const_expr(cfg.wgmma):
                # (v0.74) A's ring stage on M, x's resident k-block on N; the accumulator holds
                # [rank rows, tile tokens] of one group at a time
                NK16 = BK // 16
                # swap-AB: M = A's rank rows (a warpgroup per 64), N = the tile's BM tokens
                kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
                tiled_mma = sm90_utils.make_trivial_tiled_mma(
                    cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, (RP // 64, 1, 1),
                    tiler_mn=(64, BM))
                thr_mma = tiled_mma.get_slice(tidx)
                tGrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))  # (MMA, M, K16, ST)
                tGrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))  # (MMA, N, K16, NKB)
                tGcC = thr_mma.partition_C(cute.make_identity_tensor((RP, BM)))
                acc = cute.make_rmem_tensor(tGcC.shape, cutlass.Float32)
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                w_lo = cutlass.Int32(0)
            else:
                thr_mma = tiled_mma.get_slice(tidx)
                tCrX = tiled_mma.make_fragment_A(thr_mma.partition_A(sX[None, None, 0]))
                tCrW = tiled_mma.make_fragment_B(thr_mma.partition_B(sW[None, None, 0]))
                tCcX = thr_mma.partition_A(cute.make_identity_tensor((BM, BK)))
                tCcW = thr_mma.partition_B(cute.make_identity_tensor((RP, BK)))
                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, RP)), cutlass.Float32)
                acc.fill(0.0)
                s2r_x = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4),
                                                                   cutlass.BFloat16), tiled_mma)
                s2r_w = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4),
                                                                   cutlass.BFloat16), tiled_mma)
                thr_x = s2r_x.get_slice(tidx)
                thr_w = s2r_w.get_slice(tidx)
                tLsX = thr_x.partition_S(sX)  # (cpy, M, K16, NKB)
                tLrX = thr_x.retile(tCrX)
                tLsW = thr_w.partition_S(sW)  # (cpy, N, K16, ST)
                tLrW = thr_w.retile(tCrW)
                NK16 = BK // 16
                wm = warp_i % self.WM
                w_lo = wm * 16

            # ---- what every issue needs, loaded once (profile, run13: the prologue's issues each
            # re-loaded the rows' token indices and the group's slot and rank, a chain of dependent
            # global loads per issue that took ~40 % of a CTA's time at 2048 tokens) ------------------
            toks = self._row_tokens(mTok, r0, rows, tXcX, tXsX)
            lid0 = cutlass.Int32(-1)
            if n_groups > 0:
                lid0 = mActive[g_first]
            keff0 = cutlass.min(D.k_eff(lid0, mRanks, has_ranks, self.RP), self.R)

            # ---- prologue: items 0 .. ST-2 ---------------------------------------------------------
            # (items are (group, k-block) pairs; the issue ST - 1 items ahead is tracked by its pair,
            # advanced by (ahead_g, ahead_j) with one carry, instead of dividing by nkb per issue)
            nkb_ = cutlass.max(nkb, 1)
            ahead_g = (ST - 1) // nkb_
            ahead_j = (ST - 1) - ahead_g * nkb_
            n_live = n_groups  # groups with items (none without k-blocks)
            if nkb == 0:
                n_live = 0
            for p in cutlass.range_constexpr(ST - 1):
                gp = p // nkb_
                self._issue(gp, p - gp * nkb_, p % ST, n_live, sl, g_first, k0, K, mX, toks, lid0, keff0,
                            mActive, mRanks, has_ranks, mAs, tXsX, tXcX, tWsW, tWcW, smem_bases)
                cute.arch.cp_async_commit_group()

            for gi in cutlass.range(n_groups, unroll=1):
                # this group's slot, effective rank and rows in the tile: once per group
                g = g_first + gi
                lid = mActive[g]
                # warp-uniform by construction (every thread loads the same words); saying so lets
                # ptxas drop the WARPSYNC it otherwise puts around each predicated LDSM / HMMA
                keff = cute.arch.make_warp_uniform(D.k_eff(lid, mRanks, has_ranks, self.RP))
                lo = cute.arch.make_warp_uniform(cutlass.max(mStart[g] - r0, 0))
                hi = cute.arch.make_warp_uniform(cutlass.min(mStart[g + 1] - r0, rows))
                # v0.38: the common case (one group over the warp's rows at full rank) without the
                # per-element row masks and per-column rank tests of the general path: the same MMAs.
                whole = keff == RP and lo <= w_lo and hi >= w_lo + 16
                for j in cutlass.range(nkb, unroll=1):
                    i = gi * nkb + j
                    cute.arch.cp_async_wait_group(ST - 2)
                    if cutlass.const_expr(cfg.wgmma):
                        # cp.async wrote the stage (generic proxy); WGMMA reads it (async proxy)
                        cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier()
                    # The stage consumed in the previous iteration is free for everyone now.
                    g_n = gi + ahead_g
                    j_n = j + ahead_j
                    if j_n >= nkb:
                        j_n = j_n - nkb
                        g_n = g_n + 1
                    self._issue(g_n, j_n, (i + ST - 1) % ST, n_live, sl, g_first, k0, K, mX, toks, lid0,
                                keff0, mActive, mRanks, has_ranks, mAs, tXsX, tXcX, tWsW, tWcW, smem_bases)
                    cute.arch.cp_async_commit_group()
                    st = i % ST
                    if cutlass.const_expr(cfg.wgmma):
                        # the whole tile's tokens (other groups' columns are dropped at the store);
                        # ranks past keff multiply the ring's zero-filled rows. Done before the
                        # next iteration's barrier, so the stage can be refilled after it.
                        if keff > 0:
                            cute.nvgpu.warpgroup.fence()
                            for kk in cutlass.range_constexpr(NK16):
                                cute.gemm(tiled_mma, acc, tGrW[(None, None, kk, st)], tGrX[(None, None, kk, j)], acc)
                            cute.nvgpu.warpgroup.commit_group()
                            cute.nvgpu.warpgroup.wait_group(0)
                    else:
                        if whole:
                            # the warp's 16 rows all in the group, every rank column live: no masks
                            for kk in cutlass.range_constexpr(NK16):
                                cute.copy(s2r_x, tLsX[None, None, kk, j], tLrX[None, None, kk])
                                cute.copy(s2r_w, tLsW[None, None, kk, st], tLrW[None, None, kk])
                                cute.gemm(tiled_mma, acc, tCrX[None, None, kk], tCrW[None, None, kk], acc)
                        elif keff > 0 and lo < w_lo + 16 and hi > w_lo:
                            for kk in cutlass.range_constexpr(NK16):
                                cute.copy(s2r_x, tLsX[None, None, kk, j], tLrX[None, None, kk])
                                cute.copy(s2r_w, tLsW[None, None, kk, st], tLrW[None, None, kk])
                                for e in cutlass.range_constexpr(cute.size(tCrX[None, None, kk])):
                                    r = tCcX[None, None, kk][e][0]
                                    if r < lo or r >= hi:
                                        tCrX[None, None, kk][e] = cutlass.BFloat16(0.0)
                                for n in cutlass.range_constexpr(cute.size(tCrW, mode=[1])):
                                    # the 8 rank rows of an MMA n-tile: lane-dependent row, uniform base
                                    # (keff is a multiple of 16, so testing the base is the same test)
                                    if cute.arch.make_warp_uniform(tCcW[0, n, 0][0] // 8 * 8) < keff:
                                        acc_n = _unit_modes(acc[None, 0, n], 2)
                                        cute.gemm(tiled_mma, acc_n, tCrX[None, None, kk],
                                                  _unit_modes(tCrW[None, n, kk], 1), acc_n)
                if cutlass.const_expr(cfg.wgmma):
                    # the group's token columns -> the partial tile (rows of a -1 group or rank 0: zeros)
                    for e in cutlass.range_constexpr(cute.size(acc)):
                        rc = tGcC[e]
                        if rc[1] >= lo and rc[1] < hi:
                            sP[rc[1], rc[0]] = acc[e]
                    acc.fill(0.0)

            # ---- slice done: partial -> smem, cluster exchange, fixed-order sum -> h ---------------
            # (slice 0's CTAs of group chunk 0 also quantize the tile)
            cute.arch.barrier()
            if cutlass.const_expr(not cfg.wgmma):  # (the WGMMA build stored each group's rows)
                tCcP = thr_mma.partition_C(cute.make_identity_tensor((BM, RP)))
                for e in cutlass.range_constexpr(cute.size(acc)):
                    rc = tCcP[e]
                    sP[rc[0], rc[1]] = acc[e]
            if sl == 0 and bz == 0:
                self._row_amax(sX, sAmax, rows, nkb, k0, K, tidx)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if sl == 0 and bz == 0:
                self._quantize(sX, sAmax, mQ16, mScale, mTok, r0, rows, nkb, k0, K, split, nsplit, tidx, sorted_codes)
            self._reduce(sP, mH, mTok, sl, r0, row_lo, row_hi, split, nsplit, tidx)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            cute.arch.cp_async_wait_group(0)

        @cute.jit
        def _row_tokens(self, mTok, r0, rows, tXcX, tXsX):
            """The token index of every x row this thread copies (the same rows for each k-block),
            loaded together; -1 for rows past the tile's end (never copied)."""
            toks = []
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                for c in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                    r = tXcX[0, m, c][0]
                    t = cutlass.Int32(-1)
                    if r < rows:
                        t = mTok[r0 + r]
                    toks.append(t)
            return toks

        @cute.jit
        def _issue(self, gi, j, st, n_groups, s, g_first, k0, K, mX, toks, lid0, keff0, mActive, mRanks,
                   has_ranks, mAs: tuple, tXsX, tXcX, tWsW, tWcW, smem_bases):
            """cp.async of item (gi, j) (group gi of the CTA's groups, k-block j) of this CTA's slice s:
            the A k-block of that slot into ring stage st and, during the first group, x's k-block j
            into its resident place. toks: _row_tokens; lid0 / keff0: the first group's slot and
            rank (later groups load theirs). Every copy is one D.cp_async_cg_16 whose guard is its
            source size (16, or 0: nothing read, 16 zero bytes written), with a clamped valid
            source address and the shared address swizzled from the layout's byte offset
            (D.swizzle_128b; both buffers are 1024-aligned): v0.39 measured K1 5-12 % faster than
            with a branch around each cute.copy (SASS: 209 -> 85 branches). So K-tail chunks, rows
            past the tile and rank rows beyond the slot's are zero-filled (0 * stale smem could be
            NaN; the MMAs mask the rows either way)."""
            if gi < n_groups:
                BM, RP, R = self.BM, self.RP, self.R
                kb = k0 + j * BK
                x_base, w_base = smem_bases
                if gi == 0:
                    for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                        for c in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                            crd = tXcX[0, m, c]
                            r, col = crd[0], crd[1]
                            t = toks[m * cute.size(tXsX, mode=[2]) + c]
                            inb = kb + col < K
                            nbytes = cutlass.Int32(cutlass.select_(t >= 0, cutlass.select_(inb, 16, 0), 0))
                            tt = cutlass.Int32(cutlass.select_(t >= 0, t, 0))
                            cc = cutlass.Int32(cutlass.select_(inb, kb + col, 0))
                            src = cute.zipped_divide(mX[tt, None], (8,))[None, cc // 8]
                            off = (j * (BM * BK) + r * BK + col) * 2
                            D.cp_async_cg_16(x_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)
                lid = lid0
                keff = keff0
                if gi > 0:
                    lid = mActive[g_first + gi]
                    keff = cutlass.min(D.k_eff(lid, mRanks, has_ranks, self.RP), self.R)
                lid_s = cutlass.max(lid, 0)
                for q in cutlass.range_constexpr(self.cfg.num_slices):
                    if s == q:
                        for m in cutlass.range_constexpr(cute.size(tWsW, mode=[1])):
                            for c in cutlass.range_constexpr(cute.size(tWsW, mode=[2])):
                                crd = tWcW[0, m, c]
                                n, col = crd[0], crd[1]
                                inb = kb + col < K
                                okn = n < keff  # keff <= R: the row stays inside the slot
                                nbytes = cutlass.Int32(cutlass.select_(okn, cutlass.select_(inb, 16, 0), 0))
                                row = cutlass.Int32(cutlass.select_(okn, lid_s * R + n, 0))
                                cc = cutlass.Int32(cutlass.select_(inb, kb + col, 0))
                                src = cute.zipped_divide(mAs[q][row, None], (8,))[None, cc // 8]
                                off = (st * (RP * BK) + n * BK + col) * 2
                                D.cp_async_cg_16(w_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)

        @cute.jit
        def _row_amax(self, sX, sAmax, rows, nkb, k0, K, tidx):
            """sAmax[r] = NaN-ignoring max |x| over this CTA's chunk of row r (fmaxf from 0)."""
            BM, NT = self.BM, self.NT
            TPR = NT // BM  # threads per row: consecutive lanes
            r = tidx // TPR
            sub = tidx - r * TPR
            amax = cutlass.Float32(0.0)
            if r < rows:
                units = nkb * (BK // 8)
                for u in cutlass.range(sub, units, TPR, unroll=1):
                    jb = u // (BK // 8)
                    cu = u - jb * (BK // 8)
                    if k0 + u * 8 < K:
                        v = cute.zipped_divide(sX[r, None, jb], (8,))[None, cu].load()
                        for e in cutlass.range_constexpr(8):
                            amax = D.fmax_f32(amax, D.abs_f32(v[e].to(cutlass.Float32)))
            for sh in cutlass.range_constexpr(TPR.bit_length() - 1):
                amax = D.fmax_f32(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << sh))
            if sub == 0:
                sAmax[r] = amax

        @cute.jit
        def _quantize(self, sX, sAmax, mQ16, mScale, mTok, r0, rows, nkb, k0, K, split, nsplit, tidx, sorted_codes):
            """Fold the cluster's row maxima, then quantize this CTA's chunk from smem into row t of
            codes / scales: the row's token (original order) or, with sorted_codes, its sorted
            position (what the prefill K2 reads: no gather between the two kernels)."""
            BM, NT = self.BM, self.NT
            TPR = NT // BM
            r = tidx // TPR
            sub = tidx - r * TPR
            if r < rows:
                amax = cutlass.Float32(0.0)
                addr = sAmax.iterator.toint() + r * 4
                # All the cluster's maxima are loaded before they are folded (independent DSMEM
                # loads in flight together; max is exact, so the fold order is free).
                part = []
                for q in cutlass.range_constexpr(MAX_SPLITS):
                    m_q = cutlass.Float32(0.0)
                    if q < nsplit:
                        m_q = D.ld_dsmem_f32(addr, q)
                    part.append(m_q)
                for q in cutlass.range_constexpr(MAX_SPLITS):
                    amax = D.fmax_f32(amax, part[q])
                scale = D.fp8_scale(amax)
                t = mTok[r0 + r]
                if sorted_codes != 0:
                    t = r0 + r
                if split == 0 and sub == 0:
                    mScale[t] = scale
                # x / scale as (x, div, rcp) quotients, bit-identical to div.rn (D.quot_rn_f32; the
                # profile put div.rn's call sequence at ~12 % of a CTA): the row's operands once.
                div, rcp = D.fp8_quotient_operands(scale)
                units = nkb * (BK // 8)
                g_q = cute.zipped_divide(mQ16[t, None], (4,))  # 8 codes = 4 x int16
                for u in cutlass.range(sub, units, TPR, unroll=1):
                    jb = u // (BK // 8)
                    cu = u - jb * (BK // 8)
                    if k0 + u * 8 < K:
                        v = cute.zipped_divide(sX[r, None, jb], (8,))[None, cu].load()
                        r_q = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int16)
                        for e in cutlass.range_constexpr(4):
                            q0 = D.quot_rn_f32(v[2 * e].to(cutlass.Float32), div, rcp)
                            q1 = D.quot_rn_f32(v[2 * e + 1].to(cutlass.Float32), div, rcp)
                            r_q[e] = D.cvt_e4m3x2_f32(D.fp8_clamp(q0), D.fp8_clamp(q1))
                        cute.autovec_copy(r_q, g_q[None, (k0 + u * 8) // 8])

        @cute.jit
        def _reduce(self, sP, mH, mTok, s, r0, row_lo, row_hi, split, nsplit, tidx):
            """h[s, tok, c] = the cluster's partials summed in split order 0..n-1
            (D.reduce_split_partials), for the tile rows [row_lo, row_hi) (this CTA's adapter groups)."""
            def store(r, c, v):
                if cutlass.const_expr(self.cfg.h_bf16):
                    mH[s, mTok[r0 + r], c] = v.to(cutlass.BFloat16)  # RN, as the consumers round it
                else:
                    mH[s, mTok[r0 + r], c] = v

            D.reduce_split_partials(sP, row_lo, row_hi, self.R, self.RP + P_PAD, MAX_SPLITS, split, nsplit, tidx,
                                    self.NT, store)


def _fake_args(cfg: Config):
    from cutlass.cute.runtime import make_fake_compact_tensor

    def rowmajor(dtype, shape, align=16):
        n = len(shape)
        return make_fake_compact_tensor(dtype, tuple(shape), stride_order=tuple(range(n - 1, -1, -1)),
                                        assumed_align=align)

    i32, i16, f32, bf16 = cutlass.Int32, cutlass.Int16, cutlass.Float32, cutlass.BFloat16
    # Divisibility exactly as the host checks it (K % 8, row strides % 8 elements / 8 bytes):
    # never promise the compiler more than every valid launch gives.
    x = D.fake_matrix(bf16, 8)
    q16 = D.fake_matrix(i16, 4)
    sc = rowmajor(f32, (cute.sym_int32(),), align=4)
    h = rowmajor(bf16 if cfg.h_bf16 else f32, (cfg.num_slices, cute.sym_int32(), cfg.rank))
    vec = lambda: rowmajor(i32, (cute.sym_int32(),), align=4)  # noqa: E731
    a_bufs = tuple(D.fake_matrix(bf16, 8) for _ in range(cfg.num_slices))
    return (x, q16, sc, h, vec(), vec(), vec(), vec(), vec(), cutlass.Int32(0), cutlass.Int32(0),
            cute.runtime.make_fake_stream(), a_bufs)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """Compile for the target in ``options`` from fake tensors (no GPU needed). The result carries
    ``epilora_smem_bytes``: the DSL's own size of the kernel's shared-storage struct."""
    return D.compile_with_smem(_K1Kernel(config), _fake_args(config), options)


# ---------------------------------------------------------------------------------------------
# Host side: configuration choice, geometry, validation, launch
# ---------------------------------------------------------------------------------------------

SLICE_COUNTS = (1, 2, 3, 4)
# 1536 / 1792 (v0.13): K = 12288 / 14336 (Qwen3-8B / Llama-3-8B down) need exactly 24 / 28 k-blocks per
# split; with 2048 no row count fit two CTAs per SM (bm32_kc2048_st8: 202 KiB, one CTA per SM, two
# waves at 256 CTAs), with 1536 / 1792 bm 16 does (110 KiB).
KC_OPTIONS = (512, 1024, 1536, 1792, 2048, 4096)
SMEM_LIMIT = 227 * 1024
SMEM_TWO_PER_SM = 113 * 1024  # two CTAs per SM (228 KiB per SM, 1 KiB reserved per CTA)
SMEM_THREE_PER_SM = 75 * 1024  # three CTAs per SM
SHALLOW_SMALL_M = 1024  # select(): 16 rows per CTA up to here (more CTAs), the resident rule's rows above
TARGET_CTAS = 2 * 132  # about two CTAs per H100/H200 SM
# The group split's budget (v0.20, run10's sweep at 32 tokens x 32 adapters): ~3 CTAs per SM, and
# z rounded up to a power of two, which splits a tile's groups evenly (qkv: z 11 -> 16, 54 -> 45 us).
Z_TARGET_CTAS = 3 * 132


@functools.lru_cache(maxsize=8192)  # a pure function of its arguments, asked on every launch
def select(num_slices: int, k: int, rank: int, m: int | None = None) -> Config:
    """The configuration for K1 at m tokens (None: the resident rule alone, _select_resident):
    the by-size tile (_select_by_size) on the machinery that measured fastest for it (_retune)."""
    base = _select_resident(num_slices, k, rank)
    if m is None:
        return base
    return _retune(_select_by_size(num_slices, k, rank, m), base, m)


def _select_by_size(num_slices: int, k: int, rank: int, m: int) -> Config:
    """The mma.sync tile by token count (v0.30, run13's sweep, rank 64, K 4096): once the issue
    chain was short, a 4-stage ring that lets three or four CTAs share an SM beat the deep ring of
    two CTAs per SM at every size — 16 rows per CTA up to SHALLOW_SMALL_M tokens (twice the CTAs:
    qkv 21.4 -> 18.8 us at 256 tokens, 43.6 -> 28.0 with 32 adapters), the resident rule's rows
    above (qkv 101 -> 78 us at 2048). Taken where it fits three CTAs per SM: down (K = 12288) only
    with a 2-stage ring, above SHALLOW_SMALL_M tokens (v0.32)."""
    base = _select_resident(num_slices, k, rank)
    # Above SHALLOW_SMALL_M the ring may go down to 2 stages for the third CTA (v0.32: down at
    # K = 12288, 48 KiB of x per CTA, 133 -> 108 us at 2048 tokens); below, a 2-stage ring lost
    # (down at 256 tokens 30.0 -> 36.5 us: one wave, nothing else to hide its round trips).
    small = m <= SHALLOW_SMALL_M
    for stages in ((4,) if small else (4, 3, 2)):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=16 if small else base.bm, kc=base.kc, stages=stages)
        except ValueError:
            continue
        if cfg.smem_bytes <= SMEM_THREE_PER_SM:
            return cfg
    return base


# v0.76 (run30's sweep, rank 64, Qwen3-8B at 256 / 2048 / 8192 tokens x 1 / 32 adapters): the
# by-size tile on WGMMA up to SHALLOW_SMALL_M (qkv -8 / -13 %, gate_up -7 / -17 %, o -5 / -6 %,
# down at 16 rows / 7 stages -10 / -15 % at 256 tokens); above it 64 rows on 8 warps where two such
# CTAs share an SM and there are enough rows (qkv / gate_up -10..-18 % at 2048 and 8192; o -10 % at
# 8192 but +6 % at 2048, where the by-size tile on 8 warps is -6 / -13 %), and where K is deep
# (down: the by-size 2-stage ring) the resident ring on WGMMA (-0 / -11 % at 2048, -8 / -14 % at 8192).
WIDE_ROWS_M = 4096  # from here one-slice projections take the 64-row 8-warp tile too


def _retune(cfg: Config, resident: Config, m: int) -> Config:
    """cfg (the by-size mma.sync tile) on WGMMA or 8 warps where run30 measured that faster;
    cfg itself where the rank or the shared memory rules the faster machinery out."""
    if m <= SHALLOW_SMALL_M:
        return _or(cfg, lambda: dataclasses.replace(cfg, wgmma=True))
    if cfg.bm == 16:  # deep K on a 2-stage ring: the resident ring on WGMMA
        return _or(cfg, lambda: dataclasses.replace(resident, wgmma=True))
    if cfg.num_slices >= 2 or m >= WIDE_ROWS_M:
        wide = _or(None, lambda: Config(rank=cfg.rank, num_slices=cfg.num_slices, bm=64, kc=cfg.kc, stages=3, wn_x=2))
        if wide is not None and wide.smem_bytes <= SMEM_TWO_PER_SM:
            return wide
    return _or(cfg, lambda: dataclasses.replace(cfg, wn_x=2))


def _or(fallback, make):
    """make()'s configuration, or fallback where Config rejects it (rank, warps)."""
    try:
        return make()
    except ValueError:
        return fallback


@functools.lru_cache(maxsize=8192)  # asked on every launch (dataclasses.replace costs ~5 us)
def select_for_h(num_slices: int, k: int, rank: int, m: int, h_bf16: bool) -> Config:
    """select()'s configuration writing h as bf16 (h_bf16) or fp32."""
    return dataclasses.replace(select(num_slices, k, rank, m), h_bf16=h_bf16)


@functools.lru_cache(maxsize=None)
def _select_resident(num_slices: int, k: int, rank: int) -> Config:
    """The smallest resident chunk that covers K with <= 8 splits; then a deep A ring (v0.10: the
    shallow 3-stage ring kept two blocks in flight and made K1 a chain of DRAM round trips): the
    most rows per CTA with >= 6 stages that keeps two CTAs per SM, else the most rows per CTA with
    8..4 stages in 227 KiB, else (the old rule) 3 stages in 200 KiB or 2 in 227 KiB."""
    if rank not in RANKS:
        raise ValueError(f"adapter rank {rank} is not one of the compiled ranks {RANKS}")
    kc = next((c for c in KC_OPTIONS if MAX_SPLITS * c >= k), None)
    if kc is None:
        raise ValueError(f"K = {k} exceeds the largest resident capacity {MAX_SPLITS * KC_OPTIONS[-1]}")
    rules = [(SMEM_TWO_PER_SM, range(MAX_STAGES, 5, -1)), (SMEM_LIMIT, range(MAX_STAGES, 3, -1)),
             (200 * 1024, (3,)), (SMEM_LIMIT, (2,))]
    for limit, stage_opts in rules:
        for bm in (64, 32, 16):
            for stages in stage_opts:
                try:
                    cfg = Config(rank=rank, num_slices=num_slices, bm=bm, kc=kc, stages=stages)
                except ValueError:
                    continue
                if cfg.smem_bytes <= limit:
                    return cfg
    raise ValueError(f"no K1 configuration fits K = {k}, rank {rank}")  # pragma: no cover


def projection_ks() -> dict[int, set[int]]:
    """num_slices -> the K of the projections we serve (models of k2_gemm, TP 1/2/4/8)."""
    from .k2_gemm import MODELS

    out: dict[int, set[int]] = {s: set() for s in SLICE_COUNTS}
    for m in MODELS.values():
        for tp in (1, 2, 4, 8):
            out[3].add(m["hidden"])  # qkv
            out[2].add(m["hidden"])  # gate_up
            out[1].add(m["q"] // tp)  # o
            out[1].add(m["inter"] // tp)  # down
            out[4].add(m["hidden"])  # 4-output projections (linear attention inputs)
    return out


def prebuild_configs() -> list[Config]:
    shapes = [(s, k, r) for s, ks in projection_ks().items() for k in ks for r in RANKS]
    # what a launch at m tokens selects: below / above SHALLOW_SMALL_M, from WIDE_ROWS_M
    by_size = {select(s, k, r, m) for s, k, r in shapes for m in (SHALLOW_SMALL_M, SHALLOW_SMALL_M + 1, WIDE_ROWS_M)}
    cfgs = by_size | {select(s, k, r) for s, k, r in shapes}
    # The mma.sync tiles by size (selected before v0.76): the GPU tests hold the WGMMA / 8-warp
    # selections against them, bit for bit or within fp32 rounding.
    cfgs |= {_select_by_size(s, k, r, m) for s, k, r in shapes for m in (SHALLOW_SMALL_M, SHALLOW_SMALL_M + 1)}
    # The selections by size also with h stored as bf16 (the hybrid paths' h, v0.71).
    cfgs |= {dataclasses.replace(c, h_bf16=True) for c in by_size}
    # down's configuration before v0.13 (K 12288 / 14336, rank 64), which tests/test_k1_shrink.py's
    # GPU check compares against (still selected for K 14784 as well; the GPU machine has no DSL).
    cfgs.add(Config(rank=64, num_slices=1, bm=32, kc=2048, stages=8))
    for s, k in SWEEP_SHAPES:
        cfgs.update(sweep_configs(s, k, 64).values())
    cfgs.update(WGMMA_TEST_CONFIGS)
    return sorted(cfgs, key=lambda c: (c.num_slices, c.rank, c.kc, c.bm, c.stages, c.h_bf16, c.wn_x, c.wgmma))


# The bench's K1 sweep (`hybrid_stages` with EPILORA_BENCH_K1SWEEP=1): Qwen3-8B's (slices, K) at
# rank 64. run13's profile: at the selected depth (106-110 KiB) two CTAs of 4 warps share an SM,
# and the CTA's chain of round trips is what the time is; shallower rings / fewer rows fit 3-4.
SWEEP_SHAPES = ((3, 4096), (1, 4096), (2, 4096), (1, 12288))


def sweep_configs(num_slices: int, k: int, rank: int) -> dict[str, Config]:
    """name -> an alternative to select()'s configuration for the bench's sweep (same capacity)."""
    base = select(num_slices, k, rank)
    out = {}
    # (64, 3) / (64, 2), session 28: 64 rows per CTA halve the A blocks each row tile reads from L2
    # (at 2048 tokens qkv's 1536 CTAs each read 64 KB of A for 32 rows), at two CTAs per SM.
    for bm, stages in ((base.bm, 4), (16, 4), (16, 8), (base.bm, 3), (16, 2), (64, 3), (64, 2)):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=bm, kc=base.kc, stages=stages)
        except ValueError:
            continue
        limit = SMEM_TWO_PER_SM if bm == 64 else SMEM_LIMIT  # bm 64 only where two CTAs share an SM
        if cfg != base and cfg.smem_bytes <= limit:
            out[f"bm{bm}_st{stages}"] = cfg
    # v0.73: 8 warps instead of 4 (wn_x = 2: half the rank columns per warp) at the by-size rule's
    # rows and 4 stages, and at 64 rows / 3 stages: the same smem, twice the warps per SM.
    for bm, stages in ((base.bm, 4), (64, 3)):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=bm, kc=base.kc, stages=stages, wn_x=2)
        except ValueError:
            continue
        limit = SMEM_TWO_PER_SM if bm == 64 else SMEM_LIMIT
        if cfg.smem_bytes <= limit:
            out[f"bm{bm}_st{stages}_wn2"] = cfg
    # v0.74: the shrink on WGMMA at the by-size rule's tiles (above and up to SHALLOW_SMALL_M) and
    # at 64 rows
    big, small = (_select_by_size(num_slices, k, rank, m) for m in (SHALLOW_SMALL_M + 1, SHALLOW_SMALL_M))
    for bm, stages in dict.fromkeys(((big.bm, big.stages), (small.bm, small.stages), (64, 3))):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=bm, kc=base.kc, stages=stages, wgmma=True)
        except ValueError:
            continue
        limit = SMEM_TWO_PER_SM if bm == 64 else SMEM_LIMIT
        if cfg.smem_bytes <= limit:
            out[f"bm{bm}_st{stages}_wg"] = cfg
    return out


# v0.74's GPU tests beyond the sweep's rank 64: rank 128 (two warpgroups), K 4096 and 12288.
WGMMA_TEST_CONFIGS = (Config(rank=128, num_slices=2, bm=32, kc=512, stages=4, wgmma=True),
                      Config(rank=128, num_slices=1, bm=32, kc=1536, stages=2, wgmma=True))


def choose_splits(k: int, m: int, cfg: Config, target_ctas: int = TARGET_CTAS) -> int:
    """Cluster size: at least what the resident capacity needs, more (up to 8, >= 1 k-block
    each) while the grid is short of ~2 CTAs per SM. The kernel splits the k-blocks as
    ceil(nkb / splits) per CTA, which never exceeds the capacity when splits >= this minimum."""
    nkb = -(-k // BK)
    need = -(-nkb // cfg.nkb)
    if need > MAX_SPLITS:
        raise ValueError(f"K = {k} needs {need} splits of {cfg.kc}; the cluster holds {MAX_SPLITS}")
    tiles = -(-m // cfg.bm) * cfg.num_slices  # (row tile, slice) CTA columns
    want = -(-target_ctas // max(tiles, 1))
    s = max(need, min(MAX_SPLITS, want, nkb))
    return -(-nkb // -(-nkb // s))  # drop splits the ceil(nkb / s) share would leave empty


def max_groups_per_tile(m: int, bm: int, max_loras: int) -> int:
    """The most adapter groups a row tile can meet: its rows, and at most max_loras slots plus the
    no-adapter group."""
    return max(1, min(bm, m, max_loras + 1))


def choose_zsplit(m: int, cfg: Config, splits: int, max_loras: int | None, target_ctas: int = Z_TARGET_CTAS) -> int:
    """Grid z: how many CTAs share one row tile's adapter groups (each takes ceil(groups / z) of
    them; the rows of a group belong to exactly one). Without it a CTA streams the A blocks of every
    group of its tile one after another, e.g. 32 adapters x 1 token each through 8 CTAs. z grows
    while the grid is short of target_ctas, rounded up to a power of two (an even share of a
    power-of-two group count; run10: 11 CTAs for 32 groups took 54 us, 16 took 45), and never
    beyond a tile's possible groups (the count itself is on the device: surplus z-CTAs find no
    group and only pass the barriers)."""
    if max_loras is None:
        return 1
    ctas = splits * -(-m // cfg.bm) * cfg.num_slices
    want = pow2_ceil(max(1, target_ctas // max(ctas, 1)))
    return max(1, min(want, max_groups_per_tile(m, cfg.bm, max_loras), 65535))


def pow2_ceil(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def grid(k: int, m: int, cfg: Config, splits: int | None = None, max_loras: int | None = None,
         zsplit: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, cluster) of a launch: (splits, row tiles * slices, z); grid y = tile * S + slice.
    max_loras (the adapter buffers' slot count) lets the group split (grid z) apply; zsplit
    forces it."""
    s = splits or choose_splits(k, m, cfg)
    z = zsplit or choose_zsplit(m, cfg, s, max_loras)
    return (s, -(-m // cfg.bm) * cfg.num_slices, z), (s, 1, 1)


def as_3d(a: torch.Tensor, name: str) -> torch.Tensor:
    """An A stack ([max_loras, 1, rank, K], vLLM's) as the [max_loras, rank, K] view K1 reads."""
    return adapter_view(a, name, "rank, K")


def check_x(x) -> tuple[int, int]:
    """(M, K) of K1's activations, or the error the entry raises for them."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise TypeError("x must be a 2-D bfloat16 tensor")
    M, K = x.shape
    if K % 8 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("x needs K % 8 == 0, unit column stride, a row stride multiple of 8, 16-byte alignment")
    return M, K


def adapter_slices(lora_a_slices, x: torch.Tensor) -> list[torch.Tensor]:
    """The A slices as [max_loras, R, K] views, checked against x (the entry's errors)."""
    K = x.shape[1]
    as_ = [as_3d(a, f"lora_a_slices[{i}]") for i, a in enumerate(
        lora_a_slices if isinstance(lora_a_slices, (list, tuple)) else [lora_a_slices])]
    if not 1 <= len(as_) <= 4:
        raise ValueError(f"1..4 slices supported, got {len(as_)}")
    L, R, _ = as_[0].shape
    for i, a in enumerate(as_):
        if a.dtype != torch.bfloat16 or a.device != x.device:
            raise TypeError(f"lora_a_slices[{i}] must be bfloat16 on {x.device}")
        if tuple(a.shape) != (L, R, K):
            raise ValueError(f"lora_a_slices[{i}] is {tuple(a.shape)}: every slice needs [{L}, {R}, {K}]")
        if a.stride(2) != 1 or a.stride(1) % 8 or a.stride(0) != a.stride(1) * R or a.data_ptr() % 16:
            raise ValueError(f"lora_a_slices[{i}] must be row-major [max_loras * rank, K] (16-byte aligned rows)")
    return as_


def outputs(x: torch.Tensor, num_slices: int, rank: int, codes=None, scales=None, h=None,
            h_dtype: torch.dtype = torch.float32):
    """(codes, scales, h) for x: the given ones checked (the entry's errors), the missing ones made."""
    M, K = x.shape
    dev = x.device
    if codes is None:
        codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=dev)
    else:
        if codes.dtype is not torch.float8_e4m3fn or tuple(codes.shape) != (M, K) or codes.device != dev:
            raise ValueError(f"codes must be float8_e4m3fn [{M}, {K}] on {dev}")
        if codes.stride(1) != 1 or codes.stride(0) % 8 or codes.data_ptr() % 16:
            raise ValueError("codes needs unit column stride, a row stride multiple of 8 and 16-byte alignment")
    if scales is None:
        scales = torch.empty((M, 1), dtype=torch.float32, device=dev)
    elif scales.dtype is not torch.float32 or scales.numel() != M or scales.device != dev or \
            (M > 1 and scales.reshape(-1).stride(0) != 1):
        raise ValueError(f"scales must be a contiguous float32 [{M}, 1] on {dev}")
    if h is None:
        if h_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"h_dtype must be torch.float32 or torch.bfloat16, got {h_dtype}")
        return codes, scales, torch.empty((num_slices, M, rank), dtype=h_dtype, device=dev)
    if h.dtype not in (torch.float32, torch.bfloat16) or h.dim() != 3 or h.shape[0] != num_slices or \
            h.shape[1] < M or h.shape[2] != rank:
        raise ValueError(f"h must be float32 or bfloat16 [{num_slices}, >= {M}, {rank}]")
    if h.device != dev or h.stride(2) != 1 or h.stride(1) != rank or h.stride(0) % rank or h.data_ptr() % 16:
        raise ValueError("h must be row-major over [M, rank] with a 16-byte aligned base")
    return codes, scales, h


DYNAMIC_PARAMS = 4  # x, codes, scales, h: the parameters before static_params'


def static_params(as_: list[torch.Tensor], meta, slot_ranks, sorted_codes: bool) -> list:
    """The kernel's parameters after the DYNAMIC_PARAMS, in its order (also what a launch plan
    packs once: epilora_cute/launch_plans.py)."""
    L, R, K = as_[0].shape
    ranks = slot_ranks if slot_ranks is not None else meta.active_lora_ids  # never read when has_ranks = 0
    return [meta.token_indices_sorted_by_lora_ids, meta.row_group, meta.active_lora_ids, meta.lora_token_start_loc,
            ranks, *[a.reshape(L * R, K) for a in as_], 1 if slot_ranks is not None else 0,
            1 if sorted_codes else 0]


def k1_quant_shrink(x: torch.Tensor, lora_a_slices, meta, codes: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None, h: torch.Tensor | None = None,
                    slot_ranks: torch.Tensor | None = None, *, config: Config | None = None,
                    splits: int | None = None, zsplit: int | None = None, sorted_codes: bool = False,
                    h_dtype: torch.dtype = torch.float32):
    """One launch: (codes [M, K] e4m3, scales [M, 1] fp32) = reference.quantize_fp8_per_token(x)
    bit for bit, and h [S, M, R] = x . A_s[slot]^T per slice (0 for slot -1 and beyond a
    slot's effective rank when slot_ranks is given). Returns (codes, scales, h).
    h is fp32, or bf16 (the fp32 sum rounded to nearest even) when h_dtype / the given h is bf16.

    x: [M, K] bf16, K a multiple of 8, unit column stride, row stride a multiple of 8, 16-byte
        aligned. lora_a_slices: S (1..4) tensors [max_loras, 1, R, K] (or [max_loras, R, K]) bf16
        with unit column stride. meta: LoRABatchMeta prepared for these M tokens.
    codes / scales / h: optional outputs to write in place (same constraints; scales contiguous).
    splits / zsplit: force the cluster size / the group split (grid z, choose_zsplit); the results
    do not depend on zsplit, bit for bit.
    sorted_codes: row p of codes / scales is token meta.token_indices_sorted_by_lora_ids[p] (the
    adapter-sorted order the prefill K2 reads) instead of token p; h stays in token order.
    """
    from epilora_cute.arch import arch_of
    from epilora_cute.kernels import get_kernel

    from .expand_add import _check_meta, check_slot_ranks

    M, K = check_x(x)
    as_ = adapter_slices(lora_a_slices, x)
    S = len(as_)
    L, R, _ = as_[0].shape
    codes, scales, h = outputs(x, S, R, codes, scales, h, h_dtype)
    _check_meta(meta, M, x.device)
    check_slot_ranks(slot_ranks, L, x.device)
    h_bf16 = h.dtype == torch.bfloat16
    cfg = config or select_for_h(S, K, R, max(M, 1), h_bf16)
    if cfg.rank != R or cfg.num_slices != S:
        raise ValueError(f"config {cfg.name()} does not match rank {R} / {S} slices")
    if cfg.h_bf16 != h_bf16:
        raise ValueError(f"config {cfg.name()} writes h as {'bfloat16' if cfg.h_bf16 else 'float32'}, "
                         f"the given h is {h.dtype}")
    if M == 0:
        return codes, scales, h
    arch = arch_of(x)  # None off CUDA (and on GPUs without a CuTe target)
    if arch is None:
        raise ValueError("k1_quant_shrink runs on CUDA tensors only (the reference / emulate() on the CPU)")
    if zsplit is not None and not 1 <= zsplit <= 65535:
        raise ValueError(f"zsplit must be 1..65535, got {zsplit}")
    g, cl = grid(K, M, cfg, splits, max_loras=L, zsplit=zsplit)
    nkb_total = -(-K // BK)
    if not 1 <= g[0] <= MAX_SPLITS or -(-nkb_total // g[0]) > cfg.nkb:
        raise ValueError(f"{g[0]} splits of K = {K} do not fit {cfg.name()} (<= {MAX_SPLITS} splits of <= {cfg.kc})")
    kernel = get_kernel(sys.modules[__name__], cfg, arch)
    kernel(x, codes.view(torch.int16), scales.reshape(-1), h, *static_params(as_, meta, slot_ranks, sorted_codes),
           grid=g, cluster=cl, smem=cfg.smem_bytes)
    return codes, scales, h


def emulate(x: torch.Tensor, lora_a_slices, meta, slot_ranks=None, config: Config | None = None,
            splits: int | None = None, zsplit: int | None = None, sorted_codes: bool = False,
            h_dtype: torch.dtype = torch.float32):
    """Pure-torch model of the kernel (CPU): sorted BM-row tiles, the k-block split of the
    cluster, per-split partials of every (slice, group) pass with rows of other groups zeroed and
    rank columns beyond the slot's effective rank skipped, the fixed-order split sum, and the
    quantization from the folded per-split maxima; with the group split (zsplit, default as the
    launch) each z-chunk of a tile's groups computes and stores only its groups' rows (rows nobody
    stores stay NaN, so a gap shows); sorted_codes and h_dtype as k1_quant_shrink. Returns (codes,
    scales, h)."""
    from epilora_cute.reference import FP8_MAX as FMAX, MIN_SCALE as MINS, _clamp_like_cuda, _nan_ignoring_abs_max

    from .emulate import z_group_slices

    as_ = [as_3d(a, "a") for a in (lora_a_slices if isinstance(lora_a_slices, (list, tuple)) else [lora_a_slices])]
    M, K = x.shape
    L, R, _ = as_[0].shape
    S = len(as_)
    cfg = config or select(S, K, R, M)
    nsplit = splits or choose_splits(K, M, cfg)
    nz = zsplit or choose_zsplit(M, cfg, nsplit, L)
    nkb_total = -(-K // BK)
    per = -(-nkb_total // nsplit)
    assert per <= cfg.nkb, "capacity exceeded"
    tok = meta.token_indices_sorted_by_lora_ids[:M].long()
    rg, act, start = meta.row_group[:M], meta.active_lora_ids, meta.lora_token_start_loc
    xf = x.float()
    codes = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    scales = torch.empty(M, 1)
    h = torch.full((S, M, R), float("nan"))
    for r0 in range(0, M, cfg.bm):
        rows = min(M - r0, cfg.bm)
        xt = xf[tok[r0:r0 + rows]]
        ranges = [(q * per * BK, min((q + 1) * per, nkb_total) * BK) for q in range(nsplit)]
        ranges = [(lo, min(hi, K)) for lo, hi in ranges]
        # quantization: per-split row maxima, folded (max is exact), then the reference arithmetic
        part_max = [(_nan_ignoring_abs_max(xt[:, lo:hi], dim=-1) if hi > lo else torch.zeros(rows))
                    for lo, hi in ranges]
        amax = torch.stack(part_max).amax(0).unsqueeze(-1)
        sc = torch.maximum(amax / torch.tensor(FMAX), torch.tensor(MINS))
        dst = torch.arange(r0, r0 + rows) if sorted_codes else tok[r0:r0 + rows]
        scales[dst] = sc
        codes[dst] = _clamp_like_cuda(xt / sc).to(torch.float8_e4m3fn)
        for groups, row_lo, row_hi in z_group_slices(rg, start, r0, rows, nz):
            _emulate_h(h, xt, as_, act, start, slot_ranks, cfg, ranges, tok[r0:r0 + rows], r0, rows,
                       groups, row_lo, row_hi)
    return codes, scales, h.to(h_dtype)  # fp32 -> bf16 rounds to nearest even, as the kernel's cvt


def _emulate_h(h, xt, as_, act, start, slot_ranks, cfg, ranges, tok, r0, rows, groups, row_lo, row_hi):
    """One z-CTA column of emulate(): per slice, per split the partial of its groups, the split
    sum, stored for the rows [row_lo, row_hi) of the tile."""
    R = as_[0].shape[1]
    for s in range(len(as_)):
        partials = []
        for lo, hi in ranges:
            acc = torch.zeros(rows, cfg.rank_pad)
            for g in groups:
                lid = int(act[g])
                if lid < 0 or hi <= lo:
                    continue
                keff = cfg.rank_pad if slot_ranks is None else \
                    min((max(int(slot_ranks[lid]), 0) + 15) // 16 * 16, cfg.rank_pad)
                keff = min(keff, R)
                glo, ghi = max(int(start[g]) - r0, 0), min(int(start[g + 1]) - r0, rows)
                xm = torch.zeros(rows, hi - lo)
                xm[glo:ghi] = xt[glo:ghi, lo:hi]
                acc[:, :keff] += xm @ as_[s][lid, :keff, lo:hi].float().t()
            partials.append(acc[:, :R])
        tot = torch.zeros(rows, R)
        for p in partials:  # split order 0..n-1
            tot = tot + p
        h[s, tok[row_lo:row_hi]] = tot[row_lo:row_hi]
