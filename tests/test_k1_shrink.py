"""K1 for large batches (kernels_dsl/k1_shrink.py): fused FP8 per-token quantization + split-K LoRA
shrink. CPU emulation against the reference, compile/PTX/ABI checks with nvidia-cutlass-dsl 4.8
and 4.6 (subprocess), GPU checks (marked gpu).

The emulation (k1_shrink.emulate) follows the kernel: sorted BM-row tiles, the cluster's k-block
split (ceil(nkb / splits) per CTA), per-split partials of every (slice, group) pass with other
groups' rows zeroed and rank columns beyond the effective rank skipped, the fixed-order split sum,
and quantization from the folded per-split row maxima.

Run as a script (`python tests/test_k1_shrink.py fast|all`) it compiles and checks the
configurations and prints one RESULTS JSON line (how the 4.6.0 venv is tested).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from epilora_cute import reference  # noqa: E402
from epilora_cute.compile_cache import dsl_version  # noqa: E402
from epilora_cute.metadata import build_meta  # noqa: E402
from kernels_dsl import k1_shrink as K1  # noqa: E402
from tests.dsl46 import SHARDS, run_dsl46  # noqa: E402
from tests.test_expand_add import check_config  # noqa: E402

needs_dsl = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")

FAST = [
    K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=8),  # qkv's v0.10 selection
    K1.Config(rank=64, num_slices=3, bm=64, kc=512),
    K1.Config(rank=256, num_slices=1, bm=16, kc=4096, stages=2),
    K1.Config(rank=8, num_slices=2, bm=32, kc=1024),
    K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4),  # qkv's selection since v0.31
    K1.Config(rank=16, num_slices=1, bm=16, kc=1536, stages=2),
    K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4, h_bf16=True),  # qkv's, h stored as bf16
    K1.Config(rank=8, num_slices=1, bm=16, kc=1536, stages=2, h_bf16=True),  # 16-byte bf16 rows of h
    K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4, wn_x=2),  # v0.73: 8 warps
    K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4, wgmma=True),  # v0.74: WGMMA, one warpgroup
    K1.Config(rank=128, num_slices=1, bm=32, kc=1536, stages=2, wgmma=True),  # two warpgroups
]


# ---------------------------------------------------------------------------------------------
# Problem generator and a grouped fp32 reference (reference.lora_shrink materialises [M, R, K])
# ---------------------------------------------------------------------------------------------


def make_case(M, L, R, K, S, seed=0, neg_frac=0.2, slot_ranks=None, device="cpu", spread=False, specials=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, L, (M,), generator=g)
    ids[torch.rand(M, generator=g) < neg_frac] = -1
    ids = ids.to(torch.int32)
    x = torch.randn(M, K, generator=g)
    if spread:  # rows over 12 decades: scales from the MIN_SCALE clamp to large
        x = x * torch.logspace(-8, 4, M)[torch.randperm(M, generator=g)][:, None]
    x = x.bfloat16()
    if specials:  # only in rows without an adapter: h of such rows is 0 by definition
        neg = (ids < 0).nonzero().flatten().tolist()
        nan, inf = float("nan"), float("inf")
        for j, r in enumerate(neg[:5]):
            if j == 0:
                x[r] = 0
            elif j == 1:
                x[r, ::7] = nan
            elif j == 2:
                x[r, 1], x[r, 3] = inf, -inf
            elif j == 3:
                x[r] = (torch.randn(K, generator=g) * 1e-39).bfloat16()
            else:
                x[r] = nan
    As = [(torch.randn(L, 1, R, K, generator=g) * 0.05).bfloat16() for _ in range(S)]
    if slot_ranks is not None:
        for lid, r in enumerate(slot_ranks.tolist()):
            for a in As:
                a[lid, :, r:] = 0
    meta = build_meta(ids, L)
    case = dict(ids=ids, x=x, As=As, meta=meta, slot_ranks=slot_ranks)
    if device != "cpu":
        case = dict(ids=ids.to(device), x=x.to(device), As=[a.to(device) for a in As],
                    meta=build_meta(ids.to(device), L),
                    slot_ranks=None if slot_ranks is None else slot_ranks.to(device))
    return case


def grouped_h(x, As, ids):
    """reference.lora_shrink, one slot at a time (same fp32 math, no [M, R, K] temporaries)."""
    M = x.shape[0]
    out = []
    for a in As:
        a3 = a[:, 0] if a.dim() == 4 else a
        h = torch.zeros(M, a3.shape[1], dtype=torch.float32, device=x.device)
        for lid in torch.unique(ids).tolist():
            if lid < 0:
                continue
            sel = ids == lid
            h[sel] = x[sel].float() @ a3[lid].float().t()
        out.append(h)
    return torch.stack(out)


def assert_quant_exact(codes, scales, x):
    rc, rs = reference.quantize_fp8_per_token(x.cpu())
    assert torch.equal(scales.reshape(-1, 1).cpu().view(torch.int32), rs.view(torch.int32)), "scales differ"
    diff = codes.cpu().view(torch.uint8) != rc.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"


def assert_h_close(h, want, K):
    """fp32 sums of K exact bf16 products in another order: error ~ sqrt(K) ulps of the terms."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    tol = 1e-6 * math.sqrt(K) * 8
    d = ((h - want).abs() / scale).nan_to_num(0.0)
    assert torch.equal(h.isnan(), want.isnan()), "NaN positions differ"
    assert float(d.max()) <= tol, f"relative error {float(d.max())} > {tol}"


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tiling, split and reduction order (emulated) against the reference
# ---------------------------------------------------------------------------------------------

EMU_CASES = [
    # M, adapters, rank, K, slices, slot ranks?, splits (None: the launch rule)
    (33, 1, 16, 1024, 1, False, None),
    (101, 8, 64, 1040, 3, False, 3),  # K tail of 16 inside the last k-block
    (257, 32, 64, 520, 2, True, None),  # K tail of 8
    (599, 8, 128, 2048, 4, True, 8),
    (599, 32, 16, 4096, 3, False, None),
    (130, 32, 8, 3696, 1, True, None),  # Qwen2.5-72B down at TP 8: K % 64 == 48
]


