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
from .kernel_abi import ParamSpec, check_params

_MAX_STATIC_SMEM = 48 * 1024


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
    """A compiled kernel bound to its parameter declaration; launch with ``kernel(...)``."""

    def __init__(self, artifact: KernelArtifact, params: Sequence[ParamSpec], block: tuple[int, int, int]):
        check_params(params, artifact.param_sizes, artifact.kernel_name)
        self.artifact = artifact
        self.params = tuple(params)
        self.block = block
        self._loaded: dict[int, _Loaded] = {}
        self._smem_set: dict[int, int] = {}
        self._lock = threading.Lock()

    def _load(self) -> tuple[int, _Loaded]:
        key = int(_current_context())
        loaded = self._loaded.get(key)
        if loaded is None:
            with self._lock:
                loaded = self._loaded.get(key)
                if loaded is None:
                    drv = _driver()
                    try:
                        mod = _check(drv.cuModuleLoadData(self.artifact.cubin))
                    except CudaError as e:
                        raise CudaError(f"cannot load {self.artifact.family} built for {self.artifact.arch} by "
                                        f"nvidia-cutlass-dsl {self.artifact.dsl_version} on this GPU/driver: {e}") from e
                    fn = _check(drv.cuModuleGetFunction(mod, self.artifact.kernel_name.encode()))
                    loaded = _Loaded(mod, fn)
                    self._loaded[key] = loaded
        return key, loaded

    def _ensure_smem(self, loaded: _Loaded, ctx_key: int, smem: int) -> None:
        if smem > _MAX_STATIC_SMEM and self._smem_set.get(ctx_key, 0) < smem:
            drv = _driver()
            _check(drv.cuFuncSetAttribute(
                loaded.function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            self._smem_set[ctx_key] = smem

    def __call__(self, *args, grid: tuple[int, int, int], smem: int = 0, pdl: bool = False,
                 stream: torch.cuda.Stream | None = None) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.artifact.family}: {len(self.params)} arguments expected, got {len(args)}")
        if min(grid) < 1:
            return  # empty launch: nothing to do (the driver would reject it)
        ctx_key, loaded = self._load()
        drv = _driver()
        # One ctypes buffer per parameter, an array of pointers to them: what kernelParams wants.
        blobs = [p.pack(a) for p, a in zip(self.params, args)]
        bufs = [ctypes.create_string_buffer(b, len(b)) for b in blobs]
        ptrs = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        s = stream if stream is not None else torch.cuda.current_stream()
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = smem
        cfg.hStream = drv.CUstream(s.cuda_stream)
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        else:
            cfg.numAttrs = 0
        self._ensure_smem(loaded, ctx_key, smem)
        _check(drv.cuLaunchKernelEx(cfg, loaded.function, ctypes.addressof(ptrs), 0))
