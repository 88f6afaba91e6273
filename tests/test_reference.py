"""The reference against plain loops and golden values (CPU)."""

import math
import struct

import pytest
import torch

from epilora_cute import reference as ref

E4M3_MAX_CODE = 0x7E


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def e4m3_values():
    """Every finite e4m3fn value with its byte code."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    return {int(c): float(v) for c, v in zip(codes, vals) if math.isfinite(float(v))}


def loop_quant_row(row: list[float]) -> tuple[list[int], float]:
    """Scalar restatement of vLLM's kernel: fmaxf from 0, IEEE fp32 divide, clamp, RNE."""
    amax = 0.0
    for v in row:
        if not math.isnan(v):
            amax = max(amax, abs(v))
    scale = f32(max(f32(f32(amax) / 448.0) if math.isfinite(amax) else math.inf, ref.MIN_SCALE))
    table = sorted((v, c) for c, v in e4m3_values().items())
    out = []
    for v in row:
        q = f32(v / scale) if math.isfinite(scale) else (math.nan if math.isinf(v) else 0.0 * v)
        if math.isnan(q):
            q = 448.0
        q = min(max(q, -448.0), 448.0)
        out.append(_rne_code(q, table))
    return out, scale


def _rne_code(q: float, table) -> int:
    # Nearest e4m3 value; ties go to the even code (even mantissa LSB).
    best = min(table, key=lambda vc: (abs(vc[0] - q), vc[1] & 1, -(math.copysign(1, vc[0]) == math.copysign(1, q))))
    if q == 0.0:
        return 0x80 if math.copysign(1, q) < 0 else 0x00
    return best[1]


@pytest.mark.parametrize("m,k", [(1, 16), (3, 40), (5, 8)])
def test_per_token_quant_matches_loops(m, k):
    g = torch.Generator().manual_seed(m * 100 + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).bfloat16()
    codes, scales = ref.quantize_fp8_per_token(x)
    for i in range(m):
        want_codes, want_scale = loop_quant_row(x[i].float().tolist())
        assert scales[i, 0].item() == want_scale
        assert codes[i].view(torch.uint8).tolist() == want_codes


def test_special_values_follow_vllm_kernel():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([
        [0.0] * 8,                                      # zero row: scale = MIN_SCALE, codes 0
        [1.0, -1.0, nan, 2.0, 0.0, -0.0, 4.0, 448.0],   # NaN ignored by the amax, becomes +448
        [inf, 1.0, -inf, 2.0, 0.0, 3.0, nan, -5.0],     # inf amax: scale inf, finite -> 0, inf -> NaN -> 448
        [1e-38, -1e-39, 3e-39, 0.0, 0.0, 0.0, 0.0, 0.0],  # denormal-scale row: MIN_SCALE clamp
    ], dtype=torch.float32).bfloat16()
    codes, scales = ref.quantize_fp8_per_token(x)
    c = codes.view(torch.uint8)
    assert scales[0, 0].item() == ref.MIN_SCALE and c[0].tolist() == [0] * 8
    assert c[1, 2].item() == E4M3_MAX_CODE and c[1, 7].item() == E4M3_MAX_CODE
    assert scales[1, 0].item() == f32(448.0 / 448.0)
    assert math.isinf(scales[2, 0].item())
    assert c[2, 0].item() == E4M3_MAX_CODE and c[2, 2].item() == E4M3_MAX_CODE and c[2, 6].item() == E4M3_MAX_CODE
    assert c[2, 1].item() == 0 and c[2, 7].item() == 0x80  # -5/inf = -0
    assert scales[3, 0].item() == ref.MIN_SCALE
    for i in range(4):
        want, s = loop_quant_row(x[i].float().tolist())
        assert c[i].tolist() == want, i


