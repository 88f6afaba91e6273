"""The kernel cache a device call carries: made slim, and checked the way the GPU machine reads it.

    python tools/carry_cache.py slim [--with-prefill | --families F1,F2]  # .gpu_carry/.epilora_cache -> .gpu_carry/slim
    python tools/carry_cache.py check DIR [--with-prefill | --full | --families F1,F2]
    python tools/carry_cache.py add SRC DEST --families F1[,F2] [--full]  # one side of an A/B into DEST

Why the check exists: session 22 built part of the kernel set into the default cache
(~/.cache/epilora_cute) instead of ./.epilora_cache, carried a cache without K1, and spent its
GPU minutes on a call whose every test and benchmark stopped at `KernelUnavailable`. `check`
looks up every configuration the carried cache is meant to hold exactly as the GPU machine does
(no nvidia-cutlass-dsl there: any DSL version's build of this source and configuration, found by
the same entry path) and fails, listing what is missing, before any device time is spent.

What a slim cache holds (it must fit one call beside vLLM's `.devvllm/2`): every family's
prebuilt configurations except the trace builds and the adapter builds of ranks other than 64
(the benchmarks' and the e2e's rank; the decode pair's 33..64-token builds at every rank), and without the prefill K2 unless `--with-prefill` (then its
rank-64 and no-adapter builds). `--full` checks the whole prebuild set.

`add` merges the slim set of some families from SRC (a cache built by this tree's source, e.g. a
base tree's, `tools/base_tree.sh --family`) into DEST without PTX, leaving DEST's other entries:
an A/B carries both sides' builds in one cache, since the builds are keyed by their source.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARCH = "sm_90a"
SLIM_RANK = 64
PREFILL_FAMILY = "k2_fp8_prefill"


def in_slim(family: str, config, with_prefill: bool) -> bool:
    """Whether a slim cache carries this prebuilt configuration."""
    if family == PREFILL_FAMILY and not with_prefill:
        return False
    if "trace" in config.name():
        return False
    if getattr(config, "token_tiles", False) or (family == "lora_shrink_quant" and config.bn == 64):
        return True  # the decode pair at 33..64 tokens: every rank (its GPU tests run them all)
    if family == "lora_shrink_grouped":
        return True  # every rank: its GPU tests run them all (~6 MB)
    adapter_build = getattr(config, "lora", True)
    return not (adapter_build and getattr(config, "rank", SLIM_RANK) != SLIM_RANK)


def wanted(with_prefill: bool = False, full: bool = False, only: tuple[str, ...] | None = None) -> list[tuple]:
    """(family module, config) of every build the carried cache must hold. only: these families'
    whole prebuild sets, every rank, without the trace builds (a call that tests and benches a few
    families beside vLLM: run27 carried K1, the prefill K2, expand-add, quantization and the decode
    shrink this way, 24 MB next to .devvllm/2's 29)."""
    from epilora_cute.kernels import families

    if only:
        return [(mod, cfg) for mod in families() if mod.FAMILY in only for cfg in mod.prebuild_configs()
                if "trace" not in cfg.name()]
    return [(mod, cfg) for mod in families() for cfg in mod.prebuild_configs()
            if full or in_slim(mod.FAMILY, cfg, with_prefill)]


def missing(cache_dir: Path, builds: list[tuple]) -> list[str]:
    """The builds a machine without the DSL would not find in ``cache_dir``."""
    from epilora_cute import compile_cache

    real = compile_cache.dsl_version
    compile_cache.dsl_version = lambda: None  # look up as the GPU machine does
    try:
        out = []
        for mod, cfg in builds:
            try:
                compile_cache.get_artifact(mod, cfg, ARCH, root=cache_dir)
            except compile_cache.KernelUnavailable:
                out.append(f"{mod.FAMILY}/{cfg.name()}")
        return out
    finally:
        compile_cache.dsl_version = real


def slim(src: Path, dest: Path, with_prefill: bool, only: tuple[str, ...] | None = None) -> int:
    """Copy the entries of the slim set (or of ``only``'s families) from ``src`` (a carry cache) to
    ``dest``; the number copied."""
    from epilora_cute.compile_cache import entry_dir

    if dest.exists():
        shutil.rmtree(dest)
    n = 0
    for mod, cfg in wanted(with_prefill, only=only):
        entry = entry_dir(mod, cfg, ARCH, src)
        if entry.is_dir():
            shutil.copytree(entry, entry_dir(mod, cfg, ARCH, dest))
            n += 1
    return n


def add(src: Path, dest: Path, only: tuple[str, ...], full: bool = False) -> tuple[int, list[str]]:
    """Copy the slim-set entries of ``only``'s families (full: their whole prebuild sets, every
    rank, for the family's GPU test file) from ``src`` into ``dest`` (no PTX: the GPU machine loads
    cubins), keeping what ``dest`` holds; (entries copied, builds still missing)."""
    from epilora_cute.compile_cache import entry_dir

    builds = wanted(only=only) if full else [(mod, cfg) for mod, cfg in wanted() if mod.FAMILY in only]
    n = 0
    for mod, cfg in builds:
        entry = entry_dir(mod, cfg, ARCH, src)
        if entry.is_dir():
            shutil.copytree(entry, entry_dir(mod, cfg, ARCH, dest), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("kernel.ptx"))
            n += 1
    return n, missing(dest, builds)


def _size_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim", help="make .gpu_carry/slim/.epilora_cache from .gpu_carry/.epilora_cache, then check it")
    c = sub.add_parser("check", help="every build the cache should carry is there")
    c.add_argument("cache_dir", type=Path)
    a = sub.add_parser("add", help="merge some families' slim set from SRC into DEST (one side of an A/B)")
    a.add_argument("src", type=Path)
    a.add_argument("dest", type=Path)
    a.add_argument("--families", required=True, help="comma-separated families")
    a.add_argument("--full", action="store_true",
                   help="the families' whole prebuild sets (every rank: what their GPU test files load)")
    # One rule per call: --families replaces the slim rule, so it cannot be combined with the
    # slim rule's options (it used to win silently).
    sg, cg = s.add_mutually_exclusive_group(), c.add_mutually_exclusive_group()
    sg.add_argument("--with-prefill", action="store_true")
    cg.add_argument("--with-prefill", action="store_true")
    cg.add_argument("--full", action="store_true")
    for g in (sg, cg):
        g.add_argument("--families", default="",
                       help="comma-separated families: their whole prebuild sets instead of the slim rule")
    args = ap.parse_args(argv)
    only = tuple(f for f in args.families.split(",") if f) or None
    if args.cmd == "add" and not only:
        ap.error("add: name the families")
    if only:
        from epilora_cute.kernels import families

        known = {mod.FAMILY for mod in families()}
        unknown = sorted(set(only) - known)
        if unknown:
            ap.error(f"unknown families {unknown}; known: {sorted(known)}")
    if args.cmd == "add":
        n, gone = add(args.src, args.dest, only, args.full)
        print(f"{args.dest}: {n} builds of {', '.join(only)} added, {_size_mb(args.dest):.1f} MiB")
        if gone:
            print(f"{len(gone)} still missing:", *gone, sep="\n  ", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "slim":
        src, dest = ROOT / ".gpu_carry" / ".epilora_cache", ROOT / ".gpu_carry" / "slim" / ".epilora_cache"
        if not src.is_dir():
            print(f"no {src}: run make carry-cache first", file=sys.stderr)
            return 1
        n = slim(src, dest, args.with_prefill, only)
        print(f"{dest}: {n} builds, {_size_mb(dest):.1f} MiB")
        cache, builds = dest, wanted(args.with_prefill, only=only)
    else:
        cache, builds = args.cache_dir, wanted(args.with_prefill, args.full, only)
    gone = missing(cache, builds)
    if gone:
        print(f"{len(gone)} of {len(builds)} builds missing from {cache}:", file=sys.stderr)
        for name in gone:
            print(f"  {name}", file=sys.stderr)
        return 1
    print(f"all {len(builds)} builds found in {cache} (looked up as on a machine without the DSL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
