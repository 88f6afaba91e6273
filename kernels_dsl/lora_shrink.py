"""Down-projection of the decode path + the activations' FP8 quantization, one launch (CuTe-DSL).

h_s[m, :] = x[m] . A_s[slot(m)]^T in fp32, for every output slice s and every token m with an
adapter; x_q, s_x = quantize_fp8_per_token(x) bit for bit as vLLM (and epilora_cute.reference).

Grid (S, Y, Z), cluster (S, 1, 1):
  * z < zq = ceil(M / (S*Y)): quantization planes, one token per CTA (16-byte vector loads), or,
    when M <= Y, one token per cluster, each of its S CTAs quantizing 1/S of the row with the
    row's maximum combined in DSMEM (at one token the whole row was one CTA's serial work, on
    K2's critical path); every CTA of these planes then increments sync[0] once (release). K2's producer spins until
    sync[0] == zq*S*Y (= its n_quant).
  * z = zq + g: adapter group g (index into active_lora_ids; CTAs of absent groups, of the "-1"
    group and of rank chunks beyond the slot's effective rank exit at once).
    y = slice * n_chunks + c: slice and 64-row chunk c of the rank.
    x (the cluster rank): split-K. The S partials of a cluster are summed in DSMEM in the fixed
    order 0..S-1, each element by one CTA: deterministic, no workspace.
Swap-AB again: A's rank rows are WGMMA's M side (64 per chunk), the tokens its N side (BN), all
tokens of the batch (the group's tokens are picked when h is written; the WGMMA work on other
tokens is free at decode sizes and spares a gather).

PDL, both sides. K2 (launched with PDL) is this kernel's dependent; this kernel may itself be
launched with PDL behind the previous projection's K2 ("chained", ops.lora_linear_fp8(chain_pdl=
True)), so its launch, barrier init, descriptor prefetch and first A stages overlap that kernel's
tail. Rules (a no-op wait when launched without PDL):
  * griddepcontrol.wait comes before any read of x or of anything a predecessor may write, and
    before any global write (x_q, s_x, the sync increment, h): the quantization CTAs wait first
    thing; a down-projection CTA requests the A (weight) loads of its first stages, then waits,
    then loads x.
  * griddepcontrol.launch_dependents comes right after the wait, never before: K2 is launched
    only once the previous kernel has completed. That keeps the x_q flag safe (the previous K2's
    re-arm of `sync` is done before our increments and before our K2's spin) and keeps the
    overlap one kernel deep (no cascade of launches). CTAs that exit early trigger by exiting.
    The exception, xgate builds (v1.03, beside an xgate K2; no quantization planes): every CTA
    triggers first, then waits, and the first CTA publishes past its wait (sync[0]); the K2 reads
    x only after acquiring that and triggers its own dependents only after it, which bounds the
    cascade to two K2s in flight (k2_gemm's module docstring).
  * Assumption: the metadata (num_active, active_lora_ids, slot_ranks) and the A buffers are read
    before the wait, so they must not be written by the kernel still running when this one
    starts (the one just before it on the stream; behind one of our K2s, also the shrink or
    quantization kernel before that K2). Adapter buffers and batch metadata are written long
    before the layers run; ops only chains when that holds for its own persistent tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._abi import CoordParam, TensorParam, TmaParam, TmaSpec, struct_size

try:  # the DSL is needed to compile, not to launch a cached build
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "lora_shrink_quant"
RUNTIME_CONTRACT = True

THREADS = 128
RED_PAD = 4
# Trace builds (Config.trace): per CTA ((z * Y + y) * S + x), %globaltimer ns at: kernel entry, past
# griddepcontrol.wait, x_q published (quantization CTAs) / main loop done (down-projection), h stored;
# quantization CTAs with a token also: the CTA's amax (first pass + block barrier), the row's amax
# (after the cluster's DSMEM exchange when split), codes stored (thread 0's), past the barrier
# before the fence (then fence.acq_rel.gpu + the flag = published).
TRACE_SLOTS = 8
TRACE_SHRINK = ("start", "waited", "published_or_mainloop_done", "h_stored", "q_amax_cta", "q_amax_row",
                "q_codes_stored", "q_before_fence")
MAX_CLUSTER = 16  # the largest split-K cluster a launch may use (non-portable above 8)
QV = 8  # 16-byte vectors of x per thread in flight at once in the quantization planes
DEBUG_PRINT = False


@dataclass(frozen=True)
class Config:
    """bn: token tile (8/16/32; 64 beside K2's token-tile builds at 33..64 tokens). rank: buffer rank R.
    num_slices: A buffers (one per output slice).
    bk: bf16 K per stage (64 = one 128-byte swizzle row). stages: pipeline depth.
    quant: include the quantization (False: no quantization planes, no x_q / s_x / sync arguments;
    the down-projection alone, beside a K2 that quantizes x itself (k2_gemm.Config.self_quant),
    or timed alone by tools/bench_stages.py)."""

    bn: int = 16
    rank: int = 64
    num_slices: int = 1
    bk: int = 64
    stages: int = 4
    quant: bool = True
    trace: bool = False  # timeline stamps (%globaltimer) into an extra int64 [CTAs, 8] argument
    # The x gate (v1.03, opt-in; beside an xgate K2, k2_gemm.Config.xgate): every CTA triggers the K2
    # at its start, before its griddepcontrol.wait, and the grid's first CTA, past its wait,
    # release-increments sync[0] (the K2 reads x only after acquiring it). Builds without the
    # quantization planes only (the self_quant pair).
    xgate: bool = False

    def __post_init__(self):
        if self.bn not in (8, 16, 32, 64):
            raise ValueError("bn must be 8, 16, 32 or 64")
        if self.rank not in (8, 16, 32, 64, 128, 256):
            raise ValueError("rank must be 8..256, a power of two")
        if not 1 <= self.num_slices <= 4:
            raise ValueError("num_slices must be 1..4")
        if self.xgate and (self.quant or self.trace):
            raise ValueError("xgate is a variant of the builds without quantization planes (no trace)")

    @property
    def rows_box(self) -> int:  # A rows a TMA box brings (the WGMMA always reads 64)
        return min(self.rank, 64)

    @property
    def n_chunks(self) -> int:
        return -(-self.rank // 64)

    def name(self) -> str:
        return (f"bn{self.bn}_r{self.rank}_s{self.num_slices}_bk{self.bk}_st{self.stages}" + ("" if self.quant else "_noq")
                + ("_xg" if self.xgate else "") + ("_trace" if self.trace else ""))

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    @functools.lru_cache(maxsize=None)  # launches ask for it on every call (configs are immutable)
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the kernel's smem struct, field by field."""
        st, bn, bk = self.stages, self.bn, self.bk
        return struct_size([(8 * st, 8), (32, 4), (64 * bk * st * 2, 1024), (bn * bk * st * 2, 1024),
                            ((64 + RED_PAD) * bn * 4, 16)])


if cute is not None:

    class _ShrinkKernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg

        @cute.jit
        def __call__(self, x: cute.Tensor, h: cute.Tensor, xq16: cute.Tensor, sx: cute.Tensor,
                     sync: cute.Tensor, tok: cute.Tensor, active: cute.Tensor, num_active: cute.Tensor,
                     slot_ranks: cute.Tensor, stream: cuda.CUstream, a0: cute.Tensor, a1: cute.Tensor = None,
                     a2: cute.Tensor = None, a3: cute.Tensor = None, trace: cute.Tensor = None):
            cfg = self.cfg
            a_bufs = tuple(a for a in (a0, a1, a2, a3) if a is not None)
            assert len(a_bufs) == cfg.num_slices
            bf16 = x.element_type
            lay = utils.LayoutEnum.from_tensor(x)
            tile = (64, cfg.bn, cfg.bk)
            sA_layout = sm90_utils.make_smem_layout_a(lay, tile, bf16, cfg.stages)
            # The TMA box holds rows_box (= min(R, 64)) rows; it lands in the first rows of a stage of sA
            # (K-major atoms are 8 rows tall and stack along M, so those rows form the same layout).
            sAt_layout = sm90_utils.make_smem_layout_a(lay, (cfg.rows_box, cfg.bn, cfg.bk), bf16, 1)
            sX_layout = sm90_utils.make_smem_layout_b(lay, tile, bf16, cfg.stages)
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_as = []
            mAs = []
            for i in cutlass.range_constexpr(cfg.num_slices):
                ta, tt = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    op, a_bufs[i], cute.slice_(sAt_layout, (None, None, 0)), (cfg.rows_box, cfg.bk))
                tma_as.append(ta)
                mAs.append(tt)
            tma_x, mX = cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, x, cute.slice_(sX_layout, (None, None, 0)), (cfg.bn, cfg.bk))

            stages = cfg.stages
            red_cosize = (64 + RED_PAD) * cfg.bn

            @cute.struct
            class Storage:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                red_max: cute.struct.MemRange[cutlass.Float32, 8]
                sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sA_layout)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sX_layout)], 1024]
                sRed: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, red_cosize], 16]

            self.storage = Storage
            self.smem_size = self.storage.size_in_bytes()
            # Launch geometry for the JIT path only (the runtime launches the cubin itself):
            # S = 1, Y = slices * chunks, Z = 1 + groups (as many as the batch could have).
            ny = cfg.num_slices * cfg.n_chunks
            self.kernel(x, mX, tma_x, tuple(tma_as), tuple(mAs), h, xq16, sx, sync, tok, active, num_active,
                        slot_ranks, trace, sA_layout, sAt_layout, sX_layout).launch(
                grid=(1, ny, (cute.size(x, mode=[0]) + ny - 1) // ny + cute.size(tok)), block=(THREADS, 1, 1),
                cluster=(1, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mXg: cute.Tensor, mX: cute.Tensor, tma_x: cute.CopyAtom, tma_as: tuple, mAs: tuple,
                   mH: cute.Tensor, mXq16: cute.Tensor, mSx: cute.Tensor, mSync: cute.Tensor, mTok: cute.Tensor,
                   mActive: cute.Tensor, mNumActive: cute.Tensor, mSlotRanks: cute.Tensor, mTrace,
                   sA_layout: cute.ComposedLayout, sAt_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout):
            cfg = self.cfg
            BN, BK, STAGES, R = cfg.bn, cfg.bk, cfg.stages, cfg.rank
            RB = cfg.rows_box
            NCH = cfg.n_chunks

            tidx, _, _ = cute.arch.thread_idx()
            bx, by, bz = cute.arch.block_idx()
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[0])
            nsplit = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_dim()[0])
            M = cute.size(mXg, mode=[0])
            K = cute.size(mXg, mode=[1])

            # Trace builds: this CTA's row of the [CTAs, 8] timeline (TRACE_SHRINK).
            trace_row = cutlass.Int64(0)
            if cutlass.const_expr(cfg.trace):
                gdt = cute.arch.grid_dim()
                trace_row = mTrace.iterator.toint() + cutlass.Int64((bz * gdt[1] + by) * gdt[0] + bx) * 64
                if tidx == 0:
                    D.stamp_globaltimer(trace_row)

            smem = cutlass.utils.SmemAllocator()
            st = smem.allocate(self.storage)

            # Planes z < zq quantize (zq = ceil(M / (S*Y)) planes, see launch()): one token per CTA, or
            # one per cluster with the row split over its CTAs when M <= Y;
            # planes z >= zq are the down-projection of group z - zq.
            gd = cute.arch.grid_dim()
            per_plane = gd[0] * gd[1]
            zq = (M + per_plane - 1) // per_plane
            if cutlass.const_expr(not cfg.quant):
                zq = cutlass.Int32(0)
            if bz < zq:
                # ============================ FP8 per-token quantization ============================
                if cutlass.const_expr(cfg.quant):
                    # Chained: x may be the previous kernel's output, and sync its re-arm; read
                    # or write nothing global before it completes. Then let K2 (our PDL
                    # dependent) be scheduled: it needs x_q (flag) only before its main loop and
                    # h (its own griddepcontrol.wait) only before its epilogue.
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                    self._stamp(trace_row, 1, tidx)
                    # Rows split over the cluster when the batch has no more tokens than a plane has
                    # clusters (decode at 1..Y tokens): token by, each of the S CTAs takes 1/S of
                    # the row and the S partial maxima meet in DSMEM (max is exact in any order,
                    # so the codes are the same). Otherwise one token per CTA, the whole row.
                    rows_split = M <= gd[1]
                    m = (bz * gd[1] + by) * gd[0] + bx
                    if rows_split:
                        m = by
                    if m < M:  # uniform over a cluster in the split mode
                        red = st.red_max.get_tensor(cute.make_layout(8))
                        nvec = K // 8
                        v_lo = cutlass.Int32(0)
                        v_hi = nvec
                        if rows_split:
                            v_lo = split * nvec // nsplit
                            v_hi = (split + 1) * nvec // nsplit
                        amax = self._row_amax(mXg, m, v_lo, v_hi, tidx, red)
                        self._stamp(trace_row, 4, tidx)
                        if rows_split:
                            if tidx == 0:
                                red[4] = amax
                            cute.arch.cluster_arrive()
                            cute.arch.cluster_wait()
                            # All S maxima requested at once (one DSMEM round trip), then combined.
                            red_addr = red.iterator.toint() + 16
                            parts = cute.make_rmem_tensor((MAX_CLUSTER,), cutlass.Float32)
                            for q in cutlass.range_constexpr(MAX_CLUSTER):
                                parts[q] = cutlass.Float32(0.0)
                                if q < nsplit:
                                    parts[q] = D.ld_dsmem_f32(red_addr, q)
                            for q in cutlass.range_constexpr(MAX_CLUSTER):
                                amax = D.fmax_f32(amax, parts[q])
                        self._stamp(trace_row, 5, tidx)
                        scale = D.fp8_scale(amax)
                        sx_owner = tidx  # thread 0 of the token's (first) CTA writes s_x
                        if rows_split:
                            sx_owner = tidx + split * THREADS
                        if sx_owner == 0:
                            mSx[m] = scale
                        self._row_codes(mXg, mXq16, m, v_lo, v_hi, tidx, scale)
                        self._stamp(trace_row, 6, tidx)
                        if rows_split:
                            # Every CTA of the cluster has read this one's maximum before it exits.
                            cute.arch.cluster_arrive()
                            cute.arch.cluster_wait()
                    # Publish: all of this CTA's stores, then one release increment (every CTA of
                    # the quantization planes, with or without a token: K2 waits for all of them).
                    cute.arch.barrier()
                    self._stamp(trace_row, 7, tidx)
                    if tidx == 0:
                        cute.arch.fence_acq_rel_gpu()
                        D.red_release_gpu_add_s32(mSync.iterator.toint(), 1)
                    self._stamp(trace_row, 2, tidx)
            else:
                # ================================ down-projection ==================================
                if cutlass.const_expr(cfg.xgate):
                    # The x gate: K2 may be scheduled now, under the kernel before us (it reads x
                    # only after our first CTA's publication below). Then the wait (a no-op unless
                    # launched with PDL); past it the kernel that wrote x has completed, and the
                    # first CTA says so (release: K2 acquires it before its x loads).
                    cute.arch.griddepcontrol_launch_dependents()
                    cute.arch.griddepcontrol_wait()
                    if bx + by + bz == 0:
                        if tidx == 0:
                            cute.arch.fence_acq_rel_gpu()
                            D.red_release_gpu_add_s32(mSync.iterator.toint(), 1)
                elif cutlass.const_expr(not cfg.quant):
                    # Beside the self-quantizing K2 there is no x_q protocol to keep safe: every CTA
                    # waits (a no-op unless launched with PDL) and triggers first thing, before its
                    # barrier init and A loads (~1.3 us on the H200): K2's launch was the pair's
                    # exposed cost (docs/perf.md v0.29), and K2 still starts only once the kernel
                    # that wrote x has completed (K2 reads x when it starts).
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                g = bz - zq
                # The count and the group's slot are loaded together (one round trip, not two):
                # the slot load is clamped into the table and discarded past the count.
                n_active = mNumActive[0]
                lid_any = mActive[cutlass.min(g, cute.size(mActive) - 1)]
                lid = cutlass.Int32(-1)
                if g < n_active:
                    lid = lid_any
                sl = by // NCH
                c = by - sl * NCH
                reff = cutlass.Int32(0)
                if lid >= 0:
                    reff = cutlass.max(cutlass.min(mSlotRanks[lid], R), 0)
                # Uniform over the cluster (same y, z): whole clusters leave together.
                if c * 64 < reff:
                    full = st.full.data_ptr()
                    sA = st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
                    sX = st.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
                    sRed = st.sRed.get_tensor(cute.make_layout((64, BN), stride=(1, 64 + RED_PAD)))
                    if tidx == 0:
                        for i in cutlass.range_constexpr(STAGES):
                            cute.arch.mbarrier_init(full + i, 1)
                        cute.arch.mbarrier_init_fence()
                    cute.arch.barrier()

                    nk = (K + BK - 1) // BK
                    kb_lo = split * nk // nsplit
                    kb_hi = (split + 1) * nk // nsplit
                    nloc = kb_hi - kb_lo
                    # A rows of (slot, chunk) start at lid*R + c*64: a multiple of the box height.
                    a_blk = (lid * R + c * 64) // RB
                    gX = cute.local_tile(mX, (BN, BK), (0, None))
                    tXs, tXg = cute.nvgpu.cpasync.tma_partition(
                        tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                    stage_bytes = (RB * BK + BN * BK) * 2

                    kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
                    tiled_mma = sm90_utils.make_trivial_tiled_mma(
                        cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, (1, 1, 1), tiler_mn=(64, BN))
                    thr = tiled_mma.get_slice(tidx)
                    tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
                    tCrX = tiled_mma.make_fragment_B(thr.partition_B(sX))
                    cC = cute.make_identity_tensor((64, BN))
                    tCcC = thr.partition_C(cC)
                    acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                    acc.fill(0.0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    n_kk = cute.size(tCrA, mode=[2])

                    # Warp 0 issues the loads, all 32 lanes: a TMA copy elects its issuing lane
                    # with elect.sync over the full warp (one lane alone would wait forever).
                    # The first stages' A (weights: nothing a predecessor writes) go out before
                    # griddepcontrol.wait, x after it; each stage's expect_tx covers both.
                    npre = cutlass.min(nloc, STAGES)
                    if tidx < 32:
                        cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                        for i in cutlass.range(npre, unroll=1):
                            self._load_a(i, kb_lo + i, full, stage_bytes, tma_as, mAs, sA, sAt_layout, sl, a_blk)
                    if cutlass.const_expr(cfg.quant):
                        cute.arch.griddepcontrol_wait()
                        cute.arch.griddepcontrol_launch_dependents()
                    self._stamp(trace_row, 1, tidx)
                    if tidx < 32:
                        for i in cutlass.range(npre, unroll=1):
                            self._load_x(i, kb_lo + i, full, tma_x, tXg, tXs)
                    # This thread's share of the (rank row, token) pairs of the reduction below and
                    # their tokens' slots: loaded now, their latency hidden by the main loop (after
                    # the wait: token_lora may come from the kernel before us).
                    mvalid = cutlass.min(M, BN)
                    rows = cutlass.min(RB, R - c * 64)
                    n_el = rows * mvalid
                    lo = split * n_el // nsplit
                    hi = (split + 1) * n_el // nsplit
                    RU = 64 * BN // THREADS
                    toks = cute.make_rmem_tensor((RU,), cutlass.Int32)
                    for u in cutlass.range_constexpr(RU):
                        e = lo + tidx + THREADS * u
                        toks[u] = cutlass.Int32(-2)
                        if e < hi:
                            toks[u] = mTok[e // rows]
                    # One WGMMA group stays in flight: block i's MMAs run while the CTA agrees that
                    # block i-1's stage is free and refills it (run6: with the wait for the group
                    # just issued, every k-block paid MMA latency + barrier + refill in series, and
                    # 8 stages instead of 4 changed nothing). Same accumulator, same order: the
                    # sums are bit-identical.
                    for i in cutlass.range(nloc, unroll=1):
                        s = i % STAGES
                        cute.arch.mbarrier_wait(full + s, (i // STAGES) % 2)
                        cute.nvgpu.warpgroup.fence()
                        for kk in cutlass.range_constexpr(n_kk):
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, kk, s)], tCrX[(None, None, kk, s)], acc)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(1)
                        if i > 0:
                            # Everyone is done with block i-1's stage: refill it.
                            cute.arch.barrier()
                            j = i - 1
                            if tidx < 32 and j + STAGES < nloc:
                                self._load(j % STAGES, kb_lo + j + STAGES, full, stage_bytes, tma_as, mAs, sA,
                                           sAt_layout, sl, a_blk, tma_x, tXg, tXs)
                    cute.nvgpu.warpgroup.wait_group(0)
                    self._stamp(trace_row, 2, tidx)

                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, j = tCcC[i]
                        sRed[r, j] = acc[i]
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()

                    # Fixed-order split-K sum; this CTA writes its share of (rank row, token) pairs,
                    # each summed over the splits in the fixed order 0..S-1, all of one split's
                    # partials loaded at once (unrolled: independent loads in flight together).
                    base = sRed.iterator.toint()
                    vals = cute.make_rmem_tensor((RU,), cutlass.Float32)
                    vals.fill(0.0)
                    for q in cutlass.range(nsplit, unroll=1):
                        for u in cutlass.range_constexpr(RU):
                            e = lo + tidx + THREADS * u
                            if toks[u] == lid:
                                j = e // rows
                                vals[u] = vals[u] + D.ld_dsmem_f32(base + (e - j * rows + j * (64 + RED_PAD)) * 4, q)
                    for u in cutlass.range_constexpr(RU):
                        e = lo + tidx + THREADS * u
                        if toks[u] == lid:
                            j = e // rows
                            mH[sl, j, c * 64 + e - j * rows] = vals[u]
                    self._stamp(trace_row, 3, tidx)
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()

        @cute.jit
        def _stamp(self, trace_row, slot: cutlass.Constexpr, who):
            """Trace builds only: %globaltimer into `slot` of this CTA's timeline row, by the thread
            whose `who` is 0 (nothing in the kernels that are launched for real)."""
            if cutlass.const_expr(self.cfg.trace):
                if who == 0:
                    D.stamp_globaltimer(trace_row + 8 * slot)

        @cute.jit
        def _row_amax(self, mXg, m, v_lo, v_hi, tidx, red):
            """max |x[m, 8 v_lo : 8 v_hi]| over the CTA (fmaxf from 0: NaN never wins, max.f32
            returns the other operand). QV 16-byte vectors per thread are loaded before any is
            used, so the pass costs ceil(n / (128 QV)) memory round trips, not n / 256: K2's main
            loop waits for x_q, and beside K2's weight stream each round trip is long (run11: the
            decode path's exposure grew with K, 8 us on down). Indices past the range are clamped
            to its last vector: a repeated element leaves the maximum unchanged."""
            g_x = cute.zipped_divide(mXg[m, None], (8,))
            amax = cutlass.Float32(0.0)
            for j0 in cutlass.range(v_lo + tidx, v_hi, THREADS * QV, unroll=1):
                r_x = cute.make_rmem_tensor(cute.make_layout((8, QV)), mXg.element_type)
                for u in cutlass.range_constexpr(QV):
                    cute.autovec_copy(g_x[None, cutlass.min(j0 + THREADS * u, v_hi - 1)], r_x[None, u])
                for u in cutlass.range_constexpr(QV):
                    for e in cutlass.range_constexpr(8):
                        amax = D.fmax_f32(amax, D.abs_f32(r_x[e, u].to(cutlass.Float32)))
            for sh in cutlass.range_constexpr(5):
                amax = D.fmax_f32(amax, D.shfl_bfly_f32(amax, 1 << (4 - sh)))
            if tidx % 32 == 0:
                red[tidx // 32] = amax
            cute.arch.barrier()
            return D.fmax_f32(D.fmax_f32(red[0], red[1]), D.fmax_f32(red[2], red[3]))

        @cute.jit
        def _row_codes(self, mXg, mXq16, m, v_lo, v_hi, tidx, scale):
            """x_q[m, 8 v_lo : 8 v_hi] = e4m3(clamp(x / scale)): the row is re-read (L1/L2 hits; K up
            to 29568 does not fit in registers), batched like _row_amax; only the stores are
            predicated."""
            g_x = cute.zipped_divide(mXg[m, None], (8,))
            g_q = cute.zipped_divide(mXq16[m, None], (4,))
            for j0 in cutlass.range(v_lo + tidx, v_hi, THREADS * QV, unroll=1):
                r_x = cute.make_rmem_tensor(cute.make_layout((8, QV)), mXg.element_type)
                for u in cutlass.range_constexpr(QV):
                    cute.autovec_copy(g_x[None, cutlass.min(j0 + THREADS * u, v_hi - 1)], r_x[None, u])
                for u in cutlass.range_constexpr(QV):
                    r_q = cute.make_rmem_tensor(cute.make_layout(4), mXq16.element_type)
                    for e in cutlass.range_constexpr(4):
                        q0 = D.div_rn_f32(r_x[2 * e, u].to(cutlass.Float32), scale)
                        q1 = D.div_rn_f32(r_x[2 * e + 1, u].to(cutlass.Float32), scale)
                        r_q[e] = D.cvt_e4m3x2_f32(D.fp8_clamp(q0), D.fp8_clamp(q1))
                    if j0 + THREADS * u < v_hi:
                        cute.autovec_copy(r_q, g_q[None, j0 + THREADS * u])

        @cute.jit
        def _load(self, s, kb, full, stage_bytes, tma_as: tuple, mAs: tuple, sA, sAt_layout, sl, a_blk, tma_x, tXg,
                  tXs):
            """Stage s: A's and x's k-block kb (the steady state, after griddepcontrol.wait)."""
            self._load_a(s, kb, full, stage_bytes, tma_as, mAs, sA, sAt_layout, sl, a_blk)
            self._load_x(s, kb, full, tma_x, tXg, tXs)

        @cute.jit
        def _load_a(self, s, kb, full, stage_bytes, tma_as: tuple, mAs: tuple, sA, sAt_layout, sl, a_blk):
            """Stage s: arm its barrier for A and x (stage_bytes), request A's k-block kb."""
            cfg = self.cfg
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + s, stage_bytes)
            # Stage s of sA seen as the TMA box's (rows_box, bk) layout (same swizzle, same base).
            sAt = cute.make_tensor(sA[(None, None, s)].iterator, cute.slice_(sAt_layout.outer, (None, None, 0)))
            if cutlass.const_expr(DEBUG_PRINT):
                print("sA", sA, "sAt", sAt)
            for i in cutlass.range_constexpr(cfg.num_slices):
                if sl == i:
                    gA = cute.local_tile(mAs[i], (cfg.rows_box, cfg.bk), (None, None))
                    tAs, tAg = cute.nvgpu.cpasync.tma_partition(
                        tma_as[i], 0, cute.make_layout(1), cute.group_modes(sAt, 0, 2), cute.group_modes(gA, 0, 2))
                    cute.copy(tma_as[i], tAg[(None, a_blk, kb)], tAs, tma_bar_ptr=full + s)

        @cute.jit
        def _load_x(self, s, kb, full, tma_x, tXg, tXs):
            """Stage s: request x's k-block kb (the barrier was armed by _load_a)."""
            cute.copy(tma_x, tXg[(None, kb)], tXs[(None, s)], tma_bar_ptr=full + s)



# ---------------------------------------------------------------------------------------------
# Runtime contract
# ---------------------------------------------------------------------------------------------


def _fake_args(cfg: Config):
    bf16, f32, i32, i16 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Int16
    x = D.fake_rowmajor(bf16, (D.sym(1), D.sym(16)))
    a_bufs = tuple(D.fake_rowmajor(bf16, (D.sym(cfg.rows_box), D.sym(16))) for _ in range(cfg.num_slices))
    h = D.fake_rowmajor(f32, (cfg.num_slices, D.sym(1), cfg.rank))
    xq16 = D.fake_rowmajor(i16, (D.sym(1), D.sym(8))) if cfg.quant else None
    sx = D.fake_rowmajor(f32, (D.sym(1),), align=4) if cfg.quant else None
    sync = D.fake_rowmajor(i32, (2,), align=8) if cfg.quant or cfg.xgate else None
    tok = D.fake_rowmajor(i32, (D.sym(1),), align=4)
    active = D.fake_rowmajor(i32, (D.sym(1),), align=4)
    num_active = D.fake_rowmajor(i32, (1,), align=4)
    slot_ranks = D.fake_rowmajor(i32, (D.sym(1),), align=4)
    args = (x, h, xq16, sx, sync, tok, active, num_active, slot_ranks, D.fake_stream(), *a_bufs)
    if cfg.trace:
        return args + (None,) * (4 - cfg.num_slices) + (D.fake_rowmajor(cutlass.Int64, (D.sym(1), TRACE_SLOTS)),)
    return args


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """cute.compile with fake tensors; the result carries `epilora_smem_bytes`."""
    return D.compile_with_smem(_ShrinkKernel(config), _fake_args(config), options)


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    rb, bk, bn = config.rows_box, config.bk, config.bn
    bf16, f32, i32, i16 = torch.bfloat16, torch.float32, torch.int32, torch.int16
    p = [
        TensorParam("x", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K]
        CoordParam("x_dims", 2),  # (M, K)
        TmaParam("tma_x", TmaSpec(bf16, (bk, bn)), "x [M, K] bf16"),
    ]
    for s in range(config.num_slices):
        p.append(TmaParam(f"tma_a{s}", TmaSpec(bf16, (bk, rb)),
                          f"A_{s} [max_loras, 1, R, K] viewed as [max_loras*R, K]"))
    for s in range(config.num_slices):
        p.append(CoordParam(f"a{s}_dims", 2))  # (max_loras*R, K)
    p.append(TensorParam("h", f32, 3, dynamic_shape=(1,), dynamic_stride=(0,), align=16))  # [slices, M, R]
    if config.quant:
        p += [
            TensorParam("xq16", i16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # x_q.view(int16)
            TensorParam("s_x", f32, 1, dynamic_shape=(0,), align=4),  # [M]
            TensorParam("sync", i32, 1, align=8),  # [2], shared with K2
        ]
    if config.xgate:
        p.append(TensorParam("sync", i32, 1, align=8))  # [2]: the gate, shared with the xgate K2
    p += [
        TensorParam("token_lora", i32, 1, dynamic_shape=(0,), align=4),  # [M]
        TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras+1]
        TensorParam("num_active", i32, 1, align=4),  # [1]
        TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras]
    ]
    if config.trace:
        p.append(TensorParam("trace", torch.int64, 2, dynamic_shape=(0,), align=16))  # [CTAs, 8] ns
    return p


def launch(config: Config, *, x, lora_a, h, token_lora, active_lora_ids, num_active, slot_ranks, split: int,
           x_q=None, x_scale=None, sync=None, trace=None) -> dict:
    """Arguments (params() order) and geometry; n_quant and n_gate (for K2) are returned. The spec says
    pdl=False: launch with PDL only when chained behind the previous projection (see the module
    docstring for what that assumes).

    Grid: (split, slices * rank chunks, zq + min(M, max_loras + 1)), cluster (split, 1, 1), with
    zq = quant_planes(M, split * slices * chunks) planes of quantization CTAs first.
    """
    M, K = x.shape
    if M > config.bn:
        raise ValueError(f"{M} tokens exceed the token tile {config.bn}")
    if not 1 <= split <= MAX_CLUSTER:
        raise ValueError(f"split must be 1..{MAX_CLUSTER} (the cluster size), got {split}")
    if K % 16:
        raise ValueError(f"K = {K} must be a multiple of 16 (16-byte vectors, TMA rows)")
    views = []
    for a in lora_a:
        a3 = a[:, 0] if a.dim() == 4 else a
        if a3.shape[1] != config.rank:
            raise ValueError(f"A buffer rank {a3.shape[1]} != config rank {config.rank}")
        views.append(a3.reshape(-1, a3.shape[2]))
    if len(views) != config.num_slices:
        raise ValueError(f"{config.num_slices} A buffers expected")
    max_loras = views[0].shape[0] // config.rank
    args = [x, (M, K), x] + views + [(v.shape[0], v.shape[1]) for v in views]
    args.append(h)
    if config.quant:
        if x_q is None or x_scale is None or sync is None:
            raise ValueError("a quantizing build takes x_q, x_scale and sync")
        args += [x_q.view(torch.int16), x_scale.reshape(-1), sync]
    if config.xgate:
        if sync is None or sync.dtype != torch.int32 or sync.numel() < 2 or not sync.is_contiguous():
            raise ValueError("an xgate build takes sync, int32 [2] (the gate it shares with the xgate K2)")
        args.append(sync)
    args += [token_lora, active_lora_ids, num_active, slot_ranks]
    grid = launch_grid(config, M, split, max_loras)
    per_plane = grid[0] * grid[1]
    zq = grid[2] - min(M, max_loras + 1)
    if config.trace:
        n = grid[0] * grid[1] * grid[2]
        if trace is None or trace.shape != (n, TRACE_SLOTS) or trace.dtype != torch.int64:
            raise ValueError(f"a trace build needs trace = int64 [{n}, {TRACE_SLOTS}]")
        args.append(trace)
    return dict(args=tuple(args), grid=grid, block=config.block, cluster=(split, 1, 1),
                smem=config.smem_bytes(), pdl=False, n_quant=zq * per_plane if config.quant else 0,
                n_gate=XGATE_COUNT if config.xgate else 0)


def launch_grid(config: Config, m: int, split: int, max_loras: int) -> tuple[int, int, int]:
    """(split, slices * rank chunks, quantization planes + groups): the grid launch() uses."""
    y = config.num_slices * config.n_chunks
    zq = quant_planes(m, split * y) if config.quant else 0
    return (split, y, zq + min(m, max_loras + 1))


def quant_planes(m: int, per_plane: int) -> int:
    """Planes of quantization CTAs in front of the group planes: one token per CTA (the kernel
    derives the same number from M and the grid). A single plane of split*slices*chunks CTAs
    each quantizing several rows one after another was the decode path's bottleneck at 8-32
    tokens (docs/perf.md v0.4)."""
    return max(1, -(-m // per_plane))


# Pipeline depth of the decode path's builds: 8 stages (72-105 KiB). With 4, each CTA's A stream
# waited a full memory round trip per 4 k-blocks; beside K2's full-bandwidth stream those round
# trips are long, and on down (24 k-blocks per CTA) the shrink outlasted K2's main loop: 8.4 us of
# the decode path exposed (docs/gpu_record/run5, stages: decode - k2_epilogue).
STAGES = 8
# 33..64 tokens (token tile 64): 6 stages (113 KiB instead of 145), so that an SM running a shrink
# CTA still takes one of K2's token-tile CTAs (~98 KiB) beside it.
WIDE_STAGES = 6


def token_tile(m: int) -> int:
    """The down-projection's token tile for m tokens: K2's (8 / 16 / 32), or 64 above 32 (all of
    the batch's tokens are WGMMA's N side at once)."""
    from .k2_gemm import token_tile as k2_tile

    bn = k2_tile(m)  # (checks 1..WIDE_MAX_TOKENS)
    return 64 if m > bn else bn


def select(num_slices: int, m: int, rank: int, stages: int | None = None, quant: bool = True) -> Config:
    """The decode path's build; quant=False beside a self-quantizing K2."""
    bn = token_tile(m)
    if stages is None:
        stages = WIDE_STAGES if bn == 64 else STAGES
    return Config(bn=bn, rank=rank, num_slices=num_slices, stages=stages, quant=quant)


def choose_split(k: int, num_slices: int, rank: int, groups: int, bk: int = 64, sms: int = 132,
                 max_split: int = 8) -> int:
    """Split-K of the down-projection: spread the A streams over the GPU (K2 runs beside it, so
    aim at about half of the SMs), keeping >= 2 k-blocks per split. Up to SMALL_SPLIT the grid may
    take the whole GPU: the grid holds every possible adapter group (min(M, max_loras + 1) from
    8 tokens on), so half the SMs left qkv at split 2 with six CTAs working for one adapter, and
    split 4 was faster with one adapter and with eight (docs/perf.md v0.48, run17)."""
    ctas = num_slices * -(-rank // 64) * max(groups, 1)
    nk = -(-k // bk)
    best = 1
    for s in range(1, max_split + 1):
        fits = ctas * s <= sms // 2 or (s <= SMALL_SPLIT and ctas * s <= sms)
        if fits and nk // s >= 2:
            best = s
    return best


# The split the shrink may take with its grid filling the GPU (see choose_split): beyond it, 2 x 9
# groups x 8 splits (gate_up) or 3 x 9 x 8 (qkv) is more than one wave and was slower (run17).
SMALL_SPLIT = 4


# The xgate shrink's publications per call: its first CTA's one increment (the xgate K2's n_quant).
XGATE_COUNT = 1


def xgate_variant(cfg: Config) -> Config | None:
    """The x-gated twin of a build without quantization planes, where one is prebuilt
    (k2_gemm.XGATE_RANKS, the self_quant token tiles), else None."""
    from .k2_gemm import XGATE_RANKS

    if cfg.quant or cfg.trace or cfg.xgate or cfg.rank not in XGATE_RANKS or cfg.stages != STAGES:
        return None
    return Config(bn=cfg.bn, rank=cfg.rank, num_slices=cfg.num_slices, bk=cfg.bk, stages=cfg.stages,
                  quant=False, xgate=True)


def prebuild_configs() -> list[Config]:
    from .k2_gemm import RANKS, SELF_QUANT_TILES, TOKEN_TILES, XGATE_RANKS

    cfgs = [select(ns, m, r) for ns in (1, 2, 3) for m in (1, 9, 17, 33) for r in RANKS]
    assert {c.bn for c in cfgs} == {*TOKEN_TILES, 64}
    # Beside the self-quantizing K2 (its token tiles): the down-projection alone.
    cfgs += [Config(bn=bn, rank=r, num_slices=ns, stages=STAGES, quant=False) for ns in (1, 2, 3)
             for bn in SELF_QUANT_TILES for r in RANKS]
    # Their x-gated twins (v1.03, opt-in) at the ranks the xgate K2 is built for.
    cfgs += [Config(bn=bn, rank=r, num_slices=ns, stages=STAGES, quant=False, xgate=True) for ns in (1, 2, 3)
             for bn in SELF_QUANT_TILES for r in XGATE_RANKS]
    # For tools/bench_stages.py (rank 64, the bench's rank): the down-projection alone, and the
    # former 4-stage build.
    cfgs += [Config(bn=bn, rank=64, num_slices=ns, stages=st, quant=q) for ns in (1, 2, 3)
             for bn in TOKEN_TILES for st, q in ((STAGES, False), (4, True))]
    return list(dict.fromkeys(cfgs + trace_configs()))


def trace_configs() -> list[Config]:
    """The timeline builds tools/bench_timeline.py launches (rank 64, 1-3 slices): 1..8 tokens with
    and without the quantization planes, 9..32 tokens (bn 16, 32) with them."""
    return ([Config(bn=8, rank=64, num_slices=ns, stages=STAGES, trace=True, quant=q) for ns in (1, 2, 3)
             for q in (True, False)]
            + [Config(bn=bn, rank=64, num_slices=ns, stages=STAGES, trace=True) for bn in (16, 32) for ns in (1, 2, 3)])
