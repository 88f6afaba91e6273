"""Whether a vLLM base linear layer can run on the fused FP8 LoRA op, and if not, why.

Pure logic over duck-typed objects (no vLLM import), so it is tested with and without vLLM.
Everything is read after vLLM loaded and post-processed the weights: vLLM builds the LoRA
wrappers (``LoRAModelManager._create_lora_modules``) after ``model_loader.load_model`` has run
``process_weights_after_loading``, so the tensors checked here are the ones the kernel will read.

Accepted: per-tensor FP8 weights with dynamic per-token FP8 activations, which is what vLLM
computes for

* ``Fp8LinearMethod`` (FP8 checkpoint, ``quantization="fp8"``) without block scales,
* ``Fp8PerTensorOnlineLinearMethod`` (bf16 checkpoint quantized at load: ``quantization="fp8"``
  up to vLLM 0.30, ``"fp8_per_tensor"`` in later releases),
* compressed-tensors ``CompressedTensorsW8A8Fp8`` with the ``tensor`` strategy,

where after loading ``layer.weight`` is a [K, N] float8_e4m3fn view of a contiguous [N, K]
tensor and ``layer.weight_scale`` holds one fp32 value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
# Activation / adapter dtypes the fused op takes (bf16 only until the op declares fp16).
SUPPORTED_ACT_DTYPES = (torch.bfloat16,)

# Quantization methods by exact class name: subclasses may change apply() semantics, so they
# stay on vLLM's path rather than be trusted.
FP8_PER_TENSOR_METHODS = frozenset({"Fp8LinearMethod", "Fp8PerTensorOnlineLinearMethod"})
COMPRESSED_TENSORS_METHOD = "CompressedTensorsLinearMethod"
COMPRESSED_TENSORS_FP8_SCHEME = "CompressedTensorsW8A8Fp8"

ENV_REFERENCE = "EPILORA_REFERENCE"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _no(reason: str) -> Verdict:
    return Verdict(False, reason)


OK = Verdict(True, "per-tensor FP8 base, dynamic per-token activations")


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment variable: ``default`` when unset, off for "", 0, false, no, off."""
    return flag_value(os.environ.get(name), default)


def flag_value(value: str | None, default: bool = False) -> bool:
    """``env_flag``'s reading of a variable's value (None: unset)."""
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _quant_scheme(layer):
    """The object that carries the FP8 settings: the method itself, or compressed-tensors' scheme."""
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return None, "base layer has no quant_method"
    name = type(qm).__name__
    if name in FP8_PER_TENSOR_METHODS:
        return qm, None
    if name == COMPRESSED_TENSORS_METHOD:
        scheme = getattr(layer, "scheme", None)
        sname = type(scheme).__name__
        if sname != COMPRESSED_TENSORS_FP8_SCHEME:
            return None, f"compressed-tensors scheme {sname} is not W8A8 FP8"
        strategy = str(getattr(getattr(scheme, "strategy", None), "value", getattr(scheme, "strategy", None)))
        if strategy != "tensor":
            return None, f"compressed-tensors FP8 strategy '{strategy}' is not per-tensor"
        return scheme, None
    if name == "UnquantizedLinearMethod":
        return None, "base layer is not FP8 (unquantized)"
    return None, f"quantization method {name} is not per-tensor FP8"


def _activation_is_dynamic_per_token(scheme) -> Verdict | None:
    key = getattr(scheme, "activation_quant_key", None)
    scale = getattr(key, "scale", None)
    shape = getattr(scale, "group_shape", None)
    if key is None or scale is None or shape is None:
        return _no("activation quantization is not declared (activation_quant_key)")
    if getattr(scale, "static", True):
        return _no("static activation scale (the fused op quantizes activations per token)")
    if tuple(shape) != (1, -1):
        kind = "per-tensor" if tuple(shape) == (-1, -1) else f"group {tuple(shape)}"
        return _no(f"activation quantization is dynamic {kind}; the fused op is per-token")
    return None


