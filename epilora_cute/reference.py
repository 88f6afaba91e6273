"""Reference semantics: the one definition every kernel and dispatch path is tested against.

Plain torch, fp32 math, runs on CPU and GPU. Nothing here is fast; everything here is exact
about what the fast paths must compute.

Quantization follows vLLM's CUDA kernels (``csrc/quantization/w8a8/fp8/common.cu``):

* dynamic per-token activation quantization (``scaled_fp8_quant(x, use_per_token_if_dynamic=
  True)``): ``amax`` over the row with ``fmaxf`` starting from 0 (NaN ignored, inf kept),
  ``scale = fmaxf(amax / 448, 1 / (448 * 512))``, codes ``= cvt_rn(fmaxf(-448, fminf(x / scale,
  448)))``. ``fminf``/``fmaxf`` return the non-NaN operand, so a NaN quotient becomes +448.
* dynamic per-tensor weight quantization (``scaled_fp8_quant(w)``): ``scale = amax / 448``, codes
  from ``x * (1 / scale)`` (vLLM multiplies by the inverted scale there), clamped the same way.
"""

from __future__ import annotations

from typing import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# min_scaling_factor<c10::Float8_e4m3fn>::val() = 1.0f / (448.0f * 512.0f), computed in fp32.
MIN_SCALE = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX * 512.0, dtype=torch.float32))


def _nan_ignoring_abs_max(xf: torch.Tensor, dim=None) -> torch.Tensor:
    """``fmaxf``-reduction of |x| from 0: NaN never wins, +inf does."""
    a = torch.where(torch.isnan(xf), torch.zeros_like(xf), xf.abs())
    if dim is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=a.dtype, device=a.device)
    return a.amax(dim=dim) if a.shape[dim] else torch.zeros(a.shape[:-1], dtype=a.dtype, device=a.device)


