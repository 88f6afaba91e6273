"""tools/carry_cache.py: what a slim carry cache holds, and the no-DSL lookup that checks it."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tools import carry_cache as cc  # noqa: E402


def test_slim_rules_on_the_prebuild_set():
    from kernels_dsl import k2_prefill

    every = cc.wanted(full=True)
    slim = cc.wanted()
    with_prefill = cc.wanted(with_prefill=True)
    assert 0 < len(slim) < len(with_prefill) < len(every)
    for mod, cfg in slim:
        assert mod.FAMILY != cc.PREFILL_FAMILY and "trace" not in cfg.name()
        wide_pair = getattr(cfg, "token_tiles", False) or (mod.FAMILY == "lora_shrink_quant" and cfg.bn == 64)
        if getattr(cfg, "lora", True) and not wide_pair and mod.FAMILY != "lora_shrink_grouped":
            assert getattr(cfg, "rank", cc.SLIM_RANK) == cc.SLIM_RANK, cfg.name()
    # the grouped shrink (v0.90): every rank (its GPU tests run them all)
    assert {cfg.rank for mod, cfg in slim if mod.FAMILY == "lora_shrink_grouped"} == {8, 16, 32, 64, 128, 256}
    # the decode pair at 33..64 tokens: every rank (its GPU tests run them all)
    ranks = {(mod.FAMILY, cfg.rank) for mod, cfg in slim if getattr(cfg, "token_tiles", False) and cfg.lora}
    assert {r for _, r in ranks} == {8, 16, 32, 64, 128, 256}
    pre = {cfg for mod, cfg in with_prefill if mod.FAMILY == cc.PREFILL_FAMILY}
    # the prefill K2's bench builds: rank 64 in every accumulation mode, and the no-adapter ones
    assert k2_prefill.Config(bn=128, lora=True, num_slices=3, rank=64, accum="overlap", vstore=True) in pre
    assert k2_prefill.Config(bn=64, lora=False) in pre
    assert k2_prefill.Config(bn=128, lora=True, num_slices=3, rank=16) not in pre


def _fake_entry(mod, cfg, root: Path) -> None:
    """An entry as the compile cache writes it (meta.json + kernel.cubin), under some DSL version."""
    from epilora_cute.compile_cache import entry_dir

    d = entry_dir(mod, cfg, cc.ARCH, root) / "9.9.9"
    d.mkdir(parents=True)
    cubin = b"\x7fELF" + cfg.name().encode()
    (d / "kernel.cubin").write_bytes(cubin)
    (d / "meta.json").write_text(json.dumps({
        "family": mod.FAMILY, "config": cfg.name(), "arch": cc.ARCH, "dsl_version": "9.9.9",
        "kernel_name": "k", "param_sizes": [8], "cubin_sha256": hashlib.sha256(cubin).hexdigest()}))


def test_missing_lists_what_a_machine_without_the_dsl_would_not_find(tmp_path):
    from epilora_cute import compile_cache

    real = compile_cache.dsl_version
    builds = [b for b in cc.wanted() if b[0].FAMILY == "fp8_quant"][:3]
    assert len(builds) == 3
    names = [f"{m.FAMILY}/{c.name()}" for m, c in builds]
    assert cc.missing(tmp_path, builds) == names  # an empty cache: everything missing
    _fake_entry(*builds[1], tmp_path)
    assert cc.missing(tmp_path, builds) == [names[0], names[2]]
    assert compile_cache.dsl_version is real  # restored for the rest of the process


def test_slim_copies_the_slim_set_only(tmp_path):
    wanted = [b for b in cc.wanted(full=True) if b[0].FAMILY == "k1_quant_shrink"]
    keep = [b for b in wanted if cc.in_slim(b[0].FAMILY, b[1], False)][:2]
    drop = [b for b in wanted if not cc.in_slim(b[0].FAMILY, b[1], False)][:2]
    assert keep and drop
    src, dest = tmp_path / "src", tmp_path / "dest"
    for b in keep + drop:
        _fake_entry(*b, src)
    assert cc.slim(src, dest, with_prefill=False) == len(keep)
    assert cc.missing(dest, keep) == []
    assert len(cc.missing(dest, drop)) == len(drop)


def test_check_command_fails_with_the_missing_names(tmp_path, capsys):
    assert cc.main(["check", str(tmp_path)]) == 1
    assert "missing from" in capsys.readouterr().err


def test_families_subset_holds_those_families_at_every_rank(tmp_path):
    """`--families`: a few families' whole prebuild sets (every rank, no trace builds), nothing else."""
    only = ("k1_quant_shrink", "expand_add")
    sub = cc.wanted(only=only)
    assert {m.FAMILY for m, _ in sub} == set(only)
    assert not any("trace" in c.name() for _, c in sub)
    every = [b for b in cc.wanted(full=True) if b[0].FAMILY in only and "trace" not in b[1].name()]
    assert [(m.FAMILY, c) for m, c in sub] == [(m.FAMILY, c) for m, c in every]
    assert len({getattr(c, "rank", None) for _, c in sub}) > 1  # not only the slim rank
    k1_off_rank = [b for b in sub if b[0].FAMILY == "k1_quant_shrink" and b[1].rank != cc.SLIM_RANK][:1]
    other = [b for b in cc.wanted(full=True) if b[0].FAMILY == "fp8_quant"][:1]
    src, dest = tmp_path / "src", tmp_path / "dest"
    for b in k1_off_rank + other:
        _fake_entry(*b, src)
    assert cc.slim(src, dest, with_prefill=False, only=only) == 1
    assert cc.missing(dest, k1_off_rank) == [] and len(cc.missing(dest, other)) == 1


