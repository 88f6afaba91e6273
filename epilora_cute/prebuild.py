"""Compile the whole kernel set for a target on any machine (no GPU needed) into the cache.

    python -m epilora_cute.prebuild --arch sm_90a [--cache-dir DIR] [--family fp8_quant ...]

Copy the cache directory (or point EPILORA_CACHE_DIR at it) to a GPU machine, which then loads
and runs the kernels without nvidia-cutlass-dsl installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .compile_cache import dsl_version, get_artifact
from .kernel_abi import check_params
from .kernels import families


def prebuild(arch: str, cache_dir: Path | None = None, only: list[str] | None = None, verbose: bool = True) -> list[dict]:
    if dsl_version() is None:
        raise SystemExit("nvidia-cutlass-dsl is not installed: nothing can be compiled here")
    rows = []
    for mod in families():
        if only and mod.FAMILY not in only:
            continue
        for cfg in mod.prebuild_configs():
            t0 = time.perf_counter()
            art = get_artifact(mod, cfg, arch, root=cache_dir)
            params = mod.params(cfg) if hasattr(mod, "params") else mod.PARAMS
            check_params(params, art.param_sizes, art.kernel_name)
            rows.append({"family": mod.FAMILY, "config": cfg.name(), "seconds": time.perf_counter() - t0,
                         "cubin_bytes": len(art.cubin), "path": str(art.path)})
            if verbose:
                print(f"  {mod.FAMILY:12s} {cfg.name():40s} {rows[-1]['seconds']:6.2f} s  {len(art.cubin):8d} B",
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: EPILORA_CACHE_DIR or ~/.cache/epilora_cute")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    args = ap.parse_args(argv)
    if args.cache_dir is not None:
        os.environ["EPILORA_CACHE_DIR"] = str(args.cache_dir)
    os.environ.setdefault("EPILORA_QUIET_BUILD", "1")
    t0 = time.perf_counter()
    print(f"prebuilding for {args.arch} with nvidia-cutlass-dsl {dsl_version()}", flush=True)
    rows = prebuild(args.arch, args.cache_dir, args.family)
    print(f"{len(rows)} kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
