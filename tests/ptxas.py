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


def wgmma_overlap_problems(cubin: bytes) -> list[str]:
    """For a build meant to keep two WGMMA groups in flight: the SASS of the cubin the DSL itself
    produced must wait with a non-zero group count somewhere (`WARPGROUP.DEPBAR.LE gsb0, 0x1`).
    When the DSL's own ptxas serializes the pipeline every wait is `... gsb0, 0x0` — and the
    system ptxas above, another version, need not say C7514 for the same PTX (session 27, v0.70:
    the persistent build with compile-time stages passed spill_problems and ran 25 % slower on the
    H200, its cubin waiting for zero groups after every block). Skipped without nvdisasm."""
    from epilora_cute.sass_scan import sass_of

    sass = sass_of(cubin)
    if sass is None:
        return []
    if "GMMA" not in sass:
        return ["no WGMMA in the cubin's SASS"]
    if not re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x[1-9]", sass):
        return ["the DSL's ptxas serialized the WGMMAs (every wait is DEPBAR.LE gsb0, 0x0)"]
    return []
