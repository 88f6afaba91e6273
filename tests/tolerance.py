"""How close an adapter path's bf16 y must be to the fp32 reference.

The kernels round as stock vLLM does: y = bf16(bf16(base) + bf16(adapter)) (k2_gemm / k2_prefill /
expand_add Config.stock_round). Each term's own rounding is up to half an ulp of that term, and
an accumulation-order difference can move it by one ulp; where the terms cancel, that exceeds any
tolerance taken from the sum alone. So the bound adds 2^-8 of each term's magnitude (one bf16 ulp,
relative) to the usual rtol / atol of the sum.
"""

from __future__ import annotations

import torch

from epilora_cute.reference import lora_linear_parts


def assert_lora_close(y: torch.Tensor, base: torch.Tensor, adapter: torch.Tensor, rtol: float = 2e-2,
                      atol: float = 2e-2) -> None:
    ref = base + adapter
    tol = atol + rtol * ref.abs() + 2.0 ** -8 * (base.abs() + adapter.abs())
    d = (y.float() - ref).abs()
    bad = d > tol
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        r, c = divmod(i, y.shape[-1])
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} elements off; first at ({r}, {c}): y "
                             f"{float(y.reshape(-1)[i])} vs {float(ref.reshape(-1)[i])} (base "
                             f"{float(base.reshape(-1)[i])}, adapter {float(adapter.reshape(-1)[i])})")


def assert_matches_lora_linear(y, x, w_codes, w_scale, lora_a, lora_b, token_lora, **tol) -> None:
    """assert_lora_close against reference.lora_linear_parts of these inputs."""
    base, adapter = lora_linear_parts(x, w_codes, w_scale, lora_a, lora_b, token_lora)
    assert_lora_close(y, base, adapter, **tol)