@pytest.mark.parametrize("M,L,R,K,S,ranked,splits", EMU_CASES, ids=lambda v: str(v))
def test_emulation_matches_reference(M, L, R, K, S, ranked, splits):
    slot_ranks = None
    if ranked:
        choices = torch.tensor([r for r in (0, 8, 16, 24, 40, 64, 128) if r <= R])
        slot_ranks = choices[torch.randint(0, len(choices), (L,), generator=torch.Generator().manual_seed(M))]
        slot_ranks = slot_ranks.to(torch.int32)
    case = make_case(M, L, R, K, S, seed=M + K, slot_ranks=slot_ranks, spread=True, specials=True)
    codes, scales, h = K1.emulate(case["x"], case["As"], case["meta"], slot_ranks, splits=splits)
    assert_quant_exact(codes, scales, case["x"])
    want = grouped_h(case["x"], case["As"], case["ids"])
    assert_h_close(h, want, K)
    assert not h[:, case["ids"] < 0].any()  # tokens without an adapter: exactly 0


@pytest.mark.parametrize("M,L,S", [(33, 1, 1), (257, 32, 3), (130, 8, 2)])
def test_emulation_sorted_codes_are_the_sorted_rows(M, L, S):
    """sorted_codes: codes / scales row p is token tok[p]'s row, bit for bit; h is unchanged."""
    case = make_case(M, L, 64, 1040, S, seed=M + L, spread=True, specials=True)
    tok = case["meta"].token_indices_sorted_by_lora_ids[:M].long()
    assert not torch.equal(tok, torch.arange(M))  # the case does reorder the rows
    c0, s0, h0 = K1.emulate(case["x"], case["As"], case["meta"])
    c1, s1, h1 = K1.emulate(case["x"], case["As"], case["meta"], sorted_codes=True)
    assert torch.equal(c1.view(torch.uint8), c0.view(torch.uint8)[tok]) and torch.equal(s1, s0[tok])
    assert torch.equal(h1.nan_to_num(7.0), h0.nan_to_num(7.0))


def test_emulation_split_invariance_of_codes():
    case = make_case(77, 8, 64, 4096, 2, seed=4, spread=True)
    cfg = K1.Config(rank=64, num_slices=2, bm=16, kc=4096)
    outs = [K1.emulate(case["x"], case["As"], case["meta"], config=cfg, splits=s) for s in (1, 3, 8)]
    for c, s, h in outs[1:]:
        assert torch.equal(c.view(torch.uint8), outs[0][0].view(torch.uint8)) and torch.equal(s, outs[0][1])
        assert_h_close(h, outs[0][2], 4096)


def test_grouped_reference_equals_reference_module():
    case = make_case(30, 4, 16, 64, 2, seed=1)
    torch.testing.assert_close(grouped_h(case["x"], case["As"], case["ids"]),
                               torch.stack(reference.lora_shrink(case["x"], case["As"], case["ids"])),
                               rtol=1e-6, atol=1e-6)


