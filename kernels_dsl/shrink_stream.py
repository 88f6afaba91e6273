"""The LoRA down-projection at prefill sizes, streamed: h_s = x . A_s[slot]^T for every adapter
group and slice, CuTe-DSL, Hopper (v0.88). No quantization: on the hybrid paths the codes come from
the quantization kernel the vendor GEMM reads anyway (K1's codes were a scratch copy on hybrid_par).

Why a second shrink beside K1: K1 keeps each CTA's x chunk resident for its quantization, which
bounds a CTA to 16-64 rows and an eighth of K, so at 2048-16384 tokens every CTA is a short chain
(load, a few k-blocks, cluster barrier, reduction, quantization) and each row tile re-reads the whole
A from L2 per 16-64 rows: K1 runs at 4-8x its bytes' floor there (run30: qkv 161 us at 8192 tokens
for a 24 us floor). Here a CTA owns BM = 64 or 128 adapter-sorted rows and one slice, and streams
its K range through a cp.async ring (the x rows gathered by token index, the group's A k-block
beside them), one WGMMA per k16 step with the tokens on M and the rank on N.

One launch, grid (row tiles * S, splits, 1), x = tile * S + slice (a tile's slice CTAs are neighbours
in the launch order: the second and third read x from L2), cluster (1, splits, 1): where the row
tiles alone leave SMs idle (run40 on an H100: one CTA streams ~40 GB/s, so 32 tiles at 2048 tokens
took as long as 1024 at 8192 per tile), the splits CTAs of a cluster own disjoint K ranges, put
their fp32 partials in shared memory (over the drained ring) and, after a cluster barrier, each
sums a share of the elements over the cluster in the fixed order split 0..n-1 (DSMEM loads) and
stores it: deterministic, no workspace, no atomics. A tile's rows are sorted by adapter, so
at prefill sizes it meets one group, at a group boundary two: the CTA walks its groups and streams
K once per group, loading only that group's rows (other rows' copies read nothing and zero-fill),
and stores only the group's rows of the product. Rows of the no-adapter group get zeros (no
loads); rank columns beyond a slot's effective rank (slot_ranks, rounded up to 16 as K1) multiply
zero-filled A rows, so they are zeros too.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import ScalarParam, TensorParam

try:  # the DSL is needed to compile, not to launch a cached build
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "lora_shrink_stream"
RUNTIME_CONTRACT = True

BK = 64  # K elements per k-block: one 128-byte swizzle row of bf16
RANKS = (8, 16, 32, 64, 128, 256)
BMS = (64, 128)  # rows per CTA: one warpgroup per 64
MAX_STAGES = 8


@dataclass(frozen=True)
class Config:
    """rank: buffer rank R. num_slices: A buffers (1..4). bm: sorted rows per CTA (64 / 128, a
    warpgroup per 64). stages: depth of the (x, A) k-block ring. h_bf16: store h as bf16 (RN of the
    fp32 sum), what the hybrid paths' expand-add reads."""

    rank: int = 64
    num_slices: int = 1
    bm: int = 128
    stages: int = 4
    h_bf16: bool = True

    def __post_init__(self):
        if self.rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}")
        if not 1 <= self.num_slices <= 4:
            raise ValueError("num_slices must be 1..4")
        if self.bm not in BMS:
            raise ValueError(f"bm must be one of {BMS}")
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be 2..{MAX_STAGES}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.name()} needs {self.smem_bytes} bytes of shared memory (> {SMEM_LIMIT})")

    @property
    def rank_pad(self) -> int:
        """WGMMA's N: the rank, at least 16 (rank 8's upper rows are zero-filled)."""
        return max(16, self.rank)

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    def name(self) -> str:
        return f"r{self.rank}_s{self.num_slices}_bm{self.bm}_st{self.stages}{'_hb' if self.h_bf16 else ''}"

    @property
    def ring_bytes(self) -> int:
        """The x ring [bm, 64, stages] then the A ring [RP, 64, stages] bf16, contiguous (the x
        ring 1024-aligned, as the DSL allocator places the A ring after it)."""
        return _align(self.bm * BK * self.stages * 2, 1024) + self.rank_pad * BK * self.stages * 2

    @functools.cached_property  # launches ask for it on every call
    def smem_bytes(self) -> int:
        """The ring and the tile's token indices [bm] int32, 1024-aligned each."""
        return _align(_align(self.ring_bytes, 1024) + self.bm * 4, 1024)

    @property
    def partial_fits(self) -> bool:
        """Whether the split-K partial [bm, RP + P_PAD] fp32 fits over the ring: split-K is
        launched only where it does."""
        return self.bm * (self.rank_pad + P_PAD) * 4 <= self.ring_bytes


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