def check_quant_method(layer) -> Verdict:
    scheme, why = _quant_scheme(layer)
    if scheme is None:
        return _no(why)
    if getattr(scheme, "weight_block_size", None) is not None or getattr(scheme, "block_quant", False):
        return _no(f"block-scaled FP8 weights (block {getattr(scheme, 'weight_block_size', None)})")
    if getattr(scheme, "use_marlin", False) or "Marlin" in type(getattr(scheme, "fp8_linear", None)).__name__:
        return _no("weights repacked for Marlin (no native FP8 on this GPU)")
    if getattr(scheme, "act_q_static", False) or getattr(scheme, "is_static_input_scheme", False):
        return _no("static activation scale (the fused op quantizes activations per token)")
    bad = _activation_is_dynamic_per_token(scheme)
    return bad if bad is not None else OK


def fp8_weight_view(layer) -> torch.Tensor | None:
    """The [N, K] row-major FP8 weight, as a view of vLLM's tensor, or None if the layout differs."""
    w = getattr(layer, "weight", None)
    k = getattr(layer, "input_size_per_partition", None)
    n = getattr(layer, "output_size_per_partition", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or k is None or n is None:
        return None
    # Per-tensor FP8 layers keep the weight as the transpose of a contiguous [N, K] tensor.
    if tuple(w.shape) == (k, n) and w.t().is_contiguous():
        return w.t()
    return None


def check_tensors(layer) -> Verdict:
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor):
        return _no("base layer has no weight tensor")
    if w.dtype != FP8_WEIGHT_DTYPE:
        return _no(f"weight dtype {w.dtype} is not float8_e4m3fn")
    if fp8_weight_view(layer) is None:
        k = getattr(layer, "input_size_per_partition", "?")
        n = getattr(layer, "output_size_per_partition", "?")
        return _no(f"weight layout {tuple(w.shape)} stride {w.stride()} is not a [K={k}, N={n}] "
                   "column-major view (padded or repacked by the GEMM kernel)")
    s = getattr(layer, "weight_scale", None)
    if not isinstance(s, torch.Tensor):
        return _no("no weight_scale (weight_scale_inv means block scales)")
    if s.numel() != 1:
        return _no(f"weight scale shape {tuple(s.shape)} is not per-tensor")
    if s.dtype != torch.float32:
        return _no(f"weight scale dtype {s.dtype} is not float32")
    if getattr(layer, "input_scale", None) is not None:
        return _no("static activation scale (the fused op quantizes activations per token)")
    return OK


def _resolve_dtype(d, fallback):
    if isinstance(d, torch.dtype):
        return d
    if d in (None, "auto"):
        return fallback
    return getattr(torch, str(d), None)


def check_dtypes(layer, lora_config) -> Verdict:
    act = getattr(layer, "orig_dtype", None) or getattr(layer, "params_dtype", None)
    if act not in SUPPORTED_ACT_DTYPES:
        return _no(f"activation dtype {act} unsupported (fused op takes {SUPPORTED_ACT_DTYPES})")
    lora = _resolve_dtype(getattr(lora_config, "lora_dtype", None), act)
    if lora not in SUPPORTED_ACT_DTYPES:
        return _no(f"LoRA dtype {lora} unsupported (fused op takes {SUPPORTED_ACT_DTYPES})")
    return OK


def check_parallel(layer, lora_config) -> Verdict:
    if getattr(lora_config, "fully_sharded_loras", False) and getattr(layer, "tp_size", 1) > 1:
        return _no("fully sharded LoRA at TP>1 exchanges the shrink result between ranks "
                   "(all-gather / all-reduce) between shrink and expand; the fused op has no such step")
    return OK


def check_device(layer, device_ok) -> Verdict:
    """``device_ok(device) -> (bool, reason)``; EPILORA_REFERENCE=1 accepts any device."""
    if env_flag(ENV_REFERENCE):
        return OK
    w = getattr(layer, "weight", None)
    ok, why = device_ok(w.device)
    return OK if ok else _no(why)


def check_layer(layer, lora_config, device_ok) -> Verdict:
    """All checks in order; the first failure is the reason logged."""
    for v in (check_parallel(layer, lora_config), check_quant_method(layer), check_tensors(layer),
              check_dtypes(layer, lora_config)):
        if not v:
            return v
    return check_device(layer, device_ok)
