"""Hybrid-path expand-add (kernels_dsl/expand_add.py): CPU emulation, compile/PTX/ABI checks with
nvidia-cutlass-dsl 4.8 (this venv) and 4.6 (.venv-dsl46, subprocess), GPU checks (marked gpu).

The emulation (expand_add.emulate) follows the kernel's tiling exactly -- column tiles inside
slices from the width scalars, BM-row tiles of the adapter-sorted tokens, the groups of each tile
with the rows of other groups zeroed, k16 steps below the effective rank, bf16(h), fp32
accumulation, one rounding -- and is compared with reference.lora_expand.

Run as a script (`python tests/test_expand_add.py fast|all`) it compiles and checks the
configurations and prints one RESULTS JSON line: that is how the 4.6.0 venv is tested.
"""

from __future__ import annotations

import functools
import re
import sys
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from epilora_cute import reference  # noqa: E402
from epilora_cute.compile_cache import dsl_version  # noqa: E402
from epilora_cute.kernel_abi import check_params, ptx_entries  # noqa: E402
from epilora_cute.metadata import build_meta  # noqa: E402
from kernels_dsl import expand_add as E  # noqa: E402
from tests.dsl46 import SHARDS, run_dsl46  # noqa: E402
from tests.ptxas import spill_problems  # noqa: E402

needs_dsl = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")

FAST = [E.Config(rank=64, num_slices=3), E.Config(rank=8, num_slices=1, bm=128), E.Config(rank=256, num_slices=2, bn=64),
        E.Config(rank=64, num_slices=2, bn=64, h_bf16=True), E.Config(rank=8, num_slices=1, h_bf16=True),
        E.Config(rank=64, num_slices=2, bn=64, ct=4), E.Config(rank=8, num_slices=1, bn=128, nb=3),
        E.Config(rank=64, num_slices=3, bn=64, ct=4, nb=3)]


# ---------------------------------------------------------------------------------------------
# Problem generator and a grouped fp32 reference (reference.lora_expand materialises [M, n, R])
# ---------------------------------------------------------------------------------------------


def make_case(M, L, R, widths, seed=0, neg_frac=0.2, slot_ranks=None, device="cpu", scale_b=0.05):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, L, (M,), generator=g)
    ids[torch.rand(M, generator=g) < neg_frac] = -1
    ids = ids.to(torch.int32)
    bs = [(torch.randn(L, 1, w, R, generator=g) * scale_b).bfloat16() for w in widths]
    h = torch.randn(len(widths), M, R, generator=g)
    if slot_ranks is not None:  # vLLM zero-pads every slot beyond its rank; the shrink then gives h = 0 there
        for lid, r in enumerate(slot_ranks.tolist()):
            for b in bs:
                b[lid, :, :, r:] = 0
        rr = slot_ranks[ids.clamp(min=0).long()]
        h = h * (torch.arange(R)[None, None, :] < rr[None, :, None])
    y = torch.randn(M, sum(widths), generator=g).bfloat16()
    meta = build_meta(ids, L)
    out = dict(ids=ids, bs=bs, h=h, y=y, meta=meta)
    if device != "cpu":
        out = dict(ids=ids.to(device), bs=[b.to(device) for b in bs], h=h.to(device), y=y.to(device),
                   meta=build_meta(ids.to(device), L))
    return out


def grouped_delta(h, bs, ids):
    """reference.lora_expand, one slot at a time (same fp32 math, no [M, n, R] temporaries)."""
    M = ids.shape[0]
    parts = []
    for hs, b in zip(h, bs):
        b3 = b[:, 0] if b.dim() == 4 else b
        d = torch.zeros(M, b3.shape[1], dtype=torch.float32, device=hs.device)
        for lid in torch.unique(ids).tolist():
            if lid < 0:
                continue
            sel = ids == lid
            d[sel] = hs[sel].float() @ b3[lid].float().t()
        parts.append(d)
    return torch.cat(parts, dim=1)


def expected(case, bf16_h=False):
    h = case["h"].to(torch.bfloat16).float() if bf16_h else case["h"]
    out = (case["y"].float() + grouped_delta(h, case["bs"], case["ids"])).to(torch.bfloat16)
    neg = case["ids"] < 0
    out[neg] = case["y"][neg]
    return out


def assert_close_bf16(got, want, h_rounded):
    """bf16 outputs: with bf16(h) in both, only the fp32 summation order differs (<= 1 ulp);
    against the fp32-h reference the bf16 rounding of h adds ~2^-9 relative per term."""
    d = (got.float() - want.float()).abs()
    if h_rounded:
        tol = want.float().abs() * 2.0 ** -7 + 1e-5
    else:
        tol = want.float().abs() * 2.0 ** -6 + 0.02
    assert bool((d <= tol).all()), f"max err {d.max().item()} at {divmod(int(d.argmax()), got.shape[1])}"


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's tiling (emulated) against the reference
# ---------------------------------------------------------------------------------------------