P_PAD = 4  # fp32 words of padding per row of the split-K partial (bank conflicts of the stores)
MAX_SPLITS = 8  # portable cluster size
SMEM_LIMIT = 227 * 1024


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    i32, f32, bf16 = torch.int32, torch.float32, torch.bfloat16
    p = [
        TensorParam("x", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K]
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
    return p


def h_dtype_of(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.h_bf16 else torch.float32


if cute is not None:

    class _StreamShrinkKernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.R, self.RP, self.BM, self.ST, self.NT = cfg.rank, cfg.rank_pad, cfg.bm, cfg.stages, cfg.threads

        @cute.jit
        def __call__(self, x: cute.Tensor, h: cute.Tensor, tok: cute.Tensor, row_group: cute.Tensor,
                     active: cute.Tensor, start_loc: cute.Tensor, slot_ranks: cute.Tensor,
                     has_ranks: cutlass.Int32, stream: cuda.CUstream, a_bufs: tuple):
            sX_layout = D.kmajor_layout(self.BM, self.ST)
            sA_layout = D.kmajor_layout(self.RP, self.ST)
            bm = self.BM

            @cute.struct
            class Storage:
                sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sX_layout)], 1024]
                sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sA_layout)], 1024]
                sTok: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, bm], 1024]

            self.storage = Storage
            self.smem_size = Storage.size_in_bytes()
            self.kernel(x, h, tok, row_group, active, start_loc, slot_ranks, a_bufs, has_ranks,
                        sX_layout, sA_layout).launch(
                grid=(1, 1, 1), block=(self.NT, 1, 1), cluster=(1, 1, 1), smem=self.cfg.smem_bytes, stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mH: cute.Tensor, mTok: cute.Tensor, mRowGroup: cute.Tensor,
                   mActive: cute.Tensor, mStart: cute.Tensor, mRanks: cute.Tensor, mAs: tuple,
                   has_ranks: cutlass.Int32, sX_layout: cute.ComposedLayout, sA_layout: cute.ComposedLayout):
            cfg = self.cfg
            BM, R, RP, ST, NT = self.BM, self.R, self.RP, self.ST, self.NT
            S = cfg.num_slices
            NK16 = BK // 16
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            tile = bx // S
            sl = bx - tile * S
            M = cute.size(mX, mode=[0])
            K = cute.size(mX, mode=[1])
            r0 = tile * BM
            rows = cutlass.min(M - r0, BM)
            # this CTA's K range: ceil(k-blocks / splits) each (the host drops empty splits)
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[1])
            nsplit = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_dim()[1])
            nkb_total = (K + BK - 1) // BK
            per = (nkb_total + nsplit - 1) // nsplit
            kb0 = split * per
            nkb = cutlass.max(cutlass.min(per, nkb_total - kb0), 0)

            st_ = D.smem_allocator().allocate(self.storage)
            sX = st_.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
            sA = st_.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sTok = st_.sTok.get_tensor(cute.make_layout(BM))
            # the split-K partial, over the drained ring (host: Config.partial_fits)
            sP = cute.make_tensor(cute.recast_ptr(st_.sX.data_ptr(), dtype=cutlass.Float32),
                                  cute.make_layout((BM, RP), stride=(RP + P_PAD, 1)))
            # raw shared addresses: the copies address their 16-byte chunks themselves
            bases = (st_.sX.data_ptr().toint(), st_.sA.data_ptr().toint())

            # the tile's token indices, once (the copies' row addresses and the h stores' rows)
            for r in cutlass.range(tidx, BM, NT, unroll=1):
                t = cutlass.Int32(-1)
                if r < rows:
                    t = mTok[r0 + r]
                sTok[r] = t
            cute.arch.barrier()

            # tokens on M (a warpgroup per 64 rows), the rank on N, both operands K-major in smem
            kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, (BM // 64, 1, 1),
                tiler_mn=(64, RP))
            thr_mma = tiled_mma.get_slice(tidx)
            tCrX = tiled_mma.make_fragment_A(thr_mma.partition_A(sX))  # (MMA, M, K16, ST)
            tCrA = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))  # (MMA, N, K16, ST)
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, RP)))
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

            g_lo = mRowGroup[r0]
            g_hi = mRowGroup[r0 + rows - 1]
            for g in cutlass.range(g_lo, g_hi + 1, unroll=1):
                lid = mActive[g]
                lo = cutlass.max(mStart[g] - r0, 0)
                hi = cutlass.min(mStart[g + 1] - r0, rows)
                keff = D.k_eff(lid, mRanks, has_ranks, R)  # the A rows to load, <= R (0: no adapter)
                if keff > 0:
                    acc.fill(0.0)
                    for p in cutlass.range_constexpr(ST - 1):
                        if p < nkb:
                            self._issue(kb0 + p, p, sl, lid, keff, lo, hi, K, mX, mAs, sTok, bases, tidx)
                        cute.arch.cp_async_commit_group()
                    for j in cutlass.range(nkb, unroll=1):
                        cute.arch.cp_async_wait_group(ST - 2)
                        # cp.async wrote the stage (generic proxy); WGMMA reads it (async proxy)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier()
                        # every warpgroup finished the stage it read last iteration: refill it
                        jn = j + ST - 1
                        if jn < nkb:
                            self._issue(kb0 + jn, jn % ST, sl, lid, keff, lo, hi, K, mX, mAs, sTok, bases, tidx)
                        cute.arch.cp_async_commit_group()
                        st = j % ST
                        cute.nvgpu.warpgroup.fence()
                        for kk in cutlass.range_constexpr(NK16):
                            cute.gemm(tiled_mma, acc, tCrX[(None, None, kk, st)], tCrA[(None, None, kk, st)], acc)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(0)
                    if nsplit == 1:
                        # the group's rows of the product -> h (rows of other groups are the next pass's)
                        for e in cutlass.range_constexpr(cute.size(acc)):
                            rc = tCcC[e]
                            if rc[0] >= lo and rc[0] < hi and rc[1] < R:
                                self._store(mH, sl, sTok[rc[0]], rc[1], acc[e])
                    else:
                        cute.arch.barrier()  # every warpgroup's WGMMAs are done with the ring
                        for e in cutlass.range_constexpr(cute.size(acc)):
                            rc = tCcC[e]
                            sP[rc[0], rc[1]] = acc[e]
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                        self._reduce(sP, mH, sTok, sl, lo, hi, split, nsplit, tidx)
                        # no CTA refills its ring (the next group) while others read its partial
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                else:
                    # the no-adapter group (or a rank-0 slot): zeros, nothing loaded; the cluster's
                    # CTAs share the rows' elements
                    n_el = (hi - lo) * R
                    e_lo = split * n_el // nsplit
                    e_hi = (split + 1) * n_el // nsplit
                    for e in cutlass.range(e_lo + tidx, e_hi, NT, unroll=1):
                        r = lo + e // R
                        self._store(mH, sl, sTok[r], e - (r - lo) * R, cutlass.Float32(0.0))
                # the next group's prologue refills stages other warpgroups may still be reading
                cute.arch.barrier()
            cute.arch.cp_async_wait_group(0)

        @cute.jit
        def _reduce(self, sP, mH, sTok, s, lo, hi, split, nsplit, tidx):
            """h[s, tok, c] = the cluster's partials summed in split order 0..n-1
            (D.reduce_split_partials), for the group's rows [lo, hi) of the tile."""
            D.reduce_split_partials(sP, lo, hi, self.R, self.RP + P_PAD, MAX_SPLITS, split, nsplit, tidx, self.NT,
                                    lambda r, c, v: self._store(mH, s, sTok[r], c, v))

        @cute.jit
        def _store(self, mH, s, t, c, v):
            if cutlass.const_expr(self.cfg.h_bf16):
                mH[s, t, c] = v.to(cutlass.BFloat16)  # RN, as the consumers round it
            else:
                mH[s, t, c] = v

        @cute.jit
        def _issue(self, j, st, s, lid, keff, lo, hi, K, mX, mAs: tuple, sTok, bases, tidx):
            """cp.async of k-block j (of all of K) into ring stage st: the group's x rows [lo, hi) of the tile
            (other rows and the K tail zero-filled: a zero-byte copy reads nothing) and A_s's rows
            of slot lid below keff (the rest zero-filled). One D.cp_async_cg_16 per 16-byte chunk,
            its guard the source size, the shared address swizzled from the byte offset (both rings
            are 1024-aligned)."""
            BM, RP, R, NT = self.BM, self.RP, self.R, self.NT
            kb = j * BK
            x_base, a_base = bases
            CPR = BK // 8  # 16-byte chunks per row of a k-block
            for i in cutlass.range_constexpr((BM * CPR + NT - 1) // NT):
                c = tidx + i * NT
                if cutlass.const_expr((i + 1) * NT <= BM * CPR) or c < BM * CPR:
                    r = c // CPR
                    col = (c - r * CPR) * 8
                    ok = r >= lo and r < hi and kb + col < K
                    t = sTok[r]
                    nbytes = cutlass.Int32(cutlass.select_(ok, 16, 0))
                    tt = cutlass.Int32(cutlass.select_(ok, t, 0))
                    cc = cutlass.Int32(cutlass.select_(ok, kb + col, 0))
                    src = cute.zipped_divide(mX[tt, None], (8,))[None, cc // 8]
                    off = (st * (BM * BK) + r * BK + col) * 2
                    D.cp_async_cg_16(x_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)
            lid_s = cutlass.max(lid, 0)
            for q in cutlass.range_constexpr(self.cfg.num_slices):
                if s == q:
                    for i in cutlass.range_constexpr((RP * CPR + NT - 1) // NT):
                        c = tidx + i * NT
                        if cutlass.const_expr((i + 1) * NT <= RP * CPR) or c < RP * CPR:
                            n = c // CPR
                            col = (c - n * CPR) * 8
                            ok = n < keff and kb + col < K  # keff <= R: the row stays in the slot
                            nbytes = cutlass.Int32(cutlass.select_(ok, 16, 0))
                            row = cutlass.Int32(cutlass.select_(ok, lid_s * R + n, 0))
                            cc = cutlass.Int32(cutlass.select_(ok, kb + col, 0))
                            src = cute.zipped_divide(mAs[q][row, None], (8,))[None, cc // 8]
                            off = (st * (RP * BK) + n * BK + col) * 2
                            D.cp_async_cg_16(a_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)


def _fake_args(cfg: Config):
    i32, f32, bf16 = cutlass.Int32, cutlass.Float32, cutlass.BFloat16
    # Divisibility exactly as the host checks it (K % 8, row strides % 8 elements).
    x = D.fake_matrix(bf16, 8)
    h = D.fake_rowmajor(bf16 if cfg.h_bf16 else f32, (cfg.num_slices, cute.sym_int32(), cfg.rank))
    vec = lambda: D.fake_rowmajor(i32, (cute.sym_int32(),), align=4)  # noqa: E731
    a_bufs = tuple(D.fake_matrix(bf16, 8) for _ in range(cfg.num_slices))
    return (x, h, vec(), vec(), vec(), vec(), vec(), cutlass.Int32(0), cute.runtime.make_fake_stream(), a_bufs)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """Compile for the target in ``options`` from fake tensors (no GPU needed)."""
    return D.compile_with_smem(_StreamShrinkKernel(config), _fake_args(config), options)


# ---------------------------------------------------------------------------------------------
# Host side: configuration choice, validation, launch, CPU model
# ---------------------------------------------------------------------------------------------

SLICE_COUNTS = (1, 2, 3, 4)
SMEM_TWO_PER_SM = 113 * 1024  # two CTAs per SM (228 KiB per SM, 1 KiB reserved per CTA)
MAX_RING = 6  # deeper rings gave K1 nothing above 4-6 stages (run13 / run30)
SM_COUNT = 132  # H100 / H200: the row-tile rule below wants a CTA per SM at least


def _ring(rank: int, num_slices: int, bm: int, h_bf16: bool) -> Config:
    """The deepest ring (<= MAX_RING stages, >= 2) that keeps two CTAs per SM."""
    for stages in range(MAX_RING, 1, -1):
        try:
            cfg = Config(rank=rank, num_slices=num_slices, bm=bm, stages=stages, h_bf16=h_bf16)
        except ValueError:
            continue
        if cfg.smem_bytes <= SMEM_TWO_PER_SM:
            return cfg
    raise ValueError(f"no ring of rank {rank} at {bm} rows fits two CTAs per SM")  # pragma: no cover


@functools.lru_cache(maxsize=8192)  # a pure function of its arguments, asked on every launch
def select(num_slices: int, rank: int, m: int, h_bf16: bool = True) -> Config:
    """128 rows per CTA (half the A re-reads of 64) once that still gives every SM a CTA, else 64."""
    if rank not in RANKS:
        raise ValueError(f"adapter rank {rank} is not one of the compiled ranks {RANKS}")
    bm = 128 if -(-m // 128) * num_slices >= SM_COUNT else 64
    return _ring(rank, num_slices, bm, h_bf16)


def prebuild_configs() -> list[Config]:
    """Both row tiles of every (slices, rank) with bf16 h (the hybrid paths'), and their fp32-h
    twins at 64 rows, every rank, and 128 rows at rank 64 (the GPU tests hold them against the
    reference without bf16's rounding)."""
    cfgs = {_ring(r, s, bm, True) for s in SLICE_COUNTS for r in RANKS for bm in BMS}
    cfgs |= {_ring(r, s, 64, False) for s in SLICE_COUNTS for r in RANKS}
    cfgs |= {_ring(64, s, 128, False) for s in SLICE_COUNTS}
    return sorted(cfgs, key=lambda c: (c.num_slices, c.rank, c.bm, c.stages, c.h_bf16))


TARGET_CTAS = 2 * SM_COUNT  # two CTAs per SM: the ring keeps two resident
MIN_SPLIT_KBLOCKS = 8  # a split streams at least this many k-blocks (its ring's fill is per split)


def choose_splits(m: int, k: int, cfg: Config) -> int:
    """Cluster size along K: 1 where the row tiles x slices give more than half the SMs a CTA
    (run40 call 2, H100: splitting 96-256 CTAs lost 10-45 %: qkv at 2048 tokens 32.8 -> 41.4 µs in
    3 splits, o at 8192 30.7 -> 43.6 in 3), else enough splits for TARGET_CTAS (there it won 13-70 %:
    down at 2048 75.3 -> 41.5 in 8, o at 1024 29.1 -> 13.3), up to MAX_SPLITS, >= MIN_SPLIT_KBLOCKS
    k-blocks each and only where the partial fits over the ring, empty splits dropped."""
    nkb = -(-k // BK)
    tiles = -(-m // cfg.bm) * cfg.num_slices
    if not cfg.partial_fits or tiles > SM_COUNT // 2:
        return 1
    s = max(1, min(MAX_SPLITS, -(-TARGET_CTAS // max(tiles, 1)), nkb // MIN_SPLIT_KBLOCKS))
    return -(-nkb // -(-nkb // s))


def grid(m: int, k: int, cfg: Config, splits: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, cluster) of a launch: (row tiles * slices, splits, 1), cluster (1, splits, 1)."""
    s = splits or choose_splits(m, k, cfg)
    return (-(-m // cfg.bm) * cfg.num_slices, s, 1), (1, s, 1)


def stream_shrink(x: torch.Tensor, lora_a_slices, meta, h: torch.Tensor | None = None,
                  slot_ranks: torch.Tensor | None = None, *, config: Config | None = None,
                  splits: int | None = None, h_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One launch: h [S, M, R] = x . A_s[slot]^T per slice, fp32 sums in k-block order within each
    split's K range and over the splits in split order, stored as h_dtype (bf16: rounded to nearest
    even); zeros for tokens without an adapter and beyond a slot's effective rank (slot_ranks
    rounded up to 16). splits: force the cluster size along K (default choose_splits). Returns h.

    x: [M, K] bf16, K a multiple of 8, unit column stride, row stride a multiple of 8, 16-byte
        aligned. lora_a_slices: S (1..4) tensors [max_loras, 1, R, K] (or [max_loras, R, K]) bf16,
        row-major. meta: LoRABatchMeta prepared for these M tokens. h: optional output written in
        place (float32 or bfloat16 [S, >= M, R], row-major over [M, R])."""
    from epilora_cute.arch import arch_of
    from epilora_cute.kernels import get_kernel

    M, K, as_, h = checked_call(x, lora_a_slices, meta, h, slot_ranks, h_dtype)
    S = len(as_)
    L, R, _ = as_[0].shape
    h_bf16 = h.dtype == torch.bfloat16
    cfg = config or select(S, R, max(M, 1), h_bf16)
    if cfg.rank != R or cfg.num_slices != S:
        raise ValueError(f"config {cfg.name()} does not match rank {R} / {S} slices")
    if cfg.h_bf16 != h_bf16:
        raise ValueError(f"config {cfg.name()} writes h as {'bfloat16' if cfg.h_bf16 else 'float32'}, "
                         f"the given h is {h.dtype}")
    if splits is not None and not (1 <= splits <= MAX_SPLITS and (splits == 1 or cfg.partial_fits)):
        raise ValueError(f"splits must be 1..{MAX_SPLITS} (only 1 for {cfg.name()}: its split-K partial "
                         "does not fit over its ring)")
    if M == 0:
        return h
    arch = arch_of(x)
    if arch != "sm_90a":
        raise ValueError(f"stream_shrink needs an sm_90a GPU (have {arch or x.device}; the reference on the CPU)")
    ranks = slot_ranks if slot_ranks is not None else meta.active_lora_ids  # never read when has_ranks = 0
    g, cl = grid(M, K, cfg, splits)
    kernel = get_kernel(sys.modules[__name__], cfg, arch)
    kernel(x, h, meta.token_indices_sorted_by_lora_ids, meta.row_group, meta.active_lora_ids,
           meta.lora_token_start_loc, ranks, *[a.reshape(L * R, K) for a in as_],
           1 if slot_ranks is not None else 0, grid=g, cluster=cl, smem=cfg.smem_bytes)
    return h


def checked_call(x: torch.Tensor, lora_a_slices, meta, h, slot_ranks, h_dtype: torch.dtype):
    """The entry checks the shrinks without quantization share (this one, shrink_grouped's): x,
    the A slices, h (the given one, else a new one of h_dtype), the metadata, slot_ranks. Returns
    (M, K, the A slices as [max_loras, R, K], h)."""
    from .expand_add import _check_meta, check_slot_ranks
    from .k1_shrink import adapter_slices, check_x

    M, K = check_x(x)
    as_ = adapter_slices(lora_a_slices, x)
    L, R, _ = as_[0].shape
    h = _output(x, len(as_), R, h, h_dtype)
    _check_meta(meta, M, x.device)
    check_slot_ranks(slot_ranks, L, x.device)
    return M, K, as_, h


def _output(x: torch.Tensor, num_slices: int, rank: int, h, h_dtype: torch.dtype) -> torch.Tensor:
    """h for x: the given one checked (the entry's errors), else a new one of h_dtype."""
    M = x.shape[0]
    if h is None:
        if h_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"h_dtype must be torch.float32 or torch.bfloat16, got {h_dtype}")
        return torch.empty((num_slices, M, rank), dtype=h_dtype, device=x.device)
    if not isinstance(h, torch.Tensor) or h.dtype not in (torch.float32, torch.bfloat16) or h.dim() != 3 \
            or h.shape[0] != num_slices or h.shape[1] < M or h.shape[2] != rank:
        raise ValueError(f"h must be float32 or bfloat16 [{num_slices}, >= {M}, {rank}]")
    if h.device != x.device or h.stride(2) != 1 or h.stride(1) != rank or h.stride(0) % rank or h.data_ptr() % 16:
        raise ValueError("h must be row-major over [M, rank] on x's device with a 16-byte aligned base")
    return h


def emulate(x: torch.Tensor, lora_a_slices, meta, slot_ranks=None, config: Config | None = None,
            splits: int | None = None, h_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-torch model of the kernel (CPU): sorted BM-row tiles, each tile's groups walked in
    order, a group's rows of the tile times its slot's A rows below the effective rank (fp32 per
    split's K range, summed in split order), stored for the group's rows only; rows no CTA stores
    stay NaN, so a gap in the tile walk shows. Returns h [S, M, R] as h_dtype."""
    from .k1_shrink import as_3d

    as_ = [as_3d(a, "a") for a in (lora_a_slices if isinstance(lora_a_slices, (list, tuple)) else [lora_a_slices])]
    M, K = x.shape
    L, R, _ = as_[0].shape
    S = len(as_)
    cfg = config or select(S, R, max(M, 1), h_dtype == torch.bfloat16)
    nsplit = splits or choose_splits(M, K, cfg)
    nkb = -(-K // BK)
    per = -(-nkb // nsplit)
    ranges = [(min(q * per * BK, K), min((q + 1) * per * BK, K)) for q in range(nsplit)]
    tok = meta.token_indices_sorted_by_lora_ids[:M].long()
    rg, act, start = meta.row_group[:M], meta.active_lora_ids, meta.lora_token_start_loc
    xf = x.float()
    h = torch.full((S, M, R), float("nan"))
    for r0 in range(0, M, cfg.bm):
        rows = min(M - r0, cfg.bm)
        for g in range(int(rg[r0]), int(rg[r0 + rows - 1]) + 1):
            lid = int(act[g])
            lo, hi = max(int(start[g]) - r0, 0), min(int(start[g + 1]) - r0, rows)
            keff = 0 if lid < 0 else R if slot_ranks is None else \
                min((max(int(slot_ranks[lid]), 0) + 15) // 16 * 16, R)
            t = tok[r0 + lo:r0 + hi]
            for s in range(S):
                out = torch.zeros(hi - lo, R)
                for k_lo, k_hi in ranges:  # split order
                    if keff and k_hi > k_lo:
                        out[:, :keff] = out[:, :keff] + xf[t, k_lo:k_hi] @ as_[s][lid, :keff, k_lo:k_hi].float().t()
                h[s, t] = out
    return h.to(h_dtype)
