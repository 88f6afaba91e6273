"""The LoRA down-projection by adapter group (kernels_dsl/shrink_grouped.py, v0.90): CPU model of
its group walk against the reference, configuration rules, compile/PTX/ABI checks with
nvidia-cutlass-dsl 4.8 and 4.6 (subprocess), GPU checks (marked gpu).

Run as a script (`python tests/test_shrink_grouped.py fast|all`) it compiles and checks the
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
from kernels_dsl import shrink_grouped as G  # noqa: E402
from tests.dsl46 import SHARDS, run_dsl46  # noqa: E402
from tests.test_expand_add import check_config  # noqa: E402
from tests.test_k1_shrink import assert_h_close, grouped_h, make_case  # noqa: E402

needs_dsl = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")

FAST = [
    G.Config(bn=16, rank=64, num_slices=3, stages=6),  # qkv at 256 x 32
    G.Config(bn=8, rank=8, num_slices=1, stages=6, h_bf16=False),  # rank 8: 56 zero rows of A
    G.Config(bn=64, rank=256, num_slices=4, stages=5),  # four rank chunks, the widest token tile
    G.Config(bn=32, rank=128, num_slices=2, stages=5),
]


# ---------------------------------------------------------------------------------------------
# CPU: the group walk (emulated) against the reference
# ---------------------------------------------------------------------------------------------

EMU_CASES = [
    # M, adapters, rank, K, slices, slot ranks?, bn, splits (None: the launch rule)
    (33, 1, 16, 1024, 1, False, 16, None),  # one group of ~26 tokens: two row chunks
    (101, 8, 64, 1040, 3, False, 16, 3),  # K tail of 16 inside the last k-block
    (257, 32, 64, 520, 2, True, 8, 1),  # many small groups, some of several chunks
    (599, 8, 128, 2048, 4, True, 64, 16),
    (300, 3, 8, 3696, 1, True, 32, 7),  # Qwen2.5-72B down at TP 8: K % 64 == 48
    (70, 4, 32, 576, 2, True, 16, 9),  # one k-block per split
]


@pytest.mark.parametrize("M,L,R,K,S,ranked,bn,splits", EMU_CASES, ids=lambda v: str(v))
def test_emulation_matches_reference(M, L, R, K, S, ranked, bn, splits):
    slot_ranks = torch.tensor([(R, R // 2, 0, 1)[i % 4] for i in range(L)], dtype=torch.int32) if ranked else None
    case = make_case(M, L, R, K, S, seed=M + L, slot_ranks=slot_ranks, specials=True)
    cfg = G.Config(bn=bn, rank=R, num_slices=S, stages=G.STAGES[bn], h_bf16=False)
    h = G.emulate(case["x"], case["As"], case["meta"], slot_ranks, config=cfg, splits=splits, h_dtype=torch.float32)
    assert not h.isnan().any(), "a row no CTA stores"
    assert_h_close(h, grouped_h(case["x"], case["As"], case["ids"]), K)
    assert not h[:, case["ids"] < 0].any()


def test_emulation_bf16_h_is_the_rounded_fp32_h():
    case = make_case(200, 8, 64, 512, 2, seed=5)
    h32 = G.emulate(case["x"], case["As"], case["meta"], h_dtype=torch.float32)
    h16 = G.emulate(case["x"], case["As"], case["meta"], h_dtype=torch.bfloat16)
    assert torch.equal(h16, h32.bfloat16())


def test_select_token_tile():
    """The smallest tile holding 1.5x the mean group, at most 64; the ring depth per tile."""
    assert G.select(3, 64, 256, 32).bn == 16  # mean 8 -> 12
    assert G.select(3, 64, 128, 32).bn == 8  # mean 4 -> 6
    assert G.select(3, 64, 64, 8).bn == 16
    assert G.select(1, 64, 256, 8).bn == 64  # mean 32 -> 48
    assert G.select(1, 64, 4096, 1).bn == 64
    assert G.select(1, 64, 1, 32).bn == 8
    for m in (1, 8, 16, 32, 64, 1000):
        cfg = G.select(2, 128, m, 1)
        assert cfg.stages == G.STAGES[cfg.bn]
    with pytest.raises(ValueError, match="rank 12"):
        G.select(1, 12, 64, 8)


def test_choose_splits():
    """~three CTAs per SM over the groups' clusters, <= 16, >= 2 k-blocks each."""
    cfg = lambda s, r=64: G.select(s, r, 256, 32)  # noqa: E731
    assert G.choose_splits(4096, cfg(3), 32) == 5  # qkv 256 x 32: 96 clusters
    assert G.choose_splits(12288, cfg(1), 32) == 13  # down: 32 clusters
    assert G.choose_splits(4096, cfg(3), 8) == 16  # qkv 64 x 8: 24 clusters
    assert G.choose_splits(4096, cfg(1, 256), 32) == 4  # four rank chunks
    assert G.choose_splits(256, cfg(1), 1) == 2  # 4 k-blocks: 2 each
    assert G.choose_splits(64, cfg(1), 1) == 1
    for k in (64, 256, 1040, 4096, 12288, 29568):
        for groups in (1, 8, 33, 200):
            s = G.choose_splits(k, cfg(2), groups)
            assert 1 <= s <= G.MAX_SPLITS and s <= max(1, -(-k // G.BK) // G.MIN_SPLIT_KBLOCKS)


def test_rings_fit_the_occupancy_they_assume():
    per_sm = 228 * 1024
    for cfg in G.prebuild_configs():
        ctas = 3 if cfg.bn <= 32 else 2
        assert ctas * (cfg.smem_bytes + 1024) <= per_sm, cfg.name()


def test_prebuild_set_has_every_selection():
    pre = set(G.prebuild_configs())
    for s in G.SLICE_COUNTS:
        for r in G.RANKS:
            for m, groups in ((1, 1), (64, 8), (256, 32), (300, 3), (8192, 1)):
                assert G.select(s, r, m, groups, True) in pre
        assert G.select(s, 64, 100, 9, False) in pre


def test_config_rejects():
    with pytest.raises(ValueError, match="bn"):
        G.Config(bn=24)
    with pytest.raises(ValueError, match="rank"):
        G.Config(rank=48)
    with pytest.raises(ValueError, match="stages"):
        G.Config(bn=64, stages=13)


def test_params_declaration():
    p = G.params(G.Config(rank=64, num_slices=3))
    assert [x.size for x in p] == [24, 24, 16, 16, 8, 16, 16, 16] + [24] * 3 + [4]
    assert [x.name for x in p[:2]] == ["x", "h"] and p[-1].name == "has_ranks"


def test_grid_covers_every_possible_group():
    cfg = G.Config(bn=16, rank=128, num_slices=3)
    assert G.grid(256, 32, cfg, 5) == ((5, 6, 33), (5, 1, 1))
    assert G.grid(3, 32, cfg, 1) == ((1, 6, 3), (1, 1, 1))  # at most one group per token


def _cpu_case():
    return make_case(20, 4, 16, 64, 2, seed=2)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda c: c.update(x=c["x"].float()), TypeError, "bfloat16"),
    (lambda c: c.update(x=c["x"][:, :60]), ValueError, "K % 8"),
    (lambda c: c.update(As=[c["As"][0], c["As"][1][:, :, :8].contiguous()]), ValueError, "every slice"),
    (lambda c: c.update(As=[c["As"][0]] * 5), ValueError, "1..4"),
    (lambda c: c.update(h=torch.empty(2, 20, 8)), ValueError, "h must be"),
    (lambda c: c.update(h=torch.empty(2, 20, 16, dtype=torch.float16)), ValueError, "float32 or bfloat16"),
    (lambda c: c.update(h=torch.empty(2, 20, 16), config=G.Config(rank=16, num_slices=2)),
     ValueError, "writes h as bfloat16"),
    (lambda c: c.update(config=G.Config(rank=64, num_slices=2)), ValueError, "does not match"),
    (lambda c: c.update(meta=build_meta(c["ids"][:10], 4)), ValueError, "metadata"),
    (lambda c: c.update(slot_ranks=torch.ones(4)), TypeError, "int32"),
    (lambda c: c.update(splits=2), ValueError, "splits must be"),  # K = 64: one k-block
    (lambda c: None, ValueError, "sm_90a"),
])
def test_bad_input(mutate, exc, match):
    c = _cpu_case()
    c.update(h=None, slot_ranks=None, config=None, splits=None)
    mutate(c)
    with pytest.raises(exc, match=match):
        G.grouped_shrink(c["x"], c["As"], c["meta"], c["h"], c["slot_ranks"], config=c["config"],
                         splits=c["splits"])