EMU_CASES = [
    # M, adapters, rank, slice widths, slot ranks?
    (33, 1, 16, (96,), False),
    (101, 8, 64, (136, 64, 72), False),
    (257, 32, 64, (200, 56), True),
    (599, 8, 128, (64, 32, 48, 80), True),
    (599, 32, 16, (136, 64, 72), False),
    (130, 32, 8, (144,), True),
]


@pytest.mark.parametrize("M,L,R,widths,ranked", EMU_CASES, ids=lambda v: str(v))
def test_emulation_matches_reference(M, L, R, widths, ranked):
    slot_ranks = None
    if ranked:
        choices = torch.tensor([r for r in (0, 8, 16, 24, 40, 64, 128) if r <= R])
        slot_ranks = choices[torch.randint(0, len(choices), (L,), generator=torch.Generator().manual_seed(M))]
        slot_ranks = slot_ranks.to(torch.int32)
    case = make_case(M, L, R, widths, seed=M + L, slot_ranks=slot_ranks)
    case["h"][:, case["ids"] < 0] = float("nan")  # must never reach an output
    got = E.emulate(case["y"], case["h"], case["bs"], case["meta"], slot_ranks)
    assert_close_bf16(got, expected(case, bf16_h=True), True)
    assert_close_bf16(got, expected(case), False)
    neg = case["ids"] < 0
    assert torch.equal(got[neg].view(torch.int16), case["y"][neg].view(torch.int16))  # -1 rows untouched


def test_emulation_is_tiling_invariant():
    case = make_case(211, 8, 64, (136, 64, 72), seed=3)
    outs = [E.emulate(case["y"], case["h"], case["bs"], case["meta"], config=E.Config(rank=64, num_slices=3, bm=bm, bn=bn))
            for bm, bn in ((64, 128), (128, 64), (32, 256))]
    for o in outs[1:]:
        assert_close_bf16(o, outs[0], True)


def test_grouped_reference_equals_reference_module():
    case = make_case(40, 4, 16, (24, 16), seed=1)
    d1 = grouped_delta(case["h"], case["bs"], case["ids"])
    d2 = reference.lora_expand(list(case["h"]), case["bs"], case["ids"])
    torch.testing.assert_close(d1, d2, rtol=1e-6, atol=1e-6)


def test_column_tiles_stay_inside_slices():
    widths = (4096, 1024, 1024)
    tiles = E.column_tiles(widths, 128)
    assert len(tiles) == E.grid(widths, 100, E.Config(rank=64, num_slices=3))[0] == 48
    for s, c0, base in tiles:
        assert 0 <= c0 < widths[s] and base == sum(widths[:s])
    t2 = E.column_tiles((136, 64, 72), 128)
    assert t2 == [(0, 0, 0), (0, 128, 0), (1, 0, 136), (2, 0, 200)]


def _kernel_column_chunk(widths, bn, ct, bx):
    """The kernel's derivation of blockIdx.x's tiles from the width scalars, step by step (ct > 1:
    chunks of ct tiles; slice, first column, slice base, tile count), or None past the grid."""
    t_start = c_start = 0
    found = None
    for i, w in enumerate(widths):
        nt = (w + bn - 1) // bn
        nch = (nt + ct - 1) // ct
        if t_start <= bx < t_start + nch:
            c0 = (bx - t_start) * ct * bn
            found = [(i, c0 + j * bn, c_start) for j in range(min(nt - (bx - t_start) * ct, ct))]
        t_start += nch
        c_start += w
    return found


@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (136, 64, 72), (1096, 136, 72, 8), (12288, 12288)])
@pytest.mark.parametrize("ct", E.COLUMN_TILES_PER_CTA)
@pytest.mark.parametrize("bn", (64, 128))
def test_column_chunks_cover_every_tile_once(widths, ct, bn):
    """v0.72: blockIdx.x's chunks are ct consecutive tiles of one slice (the last one of a slice
    shorter), together every column tile once in order, as many as the grid's x; the kernel's
    own derivation from the widths gives the same chunks."""
    chunks = E.column_chunks(widths, bn, ct)
    assert [t for c in chunks for t in c] == E.column_tiles(widths, bn)
    assert all(1 <= len(c) <= ct and len({t[0] for t in c}) == 1 for c in chunks)
    cfg = E.Config(rank=64, num_slices=len(widths), bm=64, bn=bn, ct=ct)
    assert E.grid(widths, 100, cfg, zsplit=1)[0] == len(chunks)
    assert [_kernel_column_chunk(widths, bn, ct, bx) for bx in range(len(chunks))] == chunks
    assert _kernel_column_chunk(widths, bn, ct, len(chunks)) is None


