"""The CuTe per-token FP8 quantization kernel on the GPU: bit-exact against the reference and vLLM."""

import importlib.util

import pytest
import torch

from epilora_cute import ops, reference

pytestmark = pytest.mark.gpu

MS = [1, 3, 16, 255, 2048, 8192]
KS = [4096, 5120, 12288, 8192 + 16]


def _inputs(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Rows span 12 decades of magnitude, so scales hit the MIN_SCALE clamp and large values alike.
    mag = torch.logspace(-8, 4, m, device="cuda")[torch.randperm(m, device="cuda", generator=g)]
    x = torch.randn(m, k, device="cuda", generator=g) * mag[:, None]
    return x.bfloat16()


def _special_rows(k):
    nan, inf = float("nan"), float("inf")
    rows = torch.randn(6, k, device="cuda")
    rows[0] = 0                                    # all zero
    rows[1, ::7] = nan                             # NaN ignored by amax, coded +448
    rows[2, 1] = inf; rows[2, 3] = -inf            # inf amax: scale inf
    rows[3] = torch.randn(k, device="cuda") * 1e-39  # bf16 denormals
    rows[4] = 1.0625 * 448 / 448                   # exact ties after the scale (see test_reference)
    rows[4, 0] = 448.0
    rows[5, :] = nan                               # all NaN
    return rows.bfloat16()


def _assert_same(codes, scales, x):
    rc, rs = reference.quantize_fp8_per_token(x.cpu())
    assert torch.equal(scales.cpu().view(torch.int32), rs.view(torch.int32)), "scales differ"
    diff = (codes.cpu().view(torch.uint8) != rc.view(torch.uint8))
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_bit_exact_against_reference(m, k):
    x = _inputs(m, k, seed=m * 7 + k)
    codes = torch.full((m, k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # poison: NaN
    scales = torch.full((m, 1), float("nan"), device="cuda")
    ops.quantize_fp8_per_token(x, codes, scales)
    _assert_same(codes, scales, x)


@pytest.mark.parametrize("k", [8, 24, 4096, 8208, 29568])
def test_special_values(k):
    x = _special_rows(k)
    _assert_same(*ops.quantize_fp8_per_token(x), x)


def test_strided_rows_and_repeatability():
    base = _inputs(64, 4096 + 64, seed=3)
    x = base[:, 32:32 + 4096]  # row stride 4160, 64-byte offset: still 16-byte aligned
    c1, s1 = ops.quantize_fp8_per_token(x)
    _assert_same(c1, s1, x)
    for _ in range(10):
        c2, s2 = ops.quantize_fp8_per_token(x)
        assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(s1, s2)


def test_unaligned_falls_back_bit_exact():
    base = _inputs(4, 4096 + 8, seed=5)
    x = base[:, 1:1 + 4096]  # 2-byte offset: the kernel can't take it, the reference can
    _assert_same(*ops.quantize_fp8_per_token(x), x)


def test_cuda_graph_capture_and_pdl_launch():
    from kernels_dsl import fp8_quant
    from epilora_cute.kernels import get_kernel
    from epilora_cute.arch import arch_of

    x = _inputs(16, 4096, seed=11)
    codes = torch.empty(16, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(16, 1, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ops.quantize_fp8_per_token(x, codes, scales)  # load the module outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        ops.quantize_fp8_per_token(x, codes, scales)
    x.copy_(_inputs(16, 4096, seed=12))
    codes.view(torch.uint8).fill_(0x7F)
    g.replay()
    _assert_same(codes, scales, x)
    # The same kernel launched with programmatic stream serialization (no wait inside: it
    # simply must not break ordering with the previous kernel on the stream).
    cfg = fp8_quant.config_for(4096)
    k = get_kernel(fp8_quant, cfg, arch_of(x))
    x.copy_(_inputs(16, 4096, seed=13))
    k(x, codes, scales, grid=(16, 1, 1), smem=cfg.smem_bytes, pdl=True)
    _assert_same(codes, scales, x)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("m,k", [(1, 4096), (255, 12288), (2048, 8208), (8192, 5120)])
def test_bit_exact_against_vllm(m, k):
    from vllm import _custom_ops as vllm_ops

    x = _inputs(m, k, seed=m + k)
    x[0] = _special_rows(k)[1]
    if m > 3:
        x[1] = 0
        x[2] = _special_rows(k)[3]
    vc, vs = vllm_ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    c, s = ops.quantize_fp8_per_token(x)
    assert torch.equal(s.view(torch.int32), vs.view(torch.int32))
    assert torch.equal(c.view(torch.uint8), vc.view(torch.uint8))