def test_bad_h_dtype_argument():
    c = _cpu_case()
    with pytest.raises(ValueError, match="h_dtype"):
        G.grouped_shrink(c["x"], c["As"], c["meta"], h_dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# Compile checks (no GPU): PTX content, the declared parameters, the smem struct, spills
# ---------------------------------------------------------------------------------------------


def ptx_problems(ptx: str, cfg: G.Config) -> list[str]:
    bad = [f"missing {ins}" for ins in (f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16.f32.bf16.bf16",
                                        "cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc.shared",
                                        "mbarrier.try_wait", "fence.proxy.async.shared::cta",
                                        # the split-K sum: cluster barriers and DSMEM loads
                                        "barrier.cluster.arrive", "barrier.cluster.wait",
                                        "mapa.shared::cluster.u32", "ld.shared::cluster.f32")
           if ins not in ptx]
    # one WGMMA group in flight in the loop, all of them done before a chunk's partial is stored
    for n in (0, 1):
        if not re.search(rf"wgmma\.wait_group\.sync\.aligned\s+{n};", ptx):
            bad.append(f"missing wgmma.wait_group {n}")
    # no quantization, no PDL, no atomics, no spills: one CTA writes each h element once
    bad += [f"unexpected {ins}" for ins in ("griddepcontrol", "mma.sync", "cvt.rn.satfinite.e4m3x2",
                                            "cp.async.bulk")
            if ins in ptx]
    for pat in (r"\.local\b", r"^\s*(?:@%p\d+\s+)?(?:atom|red)\."):
        if re.search(pat, ptx, re.M):
            bad.append(f"unexpected {pat}")
    return bad


def _check(cfg):
    return check_config(G, cfg, functools.partial(ptx_problems, cfg=cfg))


@needs_dsl
@pytest.mark.parametrize("cfg", FAST, ids=lambda c: c.name())
def test_compiles_with_required_instructions(cfg):
    r = _check(cfg)
    assert not r["problems"], r


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("cfg", G.prebuild_configs(), ids=lambda c: c.name())
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

GPU_MS = (1, 7, 33, 64, 100, 256, 511, 2048)


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


def _poisoned(S, M, R, dtype):
    return torch.full((S, M, R), float("nan"), dtype=dtype, device="cuda")


def _cfg32(bn, R, S):
    return G.Config(bn=bn, rank=R, num_slices=S, stages=G.STAGES[bn], h_bf16=False)


@pytest.mark.gpu
@pytest.mark.parametrize("L", (1, 8, 32))
@pytest.mark.parametrize("M", GPU_MS)
def test_gpu_matches_reference(M, L):
    """qkv-like: K = 4096, three slices, rank 64, mixed effective ranks, -1 tokens (NaN / inf rows
    among them), poisoned fp32 h; every token tile, the launch rule's split and forced ones."""
    _hopper()
    K, S, R = 4096, 3, 64
    slot_ranks = torch.tensor([(16, 32, 64, 0)[i % 4] if L > 1 else 64 for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, K, S, seed=M * 3 + L, slot_ranks=slot_ranks, device="cuda", specials=True)
    want = grouped_h(case["x"], case["As"], case["ids"])
    for bn, splits in ((8, None), (16, None), (32, 1), (64, 16), (16, 3)):
        h = _poisoned(S, M, R, torch.float32)
        G.grouped_shrink(case["x"], case["As"], case["meta"], h, case["slot_ranks"], config=_cfg32(bn, R, S),
                         splits=splits)
        torch.cuda.synchronize()
        assert_h_close(h, want, K)
        assert not h[:, case["ids"] < 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,R,K,S", [
    (300, 8, 8, 4096, 2), (300, 8, 16, 1024, 1), (511, 4, 128, 12288, 1), (257, 32, 256, 4096, 1),
    (130, 3, 64, 3696, 1), (100, 8, 32, 1040, 4), (2048, 8, 64, 12288, 1), (1000, 1, 64, 520, 2),
    (64, 8, 64, 29568, 1),
])
def test_gpu_ranks_and_shapes(M, L, R, K, S):
    """Every rank (1-4 rank chunks), deep K, K tails (K % 64 = 16 / 48 / 8), one to four slices; bf16 h
    is the fp32 build's h rounded to nearest even, bit for bit."""
    _hopper()
    case = make_case(M, L, R, K, S, seed=M + R + K, device="cuda", specials=True)
    want = grouped_h(case["x"], case["As"], case["ids"])
    bn = G.select(S, R, M, L).bn
    h32 = _poisoned(S, M, R, torch.float32)
    G.grouped_shrink(case["x"], case["As"], case["meta"], h32, config=_cfg32(bn, R, S))
    h16 = G.grouped_shrink(case["x"], case["As"], case["meta"])  # the same tile and split
    torch.cuda.synchronize()
    assert_h_close(h32, want, K)
    assert torch.equal(h16, h32.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, 4, 16))