def test_emulation_column_sweep_is_bitwise_one_tile():
    """Sweeping ct tiles per CTA regroups whole tiles: the same sums, the same bits (mixed ranks,
    partial last tiles, tokens without an adapter)."""
    ranks = torch.tensor([64, 16, 0, 8] * 2, dtype=torch.int32)
    case = make_case(150, 8, 64, (1096, 136, 72), seed=11, slot_ranks=ranks)
    outs = [E.emulate(case["y"], case["h"], case["bs"], case["meta"], ranks,
                      config=E.Config(rank=64, num_slices=3, bm=64, bn=64, ct=ct)) for ct in E.COLUMN_TILES_PER_CTA]
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    assert_close_bf16(outs[-1], expected(case, bf16_h=True), True)


def test_column_sweep_and_ring_configs():
    """v0.72 / v0.75's builds: sweeping columns, the epilogue tile has its own smem (the next B
    flies beside it); with one tile it still reuses the ring, however deep; name suffixes only
    off the defaults (ct = 1, nb = 2 names, and so cache entries, unchanged), both validated; the
    sweep's and the GPU tests' builds are prebuilt; select() does not take them (opt-in until the
    H200 has measured them)."""
    one, four = E.Config(rank=64, num_slices=2, bn=64), E.Config(rank=64, num_slices=2, bn=64, ct=4)
    assert one.name() == "r64_s2_bm64_bn64" and four.name() == "r64_s2_bm64_bn64_ct4"
    assert four.smem_bytes == one.smem_bytes + 2 * 64 * 64 * 2  # sA + B double buffer + sC, not max(B, sC)
    deep = E.Config(rank=64, num_slices=3, bn=128, nb=4)
    assert deep.name() == "r64_s3_bm64_bn128_nb4"
    assert deep.smem_bytes == 8 * 1024 + 4 * 128 * 64 * 2  # sA + the ring, which sC (33 KiB) reuses
    assert E.Config(rank=64, bn=64, ct=4, nb=3).name() == "r64_s1_bm64_bn64_ct4_nb3"
    with pytest.raises(ValueError, match="ct"):
        E.Config(ct=3)
    with pytest.raises(ValueError, match="nb"):
        E.Config(nb=5)
    pre = set(E.prebuild_configs())
    assert set(E.CT_TEST_CONFIGS) <= pre
    # v0.76: from WIDE_M tokens a CTA sweeps 4 (one slice) or 8 (merged) narrow tiles, ranks <= 128
    assert all(E.select(s, m, r).ct == 1 for s in E.SLICE_COUNTS for r in E.RANKS for m in (1, E.WIDE_M - 1))
    assert all(E.select(s, m, 256).ct == 1 for s in E.SLICE_COUNTS for m in (E.WIDE_M, 8192))
    for m in (E.WIDE_M, 8192):
        assert [E.select(s, m, 64).ct for s in E.SLICE_COUNTS] == [4, 8, 8, 8]
        assert all(E.select(s, m, r).ct == E.column_tiles_per_cta(s) and E.select(s, m, r).bn == 64
                   for s in E.SLICE_COUNTS for r in E.RANKS if r <= 128)
    for s in E.SWEEP_SLICES:
        sweep = E.sweep_configs(s, 64)
        assert {c.ct for c in sweep.values()} | {E.select(s, E.WIDE_M, 64).ct} == set(E.COLUMN_TILES_PER_CTA)
        assert sweep["bm64_bn64"] == E.Config(rank=64, num_slices=s, bm=64, bn=64)  # the one-tile build
        assert {c.nb for c in sweep.values()} == set(E.B_RING_DEPTHS)
        assert sweep["bm64_bn64_hb_ct4"].h_bf16 and all(c.bn == 64 for c in sweep.values() if c.ct > 1)


