"""K2 for large batches (issue 4, 33..16384 tokens): y = x_q.s_x.(W_q.s_w)^T + sum_s h_s.B_s^T,
Hopper, CuTe-DSL. A generalization of the decode K2 (kernels_dsl/k2_gemm.py, GPU-verified) to many
token tiles; its structure, helpers and verified fixes are kept.

Swap-AB, as in the decode K2: the FP8 weight rows are WGMMA's M side (bm = 128, or 64 for slice
widths that are not multiples of 128), the tokens its N side (bn = 64 or 128 tokens per CTA). Grid
(T, N/bm, 1) with T = ceil(M/bn); the CTA's (token tile, weight tile) comes from its linear id
blockIdx.x + T.blockIdx.y (the hardware's dispatch order) through a grouped rasterization
(cta_tile(), `group` a launch-time scalar): groups of `group` token tiles sweep all weight tiles,
token tile fastest, so the CTAs sharing one weight tile run together and all but the first read it
from L2. group = T (the default while M.K fits l2_group()'s budget) is plain token-tile-fastest
order; for larger M.K (e.g. down at K = 12288, M = 8192: 100 MB of x_q) a smaller group keeps
the group's x_q tiles in L2 instead of streaming all of x_q from DRAM once per weight-tile wave.
No split-K and no cluster: at M >= 33 there are enough CTAs to fill the GPU.

Token order. Tile t covers the adapter-sorted positions [t.bn, (t+1).bn) of
meta.token_indices_sorted_by_lora_ids, so it meets a few contiguous adapter groups. TMA cannot
gather rows, so the activations must be *stored* in sorted order: the kernel takes
x_q_sorted [M, K] e4m3 and s_x_sorted [M] fp32 (row p = token token_indices_sorted[p]). The caller
provides them: K1 (kernels_dsl/k1_shrink.py, sorted_codes=True) stores its codes/scales rows in
sorted order (v0.69; before, a gather ran in between: sort_activations() below, still there for
codes from elsewhere).
h stays in K1's layout [S, M, R] fp32, original token order (the epilogue gathers it by token).
The output is scattered by row: y[token_indices_sorted[p], n0 + r], coalesced along the features.

Warp specialization: 384 threads. Warpgroup 0 is the producer (setmaxnreg.dec 40; warp 0 runs it
with all 32 lanes: a DSL TMA copy elects its lane with elect.sync over the full warp, under
`if lane == 0` it deadlocks; mbarrier.arrive.expect_tx is under elect_one()). Warpgroups 1 and 2
are the WGMMA consumers (setmaxnreg.inc 232): with bm = 128 each takes 64 weight rows x all bn
tokens (atom layout (2,1,1)), with bm = 64 each takes the 64 rows x bn/2 tokens (atom layout
(1,2,1)). Register budget per consumer thread: bm.bn/256 fp32 for each of acc, acc_blk (the
promotion block) and acc_lora: 64 each for 128 x 128, so at most 128 live at a time (acc_blk dies
with the main loop) -- one consumer warpgroup would need 3 x 128 = 384 at bn = 128, which does
not fit 232. Pool: 128 x (40 + 2 x 232) = 64512 <= 65536; the kernel is built with
`.minnctapersm 1` (min_blocks_per_mp=1) so that ptxas gives the launch 168 registers per thread
(168 x 384 = 64512): the launch pool then holds the setmaxnreg targets (the first H200 hang of the
decode K2 was exactly this).

Main loop: `stages` smem stages of W[bm, 128] + x_q[bn, 128] (TMA, 128-byte swizzle, layouts from
sm90_utils.make_smem_layout_a/b), full/empty mbarriers per stage. FP8 WGMMA accumulation is
promoted to fp32 per 128-deep k-block: a fresh accumulator per block (ACCUMULATE False on the
first k32 step), then acc += acc_blk on the CUDA cores (the decode K2's H200 fix).

Adapter epilogue (Config.lora): items = (adapter group g overlapping the tile's sorted range, rank
chunk c) for g < num_active with active_lora_ids[g] >= 0 and
[lora_token_start_loc[g], lora_token_start_loc[g+1]) meeting [p0, p0 + bn), c < ceil(r_eff/RC)
(r_eff = clamp(slot_ranks[slot], 0, R), RC = max(16, min(R, 64))). For each item the consumers
build hmask[j, :] = bf16(h[slice, token(p0+j), chunk]) for the positions of group g in the tile
and 0 elsewhere, and run a bf16 WGMMA acc_lora[bm, bn] += B_chunk[bm, RC] . hmask^T; k16 steps
beyond the slot's effective rank are skipped. B chunks (vLLM's B_s[L, 1, n_s, R] viewed as
[L.n_s, R]) come by TMA into a ring of b_bufs buffers, the first ones requested right after the
first weight stages. No griddepcontrol.wait: K1 has finished before (K2 is launched without PDL).
Config.pdl = True builds the PDL variant (producer: griddepcontrol.wait before its first x_q load;
consumer: before it reads s_x or h) -- compiled and checked, not prebuilt.

Output: partial = acc.s_x[p].s_w + acc_lora goes to an fp32 smem tile [bm, bn] (padded columns:
conflict-free both ways) that reuses the pipeline stages (dead after the main loop; a
consumer-wide named barrier orders the last WGMMA reads before the overwrite), then the 256
consumer threads store bf16 y[token(p), n0 + r] with r fastest. Every y element of a token is
written exactly once, by one CTA, in a fixed summation order: bitwise reproducible.
"""

from __future__ import annotations

import functools
import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

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

FAMILY = "k2_fp8_prefill"
RUNTIME_CONTRACT = True

THREADS = 384  # warpgroup 0: producer, warpgroups 1-2: consumers
CONSUMER_THREADS = 256
PRODUCER_REGS = 40
CONSUMER_REGS = 232  # 128 x (40 + 2 x 232) = 64512 <= 65536 (168 x 384 at launch)
RED_PAD = 4  # fp32 words of padding per token column of the output tile (bank spread)
OUT_PAD = 8  # bf16 of padding per token row of the persistent builds' output tile (bank spread)
SMEM_LIMIT = 227 * 1024  # the opt-in maximum dynamic smem of an H100/H200 CTA
# 16384: vLLM's chunked prefill steps of the e2e setup (max_num_batched_tokens); y / x_q offsets
# stay far below 2^31 (16384 x 24576).
M_MIN, M_MAX = 33, 16384
# A third mode, "fast" (one tensor-core sum over all of K, CUTLASS's FP8FastAccum), was measured
# in run25 and removed: within 1.5 % of "overlap" and up to 18 % off on rows whose products add
# up (K = 12288), where the promotion stays within the reference's tolerance (perf.md v0.60).
ACCUM_MODES = ("serial", "overlap")


class Build(NamedTuple):
    """The main-loop and output choices of a build (Config's accum / vstore / persistent / stages)."""

    accum: str = "overlap"
    vstore: bool = True
    persistent: bool = False
    stages: int = 4

    def tag(self) -> str:
        return (f"{self.accum}{'_vs' if self.vstore else ''}{'_pers' if self.persistent else ''}"
                f"{f'_st{self.stages}' if self.stages != 4 else ''}")

    def config_kw(self) -> dict:
        return dict(accum=self.accum, vstore=self.vstore, persistent=self.persistent, stages=self.stages)


# The builds the bench and the GPU tests compare (bit for bit): serial with scalar stores (the
# kernel before v0.60), "overlap" with either store and the persistent "overlap" build
# (v0.65/v0.66). Measured and removed again (docs/perf.md): the W-multicast build (v0.67, 6 %
# slower; not shared-memory or L2 bound, call 10) and the six-stage build (v0.68, within ±3.6 %).
MAIN_LOOP_BUILDS = (Build("serial", False), Build("overlap", False), Build("overlap", True),
                    Build("overlap", True, True))
# The persistent build (v0.65): two k-blocks in flight with the stage taken at run time, 16-byte
# stores.
PERSISTENT_BUILD = Build("overlap", True, True)
# The build the op's prefill path launches (ops._prefill_path), prebuilt for every rank: run25's
# fastest (2048 tokens: 683 µs per layer against serial's 804); its scalar-store twin
# (vstore=False) serves an output whose rows are not 16-byte aligned.
OP_BUILD = Build("overlap", True)
OP_ACCUM, OP_VSTORE = OP_BUILD.accum, OP_BUILD.vstore

# Named barriers (id 0 is __syncthreads).
_BAR_HMASK = 1
_BAR_EPI = 2


