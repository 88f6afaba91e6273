"""The on-disk compile cache: miss, hit, corruption, concurrent builders, no-DSL loading."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epilora_cute import compile_cache
from epilora_cute.compile_cache import KernelUnavailable, dsl_version, entry_dir, get_artifact
from kernels_dsl import fp8_quant

ROOT = Path(__file__).resolve().parents[1]
CFG = fp8_quant.Config(threads=128, vectors_per_thread=1)
pytestmark = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")


def test_miss_then_hit(isolated_cache, monkeypatch):
    calls = []
    real = fp8_quant.compile
    monkeypatch.setattr(fp8_quant, "compile", lambda *a: calls.append(a) or real(*a))
    a1 = get_artifact(fp8_quant, CFG, "sm_90a")
    a2 = get_artifact(fp8_quant, CFG, "sm_90a")
    assert len(calls) == 1 and a1.cubin == a2.cubin and a1.path == a2.path
    assert a1.path.parent == entry_dir(fp8_quant, CFG, "sm_90a") and a1.dsl_version == dsl_version()


def test_key_depends_on_config_and_arch(isolated_cache):
    d = entry_dir(fp8_quant, CFG, "sm_90a")
    assert d != entry_dir(fp8_quant, fp8_quant.Config(128, 2), "sm_90a")
    assert d != entry_dir(fp8_quant, CFG, "sm_100a")


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta"])
def test_corrupt_entry_is_rebuilt(isolated_cache, damage):
    art = get_artifact(fp8_quant, CFG, "sm_90a")
    cubin = art.path / "kernel.cubin"
    if damage == "truncate":
        cubin.write_bytes(art.cubin[:100])
    elif damage == "flip":
        b = bytearray(art.cubin); b[len(b) // 2] ^= 0xFF; cubin.write_bytes(bytes(b))
    else:
        (art.path / "meta.json").write_text("{not json")
    again = get_artifact(fp8_quant, CFG, "sm_90a")
    assert again.cubin == art.cubin


def test_two_processes_build_once_and_agree(isolated_cache):
    code = ("import sys, json; sys.path.insert(0, %r);"
            "from epilora_cute.compile_cache import get_artifact; from kernels_dsl import fp8_quant;"
            "a = get_artifact(fp8_quant, fp8_quant.Config(128, 1), 'sm_90a');"
            "print(json.dumps({'sha': __import__('hashlib').sha256(a.cubin).hexdigest(), 'path': str(a.path)}))") % str(ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=os.environ.copy()) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    res = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert res[0] == res[1]
    built = list(Path(isolated_cache).rglob("meta.json"))
    assert len(built) == 1 and not list(Path(isolated_cache).rglob(".build-*"))


def test_without_dsl_loads_any_prebuilt_version_or_explains(isolated_cache, monkeypatch):
    art = get_artifact(fp8_quant, CFG, "sm_90a")
    monkeypatch.setattr(compile_cache, "dsl_version", lambda: None)
    assert get_artifact(fp8_quant, CFG, "sm_90a").cubin == art.cubin
    with pytest.raises(KernelUnavailable, match="prebuild"):
        get_artifact(fp8_quant, fp8_quant.Config(128, 2), "sm_90a")


def test_prebuild_prune_keeps_only_the_current_kernel_set(tmp_path):
    from epilora_cute.prebuild import prune

    arch = tmp_path / "sm_90a"
    keep = arch / "fam" / "cfgA-1111" / "4.8.1"
    stale_key = arch / "fam" / "cfgA-0000" / "4.8.1"
    other_version = arch / "fam" / "cfgA-1111" / "4.6.0"
    other_arch = tmp_path / "sm_100a" / "fam" / "cfgA-0000" / "4.8.1"
    for d in (keep, stale_key, other_version, other_arch):
        d.mkdir(parents=True)
        (d / "kernel.cubin").write_bytes(b"x")
    removed = prune("sm_90a", [{"path": str(keep)}], tmp_path)
    assert keep.is_dir() and other_arch.is_dir()
    assert not stale_key.parent.exists() and not other_version.exists()
    assert len(removed) == 2


def test_prebuild_in_a_process_pool_builds_the_same_set_in_order(tmp_path):
    """`--jobs N` (make prebuild uses one process per core): the same rows, in the kernel set's
    order, and the second run finds every build in the cache the pool wrote."""
    from epilora_cute.prebuild import prebuild

    pooled = prebuild("sm_90a", tmp_path, ["fp8_quant"], verbose=False, jobs=2)
    serial = prebuild("sm_90a", tmp_path, ["fp8_quant"], verbose=False, jobs=1)
    assert [r["config"] for r in pooled] == [c.name() for c in fp8_quant.prebuild_configs()]
    assert [(r["config"], r["path"]) for r in pooled] == [(r["config"], r["path"]) for r in serial]
    assert len(list(tmp_path.rglob("kernel.cubin"))) == len(pooled)


def test_source_hash_is_the_imported_code_and_an_edited_source_is_not_stored(tmp_path):
    """The cache key's source hash is taken once per module object (the code this process runs),
    and a build whose family file changed on disk since is refused, not stored under either key
    (session 39: a prebuild worker that outlived an edit stored its old build under the new key)."""
    import importlib.util
    from dataclasses import dataclass

    from epilora_cute import compile_cache as cc

    src = tmp_path / "fakefam.py"
    src.write_text("FAMILY = 'fakefam'\n")
    spec = importlib.util.spec_from_file_location("fakefam", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h0 = cc._source_hash(mod)
    assert h0 == cc._file_hash(mod)

    @dataclass(frozen=True)
    class Cfg:
        def name(self):
            return "c"

    def compile_and_edit(cfg, options):  # the file changes while this process compiles
        src.write_text("FAMILY = 'fakefam'\nX = 1\n")
        return None

    mod.compile = compile_and_edit
    dest = tmp_path / "cache" / "sm_90a" / "fakefam" / "c-0" / "4.8.1"
    with pytest.raises(RuntimeError, match="changed on disk"):
        cc._build(mod, Cfg(), "sm_90a", "4.8.1", dest)
    assert not dest.exists()
    assert cc._source_hash(mod) == h0 != cc._file_hash(mod)  # the key stays the imported code's
