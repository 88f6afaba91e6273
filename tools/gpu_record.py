"""The GPU record: every GPU test and the benchmark in one command, written up as a report.

    python tools/gpu_record.py [--out DIR] [--quick] [--tests PATHS] [--bench-sections a,b]

Writes DIR/gpu_report.md and DIR/gpu_report.json (GPU name, versions, date, each test's outcome,
the benchmark rows). On the H200 this is run with DIR=$OUT and the files are committed under
docs/gpu_record/ with the code they measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# Every GPU test file, by the device call that runs it: one call holds at most 10 minutes, and the
# whole set needs ~12 on an H100 (run33), so `gpu_session.sh tests` runs "main" and `tests-rest`
# the others. "opt_in" are the variants no shipped path takes (EPILORA_K2_PUSH, EPILORA_K2_SQ_WIDE),
# each with its own mode (push-tests, wide-tests). tests/test_tools.py checks that every file with
# a GPU marker is in exactly one suite.
GPU_SUITES = {
    "main": ("tests/test_k2_gpu.py", "tests/test_lora_linear_gpu.py", "tests/test_quant_gpu.py",
             "tests/test_triton_path.py", "tests/test_k1_shrink.py", "tests/test_expand_add.py",
             "tests/test_shrink_stream.py"),
    "rest": ("tests/test_k2_prefill.py", "tests/test_l2_prefetch_gpu.py", "tests/test_meta_kernel.py",
             "tests/test_shrink_grouped.py"),
    "opt_in": ("tests/test_k2_push_gpu.py", "tests/test_k2_wide_gpu.py"),
}


def _gpu_test_files(paths: list[str]) -> list[Path]:
    files = []
    for p in paths:
        p = ROOT / p
        files += sorted(p.glob("test_*.py")) if p.is_dir() else [p]
    return files


def run_tests(out: Path, paths: list[str], file_timeout: int, deadline: float | None = None) -> dict:
    """Each test file in its own pytest process with a time limit, so that a kernel that hangs
    costs one file's results (reported as such), not the whole record. Past `deadline` (a
    time.time() value) the remaining files are reported as not run instead of being started."""
    cases, logs, exit_code, t0 = [], [], 0, time.time()
    for f in _gpu_test_files(paths):
        left = None if deadline is None else deadline - time.time()
        if left is not None and left < 20:
            cases.append({"test": f"{f.stem}::*", "outcome": "error", "seconds": 0.0,
                          "message": "not run: the record's time limit was reached"})
            exit_code = exit_code or 124
            continue
        file_timeout_now = file_timeout if left is None else int(min(file_timeout, left - 10))
        cut_by_deadline = file_timeout_now < file_timeout
        # junit files stay out of `out`: the device machine returns at most 8 files from $OUT.
        junit = Path(tempfile.gettempdir()) / f"epilora_junit_{os.getpid()}_{f.stem}.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               str(f.relative_to(ROOT))]
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=file_timeout_now)
            logs.append(r.stdout + r.stderr)
            if r.returncode not in (0, 5):  # 5: nothing selected in this file
                exit_code = r.returncode
        except subprocess.TimeoutExpired as e:
            out_txt = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            logs.append(out_txt + f"\n[gpu_record] {f.name} killed after {file_timeout_now} s")
            # Cut by the record's time limit, the file was only left too little time; cut by its
            # own limit, it ran longer than any file should.
            why = "all the record's time limit left it" if cut_by_deadline else "its own limit: a kernel hang?"
            cases.append({"test": f"{f.stem}::*", "outcome": "error", "seconds": float(file_timeout_now),
                          "message": f"the file did not finish within {file_timeout_now} s ({why})"})
            exit_code = exit_code or 124
            continue
        if junit.exists():
            for tc in ET.parse(junit).getroot().iter("testcase"):
                outcome, msg = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    el = tc.find(tag)
                    if el is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        msg = (el.get("message") or "")[:300]
                cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                              "seconds": float(tc.get("time", 0)), "message": msg})
    (out / "gpu_tests.log").write_text("\n".join(logs))
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"command": f"pytest -m gpu per file ({file_timeout} s each): " + " ".join(paths),
            "exit_code": exit_code, "seconds": time.time() - t0, "counts": counts, "cases": cases,
            "tail": "\n".join(logs)[-4000:]}


def run_bench(out: Path, sections: str | None, quick: bool) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--out", str(out)]
    if sections:
        cmd += ["--sections", sections]
    if quick:
        cmd.append("--quick")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "bench.log").write_text(r.stdout + r.stderr)
    data = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    return {"command": " ".join(cmd[1:]), "exit_code": r.returncode, **data, "tail": (r.stdout + r.stderr)[-3000:]}


def _fmt(v):
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_markdown(rep: dict, path: Path) -> None:
    env = rep["bench"].get("env", {})
    t = rep["tests"]
    lines = [f"# GPU record — {rep['date']}", "",
             f"- GPU: {env.get('gpu')} (cc {env.get('cc')}, {env.get('sms')} SMs), torch {env.get('torch')}, "
             f"triton {env.get('triton')}, vLLM {env.get('vllm')}, nvidia-cutlass-dsl on the GPU machine: "
             f"{env.get('nvidia-cutlass-dsl')}, kernels built by: {rep.get('kernel_builds')}",
             f"- git commit: {rep['git']}",
             f"- command: `python tools/gpu_record.py` ({rep['seconds']:.0f} s)",
             f"- measured read bandwidth: {env.get('read_bandwidth_gbs', float('nan')):.0f} GB/s", "",
             f"## Tests: {t['counts']['passed']} passed, {t['counts']['failed']} failed, "
             f"{t['counts']['error']} errors, {t['counts']['skipped']} skipped (exit {t['exit_code']})", ""]
    bad = [c for c in t["cases"] if c["outcome"] in ("failed", "error")]
    for c in bad[:40]:
        lines.append(f"- **{c['outcome']}** `{c['test']}`: {c['message']}")
    skipped = [c for c in t["cases"] if c["outcome"] == "skipped"]
    if skipped:
        lines.append(f"- skipped: " + "; ".join(f"`{c['test'].split('::')[-1]}` ({c['message'][:80]})" for c in skipped[:10]))
    lines += ["", "## Benchmark (CUDA-graph replays, L2 flushed before each, median)", ""]
    rows = rep["bench"].get("rows", [])
    for section in dict.fromkeys(r["section"] for r in rows):
        rs = [r for r in rows if r["section"] == section]
        keys = [k for k in rs[0] if k != "section"]
        for r in rs[1:]:
            keys += [k for k in r if k not in keys and k != "section"]
        lines += [f"### {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rs]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def suite_paths(suite: str | None, tests: list[str], skip: list[str]) -> list[str]:
    """The test files a record runs: one suite's (GPU_SUITES) or the given paths, less ``skip``
    (each of which must be one of them: a mistyped skip would silently run the file)."""
    paths = list(GPU_SUITES[suite]) if suite else list(tests)
    unknown = [p for p in skip if p not in paths]
    if unknown:
        raise ValueError(f"--skip {unknown}: not among {paths}")
    return [p for p in paths if p not in skip]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "build" / "gpu_record")))
    ap.add_argument("--tests", nargs="*", default=["tests"])
    ap.add_argument("--suite", choices=sorted(GPU_SUITES), default=None,
                    help="the test files of one device call (GPU_SUITES) instead of --tests")
    ap.add_argument("--skip", nargs="*", default=[], help="test files of --suite / --tests to leave out")
    ap.add_argument("--bench-sections", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--file-timeout", type=int, default=300, help="seconds per test file before it is killed")
    ap.add_argument("--time-limit", type=int, default=None,
                    help="seconds for the whole record: test files that would start after it are reported as not run")
    args = ap.parse_args(argv)
    paths = suite_paths(args.suite, args.tests, args.skip)
    import torch
    if not torch.cuda.is_available():
        print("gpu_record: no CUDA GPU here; run this on the H200 (see README)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # The GPU machine gets the working tree without .git: the caller passes the commit it measured.
    git = os.environ.get("EPILORA_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = os.environ.get("EPILORA_GIT_DIRTY", "") or subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # The benchmark first: it has a known duration, the test files each have a time limit, so a
    # record cut short by the machine's call limit still holds the numbers.
    bench = run_bench(args.out, args.bench_sections, args.quick)
    print(bench.get("tail", "")[-2500:], flush=True)
    tests = run_tests(args.out, paths, args.file_timeout,
                      None if args.time_limit is None else t0 + args.time_limit)
    print(f"tests: {tests['counts']}", flush=True)
    metas = {json.loads(p.read_text())["dsl_version"] for p in Path(os.environ.get("EPILORA_CACHE_DIR", "/nonexistent")).rglob("meta.json")} \
        if os.environ.get("EPILORA_CACHE_DIR") else set()
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git + (" (with local changes)" if dirty else ""),
           "seconds": time.time() - t0, "tests": tests, "bench": bench,
           "kernel_builds": "nvidia-cutlass-dsl " + ", ".join(sorted(metas)) if metas else "JIT here"}
    (args.out / "gpu_report.json").write_text(json.dumps(rep, indent=1))
    write_markdown(rep, args.out / "gpu_report.md")
    print((args.out / "gpu_report.md").read_text()[:6000])
    return 0 if tests["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
