"""Public ops on the CPU: reference fallback and clear errors for bad input."""

import pytest
import torch

from epilora_cute import ops, reference


def test_cpu_quant_equals_reference():
    x = torch.randn(5, 64).bfloat16()
    c, s = ops.quantize_fp8_per_token(x)
    rc, rs = reference.quantize_fp8_per_token(x)
    assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(s, rs)


def test_quant_writes_into_given_buffers():
    x = torch.randn(3, 16).bfloat16()
    c = torch.empty(3, 16, dtype=torch.float8_e4m3fn)
    s = torch.full((3, 1), float("nan"))
    c2, s2 = ops.quantize_fp8_per_token(x, c, s)
    assert c2 is c and s2 is s and not torch.isnan(s).any()


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: torch.randn(4, 8), TypeError, "bfloat16"),
    (lambda: torch.randn(4, 8).half(), TypeError, "bfloat16"),
    (lambda: torch.randn(2, 4, 8).bfloat16(), ValueError, "2-D"),
    (lambda: [[1.0]], TypeError, "torch.Tensor"),
])
def test_quant_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        ops.quantize_fp8_per_token(bad())


def test_quant_bad_output_buffers():
    x = torch.randn(3, 16).bfloat16()
    with pytest.raises(ValueError, match="codes must be"):
        ops.quantize_fp8_per_token(x, torch.empty(3, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="float32"):
        ops.quantize_fp8_per_token(x, None, torch.empty(3, 1, dtype=torch.float16))
