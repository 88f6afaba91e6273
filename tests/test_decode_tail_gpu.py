"""The decode pair's shortened tails (docs/perf.md v0.55) bit for bit against the shipped builds, on
the GPU: K2's lean epilogue (k2_gemm.Config.lean_epilogue, EPILORA_K2_LEAN_EPILOGUE: s_w loaded
before the main loop, a full rank chunk's k16 steps without branches) and the shrink's one-round
h hand-off (lora_shrink.Config.one_round, EPILORA_SHRINK_ONE_ROUND: the split-K partials in one
round of DSMEM loads, the last cluster arrive relaxed). Both keep every sum's operands and order,
so y and h must equal the shipped builds' bit for bit; each is also checked against the reference.
`tools/gpu_session.sh tail-tests` runs this file."""
from __future__ import annotations

import pytest
import torch

from epilora_cute.reference import quantize_fp8_per_token
from kernels_dsl import k2_gemm, lora_shrink
from tests.test_k2_gpu import SHAPES, DecodePath, _hopper, _kernel, _launch, _tokens, _x

pytestmark = pytest.mark.gpu

FLAGS = {"both": ("1", "1"), "lean": ("1", "0"), "one_round": ("0", "1")}


def _set(monkeypatch, lean: str, one_round: str) -> None:
    monkeypatch.setenv(k2_gemm.LEAN_ENV, lean)
    monkeypatch.setenv(lora_shrink.ONE_ROUND_ENV, one_round)


def _tail_pair(monkeypatch, widths, K, M, flags, seed, self_quant=True, split_k2=None, split_shrink=None,
               n_adapters=3, max_loras=4, slot_ranks=None):
    """h and y of the shipped builds and of the tail builds (flags) on the same projection, batch
    and splits (one DecodePath: run() selects its builds per call from the environment); the tail
    builds' y checked against the reference too."""
    x, tok = _x(M, K, seed), _tokens(M, n_adapters, seed)
    dp = DecodePath(widths, K, 64, max_loras, M, seed=seed, self_quant=self_quant, slot_ranks=slot_ranks)
    _set(monkeypatch, "0", "0")
    y0 = dp.run(x, tok, split_k2=split_k2, split_shrink=split_shrink).clone()
    h0 = dp.h.clone()
    base_cfg = dp.k_cfg
    want_lean = FLAGS[flags][0] == "1"
    if want_lean and not k2_gemm.lean_variant(base_cfg).lean_epilogue:
        pytest.skip(f"no lean build of {base_cfg.name()}")
    _set(monkeypatch, *FLAGS[flags])
    y1 = dp.run(x, tok, split_k2=split_k2, split_shrink=split_shrink).clone()
    assert dp.k_cfg == (k2_gemm.lean_variant(base_cfg) if want_lean else base_cfg), (dp.k_cfg.name(), flags)
    dp.check(x, tok, y1)
    torch.cuda.synchronize()
    # h: every element the shrink writes, and the poison it leaves elsewhere, identical.
    assert torch.equal(dp.h.view(torch.int32), h0.view(torch.int32)), "h differs from the shipped shrink's"
    bad = (y1.view(torch.int16) != y0.view(torch.int16)).nonzero()
    assert bad.numel() == 0, f"{dp.k_cfg.name()}: {bad.shape[0]} elements differ from {base_cfg.name()}, " \
                             f"first {bad[:4].tolist()}"
    for _ in range(3):  # again: bitwise reproducible
        assert torch.equal(dp.run(x, tok, split_k2=split_k2, split_shrink=split_shrink).view(torch.int16),
                           y0.view(torch.int16))


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("M,self_quant", [(1, True), (3, True), (8, True), (3, False), (17, False), (32, False)])
@pytest.mark.parametrize("split_shrink", [1, 2, 3, 5, 8])
def test_tail_bit_identical_splits(monkeypatch, flags, M, self_quant, split_shrink):
    """The shrink's cluster sizes (choose_split's 1..8; one round where a thread owns at most two
    elements, the loop otherwise: 32 tokens at split 1..5), each flag alone and both, with 1..8
    adapters and tokens without one."""
    _hopper()
    _tail_pair(monkeypatch, (4096, 1024, 1024), 4096, M, flags, seed=split_shrink * 13 + M, self_quant=self_quant,
               split_shrink=split_shrink, n_adapters=min(M, 8), max_loras=8)


@pytest.mark.parametrize("M,self_quant", [(1, True), (5, True), (9, False), (32, False)])
@pytest.mark.parametrize("split_k2", [1, 2, 4, 8])
def test_tail_bit_identical_k2_splits(monkeypatch, M, self_quant, split_k2):
    """K2's cluster sizes with the lean epilogue (the partials' push and the reduction after it)."""
    _hopper()
    _tail_pair(monkeypatch, (4096,), 4096, M, "both", seed=split_k2 * 5 + M, self_quant=self_quant,
               split_k2=split_k2)


@pytest.mark.parametrize("M,self_quant", [(1, True), (6, True), (12, False), (32, False)])
def test_tail_mixed_effective_ranks(monkeypatch, M, self_quant):
    """Slots whose effective rank leaves the chunk partly empty (the lean build's branched steps),
    full (its unbranched ones) or zero (no item)."""
    _hopper()
    _tail_pair(monkeypatch, (4096, 1024, 1024), 4096, M, "both", seed=M + 71, self_quant=self_quant,
               n_adapters=4, max_loras=4, slot_ranks=[64, 16, 40, 0])


@pytest.mark.parametrize("M", [1, 8, 16, 32])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_lean_no_adapter_bit_identical(M, split):
    """The no-adapter K2 (x_q given, the path "no_adapter") with the lean epilogue, bitwise the
    shipped build."""
    _hopper()
    K, N = 4096, 4096
    dp = DecodePath((N,), K, 16, 2, M, seed=5)
    xq, sx = quantize_fp8_per_token(_x(M, K, 5 + M))
    dp.x_q.copy_(xq)
    dp.x_scale.copy_(sx.reshape(-1))
    ys = []
    for lean in (False, True):
        _, cfg = k2_gemm.select((N,), M, lean=lean)
        assert cfg.lean_epilogue == lean
        spec = k2_gemm.launch(cfg, w_q=dp.w_codes, w_scale=dp.w_scale, x_q=dp.x_q, x_scale=dp.x_scale, y=dp.y,
                              sync=dp.sync, n_quant=0, split=split)
        dp.y.fill_(float("nan"))
        _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
        ys.append(dp.y.clone())
    assert not torch.isnan(ys[0]).any()
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-tp{s[1]}-{s[2]}")
@pytest.mark.parametrize("M", [1, 8, 32])
def test_tail_bit_identical_model_shapes(monkeypatch, shape, M):
    """Last in the file: the 72B shapes' weights take the longest to set up."""
    _hopper()
    _, _, _, widths, K = shape
    _tail_pair(monkeypatch, widths, K, M, "both", seed=M + 23)
