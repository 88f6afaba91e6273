"""Persistent, process-safe cache of compiled kernels (cubin + what the launcher needs).

Layout: ``<root>/<arch>/<family>/<config-name>-<key>/<dsl-version>/{kernel.cubin, kernel.ptx, meta.json}``

* ``key`` hashes the family, the configuration and the source of the family's module, so
  editing a kernel invalidates its entries;
* the DSL version is a directory level rather than part of the key, so a GPU machine without
  nvidia-cutlass-dsl can load what a prebuild made anywhere (it takes the newest version present),
  while a machine with the DSL uses and fills the entry for its own version.

Writers build into a temporary directory and ``os.replace`` it into place under a file lock;
readers verify the cubin's SHA-256 recorded in meta.json and rebuild a corrupt entry.
``cute.compile`` itself never caches across processes, so this is what makes a second start fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from filelock import FileLock

from .cubin_info import register_pool_problem
from .kernel_abi import ptx_entries

log = logging.getLogger("epilora_cute.compile")

META_VERSION = 1


class KernelUnavailable(RuntimeError):
    """No cached build and no way to compile one here."""


@dataclass(frozen=True)
class KernelArtifact:
    family: str
    config: dict
    arch: str
    dsl_version: str
    kernel_name: str
    param_sizes: tuple[int, ...]
    cubin: bytes
    path: Path


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None when it is not installed."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_root() -> Path:
    env = os.environ.get("EPILORA_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "epilora_cute"


_SOURCE_HASH_ATTR = "__epilora_source_hash__"


def _file_hash(module: ModuleType) -> str:
    """The family's own file plus the package's shared helpers (``_*.py`` beside it), which the
    kernels are built from too, as they are on disk now."""
    path = Path(inspect.getfile(module))
    h = hashlib.sha256(path.read_bytes())
    for shared in sorted(path.parent.glob("_*.py")):
        if shared.name != "__init__.py":
            h.update(shared.name.encode())
            h.update(shared.read_bytes())
    return h.hexdigest()


def _source_hash(module: ModuleType) -> str:
    """The source the cache keys a family's builds by: its files' hash when this process first asks
    (kept on the module object), not when it asks again. A build compiles the code this process
    imported, so its key must not follow a later edit of the file: session 39's prebuild, restarted
    after an edit while a worker of the first one still ran, stored that worker's old build under the
    edited source's key (one K2 cubin the GPU then ran in place of the edited code). _build refuses
    to store a build whose file changed since (editing either must invalidate the cached builds)."""
    h = module.__dict__.get(_SOURCE_HASH_ATTR)
    if h is None:
        h = _file_hash(module)
        setattr(module, _SOURCE_HASH_ATTR, h)
    return h


def entry_dir(module: ModuleType, config, arch: str, root: Path | None = None) -> Path:
    """The directory holding every DSL version's build of (family, config, arch)."""
    cfg = dataclasses.asdict(config)
    key = hashlib.sha256(json.dumps({"family": module.FAMILY, "config": cfg, "arch": arch,
                                     "source": _source_hash(module), "meta": META_VERSION},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_root()) / arch / module.FAMILY / f"{config.name()}-{key}"


def _read_entry(d: Path) -> KernelArtifact:
    meta = json.loads((d / "meta.json").read_text())
    cubin = (d / "kernel.cubin").read_bytes()
    if hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]:
        raise ValueError("cubin checksum mismatch")
    return KernelArtifact(meta["family"], meta["config"], meta["arch"], meta["dsl_version"], meta["kernel_name"],
                          tuple(meta["param_sizes"]), cubin, d)


