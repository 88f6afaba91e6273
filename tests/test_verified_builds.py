"""tools/verified_builds.py: which shipped cubins differ from the GPU-verified ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tools import verified_builds as vb  # noqa: E402


def test_compare_sorts_builds_into_same_changed_new_and_gone():
    verified = {"k1/a": "1", "k1/b": "2", "ea/c": "3"}
    current = {"k1/a": "1", "k1/b": "9", "ea/d": "4"}
    r = vb.compare(current, verified)
    assert r == {"same": ["k1/a"], "changed": ["k1/b"], "new": ["ea/d"], "gone": ["ea/c"]}


def test_family_table_counts_per_family():
    r = {"same": ["k1/a", "k1/b"], "changed": ["ea/c"], "new": ["ea/d"], "gone": []}
    lines = vb.family_table(r, ["k1/z"])
    assert lines[1].split() == ["ea", "0", "1", "1", "0"]
    assert lines[2].split() == ["k1", "2", "0", "0", "1"]


def _fake_shas(shas, missing=(), ptx=None):
    """build_shas's stand-in: cubin shas as given, PTX shas "p" + the cubin's unless ``ptx`` names them."""
    ptx = ptx or {}
    return lambda cache, build, only=None: (
        {k: (v, ptx.get(k, "p" + v)) for k, v in shas.items() if not only or k.split("/")[0] in only}, list(missing))


def test_record_then_diff(tmp_path, monkeypatch, capsys):
    """record writes every build's sha with the run, the commit and the DSL version; diff is 0 while
    every build is the verified one and 1 (naming the build) once one changed or is new."""
    monkeypatch.setattr("epilora_cute.compile_cache.dsl_version", lambda: "4.8.1")
    out = tmp_path / "verified.json"
    monkeypatch.setattr(vb, "build_shas", _fake_shas({"k1/a": "1", "ea/c": "3"}))
    assert vb.main(["record", "--run", "run27", "--commit", "1a0192f", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["builds"] == {"ea/c": "3", "k1/a": "1"} and rec["dsl_version"] == "4.8.1" and rec["run"] == "run27"
    assert rec["ptx"] == {"ea/c": "p3", "k1/a": "p1"}
    assert vb.main(["diff", "--record", str(out)]) == 0
    monkeypatch.setattr(vb, "build_shas", _fake_shas({"k1/a": "1", "ea/c": "7", "ea/e": "5"}, ["k1/m"]))
    capsys.readouterr()
    assert vb.main(["diff", "--record", str(out)]) == 1
    text = capsys.readouterr().out
    assert "changed: ea/c" in text and "new: ea/e" in text and "not in the cache" in text
    assert vb.main(["diff", "--record", str(out), "--family", "k1"]) == 0  # k1's builds are all verified


def test_diff_names_changed_cubins_of_the_verified_ptx(tmp_path, monkeypatch, capsys):
    """A cubin that differs while its PTX is the verified one (ptxas's register allocation, session
    41) is still "changed", and named apart; a record without PTX shas names none."""
    monkeypatch.setattr("epilora_cute.compile_cache.dsl_version", lambda: "4.8.1")
    out = tmp_path / "verified.json"
    monkeypatch.setattr(vb, "build_shas", _fake_shas({"k1/a": "1", "k1/b": "2"}))
    assert vb.main(["record", "--run", "r", "--commit", "c", "--out", str(out)]) == 0
    monkeypatch.setattr(vb, "build_shas", _fake_shas({"k1/a": "9", "k1/b": "8"}, ptx={"k1/a": "p1"}))
    capsys.readouterr()
    assert vb.main(["diff", "--record", str(out)]) == 1
    text = capsys.readouterr().out
    assert "changed: k1/a, k1/b" in text
    assert "same PTX as verified" in text and text.split("same PTX as verified")[1].count("k1/") == 1
    assert vb.same_ptx(["k1/a", "k1/b"], {"k1/a": "p1", "k1/b": None}, {"k1/a": "p1", "k1/b": None}) == ["k1/a"]
    assert vb.same_ptx(["k1/a"], {"k1/a": "p1"}, {}) == []  # run39's record has no PTX shas


def test_record_refuses_an_incomplete_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("epilora_cute.compile_cache.dsl_version", lambda: "4.8.1")
    monkeypatch.setattr(vb, "build_shas", _fake_shas({"k1/a": "1"}, ["k1/b"]))
    assert vb.main(["record", "--run", "r", "--commit", "c", "--out", str(tmp_path / "v.json")]) == 1
    assert not (tmp_path / "v.json").exists()


def test_diff_refuses_another_dsl_version(tmp_path, monkeypatch):
    rec = tmp_path / "v.json"
    rec.write_text(json.dumps({"dsl_version": "4.6.0", "run": "r", "commit": "c", "builds": {}}))
    monkeypatch.setattr("epilora_cute.compile_cache.dsl_version", lambda: "4.8.1")
    assert vb.main(["diff", "--record", str(rec)]) == 2


def test_build_names_are_unique_within_each_family():
    """The record keys builds by family and configuration name: two configurations of one family
    with the same name would share a line."""
    from epilora_cute.kernels import families

    for mod in families():
        names = [c.name() for c in mod.prebuild_configs()]
        assert len(names) == len(set(names)), mod.FAMILY


def test_the_committed_record_covers_a_prebuild_set():
    """The committed record is well formed and names builds of today's families (a family renamed
    or dropped must be recorded again)."""
    if not vb.RECORD.exists():
        pytest.skip("no verified record committed yet")
    from epilora_cute.kernels import families

    rec = json.loads(vb.RECORD.read_text())
    assert rec["arch"] == vb.ARCH and rec["run"] and rec["commit"] and rec["builds"]
    fams = {mod.FAMILY for mod in families()}
    assert {k.split("/")[0] for k in rec["builds"]} <= fams
    assert all(len(v) == 64 for v in rec["builds"].values())