def test_select_splits_and_capacity():
    pre = set(K1.prebuild_configs())
    for s, ks in K1.projection_ks().items():
        for k in ks:
            for r in K1.RANKS:
                cfg = K1.select(s, k, r)
                assert cfg in pre
                assert cfg.smem_bytes <= K1.SMEM_LIMIT
                for m in (33, 64, 100, 511, 2048, 8192):
                    (sx, ty, _), cl = K1.grid(k, m, cfg)
                    assert cl == (sx, 1, 1) and 1 <= sx <= K1.MAX_SPLITS and ty == -(-m // cfg.bm) * s
                    nkb = -(-k // K1.BK)
                    per = -(-nkb // sx)
                    assert per <= cfg.nkb  # the resident chunk holds every CTA's share
                    assert nkb - (sx - 1) * per >= 1  # no split without k-blocks
    with pytest.raises(ValueError, match="exceeds"):
        K1.select(1, 40000, 64)


def test_select_deep_ring():
    """v0.10: the Qwen3-8B projections at rank 64 get an 8-stage A ring; K = 4096 keeps two CTAs
    per SM."""
    for s in (1, 2, 3):
        c = K1.select(s, 4096, 64)
        assert (c.bm, c.kc, c.stages) == (32, 512, 8) and c.smem_bytes <= K1.SMEM_TWO_PER_SM
    # v0.13: down (K = 12288 / 14336) gets kc = exactly its 24 / 28 k-blocks per split and bm 16,
    # two CTAs per SM (was bm32_kc2048_st8, 202 KiB, one per SM)
    c = K1.select(1, 12288, 64)
    assert (c.bm, c.kc, c.stages) == (16, 1536, 7) and c.smem_bytes <= K1.SMEM_TWO_PER_SM
    c = K1.select(1, 14336, 64)
    assert (c.bm, c.kc, c.stages) == (16, 1792, 6) and c.smem_bytes <= K1.SMEM_TWO_PER_SM
    c = K1.select(1, 12288, 64)
    assert K1.grid(12288, 32, c, max_loras=32) == ((8, 2, 16), (8, 1, 1))  # 256 CTAs: one wave
    assert K1.grid(12288, 256, c, max_loras=32) == ((8, 16, 4), (8, 1, 1))  # v0.20: 396 // 128 = 3 -> 4
    assert K1.grid(12288, 2048, c, max_loras=1) == ((8, 128, 1), (8, 1, 1))
    for c in K1.prebuild_configs():
        assert 2 <= c.stages <= K1.MAX_STAGES
    # the pre-v0.13 down configuration stays prebuilt: the GPU tests compare against it
    assert K1.Config(rank=64, num_slices=1, bm=32, kc=2048, stages=8) in set(K1.prebuild_configs())


def test_select_by_token_count():
    """v0.31: at rank 64, K 4096 a 4-stage ring with 16 rows per CTA up to 1024 tokens and the
    resident rule's 32 rows above (three or more CTAs per SM); down (K 12288) keeps the resident
    rule; without a token count select() is the resident rule; every choice is prebuilt. These are
    the mma.sync tiles by size (_select_by_size); test_select_retunes_by_size holds v0.76's choice."""
    pre = set(K1.prebuild_configs())
    for s in (1, 2, 3):
        small, big = K1._select_by_size(s, 4096, 64, 64), K1._select_by_size(s, 4096, 64, 2048)
        assert (small.bm, small.stages) == (16, 4) and (big.bm, big.stages) == (32, 4)
        assert K1._select_by_size(s, 4096, 64, K1.SHALLOW_SMALL_M) == small
        assert K1._select_by_size(s, 4096, 64, K1.SHALLOW_SMALL_M + 1) == big
        assert max(small.smem_bytes, big.smem_bytes) <= K1.SMEM_THREE_PER_SM
        assert K1.select(s, 4096, 64) == K1._select_resident(s, 4096, 64)
    for m in (33, 1024):  # down below SHALLOW_SMALL_M: the resident rule (a 2-stage ring lost there)
        assert K1._select_by_size(1, 12288, 64, m) == K1.select(1, 12288, 64)
    for m in (1025, 2048, 8192):  # above: 16 rows, a 2-stage ring, three CTAs per SM (v0.32)
        c = K1._select_by_size(1, 12288, 64, m)
        assert (c.bm, c.kc, c.stages) == (16, 1536, 2) and c.smem_bytes <= K1.SMEM_THREE_PER_SM
    for s, ks in K1.projection_ks().items():
        for k in ks:
            for r in K1.RANKS:
                for m in (1, 33, 1024, 1025, 4095, 4096, 8192):
                    cfg = K1.select(s, k, r, m)
                    assert cfg in pre and K1._select_by_size(s, k, r, m) in pre, (s, k, r, m)
                    assert cfg.kc == K1.select(s, k, r).kc  # the same capacity: the same splits rule
    for s, k in K1.SWEEP_SHAPES:
        sweep = K1.sweep_configs(s, k, 64)
        assert sweep and set(sweep.values()) <= pre, (s, k)
        assert all(c.kc == K1.select(s, k, 64).kc and c.smem_bytes <= K1.SMEM_LIMIT for c in sweep.values())


def test_select_retunes_by_size():
    """v0.76 (run30's sweep): up to SHALLOW_SMALL_M the by-size tile on WGMMA (ranks 64 / 128);
    above, 64 rows on 8 warps for qkv / gate_up and, from WIDE_ROWS_M tokens, for o; o below that
    the by-size tile on 8 warps; down (K 12288) the resident ring on WGMMA; ranks the faster builds
    do not take keep the mma.sync tile."""
    for s in (2, 3):
        assert K1.select(s, 4096, 64, 256) == dataclasses.replace(K1._select_by_size(s, 4096, 64, 256), wgmma=True)
        for m in (1025, 2048, 8192):
            assert K1.select(s, 4096, 64, m) == K1.Config(rank=64, num_slices=s, bm=64, kc=512, stages=3, wn_x=2)
    assert K1.select(1, 4096, 64, 2048) == K1.Config(rank=64, num_slices=1, bm=32, kc=512, stages=4, wn_x=2)
    assert K1.select(1, 4096, 64, K1.WIDE_ROWS_M) == K1.Config(rank=64, num_slices=1, bm=64, kc=512, stages=3, wn_x=2)
    assert K1.select(1, 12288, 64, 256) == dataclasses.replace(K1.select(1, 12288, 64), wgmma=True)
    assert K1.select(1, 12288, 64, 2048) == dataclasses.replace(K1.select(1, 12288, 64), wgmma=True)
    # ranks without WGMMA builds (8, 16, 32, 256) keep the mma.sync tile below SHALLOW_SMALL_M
    assert not K1.select(1, 4096, 8, 33).wgmma and K1.select(3, 4096, 256, 33) == K1._select_by_size(3, 4096, 256, 33)
    assert K1.select(1, 4096, 128, 256).wgmma and K1.select(2, 4096, 128, 2048).wn_x == 2
    for s, ks in K1.projection_ks().items():
        for k in ks:
            for r in K1.RANKS:
                for m in (1, 1024, 1025, 4096):
                    c, by_size = K1.select(s, k, r, m), K1._select_by_size(s, k, r, m)
                    assert c.kc == by_size.kc and c.smem_bytes <= K1.SMEM_LIMIT
                    assert c.wgmma or c.wn_x == 2 or c == by_size


def test_choose_zsplit():
    cfg = K1.select(3, 4096, 64)  # bm 32: grid y = 1 tile x 3 slices at 32 tokens
    assert K1.grid(4096, 32, cfg) == ((8, 3, 1), (8, 1, 1))  # no max_loras: no group split
    assert K1.grid(4096, 32, cfg, max_loras=32) == ((8, 3, 16), (8, 1, 1))  # 396 // 24 = 16, a power of two
    assert K1.grid(4096, 256, K1.select(1, 4096, 64), max_loras=32)[0] == (8, 8, 8)  # 396 // 64 = 6 -> 8
    assert K1.grid(4096, 32, cfg, max_loras=8) == ((8, 3, 9), (8, 1, 1))
    assert K1.grid(4096, 256, cfg, max_loras=32) == ((8, 24, 2), (8, 1, 1))  # 192 CTAs x 2
    assert K1.grid(4096, 2048, cfg, max_loras=32)[0][2] == 1
    assert K1.grid(4096, 32, cfg, max_loras=32, zsplit=3)[0] == (8, 3, 3)
    c1 = K1.select(1, 4096, 64)
    assert K1.grid(4096, 32, c1, max_loras=32) == ((8, 1, 32), (8, 1, 1))  # one token per group
    for m in (1, 33, 256, 8192):
        for L in (1, 8, 32, 128):
            for k in (4096, 12288):
                c = K1.select(1, k, 64)
                (s, _, z), _ = K1.grid(k, m, c, max_loras=L)
                assert 1 <= z <= min(c.bm, m, L + 1)
                assert z & (z - 1) == 0 or z == min(c.bm, m, L + 1)  # a power of two unless capped
    assert [K1.pow2_ceil(n) for n in (1, 2, 3, 11, 16, 17)] == [1, 2, 4, 16, 16, 32]


def test_emulation_group_split_invariant():
    """Grid z only moves whole groups between CTAs: codes, scales and h are bit-identical for any
    z, and every row's h is stored (emulate() leaves unstored rows NaN)."""
    case = make_case(150, 32, 64, 1040, 3, seed=5)
    ref = K1.emulate(case["x"], case["As"], case["meta"], splits=3, zsplit=1)
    assert not ref[2].isnan().any()
    for z in (2, 7, 33, 64):
        got = K1.emulate(case["x"], case["As"], case["meta"], splits=3, zsplit=z)
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(got[1], ref[1])
        assert torch.equal(got[2].view(torch.int32), ref[2].view(torch.int32)), z


def test_config_shapes():
    for c in K1.prebuild_configs():
        assert c.rank_pad % (c.wn * 16) == 0 and c.threads <= 256
        assert c.threads // 8 <= min(c.bm, c.rank_pad)
        assert c.rank_pad // c.wn // 2 <= 64  # fp32 accumulators per thread


def test_wn2_configs():
    """v0.73: wn_x = 2 doubles the warps across the rank where each keeps >= 16 rank columns and the
    CTA <= 8 warps; name suffix only then (wn_x = 1 names and cache entries unchanged); select()
    never takes it (the bench's sweep only, until the H200 has timed it)."""
    c = K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4, wn_x=2)
    one = K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4)
    assert (c.wn, c.threads, c.name()) == (4, 256, "r64_s3_bm32_kc512_st4_wn2")
    assert one.name() == "r64_s3_bm32_kc512_st4"
    assert c.smem_bytes == one.smem_bytes
    assert K1.Config(rank=64, bm=64, kc=512, wn_x=2).threads == 256
    for bad in (dict(bm=16, wn_x=2), dict(rank=16, bm=32, wn_x=2), dict(wn_x=3)):
        with pytest.raises(ValueError):
            K1.Config(**{"rank": 64, "kc": 512, **bad})
    assert all(K1.select(s, k, r).wn_x == 1 for s, ks in K1.projection_ks().items() for k in ks for r in K1.RANKS)
    for s, k in K1.SWEEP_SHAPES[:3]:
        assert {"bm32_st4_wn2", "bm64_st3_wn2"} <= set(K1.sweep_configs(s, k, 64))


def test_wgmma_configs():
    """v0.74: WGMMA builds at ranks 64 / 128 only (whole 64-row M tiles, a warpgroup each), one
    warpgroup per 64 rank rows whatever the tile's rows; the name suffix only then; never with
    wn_x = 2; select() takes them by size (v0.76), the resident rule alone never."""
    c = K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4, wgmma=True)
    assert (c.threads, c.name()) == (128, "r64_s3_bm32_kc512_st4_wg")
    assert K1.Config(rank=128, bm=32, kc=512, wgmma=True).threads == 256
    assert c.smem_bytes == K1.Config(rank=64, num_slices=3, bm=32, kc=512, stages=4).smem_bytes
    for bad in (dict(rank=32), dict(rank=256), dict(rank=64, wn_x=2), dict(rank=128, bm=16)):
        with pytest.raises(ValueError):
            K1.Config(**{"bm": 32, "kc": 512, "wgmma": True, **bad})
    assert not any(K1.select(s, k, r).wgmma for s, ks in K1.projection_ks().items() for k in ks for r in K1.RANKS)
    pre = set(K1.prebuild_configs())
    assert set(K1.WGMMA_TEST_CONFIGS) <= pre
    for s, k in K1.SWEEP_SHAPES:
        wg = [c for n, c in K1.sweep_configs(s, k, 64).items() if n.endswith("_wg")]
        assert wg and all(c.wgmma and c in pre for c in wg)
        big = K1._select_by_size(s, k, 64, 2048)
        assert any((c.bm, c.stages) == (big.bm, big.stages) for c in wg)


