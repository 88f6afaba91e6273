"""The K2 push builds (Config.push_maxima / push_partials, EPILORA_K2_PUSH; docs/perf.md v0.50-v0.52)
bit for bit against the builds without pushes, on the GPU: the model shapes at 1..32 tokens with
the combination that ships, every cluster size and the self-quantizing codes with each flag alone
and both, the no-adapter K2. A file of its own so tests/test_k2_gpu.py stays inside one device
call's per-file limit (tools/gpu_session.sh check); `gpu_session.sh push-tests` runs this one."""
from __future__ import annotations

import pytest
import torch

from epilora_cute.reference import quantize_fp8_per_token
from kernels_dsl import k2_gemm
from tests.test_k2_gpu import SHAPES, DecodePath, _hopper, _kernel, _launch, _special_rows, _tokens, _x

pytestmark = pytest.mark.gpu


PUSH_SETS = ["maxima", "partials", "maxima,partials"]
SHIPPED = [k2_gemm.PUSH_DEFAULT]  # the model shapes run the combination that ships; the flags alone below


def _applies(cfg, push):
    return (cfg.push_maxima or cfg.push_partials) and cfg.push_maxima == ("maxima" in push and cfg.self_quant) \
        and cfg.push_partials == ("partials" in push)


def _push_pair(widths, K, M, push, seed, self_quant=True, split_k2=None, n_adapters=3, max_loras=4):
    """y of the default build and of the push build on the same projection, batch and split."""
    x, tok = _x(M, K, seed), _tokens(M, n_adapters, seed)
    ref = DecodePath(widths, K, 64, max_loras, M, seed=seed, self_quant=self_quant, push="")
    y0 = ref.run(x, tok, split_k2=split_k2).clone()
    ref.check(x, tok, y0)
    dp = DecodePath(widths, K, 64, max_loras, M, seed=seed, self_quant=self_quant, push=push)
    y1 = dp.run(x, tok, split_k2=split_k2)
    if not _applies(dp.k_cfg, push):
        pytest.skip(f"{push} does not apply to {dp.k_cfg.name()}")
    torch.cuda.synchronize()
    bad = (y1.view(torch.int16) != y0.view(torch.int16)).nonzero()
    assert bad.numel() == 0, f"{dp.k_cfg.name()}: {bad.shape[0]} elements differ from {ref.k_cfg.name()}, " \
                             f"first {bad[:4].tolist()}"
    for _ in range(3):  # and again (the mbarriers' single phase, re-initialised per launch)
        assert torch.equal(dp.run(x, tok, split_k2=split_k2).view(torch.int16), y0.view(torch.int16))


@pytest.mark.parametrize("push", SHIPPED)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-tp{s[1]}-{s[2]}")
@pytest.mark.parametrize("M", [1, 4, 8, 16, 32])
def test_push_bit_identical_model_shapes(push, shape, M):
    _hopper()
    _, _, _, widths, K = shape
    _push_pair(widths, K, M, push, seed=M + 11)


@pytest.mark.parametrize("push", PUSH_SETS)
@pytest.mark.parametrize("M,self_quant", [(1, True), (3, True), (8, True), (3, False), (9, False), (32, False)])
@pytest.mark.parametrize("split", [1, 2, 3, 5, 8, 16])
def test_push_bit_identical_split_k(push, M, self_quant, split):
    """Every cluster size (16: the non-portable one), the maxima's and the partials' exchange."""
    _hopper()
    if split == 16 and not self_quant:
        pytest.skip("split 16 is the self-quantizing builds' (x_q builds stop at 8)")
    _push_pair((4096, 1024, 1024), 4096, M, push, seed=split * 7 + M, self_quant=self_quant, split_k2=split)


@pytest.mark.parametrize("push", PUSH_SETS)
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("split", [None, 16])
def test_push_self_quant_codes_bit_exact(push, M, split):
    """The self-quantizing codes through an identity weight with the push builds (the maxima's
    exchange decides every scale): test_self_quant_codes_bit_exact's check."""
    _hopper()
    K = 4096
    x = _special_rows(M, K, K + M)
    xq_ref, sx_ref = quantize_fp8_per_token(x.cpu())
    want = (xq_ref.float() * sx_ref.reshape(-1, 1)).to(torch.bfloat16) + 0.0
    w = torch.eye(K, dtype=torch.float32).to(torch.float8_e4m3fn).to("cuda")
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    y = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    _, cfg = k2_gemm.select((K,), M, 64, self_quant=True, push=push)
    assert _applies(cfg, push), cfg.name()
    spec = k2_gemm.launch(cfg, w_q=w, w_scale=one, x=x, y=y, split=split or k2_gemm.split_for(cfg, K, K))
    _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
    bad = (y.cpu().view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} codes differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("M", [1, 8, 16, 32])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_push_partials_no_adapter_bit_identical(M, split):
    """The no-adapter K2 (x_q given, the path "no_adapter") with push_partials, bitwise the default."""
    _hopper()
    K, N = 4096, 4096
    dp = DecodePath((N,), K, 16, 2, M, seed=3)
    xq, sx = quantize_fp8_per_token(_x(M, K, 3 + M))
    dp.x_q.copy_(xq)
    dp.x_scale.copy_(sx.reshape(-1))
    ys = []
    for push in ("", "partials"):
        _, cfg = k2_gemm.select((N,), M, push=push)
        assert cfg.push_partials == (push == "partials")
        spec = k2_gemm.launch(cfg, w_q=dp.w_codes, w_scale=dp.w_scale, x_q=dp.x_q, x_scale=dp.x_scale, y=dp.y,
                              sync=dp.sync, n_quant=0, split=split)
        dp.y.fill_(float("nan"))
        _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
        ys.append(dp.y.clone())
    assert not torch.isnan(ys[0]).any()
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