def test_select_and_prebuild_set():
    pre = set(E.prebuild_configs())
    for s in E.SLICE_COUNTS:
        for r in E.RANKS:
            for m in (33, 64, 511, 2048, 8192):
                assert E.select(s, m, r) in pre
    for c in pre:
        assert c.smem_bytes <= 227 * 1024 and c.threads <= 256
    with pytest.raises(ValueError, match="rank"):
        E.select(1, 64, 48)
    # v0.13: bm 64 at every M (bm 128 at >= 2048 tokens was one CTA per SM by registers)
    assert all(E.select(s, m, 64).bm == 64 for s in E.SLICE_COUNTS for m in (33, 2048, 8192))
    # the former choice stays prebuilt: the GPU tests compare against it (no DSL on the GPU machine)
    assert E.Config(rank=64, num_slices=2, bm=128, bn=128) in pre
    # the bench's tile sweep (hybrid_stages, EPILORA_BENCH_K1SWEEP=1) runs prebuilt tiles only
    for s in E.SWEEP_SLICES:
        sweep = E.sweep_configs(s, 64)
        assert sweep and set(sweep.values()) <= pre


def test_params_declaration():
    p = E.params(E.Config(rank=64, num_slices=3))
    assert [x.size for x in p] == [24, 24] + [16] * 9 + [4, 4, 4, 4]


def test_config_validation():
    with pytest.raises(ValueError):
        E.Config(rank=64, num_slices=5)
    with pytest.raises(ValueError):
        E.Config(rank=12)
    with pytest.raises(ValueError):
        E.Config(bm=48)


def _cpu_case():
    return make_case(20, 4, 16, (24, 16), seed=2)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda c: c.update(y=c["y"].float()), TypeError, "bfloat16"),
    (lambda c: c.update(h=c["h"].double()), TypeError, "float32"),
    (lambda c: c.update(h=c["h"].half()), TypeError, "float32 or bfloat16"),
    (lambda c: c.update(h=c["h"].bfloat16(), config=E.Config(rank=16, num_slices=2)), ValueError, "reads h as float32"),
    (lambda c: c.update(config=E.Config(rank=16, num_slices=2, h_bf16=True)), ValueError, "reads h as bfloat16"),
    (lambda c: c.update(h=c["h"][:1]), ValueError, "h must be"),
    (lambda c: c.update(h=c["h"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "row-major"),
    (lambda c: c.update(bs=[c["bs"][0], c["bs"][1][:, :, :12].contiguous()]), ValueError, "multiples of 8|add up"),
    (lambda c: c.update(bs=[c["bs"][0]]), ValueError, "add up"),
    (lambda c: c.update(bs=[c["bs"][0].float(), c["bs"][1]]), TypeError, "bfloat16"),
    (lambda c: c.update(meta=build_meta(c["ids"][:10], 4)), ValueError, "metadata"),
    (lambda c: c.update(slot_ranks=torch.ones(4)), TypeError, "int32"),
    (lambda c: c.update(slot_ranks=torch.ones(2, dtype=torch.int32)), ValueError, ">= 4"),
    (lambda c: None, ValueError, "CUDA"),
])
def test_bad_input(mutate, exc, match):
    c = _cpu_case()
    c["slot_ranks"] = None
    c["config"] = None
    mutate(c)
    with pytest.raises(exc, match=match):
        E.expand_add(c["y"], c["h"], c["bs"], c["meta"], c["slot_ranks"], config=c["config"])


def test_emulation_bf16_h_is_the_fp32_h_result():
    """The kernel's operand is bf16(h) either way: a bf16 h (K1's h_bf16 store) gives y bit for bit."""
    ranks = torch.tensor([64, 16, 0, 8] * 2, dtype=torch.int32)
    case = make_case(130, 8, 64, (256, 128, 128), seed=3, slot_ranks=ranks)
    y32 = E.emulate(case["y"], case["h"], case["bs"], case["meta"], ranks)
    y16 = E.emulate(case["y"], case["h"].bfloat16(), case["bs"], case["meta"], ranks)
    assert torch.equal(y16.view(torch.int16), y32.view(torch.int16))
    assert not torch.equal(y32.view(torch.int16), case["y"].view(torch.int16))  # the case adds something


# ---------------------------------------------------------------------------------------------
# Compile for sm_90a (no GPU): PTX instructions, parameter ABI, shared memory
# ---------------------------------------------------------------------------------------------


def ptx_problems(ptx: str, cfg: E.Config | None = None) -> list[str]:
    bad = []
    for ins in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "cp.async.cg.shared.global", "cp.async.wait_group",
                "st.global.v4.b32", "ld.global.v4.b32"):  # 16-byte y accesses
        if ins not in ptx:
            bad.append(f"missing {ins}")
    if cfg is not None and cfg.h_bf16:  # bf16 h staged as 16-byte vectors, never converted
        if "st.shared.v4.b32" not in ptx:
            bad.append("h_bf16: missing st.shared.v4.b32")
        if "cvt.rn.bf16.f32" in ptx:
            bad.append("h_bf16: unexpected cvt.rn.bf16.f32")
    elif "cvt.rn.bf16.f32" not in ptx:  # h -> bf16 operand
        bad.append("missing cvt.rn.bf16.f32")
    for pat in (r"\.local\b", r"griddepcontrol", r"^\s*(?:@%p\d+\s+)?(?:atom|red)\."):  # no spills/atomics
        if re.search(pat, ptx, re.M):
            bad.append(f"unexpected {pat}")
    return bad


