"""The streamed LoRA down-projection (kernels_dsl/shrink_stream.py, v0.88): CPU model of its tile
walk against the reference, configuration rules, compile/PTX/ABI checks with nvidia-cutlass-dsl 4.8
and 4.6 (subprocess), GPU checks (marked gpu).

Run as a script (`python tests/test_shrink_stream.py fast|all`) it compiles and checks the
configurations and prints one RESULTS JSON line (how the 4.6.0 venv is tested).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from epilora_cute.compile_cache import dsl_version  # noqa: E402
from epilora_cute.metadata import build_meta  # noqa: E402
from kernels_dsl import shrink_stream as SS  # noqa: E402
from tests.dsl46 import SHARDS, run_dsl46  # noqa: E402
from tests.test_expand_add import check_config  # noqa: E402
from tests.test_k1_shrink import assert_h_close, grouped_h, make_case  # noqa: E402

needs_dsl = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")

FAST = [
    SS.Config(rank=64, num_slices=3, bm=128, stages=4),  # qkv at prefill sizes
    SS.Config(rank=64, num_slices=1, bm=64, stages=6, h_bf16=False),
    SS.Config(rank=8, num_slices=2, bm=64, stages=6),  # rank 8: N padded to 16, zero rows
    SS.Config(rank=256, num_slices=1, bm=128, stages=2),  # 128 accumulators per thread
    SS.Config(rank=128, num_slices=4, bm=64, stages=4),
]


# ---------------------------------------------------------------------------------------------
# CPU: the tile walk (emulated) against the reference
# ---------------------------------------------------------------------------------------------

EMU_CASES = [
    # M, adapters, rank, K, slices, slot ranks?, bm, splits (None: the launch rule)
    (33, 1, 16, 1024, 1, False, 64, None),
    (101, 8, 64, 1040, 3, False, 64, 3),  # K tail of 16 inside the last k-block
    (257, 32, 64, 520, 2, True, 128, 1),  # a tile meets many groups
    (599, 8, 128, 2048, 4, True, 128, 8),
    (300, 3, 8, 3696, 1, True, 64, 7),  # Qwen2.5-72B down at TP 8: K % 64 == 48
    (70, 4, 32, 576, 2, True, 64, 8),  # 9 k-blocks in 8 splits: ceil -> 5 of 2 (the last one empty)
]


@pytest.mark.parametrize("M,L,R,K,S,ranked,bm,splits", EMU_CASES, ids=lambda v: str(v))
def test_emulation_matches_reference(M, L, R, K, S, ranked, bm, splits):
    slot_ranks = torch.tensor([(R, R // 2, 0, 1)[i % 4] for i in range(L)], dtype=torch.int32) if ranked else None
    case = make_case(M, L, R, K, S, seed=M + L, slot_ranks=slot_ranks, specials=True)
    cfg = SS._ring(R, S, bm, False)
    h = SS.emulate(case["x"], case["As"], case["meta"], slot_ranks, config=cfg, splits=splits, h_dtype=torch.float32)
    assert not h.isnan().any(), "a row no CTA stores"
    assert_h_close(h, grouped_h(case["x"], case["As"], case["ids"]), K)


def test_emulation_bf16_h_is_the_rounded_fp32_h():
    case = make_case(200, 8, 64, 512, 2, seed=5)
    h32 = SS.emulate(case["x"], case["As"], case["meta"], h_dtype=torch.float32)
    h16 = SS.emulate(case["x"], case["As"], case["meta"], h_dtype=torch.bfloat16)
    assert torch.equal(h16, h32.bfloat16())


def test_select_rows_per_cta():
    # 128 rows once that still gives each of the 132 SMs a CTA, else 64
    assert SS.select(3, 64, 2048).bm == 64
    assert SS.select(3, 64, 5632).bm == 128  # 44 tiles x 3 slices = 132
    assert SS.select(3, 64, 5504).bm == 64  # 43 tiles
    assert SS.select(1, 64, 16384).bm == 64  # 128 tiles: short of one per SM
    assert SS.select(1, 64, 16897).bm == 128
    with pytest.raises(ValueError, match="rank 12"):
        SS.select(1, 12, 100)


def test_choose_splits():
    """Splits fill ~two CTAs per SM where the row tiles do not, <= 8 (a portable cluster), >= 8
    k-blocks each, none empty, and none where the partial does not fit over the ring."""
    sel = lambda s, m: SS.select(s, 64, m)  # noqa: E731
    assert SS.choose_splits(2048, 4096, sel(1, 2048)) == 8  # o: 32 tiles
    assert SS.choose_splits(2048, 4096, sel(2, 2048)) == 5  # gate_up: 64 CTAs -> 320
    assert SS.choose_splits(1024, 4096, sel(3, 1024)) == 6  # qkv: 48 CTAs -> 288
    assert SS.choose_splits(2048, 4096, sel(3, 2048)) == 1  # qkv: 96 CTAs, more than half the SMs
    assert SS.choose_splits(8192, 12288, sel(1, 8192)) == 1  # down: 128 CTAs
    assert SS.choose_splits(16384, 4096, sel(3, 16384)) == 1  # 384 CTAs
    assert SS.choose_splits(64, 256, sel(1, 64)) == 1  # 4 k-blocks: under one split's minimum
    assert SS.choose_splits(64, 576, sel(1, 64)) == 1  # 9 k-blocks
    assert SS.choose_splits(64, 4160, sel(1, 64)) == 8  # 65 k-blocks: 8 splits of 9 (the last 2)
    big = SS._ring(256, 1, 128, True)
    assert not big.partial_fits and SS.choose_splits(2048, 4096, big) == 1
    for cfg in SS.prebuild_configs():
        for m in (1, 100, 2048, 8192):
            for k in (256, 1040, 4096, 12288, 29568):
                s = SS.choose_splits(m, k, cfg)
                nkb = -(-k // SS.BK)
                per = -(-nkb // s)
                assert 1 <= s <= SS.MAX_SPLITS and (s - 1) * per < nkb, (cfg.name(), m, k, s)
                assert s == 1 or cfg.partial_fits


def test_rings_keep_two_ctas_per_sm():
    for cfg in SS.prebuild_configs():
        assert cfg.smem_bytes <= SS.SMEM_TWO_PER_SM, cfg.name()
        assert cfg.stages >= 2
    assert SS.select(3, 64, 8192, True) == SS.Config(rank=64, num_slices=3, bm=128, stages=4)
    assert SS.select(1, 64, 100, True) == SS.Config(rank=64, num_slices=1, bm=64, stages=6)


def test_prebuild_set_has_every_selection():
    pre = set(SS.prebuild_configs())
    for s in SS.SLICE_COUNTS:
        for r in SS.RANKS:
            for m in (1, 2048, 8192, 16384, 65536):
                assert SS.select(s, r, m, True) in pre
        for m in (1, 65536):
            assert SS.select(s, 64, m, False) in pre


def test_config_rejects():
    with pytest.raises(ValueError, match="bm"):
        SS.Config(bm=32)
    with pytest.raises(ValueError, match="rank"):
        SS.Config(rank=48)
    with pytest.raises(ValueError, match="shared memory"):
        SS.Config(rank=256, bm=128, stages=8)


def test_params_declaration():
    p = SS.params(SS.Config(rank=64, num_slices=3))
    assert [x.size for x in p] == [24, 24] + [16] * 5 + [24] * 3 + [4]
    assert [x.name for x in p[:2]] == ["x", "h"] and p[-1].name == "has_ranks"


def _cpu_case():
    return make_case(20, 4, 16, 64, 2, seed=2)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda c: c.update(x=c["x"].float()), TypeError, "bfloat16"),
    (lambda c: c.update(x=c["x"][:, :60]), ValueError, "K % 8"),
    (lambda c: c.update(As=[c["As"][0], c["As"][1][:, :, :8].contiguous()]), ValueError, "every slice"),
    (lambda c: c.update(As=[c["As"][0]] * 5), ValueError, "1..4"),
    (lambda c: c.update(h=torch.empty(2, 20, 8)), ValueError, "h must be"),
    (lambda c: c.update(h=torch.empty(2, 20, 16, dtype=torch.float16)), ValueError, "float32 or bfloat16"),
    (lambda c: c.update(h=torch.empty(2, 20, 16), config=SS.Config(rank=16, num_slices=2)),
     ValueError, "writes h as bfloat16"),
    (lambda c: c.update(config=SS.Config(rank=64, num_slices=2)), ValueError, "does not match"),
    (lambda c: c.update(meta=build_meta(c["ids"][:10], 4)), ValueError, "metadata"),
    (lambda c: c.update(slot_ranks=torch.ones(4)), TypeError, "int32"),
    (lambda c: c.update(splits=9), ValueError, "splits must be"),
    (lambda c: c.update(splits=2, As=[a.repeat(1, 1, 16, 1) for a in c["As"]], config=SS._ring(256, 2, 128, True)),
     ValueError, "does not fit"),
    (lambda c: None, ValueError, "sm_90a"),
])
def test_bad_input(mutate, exc, match):
    c = _cpu_case()
    c.update(h=None, slot_ranks=None, config=None, splits=None)
    mutate(c)
    with pytest.raises(exc, match=match):
        SS.stream_shrink(c["x"], c["As"], c["meta"], c["h"], c["slot_ranks"], config=c["config"], splits=c["splits"])


def test_bad_h_dtype_argument():
    c = _cpu_case()
    with pytest.raises(ValueError, match="h_dtype"):
        SS.stream_shrink(c["x"], c["As"], c["meta"], h_dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# Compile checks (no GPU): PTX content, the declared parameters, the smem struct, spills
# ---------------------------------------------------------------------------------------------


def ptx_problems(ptx: str, cfg: SS.Config) -> list[str]:
    n = cfg.rank_pad
    bad = [f"missing {ins}" for ins in (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16",
                                        "cp.async.cg.shared.global", "fence.proxy.async.shared::cta",
                                        # the split-K sum: cluster barriers and DSMEM loads
                                        "barrier.cluster.arrive", "barrier.cluster.wait",
                                        "mapa.shared::cluster.u32", "ld.shared::cluster.f32")
           if ins not in ptx]
    if not re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx):
        bad.append("missing wgmma.wait_group 0 (the stage is refilled after the next barrier)")
    # no quantization, no atomics, no spills: one CTA writes each h element once
    bad += [f"unexpected {ins}" for ins in ("griddepcontrol", "mma.sync", "cvt.rn.satfinite.e4m3x2")
            if ins in ptx]
    for pat in (r"\.local\b", r"^\s*(?:@%p\d+\s+)?(?:atom|red)\."):
        if re.search(pat, ptx, re.M):
            bad.append(f"unexpected {pat}")
    return bad


def _check(cfg):
    return check_config(SS, cfg, functools.partial(ptx_problems, cfg=cfg))


@needs_dsl
@pytest.mark.parametrize("cfg", FAST, ids=lambda c: c.name())
def test_compiles_with_required_instructions(cfg):
    r = _check(cfg)
    assert not r["problems"], r


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("cfg", SS.prebuild_configs(), ids=lambda c: c.name())
def test_prebuild_set_compiles(cfg):
    r = _check(cfg)
    assert not r["problems"], r


def test_dsl46_fast_subset():
    run_dsl46(Path(__file__).resolve(), "fast", 600)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_dsl46_prebuild_set(shard):
    run_dsl46(Path(__file__).resolve(), "all", 3600, shard)


# ---------------------------------------------------------------------------------------------
# GPU (the integrator runs these on the H200)
# ---------------------------------------------------------------------------------------------

GPU_MS = (1, 33, 64, 100, 256, 511, 2048, 8192)


def assert_bf16_h_close(h16, want, K):
    """bf16 h against the fp32 reference: one rounding (2^-8 of the value) on top of the fp32 sum's
    order error (assert_h_close's sqrt(K) ulps of the row's largest term)."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    d = (h16.float() - want).abs() - want.abs() * 2.0 ** -8
    assert float((d / scale).max()) <= 1e-6 * (K ** 0.5) * 8


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