def _clamp_like_cuda(q: torch.Tensor) -> torch.Tensor:
    """``fmaxf(-448, fminf(q, 448))``: NaN -> +448 (fminf returns its non-NaN operand)."""
    q = torch.where(torch.isnan(q), torch.full_like(q, FP8_MAX), q)
    return q.clamp(-FP8_MAX, FP8_MAX)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token FP8 quantization of a [M, K] tensor.

    Returns ``(codes [M, K] float8_e4m3fn, scales [M, 1] float32)``.
    """
    if x.dim() != 2:
        raise ValueError(f"per-token quantization takes a 2-D [tokens, hidden] tensor, got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    amax = _nan_ignoring_abs_max(xf, dim=-1).unsqueeze(-1)
    scale = torch.maximum(amax / torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device),
                          torch.tensor(MIN_SCALE, dtype=torch.float32, device=x.device))
    codes = _clamp_like_cuda(xf / scale).to(FP8_DTYPE)
    return codes, scale


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-tensor FP8 quantization (used for online FP8 weights).

    Returns ``(codes float8_e4m3fn, scale [1] float32)``.
    """
    wf = w.to(torch.float32)
    scale = (_nan_ignoring_abs_max(wf) / torch.tensor(FP8_MAX, dtype=torch.float32, device=w.device)).reshape(1)
    inv = torch.tensor(1.0, dtype=torch.float32, device=w.device) / scale
    codes = _clamp_like_cuda(wf * inv).to(FP8_DTYPE)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes * scale in fp32 (scale broadcast: [M, 1] per token or [1] per tensor)."""
    return codes.to(torch.float32) * scale.to(torch.float32)


def fp8_scaled_mm(x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor,
                  w_scale: torch.Tensor) -> torch.Tensor:
    """The base GEMM: (x_q * s_x) @ (W_q * s_w)^T in fp32. W is [N, K] (vLLM stores it so)."""
    return dequantize_fp8(x_codes, x_scale) @ dequantize_fp8(w_codes, w_scale).t()


def _as_slice_list(t) -> list[torch.Tensor]:
    return list(t) if isinstance(t, (list, tuple)) else [t]


def adapter_view(buf: torch.Tensor, name: str = "adapter buffer", dims: str = "rows, cols") -> torch.Tensor:
    """An adapter stack as the [max_loras, rows, cols] view every op and kernel entry reads: vLLM
    stacks adapters as [max_loras, 1, rows, cols] (A: rows = rank, cols = K; B: rows = n, cols =
    rank); a 3-D stack is taken as it is. Anything else is an error naming ``name`` and ``dims``."""
    if buf.dim() == 4:
        if buf.shape[1] != 1:
            raise ValueError(f"{name}: vLLM adapter buffers are [max_loras, 1, {dims}], got {tuple(buf.shape)}")
        return buf[:, 0]
    if buf.dim() != 3:
        raise ValueError(f"{name}: expected [max_loras, 1, {dims}] or [max_loras, {dims}], got {tuple(buf.shape)}")
    return buf


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor] | torch.Tensor,
                token_lora: torch.Tensor, scale: float = 1.0) -> list[torch.Tensor]:
    """h_s[m] = scale * x[m] @ A_s[token_lora[m]]^T in fp32, per slice s; zero for id -1.

    ``lora_a`` is one buffer per output slice, each [max_loras, (1,) rank, K].
    Returns one fp32 [M, rank] tensor per slice.
    """
    xf = x.to(torch.float32)
    ids = token_lora.to(torch.long)
    out = []
    for a in _as_slice_list(lora_a):
        a = adapter_view(a)
        h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
        # One small GEMM per adapter present (not a per-token copy of A: that is GBs at 2048 tokens).
        for slot in torch.unique(ids[ids >= 0]).tolist():
            rows = ids == slot
            h[rows] = (xf[rows] @ a[slot].to(torch.float32).t()) * scale
        out.append(h)
    return out


def lora_expand(h: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor] | torch.Tensor,
                token_lora: torch.Tensor) -> torch.Tensor:
    """delta[m, slice s columns] = h_s[m] @ B_s[token_lora[m]]^T in fp32, concatenated over slices.

    ``lora_b`` is one buffer per slice, each [max_loras, (1,) n_s, rank].
    """
    ids = token_lora.to(torch.long)
    parts = []
    for hs, b in zip(h, _as_slice_list(lora_b)):
        b = adapter_view(b)
        d = torch.zeros(hs.shape[0], b.shape[1], dtype=torch.float32, device=hs.device)
        for slot in torch.unique(ids[ids >= 0]).tolist():
            rows = ids == slot
            d[rows] = hs[rows].to(torch.float32) @ b[slot].to(torch.float32).t()
        parts.append(d)
    return torch.cat(parts, dim=1)


def lora_linear(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                lora_a: Sequence[torch.Tensor] | torch.Tensor,
                lora_b: Sequence[torch.Tensor] | torch.Tensor,
                token_lora: torch.Tensor, *, quantize_activations: bool = True) -> torch.Tensor:
    """The multi-adapter LoRA linear over a batch, in fp32.

    y = x_q * s_x @ (W_q * s_w)^T + concat_s(h_s @ B_s^T), h_s = x @ A_s^T (bf16 x, not x_q).

    * ``w_codes`` [N, K] FP8, ``w_scale`` [1] fp32 (per-tensor); N = sum of the slice widths.
    * ``lora_a`` / ``lora_b``: per output slice (q/k/v of unequal widths, gate/up, or one), in
      vLLM's stacked layout; vLLM folds alpha/r into B when it loads an adapter, so no scale here.
      Smaller effective ranks are zero-padded to the buffer's rank.
    * ``token_lora`` [M] int: the adapter slot of every token, -1 for none.
    * ``quantize_activations=False`` gives the W8A16 arithmetic (bf16 x against FP8 weights).
    """
    if quantize_activations:
        xq, sx = quantize_fp8_per_token(x)
        base = fp8_scaled_mm(xq, sx, w_codes, w_scale)
    else:
        base = x.to(torch.float32) @ dequantize_fp8(w_codes, w_scale).t()
    a_list, b_list = _as_slice_list(lora_a), _as_slice_list(lora_b)
    widths = [adapter_view(b).shape[1] for b in b_list]
    if sum(widths) != w_codes.shape[0]:
        raise ValueError(f"slice widths {widths} do not add up to the weight's {w_codes.shape[0]} rows")
    h = lora_shrink(x, a_list, token_lora)
    return base + lora_expand(h, b_list, token_lora)
