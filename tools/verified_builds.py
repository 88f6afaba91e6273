"""Which shipped kernel binaries differ from the ones the H200 last verified.

GPU time is scarce, so sessions without a device change kernels the GPU has not run. A prebuilt
kernel's PTX is deterministic (same source, configuration and DSL version: same bytes) and its cubin
nearly so, so the record of a GPU-verified state is one SHA-256 per build's cubin, and its PTX's:

    python tools/verified_builds.py record --run run27 --commit 1a0192f [--cache DIR] [--out FILE]
        every build of the prebuild set, looked up in the cache (compiled where missing with
        --build), written to docs/gpu_record/verified_builds.json — run at the commit whose whole
        GPU suite passed (`gpu_session.sh tests`), from the cache that run carried
    python tools/verified_builds.py diff [--cache DIR] [--build] [--family F ...]
        this tree's prebuild set against that record: per family the builds whose cubin is the
        verified one, those that changed, those that are new (no verified twin) and those not in the
        cache; exit status 1 when any shipped build changed or is new (what the next GPU session
        must run), 0 when all are verified, 2 when the record is for another DSL version

A refactor that leaves every cubin byte-identical needs no GPU run; `diff` says which builds
a kernel change touched, so the next device session can run exactly their tests. A changed cubin
whose PTX is the verified one is named apart ("same PTX"): ptxas allocated registers differently
(session 41: one prefill K2 build gave another cubin in 1 of 4 rebuilds of an unchanged tree) —
rebuilding it usually brings back the verified bytes; it is still a binary no GPU has run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECORD = ROOT / "docs" / "gpu_record" / "verified_builds.json"
ARCH = "sm_90a"


def build_key(family: str, config) -> str:
    return f"{family}/{config.name()}"


def build_shas(cache: Path | None, build: bool, only: list[str] | None = None) -> tuple[dict, list[str]]:
    """{family/config: (cubin sha256, PTX sha256 or None)} of the prebuild set found in ``cache``
    (None where the entry kept no PTX: the carry caches drop it), and the keys not found there."""
    from epilora_cute.compile_cache import KernelUnavailable, get_artifact
    from epilora_cute.kernels import families

    found, missing = {}, []
    for mod in families():
        if only and mod.FAMILY not in only:
            continue
        for cfg in mod.prebuild_configs():
            key = build_key(mod.FAMILY, cfg)
            try:
                art = get_artifact(mod, cfg, ARCH, root=cache, allow_compile=build)
            except KernelUnavailable:
                missing.append(key)
                continue
            ptx = Path(art.path) / "kernel.ptx"
            found[key] = (hashlib.sha256(art.cubin).hexdigest(),
                          hashlib.sha256(ptx.read_bytes()).hexdigest() if ptx.is_file() else None)
    return found, missing


def same_ptx(changed: list[str], ptx_now: dict, ptx_verified: dict) -> list[str]:
    """The changed builds whose PTX is the verified build's (only ptxas's output differs)."""
    return [k for k in changed if ptx_now.get(k) is not None and ptx_now.get(k) == ptx_verified.get(k)]


def compare(current: dict, verified: dict) -> dict:
    """Per key of ``current``: "same" (the verified cubin), "changed" (a verified build of that name
    with other bytes) or "new"; plus the verified keys the prebuild set no longer has."""
    out = {"same": [], "changed": [], "new": [], "gone": sorted(set(verified) - set(current))}
    for key, sha in current.items():
        if key not in verified:
            out["new"].append(key)
        elif verified[key] != sha:
            out["changed"].append(key)
        else:
            out["same"].append(key)
    return out


def family_table(result: dict, missing: list[str]) -> list[str]:
    fams: dict[str, dict[str, int]] = {}
    for kind in ("same", "changed", "new"):
        for key in result[kind]:
            fams.setdefault(key.split("/")[0], {}).setdefault(kind, 0)
            fams[key.split("/")[0]][kind] += 1
    for key in missing:
        fams.setdefault(key.split("/")[0], {}).setdefault("missing", 0)
        fams[key.split("/")[0]]["missing"] += 1
    lines = [f"{'family':20s} {'verified':>8s} {'changed':>8s} {'new':>8s} {'not built':>9s}"]
    for fam in sorted(fams):
        c = fams[fam]
        lines.append(f"{fam:20s} {c.get('same', 0):8d} {c.get('changed', 0):8d} {c.get('new', 0):8d} "
                     f"{c.get('missing', 0):9d}")
    return lines


def main(argv=None) -> int:
    from epilora_cute.compile_cache import dsl_version

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="write the verified record from this tree's builds")
    rec.add_argument("--run", required=True, help="the GPU record run that verified them, e.g. run27")
    rec.add_argument("--commit", required=True, help="the commit the GPU suite passed at")
    rec.add_argument("--out", type=Path, default=RECORD)
    dif = sub.add_parser("diff", help="this tree's builds against the verified record")
    dif.add_argument("--record", type=Path, default=RECORD)
    dif.add_argument("--family", action="append", help="only these families (repeatable)")
    dif.add_argument("--list", type=int, default=40, help="name at most this many changed / new builds")
    for p in (rec, dif):
        p.add_argument("--cache", type=Path, default=None, help="the kernel cache (default: EPILORA_CACHE_DIR's)")
        p.add_argument("--build", action="store_true", help="compile what the cache lacks (needs the DSL)")
    args = ap.parse_args(argv)

    version = dsl_version()
    if args.cmd == "record":
        both, missing = build_shas(args.cache, args.build)
        shas = {k: v[0] for k, v in both.items()}
        if missing:
            print(f"{len(missing)} builds are not in the cache (run with --build, or `make prebuild`): "
                  f"{missing[:5]} ...", file=sys.stderr)
            return 1
        if version is None:
            print("nvidia-cutlass-dsl is not installed: the record names the DSL version it holds", file=sys.stderr)
            return 1
        record = {"arch": ARCH, "dsl_version": version, "run": args.run, "commit": args.commit,
                  "builds": dict(sorted(shas.items())),
                  "ptx": {k: v[1] for k, v in sorted(both.items()) if v[1] is not None}}
        args.out.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
        print(f"{args.out}: {len(shas)} builds verified in {args.run} at {args.commit} (DSL {version})")
        return 0

    record = json.loads(args.record.read_text())
    if version is not None and record["dsl_version"] != version:
        print(f"the record is for nvidia-cutlass-dsl {record['dsl_version']}, this machine has {version}: "
              "cubins of two DSL versions cannot be compared", file=sys.stderr)
        return 2
    both, missing = build_shas(args.cache, args.build, args.family)
    shas = {k: v[0] for k, v in both.items()}
    verified = record["builds"]
    if args.family:
        verified = {k: v for k, v in verified.items() if k.split("/")[0] in args.family}
    result = compare(shas, verified)
    print(f"against {record['run']} at {record['commit']} (DSL {record['dsl_version']}):")
    print("\n".join(family_table(result, missing)))
    for kind in ("changed", "new"):
        names = result[kind]
        if names:
            more = f" (+{len(names) - args.list} more)" if len(names) > args.list else ""
            print(f"{kind}: " + ", ".join(names[:args.list]) + more)
    ptx_same = same_ptx(result["changed"], {k: v[1] for k, v in both.items()}, record.get("ptx", {}))
    if ptx_same:
        print(f"of the changed, same PTX as verified (ptxas's register allocation differs; a rebuild of the "
              f"entry usually gives the verified cubin back): {', '.join(ptx_same[:args.list])}")
    if result["gone"]:
        print(f"no longer built: {len(result['gone'])} (e.g. {', '.join(result['gone'][:5])})")
    if missing:
        print(f"not in the cache (not compared): {len(missing)}; `--build` or `make prebuild` compiles them")
    return 1 if result["changed"] or result["new"] else 0


if __name__ == "__main__":
    sys.exit(main())
