"""Launches compiled kernels through cuda-python on torch's current stream.

The cubin is loaded once per CUDA context (``cuModuleLoadData``); each launch packs the
by-value parameters by the kernel's declared ABI (kernel_abi.py) and calls ``cuLaunchKernelEx``,
adding programmatic stream serialization (PDL) when asked: the dependent kernel may then start
while its predecessor runs and must order itself with ``griddepcontrol.wait``. Nothing here
synchronizes, so launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .compile_cache import KernelArtifact
from .kernel_abi import ParamSpec, TensorMapParam, check_params

_MAX_STATIC_SMEM = 48 * 1024

# TMA descriptors (128 bytes each, encoded by cuTensorMapEncodeTiled through cuda-python: the
# largest part of a launch's host time) are a pure function of the parameter's declaration and the
# tensor's address, shape, strides and dtype. Weights and adapter buffers are the same tensors call
# after call, and activations often come back at the same address from torch's caching allocator:
# an eager call re-encoded every one of them. Bounded: emptied when full.
_TENSORMAPS: dict = {}
_TENSORMAPS_MAX = 4096


def _tensormap(p: TensorMapParam, t: torch.Tensor) -> bytes:
    """p.pack(t), encoded once per (declaration, address, shape, strides, dtype). Keyed by the
    declaration's identity (hashing a frozen declaration walks all its fields, per call): the entry
    holds p itself, so its id cannot be reused while the entry lives."""
    key = (id(p), t.data_ptr(), t.shape, t.stride(), t.dtype)
    hit = _TENSORMAPS.get(key)
    if hit is not None and hit[0] is p:
        return hit[1]
    blob = p.pack(t)
    if len(_TENSORMAPS) >= _TENSORMAPS_MAX:
        _TENSORMAPS.clear()
    _TENSORMAPS[key] = (p, blob)
    return blob


def _tensormap_writer(p: TensorMapParam):
    def write(buf, off, v):
        blob = _tensormap(p, v) if isinstance(v, torch.Tensor) else p.pack(v)
        buf[off:off + 128] = blob
    return write


def _writer(p: ParamSpec):
    """write(buf, offset, value) for one declared parameter (the declaration's own writer when it
    has one, else pack() copied in)."""
    if isinstance(p, TensorMapParam):
        return _tensormap_writer(p)
    w = getattr(p, "writer", None)
    if w is not None:
        return w()

    def write(buf, off, v):
        blob = p.pack(v)
        buf[off:off + len(blob)] = blob
    return write


class CudaError(RuntimeError):
    pass


def _driver():
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:  # pragma: no cover - older layout
        from cuda import cuda as driver
    return driver


def _check(result):
    """cuda-python returns (err, *values): raise on error, return the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        raise CudaError(f"{name.decode() if name else err}: {text.decode() if text else ''}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _current_context():
    """The context torch uses on the current device (torch creates the primary context)."""
    drv = _driver()
    torch.cuda.init()
    dev = torch.cuda.current_device()
    ctx = _check(drv.cuCtxGetCurrent())
    if ctx is None or int(ctx) == 0:
        cu_dev = _check(drv.cuDeviceGet(dev))
        ctx = _check(drv.cuDevicePrimaryCtxRetain(cu_dev))
        _check(drv.cuCtxSetCurrent(ctx))
    return ctx


@dataclass
class _Loaded:
    module: object
    function: object


class Kernel:
    """A compiled kernel bound to its parameter declaration; launch with ``kernel(...)``.

    Host cost matters for eager (non-graph) steps, so the per-launch work is kept small: the
    parameters are packed into one reusable buffer (the driver copies them at launch), the module
    lookup is keyed by device index, and launch configurations are cached per (grid, smem, pdl,
    cluster, stream).
    """

    def __init__(self, artifact: KernelArtifact, params: Sequence[ParamSpec], block: tuple[int, int, int]):
        check_params(params, artifact.param_sizes, artifact.kernel_name)
        self.artifact = artifact
        self.params = tuple(params)
        self.block = tuple(block)
        self._loaded: dict[int, _Loaded] = {}
        self._smem_set: dict[int, int] = {}
        self._configs: dict[tuple, object] = {}
        self._lock = threading.Lock()
        # Parameter slots: each at its natural alignment (64 for CUtensorMap) inside one buffer.
        offsets, off = [], 0
        for p in self.params:
            align = 64 if isinstance(p, TensorMapParam) else 8
            off = (off + align - 1) // align * align
            offsets.append(off)
            off += p.size
        self._offsets = offsets
        self._writers = tuple(_writer(p) for p in self.params)
        self._tls = threading.local()
        self._buf_size = off + 64

    def _buffers(self):
        """This thread's parameter buffer, the (writer, offset) slot of every parameter in it, and
        the pointer array into it with its address (made once per thread)."""
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = self._new_buffers(range(len(self.params)))
        return bufs

    def _new_buffers(self, written, preset=()):
        """A parameter buffer aligned to 64 bytes, ``preset`` (offset, bytes) pairs copied in, the
        (writer, offset) slots of the parameter indices ``written``, the pointer array to every
        parameter and its address."""
        raw = ctypes.create_string_buffer(self._buf_size + 64)
        base = (ctypes.addressof(raw) + 63) // 64 * 64
        shift = base - ctypes.addressof(raw)
        for off, blob in preset:
            raw[shift + off:shift + off + len(blob)] = blob
        ptrs = (ctypes.c_void_p * len(self.params))(*[base + o for o in self._offsets])
        slots = tuple((self._writers[i], shift + self._offsets[i]) for i in written)
        return raw, slots, ptrs, ctypes.addressof(ptrs)

    def _load(self) -> tuple[int, _Loaded]:
        dev = torch.cuda.current_device()
        loaded = self._loaded.get(dev)
        if loaded is None:
            with self._lock:
                loaded = self._loaded.get(dev)
                if loaded is None:
                    _current_context()
                    drv = _driver()
                    try:
                        mod = _check(drv.cuModuleLoadData(self.artifact.cubin))
                    except CudaError as e:
                        raise CudaError(f"cannot load {self.artifact.family} built for {self.artifact.arch} by "
                                        f"nvidia-cutlass-dsl {self.artifact.dsl_version} on this GPU/driver: {e}") from e
                    fn = _check(drv.cuModuleGetFunction(mod, self.artifact.kernel_name.encode()))
                    loaded = _Loaded(mod, fn)
                    self._loaded[dev] = loaded
        return dev, loaded

    def _ensure_attrs(self, loaded: _Loaded, dev: int, smem: int, cluster: tuple[int, int, int] | None) -> None:
        key = (dev, smem, cluster)
        if key in self._smem_set:
            return
        drv = _driver()
        if smem > _MAX_STATIC_SMEM:
            _check(drv.cuFuncSetAttribute(
                loaded.function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            # All shared memory, no L1 preference: our large-smem kernels stream through TMA /
            # cp.async (L1 bypassed), and two resident CTAs of ~110 KiB need the whole carveout.
            _check(drv.cuFuncSetAttribute(
                loaded.function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
        if cluster is not None and cluster[0] * cluster[1] * cluster[2] > 8:
            _check(drv.cuFuncSetAttribute(
                loaded.function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
        self._smem_set[key] = smem

    def _config(self, grid, smem: int, pdl: bool, cluster, stream_handle: int):
        key = (grid, smem, pdl, cluster, stream_handle)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg
        drv = _driver()
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = smem
        cfg.hStream = drv.CUstream(stream_handle)
        attrs = []
        if pdl:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if cluster is not None:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        if len(self._configs) > 256:  # many shapes seen eagerly: start over rather than grow
            self._configs.clear()
        self._configs[key] = cfg
        return cfg

    def __call__(self, *args, grid: tuple[int, int, int], smem: int = 0, pdl: bool = False,
                 cluster: tuple[int, int, int] | None = None, stream: torch.cuda.Stream | None = None) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.artifact.family}: {len(self.params)} arguments expected, got {len(args)}")
        grid = tuple(grid)
        if min(grid) < 1:
            return  # empty launch: nothing to do (the driver would reject it)
        raw, slots, _, ptrs_addr = self._buffers()
        for (write, off), a in zip(slots, args):
            write(raw, off, a)
        self._launch(ptrs_addr, grid, smem, pdl, cluster, stream)

    def _launch(self, ptrs_addr: int, grid, smem: int, pdl: bool, cluster, stream) -> None:
        """cuLaunchKernelEx with the parameters already written behind ``ptrs_addr``."""
        dev, loaded = self._load()
        handle = (stream if stream is not None else torch.cuda.current_stream(dev)).cuda_stream
        self._ensure_attrs(loaded, dev, smem, cluster)
        cfg = self._config(grid, smem, pdl, cluster, handle)
        _check(_driver().cuLaunchKernelEx(cfg, loaded.function, ptrs_addr, 0))

    def plan(self, static: dict[int, object]) -> "LaunchPlan":
        """A launch plan: the parameters at the indices of ``static`` packed now, once (validated
        by their declarations as in a launch); each launch of the plan writes only the others."""
        return LaunchPlan(self, static)


class LaunchPlan:
    """A kernel's parameter buffer with its long-lived parameters written once.

    An eager projection's launches differ from call to call only in a few parameters (the
    activations, the outputs, the scratch between kernels); the rest (weights, adapter buffers,
    the metadata's persistent tensors, flags) is the same tensors every call, and writing them
    was most of a launch's host time. The plan keeps their packed bytes (never the tensors: a
    plan may live in an identity memo, which must not keep buffers alive) and copies them into
    each thread's buffer once; ``plan(*dynamic, ...)`` writes the remaining parameters in
    declaration order and launches. The bytes of a plan's launch are those of
    ``kernel(*all_args, ...)`` with the same values, bit for bit (tests/test_launch_plans.py)."""

    def __init__(self, kernel: Kernel, static: dict[int, object]):
        n = len(kernel.params)
        if any(not 0 <= i < n for i in static):
            raise IndexError(f"{kernel.artifact.family}: static parameter index out of 0..{n - 1}")
        self.kernel = kernel
        scratch = ctypes.create_string_buffer(kernel._buf_size + 64)
        self._static = []
        for i, v in static.items():
            off, size = kernel._offsets[i], kernel.params[i].size
            kernel._writers[i](scratch, off, v)
            self._static.append((off, scratch.raw[off:off + size]))
        self._dynamic_idx = tuple(i for i in range(n) if i not in static)
        self._tls = threading.local()

    def _buffers(self):
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = self.kernel._new_buffers(self._dynamic_idx, self._static)
        return bufs

    def __call__(self, *dynamic, grid: tuple[int, int, int], smem: int = 0, pdl: bool = False,
                 cluster: tuple[int, int, int] | None = None, stream: torch.cuda.Stream | None = None) -> None:
        if len(dynamic) != len(self._dynamic_idx):
            raise TypeError(f"{self.kernel.artifact.family}: {len(self._dynamic_idx)} dynamic arguments expected, "
                            f"got {len(dynamic)}")
        if min(grid) < 1:
            return
        raw, slots, _, ptrs_addr = self._buffers()
        for (write, off), a in zip(slots, dynamic):
            write(raw, off, a)
        self.kernel._launch(ptrs_addr, tuple(grid), smem, pdl, cluster, stream)