@pytest.mark.parametrize("argv", [["slim", "--with-prefill", "--families", "expand_add"],
                                  ["check", "x", "--full", "--families", "expand_add"],
                                  ["check", "x", "--with-prefill", "--families", "k1_quant_shrink"],
                                  ["check", "x", "--families", "expand_add,no_such_family"]])
def test_families_is_its_own_rule(argv, capsys):
    """--families replaces the slim rule: combined with --with-prefill / --full, or naming a family
    that does not exist, the command stops with a usage error instead of silently picking one."""
    with pytest.raises(SystemExit) as e:
        cc.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with" in err or "unknown families" in err


def test_add_merges_one_sides_builds_without_ptx(tmp_path):
    """`add` (an A/B's base side): the families' slim entries from SRC join DEST's own entries,
    kernel.ptx left behind; what SRC lacks is reported missing."""
    fam = [b for b in cc.wanted() if b[0].FAMILY == "fp8_quant"]
    other = [b for b in cc.wanted() if b[0].FAMILY == "l2_prefetch"][:1]
    assert len(fam) >= 3 and other
    src, dest = tmp_path / "src", tmp_path / "dest"
    for b in fam[:-1]:
        _fake_entry(*b, src)
    from epilora_cute.compile_cache import entry_dir

    ptx = entry_dir(*fam[0][:2], cc.ARCH, src) / "9.9.9" / "kernel.ptx"
    ptx.write_text("// ptx")
    _fake_entry(*other[0], dest)
    n, gone = cc.add(src, dest, ("fp8_quant",))
    assert n == len(fam) - 1
    assert gone == [f"fp8_quant/{fam[-1][1].name()}"]
    assert cc.missing(dest, other) == []  # DEST's own entry kept
    assert not (entry_dir(*fam[0][:2], cc.ARCH, dest) / "9.9.9" / "kernel.ptx").exists()
    assert cc.main(["add", str(src), str(dest), "--families", "fp8_quant"]) == 1  # one still missing


def test_add_full_takes_every_rank(tmp_path):
    """`add --full`: the family's whole prebuild set (the GPU test file's builds at every rank),
    not only the slim set's rank 64."""
    every = cc.wanted(only=("expand_add",))
    slim = [b for b in cc.wanted() if b[0].FAMILY == "expand_add"]
    assert len(every) > len(slim)
    src, dest = tmp_path / "src", tmp_path / "dest"
    for b in every:
        _fake_entry(*b, src)
    n, gone = cc.add(src, dest, ("expand_add",), full=True)
    assert (n, gone) == (len(every), [])
    assert cc.missing(dest, every) == []
    n_slim, _ = cc.add(src, tmp_path / "slim_only", ("expand_add",))
    assert n_slim == len(slim)