def _build(module: ModuleType, config, arch: str, version: str, dest: Path) -> None:
    """Compile into a fresh temporary directory next to ``dest`` and move it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        dump = tmp / "dump"
        dump.mkdir()
        t0 = time.perf_counter()
        msg = f"compiling {module.FAMILY}/{config.name()} for {arch} (nvidia-cutlass-dsl {version})"
        log.info(msg)
        if os.environ.get("EPILORA_QUIET_BUILD") != "1":
            print(f"[epilora] {msg} ...", file=sys.stderr, flush=True)
        compiled = module.compile(config, f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}")
        if _file_hash(module) != _source_hash(module):
            raise RuntimeError(f"{module.FAMILY}'s source changed on disk since this process imported it: "
                               "its build is not stored (rebuild in a fresh process)")
        ptx = _artifact_text(compiled, dump, "PTX", ".ptx")
        cubin = _artifact_bytes(compiled, dump)
        entries = ptx_entries(ptx)
        if len(entries) != 1:
            raise RuntimeError(f"{module.FAMILY}: expected one kernel in the module, found {list(entries)}")
        (name, sizes), = entries.items()
        problem = register_pool_problem(ptx, cubin)
        if problem:
            raise RuntimeError(f"{module.FAMILY}/{config.name()}: {problem}")
        (tmp / "kernel.cubin").write_bytes(cubin)
        (tmp / "kernel.ptx").write_text(ptx)
        meta = {"family": module.FAMILY, "config": dataclasses.asdict(config), "arch": arch, "dsl_version": version,
                "kernel_name": name, "param_sizes": sizes, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "meta_version": META_VERSION}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(dump, ignore_errors=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        dt = time.perf_counter() - t0
        log.info("built %s/%s in %.1f s", module.FAMILY, config.name(), dt)
        if os.environ.get("EPILORA_QUIET_BUILD") != "1":
            print(f"[epilora]   done in {dt:.1f} s", file=sys.stderr, flush=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _artifact_text(compiled, dump: Path, attr: str, suffix: str) -> str:
    arts = getattr(compiled, "artifacts", None)
    val = getattr(arts, attr, None) if arts is not None else None
    if isinstance(val, str) and ".entry" in val:
        return val
    files = sorted(dump.glob(f"*{suffix}"))
    if not files:
        raise RuntimeError(f"the DSL left no {suffix} file in {dump}")
    return files[0].read_text()


def _artifact_bytes(compiled, dump: Path) -> bytes:
    arts = getattr(compiled, "artifacts", None)
    val = getattr(arts, "CUBIN", None) if arts is not None else None
    if isinstance(val, (bytes, bytearray)) and val[:4] == b"\x7fELF":
        return bytes(val)
    files = sorted(dump.glob("*.cubin"))
    if not files:
        raise RuntimeError(f"the DSL left no cubin in {dump}")
    return files[0].read_bytes()


def get_artifact(module: ModuleType, config, arch: str, *, root: Path | None = None,
                 allow_compile: bool = True) -> KernelArtifact:
    """The compiled kernel for (family, config, arch): from disk, else compiled now (if possible)."""
    base = entry_dir(module, config, arch, root)
    version = dsl_version()
    if version is None:
        # No DSL here: any DSL version's build of this exact source and configuration will do.
        for d in sorted(base.glob("*"), reverse=True):
            if d.name.startswith("."):
                continue
            try:
                return _read_entry(d)
            except (OSError, ValueError, KeyError):
                log.warning("ignoring unreadable cache entry %s", d)
        raise KernelUnavailable(
            f"{module.FAMILY}/{config.name()} for {arch} is not in the cache at {base.parent} and "
            "nvidia-cutlass-dsl is not installed to compile it: run `python -m epilora_cute.prebuild "
            f"--arch {arch}` on any machine with the DSL and copy the cache (EPILORA_CACHE_DIR)")
    dest = base / version
    try:
        return _read_entry(dest)
    except (OSError, ValueError, KeyError):
        pass
    if not allow_compile:
        raise KernelUnavailable(f"{module.FAMILY}/{config.name()} for {arch} is not cached at {dest}")
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base / f".{version}.lock")):
        try:  # another process may have built it while we waited for the lock
            return _read_entry(dest)
        except (OSError, ValueError, KeyError):
            if dest.exists():
                log.warning("rebuilding corrupt cache entry %s", dest)
            _build(module, config, arch, version, dest)
        return _read_entry(dest)