@pytest.mark.parametrize("M", (64, 256, 700))
def test_gpu_token_tiles_are_bitwise_equal_and_deterministic(M, splits):
    """A token's h depends on its own x row, the k-block order and the split only: every token tile
    gives the same bits at one split count, and 10 runs give the same bits."""
    _hopper()
    K, S, R = 4096, 2, 64
    case = make_case(M, 32, R, K, S, seed=M, device="cuda")
    runs = []
    for i in range(10):
        bn = G.TOKEN_TILES[i % len(G.TOKEN_TILES)]
        cfg = G.Config(bn=bn, rank=R, num_slices=S, stages=G.STAGES[bn])
        runs.append(G.grouped_shrink(case["x"], case["As"], case["meta"], config=cfg, splits=splits))
    torch.cuda.synchronize()
    for h in runs[1:]:
        assert torch.equal(h.view(torch.int16), runs[0].view(torch.int16))
    want = grouped_h(case["x"], case["As"], case["ids"])
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    d = (runs[0].float() - want).abs() - want.abs() * 2.0 ** -8
    assert float((d / scale).max()) <= 1e-6 * (K ** 0.5) * 8


@pytest.mark.gpu
def test_gpu_matches_k1_h():
    """Against K1 (the hybrid path's other shrink): the same h within fp32 summation order."""
    _hopper()
    from kernels_dsl import k1_shrink as K1

    M, K, S, R = 256, 4096, 3, 64
    case = make_case(M, 32, R, K, S, seed=9, device="cuda")
    _, _, h1 = K1.k1_quant_shrink(case["x"], case["As"], case["meta"])
    h2 = G.grouped_shrink(case["x"], case["As"], case["meta"], h_dtype=torch.float32)
    torch.cuda.synchronize()
    assert_h_close(h2, h1, K)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_inputs():
    """Captured once, replayed on new x and a new token -> adapter mapping (new groups) in place."""
    _hopper()
    K, S, R, M, L = 4096, 2, 64, 200, 16
    case = make_case(M, L, R, K, S, seed=31, device="cuda")
    meta = case["meta"]
    h = _poisoned(S, M, R, torch.bfloat16)
    G.grouped_shrink(case["x"], case["As"], meta, h, groups=L)  # load outside the capture
    x = case["x"].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.grouped_shrink(x, case["As"], meta, h, groups=L)
    h.fill_(float("nan"))
    x.copy_(x.flip(0))
    ids2 = case["ids"].flip(0).contiguous()
    meta.prepare(ids2)  # the same buffers, refilled
    g.replay()
    want = G.grouped_shrink(x, case["As"], meta, groups=L)  # eager, on the new inputs
    torch.cuda.synchronize()
    assert torch.equal(h.view(torch.int16), want.view(torch.int16))


if __name__ == "__main__":
    from tests.dsl46 import script_main

    script_main(FAST, G.prebuild_configs(), _check, lambda c: c.name())