def check_config(mod, cfg, problems=None, spills=True) -> dict:
    """Compile one configuration; check PTX content (problems: ptx -> list, default this file's
    ptx_problems for cfg), the declared parameters (sizes against the PTX .entry), the DSL's smem
    struct against Config.smem_bytes, the cubin and (spills) ptxas's register spills, which the
    result lists under "spills" either way."""
    if problems is None:
        problems = functools.partial(ptx_problems, cfg=cfg)
    with tempfile.TemporaryDirectory() as d:
        f = mod.compile(cfg, f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {d}")
        ptxs, cubins = sorted(Path(d).glob("*.ptx")), sorted(Path(d).glob("*.cubin"))
        ptx = ptxs[0].read_text() if ptxs else ""
        cubin_ok = bool(cubins) and cubins[0].read_bytes()[:4] == b"\x7fELF"
        spilled = spill_problems(ptxs[0]) if ptxs else []
    bad = problems(ptx) + (spilled if spills else [])
    entries = ptx_entries(ptx)
    if len(entries) != 1:
        bad.append(f"{len(entries)} kernels in the module")
    else:
        (name, sizes), = entries.items()
        try:
            check_params(mod.params(cfg), sizes, name)
        except RuntimeError as e:
            bad.append(str(e))
        aligns = re.findall(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)", ptx.split(".entry", 1)[1].split(")", 1)[0])
        want = [8 if type(p).__name__ == "TensorParam" else 4 for p in mod.params(cfg)]
        got = [int(a) if a else 4 for a, _ in aligns]
        if got != want:
            bad.append(f"param alignments {got} != {want}")
    if ".target sm_90a" not in ptx:
        bad.append("not sm_90a")
    if not cubin_ok:
        bad.append("no cubin")
    smem = getattr(f, "epilora_smem_bytes", None)
    if smem is not None and smem != cfg.smem_bytes:
        bad.append(f"smem_bytes {cfg.smem_bytes} != DSL struct {smem}")
    if cfg.smem_bytes > 227 * 1024:
        bad.append("smem exceeds 227 KiB")
    ver = re.search(r"\.version (\S+)", ptx)
    return {"family": mod.FAMILY, "config": cfg.name(), "problems": bad, "spills": spilled, "ptx_version": ver.group(1) if ver else None}


@needs_dsl
@pytest.mark.parametrize("cfg", FAST, ids=lambda c: c.name())
def test_compiles_with_required_instructions(cfg):
    r = check_config(E, cfg)
    assert not r["problems"], r


# Prebuilt configurations that spill under ptxas -v, GPU-verified and timed as they are. A new spill
# elsewhere fails the test below; so does an entry here that no longer spills (the list stays
# true). Session 23 found r16_s2_bm64_bn128 (and _hb) at 4 bytes; v0.96's prologue removed both.
KNOWN_SPILLS: dict[str, str] = {}


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("cfg", E.prebuild_configs(), ids=lambda c: c.name())
def test_prebuild_set_compiles(cfg):
    known = cfg.name() in KNOWN_SPILLS
    r = check_config(E, cfg, spills=not known)
    assert not r["problems"], r
    if known and shutil.which("ptxas"):
        assert r["spills"], f"{cfg.name()} no longer spills: drop it from KNOWN_SPILLS"


def test_dsl46_fast_subset():
    run_dsl46(Path(__file__).resolve(), "fast", 600)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_dsl46_prebuild_set(shard):
    run_dsl46(Path(__file__).resolve(), "all", 3600, shard)



def test_emulation_group_split_invariant():
    """The group split (grid z) only moves whole groups between CTAs: y is bit-identical for any z,
    and every row with an adapter is written (rows of slot -1 untouched)."""
    case = make_case(150, 32, 64, (136, 64, 72), seed=13)
    case["h"][:, case["ids"] < 0] = float("nan")
    base = E.emulate(case["y"], case["h"], case["bs"], case["meta"], zsplit=1)
    assert_close_bf16(base, expected(case, bf16_h=True), True)
    for z in (2, 5, 33, 64):
        got = E.emulate(case["y"], case["h"], case["bs"], case["meta"], zsplit=z)
        assert torch.equal(got.view(torch.int16), base.view(torch.int16)), z


