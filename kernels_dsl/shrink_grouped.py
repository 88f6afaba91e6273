"""The LoRA down-projection by adapter group, CuTe-DSL, Hopper (v0.90): h_s = x . A_s[slot]^T,
one cluster per (adapter group, slice, 64-row chunk of the rank), the group's tokens gathered.

Why a third shrink: at 33-512 tokens with many adapters each adapter group holds a few tokens
(256 x 32: ~8), and both other shrinks pay per row tile, not per group: K1 and the streamed shrink
walk sorted row tiles of 16-128 rows, each tile meeting several groups, so a group's A is streamed
once per tile it meets and, in the streamed shrink, once per group with the ring refilled each time
(run41: 249 us per layer at 256 x 32 against K1's 102; K1 itself ~2x its bytes' floor). The decode
shrink (lora_shrink.py) streams each group's A once, but multiplies every token of the batch (its
WGMMA N side is the whole batch, <= 64). Here each group's A k-blocks are read exactly once per
row chunk of BN of its tokens (one chunk for groups of <= BN tokens) and the WGMMA's N side is
those tokens only, gathered from x by token index.

Grid (splits, S * chunks, groups), cluster (splits, 1, 1): z = the group's index into
active_lora_ids (CTAs past num_active exit at once), y = slice * chunks + rank chunk, x = the
split of K (the cluster rank). Swap-AB as in the decode shrink: A's 64 rank rows are WGMMA's M,
the chunk's BN tokens its N, both K-major in 128-byte-swizzled shared memory. The ring is filled
by cp.async from every thread (A's rows below the effective rank, x's rows of the chunk's tokens;
rows past them zero-filled or zeroed once) and each thread's copies arrive on the stage's mbarrier
when they land (cp.async.mbarrier.arrive.noinc), so a stage is waited for by itself, not by a
CTA-wide cp.async wait; one WGMMA group stays in flight and the stage it read is refilled after
the next CTA barrier (the decode shrink's loop). After a chunk's last k-block the split partials
meet in DSMEM and are summed in the fixed order 0..n-1 (deterministic, no workspace, no atomics).

h is defined everywhere K1 and the streamed shrink define it: the group's tokens get x . A^T for
ranks below the slot's effective rank (slot_ranks rounded up to 16, as K1) and zeros above it;
the no-adapter group's tokens get zeros. No quantization (the hybrid paths quantize for the GEMM
in their own kernel), no PDL.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import ScalarParam, TensorParam

from ._abi import struct_size

try:  # the DSL is needed to compile, not to launch a cached build
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "lora_shrink_grouped"
RUNTIME_CONTRACT = True

THREADS = 128  # one warpgroup: WGMMA's M = 64 rank rows
BK = 64  # K elements per k-block: one 128-byte swizzle row of bf16
CPR = BK // 8  # 16-byte chunks per row of a k-block
RANKS = (8, 16, 32, 64, 128, 256)
TOKEN_TILES = (8, 16, 32, 64)  # BN: a group's tokens per row chunk (WGMMA's N)
SLICE_COUNTS = (1, 2, 3, 4)
RED_PAD = 4  # fp32 words of padding per token row of the split partial
MAX_SPLITS = 16  # the cluster along K (non-portable above 8; the launcher sets the attribute)
MIN_SPLIT_KBLOCKS = 2


@dataclass(frozen=True)
class Config:
    """bn: tokens per row chunk (WGMMA's N). rank: buffer rank R. num_slices: A buffers (1..4).
    stages: depth of the (A, x) k-block ring. h_bf16: store h as bf16 (RN of the fp32 sum), what
    the hybrid paths' expand-add reads by default."""

    bn: int = 16
    rank: int = 64
    num_slices: int = 1
    stages: int = 6
    h_bf16: bool = True

    def __post_init__(self):
        if self.bn not in TOKEN_TILES:
            raise ValueError(f"bn must be one of {TOKEN_TILES}")
        if self.rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}")
        if self.num_slices not in SLICE_COUNTS:
            raise ValueError("num_slices must be 1..4")
        if not 2 <= self.stages <= 12:
            raise ValueError("stages must be 2..12")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.name()} needs {self.smem_bytes} bytes of shared memory (> {SMEM_LIMIT})")

    @property
    def n_chunks(self) -> int:
        """64-row chunks of the rank (one cluster each)."""
        return -(-self.rank // 64)

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    def name(self) -> str:
        return f"bn{self.bn}_r{self.rank}_s{self.num_slices}_st{self.stages}" + ("_hb" if self.h_bf16 else "")

    @functools.cached_property  # launches ask for it on every call
    def smem_bytes(self) -> int:
        """The kernel's smem struct, field by field: full barriers, the A ring, the x ring, the
        split partial [bn, 64 + RED_PAD] fp32, the chunk's token indices [bn] int32."""
        st, bn = self.stages, self.bn
        return struct_size([(8 * st, 8), (64 * BK * st * 2, 1024), (bn * BK * st * 2, 1024),
                            ((64 + RED_PAD) * bn * 4, 16), (bn * 4, 16)])


SMEM_LIMIT = 227 * 1024


def h_dtype_of(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.h_bf16 else torch.float32


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    i32, bf16 = torch.int32, torch.bfloat16
    p = [
        TensorParam("x", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K]
        TensorParam("h", h_dtype_of(config), 3, dynamic_shape=(1,), dynamic_stride=(0,), align=16),  # [S, M, R]
        TensorParam("token_indices_sorted", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("num_active", i32, 1, align=4),  # [1]
        TensorParam("num_tokens_per_lora", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("lora_token_start_loc", i32, 1, dynamic_shape=(0,), align=4),
        TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),
    ]
    for s in range(config.num_slices):  # A_s viewed as [max_loras * R, K]
        p.append(TensorParam(f"a{s}", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16))
    p.append(ScalarParam("has_ranks", "i"))
    return p


if cute is not None:

    @dsl_user_op
    def cp_async_arrive_noinc(bar_addr, *, loc=None, ip=None):
        """The mbarrier at `bar_addr` (32-bit shared::cta) receives one arrival from this thread once
        all of its earlier cp.async copies have landed; noinc: the barrier's count includes it."""
        llvm.inline_asm(
            None,
            [cutlass.Int32(bar_addr).ir_value(loc=loc, ip=ip)],
            "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
            "r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )

    class _GroupedShrinkKernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.R, self.BN, self.ST = cfg.rank, cfg.bn, cfg.stages
            self.XU = (cfg.bn * CPR + THREADS - 1) // THREADS  # x chunks per thread per stage

        @cute.jit
        def __call__(self, x: cute.Tensor, h: cute.Tensor, tok: cute.Tensor, active: cute.Tensor,
                     num_active: cute.Tensor, counts: cute.Tensor, starts: cute.Tensor, slot_ranks: cute.Tensor,
                     has_ranks: cutlass.Int32, stream: cuda.CUstream, a_bufs: tuple):
            sA_layout = D.kmajor_layout(64, self.ST)
            sX_layout = D.kmajor_layout(self.BN, self.ST)
            st, bn = self.ST, self.BN
            red_cosize = (64 + RED_PAD) * bn

            @cute.struct
            class Storage:
                full: cute.struct.MemRange[cutlass.Int64, st]
                sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sA_layout)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sX_layout)], 1024]
                sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, red_cosize], 16]
                sTok: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, bn], 16]

            self.storage = Storage
            self.smem_size = Storage.size_in_bytes()
            # Launch geometry for the JIT path only (the runtime launches the cubin itself).
            self.kernel(x, h, tok, active, num_active, counts, starts, slot_ranks, a_bufs, has_ranks,
                        sA_layout, sX_layout).launch(
                grid=(1, self.cfg.num_slices * self.cfg.n_chunks, 1), block=(THREADS, 1, 1), cluster=(1, 1, 1),
                smem=self.cfg.smem_bytes, stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mH: cute.Tensor, mTok: cute.Tensor, mActive: cute.Tensor,
                   mNumActive: cute.Tensor, mCount: cute.Tensor, mStart: cute.Tensor, mRanks: cute.Tensor,
                   mAs: tuple, has_ranks: cutlass.Int32, sA_layout: cute.ComposedLayout,
                   sX_layout: cute.ComposedLayout):
            cfg = self.cfg
            BN, ST, R = self.BN, self.ST, self.R
            NCH = cfg.n_chunks
            NK16 = BK // 16
            XU = self.XU
            tidx, _, _ = cute.arch.thread_idx()
            _, by, bz = cute.arch.block_idx()
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[0])
            nsplit = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_dim()[0])
            K = cute.size(mX, mode=[1])

            # This cluster's group, slice and rank chunk (uniform over the cluster: it leaves whole).
            # The count and the group's slot are loaded together, clamped into the table and
            # discarded past num_active.
            g = bz
            n_active = mNumActive[0]
            gi = cutlass.min(g, cute.size(mActive) - 1)
            lid_any = mActive[gi]
            cnt_any = mCount[gi]
            start = mStart[gi]
            lid = cutlass.Int32(-1)
            cnt = cutlass.Int32(0)
            if g < n_active:
                lid = lid_any
                cnt = cnt_any
            sl = by // NCH
            c = by - sl * NCH
            c0 = c * 64
            cols = cutlass.min(R - c0, 64)  # h columns of this chunk
            keff = D.k_eff(lid, mRanks, has_ranks, R)  # 0 for the no-adapter group
            rows_a = cutlass.max(cutlass.min(keff - c0, 64), 0)  # A rows this chunk loads

            st_ = D.smem_allocator().allocate(self.storage)
            sTok = st_.sTok.get_tensor(cute.make_layout(BN))
            if cnt > 0 and rows_a == 0:
                # The no-adapter group, a rank-0 slot or a chunk above the effective rank: zeros
                # for the group's tokens, the elements shared by the cluster's CTAs.
                n_el = cnt * cols
                e_lo = split * n_el // nsplit
                e_hi = (split + 1) * n_el // nsplit
                for e in cutlass.range(e_lo + tidx, e_hi, THREADS, unroll=1):
                    j = e // cols
                    self._store(mH, sl, mTok[start + j], c0 + e - j * cols, cutlass.Float32(0.0))
            if rows_a > 0 and cnt > 0:
                full = st_.full.data_ptr()
                sA = st_.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
                sX = st_.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
                sRed = st_.sRed.get_tensor(cute.make_layout((64, BN), stride=(1, 64 + RED_PAD)))
                bases = (st_.sA.data_ptr().toint(), st_.sX.data_ptr().toint())
                if tidx == 0:
                    for i in cutlass.range_constexpr(ST):
                        cute.arch.mbarrier_init(full + i, THREADS)  # every thread's cp.async arrive
                    cute.arch.mbarrier_init_fence()
                # A rows at and above the effective rank: zero in every stage, once (the copies
                # never write them), so their products are zeros.
                zrows = 64 - rows_a
                for e in cutlass.range(tidx, zrows * CPR * ST, THREADS, unroll=1):
                    s = e // (zrows * CPR)
                    rem = e - s * (zrows * CPR)
                    r = rows_a + rem // CPR
                    off = (s * (64 * BK) + r * BK + (rem - (rem // CPR) * CPR) * 8) * 2
                    D.st_shared_v4_b32(bases[0] + D.swizzle_128b(off), cutlass.Int32(0), cutlass.Int32(0),
                                       cutlass.Int32(0), cutlass.Int32(0))
                cute.arch.fence_proxy("async.shared", space="cta")  # generic stores, WGMMA reads
                cute.arch.barrier()

                nk = (K + BK - 1) // BK
                kb_lo = split * nk // nsplit
                kb_hi = (split + 1) * nk // nsplit
                nloc = kb_hi - kb_lo  # >= 1: the host keeps splits <= k-blocks
                n_rc = (cnt + BN - 1) // BN  # row chunks of the group's tokens
                total = n_rc * nloc  # ring items: (row chunk, k-block), chunk-major
                a_row0 = lid * R + c0

                kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
                tiled_mma = sm90_utils.make_trivial_tiled_mma(
                    cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, (1, 1, 1), tiler_mn=(64, BN))
                thr = tiled_mma.get_slice(tidx)
                tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
                tCrX = tiled_mma.make_fragment_B(thr.partition_B(sX))
                tCcC = thr.partition_C(cute.make_identity_tensor((64, BN)))
                acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

                # This thread's x rows' token indices for the row chunk being issued (reloaded at
                # each chunk's first k-block: the copies' addresses wait for them only then).
                toks = cute.make_rmem_tensor((XU,), cutlass.Int32)
                for i in cutlass.range(cutlass.min(total, ST), unroll=1):
                    self._issue(i, i, nloc, kb_lo, K, cnt, start, rows_a, a_row0, sl, mX, mAs, mTok, toks, bases,
                                full, tidx)
                # One WGMMA group stays in flight: item t's MMAs run while the CTA agrees that item
                # t-1's stage is free and refills it (the decode shrink's loop).
                for t in cutlass.range(total, unroll=1):
                    s = t % ST
                    cute.arch.mbarrier_wait(full + s, (t // ST) % 2)
                    # cp.async wrote the stage (generic proxy); WGMMA reads it (async proxy). Not
                    # what limits a CTA's rate: K1's WGMMA builds without it measured the same
                    # (run42, perf.md v0.90b).
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.nvgpu.warpgroup.fence()
                    for kk in cutlass.range_constexpr(NK16):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kk, s)], tCrX[(None, None, kk, s)], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if t > 0:
                        cute.arch.barrier()  # everyone is done with item t-1's stage: refill it
                        j = t - 1 + ST
                        if j < total:
                            self._issue(j, j % ST, nloc, kb_lo, K, cnt, start, rows_a, a_row0, sl, mX, mAs, mTok,
                                        toks, bases, full, tidx)
                    q = t // nloc
                    if t - q * nloc == nloc - 1:
                        # the row chunk's last k-block: its split partials -> h
                        cute.nvgpu.warpgroup.wait_group(0)
                        mval = cutlass.min(cnt - q * BN, BN)
                        if tidx < BN:
                            tk = cutlass.Int32(-1)
                            if tidx < mval:
                                tk = mTok[start + q * BN + tidx]
                            sTok[tidx] = tk
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            r, jj = tCcC[i]
                            sRed[r, jj] = acc[i]
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                        D.reduce_split_partials(
                            sRed, 0, mval, cols, 64 + RED_PAD, MAX_SPLITS, split, nsplit, tidx, THREADS,
                            lambda jr, rc, v: self._store(mH, sl, sTok[jr], c0 + rc, v))
                        # no CTA overwrites its partial (the next chunk) while others read it
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                        acc.fill(0.0)

        @cute.jit
        def _store(self, mH, s, t, col, v):
            if cutlass.const_expr(self.cfg.h_bf16):
                mH[s, t, col] = v.to(cutlass.BFloat16)  # RN, as the consumers round it
            else:
                mH[s, t, col] = v

        @cute.jit
        def _issue(self, item, st, nloc, kb_lo, K, cnt, start, rows_a, a_row0, s, mX, mAs: tuple, mTok, toks,
                   bases, full, tidx):
            """cp.async of ring item `item` (row chunk item // nloc, k-block kb_lo + item % nloc) into
            stage st: A_s's rows [a_row0, a_row0 + rows_a) and the chunk's tokens' x rows (rows past
            the group's count and the K tail zero-filled: a zero-byte copy reads nothing), then this
            thread's arrival on the stage's barrier once its copies land. One D.cp_async_cg_16 per
            16-byte chunk, the shared address swizzled from the byte offset (1024-aligned rings)."""
            BN, XU = self.BN, self.XU
            q = item // nloc
            kq = item - q * nloc
            kb = (kb_lo + kq) * BK
            if kq == 0:  # a new row chunk: its tokens (items are issued in order)
                for i in cutlass.range_constexpr(XU):
                    row = q * BN + (tidx + i * THREADS) // CPR
                    toks[i] = mTok[start + cutlass.min(row, cnt - 1)]
            a_base, x_base = bases
            for i in cutlass.range_constexpr((64 * CPR + THREADS - 1) // THREADS):
                e = tidx + i * THREADS
                if e < rows_a * CPR:
                    n = e // CPR
                    col = (e - n * CPR) * 8
                    ok = kb + col < K
                    nbytes = cutlass.Int32(cutlass.select_(ok, 16, 0))
                    cc = cutlass.Int32(cutlass.select_(ok, kb + col, 0))
                    for sq in cutlass.range_constexpr(self.cfg.num_slices):
                        if s == sq:
                            src = cute.zipped_divide(mAs[sq][a_row0 + n, None], (8,))[None, cc // 8]
                            off = (st * (64 * BK) + n * BK + col) * 2
                            D.cp_async_cg_16(a_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)
            for i in cutlass.range_constexpr(XU):
                e = tidx + i * THREADS
                if cutlass.const_expr((i + 1) * THREADS <= BN * CPR) or e < BN * CPR:
                    r = e // CPR
                    col = (e - r * CPR) * 8
                    row = q * BN + r
                    ok = row < cnt and kb + col < K
                    t = toks[i]
                    nbytes = cutlass.Int32(cutlass.select_(ok, 16, 0))
                    tt = cutlass.Int32(cutlass.select_(ok, t, 0))
                    cc = cutlass.Int32(cutlass.select_(ok, kb + col, 0))
                    src = cute.zipped_divide(mX[tt, None], (8,))[None, cc // 8]
                    off = (st * (BN * BK) + r * BK + col) * 2
                    D.cp_async_cg_16(x_base + D.swizzle_128b(off), src.iterator.toint(), nbytes)
            cp_async_arrive_noinc(full.toint() + st * 8)  # the barriers are 8 bytes apart


def _fake_args(cfg: Config):
    i32, f32, bf16 = cutlass.Int32, cutlass.Float32, cutlass.BFloat16
    # Divisibility exactly as the host checks it (K % 8, row strides % 8 elements).
    x = D.fake_matrix(bf16, 8)
    h = D.fake_rowmajor(bf16 if cfg.h_bf16 else f32, (cfg.num_slices, cute.sym_int32(), cfg.rank))
    vec = lambda: D.fake_rowmajor(i32, (cute.sym_int32(),), align=4)  # noqa: E731
    num_active = D.fake_rowmajor(i32, (1,), align=4)
    a_bufs = tuple(D.fake_matrix(bf16, 8) for _ in range(cfg.num_slices))
    return (x, h, vec(), vec(), num_active, vec(), vec(), vec(), cutlass.Int32(0), cute.runtime.make_fake_stream(),
            a_bufs)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """Compile for the target in ``options`` from fake tensors (no GPU needed)."""
    return D.compile_with_smem(_GroupedShrinkKernel(config), _fake_args(config), options)


# ---------------------------------------------------------------------------------------------
# Host side: configuration choice, validation, launch, CPU model
# ---------------------------------------------------------------------------------------------

SM_COUNT = 132  # H100 / H200
# Ring depth per token tile: the deepest (<= 6 stages of 8 KB of A in flight) that keeps three CTAs
# per SM up to bn 32 (<= 72 KB each) and two at bn 64 (~100 KB).
STAGES = {8: 6, 16: 6, 32: 5, 64: 5}
TARGET_CTAS = 3 * SM_COUNT


def expected_groups(meta, max_loras: int) -> int:
    """The adapter groups the launch rule plans for: the host's count when it knows it
    (meta.host_num_adapters), else max_loras (an upper bound, known without reading the device)."""
    return meta.host_num_adapters or max_loras


@functools.lru_cache(maxsize=8192)  # a pure function of its arguments, asked on every launch
def select(num_slices: int, rank: int, m: int, groups: int, h_bf16: bool = True) -> Config:
    """The row chunk: the smallest token tile holding 1.5x the mean group (m / groups tokens), so
    that most groups are one chunk (each extra chunk streams the group's A again, from L2), at most
    64."""
    if rank not in RANKS:
        raise ValueError(f"adapter rank {rank} is not one of the compiled ranks {RANKS}")
    want = 1.5 * max(m, 1) / max(groups, 1)
    bn = next((b for b in TOKEN_TILES if b >= want), TOKEN_TILES[-1])
    return Config(bn=bn, rank=rank, num_slices=num_slices, stages=STAGES[bn], h_bf16=h_bf16)


def choose_splits(k: int, cfg: Config, groups: int) -> int:
    """Cluster size along K: enough for ~three CTAs per SM over the groups' clusters, at most
    MAX_SPLITS, >= MIN_SPLIT_KBLOCKS k-blocks each."""
    nkb = -(-k // BK)
    clusters = max(groups, 1) * cfg.num_slices * cfg.n_chunks
    s = max(1, min(MAX_SPLITS, -(-TARGET_CTAS // clusters), nkb // MIN_SPLIT_KBLOCKS))
    return s


def grid(m: int, max_loras: int, cfg: Config, splits: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, cluster): (splits, slices * rank chunks, every group the batch may have), cluster
    (splits, 1, 1)."""
    return (splits, cfg.num_slices * cfg.n_chunks, min(m, max_loras + 1)), (splits, 1, 1)


def prebuild_configs() -> list[Config]:
    """Every token tile at every (slices, rank), with bf16 h (the hybrid paths') and fp32 h (the GPU
    tests hold those against the reference without bf16's rounding)."""
    cfgs = {Config(bn=bn, rank=r, num_slices=s, stages=STAGES[bn], h_bf16=True)
            for s in SLICE_COUNTS for r in RANKS for bn in TOKEN_TILES}
    cfgs |= {Config(bn=bn, rank=r, num_slices=s, stages=STAGES[bn], h_bf16=False) for s in SLICE_COUNTS
             for r in RANKS for bn in TOKEN_TILES}
    return sorted(cfgs, key=lambda c: (c.num_slices, c.rank, c.bn, c.stages, c.h_bf16))


def grouped_shrink(x: torch.Tensor, lora_a_slices, meta, h: torch.Tensor | None = None,
                   slot_ranks: torch.Tensor | None = None, *, groups: int | None = None,
                   config: Config | None = None, splits: int | None = None,
                   h_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One launch: h [S, M, R] = x . A_s[slot]^T per slice, fp32 sums in k-block order within each
    split's K range and over the splits in split order, stored as h_dtype (bf16: rounded to nearest
    even); zeros for tokens without an adapter and beyond a slot's effective rank (slot_ranks
    rounded up to 16). groups: the adapters the host expects in the batch (the token tile and the
    split; default meta.host_num_adapters, else max_loras) — any value gives the same h. splits:
    force the cluster size along K. Returns h.

    x: [M, K] bf16, K a multiple of 8, unit column stride, row stride a multiple of 8, 16-byte
        aligned. lora_a_slices: S (1..4) tensors [max_loras, 1, R, K] (or [max_loras, R, K]) bf16,
        row-major. meta: LoRABatchMeta prepared for these M tokens. h: optional output written in
        place (float32 or bfloat16 [S, >= M, R], row-major over [M, R])."""
    from epilora_cute.arch import arch_of
    from epilora_cute.kernels import get_kernel

    from .shrink_stream import checked_call

    M, K, as_, h = checked_call(x, lora_a_slices, meta, h, slot_ranks, h_dtype)
    S = len(as_)
    L, R, _ = as_[0].shape
    h_bf16 = h.dtype == torch.bfloat16
    n_groups = groups if groups is not None else expected_groups(meta, L)
    cfg = config or select(S, R, max(M, 1), n_groups, h_bf16)
    if cfg.rank != R or cfg.num_slices != S:
        raise ValueError(f"config {cfg.name()} does not match rank {R} / {S} slices")
    if cfg.h_bf16 != h_bf16:
        raise ValueError(f"config {cfg.name()} writes h as {'bfloat16' if cfg.h_bf16 else 'float32'}, "
                         f"the given h is {h.dtype}")
    nkb = -(-K // BK)
    if splits is not None and not 1 <= splits <= min(MAX_SPLITS, nkb):
        raise ValueError(f"splits must be 1..{min(MAX_SPLITS, nkb)} (at most one per k-block), got {splits}")
    if M == 0:
        return h
    arch = arch_of(x)
    if arch != "sm_90a":
        raise ValueError(f"grouped_shrink needs an sm_90a GPU (have {arch or x.device}; the reference on the CPU)")
    ranks = slot_ranks if slot_ranks is not None else meta.active_lora_ids  # never read when has_ranks = 0
    g, cl = grid(M, L, cfg, splits or choose_splits(K, cfg, n_groups))
    kernel = get_kernel(sys.modules[__name__], cfg, arch)
    kernel(x, h, meta.token_indices_sorted_by_lora_ids, meta.active_lora_ids, meta.num_active,
           meta.num_tokens_per_lora, meta.lora_token_start_loc, ranks, *[a.reshape(L * R, K) for a in as_],
           1 if slot_ranks is not None else 0, grid=g, cluster=cl, smem=cfg.smem_bytes)
    return h


def emulate(x: torch.Tensor, lora_a_slices, meta, slot_ranks=None, config: Config | None = None,
            splits: int | None = None, h_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-torch model of the kernel (CPU): every group of the table below num_active, its tokens
    in row chunks of bn, each slice's 64-row rank chunks below the effective rank multiplied per
    split's K range (fp32, summed in split order), zeros for the rest of the group's columns and
    for the no-adapter group; rows no CTA stores stay NaN, so a gap in the group walk shows.
    Returns h [S, M, R] as h_dtype."""
    from .k1_shrink import as_3d

    as_ = [as_3d(a, "a") for a in (lora_a_slices if isinstance(lora_a_slices, (list, tuple)) else [lora_a_slices])]
    M, K = x.shape
    L, R, _ = as_[0].shape
    S = len(as_)
    groups = expected_groups(meta, L)
    cfg = config or select(S, R, max(M, 1), groups, h_dtype == torch.bfloat16)
    nsplit = splits or choose_splits(K, cfg, groups)
    nkb = -(-K // BK)
    ranges = [(min(q * nkb // nsplit * BK, K), min((q + 1) * nkb // nsplit * BK, K)) for q in range(nsplit)]
    tok = meta.token_indices_sorted_by_lora_ids.long()
    act, cnts, starts = meta.active_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc
    xf = x.float()
    h = torch.full((S, M, R), float("nan"))
    for g in range(min(int(meta.num_active[0]), M, L + 1)):
        lid, cnt, start = int(act[g]), int(cnts[g]), int(starts[g])
        keff = 0 if lid < 0 else R if slot_ranks is None else \
            min((max(int(slot_ranks[lid]), 0) + 15) // 16 * 16, R)
        for r0 in range(0, cnt, cfg.bn):
            t = tok[start + r0:start + min(r0 + cfg.bn, cnt)]
            for s in range(S):
                out = torch.zeros(len(t), R)
                for k_lo, k_hi in ranges:  # split order
                    if keff and k_hi > k_lo:
                        out[:, :keff] = out[:, :keff] + xf[t, k_lo:k_hi] @ as_[s][lid, :keff, k_lo:k_hi].float().t()
                h[s, t] = out
    return h.to(h_dtype)
