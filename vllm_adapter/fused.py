"""The one place the plugin calls the fused FP8 LoRA op (rewire here when its API moves).

``lora_linear_fp8`` runs ``epilora_cute.ops.lora_linear_fp8`` on CUDA and the reference math
(``epilora_cute.reference.lora_linear``) everywhere else, so CPU tests exercise the same layer
code path. ``device_ok`` is what the layer selection asks before taking a layer over.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import torch

from epilora_cute.metadata import LoRABatchMeta

# Hopper: the CuTe-DSL kernels target sm_90 (wgmma + TMA).
MIN_CAPABILITY = (9, 0)


def _ops_module():
    try:
        return importlib.import_module("epilora_cute.ops")
    except ImportError:
        return None


def fused_op():
    """``epilora_cute.ops.lora_linear_fp8`` or None while it is not installed."""
    mod = _ops_module()
    return getattr(mod, "lora_linear_fp8", None) if mod is not None else None


def device_ok(device: torch.device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"weights are on {device.type}; the fused op runs on CUDA (EPILORA_REFERENCE=1 overrides)"
    if fused_op() is None:
        return False, "epilora_cute.ops.lora_linear_fp8 is not available"
    supports = getattr(_ops_module(), "supports_device", None)
    if supports is not None:
        return (True, "") if supports(device) else (False, f"fused op does not support {device}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, f"GPU capability sm_{cap[0]}{cap[1]} < sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
    return True, ""


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
                    meta: LoRABatchMeta, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = fp8(x) @ W^T + per-token LoRA (+ bias), in x's dtype.

    x [M, K] bf16; w_q [N, K] float8_e4m3fn; w_scale one fp32 value; lora_a / lora_b vLLM's
    stacked per-slice buffers ([max_loras, 1, r, K] / [max_loras, 1, n_s, r]); meta describes
    at least the first M rows (rows past its tokens carry no adapter).
    """
    op = fused_op() if x.is_cuda else None
    if op is not None:
        y = op(x, w_q, w_scale.reshape(1), list(lora_a), list(lora_b), meta)
    else:
        y = _reference(x, w_q, w_scale, lora_a, lora_b, meta)
    if bias is not None:
        y = y + bias
    return y
