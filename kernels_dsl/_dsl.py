"""DSL-side helpers of the kernel families: inline-PTX device helpers, steps several families share
(shared-memory allocation and layouts, a slot's rank, the split-K reduction) and fake tensors for
compiling without a GPU. Imported only where nvidia-cutlass-dsl is installed.

Everything here uses only API present in both nvidia-cutlass-dsl 4.6.0 and 4.8.x.
"""

from __future__ import annotations

import warnings

import cutlass
import numpy as np
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 4.8 deprecates cutlass.utils.SmemAllocator in favour of cutlass.memory, which 4.6 lacks.
warnings.filterwarnings("ignore", message=".*SmemAllocator is deprecated.*")

# ---------------------------------------------------------------------------------------------
# vLLM's dynamic per-token FP8 quantization: its constants and the steps every kernel that
# quantizes shares (the codes must be vLLM's bit for bit; epilora_cute.reference defines them)
# ---------------------------------------------------------------------------------------------

FP8_MAX = 448.0  # e4m3's largest finite value
# min_scaling_factor: 1.0f / (448.0f * 512.0f) rounded once to fp32 (the kernel literal is that
# fp32 value exactly)
MIN_SCALE = float(np.float32(1.0) / np.float32(448.0 * 512.0))
FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# Device helpers (inline PTX where the DSL has no portable wrapper)
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def ld_dsmem_f32(smem_addr, cta_rank, *, loc=None, ip=None):
    """fp32 load from the shared memory of CTA `cta_rank` of this cluster at the address that
    `smem_addr` (a 32-bit shared::cta address) has in the calling CTA. cute.arch.load refuses
    DSMEM pointers in 4.8, so this is PTX: mapa + ld.shared::cluster."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(cta_rank).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .u32 ra;\n\tmapa.shared::cluster.u32 ra, $1, $2;\n\tld.shared::cluster.f32 $0, [ra];\n\t}",
            "=f,r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def push_b32(smem_addr, val, bar_addr, cta_rank, *, loc=None, ip=None):
    """st.async of a 32-bit word into the shared memory of CTA `cta_rank` of this cluster (which may
    be the calling CTA) at the address `smem_addr` has in the calling CTA, completing 4 bytes of
    transactions on that CTA's mbarrier at `bar_addr` (both 32-bit shared::cta addresses, mapped
    with mapa). The store is weak; the complete_tx has release semantics at cluster scope, so the
    receiver waits on its mbarrier with mbarrier_wait_acquire_cluster. Inline PTX (the same text
    under DSL 4.6 and 4.8; the DSL's store_async_dsmem takes pointers, not addresses)."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip),
         cutlass.Int32(bar_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(cta_rank).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .u32 ra, rb;\n\tmapa.shared::cluster.u32 ra, $0, $3;\n\tmapa.shared::cluster.u32 rb, $2, $3;\n\t"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [ra], $1, [rb];\n\t}",
        "r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mbarrier_wait_acquire_cluster(bar_addr, parity, *, loc=None, ip=None):
    """Wait until the mbarrier at `bar_addr` (32-bit shared::cta address) completes the phase of
    `parity`, with acquire semantics at cluster scope: the writes that peers released to it (the
    st.async stores whose complete_tx finished the phase) are visible afterwards. (The DSL's
    mbarrier_wait is acquire at CTA scope, not enough for another CTA's stores.)"""
    llvm.inline_asm(
        None,
        [cutlass.Int32(bar_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(parity).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\tLAB_WAIT:\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1;\n\t"
        "@!p bra LAB_WAIT;\n\t}",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def div_magic_u32(d, *, loc=None, ip=None):
    """m = floor((2^32 - 1) / d) + 1 (mod 2^32) for a divisor d >= 1: mulhi_u32(x, m) = x // d
    exactly whenever x * d < 2^32 (for d = 1, m wraps to 0 and the quotient is exact only for
    x = 0). One division per thread instead of one per element (the push plan's owner index)."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(), [cutlass.Int32(d).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .u32 t;\n\tdiv.u32 t, 4294967295, $1;\n\tadd.u32 $0, t, 1;\n\t}", "=r,r",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mulhi_u32(a, b, *, loc=None, ip=None):
    """The high 32 bits of the unsigned 64-bit product a * b."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(), [cutlass.Int32(a).ir_value(loc=loc, ip=ip), cutlass.Int32(b).ir_value(loc=loc, ip=ip)],
            "mul.hi.u32 $0, $1, $2;", "=r,r,r",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def div_rn_f32(a, b, *, loc=None, ip=None):
    """IEEE round-to-nearest fp32 division (no ftz, no approximation), as CUDA's `/` without
    --use_fast_math: the quantization must reproduce vLLM's codes bit for bit."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "div.rn.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def rcp_rn_f32(a, *, loc=None, ip=None):
    """IEEE round-to-nearest fp32 reciprocal (rcp.rn.f32: correctly rounded, not the approximation)."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(), [cutlass.Float32(a).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def quot_rn_f32(a, b, rb, *, loc=None, ip=None):
    """a / b rounded to nearest (bit-identical to div.rn.f32) from rb = rcp_rn_f32(b), for finite
    b > 0 and a finite or NaN with |a / b| far from overflow: q = a * rb is within one ulp, the
    remainder a - q b is exact (fma), and one correction q + (a - q b) rb rounds to the correctly
    rounded quotient (Markstein's theorem); where the remainder is 0 (a = +-0 in particular) q is
    kept, so the sign of zero survives. Four instructions instead of div.rn's call sequence: the
    self-quantizing K2 divides every element of its K range by the token's scale."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, rb)],
            "{\n\t.reg .f32 q, e, c;\n\t.reg .pred z;\n\tmul.rn.f32 q, $1, $3;\n\t"
            "neg.f32 c, q;\n\tfma.rn.f32 e, c, $2, $1;\n\tfma.rn.f32 c, e, $3, q;\n\t"
            "setp.eq.f32 z, e, 0f00000000;\n\tselp.f32 $0, q, c, z;\n\t}",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def f32_bits(a, *, loc=None, ip=None):
    """The bit pattern of an fp32 value as an int32."""
    return cutlass.Int32(
        llvm.inline_asm(T.i32(), [cutlass.Float32(a).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
                        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    )


@dsl_user_op
def red_shared_max_u32(smem_addr, val, *, loc=None, ip=None):
    """red.shared.max.u32: the maximum of non-negative fp32 values compares like their bit patterns."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
        "red.shared.max.u32 [$0], $1;",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def fmax_f32(a, b, *, loc=None, ip=None):
    """max.f32 (no ftz): returns the non-NaN operand, like CUDA's fmaxf."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "max.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def fmin_f32(a, b, *, loc=None, ip=None):
    """min.f32 (no ftz): returns the non-NaN operand, like CUDA's fminf."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "min.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def abs_f32(a, *, loc=None, ip=None):
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip)],
            "abs.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def cvt_e4m3x2_f32(lo, hi, *, loc=None, ip=None):
    """Two fp32 -> packed e4m3x2 (round to nearest even, saturating to +-448; inputs are already
    clamped). Returns a 16-bit word: `lo` in the low byte."""
    return cutlass.Int16(
        llvm.inline_asm(
            T.i16(),
            [cutlass.Float32(lo).ir_value(loc=loc, ip=ip), cutlass.Float32(hi).ir_value(loc=loc, ip=ip)],
            "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;",
            "=h,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def cvt_e4m3x4_f32(a, b, c, d, *, loc=None, ip=None):
    """Four fp32 -> four e4m3 codes packed in a 32-bit word, `a` in the lowest byte (the byte
    order of x_q in memory); rounding and saturation as cvt_e4m3x2_f32."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
            "{\n\t.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\tmov.b32 $0, {lo, hi};\n\t}",
            "=r,f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def st_shared_v4_b32(smem_addr, a, b, c, d, *, loc=None, ip=None):
    """16-byte store to shared memory (32-bit shared::cta address, 16-byte aligned)."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip)]
        + [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def cp_async_cg_16(smem_addr, gmem_addr_i64, src_bytes, *, loc=None, ip=None):
    """cp.async.cg of 16 bytes from a global to a shared (32-bit shared::cta) address with a
    runtime source size: the bytes past src_bytes are zero-filled, so src_bytes = 0 reads nothing
    and zeroes the 16 bytes. A guarded copy as one instruction (a guarded cute.copy compiles to a
    branch and a convergence barrier per copy). The global address must stay a valid one."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip), cutlass.Int64(gmem_addr_i64).ir_value(loc=loc, ip=ip),
         cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def swizzle_128b(byte_offset):
    """The 128-byte swizzle (Swizzle<3,4,3> on byte addresses) of an offset from a 1024-aligned
    base: the 16-byte chunk index (bits 4-6) XOR the row within 8 rows of 128 bytes (bits 7-9)."""
    return byte_offset ^ ((byte_offset >> 3) & 0x70)


@dsl_user_op
def shfl_bfly_f32(v, lane_mask, *, loc=None, ip=None):
    """shfl.sync.bfly over the full warp: the value of lane (lane ^ lane_mask)."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip), cutlass.Int32(lane_mask).ir_value(loc=loc, ip=ip)],
        "shfl.sync.bfly.b32 $0, $1, $2, 31, -1;", "=f,f,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ld_acquire_gpu_s32(addr_i64, *, loc=None, ip=None):
    """ld.acquire.gpu of an int32 at a global address (spin-wait on a flag another grid sets)."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip)],
            "ld.acquire.gpu.global.s32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def ld_relaxed_gpu_f32(addr_i64, *, loc=None, ip=None):
    """ld.relaxed.gpu of an fp32 at a global address: data other CTAs of this grid published
    before a flag this CTA acquired (never a stale L1 line)."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip)],
            "ld.relaxed.gpu.global.f32 $0, [$1];",
            "=f,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def atom_add_acqrel_gpu_s32(addr_i64, val, *, loc=None, ip=None):
    """atom.acq_rel.gpu.global.add.s32: returns the old value."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
            "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def atom_add_relaxed_gpu_s32(addr_i64, val, *, loc=None, ip=None):
    """atom.relaxed.gpu.global.add.s32: returns the old value (a count with no data behind it)."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
            "atom.relaxed.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def red_release_gpu_add_s32(addr_i64, val, *, loc=None, ip=None):
    """red.release.gpu.global.add.s32: publish (after this CTA's writes) one increment."""
    llvm.inline_asm(
        None,
        [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def st_relaxed_gpu_s32(addr_i64, val, *, loc=None, ip=None):
    llvm.inline_asm(
        None,
        [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
        "st.relaxed.gpu.global.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None):
    """Order this thread's (acquired) view of global memory before its later async-proxy (TMA)
    reads: the activations were written by another grid through the generic proxy."""
    llvm.inline_asm(None, [], "fence.proxy.async.global;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    llvm.inline_asm(None, [cutlass.Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def prefetch_bulk_l2(addr_i64, size, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2.global: ask L2 for ``size`` bytes (a multiple of 16) at a 16-byte
    aligned global address. No completion mechanism: a hint (kernels_dsl/l2_prefetch.py)."""
    llvm.inline_asm(None, [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip), cutlass.Int32(size).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def stamp_globaltimer(addr_i64, *, loc=None, ip=None):
    """Store %globaltimer (ns, one clock for every SM) as a u64 at a global address: the trace
    builds' timeline stamps (tools/bench_timeline.py)."""
    llvm.inline_asm(None, [cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip)],
                    "{\n\t.reg .u64 t;\n\tmov.u64 t, %globaltimer;\n\tst.global.u64 [$0], t;\n\t}", "l",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# ---------------------------------------------------------------------------------------------
# Steps several kernel families share. They live here, not in one family's module: a family's
# cache key hashes its own file and these shared helpers, so it must import no device code from
# another family's file (an edit there would not rebuild it).
# ---------------------------------------------------------------------------------------------


def smem_allocator():
    """A shared-memory allocator: 4.8 moved SmemAllocator to cutlass.memory (the old path warns);
    4.6 has only cutlass.utils."""
    mem = getattr(cutlass, "memory", None)
    return (mem.SmemAllocator if mem is not None and hasattr(mem, "SmemAllocator") else cutlass.utils.SmemAllocator)()


def kmajor_layout(rows: int, stages: int):
    """bf16 [rows, 64, stages]: a ring of K-major k-blocks of 64 elements (one 128-byte swizzle row;
    K1's and the streamed shrink's BK), 16-byte chunks swizzled over 8 rows: conflict-free for
    ldmatrix and cp.async, and the swizzle WGMMA reads K-major operands with. The swizzle goes into
    the smem pointer, where it acts on byte addresses: Swizzle<3,4,3> moves whole 16-byte chunks
    (<3,3,3> would split them: misaligned stores)."""
    atom = cute.make_composed_layout(cute.make_swizzle(3, 4, 3), 0,
                                     cute.make_layout((8, 64), stride=(64, 1)))
    return cute.tile_to_shape(atom, (rows, 64, stages), (0, 1, 2))


@cute.jit
def k_eff(lid, mRanks, has_ranks, cap):
    """The rank an adapter group computes with, for its slot lid: 0 for the no-adapter group
    (lid < 0); else ``cap``, or with slot_ranks (has_ranks != 0) the slot's effective rank rounded
    up to 16, at most ``cap``. Expand-add and K1 cap it at the padded rank RP (their MMA's K / N),
    the streamed shrink at the rank R (the A rows it loads)."""
    k = cutlass.Int32(0)
    if lid >= 0:
        k = cutlass.Int32(cap)
        if has_ranks != 0:
            k = cutlass.min((cutlass.max(mRanks[lid], 0) + 15) // 16 * 16, cap)
    return k


@cute.jit
def reduce_split_partials(sP, row_lo, row_hi, R, row_words, max_splits, split, nsplit, tidx, NT, store):
    """The split-K sum over a cluster of nsplit CTAs, each with its fp32 partial in sP (R columns
    of rows of row_words words, at the same shared address in every CTA), of the rows [row_lo,
    row_hi): this CTA sums the elements [split * E / n, (split + 1) * E / n) of the
    E = (row_hi - row_lo) * R and hands each to store(r, c, v). Every split's partial is loaded
    first (independent DSMEM loads in flight together), then summed in split order 0..n-1: the
    same additions, bit for bit, on every launch (K1 and the streamed shrink)."""
    n_el = (row_hi - row_lo) * R
    lo = split * n_el // nsplit
    hi = (split + 1) * n_el // nsplit
    base = sP.iterator.toint()
    for e in cutlass.range(lo + tidx, hi, NT, unroll=1):
        r = row_lo + e // R
        c = e - (r - row_lo) * R
        off = base + (r * row_words + c) * 4
        part = []
        for q in cutlass.range_constexpr(max_splits):
            p_q = cutlass.Float32(0.0)
            if q < nsplit:
                p_q = ld_dsmem_f32(off, q)
            part.append(p_q)
        v = cutlass.Float32(0.0)
        for q in cutlass.range_constexpr(max_splits):
            if q < nsplit:
                v = v + part[q]
        store(r, c, v)


# ---------------------------------------------------------------------------------------------
# Fake tensors for cute.compile without a GPU
# ---------------------------------------------------------------------------------------------


def fake_rowmajor(dtype, shape, align=16):
    """Compact row-major fake tensor: the last mode is contiguous."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    n = len(shape)
    return make_fake_compact_tensor(dtype, tuple(shape), stride_order=tuple(range(n - 1, -1, -1)),
                                    assumed_align=align)


def fake_matrix(dtype, kdiv):
    """[M, K] fake tensor, K contiguous: M, K and the row stride run-time values, K and the row
    stride divisible by kdiv (never promise more than every valid launch gives), 16-byte aligned."""
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (cute.sym_int32(), cute.sym_int32(divisibility=kdiv)),
                            stride=(cute.sym_int64(divisibility=kdiv), 1), assumed_align=16)


def sym(div=1):
    return cute.sym_int32(divisibility=div)


def fake_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)


def compile_with_smem(kernel, fake_args, options: str):
    """cute.compile(kernel, *fake_args) with no GPU; the result carries ``epilora_smem_bytes``, the
    DSL's own size of the kernel's shared-storage struct (what the launch must reserve)."""
    f = cute.compile(kernel, *fake_args, options=options)
    try:
        f.epilora_smem_bytes = int(kernel.smem_size)
    except AttributeError:  # a compiled object that refuses new attributes
        pass
    return f


# ---------------------------------------------------------------------------------------------
# The quantization's arithmetic (on top of the PTX helpers above)
# ---------------------------------------------------------------------------------------------


def fp8_scale(amax):
    """A row's scale from its NaN-ignoring max |x|: max(amax / 448, MIN_SCALE), the division
    correctly rounded (an infinite amax gives an infinite scale, as in vLLM)."""
    return fmax_f32(div_rn_f32(amax, cutlass.Float32(FP8_MAX)), cutlass.Float32(MIN_SCALE))


@cute.jit
def fp8_quotient_operands(scale):
    """(div, rcp) with which quot_rn_f32(x, div, rcp) is vLLM's x / scale: (scale, its correctly
    rounded reciprocal), or for an infinite scale (an infinite element in the row) (FLT_MAX, 0),
    which gives +-0 for finite x and NaN for +-inf and NaN, with no branch per element."""
    div = scale
    rcp = cutlass.Float32(0.0)
    if scale < cutlass.Float32(float("inf")):
        rcp = rcp_rn_f32(scale)
    else:
        div = cutlass.Float32(FLT_MAX)
    return div, rcp


def fp8_clamp(q):
    """fmaxf(-448, fminf(q, 448)), as vLLM clamps before the conversion: NaN -> +448 (fminf
    returns its non-NaN operand)."""
    return fmax_f32(cutlass.Float32(-FP8_MAX), fmin_f32(q, cutlass.Float32(FP8_MAX)))
