"""The by-value parameter ABI of CuTe-DSL kernels, so a cubin can be launched without the DSL.

A ``@cute.kernel`` takes one by-value parameter per argument (Constexpr arguments disappear):

* a global tensor: ``{ptr; int32 dynamic shape modes...; int64 dynamic stride modes...}`` with
  natural alignment (static modes are compiled into the code);
* a TMA atom: a 128-byte ``CUtensorMap`` aligned to 64;
* a scalar: its own width.

Kernel families declare their parameter list with these specs; ``pack`` turns run-time values
into the bytes the driver copies, and ``ptx_param_sizes`` reads the sizes the compiler actually
emitted so tests can check the declaration against the PTX.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch


@dataclass(frozen=True)
class TensorParam:
    """A global tensor argument: which shape and stride modes are run-time values."""
    name: str
    dtype: torch.dtype
    rank: int
    dynamic_shape: tuple[int, ...] = ()
    dynamic_stride: tuple[int, ...] = ()
    align: int = 16  # the byte alignment the kernel was compiled to assume for the pointer

    def layout(self) -> tuple[str, int]:
        """struct format (little endian, explicit padding) and total size."""
        fmt = "<Q" + "i" * len(self.dynamic_shape)
        size = 8 + 4 * len(self.dynamic_shape)
        if self.dynamic_stride:
            if size % 8:
                fmt += "4x"
                size += 4
            fmt += "q" * len(self.dynamic_stride)
            size += 8 * len(self.dynamic_stride)
        if size % 8:
            fmt += "4x"
            size += 4
        return fmt, size

    def pack(self, t: torch.Tensor) -> bytes:
        if t.dtype != self.dtype:
            raise TypeError(f"{self.name}: expected {self.dtype}, got {t.dtype}")
        if t.dim() != self.rank:
            raise ValueError(f"{self.name}: expected a {self.rank}-D tensor, got shape {tuple(t.shape)}")
        if t.data_ptr() % self.align:
            raise ValueError(f"{self.name}: data pointer must be {self.align}-byte aligned")
        fmt, _ = self.layout()
        shapes = [int(t.shape[i]) for i in self.dynamic_shape]
        if any(s >= 2**31 for s in shapes):
            raise ValueError(f"{self.name}: a dimension exceeds int32")
        strides = [int(t.stride(i)) for i in self.dynamic_stride]
        return struct.pack(fmt, t.data_ptr(), *shapes, *strides)

    @property
    def size(self) -> int:
        return self.layout()[1]

    @cached_property
    def _struct(self) -> struct.Struct:
        return struct.Struct(self.layout()[0])

    def writer(self):
        """write(buf, offset, t): the bytes of pack(t) written into buf (the launcher's parameter
        buffer) at offset — the launch's hot path (~25 tensor parameters per eager projection), so
        no intermediate bytes object and no per-call loops over the dynamic modes; any check
        pack() would fail falls back to pack() for its error message."""
        pack_into, dtype, rank, align = self._struct.pack_into, self.dtype, self.rank, self.align
        shape_modes, stride_modes = self.dynamic_shape, self.dynamic_stride

        def checked(t):
            ptr = t.data_ptr()
            shape = t.shape
            if t.dtype is not dtype or len(shape) != rank or ptr % align:
                self.pack(t)  # raises with the reason
            return ptr, shape

        def put(buf, off, t, *vals):
            try:
                pack_into(buf, off, *vals)
            except struct.error:
                self.pack(t)  # a dimension beyond int32: the same message as pack()
                raise

        if not shape_modes and not stride_modes:
            def write(buf, off, t):
                put(buf, off, t, checked(t)[0])
        elif len(shape_modes) == 1 and not stride_modes:
            (i,) = shape_modes

            def write(buf, off, t):
                ptr, shape = checked(t)
                put(buf, off, t, ptr, shape[i])
        elif len(shape_modes) == 2 and len(stride_modes) == 1:
            (i, j), (k,) = shape_modes, stride_modes

            def write(buf, off, t):
                ptr, shape = checked(t)
                put(buf, off, t, ptr, shape[i], shape[j], t.stride(k))
        else:
            def write(buf, off, t):
                ptr, shape = checked(t)
                stride = t.stride()
                put(buf, off, t, ptr, *[shape[m] for m in shape_modes], *[stride[m] for m in stride_modes])
        return write


@dataclass(frozen=True)
class ScalarParam:
    name: str
    fmt: str  # struct code: "i" int32, "q" int64, "f" fp32, "Q" uint64

    def pack(self, v) -> bytes:
        return struct.pack("<" + self.fmt, v)

    @property
    def size(self) -> int:
        return struct.calcsize("<" + self.fmt)

    def writer(self):
        return struct.Struct("<" + self.fmt).pack_into


@dataclass(frozen=True)
class TensorMapParam:
    """A TMA descriptor (CUtensorMap, 128 bytes) built on the host by the launcher."""
    name: str

    def pack(self, v: bytes) -> bytes:
        if len(v) != 128:
            raise ValueError(f"{self.name}: a CUtensorMap is 128 bytes, got {len(v)}")
        return bytes(v)

    @property
    def size(self) -> int:
        return 128

    def writer(self):
        def write(buf, off, v):
            buf[off:off + 128] = self.pack(v)
        return write


ParamSpec = TensorParam | ScalarParam | TensorMapParam

_ENTRY_RE = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_SCALAR_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4,
                 "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def ptx_entries(ptx: str) -> dict[str, list[int]]:
    """Kernel name -> byte size of each parameter, read from the PTX ``.entry`` signatures."""
    out = {}
    for name, body in _ENTRY_RE.findall(ptx):
        sizes = []
        for decl in body.split(","):
            decl = decl.strip()
            if not decl:
                continue
            m = re.match(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\S+?(?:\[(\d+)\])?$", decl)
            if not m:
                raise ValueError(f"unparsed PTX parameter: {decl!r}")
            ty, count = m.group(1), m.group(2)
            sizes.append(_SCALAR_BYTES[ty] * (int(count) if count else 1))
        out[name] = sizes
    return out


def check_params(params: Sequence[ParamSpec], ptx_sizes: Sequence[int], kernel: str) -> None:
    declared = [p.size for p in params]
    if declared != list(ptx_sizes):
        raise RuntimeError(f"{kernel}: declared parameter sizes {declared} do not match the PTX's {list(ptx_sizes)}")