def test_params_declaration():
    p = K1.params(K1.Config(rank=64, num_slices=3))
    assert [x.size for x in p] == [24, 24, 16, 24] + [16] * 5 + [24] * 3 + [4, 4]
    assert [x.name for x in p[-2:]] == ["has_ranks", "sorted_codes"]


def _cpu_case():
    return make_case(20, 4, 16, 64, 2, seed=2)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda c: c.update(x=c["x"].float()), TypeError, "bfloat16"),
    (lambda c: c.update(x=c["x"][:, :60]), ValueError, "K % 8"),
    (lambda c: c.update(As=[c["As"][0], c["As"][1][:, :, :8].contiguous()]), ValueError, "every slice"),
    (lambda c: c.update(As=[c["As"][0].float()]), TypeError, "bfloat16"),
    (lambda c: c.update(As=[c["As"][0]] * 5), ValueError, "1..4"),
    (lambda c: c.update(codes=torch.empty(20, 64, dtype=torch.uint8)), ValueError, "codes"),
    (lambda c: c.update(scales=torch.empty(19, 1)), ValueError, "scales"),
    (lambda c: c.update(h=torch.empty(2, 20, 8)), ValueError, "h must be"),
    (lambda c: c.update(h=torch.empty(2, 20, 16, dtype=torch.float16)), ValueError, "float32 or bfloat16"),
    (lambda c: c.update(h=torch.empty(2, 20, 16, dtype=torch.bfloat16), config=K1.Config(rank=16, num_slices=2)),
     ValueError, "writes h as float32"),
    (lambda c: c.update(config=K1.Config(rank=16, num_slices=2, h_bf16=True)), ValueError, "writes h as bfloat16"),
    (lambda c: c.update(meta=build_meta(c["ids"][:10], 4)), ValueError, "metadata"),
    (lambda c: c.update(slot_ranks=torch.ones(4)), TypeError, "int32"),
    (lambda c: None, ValueError, "CUDA"),
])
def test_bad_input(mutate, exc, match):
    c = _cpu_case()
    c.update(codes=None, scales=None, h=None, slot_ranks=None, config=None)
    mutate(c)
    with pytest.raises(exc, match=match):
        K1.k1_quant_shrink(c["x"], c["As"], c["meta"], c["codes"], c["scales"], c["h"], c["slot_ranks"],
                           config=c["config"])


