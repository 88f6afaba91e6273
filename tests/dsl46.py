"""Run a test module's own compile checks under nvidia-cutlass-dsl 4.6.0 (vLLM 0.26's pin).

The module is executed as a script with .venv-dsl46's python and prints one line
``RESULTS {json}``: the DSL version and each configuration's problems (empty when it compiled
with what its checks require).
"""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DSL46_PYTHON = ROOT / ".venv-dsl46" / "bin" / "python"


def run_dsl46(script: Path, which: str, timeout: int):
    if not DSL46_PYTHON.exists():
        pytest.skip(f"no 4.6.0 venv at {DSL46_PYTHON}")
    r = subprocess.run([str(DSL46_PYTHON), str(script), which], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"4.6.0 run failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    res = json.loads(lines[-1][8:])
    assert res["dsl_version"].startswith("4.6"), res["dsl_version"]
    bad = [x for x in res["results"] if x["problems"]]
    assert not bad, bad
    return res
