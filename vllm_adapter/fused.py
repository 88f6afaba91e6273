"""The one place the plugin calls the fused FP8 LoRA kernels (rewire here when their API moves).

``lora_linear_fp8`` picks, per call:

1. ``epilora_cute.ops.lora_linear_fp8`` on a CUDA device of capability >= 9.0 (its own "auto"
   path: the CuTe-DSL decode kernels on sm_90a for small batches, else the Triton kernels);
2. the portable Triton path (``vllm_adapter.triton_path.triton_lora_linear``) where
   ``triton_path_applies(device)`` (Ada, or any GPU with EPILORA_FORCE_TRITON=1);
3. the reference math (``epilora_cute.reference.lora_linear``) otherwise: CPU tests, and
   always under EPILORA_REFERENCE=1 (numerics debugging).

``device_ok`` is what the layer selection asks before taking a layer over: it accepts only
devices where 1 or 2 applies, so vLLM's kernels are never replaced by the slow reference unless
asked.

Chained PDL (``chain_pdl``, CuTe decode / no-adapter paths): a layer's op may start under the
kernel before it (``epilora_cute.ops.lora_linear_fp8``). That kernel must not write the adapter
buffers or the batch metadata: vLLM writes the buffers when it activates adapters, long before
the forward, and the layer passes ``chain_pdl=False`` for the call right after it prepared the
metadata. EPILORA_CHAIN_PDL=0 turns chaining off (read once).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Sequence

import torch

from epilora_cute import environ
from epilora_cute.metadata import LoRABatchMeta

from .eligibility import ENV_REFERENCE, env_flag, flag_value

# Hopper: the CuTe-DSL kernels target sm_90 (wgmma + TMA).
MIN_CAPABILITY = (9, 0)
ENV_CHAIN_PDL = "EPILORA_CHAIN_PDL"
ENV_NO_LORA_SHORTCUT = "EPILORA_NO_LORA_SHORTCUT"


@functools.lru_cache(maxsize=1)
def no_lora_shortcut_enabled() -> bool:
    """EPILORA_NO_LORA_SHORTCUT (default 1), read once: whether vLLM's "no adapter in this batch"
    flag makes a call a no-adapter call (the dispatch's adapter bucket 0)."""
    return env_flag(ENV_NO_LORA_SHORTCUT, default=True)


@functools.lru_cache(maxsize=1)
def chain_pdl_enabled() -> bool:
    """EPILORA_CHAIN_PDL (default 1), read once: whether the op may chain onto the kernel before it."""
    return env_flag(ENV_CHAIN_PDL, default=True)


def _ops_module():
    try:
        return importlib.import_module("epilora_cute.ops")
    except ImportError:
        return None


def fused_op():
    """``epilora_cute.ops.lora_linear_fp8`` or None while it is not installed."""
    mod = _ops_module()
    return getattr(mod, "lora_linear_fp8", None) if mod is not None else None


def _cute_applies(device: torch.device) -> bool:
    if device.type != "cuda" or fused_op() is None:
        return False
    supports = getattr(_ops_module(), "supports_device", None)
    if supports is not None:
        return bool(supports(device))
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def _triton_applies(device: torch.device) -> bool:
    try:
        from . import triton_path
    except ImportError:  # triton missing
        return False
    return triton_path.triton_path_applies(device)


@functools.lru_cache(maxsize=None)
def _kernel_path(device: torch.device, force_triton: str, reference: bool) -> str:
    if device.type != "cuda" or reference:
        return "reference"
    if _cute_applies(device):
        return "cute"
    return "triton" if _triton_applies(device) else "reference"


_KERNEL_PATH_KEYS = environ.keys(("EPILORA_FORCE_TRITON", ENV_REFERENCE))


def kernel_path(device) -> str:
    """'cute', 'triton' or 'reference' for tensors on ``device`` (cached: asked by every call).

    EPILORA_REFERENCE=1 forces the reference (numerics debugging)."""
    return _kernel_path_for(device, *environ.values(_KERNEL_PATH_KEYS))


@functools.lru_cache(maxsize=64)
def _kernel_path_for(device, force_triton, reference) -> str:
    # Keyed by the switches' raw values: the environment is read on every call, decoded only here.
    return _kernel_path(torch.device(device), environ.text(force_triton) or "", flag_value(environ.text(reference)))


def device_ok(device: torch.device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"weights are on {device.type}; the fused kernels run on CUDA (EPILORA_REFERENCE=1 overrides)"
    if _kernel_path(device, os.environ.get("EPILORA_FORCE_TRITON", ""), False) != "reference":
        return True, ""
    cap = torch.cuda.get_device_capability(device)
    return False, (f"no fused kernel for sm_{cap[0]}{cap[1]} (CuTe op: sm_90+ when "
                   "epilora_cute.ops.lora_linear_fp8 exists; Triton path: sm_89 or EPILORA_FORCE_TRITON=1)")


def shape_reason(device, n: int, k: int, rank: int, num_slices: int) -> str | None:
    """Why the kernel for ``device`` can't take this layer's shapes (None: it can). Asked once,
    when vLLM has made the adapter buffers, so a layer falls back at load, not mid-serving."""
    path = kernel_path(device)
    if path == "cute":
        check = getattr(_ops_module(), "lora_linear_fp8_unsupported", None)
        return check(n, k, rank, num_slices) if check is not None else None
    if path == "triton":
        from .triton_path import MAX_RANK

        return f"rank {rank} > the Triton path's {MAX_RANK}" if rank > MAX_RANK else None
    return None


def prepare_layer(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]) -> None:
    """Build the kernels' per-layer device tables now, outside any CUDA-graph capture: called once
    vLLM has created a layer's adapter buffers (their addresses never change after that). The
    Triton kernels read them ("triton", and "cute": ``epilora_cute.ops``' timed dispatch runs the
    Triton path); vLLM captures its graphs later, and a capture must not build them (it records
    fills and copies without running them). Raises when the buffers are not ones the kernels take."""
    device = lora_a[0].device
    if kernel_path(device) not in ("cute", "triton"):
        return
    from .triton_path import prepare_tables

    prepare_tables(list(lora_a), list(lora_b))


def base_shortcut_applies(x: torch.Tensor) -> bool:
    """Whether a call vLLM flagged as having no adapter may go straight to vLLM's FP8 path
    (``base_linear_fp8``): the CuTe op serves this device and its dispatch would take "base" anyway."""
    if kernel_path(x.device) != "cute":
        return False
    from epilora_cute.dispatch import base_is_the_no_adapter_path

    return base_is_the_no_adapter_path()


def base_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """y = fp8(x) @ W^T (+ bias) with vLLM's own FP8 path, for a batch without adapters
    (``epilora_cute.ops.base_linear_fp8``): what the op's dispatch takes for it, without building
    the metadata, checking the adapter buffers or describing the call (host time per eager call)."""
    return _with_bias(_ops_module().base_linear_fp8(x, w_q, w_scale.reshape(1), out=out), bias, out)


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """y + bias, in place when y is the caller's ``out``."""
    if bias is None:
        return y
    return y.add_(bias) if out is not None else y + bias


def _reference(x, w_q, w_scale, lora_a, lora_b, meta: LoRABatchMeta) -> torch.Tensor:
    from epilora_cute.reference import lora_linear

    m = x.shape[0]
    ids = meta.token_lora_mapping[:m]
    if ids.shape[0] < m:  # rows past the metadata's capacity carry no adapter
        ids = torch.cat([ids, ids.new_full((m - ids.shape[0],), -1)])
    y = lora_linear(x, w_q, w_scale.reshape(1), list(lora_a), list(lora_b), ids)
    return y.to(x.dtype)


def lora_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                    meta: LoRABatchMeta, bias: torch.Tensor | None = None, chain_pdl: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = fp8(x) @ W^T + per-token LoRA (+ bias), in x's dtype; written into ``out`` when
    given (a contiguous [M, N] tensor of x's dtype), else into a new tensor.

    x [M, K] bf16; w_q [N, K] float8_e4m3fn; w_scale one fp32 value; lora_a / lora_b vLLM's
    stacked per-slice buffers ([max_loras, 1, r, K] / [max_loras, 1, n_s, r]); meta describes
    at least the first M rows (rows past its tokens carry no adapter). ``chain_pdl``: see the
    module docstring (CuTe path only, unless EPILORA_CHAIN_PDL=0).
    """
    path = kernel_path(x.device)
    if path == "cute":
        into = {"out": out} if out is not None else {}
        y = fused_op()(x, w_q, w_scale.reshape(1), list(lora_a), list(lora_b), meta, **into,
                       chain_pdl=chain_pdl and chain_pdl_enabled())
    elif path == "triton":
        from .triton_path import triton_lora_linear

        y = triton_lora_linear(x, w_q, w_scale.reshape(1), list(lora_a), list(lora_b), meta, out=out)
    else:
        y = _reference(x, w_q, w_scale, lora_a, lora_b, meta)
        if out is not None:
            y = out.copy_(y)
    return _with_bias(y, bias, out)
