"""Run-time side of the decode-path kernels: parameter specs the launcher packs, TMA descriptors
encoded with cuTensorMapEncodeTiled from a declared spec, and the exact dynamic smem size.

No nvidia-cutlass-dsl import here: a GPU machine without the DSL launches cached cubins with it.
The specs duck-type epilora_cute.kernel_abi's (name, size, pack(value)).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import ScalarParam, TensorMapParam, TensorParam  # noqa: F401 (re-export)

SM_COUNT_H100 = 132


@dataclass(frozen=True)
class CoordParam:
    """A TMA coordinate tensor: the kernel receives only its int32 dynamic shape modes, in order
    (no pointer). pack((d0, d1, ...))."""

    name: str
    n: int

    @property
    def size(self) -> int:
        return 4 * self.n

    def pack(self, dims) -> bytes:
        dims = tuple(int(d) for d in dims)
        if len(dims) != self.n:
            raise ValueError(f"{self.name}: {self.n} dims expected, got {dims}")
        if any(not 0 < d < 2**31 for d in dims):
            raise ValueError(f"{self.name}: dims out of int32 range: {dims}")
        return struct.pack("<" + "i" * self.n, *dims)

    def writer(self):
        st, n = struct.Struct("<" + "i" * self.n), self.n

        def write(buf, off, dims):
            if len(dims) != n or not all(0 < d < 2**31 for d in dims):
                self.pack(dims)  # raises with the reason
            st.pack_into(buf, off, *dims)
        return write


# cuTensorMapEncodeTiled enums, by name (values are cuda-python's enum members, resolved lazily).
_DTYPES = {torch.float8_e4m3fn: "UINT8", torch.uint8: "UINT8", torch.int8: "UINT8",
           torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT32"}


@dataclass(frozen=True)
class TmaSpec:
    """One 2-D TMA descriptor as the DSL kernel expects it.

    The kernel sees a row-major [rows, cols] tensor (cols contiguous): TMA dim 0 = cols (box
    box[0]), dim 1 = rows (box[1]). dtype: UINT8 for FP8 (the DSL copies FP8 as bytes), BFLOAT16.
    l2_promotion / oob_fill are what the DSL's host code chooses; tests/test_k2_gpu.py checks the
    encoded bytes against the DSL's (captured by kernels_dsl.host_capture).
    """

    torch_dtype: torch.dtype
    box: tuple  # (box cols, box rows)
    swizzle: str = "128B"  # NONE / 32B / 64B / 128B
    l2_promotion: str = "L2_128B"  # the DSL host code's choice
    oob_fill: str = "NONE"  # zeros; K tails rely on it
    interleave: str = "NONE"

    @property
    def tma_dtype(self) -> str:
        return _DTYPES[self.torch_dtype]


def encode_tensormap(t: torch.Tensor, spec: TmaSpec, l2_promotion: str | None = None,
                     oob_fill: str | None = None) -> bytes:
    """cuTensorMapEncodeTiled for a row-major 2-D tensor; returns the 128 descriptor bytes."""
    if t.dim() != 2:
        raise ValueError(f"TMA tensors are 2-D views here, got shape {tuple(t.shape)}")
    if t.dtype != spec.torch_dtype:
        raise TypeError(f"TMA tensor dtype {t.dtype}, expected {spec.torch_dtype}")
    es = t.element_size()
    if t.stride(1) != 1:
        raise ValueError("TMA tensor must have a contiguous last dimension")
    if t.data_ptr() % 16 or (t.stride(0) * es) % 16:
        raise ValueError("TMA needs a 16-byte aligned base and row stride")
    from cuda.bindings import driver as drv

    dt = getattr(drv.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{spec.tma_dtype}")
    il = getattr(drv.CUtensorMapInterleave, f"CU_TENSOR_MAP_INTERLEAVE_{spec.interleave}")
    sw = getattr(drv.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{spec.swizzle}")
    l2 = getattr(drv.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{l2_promotion or spec.l2_promotion}")
    oob = getattr(drv.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{oob_fill or spec.oob_fill}")
    dims = [drv.cuuint64_t(int(t.shape[1])), drv.cuuint64_t(int(t.shape[0]))]
    strides = [drv.cuuint64_t(int(t.stride(0)) * es)]
    box = [drv.cuuint32_t(int(b)) for b in spec.box]
    estr = [drv.cuuint32_t(1), drv.cuuint32_t(1)]
    err, tmap = drv.cuTensorMapEncodeTiled(dt, 2, t.data_ptr(), dims, strides, box, estr, il, sw, l2, oob)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err} (shape {tuple(t.shape)}, spec {spec})")
    return tensormap_bytes(tmap)


def tensormap_bytes(tmap) -> bytes:
    op = getattr(tmap, "opaque", None)
    if op is not None:
        words = list(op)
        return struct.pack("<" + "Q" * len(words), *[int(w) for w in words])
    import ctypes

    return ctypes.string_at(int(tmap.getPtr()), 128)


@dataclass(frozen=True)
class TmaParam(TensorMapParam):
    """A CUtensorMap parameter (a kernel_abi.TensorMapParam, so the launcher aligns it to 64) that
    also knows its spec: pack(tensor_2d) encodes the descriptor, pack(bytes) passes prebuilt ones."""

    spec: TmaSpec = None
    note: str = ""

    def pack(self, v) -> bytes:
        if isinstance(v, (bytes, bytearray)):
            return super().pack(v)
        return encode_tensormap(v, self.spec)


# ---------------------------------------------------------------------------------------------
# Shared-memory struct layout (mirrors the kernels' @cute.struct declarations)
# ---------------------------------------------------------------------------------------------


def struct_size(fields) -> int:
    """fields: [(bytes, align)]; sequential layout, total rounded to the largest alignment (this
    is the dynamic smem size the DSL launches with; tests check it against the DSL's)."""
    off, amax = 0, 1
    for size, align in fields:
        off = (off + align - 1) // align * align + size
        amax = max(amax, align)
    return (off + amax - 1) // amax * amax


# ---------------------------------------------------------------------------------------------
# PTX
# ---------------------------------------------------------------------------------------------

_SCALAR = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4, "s32": 4,
           "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def ptx_entry_params(ptx: str) -> dict[str, list[tuple[int, int]]]:
    """{entry: [(align, size) per .param]}."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+?)\s*\((.*?)\)", ptx, re.S):
        params = []
        for decl in m.group(2).split(","):
            decl = decl.strip()
            if not decl:
                continue
            p = re.match(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+\S+?(?:\[(\d+)\])?$", decl)
            ty, n = p.group(2), p.group(3)
            size = _SCALAR[ty] * (int(n) if n else 1)
            params.append((int(p.group(1)) if p.group(1) else _SCALAR[ty], size))
        out[m.group(1)] = params
    return out