def test_choose_zsplit():
    qkv = (4096, 1024, 1024)
    cfg = E.select(3, 32, 64)
    assert E.grid(qkv, 32, cfg) == (48, 1, 1)  # no max_loras: no group split (the old geometry)
    assert E.grid(qkv, 32, cfg, max_loras=32) == (48, 1, 8)  # ceil(256 / 48) = 6 -> 8
    assert E.grid((12288, 12288), 32, E.select(2, 32, 64), max_loras=32) == (192, 1, 2)
    assert E.grid(qkv, 32, cfg, max_loras=32, zsplit=3) == (48, 1, 3)
    assert E.grid(qkv, 2048, E.select(3, 2048, 64), max_loras=32)[2] == 1  # enough CTAs already
    for m in (1, 5, 33, 256):
        for L in (1, 8, 32, 128):
            for widths in (qkv, (4096,), (12288, 12288)):
                c = E.select(len(widths), m, 64)
                z = E.choose_zsplit(widths, m, c, L)
                assert 1 <= z <= min(c.bm, m, L + 1)
                assert z & (z - 1) == 0 or z == min(c.bm, m, L + 1)  # a power of two unless capped


# ---------------------------------------------------------------------------------------------
# GPU (the integrator runs these on the H200): launches through epilora_cute.kernels.get_kernel
# ---------------------------------------------------------------------------------------------

