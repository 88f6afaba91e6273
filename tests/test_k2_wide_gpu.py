"""The wide self-quantizing K2 builds (Config.sq_xblocks: 32 resident k-blocks of x_q,
EPILORA_K2_SQ_WIDE; docs/perf.md v0.54) on the GPU: against the reference where they lower the
split (gate_up and down of the supported models at 1..6 tokens), bit for bit against the default
build at the same split, at every cluster size they can run, the codes through an identity weight
at split 1, and repeated runs. `gpu_session.sh wide-tests` runs this file."""
from __future__ import annotations

import pytest
import torch

from epilora_cute.metadata import build_meta
from epilora_cute.reference import quantize_fp8_per_token
from kernels_dsl import k2_gemm
from tests.test_k2_gpu import SHAPES, DecodePath, _hopper, _kernel, _launch, _special_rows, _tokens, _x

pytestmark = pytest.mark.gpu

WIDE_SHAPES = [s for s in SHAPES if s[2] in ("gate_up", "down")]


def _bits(y):
    return y.view(torch.int16)


@pytest.mark.parametrize("M", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("split", [1, 2, 3, 5, 8, 16])
def test_wide_split_k(M, split):
    """Every cluster size the wide build can run M tokens of K = 4096 at (a CTA holds at most
    min(32, 128 / M) k-blocks), against the reference, and bit for bit the default build at the
    same split where that one can run it too (split >= 2)."""
    _hopper()
    widths, K = (4096, 1024, 1024), 4096
    wide = k2_gemm.wide_config(k2_gemm.select(widths, M, 64, self_quant=True)[0])
    if split < k2_gemm.min_split(wide, K, M):
        pytest.skip(f"split {split} is below the wide build's minimum at {M} tokens")
    x, tok = _x(M, K, split + M), _tokens(M, 3, split + M)
    forced = DecodePath(widths, K, 64, 4, M, seed=split * 3 + M, wide="always")
    y1 = forced.run(x, tok, split_k2=split).clone()
    assert forced.k_cfg == wide
    forced.check(x, tok, y1)
    if split >= k2_gemm.min_split(k2_gemm.select(widths, M, 64, self_quant=True)[0], K, M):
        ref = DecodePath(widths, K, 64, 4, M, seed=split * 3 + M, wide=False)
        y0 = ref.run(x, tok, split_k2=split)
        assert torch.equal(_bits(y0), _bits(y1)), f"{forced.k_cfg.name()} != {ref.k_cfg.name()} at split {split}"


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("lora", [False, True])
def test_wide_self_quant_codes_bit_exact(M, lora):
    """The wide builds' codes through an identity weight at split 1 (one CTA quantizes the whole
    row, 32 k-blocks): y = the dequantized codes bit for bit, as test_self_quant_codes_bit_exact
    checks the default builds (tokens without adapter: the epilogue adds nothing)."""
    _hopper()
    K, dev = 4096, "cuda"
    x = _special_rows(M, K, K + M + 100)
    xq_ref, sx_ref = quantize_fp8_per_token(x.cpu())
    want = (xq_ref.float() * sx_ref.reshape(-1, 1)).to(torch.bfloat16) + 0.0  # (-0 codes sum to +0)
    w = torch.eye(K, dtype=torch.float32).to(torch.float8_e4m3fn).to(dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    y = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=dev)
    lcfg, ncfg = (k2_gemm.wide_config(c) for c in k2_gemm.select((K,), M, 64, self_quant=True))
    cfg = lcfg if lora else ncfg
    kw = {}
    if lora:
        dp = DecodePath((K,), K, 64, 2, M, seed=1)
        meta = build_meta(torch.full((M,), -1, dtype=torch.int32, device=dev), 2)
        dp.h.zero_()
        kw = dict(h=dp.h, token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                  num_active=meta.num_active, slot_ranks=dp.slot_ranks, slice_start=dp.slice_start,
                  lora_b=dp.lora_b)
    spec = k2_gemm.launch(cfg, w_q=w, w_scale=one, x=x, y=y, split=1, **kw)
    _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
    bad = (y.cpu().view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.numel() == 0, f"{cfg.name()}: {bad.shape[0]} codes differ, first at {bad[:4].tolist()}"


def test_wide_bitwise_identical_over_10_runs():
    _hopper()
    widths, K, M = (12288, 12288), 4096, 3
    dp = DecodePath(widths, K, 64, 4, M, seed=77, wide=True)
    x, tok = _x(M, K, 77), _tokens(M, 3, 77)
    y0 = dp.run(x, tok).clone()
    assert dp.k_cfg.sq_xblocks and k2_gemm.split_for(dp.k_cfg, sum(widths), K, M) == 1
    dp.check(x, tok, y0)
    for _ in range(9):
        assert torch.equal(_bits(dp.run(x, tok)), _bits(y0))


@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=lambda s: f"{s[0]}-tp{s[1]}-{s[2]}")
@pytest.mark.parametrize("M", [1, 4, 6])
def test_wide_model_shapes_against_reference_and_default(shape, M):
    """Where select() takes the wide build (its own, smaller split): against the reference; and
    the wide build at the default build's split, bit for bit the default's y."""
    _hopper()
    _, _, _, widths, K = shape
    if not k2_gemm.self_quant_applies(M, K):  # (the 72B TP = 2 down: K = 14784 is no multiple of 128)
        pytest.skip(f"the self-quantizing K2 does not take K = {K}")
    if not k2_gemm.select(widths, M, 64, self_quant=True, k=K, wide=True)[0].sq_xblocks:
        pytest.skip(f"the wide build does not lower the split of {shape[2]} at {M} tokens")
    x, tok = _x(M, K, M + 5), _tokens(M, 3, M + 5)
    dp = DecodePath(widths, K, 64, 4, M, seed=M, wide=True)
    y = dp.run(x, tok)
    assert dp.k_cfg.sq_xblocks
    dp.check(x, tok, y)
    ref = DecodePath(widths, K, 64, 4, M, seed=M, wide=False)
    y0 = ref.run(x, tok).clone()
    split0 = k2_gemm.split_for(ref.k_cfg, sum(widths), K, M)
    forced = DecodePath(widths, K, 64, 4, M, seed=M, wide="always")
    y1 = forced.run(x, tok, split_k2=split0)
    bad = (_bits(y1) != _bits(y0)).nonzero()
    assert bad.numel() == 0, f"{forced.k_cfg.name()} at split {split0}: {bad.shape[0]} elements differ from " \
                             f"{ref.k_cfg.name()}, first {bad[:4].tolist()}"