@dataclass(frozen=True)
class Config:
    """Compile-time choices of one prefill K2 kernel.

    bn: token tile (WGMMA N side) 64 or 128.
    bm: weight rows per CTA (128, or 64 when a slice width is not a multiple of 128).
    bk: FP8 K elements per pipeline stage (128 = one 128-byte swizzle row).
    stages: depth of the weight/activation pipeline.
    lora: adapter epilogue; False = the no-adapter variant.
    num_slices: output slices of the projection (qkv: 3, gate/up: 2), lora only.
    rank: the adapter buffers' rank R (vLLM's max_lora_rank), lora only.
    b_bufs: smem ring of B chunks (each bm x min(R, 64) bf16).
    pdl: build with griddepcontrol.wait (PDL dependent of the kernel producing x_q / s_x / h).
    accum: how the main loop sums the FP8 products (ACCUM_MODES):
      "serial"  each 128-deep k-block a fresh tensor-core sum, waited for, then added to the fp32
                accumulator on the CUDA cores (the tensor cores idle during the wait and the add);
      "overlap" the same sums in the same order (bit for bit "serial"'s result), two k-blocks in
                flight: block i+1's WGMMAs run while block i is added (one more accumulator).
    vstore: the output tile leaves as 16-byte stores (8 features of one token per thread and
      instruction) instead of one bf16 per thread and instruction; needs y's rows 16-byte aligned.
    persistent: one CTA per SM walks the tile list (launch(): grid = min(tiles, SMs)); the
      producer's stage ring and B ring run on across tiles, the output tile has its own bf16
      buffer, so the next tile's stages stream in during this tile's epilogue (v0.65). Needs
      vstore (an unaligned output takes the one-tile scalar-store build) and no PDL.
    """

    bn: int = 128
    bm: int = 128
    bk: int = 128
    stages: int = 4
    lora: bool = True
    num_slices: int = 1
    rank: int = 64
    b_bufs: int = 2
    pdl: bool = False
    accum: str = "serial"
    vstore: bool = False
    persistent: bool = False

    def __post_init__(self):
        if self.accum not in ACCUM_MODES:
            raise ValueError(f"accum must be one of {ACCUM_MODES}")
        if self.bn not in (64, 128):
            raise ValueError("bn must be 64 or 128")
        if self.bm not in (64, 128):
            raise ValueError("bm must be 64 or 128")
        if self.bk != 128:
            raise ValueError("bk must be 128")
        if not 2 <= self.stages <= 8:
            raise ValueError("stages must be 2..8")
        if self.accum == "overlap" and self.stages % 2:
            raise ValueError("the overlap main loop alternates two accumulators per stage: stages must be even")
        if self.persistent and (self.pdl or not self.vstore):
            # (an output whose rows are not 16-byte aligned takes the one-tile scalar-store build)
            raise ValueError("the persistent builds store 16-byte vectors and are launched without PDL")
        if self.lora:
            if self.rank not in (8, 16, 32, 64, 128, 256):
                raise ValueError("rank must be 8..256, a power of two")
            if not 1 <= self.num_slices <= 4:
                raise ValueError("num_slices must be 1..4")
            if self.b_bufs < 1:
                raise ValueError("b_bufs must be >= 1")

    @property
    def rank_chunk(self) -> int:
        # bf16 WGMMA needs K >= 16: rank 8 uses a 16-wide chunk, TMA zero-fills columns 8..15.
        return max(16, min(self.rank, 64))

    @property
    def atom_layout(self) -> tuple[int, int, int]:
        """How the two consumer warpgroups split the bm x bn tile."""
        return (2, 1, 1) if self.bm == 128 else (1, 2, 1)

    @property
    def mma_n(self) -> int:
        """N of each WGMMA instruction (tokens per consumer warpgroup)."""
        return self.bn if self.bm == 128 else self.bn // 2

    def name(self) -> str:
        s = f"bm{self.bm}_bn{self.bn}_bk{self.bk}_st{self.stages}"
        if self.lora:
            s += f"_lora_s{self.num_slices}_r{self.rank}_nb{self.b_bufs}"
        else:
            s += "_nolora"
        s += "" if self.accum == "serial" else f"_{self.accum}"
        s += "_vs" if self.vstore else ""
        s += "_pers" if self.persistent else ""
        return s + ("_pdl" if self.pdl else "")

    @property
    def consumer_regs(self) -> int:
        return CONSUMER_REGS

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    def acc_regs(self) -> dict:
        """fp32 registers per consumer thread for each accumulator (acc, acc_blk, acc_lora)."""
        per = self.bm * self.bn // CONSUMER_THREADS
        blk = {"serial": per, "overlap": 2 * per}[self.accum]
        return dict(acc=per, acc_blk=blk, acc_lora=per if self.lora else 0,
                    peak=per + blk)  # acc_blk dies with the main loop, acc_lora is born after it

    @property
    def build(self) -> Build:
        return Build(self.accum, self.vstore, self.persistent, self.stages)

    @property
    def tile_bufs(self) -> int:
        """Copies of the per-tile token indices / scales in smem: the persistent builds write the
        next tile's while the last tile's stores still read theirs."""
        return 2 if self.persistent else 1

    def stage_union_bytes(self) -> int:
        """The first smem buffer: weight stages, reused for the fp32 output tile afterwards (not
        in the persistent builds: the next tile's stages load during the epilogue)."""
        if self.persistent:
            return self.bm * self.bk * self.stages
        return max(self.bm * self.bk * self.stages, (self.bm + RED_PAD) * self.bn * 4)

    def out_tile_elems(self) -> int:
        """bf16 elements of the persistent builds' output tile: bn token rows of bm + OUT_PAD."""
        return self.bn * (self.bm + OUT_PAD)

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the kernel's smem struct, field by field."""
        st, nb, bn, tb = self.stages, self.b_bufs, self.bn, self.tile_bufs
        f = [(8 * st, 8), (8 * st, 8), (4 * bn * tb, 4), (4 * bn * tb, 4), (8 * nb, 8), (8 * nb, 8)]
        if self.persistent:
            f += [(4 * st, 4)]  # the tile id posted with each tile's first stage
        f += [(self.stage_union_bytes(), 1024), (bn * self.bk * st, 1024)]
        if self.lora:
            f += [(nb * self.bm * self.rank_chunk * 2, 1024), (bn * self.rank_chunk * 2, 1024)]
        if self.persistent:
            f += [(self.out_tile_elems() * 2, 1024)]
        return struct_size(f)


# ---------------------------------------------------------------------------------------------
# The kernel (defined only where the DSL is importable)
# ---------------------------------------------------------------------------------------------