def _poisoned(S, M, R, dtype):
    return torch.full((S, M, R), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("L", (1, 8, 32))
@pytest.mark.parametrize("M", GPU_MS)
def test_gpu_matches_reference(M, L):
    """qkv-like: K = 4096, three slices, rank 64, mixed effective ranks, -1 tokens (NaN / inf rows
    among them), poisoned fp32 h; both row tiles."""
    _hopper()
    K, S, R = 4096, 3, 64
    slot_ranks = torch.tensor([(16, 32, 64, 0)[i % 4] if L > 1 else 64 for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, K, S, seed=M * 3 + L, slot_ranks=slot_ranks, device="cuda", specials=True)
    want = grouped_h(case["x"], case["As"], case["ids"])
    for bm, splits in ((64, None), (128, None), (64, 1), (128, 8)):
        h = _poisoned(S, M, R, torch.float32)
        SS.stream_shrink(case["x"], case["As"], case["meta"], h, case["slot_ranks"],
                         config=SS._ring(R, S, bm, False), splits=splits)
        torch.cuda.synchronize()
        assert_h_close(h, want, K)
        assert not h[:, case["ids"] < 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,R,K,S", [
    (300, 8, 8, 4096, 2), (300, 8, 16, 1024, 1), (511, 4, 128, 12288, 1), (257, 32, 256, 4096, 1),
    (130, 3, 64, 3696, 1), (100, 8, 32, 1040, 4), (2048, 8, 64, 12288, 1), (1000, 1, 64, 520, 2),
])
def test_gpu_ranks_and_shapes(M, L, R, K, S):
    """Every rank, deep K (down), K tails (K % 64 = 16 / 48 / 8), one to four slices; bf16 h is
    the fp32 build's h rounded to nearest even, bit for bit."""
    _hopper()
    case = make_case(M, L, R, K, S, seed=M + R + K, device="cuda", specials=True)
    want = grouped_h(case["x"], case["As"], case["ids"])
    cfg32 = SS._ring(R, S, 64, False)
    h32 = _poisoned(S, M, R, torch.float32)
    SS.stream_shrink(case["x"], case["As"], case["meta"], h32, config=cfg32)
    # the bf16 build at the same tile and split: the same fp32 sums, rounded once
    h16 = SS.stream_shrink(case["x"], case["As"], case["meta"], config=SS._ring(R, S, 64, True),
                           splits=SS.choose_splits(M, K, cfg32))
    torch.cuda.synchronize()
    assert_h_close(h32, want, K)
    assert torch.equal(h16, h32.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, 3, 8))