GPU_MS = (33, 64, 100, 256, 511, 2048, 8192)


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("L", (1, 8, 32))
@pytest.mark.parametrize("M", GPU_MS)
def test_gpu_matches_reference(M, L):
    _hopper()
    widths, R = (4096, 1024, 1024), 64
    slot_ranks = torch.tensor([(16, 32, 64, 0)[i % 4] if L > 1 else 64 for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, widths, seed=M * 7 + L, slot_ranks=slot_ranks, device="cuda")
    y0 = case["y"].clone()
    neg = case["ids"] < 0
    y0[neg] = float("nan")  # poison the rows that must be neither read nor written
    case["y"] = y0.clone()
    case["h"][:, neg] = float("nan")  # and h of tokens without an adapter (never used)
    out = E.expand_add(case["y"], case["h"], case["bs"], case["meta"], slot_ranks.cuda())
    assert out is case["y"]
    torch.cuda.synchronize()
    assert torch.equal(out[neg].view(torch.int16), y0[neg].view(torch.int16))
    keep = ~neg
    want = expected(dict(case, y=y0), bf16_h=True)
    assert_close_bf16(out[keep], want[keep], True)
    assert_close_bf16(out[keep], expected(dict(case, y=y0))[keep], False)


@pytest.mark.gpu
@pytest.mark.parametrize("R,widths", [(16, (2048,)), (128, (1536, 1536)), (256, (1024, 512, 512, 256)), (8, (4096,))])
def test_gpu_ranks_and_slices_without_slot_ranks(R, widths):
    _hopper()
    case = make_case(300, 8, R, widths, seed=R, device="cuda")
    y0 = case["y"].clone()
    E.expand_add(case["y"], case["h"], case["bs"], case["meta"])
    torch.cuda.synchronize()
    assert_close_bf16(case["y"], expected(dict(case, y=y0), bf16_h=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("M", (100, 2048))
def test_gpu_bitwise_deterministic(M):
    _hopper()
    case = make_case(M, 32, 64, (4096, 1024, 1024), seed=5, device="cuda")
    y0 = case["y"].clone()
    first = None
    for _ in range(5):
        y = y0.clone()
        E.expand_add(y, case["h"], case["bs"], case["meta"])
        if first is None:
            first = y
        else:
            assert torch.equal(y.view(torch.int16), first.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("M", (33, 256))
def test_gpu_group_split_bitwise_invariant(M):
    """Grid z (the group split) only moves whole groups between CTAs: bit-identical y for z = 1
    (the geometry before the split), the default and odd splits, and equal to the reference."""
    _hopper()
    case = make_case(M, 32, 64, (4096, 1024, 1024), seed=M + 17, device="cuda")
    y0 = case["y"].clone()
    outs = {}
    for z in (1, None, 5, 64):
        y = y0.clone()
        E.expand_add(y, case["h"], case["bs"], case["meta"], zsplit=z)
        outs[z] = y
    torch.cuda.synchronize()
    for z, y in outs.items():
        assert torch.equal(y.view(torch.int16), outs[1].view(torch.int16)), z
    assert_close_bf16(outs[None], expected(dict(case, y=y0), bf16_h=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,R,widths", [(33, 8, 64, (4096, 1024, 1024)), (2048, 1, 64, (12288, 12288)),
                                          (256, 32, 64, (4096,)), (511, 8, 8, (2048, 512)), (300, 4, 256, (1024, 512)),
                                          (2500, 32, 16, (4096, 1024, 1024, 512))])
def test_gpu_bf16_h_is_bitwise_fp32_h(M, L, R, widths):
    """v0.71: a bf16 h (K1's h_bf16 store) gives the y of the fp32 h it rounds, bit for bit (the
    MMA operand is bf16(h) either way); rows without an adapter untouched (their h poisoned);
    mixed effective ranks; both tile widths (below / from WIDE_M)."""
    _hopper()
    ranks = torch.tensor([(R, R // 2, 0, 8)[i % 4] for i in range(L)], dtype=torch.int32)
    case = make_case(M, L, R, widths, seed=M + R, slot_ranks=ranks, device="cuda")
    neg = case["ids"] < 0
    case["h"][:, neg] = float("nan")
    y0 = case["y"].clone()
    y0[neg] = float("nan")
    y32, y16 = y0.clone(), y0.clone()
    E.expand_add(y32, case["h"], case["bs"], case["meta"], ranks.cuda())
    out = E.expand_add(y16, case["h"].bfloat16(), case["bs"], case["meta"], ranks.cuda())
    assert out is y16
    torch.cuda.synchronize()
    assert torch.equal(y16.view(torch.int16), y32.view(torch.int16))
    assert torch.equal(y16[neg].view(torch.int16), y0[neg].view(torch.int16))
    keep = ~neg
    assert_close_bf16(y16[keep], expected(dict(case, y=y0), bf16_h=True)[keep], True)


def _assert_configs_bitwise_equal(case, cfgs):
    """Each configuration on its own copy of the case's y: the same bits from all of them (rows
    without an adapter untouched), and that y within the reference's tolerance."""
    y0 = case["y"].clone()
    outs = []
    for cfg in cfgs:
        y = y0.clone()
        E.expand_add(y, case["h"], case["bs"], case["meta"], config=cfg)
        outs.append(y)
    torch.cuda.synchronize()
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int16), outs[0].view(torch.int16))
    assert_close_bf16(outs[-1], expected(dict(case, y=y0), bf16_h=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("L", (1, 32))
def test_gpu_prefill_bm64_equals_bm128(L):
    """v0.13: from 2048 tokens select() takes bm 64 instead of 128; each output element is the
    same thread-local fp32 sum and one rounding, so y is bit-identical (gate_up-like widths)."""
    _hopper()
    M, widths = 2048, (12288, 12288)
    case = make_case(M, L, 64, widths, seed=L + 40, device="cuda")
    assert E.select(2, M, 64).bm == 64
    _assert_configs_bitwise_equal(case, (E.select(2, M, 64), E.Config(rank=64, num_slices=2, bm=128, bn=128)))


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,widths", [(33, 8, (2048, 512)), (256, 32, (4096, 1024, 1024)), (2048, 8, (4096,)),
                                        (2500, 32, (12288, 12288))])
def test_gpu_bn64_is_bitwise_bn128(M, L, widths):
    """select() takes the bn 64 tile from WIDE_M tokens (v0.37) and bn 128 below: each output
    element is the same sum in the same order either way (the tile width only regroups columns),
    so y is bit-identical, rows without an adapter untouched, with the group split."""
    _hopper()
    case = make_case(M, L, 64, widths, seed=M + L, device="cuda")
    _assert_configs_bitwise_equal(case, [E.Config(rank=64, num_slices=len(widths), bn=bn) for bn in (128, 64)])


CT_GPU_CASES = [  # (M, adapters, rank, widths, the column-sweeping / deep-ring build)
    (33, 8, 64, (4096, 1024, 1024), E.Config(rank=64, num_slices=3, bm=64, bn=128, nb=3)),
    (256, 32, 64, (4096, 1024, 1024), E.Config(rank=64, num_slices=3, bm=64, bn=128, nb=4)),
    (2048, 1, 64, (12288, 12288), E.Config(rank=64, num_slices=2, bm=64, bn=64, ct=8)),
    (2500, 8, 64, (1096, 136, 72), E.Config(rank=64, num_slices=3, bm=64, bn=64, ct=4)),  # partial chunks / tiles
    (511, 32, 64, (4096,), E.Config(rank=64, num_slices=1, bm=64, bn=64, ct=4, nb=3)),
    (64, 8, 64, (12288, 12288), E.Config(rank=64, num_slices=2, bm=64, bn=64, nb=3)),
    (300, 4, 8, (4096,), E.CT_TEST_CONFIGS[0]),
    (777, 8, 256, (1024, 512, 512, 256), E.CT_TEST_CONFIGS[1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,L,R,widths,cfg", CT_GPU_CASES, ids=lambda v: getattr(v, "name", lambda: str(v))())
def test_gpu_sweep_and_ring_builds_are_bitwise_one_tile(M, L, R, widths, cfg):
    """v0.72 / v0.75: a CTA sweeping cfg.ct column tiles (h staged once, the next B in flight
    during the epilogue) or running a cfg.nb-deep B ring writes the y of the default build of the
    same tile, bit for bit: mixed effective ranks, tokens without an adapter (their y and h rows
    poisoned, left untouched), the default and forced group splits; and that y within the
    reference's tolerance."""
    import dataclasses

    _hopper()
    ranks = torch.tensor([(R, R // 2, 0, 8)[i % 4] for i in range(L)], dtype=torch.int32).cuda()
    case = make_case(M, L, R, widths, seed=M + R + cfg.ct, slot_ranks=ranks.cpu(), device="cuda")
    neg = case["ids"] < 0
    case["h"][:, neg] = float("nan")
    y0 = case["y"].clone()
    y0[neg] = float("nan")
    one = dataclasses.replace(cfg, ct=1, nb=2)
    ref = y0.clone()
    E.expand_add(ref, case["h"], case["bs"], case["meta"], ranks, config=one)
    for z in (None, 1, 5):
        y = y0.clone()
        out = E.expand_add(y, case["h"], case["bs"], case["meta"], ranks, config=cfg, zsplit=z)
        assert out is y
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), z
    keep = ~neg
    assert torch.equal(ref[neg].view(torch.int16), y0[neg].view(torch.int16))
    assert_close_bf16(ref[keep], expected(dict(case, y=y0), bf16_h=True)[keep], True)


@pytest.mark.gpu
@pytest.mark.parametrize("S,widths", [(1, (4096,)), (2, (12288, 12288)), (3, (4096, 1024, 1024))])
def test_gpu_column_sweep_on_bf16_h_is_bitwise_fp32_h(S, widths):
    """The sweep's bf16-h column-sweeping build (v0.71 + v0.72) against the one-tile fp32-h build."""
    _hopper()
    case = make_case(2048, 8, 64, widths, seed=S + 60, device="cuda")
    y0 = case["y"].clone()
    y32, y16 = y0.clone(), y0.clone()
    E.expand_add(y32, case["h"], case["bs"], case["meta"], config=E.Config(rank=64, num_slices=S, bm=64, bn=64))
    E.expand_add(y16, case["h"].bfloat16(), case["bs"], case["meta"], config=E.sweep_configs(S, 64)["bm64_bn64_hb_ct4"])
    torch.cuda.synchronize()
    assert torch.equal(y16.view(torch.int16), y32.view(torch.int16))


def test_select_takes_the_narrow_tile_from_wide_m():
    assert E.select(3, E.WIDE_M - 1, 64).bn == 128
    assert E.select(3, E.WIDE_M, 64).bn == 64
    assert E.select(1, 64, 256).bn == 64
    assert all(E.select(s, m, r) in E.prebuild_configs() for s in (1, 2, 3, 4) for r in E.RANKS
               for m in (1, E.WIDE_M - 1, E.WIDE_M, 8192))


def test_prebuild_set_has_the_bf16_h_tiles():
    """Every tile select() takes, also built for a bf16 h (v0.71)."""
    import dataclasses

    built = set(E.prebuild_configs())
    for s in (1, 2, 3, 4):
        for r in E.RANKS:
            for m in (1, E.WIDE_M - 1, E.WIDE_M, 8192):
                assert dataclasses.replace(E.select(s, m, r), h_bf16=True) in built, (s, r, m)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    _hopper()
    case = make_case(256, 8, 64, (2048, 512), seed=9, device="cuda")
    y0 = case["y"].clone()
    y = y0.clone()
    E.expand_add(y, case["h"], case["bs"], case["meta"])  # load the kernel outside the capture
    g = torch.cuda.CUDAGraph()
    y.copy_(y0)
    with torch.cuda.graph(g):
        E.expand_add(y, case["h"], case["bs"], case["meta"])
    y.copy_(y0)
    g.replay()
    torch.cuda.synchronize()
    assert_close_bf16(y, expected(dict(case, y=y0), bf16_h=True), True)


if __name__ == "__main__":
    from tests.dsl46 import script_main

    script_main(FAST, E.prebuild_configs(), lambda c: check_config(E, c, spills=c.name() not in KNOWN_SPILLS), lambda c: c.name())
