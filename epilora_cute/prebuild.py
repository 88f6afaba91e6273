"""Compile the whole kernel set for a target on any machine (no GPU needed) into the cache.

    python -m epilora_cute.prebuild --arch sm_90a [--cache-dir DIR] [--family fp8_quant ...]

Copy the cache directory (or point EPILORA_CACHE_DIR at it) to a GPU machine, which then loads
and runs the kernels without nvidia-cutlass-dsl installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import time
from pathlib import Path

from .compile_cache import cache_root, dsl_version, get_artifact
from .kernel_abi import check_params
from .kernels import families


def _build_one(module_name: str, cfg, arch: str, cache_dir: Path | None) -> dict:
    """Compile (or find in the cache) one prebuild configuration; a worker's unit of work (the
    module by name and the frozen config travel to a pool worker by pickling)."""
    mod = importlib.import_module(module_name)
    t0 = time.perf_counter()
    art = get_artifact(mod, cfg, arch, root=cache_dir)
    params = mod.params(cfg) if hasattr(mod, "params") else mod.PARAMS
    check_params(params, art.param_sizes, art.kernel_name)
    return {"family": mod.FAMILY, "config": cfg.name(), "seconds": time.perf_counter() - t0,
            "cubin_bytes": len(art.cubin), "path": str(art.path)}


def prebuild(arch: str, cache_dir: Path | None = None, only: list[str] | None = None, verbose: bool = True,
             jobs: int = 1) -> list[dict]:
    """Every family's prebuild configurations into the cache. jobs > 1: a pool of processes (the
    DSL compiles in Python, one core per process; the cache's file locks make concurrent writers
    safe). Rows come back in the kernel set's order either way."""
    if dsl_version() is None:
        raise SystemExit("nvidia-cutlass-dsl is not installed: nothing can be compiled here")
    work = [(mod.__name__, cfg) for mod in families() if not only or mod.FAMILY in only
            for cfg in mod.prebuild_configs()]

    def report(row):
        if verbose:
            print(f"  {row['family']:12s} {row['config']:40s} {row['seconds']:6.2f} s  {row['cubin_bytes']:8d} B",
                  flush=True)
        return row

    if jobs <= 1:
        return [report(_build_one(m, cfg, arch, cache_dir)) for m, cfg in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a fresh interpreter per worker (the DSL's MLIR context does not survive fork).
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_build_one, m, cfg, arch, cache_dir) for m, cfg in work]
        return [report(fut.result()) for fut in futures]


def prune(arch: str, rows: list[dict], cache_dir: Path | None = None) -> list[Path]:
    """Delete this arch's cache entries that the prebuild did not produce or reuse: builds of
    older kernel sources (their key changed) and other DSL versions. Keeps the directory that is
    carried to the GPU machine down to the current kernel set."""
    kept = {Path(r["path"]).resolve() for r in rows}
    kept_entries = {p.parent for p in kept}
    arch_dir = (cache_dir or cache_root()) / arch
    removed = []
    for family_dir in sorted(p for p in arch_dir.iterdir() if p.is_dir()) if arch_dir.is_dir() else []:
        for entry in sorted(p for p in family_dir.iterdir() if p.is_dir()):
            if entry.resolve() not in kept_entries:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
                continue
            for version in sorted(p for p in entry.iterdir() if p.is_dir()):
                if version.resolve() not in kept:
                    shutil.rmtree(version, ignore_errors=True)
                    removed.append(version)
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: EPILORA_CACHE_DIR or ~/.cache/epilora_cute")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes (0: one per core)")
    ap.add_argument("--prune", action="store_true",
                    help="then delete the arch's entries not in the kernel set (stale sources, other DSL versions)")
    args = ap.parse_args(argv)
    if args.cache_dir is not None:
        os.environ["EPILORA_CACHE_DIR"] = str(args.cache_dir)
    os.environ.setdefault("EPILORA_QUIET_BUILD", "1")
    t0 = time.perf_counter()
    print(f"prebuilding for {args.arch} with nvidia-cutlass-dsl {dsl_version()}", flush=True)
    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    rows = prebuild(args.arch, args.cache_dir, args.family, jobs=jobs)
    print(f"{len(rows)} kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.prune:
        if args.family:
            raise SystemExit("--prune needs the whole kernel set (no --family)")
        removed = prune(args.arch, rows, args.cache_dir)
        print(f"pruned {len(removed)} stale cache entries", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