if cute is not None:

    class _K2PrefillKernel:
        def __init__(self, cfg: Config):
            self.cfg = cfg
            self.bm, self.bn, self.bk = cfg.bm, cfg.bn, cfg.bk
            self.stages = cfg.stages
            self.rc = cfg.rank_chunk
            self.nb = cfg.b_bufs

        @cute.jit
        def __call__(self, w: cute.Tensor, xq: cute.Tensor, sx: cute.Tensor, sw: cute.Tensor,
                     y: cute.Tensor, tok_sorted: cute.Tensor, group: cutlass.Int32, stream: cuda.CUstream,
                     h: cute.Tensor = None, active_ids: cute.Tensor = None, num_active: cute.Tensor = None,
                     start_loc: cute.Tensor = None, slot_ranks: cute.Tensor = None,
                     slice_start: cute.Tensor = None, b0: cute.Tensor = None, b1: cute.Tensor = None,
                     b2: cute.Tensor = None, b3: cute.Tensor = None, tile_counter: cute.Tensor = None):
            # Flat arguments (no tuples): export_to_c, used by tools/capture, only takes flat ones.
            cfg = self.cfg
            fp8 = w.element_type
            tile_mnk = (self.bm, self.bn, self.bk)
            sW_layout = sm90_utils.make_smem_layout_a(utils.LayoutEnum.from_tensor(w), tile_mnk, fp8, self.stages)
            sX_layout = sm90_utils.make_smem_layout_b(utils.LayoutEnum.from_tensor(xq), tile_mnk,
                                                      xq.element_type, self.stages)
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_w, mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, w, cute.slice_(sW_layout, (None, None, 0)), (self.bm, self.bk))
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
                lora_pack = (tuple(tma_bs), tuple(mBs), h, active_ids, num_active, start_loc, slot_ranks,
                             slice_start)
            else:
                # None, not an empty tuple: an empty tuple would still become a 1-byte parameter.
                lora_pack = None
                sB_layout = sW_layout
                sH_layout = sX_layout

            union_elems = cfg.stage_union_bytes()
            out_elems = cfg.out_tile_elems()
            bn = self.bn
            nb = self.nb
            stages = self.stages
            tb_bn = bn * cfg.tile_bufs

            @cute.struct
            class Storage:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sSx: cute.struct.MemRange[cutlass.Float32, tb_bn]
                sTok: cute.struct.MemRange[cutlass.Int32, tb_bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                # Weight stages; after the main loop, the fp32 output tile (not persistent).
                sW: cute.struct.Align[cute.struct.MemRange[fp8, union_elems], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]

            @cute.struct
            class StorageLora:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sSx: cute.struct.MemRange[cutlass.Float32, tb_bn]
                sTok: cute.struct.MemRange[cutlass.Int32, tb_bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                sW: cute.struct.Align[cute.struct.MemRange[fp8, union_elems], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sB_layout)], 1024]
                sH: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sH_layout)], 1024]

            # The persistent builds: the same fields, then their own bf16 output tile.
            @cute.struct
            class StoragePers:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sSx: cute.struct.MemRange[cutlass.Float32, tb_bn]
                sTok: cute.struct.MemRange[cutlass.Int32, tb_bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                sLin: cute.struct.MemRange[cutlass.Int32, stages]  # tile ids (_persistent_kernel)
                sW: cute.struct.Align[cute.struct.MemRange[fp8, union_elems], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, out_elems], 1024]

            @cute.struct
            class StorageLoraPers:
                full: cute.struct.MemRange[cutlass.Int64, stages]
                empty: cute.struct.MemRange[cutlass.Int64, stages]
                sSx: cute.struct.MemRange[cutlass.Float32, tb_bn]
                sTok: cute.struct.MemRange[cutlass.Int32, tb_bn]
                bfull: cute.struct.MemRange[cutlass.Int64, nb]
                bempty: cute.struct.MemRange[cutlass.Int64, nb]
                sLin: cute.struct.MemRange[cutlass.Int32, stages]  # tile ids (_persistent_kernel)
                sW: cute.struct.Align[cute.struct.MemRange[fp8, union_elems], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sX_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sB_layout)], 1024]
                sH: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sH_layout)], 1024]
                sOut: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, out_elems], 1024]

            if cutlass.const_expr(cfg.lora and cfg.persistent):
                self.storage = StorageLoraPers
            elif cutlass.const_expr(cfg.lora):
                self.storage = StorageLora
            elif cutlass.const_expr(cfg.persistent):
                self.storage = StoragePers
            else:
                self.storage = Storage
            self.smem_size = self.storage.size_in_bytes()

            n_tiles = cute.size(w, mode=[0]) // self.bm
            t_tiles = (cute.size(xq, mode=[0]) + self.bn - 1) // self.bn
            # (The launcher takes the grid from launch(): persistent builds run min(tiles, SMs)
            # CTAs along x and read their tile stride from gridDim.)
            self.kernel(
                tma_w, mW, tma_x, mX, sx, sw, y, tok_sorted, group, tile_counter, lora_pack, sW_layout, sX_layout, sB_layout, sH_layout,
            ).launch(grid=(t_tiles, n_tiles, 1), block=(THREADS, 1, 1), cluster=(1, 1, 1), stream=stream,
                     # .minnctapersm 1: ptxas gives the launch 168 registers per thread, a pool of
                     # 384 x 168 = 128 x (40 + 2 x 232); at ptxas's own count setmaxnreg.inc would
                     # wait forever (the decode K2's first H200 hang).
                     min_blocks_per_mp=1)

        # -----------------------------------------------------------------------------------------
        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                   mSx: cute.Tensor, mSw: cute.Tensor, mY: cute.Tensor, mTokS: cute.Tensor, group: cutlass.Int32,
                   mCounter, lora_pack, sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
                   sB_layout: cute.ComposedLayout, sH_layout: cute.ComposedLayout):
            if cutlass.const_expr(self.cfg.persistent):
                self._persistent_kernel(tma_w, mW, tma_x, mX, mSx, mSw, mY, mTokS, group, mCounter, lora_pack,
                                        sW_layout, sX_layout, sB_layout, sH_layout)
            else:
                self._tile_kernel(tma_w, mW, tma_x, mX, mSx, mSw, mY, mTokS, group, lora_pack,
                                  sW_layout, sX_layout, sB_layout, sH_layout)

        @cute.jit
        def _tile_kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                         mSx: cute.Tensor, mSw: cute.Tensor, mY: cute.Tensor, mTokS: cute.Tensor, group: cutlass.Int32,
                         lora_pack, sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
                         sB_layout: cute.ComposedLayout, sH_layout: cute.ComposedLayout):
            """One CTA per (token tile, weight tile), the grid in the hardware's dispatch order."""
            cfg = self.cfg
            BM, BN, BK, NB, STAGES = self.bm, self.bn, self.bk, self.nb, self.stages
            if cutlass.const_expr(cfg.lora):
                tma_bs, mBs, mH, mActive, mNumActive, mStart, mSlotRanks, mSliceStart = lora_pack
            # Built here, not passed: a TiledMma kernel argument becomes a 1-byte dummy parameter.
            kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
            tiled_mma = self._fp8_mma()
            tiled_mma_l = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, cfg.atom_layout,
                tiler_mn=(64, cfg.mma_n))

            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = warp_idx // 4
            # Grouped rasterization (see cta_tile()): groups of `group` token tiles sweep all weight
            # tiles, token tile fastest; group = T is plain token-tile-fastest order.
            bx, by, _ = cute.arch.block_idx()
            gdim = cute.arch.grid_dim()
            ttile, tile = self._tile_of(bx + by * gdim[0], gdim[0], gdim[1], group)
            n0 = tile * BM
            p0 = ttile * BN

            K = cute.size(mW, mode=[1])
            M = cute.size(mX, mode=[0])
            nk = (K + BK - 1) // BK
            valid = cutlass.min(M - p0, BN)

            smem = cutlass.utils.SmemAllocator()
            st = smem.allocate(self.storage)
            full = st.full.data_ptr()
            empty = st.empty.data_ptr()
            sSx = st.sSx.get_tensor(cute.make_layout(BN))
            sTok = st.sTok.get_tensor(cute.make_layout(BN))
            bfull = st.bfull.data_ptr()
            bempty = st.bempty.data_ptr()
            sW = st.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
            sX = st.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)

            if tidx == 0:
                for i in cutlass.range_constexpr(STAGES):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, CONSUMER_THREADS)
                for i in cutlass.range_constexpr(NB):
                    cute.arch.mbarrier_init(bfull + i, 1)
                    cute.arch.mbarrier_init(bempty + i, CONSUMER_THREADS)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            # TMA views: (tile, k-block) of W, (token tile, k-block) of x_q_sorted.
            gW = cute.local_tile(mW, (BM, BK), (tile, None))
            gX = cute.local_tile(mX, (BN, BK), (ttile, None))
            tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
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
                if warp_idx == 0:
                    # The whole warp runs the producer: a TMA copy picks its issuing lane with
                    # elect.sync over the full warp, so all 32 lanes must reach it.
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                    npre = cutlass.min(nk, STAGES)
                    # 1. weights of the first stages (they depend on no previous kernel).
                    for i in cutlass.range(npre, unroll=1):
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(full + i, stage_bytes)
                        cute.copy(tma_w, tWg[(None, i)], tWs[(None, i)], tma_bar_ptr=full + i)
                    # 2. the adapter B chunks that fit the ring, 3. x_q of the first stages. The B
                    # chunks' group scan is a chain of metadata loads: without PDL it goes after
                    # the x_q requests (the main loop needs those first); with PDL before the
                    # wait (x_q_sorted comes from the previous grid, B and the metadata do not).
                    if cutlass.const_expr(cfg.lora and cfg.pdl):
                        self._issue_b(0, NB, tma_bs, mBs, st, sB_layout, bfull, bempty, mActive, mNumActive,
                                      mStart, mSlotRanks, sl, row_in_slice, n_s, p0)
                    if cutlass.const_expr(cfg.pdl):
                        cute.arch.griddepcontrol_wait()
                    for i in cutlass.range(npre, unroll=1):
                        cute.copy(tma_x, tXg[(None, i)], tXs[(None, i)], tma_bar_ptr=full + i)
                    if cutlass.const_expr(cfg.lora and not cfg.pdl):
                        self._issue_b(0, NB, tma_bs, mBs, st, sB_layout, bfull, bempty, mActive, mNumActive,
                                      mStart, mSlotRanks, sl, row_in_slice, n_s, p0)
                    # 4. the steady state.
                    for i in cutlass.range(npre, nk, unroll=1):
                        s = i % STAGES
                        cute.arch.mbarrier_wait(empty + s, ((i // STAGES) + 1) % 2)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(full + s, stage_bytes)
                        cute.copy(tma_w, tWg[(None, i)], tWs[(None, s)], tma_bar_ptr=full + s)
                        cute.copy(tma_x, tXg[(None, i)], tXs[(None, s)], tma_bar_ptr=full + s)
                    # 5. the rest of the B chunks, as the consumers free buffers.
                    if cutlass.const_expr(cfg.lora):
                        self._issue_b(NB, 1 << 30, tma_bs, mBs, st, sB_layout, bfull, bempty, mActive,
                                      mNumActive, mStart, mSlotRanks, sl, row_in_slice, n_s, p0)
            else:
                # ==================================== consumers ====================================
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                ctid = tidx - 128
                # The tile's token indices (metadata: not produced by the previous kernel).
                if ctid < BN:
                    tk = cutlass.Int32(0)
                    if ctid < valid:
                        tk = mTokS[p0 + ctid]
                    sTok[ctid] = tk
                if cutlass.const_expr(not cfg.pdl):
                    self._load_sx(ctid, sSx, mSx, p0, valid)

                thr_mma = tiled_mma.get_slice(ctid)
                # The smem operands' partition depends only on the warpgroup: taken from a
                # warp-uniform index, their WGMMA descriptors can live in uniform registers
                # (from ctid, ptxas built them in vector registers and moved each one over with
                # R2UR before every WGMMA: run25's profile).
                thr_ab = tiled_mma.get_slice(cute.arch.make_warp_uniform((wg - 1) * 128))
                tCsW = thr_ab.partition_A(sW)
                tCsX = thr_ab.partition_B(sX)
                tCrW = tiled_mma.make_fragment_A(tCsW)
                tCrX = tiled_mma.make_fragment_B(tCsX)
                cC = cute.make_identity_tensor((BM, BN))
                tCcC = thr_mma.partition_C(cC)
                acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc.fill(0.0)
                num_kk = cute.size(tCrW, mode=[2])
                # What the main-loop helpers share (each block builds its own TiledMma).
                mma = (tCrW, tCrX, full, empty, num_kk)
                if cutlass.const_expr(cfg.accum == "serial"):
                    acc_blk = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                    for i in cutlass.range(nk, unroll=1):
                        self._issue_block(mma, acc_blk, i, False)
                        self._retire_block(mma, acc, acc_blk, i, 0)
                elif cutlass.const_expr(cfg.accum == "overlap"):
                    # Blocks alternate between two promotion accumulators; block i is retired
                    # (waited for, its stage released, added) after block i+1 is issued. The adds
                    # keep k-block order: the same fp32 sums as "serial". The loop is unrolled by
                    # the stage count (even): block i0 + u reads stage u and accumulator u % 2,
                    # both compile-time, so its WGMMA descriptors are constant offsets (with a
                    # runtime stage index every block rebuilt eight descriptors in vector
                    # registers and moved them to uniform ones: run25's profile, ~20 M extra
                    # instructions at gate_up x 2048 tokens).
                    bufs = (cute.make_rmem_tensor(tCcC.shape, cutlass.Float32),
                            cute.make_rmem_tensor(tCcC.shape, cutlass.Float32))
                    for i0 in cutlass.range(0, nk, STAGES, unroll=1):
                        for u in cutlass.range_constexpr(STAGES):
                            i = i0 + u
                            if i < nk:
                                self._issue_block(mma, bufs[u % 2], i, False, u)
                                if i > 0:
                                    self._retire_block(mma, acc, bufs[(u + 1) % 2], i - 1, 1)
                    if (nk - 1) % 2 == 0:
                        self._retire_block(mma, acc, bufs[0], nk - 1, 0)
                    else:
                        self._retire_block(mma, acc, bufs[1], nk - 1, 0)

                if cutlass.const_expr(cfg.pdl):
                    # s_x and h come from the previous grid.
                    cute.arch.griddepcontrol_wait()
                    self._load_sx(ctid, sSx, mSx, p0, valid)
                # sTok / sSx visible to all consumers; every consumer's last main-loop WGMMA has
                # read its stage before anyone overwrites the stages with the output tile.
                cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=CONSUMER_THREADS)

                acc_l = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc_l.fill(0.0)
                if cutlass.const_expr(cfg.lora):
                    self._lora_epilogue(ctid, acc_l, tiled_mma_l, st, sB_layout, sH_layout, bfull, bempty, sTok,
                                        mH, mActive, mNumActive, mStart, mSlotRanks, sl, p0)

                # partial = acc * s_x[p] * s_w (+ adapter) into the fp32 output tile (the stages).
                sRed = cute.make_tensor(cute.recast_ptr(st.sW.data_ptr(), dtype=cutlass.Float32),
                                        cute.make_layout((BM, BN), stride=(1, BM + RED_PAD)))
                s_w = mSw[0]
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, j = tCcC[i]
                    v = acc[i] * (sSx[j] * s_w)
                    if cutlass.const_expr(cfg.lora):
                        v = v + acc_l[i]
                    sRed[r, j] = v
                cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=CONSUMER_THREADS)
                # Row scatter to the original token order, coalesced along the features.
                if cutlass.const_expr(cfg.vstore):
                    # 8 features of one token per thread: two 16-byte smem loads (a token's column
                    # of the tile is contiguous), one rounding, one 16-byte store.
                    vpr = BM // 8
                    for e in cutlass.range(ctid, vpr * valid, CONSUMER_THREADS, unroll=1):
                        j = e // vpr
                        vec = e - j * vpr
                        r_c = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                        cute.autovec_copy(cute.zipped_divide(sRed[None, j], (8,))[None, vec], r_c)
                        r_o = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
                        r_o.store(r_c.load().to(cutlass.BFloat16))
                        cute.autovec_copy(r_o, cute.zipped_divide(mY[sTok[j], None], (8,))[None, n0 // 8 + vec])
                else:
                    n_el = BM * valid
                    for e in cutlass.range(ctid, n_el, CONSUMER_THREADS, unroll=1):
                        j = e // BM
                        r = e - j * BM
                        mY[sTok[j], n0 + r] = sRed[r, j].to(cutlass.BFloat16)

        # -----------------------------------------------------------------------------------------
        @cute.jit
        def _tile_of(self, lin, n_ttiles, n_wtiles, group):
            """(token tile, weight tile) of linear tile id lin: cta_tile()'s grouped rasterization."""
            per_group = group * n_wtiles
            grp = lin // per_group
            first = grp * group
            gsize = cutlass.min(n_ttiles - first, group)
            rem = lin - grp * per_group
            return first + rem % gsize, rem // gsize

        @cute.jit
        def _slice_of(self, n0, mSliceStart):
            """(slice, first row inside it, its width) of the weight rows at n0 (tiles never straddle
            slices)."""
            sl = cutlass.Int32(0)
            for i in cutlass.range_constexpr(1, self.cfg.num_slices):
                if n0 >= mSliceStart[i]:
                    sl = cutlass.Int32(i)
            return sl, n0 - mSliceStart[sl], mSliceStart[sl + 1] - mSliceStart[sl]

        @cute.jit
        def _persistent_kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
                               mSx: cute.Tensor, mSw: cute.Tensor, mY: cute.Tensor, mTokS: cute.Tensor,
                               group: cutlass.Int32, mCounter: cute.Tensor, lora_pack, sW_layout: cute.ComposedLayout,
                               sX_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
                               sH_layout: cute.ComposedLayout):
            """Persistent: CTA b starts on linear tile b (cta_tile()'s order); each later tile is
            claimed from the launch's tile counter (linear id gridDim.x + the counter's old value),
            so the tiles in flight stay a window of consecutive ids, as the one-tile grid's waves
            are (a static walk b, b + gridDim.x, ... drifted apart: +12 % per k-block at shapes
            that stream from DRAM, run26 call 5). The producer claims and posts each k-block's
            tile id in sLin beside the stage's full barrier; the consumers read it there, and an
            id past the last tile (posted with a barrier arrival and no bytes) ends their loop.
            The claim that gets the counter's last value (n_tiles - 1: every CTA's claims end
            with one that fails) re-arms the counter to 0 for the next launch. The stage ring and
            the B ring count globally (slot = count % depth, phase = count / depth % 2), so the
            producer streams the next tile's stages while the consumers run this tile's epilogue.
            The output tile has its own bf16 buffer; the tile's token indices and scales are
            double-buffered (the next tile's are written while the last tile's stores may still
            read theirs)."""
            cfg = self.cfg
            BM, BN, BK, NB, STAGES = self.bm, self.bn, self.bk, self.nb, self.stages
            if cutlass.const_expr(cfg.lora):
                tma_bs, mBs, mH, mActive, mNumActive, mStart, mSlotRanks, mSliceStart = lora_pack
            kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
            tiled_mma = self._fp8_mma()
            tiled_mma_l = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, kmaj, kmaj, cutlass.Float32, cfg.atom_layout,
                tiler_mn=(64, cfg.mma_n))

            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = warp_idx // 4
            bx, _, _ = cute.arch.block_idx()
            gdim = cute.arch.grid_dim()
            K = cute.size(mW, mode=[1])
            M = cute.size(mX, mode=[0])
            nk = (K + BK - 1) // BK
            n_ttiles = (M + BN - 1) // BN
            n_wtiles = cute.size(mW, mode=[0]) // BM
            n_tiles = n_ttiles * n_wtiles

            smem = cutlass.utils.SmemAllocator()
            st = smem.allocate(self.storage)
            full = st.full.data_ptr()
            empty = st.empty.data_ptr()
            sSx = st.sSx.get_tensor(cute.make_layout((BN, 2)))  # [position, tile parity]
            sTok = st.sTok.get_tensor(cute.make_layout((BN, 2)))
            bfull = st.bfull.data_ptr()
            bempty = st.bempty.data_ptr()
            sW = st.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
            sX = st.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
            sLin = st.sLin.get_tensor(cute.make_layout(STAGES))
            counter = mCounter.iterator.toint()

            if tidx == 0:
                for i in cutlass.range_constexpr(STAGES):
                    cute.arch.mbarrier_init(full + i, 1)
                    cute.arch.mbarrier_init(empty + i, CONSUMER_THREADS)
                for i in cutlass.range_constexpr(NB):
                    cute.arch.mbarrier_init(bfull + i, 1)
                    cute.arch.mbarrier_init(bempty + i, CONSUMER_THREADS)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            stage_bytes = BM * BK + BN * BK

            if wg == 0:
                # ===================================== producer ====================================
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                    lane = cute.arch.lane_idx()
                    it = cutlass.Int32(0)  # k-blocks issued so far (all tiles)
                    qb = cutlass.Int32(0)  # B chunks issued so far
                    lin = bx
                    while lin < n_tiles:
                        # Claim the next tile now; its id is needed only after this tile's stages.
                        claim = cutlass.Int32(0)
                        if lane == 0:
                            claim = D.atom_add_relaxed_gpu_s32(counter, 1)
                        ttile, tile = self._tile_of(lin, n_ttiles, n_wtiles, group)
                        gW = cute.local_tile(mW, (BM, BK), (tile, None))
                        gX = cute.local_tile(mX, (BN, BK), (ttile, None))
                        tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                        tXs, tXg = cute.nvgpu.cpasync.tma_partition(
                            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                        for i in cutlass.range(nk, unroll=1):
                            g = it + i
                            s = g % STAGES
                            # (a fresh barrier's phase "before 0" counts as complete: round 0 passes)
                            cute.arch.mbarrier_wait(empty + s, ((g // STAGES) + 1) % 2)
                            with cute.arch.elect_one():
                                sLin[s] = lin  # published by the arrival's release
                                cute.arch.mbarrier_arrive_and_expect_tx(full + s, stage_bytes)
                            cute.copy(tma_w, tWg[(None, i)], tWs[(None, s)], tma_bar_ptr=full + s)
                            cute.copy(tma_x, tXg[(None, i)], tXs[(None, s)], tma_bar_ptr=full + s)
                        it = it + nk
                        if cutlass.const_expr(cfg.lora):
                            n0 = tile * BM
                            sl, row_in_slice, n_s = self._slice_of(n0, mSliceStart)
                            qb = self._issue_b(0, 1 << 30, tma_bs, mBs, st, sB_layout, bfull, bempty, mActive,
                                               mNumActive, mStart, mSlotRanks, sl, row_in_slice, n_s, ttile * BN, qb)
                        if lane == 0:
                            if claim == n_tiles - 1:
                                # The launch's last claim (coherence order): no CTA reads the
                                # counter again in this launch.
                                D.st_relaxed_gpu_s32(counter, 0)
                        lin = gdim[0] + cute.arch.shuffle_sync(claim, 0)
                    # No tile left: post an id past the end with a bytes-less arrival on the next
                    # stage (once the consumers have released that stage's last round).
                    s = it % STAGES
                    cute.arch.mbarrier_wait(empty + s, ((it // STAGES) + 1) % 2)
                    with cute.arch.elect_one():
                        sLin[s] = n_tiles
                        cute.arch.mbarrier_arrive(full + s)
            else:
                # ==================================== consumers ====================================
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                ctid = tidx - 128
                thr_mma = tiled_mma.get_slice(ctid)
                thr_ab = tiled_mma.get_slice(cute.arch.make_warp_uniform((wg - 1) * 128))
                tCrW = tiled_mma.make_fragment_A(thr_ab.partition_A(sW))
                tCrX = tiled_mma.make_fragment_B(thr_ab.partition_B(sX))
                cC = cute.make_identity_tensor((BM, BN))
                tCcC = thr_mma.partition_C(cC)
                acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                acc_l = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
                bufs = (cute.make_rmem_tensor(tCcC.shape, cutlass.Float32),
                        cute.make_rmem_tensor(tCcC.shape, cutlass.Float32))
                num_kk = cute.size(tCrW, mode=[2])
                mma = (tCrW, tCrX, full, empty, num_kk)
                sOut = st.sOut.get_tensor(cute.make_layout((BN, BM + OUT_PAD), stride=(BM + OUT_PAD, 1)))
                s_w = mSw[0]
                it = cutlass.Int32(0)
                qc = cutlass.Int32(0)
                tcount = cutlass.Int32(0)
                lin = self._posted_tile(full, sLin, it)
                while lin < n_tiles:
                    ttile, tile = self._tile_of(lin, n_ttiles, n_wtiles, group)
                    n0 = tile * BM
                    p0 = ttile * BN
                    valid = cutlass.min(M - p0, BN)
                    par = tcount % 2
                    sTok_t = sTok[None, par]
                    sSx_t = sSx[None, par]
                    if ctid < BN:
                        tk = cutlass.Int32(0)
                        if ctid < valid:
                            tk = mTokS[p0 + ctid]
                        sTok_t[ctid] = tk
                    self._load_sx(ctid, sSx_t, mSx, p0, valid)

                    acc.fill(0.0)
                    # The WGMMAs name their accumulator registers as inputs even when they do not
                    # accumulate: without a fresh definition here the promotion blocks would stay
                    # live from the last tile's main loop through its epilogue (acc + acc_l + two
                    # blocks = 256 registers: 740 bytes of spills).
                    bufs[0].fill(0.0)
                    bufs[1].fill(0.0)
                    if cutlass.const_expr(cfg.accum == "serial"):
                        for i in cutlass.range(nk, unroll=1):
                            self._issue_block(mma, bufs[0], it + i, False)
                            self._retire_block(mma, acc, bufs[0], it + i, 0)
                    else:
                        # Two blocks in flight, as the one-tile build, but with the stage taken at
                        # run time (a tile starts wherever the ring stands): ptxas serialized every
                        # WGMMA (C7514) when this loop sat beside the one-tile build's compile-time
                        # stage loop (or replaced it) inside the tile loop (run26, perf.md v0.65).
                        for i0 in cutlass.range(0, nk, 2, unroll=1):
                            for u in cutlass.range_constexpr(2):
                                i = i0 + u
                                if i < nk:
                                    self._issue_block(mma, bufs[u], it + i, False)
                                    if i > 0:
                                        self._retire_block(mma, acc, bufs[(u + 1) % 2], it + i - 1, 1)
                        if (nk - 1) % 2 == 0:
                            self._retire_block(mma, acc, bufs[0], it + nk - 1, 0)
                        else:
                            self._retire_block(mma, acc, bufs[1], it + nk - 1, 0)
                    it = it + nk
                    # sTok / sSx of this tile visible; every consumer is past the last tile's reads of
                    # sOut.
                    cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=CONSUMER_THREADS)
                    if cutlass.const_expr(cfg.lora):
                        acc_l.fill(0.0)
                        sl, _, _ = self._slice_of(n0, mSliceStart)
                        qc = self._lora_epilogue(ctid, acc_l, tiled_mma_l, st, sB_layout, sH_layout, bfull, bempty,
                                                 sTok_t, mH, mActive, mNumActive, mStart, mSlotRanks, sl, p0, qc)
                    # partial = acc * s_x[p] * s_w (+ adapter), rounded to bf16 once, token-major.
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, j = tCcC[i]
                        v = acc[i] * (sSx_t[j] * s_w)
                        if cutlass.const_expr(cfg.lora):
                            v = v + acc_l[i]
                        sOut[j, r] = v.to(cutlass.BFloat16)
                    cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=CONSUMER_THREADS)
                    # Row scatter to the original token order: 8 features of one token per thread.
                    vpr = BM // 8
                    for e in cutlass.range(ctid, vpr * valid, CONSUMER_THREADS, unroll=1):
                        j = e // vpr
                        vec = e - j * vpr
                        r_o = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
                        cute.autovec_copy(cute.zipped_divide(sOut[j, None], (8,))[None, vec], r_o)
                        cute.autovec_copy(r_o, cute.zipped_divide(mY[sTok_t[j], None], (8,))[None, n0 // 8 + vec])
                    tcount = tcount + 1
                    lin = self._posted_tile(full, sLin, it)

        @cute.jit
        def _posted_tile(self, full, sLin, i):
            """Persistent consumers: the tile id the producer posted with k-block i (its stage's
            full barrier: the stage's bytes, or the end marker's bytes-less arrival)."""
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            return sLin[s]

        def _fp8_mma(self):
            kmaj = cute.nvgpu.warpgroup.OperandMajorMode.K
            return sm90_utils.make_trivial_tiled_mma(
                cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, kmaj, kmaj, cutlass.Float32, self.cfg.atom_layout,
                tiler_mn=(64, self.cfg.mma_n))

        @cute.jit
        def _issue_block(self, mma, acc_t, i, into_acc: cutlass.Constexpr, stage: cutlass.Constexpr = -1):
            """Consumers: wait for k-block i's stage and issue its WGMMAs into acc_t (a fresh sum,
            or, into_acc, added to acc_t's running sum), committed as one group. stage: i's stage
            when the caller knows it at compile time (i % stages), else -1."""
            tCrW, tCrX, full, _, num_kk = mma
            # A fresh TiledMma per block: its ACCUMULATE field is state that a set() inside this
            # (staged) body must not leak out of it (the DSL cannot thread attribute rebinds).
            tiled_mma = self._fp8_mma()
            s = i % self.stages
            if cutlass.const_expr(stage >= 0):
                s = stage
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            cute.nvgpu.warpgroup.fence()
            # acc starts zero-filled, so a running sum accumulates from its first block on.
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, into_acc)
            for kk in cutlass.range_constexpr(num_kk):
                cute.gemm(tiled_mma, acc_t, tCrW[(None, None, kk, s)], tCrX[(None, None, kk, s)], acc_t)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()

        @cute.jit
        def _release_stage(self, mma, i, pending: cutlass.Constexpr):
            """Consumers: wait until at most `pending` WGMMA groups are in flight (k-block i's is
            then complete) and hand its stage back to the producer."""
            empty = mma[3]
            cute.nvgpu.warpgroup.wait_group(pending)
            cute.arch.mbarrier_arrive(empty + i % self.stages)

        @cute.jit
        def _retire_block(self, mma, acc, acc_t, i, pending: cutlass.Constexpr):
            """_release_stage, then the promotion: k-block i's fresh sum added to acc in fp32."""
            self._release_stage(mma, i, pending)
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] + acc_t[e]

        @cute.jit
        def _load_sx(self, ctid, sSx, mSx, p0, valid):
            if ctid < self.bn:
                v = cutlass.Float32(0.0)
                if ctid < valid:
                    v = mSx[p0 + ctid]
                sSx[ctid] = v

        @cute.jit
        def _issue_b(self, q_lo, q_hi, tma_bs: tuple, mBs: tuple, st, sB_layout, bfull, bempty,
                     mActive, mNumActive, mStart, mSlotRanks, sl, row_in_slice, n_s, p0, q0=0):
            """Producer warp (all 32 lanes): TMA the B chunks of this tile's items with ordinals in
            [q_lo, q_hi). Ordinals count on from q0 (the persistent builds' ring runs across tiles);
            returns the ordinal after the tile's last item."""
            cfg = self.cfg
            BM, BN, RC, NB, R = self.bm, self.bn, self.rc, self.nb, cfg.rank
            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            q = cutlass.Int32(q0)  # item ordinal
            num_active = mNumActive[0]
            for g in cutlass.range(num_active, unroll=1):
                lid = mActive[g]
                glo = mStart[g]
                ghi = mStart[g + 1]
                if lid >= 0 and glo < p0 + BN and ghi > p0:
                    reff = cutlass.max(cutlass.min(mSlotRanks[lid], R), 0)
                    nch = (reff + RC - 1) // RC
                    for c in cutlass.range(nch, unroll=1):
                        if q >= q_lo and q < q_hi:
                            b = q % NB
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
            return q

        @cute.jit
        def _stage_hmask(self, ctid, sH, mH, sTok, sl, c, jlo, jhi):
            """sH[j, :] = bf16(h[sl, token(p0 + j), chunk c]) for the group's positions jlo <= j < jhi,
            0 elsewhere. Every thread issues all its 16-byte h loads first (unconditional, at clamped
            addresses), then selects and stores: a load inside the position test would make each
            wait for the one before (h is an L2 round trip: ~8 per thread at 128 x 64 per item, the
            decode K2's v0.45 lesson)."""
            BN, RC, R = self.bn, self.rc, self.cfg.rank
            vpr = RC // 4  # 16-byte vectors of h per token row of the chunk
            n_it = BN * vpr // CONSUMER_THREADS  # exact: BN * RC / 4 is 256 .. 2048
            loads = []
            for it in cutlass.range_constexpr(n_it):
                v = it * CONSUMER_THREADS + ctid
                j = v // vpr
                col = cutlass.min(c * RC + (v - j * vpr) * 4, R - 4)  # in bounds; masked below
                r_h = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
                cute.autovec_copy(cute.zipped_divide(mH[sl, sTok[j], None], (4,))[None, col // 4], r_h)
                loads.append(r_h)
            for it in cutlass.range_constexpr(n_it):
                v = it * CONSUMER_THREADS + ctid
                j = v // vpr
                rr = (v - j * vpr) * 4
                ok = j >= jlo and j < jhi and c * RC + rr < R
                h4 = loads[it].load()
                for e in cutlass.range_constexpr(4):
                    he = h4[e]
                    x = cutlass.Float32(0.0)
                    if ok:
                        x = he
                    sH[j, rr + e, 0] = x.to(cutlass.BFloat16)

        @cute.jit
        def _lora_epilogue(self, ctid, acc_l, tiled_mma_l, st, sB_layout, sH_layout, bfull, bempty, sTok,
                           mH, mActive, mNumActive, mStart, mSlotRanks, sl, p0, q0=0):
            """Consumers: acc_l += B_chunk . hmask^T for this tile's items, in item order. Item
            ordinals (the B ring's slots and phases) count on from q0; returns the next one."""
            cfg = self.cfg
            BN, RC, NB, R = self.bn, self.rc, self.nb, cfg.rank
            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sH = st.sH.get_tensor(sH_layout.outer, swizzle=sH_layout.inner)
            # Warp-uniform slice index, as for the main loop's operands (uniform descriptors).
            thr = tiled_mma_l.get_slice(cute.arch.make_warp_uniform(ctid // 128 * 128))
            tLrB = tiled_mma_l.make_fragment_A(thr.partition_A(sB))
            tLrH = tiled_mma_l.make_fragment_B(thr.partition_B(sH))
            tiled_mma_l.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            n_kk = cute.size(tLrB, mode=[2])
            q = cutlass.Int32(q0)
            num_active = mNumActive[0]
            for g in cutlass.range(num_active, unroll=1):
                lid = mActive[g]
                glo = mStart[g]
                ghi = mStart[g + 1]
                if lid >= 0 and glo < p0 + BN and ghi > p0:
                    reff = cutlass.max(cutlass.min(mSlotRanks[lid], R), 0)
                    nch = (reff + RC - 1) // RC
                    # The group's positions inside the tile: [jlo, jhi).
                    jlo = cutlass.max(glo - p0, 0)
                    jhi = cutlass.min(ghi - p0, BN)
                    for c in cutlass.range(nch, unroll=1):
                        b = q % NB
                        # hmask chunk: bf16(h) of this group's tokens, 0 elsewhere.
                        self._stage_hmask(ctid, sH, mH, sTok, sl, c, jlo, jhi)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=_BAR_HMASK, number_of_threads=CONSUMER_THREADS)
                        cute.arch.mbarrier_wait(bfull + b, (q // NB) % 2)
                        # k16 steps past the slot's effective rank multiply zeros: skip them.
                        n_steps = (cutlass.min(reff - c * RC, RC) + 15) // 16
                        cute.nvgpu.warpgroup.fence()
                        for kk in cutlass.range_constexpr(n_kk):
                            if kk < n_steps:
                                cute.gemm(tiled_mma_l, acc_l, tLrB[(None, None, kk, b)],
                                          tLrH[(None, None, kk, 0)], acc_l)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(bempty + b)
                        # sH is rewritten by the next item: everyone must be past this WGMMA.
                        cute.arch.barrier(barrier_id=_BAR_HMASK, number_of_threads=CONSUMER_THREADS)
                        q = q + 1
            return q


# ---------------------------------------------------------------------------------------------
# Runtime contract
# ---------------------------------------------------------------------------------------------


def _fake_args(cfg: Config):
    """Fake tensors with symbolic sizes, in the __call__ order."""
    f8, bf16, f32, i32 = cutlass.Float8E4M3FN, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    N = D.sym(cfg.bm)
    w = D.fake_rowmajor(f8, (N, D.sym(16)))
    xq = D.fake_rowmajor(f8, (D.sym(1), D.sym(16)))
    sx = D.fake_rowmajor(f32, (D.sym(1),), align=4)
    sw = D.fake_rowmajor(f32, (1,), align=4)
    y = D.fake_rowmajor(bf16, (D.sym(1), D.sym(8)))
    tok = D.fake_rowmajor(i32, (D.sym(1),), align=4)
    # The persistent builds' tile counter comes last in __call__ (after the lora arguments).
    tail = (D.fake_rowmajor(i32, (1,), align=4),) if cfg.persistent else ()
    if cfg.lora:
        bufs = tuple(D.fake_rowmajor(bf16, (D.sym(cfg.bm), cfg.rank)) for _ in range(cfg.num_slices))
        h = D.fake_rowmajor(f32, (cfg.num_slices, D.sym(1), cfg.rank))
        active = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        num_active = D.fake_rowmajor(i32, (1,), align=4)
        start_loc = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        slot_ranks = D.fake_rowmajor(i32, (D.sym(1),), align=4)
        slice_start = D.fake_rowmajor(i32, (cfg.num_slices + 1,), align=4)
        pad = (None,) * (4 - cfg.num_slices) if tail else ()
        return (w, xq, sx, sw, y, tok, cutlass.Int32(1), D.fake_stream(), h, active, num_active, start_loc, slot_ranks, slice_start,
                *bufs, *pad, *tail)
    pad = (None,) * 10 if tail else ()
    return (w, xq, sx, sw, y, tok, cutlass.Int32(1), D.fake_stream(), *pad, *tail)


def compile(config: Config, options: str = "--gpu-arch sm_90a"):
    """cute.compile of one configuration with fake tensors (no GPU needed). The result carries
    `epilora_smem_bytes`: the dynamic shared memory the launch needs."""
    return D.compile_with_smem(_K2PrefillKernel(config), _fake_args(config), options)


def params(config: Config) -> list:
    """The kernel's by-value parameters in launch order (epilora_cute.kernel_abi protocol)."""
    bm, bn, bk, rc = config.bm, config.bn, config.bk, config.rank_chunk
    f8, bf16, f32, i32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32
    p = [
        TmaParam("tma_w", TmaSpec(f8, (bk, bm)), "W_q [N, K] e4m3"),
        CoordParam("w_dims", 2),  # (N, K)
        TmaParam("tma_xq", TmaSpec(f8, (bk, bn)), "x_q_sorted [M, K] e4m3 (row p = token token_indices_sorted[p])"),
        CoordParam("xq_dims", 2),  # (M, K)
        TensorParam("s_x", f32, 1, dynamic_shape=(0,), align=4),  # [M] sorted
        TensorParam("s_w", f32, 1, align=4),  # [1]
        TensorParam("y", bf16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),  # [M, N] original order
        TensorParam("token_indices_sorted", i32, 1, dynamic_shape=(0,), align=4),  # [M]
        ScalarParam("group", "i"),  # token tiles per rasterization group, 1..T (l2_group())
    ]
    if config.persistent:
        # [1]: 0 before a launch; the launch claims tiles from it and leaves it 0 again
        p.append(TensorParam("tile_counter", i32, 1, align=4))
    if config.lora:
        sw = {16: "32B", 32: "64B", 64: "128B"}[rc]
        for s in range(config.num_slices):
            p.append(TmaParam(f"tma_b{s}", TmaSpec(bf16, (rc, bm), swizzle=sw),
                              f"B_{s} [max_loras, 1, n_{s}, R] viewed as [max_loras*n_{s}, R]"))
        for s in range(config.num_slices):
            p.append(CoordParam(f"b{s}_dims", 1))  # (max_loras*n_s,)
        p += [
            TensorParam("h", f32, 3, dynamic_shape=(1,), dynamic_stride=(0,), align=16),  # [slices, M, R]
            TensorParam("active_lora_ids", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras+1]
            TensorParam("num_active", i32, 1, align=4),  # [1]
            TensorParam("lora_token_start_loc", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras+2]
            TensorParam("slot_ranks", i32, 1, dynamic_shape=(0,), align=4),  # [max_loras]
            TensorParam("slice_start", i32, 1, align=4),  # [num_slices+1]: 0, n_0, n_0+n_1, ..., N
        ]
    return p


def sort_activations(x_q: torch.Tensor, x_scale: torch.Tensor, token_indices_sorted: torch.Tensor):
    """(x_q_sorted [M, K], s_x_sorted [M]) from original-order codes / scales: row p is token
    token_indices_sorted[p] (meta.token_indices_sorted_by_lora_ids[:M]). A torch gather (one
    extra read + write of M.K bytes) for codes from elsewhere; the op's K1 stores sorted rows
    itself (k1_quant_shrink(sorted_codes=True))."""
    M, K = x_q.shape
    idx = token_indices_sorted[:M]
    if idx.device != x_q.device or idx.dtype not in (torch.int32, torch.int64):
        idx = idx.to(device=x_q.device, dtype=torch.long)
    # Rows moved as 8-byte words (K is a multiple of 16): torch's byte-wise index_select of the
    # uint8 view took ~20 us for 2048 x 4096 codes (run26), 4x the bytes' time.
    src = x_q.view(torch.uint8)
    if K % 8 == 0 and x_q.is_contiguous():
        src = src.view(torch.int64)
    xs = src.index_select(0, idx).view(torch.uint8).view(x_q.dtype)
    ss = x_scale.reshape(-1).index_select(0, idx).contiguous()
    return xs, ss


def vstore_fits(y: torch.Tensor) -> bool:
    """Whether y's rows take the vstore builds' 16-byte stores (row stride a multiple of 8 bf16,
    16-byte aligned base)."""
    return y.stride(0) % 8 == 0 and y.data_ptr() % 16 == 0


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent builds' grid); H100/H200's 132
    where there is none (CPU tests)."""
    if getattr(device, "type", None) != "cuda":
        return SM_COUNT_H100
    return _sm_count_cuda(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(config: Config, *, w_q, w_scale, x_q_sorted, x_scale_sorted, y, token_indices_sorted,
           group: int | None = None, h=None, active_lora_ids=None, num_active=None, lora_token_start_loc=None, slot_ranks=None,
           slice_start=None, lora_b=None, ctas: int | None = None, tile_counter=None) -> dict:
    """Arguments (in params() order) and launch geometry for one prefill K2 call.

    x_q_sorted / x_scale_sorted: activations in adapter-sorted order (sort_activations());
    token_indices_sorted: meta.token_indices_sorted_by_lora_ids (the first M entries are used);
    h: K1's [S, >= M, R] fp32 in original token order. group: rasterization (cta_tile()); None
    = l2_group(M, K, bn). ctas (persistent builds): CTAs in the grid, None = min(tiles, SMs).
    tile_counter (persistent builds): an int32 [>= 1] on y's device holding 0, which the launch
    claims its tiles from and leaves 0 again; launches that share one must not overlap (e.g.
    one per stream, as epilora_cute.ops._sync_buffer keeps its counters).
    Returns dict(args, grid, block, cluster, smem, pdl); launch without PDL (K1 must have
    finished) unless config.pdl.
    """
    M, K = x_q_sorted.shape
    N = w_q.shape[0]
    if not 1 <= M:
        raise ValueError("no tokens")
    if N % config.bm:
        raise ValueError(f"N={N} is not a multiple of bm={config.bm}")
    if K % 16:
        raise ValueError(f"K={K} must be a multiple of 16")
    if y.shape[0] < M or y.shape[1] != N or y.stride(1) != 1:
        raise ValueError(f"y must be [>= {M}, {N}] with unit column stride")
    if config.vstore and not vstore_fits(y):
        raise ValueError("a vstore build needs y's rows 16-byte aligned (row stride a multiple of 8)")
    tok = token_indices_sorted[:M]
    T = -(-M // config.bn)
    group = l2_group(M, K, config.bn) if group is None else int(group)
    if not 1 <= group <= T:
        raise ValueError(f"group must be 1..{T} token tiles, got {group}")
    args = [w_q, (N, K), x_q_sorted, (M, K), x_scale_sorted.reshape(-1), w_scale.reshape(-1), y, tok, group]
    if config.persistent:
        if tile_counter is None or tile_counter.dtype != torch.int32 or tile_counter.numel() < 1 \
                or tile_counter.device != y.device:
            raise ValueError("a persistent build needs tile_counter: an int32 [>= 1] on y's device holding 0")
        args.append(tile_counter.reshape(-1)[:1])
    elif tile_counter is not None:
        raise ValueError("tile_counter applies to the persistent builds only")
    if config.lora:
        bufs = list(lora_b)
        if len(bufs) != config.num_slices:
            raise ValueError(f"{config.num_slices} B buffers expected")
        views = []
        for b in bufs:
            b3 = b[:, 0] if b.dim() == 4 else b
            if b3.shape[2] != config.rank:
                raise ValueError(f"B buffer rank {b3.shape[2]} != config rank {config.rank}")
            if b3.shape[1] % config.bm:
                raise ValueError(f"slice width {b3.shape[1]} is not a multiple of bm={config.bm}")
            views.append(b3.reshape(-1, config.rank))
        args += views + [(v.shape[0],) for v in views]
        args += [h, active_lora_ids, num_active, lora_token_start_loc, slot_ranks, slice_start]
    grid = (T, N // config.bm, 1)
    if config.persistent:
        tiles = T * (N // config.bm)
        ctas = min(tiles, sm_count(y.device)) if ctas is None else int(ctas)
        if not 1 <= ctas <= tiles:
            raise ValueError(f"ctas must be 1..{tiles} (the tiles), got {ctas}")
        grid = (ctas, 1, 1)
    elif ctas is not None:
        raise ValueError("ctas applies to the persistent builds only")
    return dict(args=tuple(args), grid=grid, block=config.block,
                cluster=(1, 1, 1), smem=config.smem_bytes(), pdl=config.pdl)


# ---------------------------------------------------------------------------------------------
# Configuration choice and the prebuild set
# ---------------------------------------------------------------------------------------------

RANKS = (8, 16, 32, 64, 128, 256)
TOKEN_TILES = (64, 128)
L2_BUDGET = 24 << 20  # bytes of x_q tiles a rasterization group keeps in L2 (H100/H200: 50 MB L2)


def cta_tile(lin: int, n_ttiles: int, n_wtiles: int, group: int) -> tuple[int, int]:
    """(token tile, weight tile) of the CTA with linear id lin = blockIdx.x + blockIdx.y * T (the
    order the hardware dispatches in), exactly as the kernel computes it: groups of `group` token
    tiles sweep all weight tiles, token tile fastest inside a group. group = T: plain
    token-tile-fastest order (all x_q from L2 after its first read, weights read once per
    weight tile); smaller groups bound the x_q working set when M.K exceeds L2 (weights are then
    read T/group times, x_q once)."""
    per_group = group * n_wtiles
    grp = lin // per_group
    first = grp * group
    gsize = min(n_ttiles - first, group)
    rem = lin - grp * per_group
    return first + rem % gsize, rem // gsize


def l2_group(m: int, k: int, bn: int) -> int:
    """Token tiles per rasterization group: as many as keep their x_q rows (bn.K bytes each)
    within L2_BUDGET; all of them when the whole x_q fits."""
    t = -(-m // bn)
    return max(1, min(t, L2_BUDGET // (bn * k)))


def bm_for(widths) -> int:
    return 128 if all(wd % 128 == 0 for wd in widths) else 64


def token_tile(n_out: int, m: int, bm: int = 128, sms: int = SM_COUNT_H100) -> int:
    """bn = 128 (each weight tile read from L2 serves twice the tokens) unless the grid would then
    be short of two waves while 64 gives more CTAs."""
    if not M_MIN <= m <= M_MAX:
        raise ValueError(f"the prefill K2 takes {M_MIN}..{M_MAX} tokens, got {m}")
    tiles = n_out // bm
    return 128 if tiles * -(-m // 128) >= 2 * sms else 64


def unaligned_twin(build: Build) -> Build:
    """The build that serves an output whose rows are not 16-byte aligned (vstore_fits() false):
    scalar stores, one tile per CTA."""
    return build._replace(vstore=False, persistent=False)


def select(widths, m: int, rank: int | None = None, build: Build = OP_BUILD):
    """(adapter config or None, no-adapter config) for a projection with these slice widths; the
    op's build unless told otherwise."""
    bm = bm_for(widths)
    bn = token_tile(sum(widths), m, bm)
    b = build.config_kw()
    lora = _b_bufs_that_fit(Config(bn=bn, bm=bm, lora=True, num_slices=len(widths), rank=rank, **b)) if rank else None
    return lora, Config(bn=bn, bm=bm, lora=False, **b)


def _b_bufs_that_fit(cfg: Config) -> Config:
    """cfg, with one B chunk buffer where two do not fit beside a deep stage ring (6 stages at
    128 x 128)."""
    return dataclasses.replace(cfg, b_bufs=1) if cfg.smem_bytes() > SMEM_LIMIT else cfg


def prebuild_configs() -> list[Config]:
    """Every prefill K2 configuration for the supported models' projections (k2_gemm's shapes)."""
    from .k2_gemm import projection_shapes

    cfgs = set()
    for _, _, _, widths, _ in projection_shapes():
        bm = bm_for(widths)
        for bn in TOKEN_TILES:
            # The op's build and its scalar-store twin at every rank; the bench's and the GPU tests'
            # main-loop builds (tools/bench_prefill_k2.py) at rank 64.
            for b in (OP_BUILD, unaligned_twin(OP_BUILD)):
                kw = b.config_kw()
                cfgs.add(Config(bn=bn, bm=bm, lora=False, **kw))
                for r in RANKS:
                    cfgs.add(Config(bn=bn, bm=bm, lora=True, num_slices=len(widths), rank=r, **kw))
            for b in MAIN_LOOP_BUILDS:
                kw = b.config_kw()
                cfgs.add(Config(bn=bn, bm=bm, lora=False, **kw))
                c_l = _b_bufs_that_fit(Config(bn=bn, bm=bm, lora=True, num_slices=len(widths), rank=64, **kw))
                if c_l.smem_bytes() <= SMEM_LIMIT:
                    cfgs.add(c_l)
    return sorted(cfgs, key=lambda c: (c.lora, c.num_slices, c.bm, c.bn, c.rank, c.accum, c.vstore,
                                       c.persistent, c.stages, c.b_bufs))


# ---------------------------------------------------------------------------------------------
# CPU emulation: the kernel's decomposition in torch
# ---------------------------------------------------------------------------------------------


def _items(p0: int, bn: int, active, num_active: int, start_loc, slot_ranks, rank: int, rc: int):
    """(group, slot, chunk, jlo, jhi) of a token tile in the kernel's item order."""
    out = []
    for g in range(num_active):
        lid = int(active[g])
        glo, ghi = int(start_loc[g]), int(start_loc[g + 1])
        if lid >= 0 and glo < p0 + bn and ghi > p0:
            reff = max(min(int(slot_ranks[lid]), rank), 0)
            for c in range(-(-reff // rc)):
                out.append((g, lid, c, max(glo - p0, 0), min(ghi - p0, bn)))
    return out


def emulate(config: Config, *, w_q, w_scale, x_q_sorted, x_scale_sorted, token_indices_sorted, widths,
            h=None, active_lora_ids=None, num_active=None, lora_token_start_loc=None, slot_ranks=None,
            lora_b=None, y=None, group: int | None = None, tile_order_seed: int | None = None) -> torch.Tensor:
    """Pure-torch model of the kernel (CPU): (token tile, weight tile) CTAs, 128-deep k-blocks
    summed in fp32 (promotion), the tile's adapter items from the sorted group ranges, bf16 hmask
    (h gathered by token, zero outside the group), k16 steps cut at the effective rank, the fp32
    partial acc.s_x.s_w + acc_lora rounded once to bf16 and scattered to the original rows.
    y (optional) is written in place (poison it to check that every row of the batch is written)."""
    import random

    M, K = x_q_sorted.shape
    N = w_q.shape[0]
    bm, bn, bk, rc, R = config.bm, config.bn, config.bk, config.rank_chunk, config.rank
    if y is None:
        y = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    xf = x_q_sorted.float()
    wf = w_q.float()
    sx = x_scale_sorted.reshape(-1).float()
    sw = float(w_scale.reshape(-1)[0])
    tok = [int(t) for t in token_indices_sorted[:M]]
    starts = [0]
    for wd in widths:
        starts.append(starts[-1] + wd)
    if config.lora:
        act = [int(a) for a in active_lora_ids]
        na = int(num_active.reshape(-1)[0])
        sloc = [int(s) for s in lora_token_start_loc]
        sr = [int(s) for s in slot_ranks]
    nk = -(-K // bk)
    T, NT = -(-M // bn), N // bm
    G = l2_group(M, K, bn) if group is None else group
    ctas = [cta_tile(lin, T, NT, G) for lin in range(T * NT)]  # the hardware's dispatch order
    if tile_order_seed is not None:
        random.Random(tile_order_seed).shuffle(ctas)
    for t, n in ctas:
        p0, n0 = t * bn, n * bm
        valid = min(M - p0, bn)
        xt = torch.zeros(bn, K)
        xt[:valid] = xf[p0:p0 + valid]  # TMA zero fill past M
        acc = torch.zeros(bm, bn)
        for kb in range(nk):
            ka, ke = kb * bk, min((kb + 1) * bk, K)
            acc += wf[n0:n0 + bm, ka:ke] @ xt[:, ka:ke].t()  # one k-block, then promoted
        acc_l = torch.zeros(bm, bn)
        if config.lora:
            sl = max(i for i in range(len(widths)) if starts[i] <= n0)
            rin = n0 - starts[sl]
            bsl = lora_b[sl]
            bsl = bsl[:, 0] if bsl.dim() == 4 else bsl
            for g, lid, c, jlo, jhi in _items(p0, bn, act, na, sloc, sr, R, rc):
                bchunk = torch.zeros(bm, rc)
                cols = min(rc, R - c * rc)
                bchunk[:, :cols] = bsl[lid, rin:rin + bm, c * rc:c * rc + cols].float()
                hm = torch.zeros(bn, rc)
                for j in range(jlo, jhi):
                    hm[j, :cols] = h[sl, tok[p0 + j], c * rc:c * rc + cols]
                hm = hm.to(torch.bfloat16).float()
                reff = max(min(sr[lid], R), 0)
                n_steps = (min(reff - c * rc, rc) + 15) // 16
                acc_l += bchunk[:, :16 * n_steps] @ hm[:, :16 * n_steps].t()
        sxt = torch.zeros(bn)
        sxt[:valid] = sx[p0:p0 + valid]
        part = acc * (sxt * sw)[None, :] + acc_l
        for j in range(valid):
            y[tok[p0 + j], n0:n0 + bm] = part[:, j].to(torch.bfloat16)
    return y
