"""ptxas -v on a compiled kernel's PTX (the DSL's own ptxas pass hides its report): register
spills, which the PTX itself does not show, and WGMMAs that ptxas serializes (C7514: a WGMMA
pipeline ptxas cannot prove safe is waited for after every instruction; v0.65's persistent
overlap loop ran 25-45 % slower for it). Skipped (no problems) where ptxas is not installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def spill_problems(ptx_path: Path) -> list[str]:
    """Register spills and serialized WGMMAs reported by ptxas -v."""
    ptxas = shutil.which("ptxas")
    if not ptxas:
        return []
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", "/dev/null"], capture_output=True,
                       text=True)
    bad = []
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if m and (int(m.group(1)) or int(m.group(2))):
        bad.append(f"register spills: {m.group(0)}")
    if "C7514" in r.stderr:
        bad.append("ptxas serializes the WGMMAs (C7514): " + r.stderr.split("C7514")[1][:160].strip())
    return bad