def test_bad_h_dtype_argument():
    c = _cpu_case()
    with pytest.raises(ValueError, match="h_dtype"):
        K1.k1_quant_shrink(c["x"], c["As"], c["meta"], h_dtype=torch.float16)


def test_emulation_h_bf16_is_the_rounded_fp32_h():
    """h_dtype=bf16: the fp32 h rounded to nearest even, element for element; codes unchanged."""
    case = make_case(257, 32, 64, 1040, 3, seed=5, spread=True, specials=True)
    c0, s0, h0 = K1.emulate(case["x"], case["As"], case["meta"])
    c1, s1, h1 = K1.emulate(case["x"], case["As"], case["meta"], h_dtype=torch.bfloat16)
    assert h1.dtype == torch.bfloat16
    assert torch.equal(h1.view(torch.int16), h0.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(c1.view(torch.uint8), c0.view(torch.uint8)) and torch.equal(s1, s0)


def test_prebuild_set_has_every_selection_with_bf16_h():
    """The hybrid path asks for select()'s configuration with h_bf16 at any size it serves."""
    import dataclasses

    built = set(K1.prebuild_configs())
    for s, ks in K1.projection_ks().items():
        for k in ks:
            for r in K1.RANKS:
                for m in (33, 1024, 1025, 8192):
                    assert dataclasses.replace(K1.select(s, k, r, m), h_bf16=True) in built, (s, k, r, m)


# ---------------------------------------------------------------------------------------------
# Compile for sm_90a (no GPU): PTX instructions, parameter ABI, shared memory
# ---------------------------------------------------------------------------------------------


def ptx_problems(ptx: str, cfg: K1.Config | None = None) -> list[str]:
    import re

    bad = []
    if cfg is not None and cfg.h_bf16:  # h rounded to nearest even, 2-byte stores
        bad += [f"h_bf16: missing {ins}" for ins in ("cvt.rn.bf16.f32", "st.global.b16") if ins not in ptx]
    if cfg is not None and cfg.wgmma:  # v0.74: swap-AB WGMMA on smem operands after the cp.async fence
        mma = (f"wgmma.mma_async.sync.aligned.m64n{cfg.bm}k16.f32.bf16.bf16", "wgmma.fence.sync.aligned",
               "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned", "fence.proxy.async.shared::cta")
        bad += [f"unexpected {ins}" for ins in ("mma.sync", "ldmatrix") if ins in ptx]
    else:
        mma = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16")
    for ins in (*mma,
                "cp.async.cg.shared.global", "barrier.cluster.arrive", "barrier.cluster.wait",
                "mapa.shared::cluster.u32", "ld.shared::cluster.f32",  # DSMEM split-K reduction
                "div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "max.f32", "min.f32", "abs.f32"):  # exact quant
        if ins not in ptx:
            bad.append(f"missing {ins}")
    for ins in ("div.approx", "div.full", ".ftz", "max.NaN", "min.NaN", "griddepcontrol"):
        if ins in ptx:
            bad.append(f"unexpected {ins}")
    for pat in (r"\.local\b", r"^\s*(?:@%p\d+\s+)?(?:atom|red)\."):  # no spills, no atomics
        if re.search(pat, ptx, re.M):
            bad.append(f"unexpected {pat}")
    return bad


@needs_dsl
@pytest.mark.parametrize("cfg", FAST, ids=lambda c: c.name())
def test_compiles_with_required_instructions(cfg):
    # spills=False: r64_s3_bm64_kc512_st3 (a test configuration, not prebuilt) spills 8 bytes
    # under ptxas -v (session 23); the prebuilt set was never checked for spills.
    r = check_config(K1, cfg, functools.partial(ptx_problems, cfg=cfg), spills=False)
    assert not r["problems"], r


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("cfg", K1.prebuild_configs(), ids=lambda c: c.name())
def test_prebuild_set_compiles(cfg):
    r = check_config(K1, cfg, functools.partial(ptx_problems, cfg=cfg), spills=False)
    assert not r["problems"], r


def test_dsl46_fast_subset():
    run_dsl46(Path(__file__).resolve(), "fast", 600)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_dsl46_prebuild_set(shard):
    run_dsl46(Path(__file__).resolve(), "all", 3600, shard)


# ---------------------------------------------------------------------------------------------
# GPU (the integrator runs these on the H200): launches through epilora_cute.kernels.get_kernel
# ---------------------------------------------------------------------------------------------

GPU_MS = (33, 64, 100, 256, 511, 2048, 8192)


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


def _poisoned(M, K, S, R):
    codes = torch.full((M, K), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # NaN codes
    scales = torch.full((M, 1), float("nan"), device="cuda")
    h = torch.full((S, M, R), float("nan"), device="cuda")
    return codes, scales, h


def _check(case, codes, scales, h, K):
    assert_quant_exact(codes, scales, case["x"])
    want = grouped_h(case["x"], case["As"], case["ids"])
    assert_h_close(h, want, K)
    assert not h[:, case["ids"] < 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("L", (1, 8, 32))
@pytest.mark.parametrize("M", GPU_MS)
def test_gpu_matches_reference(M, L):
    """qkv-like: K = 4096, three slices, rank 64, mixed effective ranks, -1 tokens, poisoned outputs."""
    _hopper()
    K, S, R = 4096, 3, 64
    slot_ranks = torch.tensor([(16, 32, 64, 0)[i % 4] if L > 1 else 64 for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, K, S, seed=M * 3 + L, slot_ranks=slot_ranks, device="cuda", spread=True,
                     specials=True)
    codes, scales, h = _poisoned(M, K, S, R)
    out = K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"])
    assert out[0] is codes and out[1] is scales and out[2] is h
    torch.cuda.synchronize()
    _check(case, codes, scales, h, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,K,S", [(33, 1, 4096, 3), (300, 8, 4096, 2), (2048, 32, 12288, 1), (1000, 8, 1040, 1)])
def test_gpu_sorted_codes(M, L, K, S):
    """sorted_codes (the prefill path's K1): codes / scales rows in adapter-sorted order, bit for
    bit the reference's rows tok[p]; h in token order as without it; poisoned outputs."""
    _hopper()
    case = make_case(M, L, 64, K, S, seed=M + K + S, device="cuda", spread=True, specials=True)
    codes, scales, h = _poisoned(M, K, S, 64)
    K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, sorted_codes=True)
    torch.cuda.synchronize()
    tok = case["meta"].token_indices_sorted_by_lora_ids[:M].long()
    inv = torch.empty_like(tok)
    inv[tok] = torch.arange(M, device=tok.device)
    _check(case, codes.view(torch.uint8)[inv].view(torch.float8_e4m3fn), scales[inv], h, K)


@pytest.mark.gpu
@pytest.mark.parametrize("K,R", [(12288, 64), (14336, 64), (14336, 128), (3696, 16), (29568, 64), (4096, 256),
                                 (2048, 8)])
@pytest.mark.parametrize("M", (64, 2048))
def test_gpu_down_projection_shapes(M, K, R):
    """One slice, long K (the resident-chunk configurations with bm 32/16), no slot ranks."""
    _hopper()
    case = make_case(M, 8, R, K, 1, seed=K + R + M, device="cuda", spread=True)
    codes, scales, h = _poisoned(M, K, 1, R)
    K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h)
    torch.cuda.synchronize()
    _check(case, codes, scales, h, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,L", [(32, 1), (32, 32), (256, 32), (2048, 1), (300, 8)])
def test_gpu_down_v013_config_equals_v010(M, L):
    """v0.13 moved K = 12288 from bm32_kc2048_st8 to bm16_kc1536_st7. At the same 8 splits of 24
    k-blocks only the rows per CTA change, so codes, scales and h are bit-identical. The old config
    chose 6 splits of 32 from ~1.4K tokens (choose_splits), so the split count is forced to the new
    config's 8 here: at 6 splits h's split sum rounds differently (test_emulation_down_v013_...)."""
    _hopper()
    K, R = 12288, 64
    new, old = K1.select(1, K, R), K1.Config(rank=R, num_slices=1, bm=32, kc=2048, stages=8)
    assert (new.bm, new.kc) == (16, 1536)
    splits = K1.grid(K, M, new, max_loras=L)[0][0]
    assert splits == 8
    case = make_case(M, L, R, K, 1, seed=M + L, device="cuda", spread=True, neg_frac=0.2 if L == 8 else 0.0)
    outs = []
    for cfg in (new, old):
        codes, scales, h = _poisoned(M, K, 1, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, config=cfg, splits=splits)
        outs.append((codes.view(torch.uint8), scales.view(torch.int32), h.view(torch.int32)))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    _check(case, outs[0][0].view(torch.float8_e4m3fn), outs[0][1].view(torch.float32),
           outs[0][2].view(torch.float32), K)


def test_emulation_down_v013_config_equals_v010():
    """CPU: the emulation of the v0.13 down configuration equals the v0.10 one bit for bit at the
    same split ranges (only the row tiles differ). The split count is not always the same: the old
    config took 6 splits of 32 k-blocks from ~1.4K tokens, the new one always 8 of 24 (codes and
    scales are still exact, h's fp32 split sum rounds differently)."""
    case = make_case(40, 4, 64, 12288, 1, seed=13)
    new, old = K1.select(1, 12288, 64), K1.Config(rank=64, num_slices=1, bm=32, kc=2048, stages=8)
    assert [K1.choose_splits(12288, m, new) for m in (40, 2048)] == [8, 8]
    assert [K1.choose_splits(12288, m, old) for m in (40, 2048)] == [8, 6]
    a = K1.emulate(case["x"], case["As"], case["meta"], config=new, splits=8, zsplit=1)
    b = K1.emulate(case["x"], case["As"], case["meta"], config=old, splits=8, zsplit=1)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2], rtol=1e-6, atol=1e-6)  # torch's CPU GEMM may block by rows


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, 2, 5, 8))
def test_gpu_explicit_splits(splits):
    _hopper()
    K = 4096
    case = make_case(300, 8, 64, K, 1, seed=splits, device="cuda")
    cfg = K1.select(1, 8 * 4096, 64)  # a prebuilt configuration holding K = 4096 in one CTA
    assert cfg.kc == 4096
    codes, scales, h = _poisoned(300, K, 1, 64)
    K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, config=cfg, splits=splits)
    torch.cuda.synchronize()
    _check(case, codes, scales, h, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M", (100, 2048))
def test_gpu_bitwise_deterministic(M):
    _hopper()
    K, S, R = 4096, 3, 64
    case = make_case(M, 32, R, K, S, seed=11, device="cuda")
    first = None
    for _ in range(5):
        codes, scales, h = _poisoned(M, K, S, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h)
        cur = (codes.view(torch.uint8).clone(), scales.view(torch.int32).clone(), h.view(torch.int32).clone())
        if first is None:
            first = cur
        else:
            assert all(torch.equal(a, b) for a, b in zip(cur, first))


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,R,K,S", [(33, 1, 64, 4096, 3), (2048, 1, 64, 4096, 3), (300, 32, 64, 4096, 2),
                                       (2048, 8, 64, 12288, 1), (511, 8, 8, 4096, 2), (100, 4, 256, 1040, 1),
                                       (1025, 32, 16, 3696, 1)])
