"""K2 for the decode path (<= 64 tokens): y = x_q.s_x.(W_q.s_w)^T + sum_s h_s.B_s^T, Hopper, CuTe-DSL.

Swap-AB: the FP8 weight rows are WGMMA's M side (BM = 64/128 rows per CTA), the tokens its N
side (BN = 8/16/32, one N tile covers the whole decode batch; at 33..64 tokens the token-tile
builds, Config.token_tiles, run two 32-token tiles per weight block, interleaved in grid y).
Split-K over a thread-block cluster: the S CTAs of a cluster (cluster dims (S,1,1), S chosen at
launch, 1..8, or up to 16 with the non-portable attribute) stream disjoint K ranges of the same BM rows; their fp32
partials meet in distributed shared memory and every element of y is summed in the fixed order
split 0, 1, ..., S-1 and written exactly once, by one CTA. No workspace, no atomics on data, so
results are bitwise reproducible.

Warp specialization: warpgroup 0 is the producer (setmaxnreg lowers it to 40 registers): warp 0
streams the weights and x_q, warp 1 (adapter builds) builds the tile's adapter table and streams
the B chunks; warpgroup 1 is the WGMMA consumer (setmaxnreg 232, or 216 for builds with two CTAs
per SM - the decode path's default, see default_config).

Self-quantizing builds (Config.self_quant, 1..8 tokens, the path "decode_sq"): K2 loads bf16 x and
quantizes it itself (_quantize_x: each CTA its K range, the token maxima combined over the cluster
in DSMEM, the codes written into a resident smem copy of its x_q that the WGMMAs read); no x_q,
s_x or counter, and the shrink beside it has no quantization CTAs (docs/perf.md v0.29).

fused_h builds (Config.fused_h, the path "decode_fh", an experiment: correct on the H200, slower
than decode_sq, docs/perf.md v0.43): the self-quantizing adapter K2 computes h itself. The grid's
first CTAs (at most FH_PRODUCERS) turn units of A (FH_ROWS rank rows x FH_KC of K, one slice, one
adapter group) into partials of h in a workspace and publish them with a release-increment of
sync[0]; every CTA's epilogue acquires sync[0] >= the producers' count and sums its tokens'
partials in K order; the last cluster done (sync[1]) re-arms both.

Activations: x_q/s_x are written by the quantization CTAs of the shrink kernel, launched just
before K2 (K2 is its PDL dependent). K2 cannot use griddepcontrol.wait for them without giving
up the overlap, so the producer spins (ld.acquire.gpu) on a counter those CTAs increment
(red.release.gpu) once per CTA; it issues the first weight stages before spinning. The last K2
CTA to pass the spin resets the counter for the next call (see docs/k2_design.md). With
n_quant = 0 (x_q from the standalone quantization kernel, the no-adapter path) the producer
instead executes griddepcontrol.wait after requesting the first weight stages.

Every CTA executes griddepcontrol.launch_dependents right after its prologue: the next
projection's first kernel, when launched with PDL ("chained"), is scheduled under this K2 and
waits (griddepcontrol.wait) for its completion before it reads x or writes anything. The re-arm
stays safe: that kernel increments sync only after the wait, and the next K2 is launched only
after it passed the wait, so this K2's re-arm is complete and visible by then.

The x gate (Config.xgate, v1.03, opt-in): the self_quant pair's shrink normally triggers this
K2 only after its own griddepcontrol.wait (x is read at K2's start), so at every projection
boundary K2 is launched only once the kernel before the shrink has completed. An xgate shrink
triggers at its start and its first CTA, past its wait, release-increments sync[0]; the xgate K2,
launched under the previous kernel, streams its first weight stages and the adapter's B chunks,
and its consumer acquires sync[0] before it loads x (re-arm as above, over two sync buffers that
ops alternates). The K2 triggers its dependents only past that gate, every thread (the producer
warps wait for the consumer's arrival on sx_ready, otherwise unused in self_quant builds), so a
dependent is launched only once the kernel before this K2's shrink has completed: two xgate K2s
in flight at once are consecutive ones, on different buffers. (Every kernel the ops chain
completes only after its predecessor: each executes griddepcontrol.wait or is launched without
PDL. So "this K2's gate passed" implies "every earlier kernel completed".)

Adapter epilogue (Config.lora): the adapter groups come from the tile's own tokens (token_lora,
one lane per token, first token of each slot; slot_ranks gives its effective rank), built into
smem by producer warp 1 at the start, so the epilogue reads no metadata from global memory.
After the main loop the consumer executes griddepcontrol.wait (h comes from the shrink kernel),
then for every (adapter group, 64-wide rank chunk) item assigned to this CTA (items are dealt
round-robin over the cluster's CTAs) it runs a second WGMMA: acc_lora[BM, BN] += B_chunk[BM, 64]
. hmask^T, with hmask = bf16(h) of the group's tokens and 0 for all other tokens. The B chunks
are TMA-loaded by warp 1 into a small ring of buffers, the first ones at the kernel's start.
partial = acc * s_x[token] * s_w + acc_lora, then the cluster reduction above (its buffer reuses
the weight stages' smem).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from epilora_cute.reference import adapter_view

from ._abi import SM_COUNT_H100, CoordParam, ScalarParam, TensorParam, TmaParam, TmaSpec, struct_size

try:  # the DSL is needed to compile, not to launch a cached build
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "k2_fp8_swapab"
RUNTIME_CONTRACT = True

THREADS = 256  # warpgroup 0: producer, warpgroup 1: consumer
PRODUCER_REGS = 40
CONSUMER_REGS = 232  # one CTA per SM: 128 x (40 + 232) <= 256 x 232, the launch's pool
# Two CTAs per SM (Config.ctas = 2): each CTA launches with 65536 / 512 = 128 registers per thread,
# a pool of 256 x 128 = 128 x (40 + 216). The accumulators of a 128 x 32 tile need 64 of them.
CONSUMER_REGS_2CTA = 216
SMEM_PER_SM = 228 * 1024  # H100/H200; each resident CTA also reserves 1 KiB
RED_PAD = 4  # fp32 words of padding per token column of the reduction buffer (bank spread)
META_ROWS = 32  # the adapter table in smem: one row per token of the tile (bn <= 32)
# self_quant builds (vLLM's per-token quantization: _dsl.fp8_scale / fp8_quotient_operands /
# fp8_clamp, as the shrink's planes and K1 quantize):
ROWMAX_VECS = 12  # sq_rowmax: 16-byte vectors of x per consumer thread for the whole rows
ROWMAX_ELEMS = 128 * ROWMAX_VECS * 8  # M * K up to which sq_rowmax builds skip the exchange
MAX_CLUSTER = 16
# self_quant builds keep x's values in registers between the maxima and the codes: SQ_UNITS work
# units (16-element chunks of one token) per consumer thread, 128 * SQ_UNITS in all, which bounds a
# CTA's M x k-blocks at 128 * SQ_UNITS / 8 = 128 (16 k-blocks at 8 tokens, 32 at 4).
SQ_UNITS = 8
# The wide self_quant builds (Config.sq_xblocks): room for SQ_WIDE_KBLOCKS resident k-blocks of
# x_q, so that at 1..4 tokens a CTA covers K = 4096 alone (gate_up at split 1: one wave of CTAs
# instead of two, docs/perf.md v0.54). Chosen at run time (EPILORA_K2_SQ_WIDE, on unless 0) where they
# lower the split; built for the ranks of WIDE_RANKS and the no-adapter K2.
SQ_WIDE_KBLOCKS = 32
# The reduction's few-elements form (at most FEW_RED elements per thread and FEW_RED_SPLITS
# splits): every split's load of an element in one round (docs/perf.md v0.47).
FEW_RED = 2
FEW_RED_SPLITS = 8
# Trace builds (Config.trace): per CTA (row split + S * tile), %globaltimer ns at: kernel entry,
# x_q ready (the producer past its spin / wait), main loop done, h ready (the epilogue's
# griddepcontrol.wait passed; adapter builds), partials written, done (after the last cluster barrier).
TRACE_SLOTS = 8
# Self-quantizing builds also: the CTA's token maxima in smem (6), the scales after the cluster's
# exchange (7); xq_ready (1) is then its codes stored. fused_h builds instead: this CTA's units of h
# computed and stored (6), published (7; CTAs without units stamp neither).
# fused_h builds (the adapter's down-projection inside K2, docs/perf.md v0.43): a work unit is
# FH_ROWS rank rows x FH_KC elements of K of one slice's A for one adapter group; only the first
# FH_PRODUCERS CTAs of the grid take units, so the CTAs that wait for h never keep a producer off
# the GPU (CTAs are dispatched in index order, and 128 <= the CTAs of the first wave on any sm_90).
FH_KC = 512
FH_ROWS = 16
FH_PRODUCERS = 128
FH_SUM = 8  # partials summed per round of loads in the epilogue (all in flight at once)
TRACE_K2 = ("start", "xq_ready", "mainloop_done", "h_ready", "partials_written", "end", "sq_cta_max", "sq_scales")
TRACE_K2_FH = TRACE_K2[:6] + ("fh_units_done", "fh_published")


@dataclass(frozen=True)
class Config:
    """Compile-time choices of one K2 kernel.

    bn: token tile (WGMMA N) 8/16/32, the launch serves 1..bn tokens.
    bm: weight rows per CTA (64 or 128); every slice width must be a multiple of bm.
    bk: FP8 K elements per pipeline stage (128 = one 128-byte swizzle row).
    stages: depth of the weight/activation pipeline.
    lora: adapter epilogue (and griddepcontrol.wait); False = the no-adapter variant.
    num_slices: output slices of the projection (qkv: 3, gate/up: 2), lora only.
    rank: the adapter buffers' rank R (vLLM's max_lora_rank), lora only.
    b_bufs: smem ring of B chunks (each bm x min(R,64) bf16).
    """

    bn: int = 16
    bm: int = 128
    bk: int = 128
    stages: int = 4
    lora: bool = True
    num_slices: int = 1
    rank: int = 64
    b_bufs: int = 2
    ctas: int = 1  # CTAs per SM the kernel is built for (1 or 2: registers and the launch bound)
    trace: bool = False  # timeline stamps (%globaltimer) into an extra int64 [CTAs, 8] argument
    # Weight stages requested before x_q is ready (0 = all `stages`). Fewer leave the memory system
    # to the quantization CTAs that K2 waits for (docs/perf.md v0.27: no gain). Like `trace`, only
    # tools/bench_*.py launch such builds; the GPU tests cover the defaults.
    early: int = 0
    # K2 quantizes x itself (bf16 x in; no x_q, s_x or sync): each CTA loads its K range of the
    # batch's rows, the cluster's CTAs combine their per-token maxima in DSMEM (the split-K CTAs of
    # one tile cover K), and the codes go straight into a resident smem copy of the CTA's x_q. K2
    # then depends on no other kernel before its main loop (docs/perf.md v0.29).
    self_quant: bool = False
    # self_quant experiment (bench-only builds, like `early`): when the batch's rows hold at most
    # ROWMAX_ELEMS elements, every CTA takes its token maxima over the whole rows itself (no
    # cluster exchange, no DSMEM); larger batches exchange as the default builds do.
    sq_rowmax: bool = False
    # The adapter's down-projection inside K2 (self_quant adapter builds of bn 8; the path
    # "decode_fh", one launch per projection, no shrink kernel): the first CTAs of the grid compute
    # per-K-chunk partials of h = x.A^T into a workspace (`h` is then [slices, nkc * bn, R] fp32, nkc
    # = ceil(K / FH_KC)) and publish them with one release-increment per CTA on sync[0]; each CTA's
    # epilogue acquires sync[0] and sums a token's partials in the fixed order of K. The grid's last
    # cluster to finish re-arms sync (sync[1] counts the clusters done).
    fused_h: bool = False
    # Opt-in experiments (docs: the GPU verifies them against the default builds; selected at run
    # time by EPILORA_K2_PUSH, see push_flags()). push_maxima (self_quant builds): each CTA's token
    # maxima go to every cluster peer with st.async (mbarrier complete_tx) into a receive buffer,
    # waited for with an acquire.cluster mbarrier wait, instead of a release cluster barrier and a
    # DSMEM round trip. push_partials: after a relaxed "main loop done" cluster phase, each CTA
    # pushes its split-K partials to the CTA that owns each element (reduction_owner) into that
    # CTA's freed weight stages, and the owner sums them locally in the order 0..S-1 (the same
    # values in the same order: bitwise the default's y) - no release barrier, no DSMEM loads.
    push_maxima: bool = False
    push_partials: bool = False
    # self_quant: resident k-blocks of x_q in smem (0: 128 // bn, the register bound at bn tokens).
    # More (SQ_WIDE_KBLOCKS) lets a batch of fewer tokens take a longer K range per CTA: the
    # register bound is on M x k-blocks (SQ_UNITS), checked per launch (min_split with M).
    sq_xblocks: int = 0
    # Token tiles (the decode pair at 33..WIDE_MAX_TOKENS tokens, x_q given, bn 32): the grid's y
    # holds T = ceil(M / bn) token tiles per weight block, interleaved (y = weight block * T + t), so
    # the T CTAs of one block are dispatched back to back and all but the first read its weights
    # from L2; each CTA computes tokens t * bn .. t * bn + bn - 1 as a one-tile build computes 0..bn-1.
    token_tiles: bool = False
    # The x gate (v1.03, opt-in: EPILORA_K2_XGATE; self_quant adapter builds of XGATE_RANKS beside a
    # lora_shrink xgate build): the shrink triggers this K2 at its start, before its own
    # griddepcontrol.wait, so this K2 is launched under the previous kernel and streams its first
    # weight stages there; it reads x only once the shrink has published (one release-increment of
    # sync[0] by the shrink's first CTA after its wait) that the kernel before the shrink, the
    # writer of x, has completed. This K2 triggers its own dependents only after that gate (every
    # thread), which keeps at most two such K2s in flight: see the module docstring.
    xgate: bool = False

    def __post_init__(self):
        if (self.bm + RED_PAD) * self.bn * 4 > self.bm * self.bk * self.stages:
            raise ValueError("the reduction buffer must fit the weight stages it reuses")
        if self.bn not in (8, 16, 32):
            raise ValueError("bn must be 8, 16 or 32")
        if self.bm not in (64, 128):
            raise ValueError("bm must be 64 or 128")
        if self.bk not in (64, 128):
            raise ValueError("bk must be 64 or 128")
        if self.ctas not in (1, 2):
            raise ValueError("ctas must be 1 or 2")
        if not 0 <= self.early <= self.stages:
            raise ValueError("early must be 0..stages")
        if self.self_quant and (self.bn not in (8, 16) or self.bk != 128 or self.early):
            raise ValueError("self_quant builds take bn 8 or 16, bk 128 and no early stages")
        if self.sq_rowmax and not self.self_quant:
            raise ValueError("sq_rowmax is a variant of the self_quant builds")
        if self.fused_h and not (self.self_quant and self.lora and self.bn == 8 and not self.sq_rowmax):
            raise ValueError("fused_h is a variant of the self_quant adapter builds of bn 8")
        if self.push_maxima and not (self.self_quant and not self.sq_rowmax):
            raise ValueError("push_maxima is a variant of the self_quant builds (not sq_rowmax)")
        if (self.push_maxima or self.push_partials) and self.fused_h:
            raise ValueError("the push variants are not built for fused_h")
        if self.push_partials and self.sq_rowmax:
            raise ValueError("push_partials is not built for sq_rowmax")
        if self.sq_xblocks and not (self.self_quant and not self.sq_rowmax and not self.fused_h
                                    and 128 // self.bn < self.sq_xblocks <= SQ_WIDE_KBLOCKS):
            raise ValueError(f"sq_xblocks is a variant of the self_quant builds (not sq_rowmax / fused_h), "
                             f"{128 // self.bn + 1}..{SQ_WIDE_KBLOCKS}")
        if self.xgate and not (self.self_quant and self.lora and not self.fused_h and not self.sq_rowmax
                               and not self.trace):
            raise ValueError("xgate is a variant of the self_quant adapter builds (not fused_h / sq_rowmax / trace)")
        if self.token_tiles and (self.bn != 32 or self.self_quant or self.trace or self.early):
            raise ValueError("token_tiles is a variant of the bn 32 builds that take x_q (no trace / early)")
        if self.lora:
            if self.rank not in (8, 16, 32, 64, 128, 256):
                raise ValueError("rank must be 8..256, a power of two")
            if not 1 <= self.num_slices <= 4:
                raise ValueError("num_slices must be 1..4")

    @property
    def sq_kblocks(self) -> int:
        """self_quant: the most k-blocks a CTA may own (x_q's smem room): sq_xblocks, or 128 // bn,
        where the register bound (SQ_UNITS chunks of 16 elements per consumer thread, 64 registers)
        holds for every batch the tile takes. A launch also needs min(M, bn) x k-blocks <= 128."""
        return self.sq_xblocks or 128 // self.bn

    @property
    def x_kblocks(self) -> int:
        """k-blocks of x_q in smem: the pipeline's stages, or the CTA's whole K range (self_quant)."""
        return self.sq_kblocks if self.self_quant else self.stages

    @property
    def rank_chunk(self) -> int:
        # bf16 WGMMA needs K >= 16: rank 8 uses a 16-wide chunk, TMA zero-fills columns 8..15.
        return max(16, min(self.rank, 64))

    def name(self) -> str:
        s = f"bm{self.bm}_bn{self.bn}_bk{self.bk}_st{self.stages}"
        if self.lora:
            s += f"_lora_s{self.num_slices}_r{self.rank}_nb{self.b_bufs}"
        else:
            s += "_nolora"
        return (s + ("_c2" if self.ctas == 2 else "") + (f"_e{self.early}" if self.early else "")
                + ("_sq" if self.self_quant else "") + ("_rowmax" if self.sq_rowmax else "")
                + ("_fh" if self.fused_h else "")
                + ("_pm" if self.push_maxima else "") + ("_pp" if self.push_partials else "")
                + (f"_x{self.sq_xblocks}" if self.sq_xblocks else "") + ("_tt" if self.token_tiles else "")
                + ("_xg" if self.xgate else "") + ("_trace" if self.trace else ""))

    @property
    def consumer_regs(self) -> int:
        return CONSUMER_REGS if self.ctas == 1 else CONSUMER_REGS_2CTA

    def fits_ctas(self) -> bool:
        """Whether `ctas` copies of this CTA fit one SM's shared memory."""
        return self.ctas * (self.smem_bytes() + 1024) <= SMEM_PER_SM

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    @functools.lru_cache(maxsize=None)  # launches ask for it on every call (configs are immutable)
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the kernel's smem struct, field by field."""
        st, nb, bn = self.stages, self.b_bufs, self.bn
        f = [(8 * st, 8), (8 * st, 8), (8, 8), (4 * bn, 4), (8 * nb, 8), (8 * nb, 8),
             (self.bm * self.bk * st, 1024), (bn * self.bk * self.x_kblocks, 1024)]
        if self.lora:
            f += [(nb * self.bm * self.rank_chunk * 2, 1024), (bn * self.rank_chunk * 2, 1024),
                  (8, 8), (4 * META_ROWS, 4), (4 * META_ROWS, 4)]
        # self_quant: per-warp token maxima (4 x bn), then the CTA's (bn); one unused word otherwise.
        f += [(4 * 5 * bn if self.self_quant else 4, 4)]
        if self.fused_h:  # the unit's x, bf16 [bn, FH_KC]
            f += [(2 * bn * FH_KC, 128)]
        if self.push_maxima or self.push_partials:  # mbarriers: maxima received, partials received
            f += [(8 * 2, 8)]
        if self.push_maxima:  # the received maxima: [peer, token]
            f += [(4 * MAX_CLUSTER * bn, 4)]
        return struct_size(f)



# ---------------------------------------------------------------------------------------------
# The kernel (defined only where the DSL is importable)
# ---------------------------------------------------------------------------------------------

if cute is not None:

    class _K2Kernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.bm, self.bn, self.bk = cfg.bm, cfg.bn, cfg.bk
            self.stages = cfg.stages
            self.rc = cfg.rank_chunk
            self.nb = cfg.b_bufs

        # Host-side JIT function: builds TMA atoms and launches. At run time the runtime launches
        # the cubin itself; this function only has to produce the same kernel.
        @cute.jit
        def __call__(self, w: cute.Tensor, xq: cute.Tensor, sx: cute.Tensor, sw: cute.Tensor,
                     y: cute.Tensor, sync: cute.Tensor, n_quant: cutlass.Int32, stream: cuda.CUstream,
                     h: cute.Tensor = None, tok_lora: cute.Tensor = None, active_ids: cute.Tensor = None,
                     num_active: cute.Tensor = None, slot_ranks: cute.Tensor = None,
                     slice_start: cute.Tensor = None, b0: cute.Tensor = None, b1: cute.Tensor = None,
                     b2: cute.Tensor = None, b3: cute.Tensor = None, trace: cute.Tensor = None,
                     a0: cute.Tensor = None, a1: cute.Tensor = None, a2: cute.Tensor = None,
                     a3: cute.Tensor = None):
            # Flat arguments (no tuples): export_to_c, used by tools/capture, only takes flat ones.
            cfg = self.cfg
            fp8 = w.element_type
            a_layout = utils.LayoutEnum.from_tensor(w)
            b_layout = utils.LayoutEnum.from_tensor(xq)
            tile_mnk = (self.bm, self.bn, self.bk)
            sW_layout = sm90_utils.make_smem_layout_a(a_layout, tile_mnk, fp8, self.stages)
            # self_quant: `xq` is the bf16 x, and x_q lives in smem only (all of the CTA's k-blocks).
            sX_layout = sm90_utils.make_smem_layout_b(b_layout, tile_mnk, fp8, cfg.x_kblocks)
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_w, mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, w, cute.slice_(sW_layout, (None, None, 0)), (self.bm, self.bk))
            if cutlass.const_expr(cfg.self_quant):
                tma_x, mX = None, xq
            else:
                tma_x, mX = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    op, xq, cute.slice_(sX_layout, (None, None, 0)), (self.bn, self.bk))

            if cutlass.const_expr(cfg.lora):
                bufs_b = tuple(b for b in (b0, b1, b2, b3) if b is not None)
                assert len(bufs_b) == cfg.num_slices
                bf16 = bufs_b[0].element_type
                l_tile = (self.bm, self.bn, self.rc)
                sB_layout = sm90_utils.make_smem_layout_a(
                    utils.LayoutEnum.from_tensor(bufs_b[0]), l_tile, bf16, self.nb)
                sH_layout = sm90_utils.make_smem_layout_b(
                    utils.LayoutEnum.from_tensor(bufs_b[0]), l_tile, bf16, 1)
                tma_bs = []
                mBs = []
                for i in cutlass.range_constexpr(cfg.num_slices):
                    ta, tt = cute.nvgpu.cpasync.make_tiled_tma_atom(
                        op, bufs_b[i], cute.slice_(sB_layout, (None, None, 0)), (self.bm, self.rc))
                    tma_bs.append(ta)
                    mBs.append(tt)
                lora_pack = (tuple(tma_bs), tuple(mBs), h, tok_lora, active_ids, num_active, slot_ranks,
                             slice_start)
                if cutlass.const_expr(cfg.fused_h):
                    bufs_a = tuple(a for a in (a0, a1, a2, a3) if a is not None)
                    assert len(bufs_a) == cfg.num_slices
                    lora_pack = lora_pack + (bufs_a,)
            else:
                # None, not an empty tuple: an empty tuple would still become a 1-byte parameter.
                lora_pack = None
                sB_layout = sW_layout
                sH_layout = sX_layout

            red_cosize = (self.bm + RED_PAD) * self.bn
            bn = self.bn
            nb = self.nb
            stages = self.stages
            lora = cfg.lora
            n_amax = 5 * bn if cfg.self_quant else 1  # self_quant: the token maxima (4 warps', the CTA's)

            class BaseFields:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sx_ready: cute.struct.MemRange[cutlass.Int64, 1]
                sSx: cute.struct.MemRange[cutlass.Float32, bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                sW: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sW_layout)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]
                sAmax: cute.struct.MemRange[cutlass.Float32, n_amax]

            Storage = cute.struct(BaseFields)

            class LoraFields:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sx_ready: cute.struct.MemRange[cutlass.Int64, 1]
                sSx: cute.struct.MemRange[cutlass.Float32, bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                sW: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sW_layout)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sB_layout)], 1024]
                sH: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sH_layout)], 1024]
                meta_ready: cute.struct.MemRange[cutlass.Int64, 1]
                sTok: cute.struct.MemRange[cutlass.Int32, META_ROWS]
                sReff: cute.struct.MemRange[cutlass.Int32, META_ROWS]
                sAmax: cute.struct.MemRange[cutlass.Float32, n_amax]

            StorageLora = cute.struct(LoraFields)
            # fused_h: the same fields plus the unit's x, appended (every other field keeps its offset).
            StorageFused = cute.struct(type("StorageFused", (), {"__annotations__": {
                **LoraFields.__annotations__,
                "sUx": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, bn * FH_KC], 128]}}))

            if cutlass.const_expr(cfg.fused_h):
                self.storage = StorageFused
            elif cutlass.const_expr(lora):
                self.storage = StorageLora
            else:
                self.storage = Storage
            if cutlass.const_expr(cfg.push_maxima or cfg.push_partials):
                # The push variants: the same fields, then their mbarriers (0: the peers' maxima
                # received, 1: the partials of this CTA's elements received) and the maxima's
                # receive buffer [peer, token], appended (every other field keeps its offset).
                extra = {"pbar": cute.struct.MemRange[cutlass.Int64, 2]}
                if cutlass.const_expr(cfg.push_maxima):
                    extra["sRecv"] = cute.struct.MemRange[cutlass.Float32, MAX_CLUSTER * bn]
                base = LoraFields if lora else BaseFields
                self.storage = cute.struct(type("StoragePush", (), {"__annotations__": {
                    **base.__annotations__, **extra}}))
            self.smem_size = self.storage.size_in_bytes()

            n_tiles = cute.size(w, mode=[0]) // self.bm
            self.kernel(
                tma_w, mW, tma_x, mX, sx, sw, y, sync, n_quant, lora_pack, trace, sW_layout, sX_layout, sB_layout,
                sH_layout,
            ).launch(grid=(1, n_tiles, 1), block=(THREADS, 1, 1), cluster=(1, 1, 1), stream=stream,
                     # .minnctapersm ctas: ptxas then gives the launch the full register budget (for
                     # 1 CTA per SM; half of it for 2). Without
                     # it the kernel launched with ~40-90 registers per thread, a pool too small for
                     # setmaxnreg.inc 232, and the consumer warpgroup waited forever (the H200 hang).
                     min_blocks_per_mp=cfg.ctas,
                     # With 2 CTAs per SM the DSL would otherwise ask the driver for the SM's smem
                     # size at compile time (no GPU here); the runtime launcher sets the same 100%.
                     preferred_smem_carveout=100 if cfg.ctas > 1 else None)

        # -----------------------------------------------------------------------------------------
        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mSx: cute.Tensor, mSw: cute.Tensor, mY: cute.Tensor, mSync: cute.Tensor,
                   n_quant: cutlass.Int32, lora_pack, mTrace, sW_layout: cute.ComposedLayout,
                   sX_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, sH_layout: cute.ComposedLayout):
            cfg = self.cfg
            BM, BN, BK, RC, NB, STAGES = self.bm, self.bn, self.bk, self.rc, self.nb, self.stages
            R = cfg.rank
            if cutlass.const_expr(cfg.fused_h):
                tma_bs, mBs, mH, mTok, mActive, mNumActive, mSlotRanks, mSliceStart, mAs = lora_pack
            elif cutlass.const_expr(cfg.lora):
                tma_bs, mBs, mH, mTok, mActive, mNumActive, mSlotRanks, mSliceStart = lora_pack
            # Built here, not passed: a TiledMma kernel argument becomes a 1-byte dummy parameter.
            kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, kmaj, kmaj, cutlass.Float32, (1, 1, 1),
                tiler_mn=(64, BN))
            tiled_mma_l = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, (1, 1, 1), tiler_mn=(64, BN))

            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = warp_idx // 4
            _, tile, _ = cute.arch.block_idx()
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[0])
            nsplit = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_dim()[0])

            K = cute.size(mW, mode=[1])
            M = cute.size(mX, mode=[0])
            t_tile = cutlass.Int32(0)  # this CTA's token tile (token_tiles builds; 0 otherwise)
            if cutlass.const_expr(cfg.token_tiles):
                # y = weight block * T + token tile. From here on this CTA sees its own tokens only:
                # M counts those from its first one on (every use clamps it to BN), and the per-token
                # tensors start at that token, so the code below is the one-tile kernel's.
                n_tt = (M + BN - 1) // BN
                by = tile
                tile = by // n_tt
                t_tile = by - tile * n_tt
                t0 = t_tile * BN
                M = M - t0
                mSx = cute.domain_offset((t0,), mSx)
                mY = cute.domain_offset((t0, 0), mY)
                if cutlass.const_expr(cfg.lora):
                    mH = cute.domain_offset((0, t0, 0), mH)
                    mTok = cute.domain_offset((t0,), mTok)
            n0 = tile * BM
            nk = (K + BK - 1) // BK
            kb_lo = split * nk // nsplit
            kb_hi = (split + 1) * nk // nsplit
            nloc = kb_hi - kb_lo

            # Trace builds: slot addresses of this CTA's row of the [CTAs, 8] timeline (TRACE_K2).
            trace_row = cutlass.Int64(0)
            if cutlass.const_expr(cfg.trace):
                gd_x = cute.arch.grid_dim()[0]
                trace_row = mTrace.iterator.toint() + cutlass.Int64(tile * gd_x + cute.arch.block_idx()[0]) * 64
                if tidx == 0:
                    D.stamp_globaltimer(trace_row)

            smem = cutlass.utils.SmemAllocator()
            st = smem.allocate(self.storage)
            full = st.full.data_ptr()
            empty = st.empty.data_ptr()
            sx_ready = st.sx_ready.data_ptr()
            sSx = st.sSx.get_tensor(cute.make_layout(BN))
            bfull = st.bfull.data_ptr()
            bempty = st.bempty.data_ptr()
            sW = st.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
            sX = st.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
            # The split-K partials reuse the weight stages' smem: when the consumer writes them, it
            # has waited for every stage's TMA and every WGMMA that read one (red_fits_stages).
            sRed = cute.make_tensor(cute.recast_ptr(st.sW.data_ptr(), dtype=cutlass.Float32),
                                    cute.make_layout((BM, BN), stride=(1, BM + RED_PAD)))

            if tidx == 0:
                for i in cutlass.range_constexpr(STAGES):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, 128)
                # s_x and the adapter table are released by every lane of their producer warp
                # (32 arrivals): each lane's arrive orders its own stores, which compute-sanitizer's
                # racecheck follows. (One arrive by lane 0 after a __syncwarp is ordered under PTX's
                # memory model too, but racecheck reported it as a hazard: run19, run38.)
                cute.arch.mbarrier_init(sx_ready, 32)
                for i in cutlass.range_constexpr(NB):
                    cute.arch.mbarrier_init(bfull + i, 1)
                    cute.arch.mbarrier_init(bempty + i, 128)
                if cutlass.const_expr(cfg.lora):
                    cute.arch.mbarrier_init(st.meta_ready.data_ptr(), 32)
                if cutlass.const_expr(cfg.push_maxima or cfg.push_partials):
                    for i in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(st.pbar.data_ptr() + i, 1)
                cute.arch.mbarrier_init_fence()
                # The push variants' receive barriers: this thread's one arrival of their only
                # phase, expecting every byte the peers will st.async (a peer's complete_tx may
                # come first: the phase cannot complete before this arrival anyway).
                if cutlass.const_expr(cfg.push_maxima):
                    cute.arch.mbarrier_arrive_and_expect_tx(st.pbar.data_ptr(), nsplit * BN * 4)
                if cutlass.const_expr(cfg.push_partials):
                    _, p_lo, p_hi = self._red_share(M, split, nsplit)
                    cute.arch.mbarrier_arrive_and_expect_tx(st.pbar.data_ptr() + 1, (p_hi - p_lo) * nsplit * 4)
            cute.arch.sync_threads()
            if cutlass.const_expr(cfg.push_maxima):
                # The first cluster phase only makes every CTA's mbarrier init visible before a
                # peer st.async's into it (fence.mbarrier_init above, relaxed arrive): the
                # consumer waits for it just before it pushes its maxima, the producer at its end.
                cute.arch.cluster_arrive_relaxed()
            # Let the next projection's first kernel (shrink or quantization, launched with PDL
            # when chained) be scheduled now: it prepares under our main loop and executes
            # griddepcontrol.wait, i.e. waits for our completion, before it reads x (maybe our y)
            # or writes anything (sync included), and triggers its own dependent only after that.
            # A kernel launched without PDL behind us is not affected. (xgate builds: every thread
            # triggers only past the x gate, _gate_then_trigger.)
            if cutlass.const_expr(not cfg.xgate):
                cute.arch.griddepcontrol_launch_dependents()

            # TMA views: (tile, k-block) of W, (0, k-block) of x_q.
            gW = cute.local_tile(mW, (BM, BK), (tile, None))
            tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
            stage_bytes = BM * BK
            if cutlass.const_expr(not cfg.self_quant):
                gX = cute.local_tile(mX, (BN, BK), (t_tile, None))
                tXs, tXg = cute.nvgpu.cpasync.tma_partition(
                    tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                stage_bytes = BM * BK + BN * BK

            # Which slice this tile belongs to (lora only): tiles never straddle slices.
            sl = cutlass.Int32(0)
            row_in_slice = n0
            n_s = cute.size(mW, mode=[0])
            if cutlass.const_expr(cfg.lora):
                for i in cutlass.range_constexpr(1, cfg.num_slices):
                    if n0 >= mSliceStart[i]:
                        sl = cutlass.Int32(i)
                row_in_slice = n0 - mSliceStart[sl]
                n_s = mSliceStart[sl + 1] - mSliceStart[sl]

            if wg == 0:
                # ===================================== producer ====================================
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if cutlass.const_expr(cfg.self_quant and not cfg.push_maxima):
                    # The consumer's exchange of token maxima is a cluster barrier, and every
                    # thread of the cluster takes part: arrive now, wait at the end.
                    cute.arch.cluster_arrive()
                if warp_idx == 0:
                    if cutlass.const_expr(cfg.self_quant):
                        self._weight_producer(tma_w, tWg, tWs, full, empty, stage_bytes, kb_lo, nloc, sx_ready)
                    else:
                        # The whole warp runs the producer: a TMA copy picks its issuing lane with
                        # elect.sync over the full warp, so all 32 lanes must reach it (one lane alone
                        # waits forever: the H200 hang). Transaction setup and the one-thread steps of
                        # the x_q protocol run on a single lane.
                        lane = cute.arch.lane_idx()
                        cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                        cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                        npre = cutlass.min(nloc, STAGES)
                        npre_w = npre  # stages whose weights go out before x_q is ready
                        if cutlass.const_expr(cfg.early > 0):
                            npre_w = cutlass.min(nloc, cfg.early)
                        # 1. weights of the first stages: they do not depend on the previous kernel.
                        for i in cutlass.range(npre_w, unroll=1):
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive_and_expect_tx(full + i, stage_bytes)
                            cute.copy(tma_w, tWg[(None, kb_lo + i)], tWs[(None, i)], tma_bar_ptr=full + i)
                        # 2. (the adapter's B chunks are warp 1's job, below)
                        # 3. wait until the quantization CTAs have published x_q / s_x (every lane
                        #    acquires, then orders its later async-proxy reads after it).
                        sync_addr = mSync.iterator.toint()
                        if n_quant == 0:
                            # x_q from a previous kernel (the standalone quantization): as its PDL
                            # dependent, wait for it here, after the first weight stages are requested
                            # (a no-op when launched without PDL). The counter is not touched.
                            cute.arch.griddepcontrol_wait()
                        else:
                            while D.ld_acquire_gpu_s32(sync_addr) < n_quant:
                                D.nanosleep(32)
                        D.fence_proxy_async_global()
                        self._stamp(trace_row, 1, lane)
                        # 4. x_q of the stages already holding weights, first: the consumer's first
                        #    WGMMA waits on it (s_x is needed only after the main loop).
                        for i in cutlass.range(npre_w, unroll=1):
                            cute.copy(tma_x, tXg[(None, kb_lo + i)], tXs[(None, i)], tma_bar_ptr=full + i)
                        if cutlass.const_expr(cfg.early > 0):
                            # The rest of the first pass over the (still free) stages: weights and x_q.
                            for i in cutlass.range(npre_w, npre, unroll=1):
                                with cute.arch.elect_one():
                                    cute.arch.mbarrier_arrive_and_expect_tx(full + i, stage_bytes)
                                cute.copy(tma_w, tWg[(None, kb_lo + i)], tWs[(None, i)], tma_bar_ptr=full + i)
                                cute.copy(tma_x, tXg[(None, kb_lo + i)], tXs[(None, i)], tma_bar_ptr=full + i)
                        # s_x goes to the consumer through smem + an mbarrier, so that its reads are
                        # ordered after this acquire (the consumer never saw the flag). One token per
                        # lane (bn <= 32): one memory round trip, not one per token (a serial loop here
                        # cost ~0.4 us per token before the first x_q load, measured on the H200).
                        if lane < cutlass.min(M, BN):
                            sSx[lane] = mSx[lane]
                        cute.arch.mbarrier_arrive(sx_ready)  # every lane (sx_ready counts 32)
                        if lane == 0:
                            if n_quant > 0:
                                self._count_past_spin(sync_addr)
                        cute.arch.sync_warp()
                        # 5. the steady state: weights and x_q of each freed stage.
                        for i in cutlass.range(npre, nloc, unroll=1):
                            s = i % STAGES
                            cute.arch.mbarrier_wait(empty + s, ((i // STAGES) + 1) % 2)
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive_and_expect_tx(full + s, stage_bytes)
                            cute.copy(tma_w, tWg[(None, kb_lo + i)], tWs[(None, s)], tma_bar_ptr=full + s)
                            cute.copy(tma_x, tXg[(None, kb_lo + i)], tXs[(None, s)], tma_bar_ptr=full + s)
                if cutlass.const_expr(cfg.lora):
                    if warp_idx == 1:
                        # The adapter side, beside the weight stream: the tile's token table, then
                        # every B chunk of this CTA's items (the ring's first ones at once: they
                        # depend on nothing the shrink kernel writes).
                        self._adapter_producer(tma_bs, mBs, st, sB_layout, bfull, bempty, mTok, mSlotRanks,
                                               sl, row_in_slice, n_s, split, nsplit, M)
                if cutlass.const_expr(cfg.xgate):
                    if warp_idx >= 2:  # (warps 0 and 1 trigger inside their loops, before they block)
                        self._gate_then_trigger(sx_ready)
                # The producer warpgroup's side of the consumer's two cluster barriers (all
                # threads of the cluster take part in each; the last one relaxed, as there).
                if cutlass.const_expr(cfg.self_quant):
                    cute.arch.cluster_wait()
                if cutlass.const_expr(cfg.push_maxima or cfg.push_partials):
                    # The push variants: this warpgroup publishes nothing that a peer reads (the
                    # partials are the consumer's; with push_partials this phase is the relaxed
                    # "main loop done" one).
                    cute.arch.cluster_arrive_relaxed()
                else:
                    cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
            else:
                # ===================================== consumer ====================================
                cute.arch.setmaxregister_increase(cfg.consumer_regs)
                ctid = tidx - 128
                thr_mma = tiled_mma.get_slice(ctid)
                tCsW = thr_mma.partition_A(sW)
                tCsX = thr_mma.partition_B(sX)
                tCrW = tiled_mma.make_fragment_A(tCsW)
                tCrX = tiled_mma.make_fragment_B(tCsX)
                cC = cute.make_identity_tensor((BM, BN))
                tCcC = thr_mma.partition_C(cC)
                acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc.fill(0.0)
                acc_blk = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                num_kk = cute.size(tCrW, mode=[2])
                rowmax = False  # sq_rowmax builds: this batch's maxima without the cluster exchange
                if cutlass.const_expr(cfg.sq_rowmax):
                    rowmax = M * K <= ROWMAX_ELEMS
                n_prod = cutlass.Int32(0)  # fused_h: the CTAs that publish partials of h
                if cutlass.const_expr(cfg.fused_h):
                    # The first unit's loads go out during the quantization; its products after it.
                    r_a = cute.make_rmem_tensor(cute.make_layout((8, 8)), mX.element_type)  # 4 rows x 2 vectors
                    cta = tile * nsplit + split
                    n_prod, total = self._quantize_x(ctid, mX, st, sSx, kb_lo, nloc, M, nsplit, trace_row, rowmax,
                                                     (cta, nsplit * cute.arch.grid_dim()[1], mAs, r_a))
                    self._h_units(ctid, mX, mAs, mH, mSync, st, M, K, cta, n_prod, total, r_a, trace_row)
                elif cutlass.const_expr(cfg.xgate):
                    self._quantize_x(ctid, mX, st, sSx, kb_lo, nloc, M, nsplit, trace_row, rowmax,
                                     gate=(mSync.iterator.toint(), n_quant, sx_ready))
                elif cutlass.const_expr(cfg.self_quant):
                    self._quantize_x(ctid, mX, st, sSx, kb_lo, nloc, M, nsplit, trace_row, rowmax)

                for i in cutlass.range(nloc, unroll=1):
                    s = i % STAGES
                    xb = s  # x_q's k-block in smem: the stage, or (self_quant) the CTA's i-th
                    if cutlass.const_expr(cfg.self_quant):
                        xb = i
                    cute.arch.mbarrier_wait(full + s, (i // STAGES) % 2)
                    cute.nvgpu.warpgroup.fence()
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    for kk in cutlass.range_constexpr(num_kk):
                        cute.gemm(tiled_mma, acc_blk, tCrW[(None, None, kk, s)], tCrX[(None, None, kk, xb)], acc_blk)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(empty + s)
                    # Promotion: FP8 WGMMA accumulates with less than fp32 precision (seen on the
                    # H200: 2-4% off on K = 4096 sums of aligned rows), so each 128-deep k-block
                    # starts a fresh tensor-core sum and the blocks add up here in fp32.
                    for e in cutlass.range_constexpr(cute.size(acc)):
                        acc[e] = acc[e] + acc_blk[e]

                if cutlass.const_expr(cfg.push_partials):
                    # "Main loop done": every stage's TMA has landed and every WGMMA that read one
                    # has completed, so the peers may overwrite this CTA's weight stages with
                    # their partials once every CTA has arrived (relaxed: nothing is published).
                    cute.arch.cluster_arrive_relaxed()
                self._stamp(trace_row, 2, ctid)
                acc_l = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc_l.fill(0.0)
                if cutlass.const_expr(cfg.lora):
                    # h comes from the shrink kernel: wait for it here, after the main loop, and not
                    # a moment earlier.
                    cute.arch.mbarrier_wait(st.meta_ready.data_ptr(), 0)
                    if cutlass.const_expr(cfg.fused_h):
                        # h's partials come from the first CTAs of this grid (_h_units): acquire
                        # their count, then the whole consumer reads them.
                        if ctid == 0:
                            while D.ld_acquire_gpu_s32(mSync.iterator.toint()) < n_prod:
                                D.nanosleep(32)
                        cute.arch.barrier(barrier_id=1, number_of_threads=128)
                    else:
                        cute.arch.griddepcontrol_wait()
                    self._stamp(trace_row, 3, ctid)
                    self._lora_epilogue(ctid, acc_l, tiled_mma_l, st, sB_layout, sH_layout, bfull, bempty,
                                        mH, sl, M, split, nsplit)

                # partial = acc * s_x[token] * s_w (+ adapter), into this CTA's reduction buffer.
                s_w = mSw[0]
                if cutlass.const_expr(not cfg.self_quant):
                    cute.arch.mbarrier_wait(sx_ready, 0)
                # s_x read for every element first (j < bn: inside sSx), the token mask a select:
                # under `if j < M` each read sat in its branch and the reads went out one at a
                # time (one register reused; SASS, docs/perf.md v0.46).
                sxe = cute.make_rmem_tensor((cute.size(acc),), cutlass.Float32)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, j = tCcC[i]
                    sxe[i] = sSx[j]
                pv = None
                if cutlass.const_expr(cfg.push_partials):
                    pv = cute.make_rmem_tensor((cute.size(acc),), cutlass.Float32)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, j = tCcC[i]
                    v = acc[i] * (sxe[i] * s_w)
                    if cutlass.const_expr(cfg.lora):
                        v = v + acc_l[i]
                    if cutlass.const_expr(cfg.push_partials):
                        pv[i] = v  # (tokens past M are not pushed)
                    else:
                        sRed[r, j] = cutlass.Float32(cutlass.select_(j < M, v, cutlass.Float32(0.0)))

                if cutlass.const_expr(cfg.push_partials):
                    self._push_reduce(ctid, pv, tCcC, st, mY, M, n0, split, nsplit, trace_row)
                else:
                    self._stamp(trace_row, 4, ctid)
                    if cutlass.const_expr(cfg.sq_rowmax):
                        if rowmax:  # the first phase, arrived at in _quantize_x
                            cute.arch.cluster_wait()
                    # Cluster-wide: every partial is in smem (release/acquire at cluster scope).
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                    # Fixed-order reduction of this CTA's share of the valid elements; y written once.
                    # It stays inside the consumer branch: code after the branches join is register-
                    # allocated for the producer's budget too, and there the reduction spilled (140 B
                    # of stack loads at bn = 16, 940 B at bn = 32, ptxas -v).
                    n_el, lo, hi = self._red_share(M, split, nsplit)
                    red_base = sRed.iterator.toint()
                    # Every element this thread owns is summed over the splits in the fixed order
                    # 0, 1, ..., S-1; the loads of one split are independent, so they are unrolled
                    # and all in flight at once (a serial load-add chain per element was the
                    # epilogue's largest cost at bn = 32).
                    RU = BM * BN // 128
                    # The loads are unconditional (elements past this CTA's share read a clamped one
                    # and are never stored): under `if e < hi` each load's add sat in its branch, so
                    # the loads went out one or two at a time (SASS, docs/perf.md v0.45).
                    vals = cute.make_rmem_tensor((RU,), cutlass.Float32)
                    vals.fill(0.0)
                    n_mine = (hi - lo + 127) // 128  # this CTA's elements per thread (at most)
                    if n_mine <= FEW_RED and nsplit <= FEW_RED_SPLITS:
                        # Few elements (decode at 1..8 tokens): one round of loads over every split
                        # per element instead of one round per split (each a DSMEM round trip, ~0.3 us
                        # on the H200: split 4 took ~0.6 us more than split 2 from partials to end, run17).
                        for u in cutlass.range_constexpr(min(RU, FEW_RED)):
                            if u < n_mine:
                                e = cutlass.min(lo + ctid + 128 * u, n_el - 1)
                                j = e // BM
                                r = e - j * BM
                                parts = cute.make_rmem_tensor((FEW_RED_SPLITS,), cutlass.Float32)
                                for q in cutlass.range_constexpr(FEW_RED_SPLITS):
                                    parts[q] = cutlass.Float32(0.0)
                                    if q < nsplit:
                                        parts[q] = D.ld_dsmem_f32(red_base + (r + j * (BM + RED_PAD)) * 4, q)
                                # The same order as below (0, 1, ..., S-1); + 0.0 past S leaves the sum
                                # as it is (it starts at +0.0, so it is never -0.0).
                                for q in cutlass.range_constexpr(FEW_RED_SPLITS):
                                    vals[u] = vals[u] + parts[q]
                    else:
                        for q in cutlass.range(nsplit, unroll=1):
                            for u in cutlass.range_constexpr(RU):
                                e = cutlass.min(lo + ctid + 128 * u, n_el - 1)
                                j = e // BM
                                r = e - j * BM
                                vals[u] = vals[u] + D.ld_dsmem_f32(red_base + (r + j * (BM + RED_PAD)) * 4, q)
                    self._store_share(vals, lo, hi, ctid, mY, n0)
                    # Keep this CTA's smem alive until every CTA of the cluster has read it. Relaxed:
                    # nothing is published here (this thread's DSMEM loads have returned, their values
                    # are in the stores above), and a release arrive compiles to MEMBAR.ALL.GPU, which
                    # would wait for those y stores to be acknowledged (run17's profile: ERRBAR).
                    cute.arch.cluster_arrive_relaxed()
                    cute.arch.cluster_wait()
                if cutlass.const_expr(cfg.fused_h):
                    if ctid == 0 and split == 0:
                        # Every CTA of this cluster is past its wait for h (the cluster barrier
                        # above): count the cluster done, one atomic per cluster (one per CTA made
                        # every CTA end ~3-6 us after the last one's partials on the H200, v0.43);
                        # the last one re-arms sync for the next call (which touches sync only
                        # after its griddepcontrol.wait, i.e. after this grid has completed).
                        gdim = cute.arch.grid_dim()
                        sync_addr = mSync.iterator.toint()
                        # (relaxed: the spin loads on sync[0] have returned, their values decided
                        # the branches that got every thread of the cluster here)
                        old = D.atom_add_relaxed_gpu_s32(sync_addr + 4, 1)
                        if old == gdim[1] * gdim[2] - 1:
                            D.st_relaxed_gpu_s32(sync_addr, 0)
                            D.st_relaxed_gpu_s32(sync_addr + 4, 0)
                self._stamp(trace_row, 5, ctid)

        # -----------------------------------------------------------------------------------------
        @cute.jit
        def _stamp(self, trace_row, slot: cutlass.Constexpr, who):
            """Trace builds only: %globaltimer into `slot` of this CTA's timeline row, by the thread
            whose `who` is 0 (nothing in the kernels that are launched for real)."""
            if cutlass.const_expr(self.cfg.trace):
                if who == 0:
                    D.stamp_globaltimer(trace_row + 8 * slot)

        @cute.jit
        def _weight_producer(self, tma_w, tWg, tWs, full, empty, stage_bytes, kb_lo, nloc, sx_ready):
            """Producer warp 0 of self_quant builds (all 32 lanes): the weights only, every stage as
            soon as it is free. Adapter builds first let the consumer issue its loads of x
            (_quantize_x): queued behind this CTA's first weight stages they returned ~1.5 us after
            K2's start on the H200 (docs/perf.md v0.29); the no-adapter builds start the weights at
            once (chained, they stream under the previous kernel while the consumer waits for x)."""
            STAGES = self.stages
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            if cutlass.const_expr(self.cfg.lora and not self.cfg.xgate):
                cute.arch.barrier(barrier_id=2, number_of_threads=160)
            for i in cutlass.range(nloc, unroll=1):
                s = i % STAGES
                if cutlass.const_expr(self.cfg.xgate):
                    if i == STAGES:  # every stage holds weights: trigger once the gate is passed
                        self._gate_then_trigger(sx_ready)
                if i >= STAGES:
                    cute.arch.mbarrier_wait(empty + s, ((i // STAGES) + 1) % 2)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(full + s, stage_bytes)
                cute.copy(tma_w, tWg[(None, kb_lo + i)], tWs[(None, s)], tma_bar_ptr=full + s)
            if cutlass.const_expr(self.cfg.xgate):
                if nloc <= STAGES:
                    self._gate_then_trigger(sx_ready)

        @cute.jit
        def _count_past_spin(self, sync_addr):
            """One thread per CTA, past its spin on sync[0] (the x_q flag, or the x gate): counts the
            CTA in sync[1]; the grid's last CTA past the spin re-arms both counters for the next
            call (every CTA has read sync[0] by then)."""
            gdim = cute.arch.grid_dim()
            total = gdim[0] * gdim[1] * gdim[2]
            old = D.atom_add_acqrel_gpu_s32(sync_addr + 4, 1)
            if old == total - 1:
                D.st_relaxed_gpu_s32(sync_addr, 0)
                D.st_relaxed_gpu_s32(sync_addr + 4, 0)

        @cute.jit
        def _gate_then_trigger(self, sx_ready):
            """xgate builds, every thread once: wait until the consumer has passed the x gate (it
            arrives on sx_ready, unused otherwise by self_quant builds), then trigger the dependents.
            No thread of the CTA triggers before the gate, whichever way the hardware counts a CTA's
            trigger (its first thread, or all of them): a dependent of this K2 is launched only once
            the kernel before this K2's shrink has completed."""
            cute.arch.mbarrier_wait(sx_ready, 0)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def _quantize_x(self, ctid, mX, st, sSx, kb_lo, nloc, M, nsplit, trace_row, rowmax, fh=None, gate=None):
            """Consumer (128 threads) of self_quant builds: x_q of this CTA's k-blocks into smem, s_x
            of the batch's tokens into sSx, bit for bit as vLLM (the codes of the shrink's
            quantization planes, epilora_cute.reference.quantize_fp8_per_token).

            Work units are (token, 16-element chunk) pairs of the batch's M tokens over the CTA's K
            range (8 chunks per 128-element k-block), unit ctid + 128 u for u < IT: every load is
            issued before any is used (one memory round trip; units past the last are not loaded)
            and the values stay in registers for the codes. Rows past the batch are neither loaded nor written: their
            WGMMA columns are never stored. Token maxima: per unit, into smem (red.max on the bit
            patterns, NaN never wins), then over the cluster's CTAs, which cover K between them
            (DSMEM behind a cluster barrier); one thread per token turns it into the scale and its
            correctly rounded reciprocal, with which each quotient x / s costs a few instructions
            and no branch (D.quot_rn_f32, bit-identical to div.rn: a branch per element to div.rn
            for infinite scales serialized the elements, 10 us at 8 tokens on the H200). The
            codes go to the swizzled K-major layout the WGMMA reads (128-byte rows, 16-byte chunk c
            of row j at c ^ (j % 8)) with 16-byte stores.

            rowmax (sq_rowmax builds, M * K <= ROWMAX_ELEMS): the maxima come from the whole rows,
            loaded by this CTA (ROWMAX_VECS vectors per thread); the cluster barrier's first phase
            is then arrived at here and waited for only before the partials' phase.

            fh (fused_h builds: cta, CTAs, A buffers, the first unit's A registers): after x's loads,
            the plan of h's units and this CTA's first unit's loads go out before the weights may
            (barrier 2); returns (n_prod, units) for _h_units.

            gate (xgate builds: sync's address, the count to wait for, sx_ready): x is read only
            once the shrink has published that x's writer has completed (_pass_x_gate)."""
            cfg = self.cfg
            BN, BK = self.bn, self.bk
            IT = SQ_UNITS  # units per thread at most (the launch checks M x k-blocks)
            if cutlass.const_expr(gate is not None):
                self._pass_x_gate(ctid, gate[0], gate[1], gate[2])
            elif cutlass.const_expr(not cfg.lora or cfg.fused_h):
                # Launched with PDL behind the kernel that writes x (chained no-adapter or fused_h
                # calls): wait for it here, after the weight stages were requested. (The other
                # adapter builds are the shrink's dependent, launched only after the shrink passed
                # its own wait: x is complete when they start.)
                cute.arch.griddepcontrol_wait()
            mv = cutlass.min(M, BN)
            nch = nloc * 8
            nunits = mv * nch
            sAm = st.sAmax.get_tensor(cute.make_layout(5 * BN))
            # [0, BN): this CTA's token maxima (read by the cluster); [BN, 3 BN): the quotients' operands
            am_addr = sAm.iterator.toint()
            if ctid < BN:
                sAm[ctid] = cutlass.Float32(0.0)
            r_x = cute.make_rmem_tensor(cute.make_layout((8, 2, IT)), mX.element_type)
            for u in cutlass.range_constexpr(IT):
                e = ctid + 128 * u
                if e < nunits:
                    j = e // nch
                    v = (kb_lo * 8 + e - j * nch) * 2
                    g_x = cute.zipped_divide(mX[j, None], (8,))
                    cute.autovec_copy(g_x[None, v], r_x[None, 0, u])
                    cute.autovec_copy(g_x[None, v + 1], r_x[None, 1, u])
            if cutlass.const_expr(cfg.sq_rowmax):
                r_f = cute.make_rmem_tensor(cute.make_layout((8, ROWMAX_VECS)), mX.element_type)
                nvr = cute.size(mX, mode=[1]) // 8  # vectors per row
                if rowmax:
                    cute.arch.cluster_arrive()  # nothing to publish: waited before the partials' phase
                    for i in cutlass.range_constexpr(ROWMAX_VECS):
                        v = ctid + 128 * i
                        if v < mv * nvr:
                            j = v // nvr
                            g_r = cute.zipped_divide(mX[j, None], (8,))
                            cute.autovec_copy(g_r[None, v - j * nvr], r_f[None, i])
            plan = None
            if cutlass.const_expr(fh is not None):
                cta, ncta, mAs, r_a = fh
                n_prod, total = self._h_plan(st, M, cute.size(mX, mode=[1]), ncta)
                if cta < n_prod:
                    self._h_unit(cta, ctid, mX, mAs, None, st, M, cute.size(mX, mode=[1]), r_a, True, False)
                plan = (n_prod, total)
            if cutlass.const_expr(cfg.lora and not cfg.xgate):
                cute.arch.barrier_arrive(barrier_id=2, number_of_threads=160)  # the weights may go now
            cute.arch.barrier(barrier_id=1, number_of_threads=128)  # the maxima are zeroed
            if cutlass.const_expr(cfg.sq_rowmax):
                if rowmax:
                    for i in cutlass.range_constexpr(ROWMAX_VECS):
                        v = ctid + 128 * i
                        if v < mv * nvr:
                            amax = cutlass.Float32(0.0)
                            for e8 in cutlass.range_constexpr(8):
                                amax = D.fmax_f32(amax, D.abs_f32(r_f[e8, i].to(cutlass.Float32)))
                            D.red_shared_max_u32(am_addr + (v // nvr) * 4, D.f32_bits(amax))
                else:
                    self._unit_maxima(r_x, ctid, nunits, nch, am_addr)
            else:
                self._unit_maxima(r_x, ctid, nunits, nch, am_addr)
            if cutlass.const_expr(not cfg.fused_h):  # (fused_h trace builds: slots 6, 7 are h's)
                self._stamp(trace_row, 6, ctid)
            if cutlass.const_expr(cfg.sq_rowmax):
                if rowmax:
                    cute.arch.barrier(barrier_id=1, number_of_threads=128)  # the CTA's maxima are the rows'
                else:
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
            else:
                if cutlass.const_expr(cfg.push_maxima):
                    self._push_maxima(ctid, st, sAm, nsplit)
                else:
                    # Every CTA's maxima are in its smem (release / acquire at cluster scope).
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
            if ctid < mv:
                amax = cutlass.Float32(0.0)
                if cutlass.const_expr(cfg.sq_rowmax):
                    if rowmax:
                        amax = sAm[ctid]
                    else:
                        amax = self._cluster_max(am_addr + ctid * 4, nsplit)
                else:
                    if cutlass.const_expr(cfg.push_maxima):
                        amax = self._received_max(st, ctid, nsplit)
                    else:
                        amax = self._cluster_max(am_addr + ctid * 4, nsplit)
                scale = D.fp8_scale(amax)
                sSx[ctid] = scale
                div, rcp = D.fp8_quotient_operands(scale)  # one per row, not per element
                sAm[BN + ctid] = rcp
                sAm[2 * BN + ctid] = div
            cute.arch.barrier(barrier_id=1, number_of_threads=128)  # scales and reciprocals
            if cutlass.const_expr(not cfg.fused_h):
                self._stamp(trace_row, 7, ctid)
            x_base = st.sX.data_ptr().toint()
            for u in cutlass.range_constexpr(IT):
                e = ctid + 128 * u
                if e < nunits:
                    j = e // nch
                    ch = e - j * nch
                    kb = ch // 8
                    c16 = ch - kb * 8
                    rcp = sAm[BN + j]
                    div = sAm[2 * BN + j]
                    w = cute.make_rmem_tensor((4,), cutlass.Int32)
                    for q4 in cutlass.range_constexpr(4):
                        c = cute.make_rmem_tensor((4,), cutlass.Float32)
                        for i in cutlass.range_constexpr(4):
                            el = q4 * 4 + i
                            qv = D.quot_rn_f32(r_x[el % 8, el // 8, u].to(cutlass.Float32), div, rcp)
                            c[i] = D.fp8_clamp(qv)
                        w[q4] = D.cvt_e4m3x4_f32(c[0], c[1], c[2], c[3])
                    off = kb * (BN * BK) + j * BK + ((c16 ^ (j % 8)) * 16)
                    D.st_shared_v4_b32(x_base + off, w[0], w[1], w[2], w[3])
            # The WGMMAs (async proxy) read what these generic-proxy stores wrote.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            self._stamp(trace_row, 1, ctid)
            return plan

        @cute.jit
        def _pass_x_gate(self, ctid, sync_addr, n_gate, sx_ready):
            """xgate builds, the consumer warpgroup (128 threads): one thread acquires sync[0] >=
            n_gate (the shrink's release after its griddepcontrol.wait: the kernel that wrote x has
            completed), counts this CTA past the gate in sync[1] and, as the grid's last CTA past
            it, re-arms both counters for the next call on this sync buffer (ops alternates two
            buffers: the next xgate K2 on the stream may already spin on the other one); then the
            warpgroup's barrier orders every thread's x loads after that acquire, warp 0 releases
            the producer warps (sx_ready) and every thread triggers the dependents."""
            if ctid == 0:
                while D.ld_acquire_gpu_s32(sync_addr) < n_gate:
                    D.nanosleep(32)
                self._count_past_spin(sync_addr)
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            if ctid < 32:
                cute.arch.mbarrier_arrive(sx_ready)  # every lane of warp 0 (sx_ready counts 32)
            cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def _h_plan(self, st, M, K, ncta):
            """fused_h: (n_prod, units) of this call from the adapter table (waits for it).

            Units are (slice, adapter group, FH_ROWS rank rows, FH_KC-wide chunk of K), slice-major,
            the groups in the table's order (first token of each slot with a non-zero effective
            rank); units past a group's effective rank are skipped (their partials are never read).
            Unit u goes to CTA u mod n_prod, n_prod = min(CTAs, FH_PRODUCERS, units): only the
            grid's first CTAs produce, and none of them waits for anything of this grid before it
            has published."""
            cfg = self.cfg
            R = cfg.rank
            cute.arch.mbarrier_wait(st.meta_ready.data_ptr(), 0)
            total = cfg.num_slices * self._h_groups(st, M) * (R // min(R, FH_ROWS)) * ((K + FH_KC - 1) // FH_KC)
            return cutlass.min(cutlass.min(ncta, FH_PRODUCERS), total), total

        @cute.jit
        def _h_groups(self, st, M):
            """fused_h: the adapter groups of the table (first tokens of slots with a rank)."""
            sReff = st.sReff.get_tensor(cute.make_layout(META_ROWS))
            n_groups = cutlass.Int32(0)
            for j in cutlass.range_constexpr(self.bn):
                if j < cutlass.min(M, self.bn):
                    if sReff[j] > 0:
                        n_groups = n_groups + 1
            return n_groups

        @cute.jit
        def _h_unit(self, u, ctid, mX, mAs: tuple, mP, st, M, K, r_a, load_a: cutlass.Constexpr,
                    compute: cutlass.Constexpr):
            """fused_h: unit u's loads (load_a: its A rows into r_a, its x into smem by cp.async),
            then (compute) its partials.

            Warp w takes rank rows 4w..4w+3 and lane l the 16 elements of K at l*16 (4 A rows x 2
            vectors in registers). The products run as a loop over the group's tokens (straight-line
            code over all tokens was instruction-fetch bound, docs/perf.md v0.43/v0.44): per token
            each (row) dot product is summed in order over the lane's 16 elements, then over the
            lanes in a fixed tree (6 shuffles), after which lanes 8 r hold row r and store it into
            partial[slice, chunk * bn + token, row]."""
            cfg = self.cfg
            BN, R, NS = self.bn, cfg.rank, cfg.num_slices
            FR = min(R, FH_ROWS)
            sTok = st.sTok.get_tensor(cute.make_layout(META_ROWS))
            sReff = st.sReff.get_tensor(cute.make_layout(META_ROWS))
            warp = cute.arch.make_warp_uniform(ctid // 32)
            lane = ctid % 32
            mv = cutlass.min(M, BN)
            nkc = (K + FH_KC - 1) // FH_KC
            per_group = (R // FR) * nkc
            per_slice = self._h_groups(st, M) * per_group
            sl = u // per_slice
            rem = u - sl * per_slice
            gi = rem // per_group
            rem = rem - gi * per_group
            rc = rem // nkc
            kc = rem - rc * nkc
            # The gi-th group of the table: its slot and effective rank.
            lid = cutlass.Int32(-1)
            rg = cutlass.Int32(0)
            cnt = cutlass.Int32(0)
            for j in cutlass.range_constexpr(BN):
                if j < mv:
                    r_j = sReff[j]
                    if r_j > 0:
                        if cnt == gi:
                            lid = sTok[j]
                            rg = r_j
                        cnt = cnt + 1
            k0 = kc * FH_KC + lane * 16
            kin = k0 < K
            if rc * FR < rg:
                if cutlass.const_expr(load_a):
                    # Zeros where nothing is loaded (K past its end, rows past FR): the products
                    # are taken branch-free, and 0 x (a stale register's NaN) would be NaN.
                    for e in cutlass.range_constexpr(64):
                        r_a[e % 8, e // 8] = cutlass.BFloat16(0.0)
                    for i in cutlass.range_constexpr(4):
                        if warp * 4 + i < FR:
                            if kin:
                                for q in cutlass.range_constexpr(NS):
                                    if sl == q:
                                        g_a = cute.zipped_divide(mAs[q][lid * R + rc * FR + warp * 4 + i, None], (8,))
                                        cute.autovec_copy(g_a[None, k0 // 8], r_a[None, 2 * i])
                                        cute.autovec_copy(g_a[None, k0 // 8 + 1], r_a[None, 2 * i + 1])
                    # The unit's x, every token row of the batch (rows past it and K past its end
                    # read as zeros), into smem with cp.async: 4 x 16 bytes per thread, no registers.
                    ux = st.sUx.data_ptr().toint()
                    x_base = mX.iterator.toint()
                    x_row = mX.layout.stride[0]
                    for q in cutlass.range_constexpr(BN * FH_KC // 8 // 128):
                        v = ctid + 128 * q
                        jr = v // (FH_KC // 8)
                        kv = kc * FH_KC + (v - jr * (FH_KC // 8)) * 8
                        ok = jr < mv and kv < K
                        src = x_base + (cutlass.Int64(cutlass.min(jr, mv - 1)) * x_row
                                        + cutlass.min(kv, K - 8)) * 2
                        D.cp_async_cg_16(ux + v * 16, src, cutlass.select_(ok, 16, 0))
                    cute.arch.cp_async_commit_group()
                if cutlass.const_expr(compute):
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier(barrier_id=1, number_of_threads=128)  # every thread's copies
                    sUx = st.sUx.get_tensor(cute.make_layout(BN * FH_KC))
                    g_u = cute.zipped_divide(sUx, (8,))
                    a_f = cute.make_rmem_tensor((64,), cutlass.Float32)
                    for e in cutlass.range_constexpr(64):
                        a_f[e] = r_a[e % 8, e // 8].to(cutlass.Float32)  # row e // 16, element e % 16
                    r_u = cute.make_rmem_tensor(cute.make_layout((8, 2)), r_a.element_type)
                    # One token per iteration (a loop, not unrolled: straight-line code run once per
                    # warp was instruction-fetch bound, docs/perf.md v0.43).
                    for jt in cutlass.range(mv, unroll=1):
                        if sTok[jt] == lid:  # warp-uniform
                            cute.autovec_copy(g_u[None, (jt * FH_KC + lane * 16) // 8], r_u[None, 0])
                            cute.autovec_copy(g_u[None, (jt * FH_KC + lane * 16) // 8 + 1], r_u[None, 1])
                            d = cute.make_rmem_tensor((4,), cutlass.Float32)
                            for i in cutlass.range_constexpr(4):
                                d[i] = cutlass.Float32(0.0)
                            for e in cutlass.range_constexpr(16):
                                xe = r_u[e % 8, e // 8].to(cutlass.Float32)
                                for i in cutlass.range_constexpr(4):
                                    d[i] = d[i] + xe * a_f[i * 16 + e]
                            # Over the lanes (a fixed tree): rows {0,1} / {2,3} by lane bit 4, then
                            # row by bit 3, then the sum over bits 2..0; lane 8 r holds row r.
                            up4 = (lane & 16) != 0
                            for q in cutlass.range_constexpr(2):
                                send = cutlass.Float32(cutlass.select_(up4, d[q], d[q + 2]))
                                keep = cutlass.Float32(cutlass.select_(up4, d[q + 2], d[q]))
                                d[q] = keep + cute.arch.shuffle_sync_bfly(send, offset=16)
                            up3 = (lane & 8) != 0
                            send = cutlass.Float32(cutlass.select_(up3, d[0], d[1]))
                            keep = cutlass.Float32(cutlass.select_(up3, d[1], d[0]))
                            d[0] = keep + cute.arch.shuffle_sync_bfly(send, offset=8)
                            for m in (4, 2, 1):
                                d[0] = d[0] + cute.arch.shuffle_sync_bfly(d[0], offset=m)
                            row = lane // 8
                            if lane % 8 == 0 and warp * 4 + row < FR:
                                mP[sl, kc * BN + jt, rc * FR + warp * 4 + row] = d[0]
                    # sUx is refilled by this CTA's next unit: every warp is past its reads.
                    cute.arch.barrier(barrier_id=1, number_of_threads=128)

        @cute.jit
        def _h_units(self, ctid, mX, mAs: tuple, mP, mSync, st, M, K, cta, n_prod, total, r_a, trace_row):
            """fused_h, consumer, after the quantization: this CTA's units of h (the first one's loads
            were requested with the quantization's x, before the weight stream: docs/perf.md v0.43),
            then one release-increment of sync[0]."""
            if cta < n_prod:
                self._h_unit(cta, ctid, mX, mAs, mP, st, M, K, r_a, False, True)
                for u in cutlass.range(cta + n_prod, total, n_prod, unroll=1):
                    self._h_unit(u, ctid, mX, mAs, mP, st, M, K, r_a, True, True)
                self._stamp(trace_row, 6, ctid)
                # Every thread's partials are stored; one release publishes them for the grid.
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                if ctid == 0:
                    D.red_release_gpu_add_s32(mSync.iterator.toint(), 1)
                self._stamp(trace_row, 7, ctid)

        @cute.jit
        def _unit_maxima(self, r_x, ctid, nunits, nch, am_addr):
            """Each of this thread's work units' |x| maximum into its token's smem word (red.max)."""
            IT = SQ_UNITS
            for u in cutlass.range_constexpr(IT):
                e = ctid + 128 * u
                if e < nunits:
                    amax = cutlass.Float32(0.0)
                    for hh in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(8):
                            amax = D.fmax_f32(amax, D.abs_f32(r_x[i, hh, u].to(cutlass.Float32)))
                    D.red_shared_max_u32(am_addr + (e // nch) * 4, D.f32_bits(amax))

        @cute.jit
        def _push_maxima(self, ctid, st, sAm, nsplit):
            """push_maxima (consumer): this CTA's token maxima (all BN words, zeros past the batch)
            into slot [split, token] of every peer's receive buffer, itself included, with st.async
            completing 4 bytes each on the peer's pbar[0] (which expects nsplit * BN * 4)."""
            BN = self.bn
            split = cute.arch.make_warp_uniform(cute.arch.block_in_cluster_idx()[0])
            # This CTA's red.max updates are complete before any thread reads a maximum.
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            # The init phase (arrived at after the mbarrier init): every peer's barrier is initialised.
            cute.arch.cluster_wait()
            bar = st.pbar.data_ptr().toint()
            recv = st.sRecv.data_ptr().toint()
            for it in cutlass.range_constexpr((MAX_CLUSTER * BN + 127) // 128):
                idx = ctid + 128 * it
                if idx < nsplit * BN:
                    q = idx // BN
                    j = idx - q * BN
                    D.push_b32(recv + (split * BN + j) * 4, D.f32_bits(sAm[j]), bar, q)

        @cute.jit
        def _received_max(self, st, ctid, nsplit):
            """push_maxima: token ctid's maximum over the cluster from the receive buffer, after
            the acquire.cluster wait for every peer's st.async (max is exact in any order)."""
            BN = self.bn
            D.mbarrier_wait_acquire_cluster(st.pbar.data_ptr().toint(), 0)
            sRv = st.sRecv.get_tensor(cute.make_layout(MAX_CLUSTER * BN))
            parts = cute.make_rmem_tensor((MAX_CLUSTER,), cutlass.Float32)
            for q in cutlass.range_constexpr(MAX_CLUSTER):
                parts[q] = sRv[q * BN + ctid]  # slots past the cluster hold no maxima: masked below
            amax = cutlass.Float32(0.0)
            for q in cutlass.range_constexpr(MAX_CLUSTER):
                amax = D.fmax_f32(amax, cutlass.Float32(cutlass.select_(q < nsplit, parts[q], cutlass.Float32(0.0))))
            return amax

        @cute.jit
        def _red_share(self, M, split, nsplit):
            """(n_el, lo, hi): the valid elements of the tile (BM x min(M, BN), element e = token *
            BM + row) and the range [lo, hi) this CTA reduces and stores (reduction_owner)."""
            n_el = self.bm * cutlass.min(M, self.bn)
            return n_el, split * n_el // nsplit, (split + 1) * n_el // nsplit

        @cute.jit
        def _push_reduce(self, ctid, pv, tCcC, st, mY, M, n0, split, nsplit, trace_row):
            """push_partials (consumer, after the partials pv are in registers): each valid element's
            partial goes by st.async to its owner o = reduction_owner(e) = ((e + 1) S - 1) // n_el
            (magic-number division), into slot split * sh + e - lo_o of o's freed weight stages
            (sh = ceil(n_el / S) slots per sender), completing 4 bytes on o's pbar[1], which
            expects (hi - lo) * S * 4. The owner waits (acquire.cluster) and sums its elements over
            the senders in the order 0..S-1 from +0.0, as the DSMEM reduction does: bitwise the
            same y. Lifetime: a CTA's last st.async into a peer is complete once that peer is past
            its wait; the final relaxed cluster phase (arrived right after the wait, waited at the
            end) keeps every CTA alive until all of them are, so none exits with stores in flight."""
            BM, BN = self.bm, self.bn
            n_el, lo, hi = self._red_share(M, split, nsplit)
            mvalid = cutlass.min(M, BN)
            sh = (n_el + nsplit - 1) // nsplit
            recv = st.sW.data_ptr().toint()
            bar = st.pbar.data_ptr().toint() + 8
            mag_n = D.div_magic_u32(n_el)  # exact: x * n_el < S * n_el^2 <= 2^28
            mag_s = D.div_magic_u32(nsplit)  # exact: o * n_el * S < 2^20 (S = 1: o = 0, m = 0)
            # "Main loop done" (arrived after the main loop): every CTA's weight stages are free.
            cute.arch.cluster_wait()
            for i in cutlass.range_constexpr(cute.size(pv)):
                r, j = tCcC[i]
                if j < mvalid:
                    e = j * BM + r
                    o = D.mulhi_u32((e + 1) * nsplit - 1, mag_n)
                    lo_o = D.mulhi_u32(o * n_el, mag_s)
                    D.push_b32(recv + (split * sh + e - lo_o) * 4, D.f32_bits(pv[i]), bar, o)
            self._stamp(trace_row, 4, ctid)
            D.mbarrier_wait_acquire_cluster(bar, 0)
            # Every st.async into this CTA is complete: arrive at the last phase now, wait at the end.
            cute.arch.cluster_arrive_relaxed()
            RU = BM * BN // 128
            sRv = cute.make_tensor(cute.recast_ptr(st.sW.data_ptr(), dtype=cutlass.Float32),
                                   cute.make_layout(BM * BN + MAX_CLUSTER))
            vals = cute.make_rmem_tensor((RU,), cutlass.Float32)
            vals.fill(0.0)
            for q in cutlass.range(nsplit, unroll=1):
                for u in cutlass.range_constexpr(RU):
                    # Unconditional (clamped into the share; past it never stored), as in the
                    # DSMEM reduction: local smem loads now.
                    e = cutlass.min(lo + ctid + 128 * u, hi - 1)
                    vals[u] = vals[u] + sRv[q * sh + e - lo]
            self._store_share(vals, lo, hi, ctid, mY, n0)
            cute.arch.cluster_wait()

        @cute.jit
        def _store_share(self, vals, lo, hi, ctid, mY, n0):
            """y of this CTA's reduced share [lo, hi) (element e = token * BM + row; thread ctid
            holds e = lo + ctid + 128 u in vals[u]), written once, as bf16."""
            BM = self.bm
            for u in cutlass.range_constexpr(cute.size(vals)):
                e = lo + ctid + 128 * u
                if e < hi:
                    j = e // BM
                    mY[j, n0 + e - j * BM] = vals[u].to(cutlass.BFloat16)

        @cute.jit
        def _cluster_max(self, addr, nsplit):
            """The maximum of the word at smem address `addr` over the cluster's CTAs (all requested
            at once: one DSMEM round trip)."""
            parts = cute.make_rmem_tensor((MAX_CLUSTER,), cutlass.Float32)
            for q in cutlass.range_constexpr(MAX_CLUSTER):
                parts[q] = cutlass.Float32(0.0)
                if q < nsplit:
                    parts[q] = D.ld_dsmem_f32(addr, q)
            amax = cutlass.Float32(0.0)
            for q in cutlass.range_constexpr(MAX_CLUSTER):
                amax = D.fmax_f32(amax, parts[q])
            return amax

        @cute.jit
        def _adapter_producer(self, tma_bs: tuple, mBs: tuple, st, sB_layout, bfull, bempty, mTok, mSlotRanks,
                              sl, row_in_slice, n_s, split, nsplit, M):
            """Producer warp 1 (all 32 lanes): the adapter table, then the B chunks.

            Table: row j (one lane each) holds token j's slot (sTok) and, when j is the first token
            of its slot, the slot's effective rank (sReff; 0 otherwise) - the tile's adapter groups
            in token order, from one parallel round of loads instead of a dependent chain of
            metadata reads at the end of the kernel. Items: (group, 64-wide rank chunk) in table
            order, dealt round-robin over the cluster's CTAs; the consumer walks the same order."""
            cfg = self.cfg
            BM, BN, RC, NB, R = self.bm, self.bn, self.rc, self.nb, cfg.rank
            sTok = st.sTok.get_tensor(cute.make_layout(META_ROWS))
            sReff = st.sReff.get_tensor(cute.make_layout(META_ROWS))
            lane = cute.arch.lane_idx()
            mv = cutlass.min(M, BN)
            tok = cutlass.Int32(-1)
            if lane < mv:
                tok = mTok[lane]
            sTok[lane] = tok
            cute.arch.sync_warp()
            first = tok >= 0
            for i in cutlass.range(lane, unroll=1):
                if sTok[i] == tok:
                    first = False
            reff = cutlass.Int32(0)
            if first:
                reff = cutlass.max(cutlass.min(mSlotRanks[tok], R), 0)
            sReff[lane] = reff
            cute.arch.sync_warp()  # the walk below reads every lane's entry
            cute.arch.mbarrier_arrive(st.meta_ready.data_ptr())  # every lane (meta_ready counts 32)

            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            t = cutlass.Int32(0)  # global item index (all CTAs of the cluster)
            q = cutlass.Int32(0)  # this CTA's item ordinal
            for g in cutlass.range(mv, unroll=1):
                rg = sReff[g]
                if rg > 0:
                    lid = sTok[g]
                    for c in cutlass.range((rg + RC - 1) // RC, unroll=1):
                        if t % nsplit == split:
                            b = q % NB
                            if cutlass.const_expr(cfg.xgate):
                                if q == NB:  # the ring is full: trigger once the gate is passed
                                    self._gate_then_trigger(st.sx_ready.data_ptr())
                            if q >= NB:
                                cute.arch.mbarrier_wait(bempty + b, ((q // NB) + 1) % 2)
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive_and_expect_tx(bfull + b, BM * RC * 2)
                            row_blk = (lid * n_s + row_in_slice) // BM
                            for i in cutlass.range_constexpr(cfg.num_slices):
                                if sl == i:
                                    gB = cute.local_tile(mBs[i], (BM, RC), (None, None))
                                    tBs, tBg = cute.nvgpu.cpasync.tma_partition(
                                        tma_bs[i], 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                        cute.group_modes(gB, 0, 2))
                                    cute.copy(tma_bs[i], tBg[(None, row_blk, c)], tBs[(None, b)],
                                              tma_bar_ptr=bfull + b)
                            q = q + 1
                        t = t + 1
            if cutlass.const_expr(cfg.xgate):
                if q <= NB:  # (more items triggered at item NB, above)
                    self._gate_then_trigger(st.sx_ready.data_ptr())

        @cute.jit
        def _h_from_partials(self, hv, ctid, mP, sTok, sl, lid, rg, c, M):
            """fused_h: this thread's hmask elements of rank chunk c, each the sum of its token's
            partials over K's chunks in order (FH_SUM loads in flight per element and round);
            elements past the group's effective rank stay 0 (their partials were not computed)."""
            BN, RC, R = self.bn, self.rc, self.cfg.rank
            HU = BN * RC // 128
            nkc = cute.size(mP, mode=[1]) // BN  # the workspace is [slices, nkc * bn, R]
            p_base = mP.iterator.toint()
            for u in cutlass.range_constexpr(HU):
                hv[u] = cutlass.Float32(0.0)
            for kc0 in cutlass.range(0, nkc, FH_SUM, unroll=1):
                # Unconditional loads (the chunk clamped into the workspace; j < bn and col < R
                # are inside it), masked by a select: see the h loads of _lora_epilogue.
                parts = cute.make_rmem_tensor((HU * FH_SUM,), cutlass.Float32)
                for u in cutlass.range_constexpr(HU):
                    e = ctid + 128 * u
                    j = e // RC
                    col = c * RC + e - j * RC
                    for q in cutlass.range_constexpr(FH_SUM):
                        off = ((sl * nkc + cutlass.min(kc0 + q, nkc - 1)) * BN + j) * R + col
                        parts[u * FH_SUM + q] = D.ld_relaxed_gpu_f32(p_base + cutlass.Int64(off) * 4)
                for u in cutlass.range_constexpr(HU):
                    e = ctid + 128 * u
                    j = e // RC
                    ok = j < M and c * RC + e - j * RC < rg and sTok[j] == lid
                    for q in cutlass.range_constexpr(FH_SUM):
                        v = cutlass.Float32(cutlass.select_(ok and kc0 + q < nkc, parts[u * FH_SUM + q],
                                                            cutlass.Float32(0.0)))
                        hv[u] = hv[u] + v

        @cute.jit
        def _lora_epilogue(self, ctid, acc_l, tiled_mma_l, st, sB_layout, sH_layout, bfull, bempty,
                           mH, sl, M, split, nsplit):
            """Consumer: acc_l += B_chunk . hmask^T for this CTA's items, in the table's order."""
            cfg = self.cfg
            BN, RC, NB, R = self.bn, self.rc, self.nb, cfg.rank
            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sH = st.sH.get_tensor(sH_layout.outer, swizzle=sH_layout.inner)
            sTok = st.sTok.get_tensor(cute.make_layout(META_ROWS))
            sReff = st.sReff.get_tensor(cute.make_layout(META_ROWS))
            thr = tiled_mma_l.get_slice(ctid)
            tLrB = tiled_mma_l.make_fragment_A(thr.partition_A(sB))
            tLrH = tiled_mma_l.make_fragment_B(thr.partition_B(sH))
            tiled_mma_l.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            n_kk = cute.size(tLrB, mode=[2])
            HU = BN * RC // 128  # hmask elements per consumer thread
            hv = cute.make_rmem_tensor((HU,), cutlass.Float32)
            t = cutlass.Int32(0)
            q = cutlass.Int32(0)
            for g in cutlass.range(cutlass.min(M, BN), unroll=1):
                rg = sReff[g]
                if rg > 0:
                    lid = sTok[g]
                    for c in cutlass.range((rg + RC - 1) // RC, unroll=1):
                        if t % nsplit == split:
                            b = q % NB
                            # hmask chunk: bf16(h) of this group's tokens, 0 elsewhere. Loads first,
                            # all independent (one round trip), then the smem stores.
                            if cutlass.const_expr(cfg.fused_h):
                                self._h_from_partials(hv, ctid, mH, sTok, sl, lid, rg, c, M)
                            else:
                                # Every load unconditional (indices clamped into h) and the mask a
                                # select afterwards: a load under its element's condition made
                                # ptxas convert it inside that branch, so each element waited for
                                # its own round trip (16 in a row at bn 32, ~4 us on the H200).
                                hl = cute.make_rmem_tensor((HU,), cutlass.Float32)
                                for u in cutlass.range_constexpr(HU):
                                    e = ctid + 128 * u
                                    j = e // RC
                                    hl[u] = mH[sl, cutlass.min(j, M - 1), cutlass.min(c * RC + e - j * RC, R - 1)]
                                for u in cutlass.range_constexpr(HU):
                                    e = ctid + 128 * u
                                    j = e // RC
                                    ok = j < M and c * RC + e - j * RC < R and sTok[j] == lid
                                    hv[u] = cutlass.Float32(cutlass.select_(ok, hl[u], cutlass.Float32(0.0)))
                            for u in cutlass.range_constexpr(HU):
                                e = ctid + 128 * u
                                j = e // RC
                                sH[j, e - j * RC, 0] = hv[u].to(cutlass.BFloat16)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            cute.arch.barrier(barrier_id=1, number_of_threads=128)
                            cute.arch.mbarrier_wait(bfull + b, (q // NB) % 2)
                            # k16 steps past the slot's effective rank multiply zeros: skip them.
                            n_steps = (cutlass.min(rg - c * RC, RC) + 15) // 16
                            cute.nvgpu.warpgroup.fence()
                            for kk in cutlass.range_constexpr(n_kk):
                                if kk < n_steps:
                                    cute.gemm(tiled_mma_l, acc_l, tLrB[(None, None, kk, b)],
                                              tLrH[(None, None, kk, 0)], acc_l)
                            cute.nvgpu.warpgroup.commit_group()
                            cute.nvgpu.warpgroup.wait_group(0)
                            cute.arch.mbarrier_arrive(bempty + b)
                            # sH is rewritten by the next item: everyone must be past this WGMMA.
                            cute.arch.barrier(barrier_id=1, number_of_threads=128)
                            q = q + 1
                        t = t + 1



# ---------------------------------------------------------------------------------------------
# Runtime contract
# ---------------------------------------------------------------------------------------------


def _fake_args(cfg: Config):
    """Fake tensors with symbolic sizes, in the __call__ order."""
    f8, bf16, f32, i32 = cutlass.Float8E4M3FN, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    N, K, M = D.sym(cfg.bm), D.sym(16), D.sym(1)
    w = D.fake_rowmajor(f8, (N, K))
    sw = D.fake_rowmajor(f32, (1,), align=4)
    y = D.fake_rowmajor(bf16, (D.sym(1), D.sym(8)))
    if cfg.self_quant:  # bf16 x in the x_q position; no s_x, no sync (fused_h: its counters)
        xq, sx, sync = D.fake_rowmajor(bf16, (D.sym(1), D.sym(128))), None, None
        if cfg.fused_h or cfg.xgate:
            sync = D.fake_rowmajor(i32, (2,), align=8)
    else:
        xq = D.fake_rowmajor(f8, (D.sym(1), D.sym(16)))
        sx = D.fake_rowmajor(f32, (D.sym(1),), align=4)
        sync = D.fake_rowmajor(i32, (2,), align=8)
    if cfg.lora:
        bufs = tuple(D.fake_rowmajor(bf16, (D.sym(cfg.bm), cfg.rank)) for _ in range(cfg.num_slices))
        h = D.fake_rowmajor(f32, (cfg.num_slices, D.sym(1), cfg.rank))
        tok = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        active = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        num_active = D.fake_rowmajor(i32, (1,), align=4)
        slot_ranks = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        slice_start = D.fake_rowmajor(i32, (cfg.num_slices + 1,), align=4)
        args = (w, xq, sx, sw, y, sync, cutlass.Int32(0), D.fake_stream(), h, tok, active, num_active,
                slot_ranks, slice_start, *bufs)
        pad = 4 - cfg.num_slices  # b_{num_slices}..b3
    else:
        args = (w, xq, sx, sw, y, sync, cutlass.Int32(0), D.fake_stream())
        pad = 10  # h .. slice_start, b0 .. b3
    trace = D.fake_rowmajor(cutlass.Int64, (D.sym(1), TRACE_SLOTS)) if cfg.trace else None
    if cfg.fused_h:  # after `trace`: A of each slice, [max_loras * R, K]
        bufs_a = tuple(D.fake_rowmajor(bf16, (D.sym(1), D.sym(128))) for _ in range(cfg.num_slices))
        return args + (None,) * pad + (trace,) + bufs_a
    if not cfg.trace:
        return args
    return args + (None,) * pad + (trace,)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """cute.compile of one configuration with fake tensors (no GPU needed). The result carries
    `epilora_smem_bytes`: the dynamic shared memory the launch needs."""
    return D.compile_with_smem(_K2Kernel(config), _fake_args(config), options)


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol).

    TMA parameters pack a 2-D torch view (encoded with cuTensorMapEncodeTiled from the TmaSpec)
    or prebuilt 128 bytes; coordinate parameters pack a tuple of int32 dims.
    """
    bm, bn, bk, rc = config.bm, config.bn, config.bk, config.rank_chunk
    f8, bf16, f32, i32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32
    p = [
        TmaParam("tma_w", TmaSpec(f8, (bk, bm)), "W_q [N, K] e4m3"),
        CoordParam("w_dims", 2),  # (N, K)
    ]
    if config.self_quant:
        p += [
            TensorParam("x", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, K]
            TensorParam("s_w", f32, 1, align=4),  # [1]
            TensorParam("y", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, N]
        ]
        if config.fused_h or config.xgate:
            # [2]: fused_h, h's partials published / CTAs done; xgate, the shrink's gate / CTAs past it
            p.append(TensorParam("sync", i32, 1, align=8))
        p.append(ScalarParam("n_quant", "i"))  # xgate: the gate's count (1); otherwise unused (0)
    else:
        p += [
            TmaParam("tma_xq", TmaSpec(f8, (bk, bn)), "x_q [M, K] e4m3 (M <= bn; rows >= M are never stored)"),
            CoordParam("xq_dims", 2),  # (M, K)
            TensorParam("s_x", f32, 1, dynamic_shape=(0,), align=4),  # [M] (x_scale.view(-1))
            TensorParam("s_w", f32, 1, align=4),  # [1]
            TensorParam("y", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, N]
            TensorParam("sync", i32, 1, align=8),  # [2], shared with the shrink kernel, zeroed once
            ScalarParam("n_quant", "i"),
        ]
    if config.lora:
        sw = {16: "32B", 32: "64B", 64: "128B"}[rc]
        # (tma atoms..., coordinate tensors...) flatten atoms first, then coordinates.
        for s in range(config.num_slices):
            p.append(TmaParam(f"tma_b{s}", TmaSpec(bf16, (rc, bm), swizzle=sw),
                              f"B_{s} [max_loras, 1, n_{s}, R] viewed as [max_loras*n_{s}, R]"))
        for s in range(config.num_slices):
            p.append(CoordParam(f"b{s}_dims", 1))  # (max_loras*n_s,)
        p += [
            TensorParam("h", f32, 3, dynamic_shape=(1,), dynamic_stride=(0,), align=16),  # [slices, M, R]
            TensorParam("token_lora", i32, 1, dynamic_shape=(0,), align=4),  # [M]
            TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras+1]
            TensorParam("num_active", i32, 1, align=4),  # [1]
            TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras]
            TensorParam("slice_start", i32, 1, align=4),  # [num_slices+1]: 0, n_0, n_0+n_1, ..., N
        ]
        if config.fused_h:  # `h` above is then the partials' workspace [slices, nkc * bn, R]
            p += [TensorParam(f"a{s}", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16)
                  for s in range(config.num_slices)]  # A_s [max_loras, 1, R, K] viewed as [max_loras*R, K]
    if config.trace:
        p.append(TensorParam("trace", torch.int64, 2, dynamic_shape=(0,), align=16))  # [CTAs, 8] ns
    return p


def launch(config: Config, *, w_q, w_scale, y, split: int, x_q=None, x_scale=None, sync=None, n_quant: int = 0,
           x=None, h=None, token_lora=None, active_lora_ids=None, num_active=None, slot_ranks=None,
           slice_start=None, lora_b=None, trace=None, lora_a=None) -> dict:
    """Arguments (in params() order) and launch geometry for one K2 call.

    x_q, x_scale, sync, n_quant: the activations quantized by another kernel (see the module
    docstring); xgate builds take sync (the shrink's gate buffer) and as n_quant the gate's count;
    x instead (bf16 [M, K], K a multiple of 128) for self_quant builds, which need
    split >= min_split(config, K, M) so that no CTA owns more k-blocks than the build holds.
    fused_h builds also take lora_a (vLLM's A buffers, one per slice), sync (int32 [2], zero before
    the first call; the kernel re-arms it) and as h the partials' workspace
    fused_h_workspace_shape(config, K) fp32, contiguous.
    Returns dict(args, grid, block, cluster, smem, pdl). Launch with cluster dims (split, 1, 1)
    and, for the adapter variant, PDL (programmatic stream serialization) as the dependent of the
    shrink kernel.
    """
    if config.self_quant:
        if x is None or x_q is not None:
            raise ValueError("a self_quant build takes x (bf16), not x_q")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.data_ptr() % 16:
            raise ValueError("x must be a bf16 [M, K] tensor with contiguous, 16-byte aligned rows")
    elif x_q is None or x_scale is None or sync is None:
        raise ValueError("this build takes x_q, x_scale and sync (x only with self_quant)")
    M, K = (x if config.self_quant else x_q).shape
    N = w_q.shape[0]
    n_tt = token_tiles_of(config, M)
    if N % config.bm:
        raise ValueError(f"N={N} is not a multiple of bm={config.bm}")
    if not 1 <= split <= 16:
        raise ValueError("split must be 1..16 (cluster size; > 8 needs the non-portable attribute)")
    if config.self_quant:
        if K % 128 or x.stride(0) % 8:
            raise ValueError(f"K = {K} must be a multiple of 128 (and x's row stride of 8)")
        if split > K // config.bk:
            raise ValueError(f"split {split} leaves a CTA without k-blocks (K = {K})")
        if split < min_split(config, K, M):
            raise ValueError(f"split {split} leaves a CTA more k-blocks of K = {K} than {M} tokens of this "
                             f"build may have (at most {config.sq_kblocks}, and {M} x k-blocks <= 128)")
        args = [w_q, (N, K), x, w_scale.reshape(-1), y, 0]
        if config.xgate:
            if sync is None or sync.dtype != torch.int32 or sync.numel() < 2 or not sync.is_contiguous():
                raise ValueError("an xgate build takes sync, int32 [2] (the shrink's gate), contiguous")
            if n_quant < 1:
                raise ValueError("an xgate build takes n_quant >= 1: the gate's count (lora_shrink.launch's n_gate)")
            args = [w_q, (N, K), x, w_scale.reshape(-1), y, sync, int(n_quant)]
        if config.fused_h:
            if sync is None or sync.dtype != torch.int32 or sync.numel() < 2:
                raise ValueError("a fused_h build takes sync, int32 [2]")
            args = [w_q, (N, K), x, w_scale.reshape(-1), y, sync, 0]
    else:
        args = [w_q, (N, K), x_q, (M, K), x_scale.reshape(-1), w_scale.reshape(-1), y, sync, int(n_quant)]
    if config.lora:
        bufs = list(lora_b)
        if len(bufs) != config.num_slices:
            raise ValueError(f"{config.num_slices} B buffers expected")
        views = []
        for b in bufs:
            b3 = adapter_view(b, "lora_b", "n, rank")
            if b3.shape[2] != config.rank:
                raise ValueError(f"B buffer rank {b3.shape[2]} != config rank {config.rank}")
            if b3.shape[1] % config.bm:
                raise ValueError(f"slice width {b3.shape[1]} is not a multiple of bm={config.bm}")
            views.append(b3.reshape(-1, config.rank))
        args += views + [(v.shape[0],) for v in views]
        if config.fused_h:
            want = fused_h_workspace_shape(config, K)
            if h is None or tuple(h.shape) != want or h.dtype != torch.float32 or not h.is_contiguous():
                raise ValueError(f"a fused_h build takes as h the partials' workspace, fp32 {want}, contiguous")
        args += [h, token_lora, active_lora_ids, num_active, slot_ranks, slice_start]
        if config.fused_h:
            bufs_a = list(lora_a) if lora_a is not None else []
            if len(bufs_a) != config.num_slices:
                raise ValueError(f"{config.num_slices} A buffers expected")
            for a in bufs_a:
                a3 = adapter_view(a, "lora_a", "rank, K")
                if a3.shape[1] != config.rank or a3.shape[2] != K or a3.dtype != torch.bfloat16:
                    raise ValueError(f"A buffer {tuple(a.shape)} does not match rank {config.rank}, K {K}")
                if not a3.is_contiguous() or a3.data_ptr() % 16:
                    raise ValueError("A buffers must be contiguous and 16-byte aligned")
                args.append(a3.reshape(-1, K))
    if config.trace:
        if trace is None or trace.shape != (split * (N // config.bm), TRACE_SLOTS) or trace.dtype != torch.int64:
            raise ValueError(f"a trace build needs trace = int64 [{split * (N // config.bm)}, {TRACE_SLOTS}]")
        args.append(trace)
    return dict(args=tuple(args), grid=(split, N // config.bm * n_tt, 1), block=config.block,
                cluster=(split, 1, 1), smem=config.smem_bytes(), pdl=config.lora)


def token_tiles_of(config: Config, m: int) -> int:
    """The token tiles a launch of m tokens has (grid y = weight blocks x this): 1, or for
    token_tiles builds ceil(m / bn) up to WIDE_MAX_TOKENS tokens."""
    limit = WIDE_MAX_TOKENS if config.token_tiles else config.bn
    if not 1 <= m <= limit:
        raise ValueError(f"{m} tokens: this build takes 1..{limit} (token tile {config.bn}"
                         + (", token tiles)" if config.token_tiles else ")"))
    return -(-m // config.bn)


def reduction_owner(e: int, n_el: int, nsplit: int) -> int:
    """The CTA that reduces and stores element e of n_el: the o with o n_el // S <= e < (o + 1) n_el // S."""
    return ((e + 1) * nsplit - 1) // n_el


def _magic_u32(d: int) -> int:
    return ((0xFFFFFFFF // d) + 1) & 0xFFFFFFFF  # _dsl.div_magic_u32


def push_plan(bm: int, m_valid: int, nsplit: int) -> dict:
    """push_partials' plan, in the kernel's own integer arithmetic (magic-number divisions
    included), for tests: {"sh": slots per sender, "expect": [bytes each owner expects],
    "pushes": [(sender, element, owner, slot)], "share": [(lo, hi)] per CTA}. Every sender pushes
    every valid element (e = token * bm + row, token < m_valid) of its partial tile."""
    n_el = bm * m_valid
    sh = (n_el + nsplit - 1) // nsplit
    mag_n, mag_s = _magic_u32(n_el), _magic_u32(nsplit)
    share = [(q * n_el // nsplit, (q + 1) * n_el // nsplit) for q in range(nsplit)]
    pushes = []
    for q in range(nsplit):
        for e in range(n_el):
            o = (((e + 1) * nsplit - 1) * mag_n) >> 32
            lo_o = ((o * n_el) * mag_s) >> 32
            pushes.append((q, e, o, q * sh + e - lo_o))
    return {"sh": sh, "share": share, "pushes": pushes,
            "expect": [(hi - lo) * nsplit * 4 for lo, hi in share]}


def fused_h_workspace_shape(config: Config, k: int) -> tuple[int, int, int]:
    """The fused_h partials' workspace: [slices, ceil(K / FH_KC) * bn, R] fp32."""
    return (config.num_slices, -(-k // FH_KC) * config.bn, config.rank)


def choose_split(n_out: int, k: int, bm: int = 128, bk: int = 128, sms: int = SM_COUNT_H100,
                 max_split: int = 8, ctas_per_sm: int = 2, overhead_kblocks: float = 4.0,
                 sm_boost: float = 1.6) -> int:
    """Split-K (cluster size) so that every SM streams weights.

    Cost model, in k-block times at an SM's fair share of the bandwidth: the whole projection
    needs tiles*nk/sms; the busiest SM, holding ceil(tiles*S/sms) CTAs of nk/S k-blocks, streams
    them at most `sm_boost` times faster than its fair share; each of its CTAs adds a fixed cost
    (pipeline fill, epilogue, reduction) of `overhead_kblocks`. Builds with one CTA per SM stop at
    S = 2: a cluster then needs S free SMs of one GPC, and on the H200 clusters of 4 spilled into a
    second wave (o / down at S = 4: 18.9 / 33.0 us against 14.3 / 25.2 us with two CTAs per SM).
    Fitted to docs/gpu_record/run4 (k2sweep); a starting point for the timed dispatch."""
    tiles = n_out // bm
    nk = -(-k // bk)
    top = max_split if ctas_per_sm > 1 else min(max_split, 2)
    best, best_t = 1, None
    for s in range(1, top + 1):
        if nk // s < 2:
            break
        per_sm = -(-tiles * s // sms)
        t = max(tiles * nk / sms, per_sm * (nk / s) / sm_boost) + per_sm * overhead_kblocks
        if best_t is None or t <= best_t + 1e-9:  # ties: the larger split (o at S = 4, measured)
            best, best_t = s, t
    return best


def split_for(cfg: "Config", n_out: int, k: int, m: int | None = None) -> int:
    """choose_split for a built configuration (its bm, bk and CTAs per SM), raised for self_quant
    builds to min_split (for m tokens; None: a full tile). token_tiles builds count each weight
    block once per token tile (that many more CTAs share the GPU)."""
    n_tt = token_tiles_of(cfg, m) if cfg.token_tiles and m is not None else 1
    return max(choose_split(n_out * n_tt, k, cfg.bm, cfg.bk, ctas_per_sm=cfg.ctas), min_split(cfg, k, m))


def min_split(cfg: "Config", k: int, m: int | None = None) -> int:
    """The smallest split a build can run K with: 1, or for self_quant builds the one that leaves
    no CTA more than sq_kblocks k-blocks, nor more than 128 / min(m, bn) of them (the register
    bound, SQ_UNITS; m None: a full tile) (> 16 means the build cannot take this K)."""
    if not cfg.self_quant:
        return 1
    nk = -(-k // cfg.bk)  # k-blocks
    rows = cfg.bn if m is None else max(1, min(m, cfg.bn))
    return -(-nk // min(cfg.sq_kblocks, 128 * SQ_UNITS // (8 * rows)))


def token_tile(m: int) -> int:
    """The token tile (WGMMA N) of the decode K2 for m tokens: 8 / 16 / 32, and 32 with token
    tiles (Config.token_tiles) at 33..WIDE_MAX_TOKENS."""
    if not 1 <= m <= WIDE_MAX_TOKENS:
        raise ValueError(f"the decode path takes 1..{WIDE_MAX_TOKENS} tokens, got {m}")
    return 8 if m <= 8 else 16 if m <= 16 else 32


def default_config(bn: int, bm: int, **kw) -> Config:
    """The decode path's build for a token tile: two CTAs per SM (measured on the H200: the
    second CTA's stream covers the first one's prologue and epilogue, and clusters of up to 8
    stay in one wave), with 4 weight stages, or 3 where 4 don't fit twice (bn = 32 with an
    adapter); one CTA per SM only if neither fits. Self-quantizing adapter builds (x_q resident
    in smem) first give up the second B buffer (one rank-64 adapter: one item per CTA)."""
    bufs = (2, 1) if kw.get("self_quant") and kw.get("lora", True) else (2,)
    for stages in (4, 3):
        for nb in bufs:
            c = Config(bn=bn, bm=bm, stages=stages, ctas=2, b_bufs=nb, **kw)
            if c.fits_ctas():
                return c
    return Config(bn=bn, bm=bm, stages=4, ctas=1, **kw)


# The push variants (Config.push_maxima / push_partials) are chosen at run time: EPILORA_K2_PUSH is
# a comma list of `maxima`, `partials`; unset means PUSH_DEFAULT, empty or `none` the builds without
# them. select() is the one place that reads it; it applies to the decode K2 builds of rank 64 and
# the no-adapter ones (the prebuilt push set, push_configs(), the builds the H200 verified bit for
# bit against the others: docs/perf.md v0.52); other ranks keep the builds without pushes.
PUSH_ENV = "EPILORA_K2_PUSH"
PUSH_NAMES = ("maxima", "partials")
PUSH_DEFAULT = "maxima,partials"
PUSH_RANKS = (64,)


def push_flags(value: str | None = None) -> tuple[str, ...]:
    """The push variants asked for: `value`, or EPILORA_K2_PUSH when None (unset: PUSH_DEFAULT;
    empty or "none": no push variant)."""
    return _parse_push(os.environ.get(PUSH_ENV, PUSH_DEFAULT) if value is None else value)


@functools.lru_cache(maxsize=None)
def _parse_push(v: str) -> tuple[str, ...]:
    if v.strip().lower() == "none":
        return ()
    names = tuple(sorted({t.strip() for t in v.split(",") if t.strip()}))
    bad = [n for n in names if n not in PUSH_NAMES]
    if bad:
        raise ValueError(f"{PUSH_ENV}: unknown {bad} (known: {', '.join(PUSH_NAMES)})")
    return names


def push_variant(cfg: "Config | None", push=None) -> "Config | None":
    """`cfg` with the push flags asked for (push: a comma string or a tuple of names; None reads
    EPILORA_K2_PUSH) where they apply to it: maxima to self_quant builds, partials to every
    decode K2; only builds of PUSH_RANKS or without adapter, never fused_h / sq_rowmax / trace /
    early builds. Otherwise `cfg` itself."""
    if cfg is None:
        return None
    names = push_flags(push) if push is None or isinstance(push, str) else tuple(push)
    if not names or cfg.fused_h or cfg.sq_rowmax or cfg.trace or cfg.early or (cfg.lora and cfg.rank not in PUSH_RANKS):
        return cfg
    pm = "maxima" in names and cfg.self_quant
    pp = "partials" in names
    if not (pm or pp):
        return cfg
    c = dataclasses.replace(cfg, push_maxima=pm, push_partials=pp)
    return c if c.fits_ctas() else cfg


SQ_WIDE_ENV = "EPILORA_K2_SQ_WIDE"
# On by default since run20 (docs/perf.md v0.54 measured: the chained Qwen3-8B layer at one token
# 81.4 -> 76.3 us; bitwise the default builds at equal splits); 0 turns them off.
SQ_WIDE_DEFAULT = "1"
WIDE_RANKS = (64,)


def sq_wide_enabled(value: str | None = None) -> bool:
    """Whether the wide self_quant builds are asked for: `value`, or EPILORA_K2_SQ_WIDE when None
    (1 / on / true: yes; 0 / off / false / empty: no; unset: SQ_WIDE_DEFAULT)."""
    return _parse_flag(os.environ.get(SQ_WIDE_ENV, SQ_WIDE_DEFAULT) if value is None else value, SQ_WIDE_ENV)


@functools.lru_cache(maxsize=None)
def _parse_flag(v: str, name: str) -> bool:
    t = v.strip().lower()
    if t in ("1", "on", "true", "yes"):
        return True
    if t in ("", "0", "off", "false", "no", "none"):
        return False
    raise ValueError(f"{name}: {v!r} is neither on (1) nor off (0)")


def wide_config(cfg: Config) -> Config | None:
    """The wide twin of a default self_quant build (SQ_WIDE_KBLOCKS resident k-blocks, the same
    pushes; its stages and B buffers as default_config fits them), or None where it has none (other
    ranks, experiments, or no two-CTA fit)."""
    if not cfg.self_quant or cfg.sq_xblocks or cfg.fused_h or cfg.sq_rowmax or cfg.trace or cfg.early:
        return None
    if cfg.lora and cfg.rank not in WIDE_RANKS:
        return None
    kw = dict(lora=True, num_slices=cfg.num_slices, rank=cfg.rank) if cfg.lora else dict(lora=False)
    w = default_config(cfg.bn, cfg.bm, self_quant=True, sq_xblocks=SQ_WIDE_KBLOCKS, **kw)
    if w.ctas != cfg.ctas:
        return None
    w = dataclasses.replace(w, push_maxima=cfg.push_maxima, push_partials=cfg.push_partials)
    return w if w.fits_ctas() else None


def sq_wide_applies(cfg: Config, n_out: int, k: int, m: int) -> Config | None:
    """The wide twin of `cfg` when it runs m tokens of K at a smaller split than `cfg` (the
    projection's CTAs in fewer waves), else None."""
    w = wide_config(cfg)
    if w is None:
        return None
    return w if split_for(w, n_out, k, m) < split_for(cfg, n_out, k, m) else None


def _wide_or(cfg: Config | None, n_out: int, m: int, k: int) -> Config | None:
    return None if cfg is None else (sq_wide_applies(cfg, n_out, k, m) or cfg)


XGATE_ENV = "EPILORA_K2_XGATE"
# Off by default: an experiment (docs/perf.md v1.03) until a GPU record measures and verifies it.
XGATE_DEFAULT = "0"
XGATE_RANKS = (64,)


def xgate_enabled(value: str | None = None) -> bool:
    """Whether chained decode_sq calls take the x-gated pair (Config.xgate): `value`, or
    EPILORA_K2_XGATE when None (1 / on: yes; 0 / off / empty: no; unset: XGATE_DEFAULT)."""
    return _parse_flag(os.environ.get(XGATE_ENV, XGATE_DEFAULT) if value is None else value, XGATE_ENV)


def xgate_variant(cfg: Config | None) -> Config | None:
    """The x-gated twin of a self_quant adapter build (default or wide, any pushes) of
    XGATE_RANKS, or None where none is built (other ranks, fused_h, sq_rowmax, trace builds)."""
    if cfg is None or not (cfg.self_quant and cfg.lora) or cfg.rank not in XGATE_RANKS or cfg.xgate:
        return None
    if cfg.fused_h or cfg.sq_rowmax or cfg.trace:
        return None
    return dataclasses.replace(cfg, xgate=True)


def xgate_configs() -> list[Config]:
    """The prebuilt x-gated K2s: the twin of every self_quant adapter build of XGATE_RANKS that
    select() may return (each push combination, wide builds included)."""
    out = set()
    for _, _, _, widths, _ in projection_shapes():
        for bn in SELF_QUANT_TILES:
            for r in XGATE_RANKS:
                for names in ((), ("maxima",), ("partials",), ("maxima", "partials")):
                    c, _ = _select(tuple(widths), bn, r, None, None, True, False, names)
                    for v in (c, wide_config(c)):
                        x = xgate_variant(v)
                        if x is not None:
                            out.add(x)
    return sorted(out, key=lambda c: (c.num_slices, c.bm, c.sq_xblocks, c.push_maxima, c.push_partials))


def wide_configs() -> list[Config]:
    """The prebuilt wide self_quant builds: the twin of every default self_quant build of rank 64
    and without adapter, with each push combination (the builds select() may return with
    EPILORA_K2_SQ_WIDE on, whatever EPILORA_K2_PUSH says)."""
    out = set()
    for _, _, _, widths, _ in projection_shapes():
        for bn in SELF_QUANT_TILES:
            for names in ((), ("maxima",), ("partials",), ("maxima", "partials")):
                for c in _select(tuple(widths), bn, 64, None, None, True, False, names):
                    w = wide_config(c) if c is not None else None
                    if w is not None:
                        out.add(w)
    return sorted(out, key=lambda c: (c.lora, c.num_slices, c.bm, c.push_maxima, c.push_partials))


def push_configs() -> list[Config]:
    """The prebuilt push variants: every combination of the flags on the decode path's default
    builds of rank 64 and without adapter, for the supported models' projections (the builds
    select() returns under EPILORA_K2_PUSH)."""
    out = set()
    for _, _, _, widths, _ in projection_shapes():
        for m in (1, 9, 17, 33):  # the token tiles 8 / 16 / 32, and 32 with token tiles
            for sq in ((False, True) if m <= max(SELF_QUANT_TILES) else (False,)):
                for c in select(widths, m, 64, self_quant=sq, push=""):
                    for names in (("maxima",), ("partials",), ("maxima", "partials")):
                        v = push_variant(c, names)
                        if v != c:
                            out.add(v)
    return sorted(out, key=lambda c: (c.lora, c.num_slices, c.bm, c.bn, c.self_quant, c.token_tiles, c.push_maxima,
                                      c.push_partials))


def select(widths, m: int, rank: int | None = None, ctas: int | None = None, stages: int | None = None,
           self_quant: bool = False, fused_h: bool = False, push=None, k: int | None = None, wide=None):
    """(adapter config or None, no-adapter config) for a projection with these slice widths.

    ctas / stages ask for an experimental build that tools/bench_stages.py times against the
    default (prebuilt for rank 64 and no adapter: the former default, one CTA per SM with 4
    stages, and one CTA per SM with 8 stages); without such a build the default is returned.
    self_quant: the builds that quantize x themselves (see self_quant_applies); fused_h: those that
    also compute h (the path "decode_fh"; the same tokens and K). push: the push variants
    (push_variant; None reads EPILORA_K2_PUSH, "" asks for none) of the default builds.
    k, wide: with self_quant and K given, the wide builds (Config.sq_xblocks) where they let m
    tokens of K run at a smaller split than the default builds (sq_wide_applies; wide None reads
    EPILORA_K2_SQ_WIDE). Callers then take the split from split_for(cfg, n, k, m).
    33..WIDE_MAX_TOKENS tokens (x_q given only): the bn 32 builds with token tiles.
    The ops call this once per decode launch: the answer is a pure function of the arguments and
    the environment's names, so it is cached on them (a few hundred keys at most)."""
    names = push_flags(push) if push is None or isinstance(push, str) else tuple(push)
    bn = token_tile(m)
    wm = None  # the wide builds' key: (tokens, K) where they are asked for
    if self_quant and not fused_h and k is not None and (sq_wide_enabled() if wide is None else wide):
        wm = (min(m, bn), k)
    tt = m > max(TOKEN_TILES)
    if tt and (self_quant or fused_h):
        raise ValueError(f"{m} tokens: the self-quantizing builds take 1..{max(SELF_QUANT_TILES)}")
    return _select(tuple(widths), bn, rank, ctas, stages, self_quant, fused_h, names, wm, tt)


@functools.lru_cache(maxsize=4096)
def _select(widths: tuple, bn: int, rank, ctas, stages, self_quant: bool, fused_h: bool, push: tuple,
            wide_mk: tuple | None = None, tt: bool = False):
    bm = bm_for(widths)
    if tt:  # the token-tile builds: defaults only (no experiment builds of them)
        kw = dict(token_tiles=True)
        lora = default_config(bn, bm, lora=True, num_slices=len(widths), rank=rank, **kw) if rank else None
        return push_variant(lora, push), push_variant(default_config(bn, bm, lora=False, **kw), push)
    if self_quant or fused_h:
        fh = dict(fused_h=True) if fused_h else {}
        pair = ((default_config(bn, bm, lora=True, num_slices=len(widths), rank=rank, self_quant=True, **fh)
                 if rank else None), default_config(bn, bm, lora=False, self_quant=True))
        if fused_h:
            return pair
        if wide_mk is not None:
            pair = tuple(_wide_or(c, sum(widths), *wide_mk) for c in pair)
        return tuple(push_variant(c, push) for c in pair)

    def pick(**kw):
        default = default_config(bn, bm, **kw)
        if ctas is None and stages is None:  # the decode path's per-call case: no set lookup
            return default
        want = Config(bn=bn, bm=bm, ctas=ctas or default.ctas, stages=stages or default.stages, **kw)
        return want if want in _experiment_builds() else default

    lora = pick(lora=True, num_slices=len(widths), rank=rank) if rank else None
    if ctas is None and stages is None:
        return push_variant(lora, push), push_variant(pick(lora=False), push)
    return lora, pick(lora=False)


@functools.lru_cache(maxsize=1)
def _experiment_builds() -> frozenset:
    defaults = {default_config(c.bn, c.bm, **_kw(c)) for c in prebuild_configs()}
    return frozenset(c for c in prebuild_configs()
                     if c not in defaults and not (c.push_maxima or c.push_partials))


def _kw(c: Config) -> dict:
    return dict(lora=c.lora, num_slices=c.num_slices, rank=c.rank) if c.lora else dict(lora=False)


def configs_for(widths) -> list[Config]:
    return sorted({c for bn in TOKEN_TILES for r in RANKS for c in select(widths, bn, r)},
                  key=lambda c: (c.lora, c.bn, c.rank))


# Decode-path shapes: (name, N slices, K) per projection, full model and 2-way TP shard.
MODELS = {
    "qwen3-8b": dict(hidden=4096, q=4096, kv=1024, inter=12288),
    "llama-3.1-8b": dict(hidden=4096, q=4096, kv=1024, inter=14336),
    "qwen2.5-72b": dict(hidden=8192, q=8192, kv=1024, inter=29568),
}


def projection_shapes(tp_values=(1, 2)):
    """[(model, tp, proj, slice widths, K)] for qkv, o, gate_up, down."""
    out = []
    for name, m in MODELS.items():
        for tp in tp_values:
            h, q, kv, it = m["hidden"], m["q"] // tp, m["kv"] // tp, m["inter"] // tp
            out += [
                (name, tp, "qkv", (q, kv, kv), h),
                (name, tp, "o", (h,), m["q"] // tp),
                (name, tp, "gate_up", (it, it), h),
                (name, tp, "down", (h,), it),
            ]
    return out


RANKS = (8, 16, 32, 64, 128, 256)
TOKEN_TILES = (8, 16, 32)
# The decode pair's token limit: up to 32 one token tile; 33..64 the bn 32 builds with token tiles
# (Config.token_tiles: two tiles, the second reading the weights from L2; docs/perf.md v0.85).
WIDE_MAX_TOKENS = 64
SELF_QUANT_TILES = (8,)  # token tiles with self-quantizing builds (1..8 tokens)


def self_quant_applies(m: int, k: int) -> bool:
    """Whether the self-quantizing K2 takes m tokens of K: a token tile it is built for, K a
    multiple of 128 and split <= 16 enough for sq_kblocks k-blocks per CTA."""
    if not 1 <= m <= max(SELF_QUANT_TILES) or k % 128 or token_tile(m) not in SELF_QUANT_TILES:
        return False
    return min_split(Config(bn=token_tile(m), lora=False, self_quant=True), k) <= 16


def bm_for(widths) -> int:
    return 128 if all(wd % 128 == 0 for wd in widths) else 64


def prebuild_configs() -> list[Config]:
    """Every K2 configuration the decode path may launch for the supported models."""
    cfgs = set()
    for _, _, _, widths, _ in projection_shapes():
        bm = bm_for(widths)
        for bn in TOKEN_TILES:
            cfgs.add(default_config(bn, bm, lora=False))
            for r in RANKS:
                cfgs.add(default_config(bn, bm, lora=True, num_slices=len(widths), rank=r))
            # Experiments timed against the default by tools/bench_stages.py (the no-adapter kernel
            # and rank 64, where they fit): the former default (one CTA per SM, 4 stages) and one
            # CTA per SM with 8 stages (128 KiB of weights in flight per SM).
            for kw in (dict(ctas=1, stages=4), dict(ctas=1, stages=8)):
                for c in (Config(bn=bn, bm=bm, lora=False, **kw),
                          Config(bn=bn, bm=bm, lora=True, num_slices=len(widths), rank=64, **kw)):
                    if c.fits_ctas() and c.smem_bytes() <= 227 * 1024:
                        cfgs.add(c)
        # 33..64 tokens: the bn 32 builds with token tiles.
        cfgs.add(default_config(32, bm, lora=False, token_tiles=True))
        for r in RANKS:
            cfgs.add(default_config(32, bm, lora=True, num_slices=len(widths), rank=r, token_tiles=True))
        # The self-quantizing builds (1..8 tokens).
        for bn in SELF_QUANT_TILES:
            cfgs.add(default_config(bn, bm, lora=False, self_quant=True))
            for r in RANKS:
                cfgs.add(default_config(bn, bm, lora=True, num_slices=len(widths), rank=r, self_quant=True))
                cfgs.add(default_config(bn, bm, lora=True, num_slices=len(widths), rank=r, self_quant=True,
                                        fused_h=True))
    cfgs.update(sweep_configs())
    cfgs.update(trace_configs())
    cfgs.update(early_configs())
    cfgs.update(rowmax_configs())
    cfgs.update(push_configs())
    cfgs.update(wide_configs())
    cfgs.update(xgate_configs())
    return sorted(cfgs, key=lambda c: (c.lora, c.num_slices, c.bm, c.bn, c.rank, c.ctas, c.stages, c.trace,
                                       c.token_tiles, c.fused_h, c.push_maxima, c.push_partials, c.sq_xblocks,
                                       c.xgate))


def early_configs() -> list[Config]:
    """tools/bench_stages.py's `decode_e1` builds: the decode path's rank-64 builds of bn 8 with one
    weight stage requested before x_q (Config.early) instead of all four."""
    return [default_config(8, 128, lora=True, num_slices=ns, rank=64, early=1) for ns in (1, 2, 3)]


def rowmax_configs() -> list[Config]:
    """tools/bench_stages.py's `decode_sqr` / `k2_sqr` builds: the self-quantizing rank-64 builds of
    bn 8 (bm 128, 1..3 slices) and the no-adapter one with Config.sq_rowmax (the maxima over the
    whole rows, no cluster exchange, at M * K <= ROWMAX_ELEMS)."""
    return ([default_config(8, 128, lora=True, num_slices=ns, rank=64, self_quant=True, sq_rowmax=True)
             for ns in (1, 2, 3)] + [default_config(8, 128, lora=False, self_quant=True, sq_rowmax=True)])


def trace_configs() -> list[Config]:
    """The timeline builds tools/bench_timeline.py launches: the decode path's rank-64 adapter builds
    of bn 8 (1..8 tokens) for 1, 2 and 3 slices (bm 128: the Qwen3-8B projections), x_q given,
    self-quantizing, and self-quantizing with h computed inside (decode_fh); x_q given at bn 16 and
    32 (9..32 tokens, where only the shrink + K2 pair applies)."""
    return ([default_config(8, 128, lora=True, num_slices=ns, rank=64, trace=True, self_quant=sq)
             for ns in (1, 2, 3) for sq in (False, True)]
            + [default_config(bn, 128, lora=True, num_slices=ns, rank=64, trace=True)
               for bn in (16, 32) for ns in (1, 2, 3)]
            + [default_config(8, 128, lora=True, num_slices=ns, rank=64, trace=True, self_quant=True, fused_h=True)
               for ns in (1, 2, 3)])


def sweep_configs() -> list[Config]:
    """No-adapter one-token builds that tools/bench_k2sweep.py times against each other: the
    pipeline depth (bytes in flight per SM), the weight rows per CTA and CTAs per SM."""
    out = []
    for bm, depths in ((128, (4, 6, 8, 12)), (64, (4, 8, 16))):
        for stages in depths:
            for ctas in (1, 2):
                c = Config(bn=8, bm=bm, stages=stages, lora=False, ctas=ctas)
                if c.fits_ctas() and c.smem_bytes() <= 227 * 1024:
                    out.append(c)
    return out
