"""Public ops: validate, pick the kernel (or the reference as a clean fallback), launch.

Every op here computes exactly what ``reference.py`` defines; a fallback to the reference is
taken only where the result is identical (the quantization) or explicitly requested.
"""

from __future__ import annotations

import logging

import torch

from . import reference
from .arch import SIMPLE_KERNEL_TARGETS, arch_of
from .compile_cache import KernelUnavailable
from .kernels import get_kernel

log = logging.getLogger("epilora_cute")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def _check_2d(name: str, t, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _quant_kernel_reason(x: torch.Tensor) -> str | None:
    """Why the CuTe quantization kernel can't take x (None: it can)."""
    from kernels_dsl import fp8_quant

    arch = arch_of(x)
    if arch not in SIMPLE_KERNEL_TARGETS:
        return f"no CuTe quantization kernel for {arch or 'this device'}"
    k = x.shape[1]
    if k % fp8_quant.ELEMS_PER_VECTOR or x.stride(1) != 1 or x.stride(0) % fp8_quant.ELEMS_PER_VECTOR:
        return "rows must be contiguous with a length and stride that are multiples of 8"
    if x.data_ptr() % 16:
        return "x must be 16-byte aligned"
    if k > fp8_quant.MAX_K:
        return f"rows longer than {fp8_quant.MAX_K}"
    return None


def quantize_fp8_per_token(x: torch.Tensor, codes: torch.Tensor | None = None,
                           scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token FP8 quantization: (codes [M, K] e4m3, scales [M, 1] fp32).

    Bit-identical to ``reference.quantize_fp8_per_token`` (and to vLLM's ``scaled_fp8_quant``
    with ``use_per_token_if_dynamic=True``). ``codes``/``scales`` may be given to write in place.
    """
    _check_2d("x", x, torch.bfloat16)
    m, k = x.shape
    if codes is None:
        codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _check_2d("codes", codes, torch.float8_e4m3fn)
    _check_2d("scales", scales, torch.float32)
    if tuple(codes.shape) != (m, k) or tuple(scales.shape) != (m, 1):
        raise ValueError(f"codes must be [{m}, {k}] and scales [{m}, 1]; got {tuple(codes.shape)}, {tuple(scales.shape)}")
    if codes.device != x.device or scales.device != x.device:
        raise ValueError("x, codes and scales must be on one device")
    if m == 0:
        return codes, scales
    reason = _quant_kernel_reason(x) if x.is_cuda else "x is on the CPU"
    if reason is None and (codes.stride(1) != 1 or codes.stride(0) % 8 or codes.data_ptr() % 16
                           or scales.stride(0) != 1):
        reason = "codes must be row-contiguous (stride multiple of 8, 16-byte aligned) and scales contiguous"
    if reason is not None:
        if x.is_cuda:
            _warn_once(reason, f"quantize_fp8_per_token: using the torch reference ({reason})")
        c, s = reference.quantize_fp8_per_token(x)
        codes.copy_(c)
        scales.copy_(s)
        return codes, scales
    from kernels_dsl import fp8_quant

    cfg = fp8_quant.config_for(k)
    try:
        kernel = get_kernel(fp8_quant, cfg, arch_of(x))
    except KernelUnavailable as e:  # no cached build and no DSL to make one: same result, slower
        _warn_once(str(e), f"quantize_fp8_per_token: using the torch reference ({e})")
        c, s = reference.quantize_fp8_per_token(x)
        codes.copy_(c)
        scales.copy_(s)
        return codes, scales
    kernel(x, codes, scales, grid=(m, 1, 1), smem=cfg.smem_bytes)
    return codes, scales