@pytest.mark.parametrize("M", (64, 700, 8192))
def test_gpu_row_tiles_are_bitwise_equal_and_deterministic(M, splits):
    """A row's h depends on its own x row, the k-block order and the split only: 64- and 128-row
    tiles give the same bits at one split count, and 10 runs give the same bits."""
    _hopper()
    K, S, R = 4096, 2, 64
    case = make_case(M, 8, R, K, S, seed=M, device="cuda")
    runs = []
    for i in range(10):
        cfg = SS._ring(R, S, SS.BMS[i % 2], True)
        runs.append(SS.stream_shrink(case["x"], case["As"], case["meta"], config=cfg, splits=splits))
    torch.cuda.synchronize()
    for h in runs[1:]:
        assert torch.equal(h.view(torch.int16), runs[0].view(torch.int16))
    assert_bf16_h_close(runs[0], grouped_h(case["x"], case["As"], case["ids"]), K)


@pytest.mark.gpu
def test_gpu_matches_k1_h():
    """Against K1 (the hybrid path's other shrink): the same h within fp32 summation order."""
    _hopper()
    from kernels_dsl import k1_shrink as K1

    M, K, S, R = 2048, 4096, 3, 64
    case = make_case(M, 8, R, K, S, seed=9, device="cuda")
    _, _, h1 = K1.k1_quant_shrink(case["x"], case["As"], case["meta"])
    h2 = SS.stream_shrink(case["x"], case["As"], case["meta"], h_dtype=torch.float32)
    torch.cuda.synchronize()
    assert_h_close(h2, h1, K)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs():
    _hopper()
    K, S, R, M = 4096, 2, 64, 1024
    case = make_case(M, 8, R, K, S, seed=31, device="cuda")
    h = _poisoned(S, M, R, torch.bfloat16)
    SS.stream_shrink(case["x"], case["As"], case["meta"], h)  # load outside the capture
    x = case["x"].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        SS.stream_shrink(x, case["As"], case["meta"], h)
    h.fill_(float("nan"))
    x.copy_(x.flip(0))
    g.replay()
    want = SS.stream_shrink(x, case["As"], case["meta"])  # eager, on the new inputs
    torch.cuda.synchronize()
    assert torch.equal(h.view(torch.int16), want.view(torch.int16))

if __name__ == "__main__":
    from tests.dsl46 import script_main

    script_main(FAST, SS.prebuild_configs(), _check, lambda c: c.name())