def test_ties_round_to_even():
    # amax 448 -> scale exactly 1: x is its own quotient. 1.0625 lies halfway between 1.0 (0x38)
    # and 1.125 (0x39): RNE picks the even code 0x38; 1.1875 between 0x39 and 0x3A picks 0x3A.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 0.0, 0.0, 0.0, 0.0]]).bfloat16()
    codes, scales = ref.quantize_fp8_per_token(x)
    assert scales.item() == 1.0
    assert codes.view(torch.uint8)[0, :4].tolist() == [0x7E, 0x38, 0x3A, 0xB8]


def test_per_tensor_weight_quant():
    w = torch.randn(64, 32).bfloat16()
    codes, scale = ref.quantize_fp8_per_tensor(w)
    amax = w.float().abs().max()
    assert scale.item() == f32(amax.item() / 448.0)
    inv = f32(1.0 / scale.item())
    want = (w.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))


def _loop_lora_linear(x, wq, ws, a_slices, b_slices, ids):
    xq, sx = ref.quantize_fp8_per_token(x)
    w = wq.double() * ws.double()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for m in range(x.shape[0]):
        base = (xq[m].double() * sx[m].double()) @ w.t()
        col = 0
        for a, b in zip(a_slices, b_slices):
            n = b.shape[2]
            if ids[m] >= 0:
                h = a[ids[m], 0].double() @ x[m].double()
                base[col:col + n] += b[ids[m], 0].double() @ h
            col += n
        out[m] = base
    return out


def test_lora_linear_matches_loops_with_slices_and_no_adapter_tokens():
    g = torch.Generator().manual_seed(0)
    m, k, widths, rank, loras = 7, 32, (16, 8, 8), 4, 3
    x = torch.randn(m, k, generator=g).bfloat16()
    wq, ws = ref.quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g))
    a = [torch.randn(loras, 1, rank, k, generator=g).bfloat16() for _ in widths]
    b = [torch.randn(loras, 1, n, rank, generator=g).bfloat16() for n in widths]
    b[1][2, 0, :, 2:] = 0  # slot 2 of slice 1 has effective rank 2 (zero padded)
    ids = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    y = ref.lora_linear(x, wq, ws, a, b, ids)
    want = _loop_lora_linear(x, wq, ws, a, b, ids.tolist())
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)


def test_lora_linear_rejects_mismatched_slices():
    x = torch.randn(2, 16).bfloat16()
    wq, ws = ref.quantize_fp8_per_tensor(torch.randn(24, 16))
    a = [torch.zeros(1, 1, 4, 16).bfloat16()]
    b = [torch.zeros(1, 1, 16, 4).bfloat16()]
    with pytest.raises(ValueError, match="slice widths"):
        ref.lora_linear(x, wq, ws, a, b, torch.tensor([0, -1]))


def test_w8a16_mode_uses_unrounded_activations():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=g).bfloat16()
    wq, ws = ref.quantize_fp8_per_tensor(torch.randn(8, 16, generator=g))
    a = [torch.zeros(1, 1, 4, 16).bfloat16()]
    b = [torch.zeros(1, 1, 8, 4).bfloat16()]
    y = ref.lora_linear(x, wq, ws, a, b, torch.tensor([-1, -1, -1]), quantize_activations=False)
    assert torch.allclose(y, x.float() @ (wq.float() * ws).t())


def test_adapter_view_takes_vllms_stack_or_3d_and_names_bad_buffers():
    """vLLM's [max_loras, 1, rows, cols] stacks (and 3-D ones) become [max_loras, rows, cols] views;
    any other shape is an error naming the buffer (every kernel entry reads buffers through it)."""
    b = torch.randn(3, 1, 8, 4)
    v = ref.adapter_view(b)
    assert v.shape == (3, 8, 4) and v.data_ptr() == b.data_ptr()
    assert ref.adapter_view(v) is v
    with pytest.raises(ValueError, match=r"lora_b\[1\]: vLLM adapter buffers are \[max_loras, 1, n, rank\]"):
        ref.adapter_view(torch.randn(3, 2, 8, 4), "lora_b[1]", "n, rank")
    with pytest.raises(ValueError, match=r"lora_a: expected \[max_loras, 1, rank, K\]"):
        ref.adapter_view(torch.randn(8, 4), "lora_a", "rank, K")
