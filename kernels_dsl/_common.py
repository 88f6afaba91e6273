"""Shared pieces of the decode-path kernel families (K2, shrink): device helpers, fake tensors,
the kernel-parameter ABI description and PTX inspection.

Everything here uses only API present in both nvidia-cutlass-dsl 4.6.0 and 4.8.x.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 4.8 deprecates cutlass.utils.SmemAllocator in favour of cutlass.memory, which 4.6 lacks.
warnings.filterwarnings("ignore", message=".*SmemAllocator is deprecated.*")

SM_COUNT_H100 = 132

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


# ---------------------------------------------------------------------------------------------
# Kernel parameter ABI
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TmaSpec:
    """What the host must pass to cuTensorMapEncodeTiled for one TMA parameter.

    Dims/strides/box are in TMA order (dim 0 = the contiguous one). `global_dims` and
    `global_strides_bytes` name the runtime tensor's quantities symbolically (e.g. "K", "N"),
    `box` is static.
    """

    dtype: str  # CU_TENSOR_MAP_DATA_TYPE_* suffix: UINT8 / BFLOAT16 / FLOAT32
    global_dims: tuple  # TMA order, symbolic names of the torch dims
    global_strides_bytes: tuple  # for dims 1.. (dim 0 is contiguous), symbolic
    box: tuple  # TMA order, elements
    element_strides: tuple
    interleave: str = "NONE"
    swizzle: str = "128B"
    l2_promotion: str = "NONE"  # performance only; see docs/k2_design.md
    oob_fill: str = "NONE"  # NONE == zeros; the kernels rely on zero fill for K tails


@dataclass(frozen=True)
class Param:
    """One kernel parameter in launch order.

    kind: "tensormap" (128 B CUtensorMap, align 64), "tensor" ({ptr; i32 shapes; i64 strides}),
    "coord" (a TMA coordinate tensor: its int32 dynamic shapes only), "i32" scalar.
    """

    name: str
    kind: str
    dyn_shapes: tuple = ()  # names of the int32 dynamic shape entries, in order
    dyn_strides: tuple = ()  # names of the int64 dynamic stride entries (elements), in order
    tma: TmaSpec | None = None
    note: str = ""

    @property
    def size(self) -> int:
        if self.kind == "tensormap":
            return 128
        if self.kind == "i32":
            return 4
        if self.kind == "coord":
            return 4 * len(self.dyn_shapes)
        if self.kind == "tensor":
            off = 8 + 4 * len(self.dyn_shapes)
            if self.dyn_strides:
                off = (off + 7) // 8 * 8 + 8 * len(self.dyn_strides)
            return (off + 7) // 8 * 8
        raise ValueError(self.kind)

    @property
    def align(self) -> int:
        return {"tensormap": 64, "i32": 4, "coord": 4, "tensor": 8}[self.kind]


def tensor_param(name, shapes=(), strides=(), note=""):
    return Param(name, "tensor", tuple(shapes), tuple(strides), note=note)


# ---------------------------------------------------------------------------------------------
# Fake tensors for cute.compile without a GPU
# ---------------------------------------------------------------------------------------------


def fake_rowmajor(dtype, shape, align=16):
    """Compact row-major fake tensor: the last mode is contiguous."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    n = len(shape)
    return make_fake_compact_tensor(dtype, tuple(shape), stride_order=tuple(range(n - 1, -1, -1)),
                                    assumed_align=align)


def sym(div=1):
    return cute.sym_int32(divisibility=div)


def fake_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)


# ---------------------------------------------------------------------------------------------
# PTX inspection (tests)
# ---------------------------------------------------------------------------------------------


def ptx_entries(ptx: str) -> dict[str, list[tuple[int, int]]]:
    """{entry name: [(align, size) per .param]} from a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\((.*?)\)", ptx, re.S):
        params = []
        for p in re.finditer(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+\S+?(?:\[(\d+)\])?\s*(?:,|$)", m.group(2)):
            align, ty, n = p.group(1), p.group(2), p.group(3)
            if n is None:  # scalar .param .u32 etc.
                size = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "b32": 4, "u32": 4, "s32": 4,
                        "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}[ty]
                params.append((int(align) if align else size, size))
            else:
                params.append((int(align) if align else 1, int(n)))
        out[m.group(1)] = params
    return out


def read_artifacts(compiled, dump_dir: str):
    """(ptx text, cubin path) of a cute.compile result built with --keep-ptx --keep-cubin."""
    ptx = getattr(compiled, "__ptx__", None)
    cubin = getattr(compiled, "__cubin__", None)
    if isinstance(ptx, str) and os.path.exists(ptx):
        ptx = open(ptx).read()
    if not isinstance(ptx, str) or ".entry" not in ptx:
        cands = sorted((os.path.join(dump_dir, f) for f in os.listdir(dump_dir) if f.endswith(".ptx")),
                       key=os.path.getmtime)
        ptx = open(cands[-1]).read()
    return ptx, cubin