def test_gpu_h_bf16_is_the_rounded_fp32_h(M, L, R, K, S):
    """v0.71: h stored as bf16 is the fp32 h rounded to nearest even, bit for bit (the same sums,
    one cvt), codes and scales unchanged; mixed effective ranks, -1 tokens, poisoned outputs;
    sizes on both sides of SHALLOW_SMALL_M (two configurations per shape), rank 8's 16-byte rows."""
    _hopper()
    slot_ranks = torch.tensor([(R, R // 2, 0, 8)[i % 4] for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, K, S, seed=M + 7 * L, slot_ranks=slot_ranks, device="cuda", spread=True,
                     specials=True)
    codes, scales, h = _poisoned(M, K, S, R)
    K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"])
    codes_b, scales_b, _ = _poisoned(M, K, S, R)
    h_b = torch.full((S, M, R), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes_b, scales_b, h_b, case["slot_ranks"])
    assert out[2] is h_b
    torch.cuda.synchronize()
    assert torch.equal(h_b.view(torch.int16), h.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(codes_b.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(scales_b.view(torch.int32), scales.view(torch.int32))
    _check(case, codes, scales, h, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,K,S", [(64, 8, 4096, 3), (2048, 1, 4096, 3), (300, 32, 4096, 2), (2048, 8, 12288, 1),
                                     (100, 8, 4040, 1), (1500, 4, 4040, 1)])
def test_gpu_zero_filled_copies_match_the_reference(M, L, K, S):
    """Every guarded copy is one cp.async whose source size is its guard (v0.39): K-tail chunks
    (K = 4040: the last k-block half zero-filled), rows past the tile and rank rows beyond a slot's
    effective rank are zero-filled, never skipped. Codes, scales and h against the reference at
    mixed effective ranks, tokens without an adapter, special values, poisoned outputs; the same
    bits on a second run."""
    _hopper()
    R = 64
    slot_ranks = torch.tensor([(16, 32, 64, 0)[i % 4] if L > 1 else 64 for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, K, S, seed=M + L + K, slot_ranks=slot_ranks, device="cuda", spread=True,
                     specials=True)
    outs = []
    for _ in range(2):
        codes, scales, h = _poisoned(M, K, S, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"])
        outs.append((codes.view(torch.uint8), scales.view(torch.int32), h.view(torch.int32)))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    _check(case, outs[1][0].view(torch.float8_e4m3fn), outs[1][1].view(torch.float32),
           outs[1][2].view(torch.float32), K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(33, 4096), (256, 4096), (64, 12288)])
def test_gpu_group_split_bitwise_invariant(M, K):
    """Grid z (the group split) only moves whole groups between CTAs; z = 0 alone quantizes: codes,
    scales and h bit-identical for z = 1 (the geometry before the split), the default and odd
    splits, every output written (poisoned first), and equal to the reference."""
    _hopper()
    S = 3 if K == 4096 else 1
    case = make_case(M, 32, 64, K, S, seed=M + K, device="cuda", spread=True)
    outs = {}
    for z in (1, None, 5, 64):
        codes, scales, h = _poisoned(M, K, S, 64)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, zsplit=z)
        outs[z] = (codes.view(torch.uint8), scales.view(torch.int32), h.view(torch.int32))
    torch.cuda.synchronize()
    for z, o in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(o, outs[1])), z
    _check(case, outs[None][0].view(torch.float8_e4m3fn), outs[None][1].view(torch.float32),
           outs[None][2].view(torch.float32), K)


@pytest.mark.gpu
@pytest.mark.parametrize("K,S", [(4096, 3), (4096, 1), (4096, 2), (12288, 1)])
@pytest.mark.parametrize("M,L", [(32, 1), (32, 32), (256, 32), (2048, 1), (300, 8)])
def test_gpu_bench_shapes(M, L, K, S):
    """v0.10 geometry (slices on grid y, deep ring, bm 32) at the hybrid_stages shapes: one and 32
    adapters (round-robin, one token per group at 32 tokens), and mixed effective ranks with
    tokens without an adapter (L = 8); outputs poisoned first, default and z = 1 bit-identical."""
    _hopper()
    R = 64
    ranks = torch.tensor([(64, 16, 0, 32)[i % 4] for i in range(L)], dtype=torch.int32) if L == 8 else None
    case = make_case(M, L, R, K, S, seed=M + L + K + S, slot_ranks=ranks, device="cuda", spread=True,
                     specials=L == 8, neg_frac=0.2 if L == 8 else 0.0)
    if L == 32:  # round-robin as the bench
        ids = (torch.arange(M) % L).to(torch.int32).cuda()
        case["ids"], case["meta"] = ids, build_meta(ids, L)
    outs = []
    for z in (None, 1):
        codes, scales, h = _poisoned(M, K, S, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"], zsplit=z)
        outs.append((codes, scales, h))
    torch.cuda.synchronize()
    _check(case, *outs[0], K)
    assert torch.equal(outs[0][0].view(torch.uint8), outs[1][0].view(torch.uint8))
    assert torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
    assert torch.equal(outs[0][2].view(torch.int32), outs[1][2].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("S", (3, 1, 2))
@pytest.mark.parametrize("M,L", [(2048, 1), (300, 8), (256, 32), (33, 4)])
def test_gpu_wn2_is_bitwise_the_selection(M, L, S):
    """v0.73: the sweep's 8-warp builds (wn_x = 2: half the rank columns per warp; the quantization
    and the reduction spread over twice the threads; v0.76 selects them above SHALLOW_SMALL_M)
    write the codes, scales and h of the 4-warp by-size build (_select_by_size) bit for bit (each element is the same thread-local sum of the same k16 steps, the
    same fixed-order cluster sum); mixed effective ranks, tokens without an adapter, special
    values, outputs poisoned first; and against the reference."""
    _hopper()
    K, R = 4096, 64
    ranks = torch.tensor([(64, 16, 0, 32)[i % 4] for i in range(L)], dtype=torch.int32) if L > 1 else None
    case = make_case(M, L, R, K, S, seed=M + L + S, slot_ranks=ranks, device="cuda", spread=True, specials=L > 1)
    cfgs = [K1._select_by_size(S, K, R, M)] + [c for n, c in K1.sweep_configs(S, K, R).items() if n.endswith("_wn2")]
    assert len(cfgs) == 3
    outs = []
    for cfg in cfgs:
        codes, scales, h = _poisoned(M, K, S, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"], config=cfg)
        outs.append((codes.view(torch.uint8), scales.view(torch.int32), h.view(torch.int32)))
    torch.cuda.synchronize()
    for cfg, o in zip(cfgs[1:], outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0])), cfg.name()
    codes, scales, h = outs[1]
    _check(case, codes.view(torch.float8_e4m3fn), scales.view(torch.float32), h.view(torch.float32), K)


def _wgmma_cases():
    """(M, adapters, K, slices, the WGMMA build) for v0.74's GPU test: every sweep build at the
    sweep's shapes, one size per build, and the rank-128 builds."""
    out = []
    sizes = ((2048, 1), (300, 8), (256, 32), (33, 4))
    for s, k in K1.SWEEP_SHAPES:
        for i, cfg in enumerate(c for n, c in K1.sweep_configs(s, k, 64).items() if n.endswith("_wg")):
            out.append((*sizes[(i + s) % len(sizes)], k, s, cfg))
    out += [(300, 8, 4096, 2, K1.WGMMA_TEST_CONFIGS[0]), (2048, 1, 12288, 1, K1.WGMMA_TEST_CONFIGS[1])]
    return out


WGMMA_CASES = _wgmma_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,K,S,cfg", WGMMA_CASES, ids=lambda v: getattr(v, "name", lambda: str(v))())
def test_gpu_wgmma_matches_the_selection(M, L, K, S, cfg):
    """v0.74: the shrink on WGMMA. Codes and scales bit for bit the by-size mma.sync build's (the
    quantization is the same code), h within the reference's tolerance and within fp32 rounding of
    the mma.sync build's h (the same bf16 products summed per k16 step in the tensor cores' own
    order), the same bits on a second run; mixed effective ranks, tokens without an adapter (h
    rows zero), special values, outputs poisoned first."""
    _hopper()
    R = cfg.rank
    ranks = torch.tensor([(R, R // 4, 0, 16)[i % 4] for i in range(L)], dtype=torch.int32) if L > 1 else None
    case = make_case(M, L, R, K, S, seed=M + L + K + S, slot_ranks=ranks, device="cuda", spread=True,
                     specials=L > 1)
    runs = []
    for c in (K1._select_by_size(S, K, R, M), cfg, cfg):
        codes, scales, h = _poisoned(M, K, S, R)
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h, case["slot_ranks"], config=c)
        runs.append((codes.view(torch.uint8), scales.view(torch.int32), h))
    torch.cuda.synchronize()
    (c0, s0, h0), (c1, s1, h1), (c2, s2, h2) = runs
    assert torch.equal(c1, c0) and torch.equal(s1, s0)
    assert torch.equal(c2, c1) and torch.equal(s2, s1) and torch.equal(h2.view(torch.int32), h1.view(torch.int32))
    _check(case, c1.view(torch.float8_e4m3fn), s1.view(torch.float32), h1, K)
    assert_h_close(h1, h0, K)


@pytest.mark.gpu
def test_gpu_k1_then_expand_add_equals_reference_delta():
    """The hybrid path's adapter part end to end: y + expand(K1's h) vs y + reference delta."""
    _hopper()
    from kernels_dsl import expand_add as E

    M, L, R, K, widths = 700, 8, 64, 4096, (4096, 1024, 1024)
    case = make_case(M, L, R, K, len(widths), seed=21, device="cuda")
    g = torch.Generator().manual_seed(22)
    bs = [(torch.randn(L, 1, w, R, generator=g) * 0.05).bfloat16().cuda() for w in widths]
    y = torch.randn(M, sum(widths), generator=g).bfloat16().cuda()
    y0 = y.clone()
    _, _, h = K1.k1_quant_shrink(case["x"], case["As"], case["meta"])
    E.expand_add(y, h, bs, case["meta"])
    torch.cuda.synchronize()
    ids = case["ids"]
    d = reference.lora_expand(list(grouped_h(case["x"], case["As"], ids).to(torch.bfloat16).float()), bs, ids)
    want = (y0.float() + d).to(torch.bfloat16)
    err = (y.float() - want.float()).abs()
    assert float((err - want.float().abs() * 2.0 ** -6).max()) <= 0.02


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    _hopper()
    K, S, R, M = 4096, 2, 64, 256
    case = make_case(M, 8, R, K, S, seed=31, device="cuda")
    codes, scales, h = _poisoned(M, K, S, R)
    K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h)  # load outside the capture
    codes, scales, h = _poisoned(M, K, S, R)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K1.k1_quant_shrink(case["x"], case["As"], case["meta"], codes, scales, h)
    g.replay()
    torch.cuda.synchronize()
    _check(case, codes, scales, h, K)


if __name__ == "__main__":
    from tests.dsl46 import script_main

    script_main(FAST, K1.prebuild_configs(), lambda c: check_config(K1, c, functools.partial(ptx_problems, cfg=c), spills=False), lambda c: c.name())
