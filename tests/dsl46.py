"""Run a test module's own compile checks under nvidia-cutlass-dsl 4.6.0 (vLLM 0.26's pin).

The module is executed as a script with .venv-dsl46's python (its ``__main__`` calls
:func:`script_main`) and prints one line ``RESULTS {json}``: the DSL version and each
configuration's problems (empty when it compiled with what its checks require).

A module's whole prebuild set is checked in ``SHARDS`` slices, one test each, so that the test
runner's workers (pytest-xdist, one per core) share the slow compiles between them.
"""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DSL46_PYTHON = ROOT / ".venv-dsl46" / "bin" / "python"
SHARDS = 4


def run_dsl46(script: Path, which: str, timeout: int, shard: int | None = None):
    """Check `which` ("fast" or "all") configurations of `script`'s module with DSL 4.6; with
    `shard`, only every SHARDS-th configuration from index `shard` on."""
    if not DSL46_PYTHON.exists():
        pytest.skip(f"no 4.6.0 venv at {DSL46_PYTHON}")
    argv = [str(DSL46_PYTHON), str(script), which] + ([f"{shard}/{SHARDS}"] if shard is not None else [])
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"4.6.0 run failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    res = json.loads(lines[-1][8:])
    assert res["dsl_version"].startswith("4.6"), res["dsl_version"]
    assert res["results"], "no configuration was checked"
    bad = [x for x in res["results"] if x["problems"]]
    assert not bad, bad
    return res


def script_main(fast: list, full: list, check, name) -> None:
    """A test module's ``__main__``: argv ``fast`` | ``all [i/n]``; runs ``check(item)`` on each
    selected item (``name(item)`` labels an item whose check raised) and prints RESULTS."""
    which = sys.argv[1] if len(sys.argv) > 1 else "fast"
    items = list(fast if which == "fast" else full)
    if len(sys.argv) > 2:
        i, n = (int(v) for v in sys.argv[2].split("/"))
        items = items[i::n]
    results = []
    for item in items:
        try:
            results.append(check(item))
        except Exception as e:  # report, don't stop: one JSON line with everything
            results.append({"config": name(item), "problems": [f"{type(e).__name__}: {e}"[:2000]]})
    print("RESULTS " + json.dumps({"dsl_version": importlib.metadata.version("nvidia-cutlass-dsl"),
                                   "results": results}))
