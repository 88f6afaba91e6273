"""Timed dispatch on the CPU, with an injected timer."""

import json

import pytest

from epilora_cute import dispatch as d


def key(**kw):
    base = dict(device="H200", k=4096, slices=(4096, 1024, 1024), rank=64, tokens=d.token_bucket(7),
                adapters=d.adapter_bucket(1), mode="graph")
    base.update(kw)
    return d.DispatchKey(**base)


def test_buckets():
    assert [d.token_bucket(n) for n in (1, 2, 3, 32, 33, 8192, 9000)] == [1, 2, 4, 32, 64, 8192, 8192]
    assert [d.adapter_bucket(n) for n in (0, 1, 3, 8, 32, 100)] == ["0", "1", "2-4", "5-8", "9-32", "33-inf"]


def test_fastest_is_kept_persisted_and_reused(tmp_path):
    t = d.DispatchTable(tmp_path / "dispatch.json")
    times = {"decode": 50.0, "hybrid": 70.0, "vllm": 90.0}
    calls = []
    timer = lambda fn, mode: calls.append(fn) or times[fn()]
    cands = {p: (lambda p=p: p) for p in times}
    assert d.choose(t, key(), cands, timer) == "decode"
    assert len(calls) == 3
    assert d.choose(t, key(), cands, timer) == "decode" and len(calls) == 3  # remembered
    t2 = d.DispatchTable(tmp_path / "dispatch.json")  # the next start reads the file
    assert t2.get(key()) == "decode"
    saved = json.loads((tmp_path / "dispatch.json").read_text())
    assert saved[key().text()]["times_us"]["hybrid"] == 70.0
    # Eager and graph modes are decided separately.
    assert d.choose(t, key(mode="eager"), cands, lambda fn, m: {"decode": 9, "hybrid": 5, "vllm": 7}[fn()]) == "hybrid"


def test_force_env_and_failing_candidates(tmp_path, monkeypatch):
    t = d.DispatchTable(tmp_path / "x.json")
    cands = {"a": lambda: "a", "b": lambda: "b"}

    def timer(fn, mode):
        if fn() == "a":
            raise RuntimeError("kernel refused this shape")
        return 1.0
    assert d.choose(t, key(), cands, timer) == "b"
    monkeypatch.setenv(d.FORCE_ENV, "a")
    assert d.choose(t, key(tokens=64), cands, timer) == "a"
    monkeypatch.setenv(d.FORCE_ENV, "zzz")
    with pytest.raises(ValueError, match="EPILORA_FORCE_PATH"):
        d.choose(t, key(), cands, timer)


def test_unwritable_table_still_decides(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    t = d.DispatchTable(ro / "sub" / "dispatch.json")
    assert d.choose(t, key(), {"a": lambda: 1}, lambda fn, m: 1.0) == "a"


def test_print_table(tmp_path, capsys):
    t = d.DispatchTable(tmp_path / "t.json")
    t.record(key(), {"decode": 1.0, "hybrid": 2.0})
    d.main(["--path", str(tmp_path / "t.json")])
    assert "-> decode" in capsys.readouterr().out
