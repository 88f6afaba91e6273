"""Summarize a `gpu_session.sh profile` archive (Nsight Compute text exports) as markdown.

    python tools/ncu_summary.py PROF_DIR [--cases 'qkv:2048:1 ...'] [--bins 10] > summary.md

PROF_DIR holds details.txt (`ncu -i rep --page details`) and sass_<i>.csv (`--page source --csv
--print-source sass`, launch i). Per launch: duration, grid, registers, smem, theoretical
occupancy, DRAM throughput, executed warp-instructions, the top warp-stall reasons, and where
in the SASS the stall samples fall (the listing cut into equal bins of instructions, with the
instructions each warp executed there): enough to tell a latency chain from a bandwidth limit.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from pathlib import Path

DETAIL_KEYS = {"Duration": "duration_us", "Grid Size": "grid", "Registers Per Thread": "regs",
               "Dynamic Shared Memory Per Block": "smem_kib", "Theoretical Occupancy": "occupancy_pct",
               "DRAM Throughput": "dram_pct", "Executed Instructions": "instructions",
               "Issued Warp Per Scheduler": "issue_per_cycle"}


def parse_details(text: str) -> list[dict]:
    """One dict per launch (in report order): kernel name and the DETAIL_KEYS metrics."""
    out: list[dict] = []
    for line in text.splitlines():
        if re.match(r"^  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line) or re.match(r"^  [A-Za-z_]\S*.*Context \d+", line):
            out.append({"kernel": line.strip().split(" ")[0]})
            continue
        if not out:
            continue
        for key, name in DETAIL_KEYS.items():
            m = re.match(rf"^\s+{re.escape(key)}\s+(\S+/?\S*)?\s+([\d,\.]+)\s*$", line)
            if m and name not in out[-1]:
                out[-1][name] = float(m.group(2).replace(",", ""))
    return out


def parse_sass(path: Path, bins: int) -> dict:
    rows = list(csv.reader(path.open()))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    stalls: collections.Counter = collections.Counter()
    samples = [int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    executed = [int(r[ix["Instructions Executed"]] or 0) for r in data]
    for r in data:
        for c in stall_cols:
            v = r[ix[c]]
            if v and v != "-":
                stalls[c[len("stall_"):]] += int(v)
    n = len(data)
    step = max(1, -(-n // bins))
    regions = [(b, min(b + step, n), sum(samples[b:b + step]), sum(executed[b:b + step]))
               for b in range(0, n, step)]
    return {"n": n, "samples": sum(samples), "stalls": stalls, "regions": regions}


def summarize(prof: Path, cases: list[str] | None, bins: int) -> str:
    launches = parse_details((prof / "details.txt").read_text(errors="replace"))
    lines = ["| # | kernel | case | µs | grid | regs | smem KiB | occupancy % | DRAM % | warp-instructions | top stalls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    detail_blocks = []
    for i, d in enumerate(launches):
        sass = prof / f"sass_{i}.csv"
        s = parse_sass(sass, bins) if sass.exists() else None
        kern = re.sub(r"^kernel_cutlass_kernel_kernels_dsl", "", d["kernel"])[:28]
        case = cases[i] if cases and i < len(cases) else ""
        top = ""
        if s and s["samples"]:
            top = ", ".join(f"{k} {100 * v / s['samples']:.0f}%" for k, v in s["stalls"].most_common(4))
            detail_blocks.append((i, kern, case, s))
        lines.append(f"| {i} | {kern} | {case} | {d.get('duration_us', '')} | {int(d.get('grid', 0))} | "
                     f"{int(d.get('regs', 0))} | {d.get('smem_kib', '')} | {d.get('occupancy_pct', '')} | "
                     f"{d.get('dram_pct', '')} | {int(d.get('instructions', 0))} | {top} |")
    out = ["\n".join(lines), ""]
    for i, kern, case, s in detail_blocks:
        out.append(f"Launch {i} ({kern}, {case}): stall samples by SASS region "
                   f"({s['n']} instructions, {s['samples']} samples)\n")
        out.append("| instructions | samples % | warp-instructions executed |")
        out.append("|---|---|---|")
        for lo, hi, smp, ex in s["regions"]:
            out.append(f"| {lo}–{hi} | {100 * smp / max(1, s['samples']):.1f} | {ex} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prof", type=Path)
    ap.add_argument("--cases", default="", help="space-separated labels, one per launch in report order")
    ap.add_argument("--bins", type=int, default=10)
    args = ap.parse_args(argv)
    sys.stdout.write(summarize(args.prof, args.cases.split() or None, args.bins) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
