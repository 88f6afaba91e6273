"""ptxas -v on a compiled kernel's PTX (the DSL's own ptxas pass hides its report): register
spills, which the PTX itself does not show. Skipped (no problems) where ptxas is not installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def spill_problems(ptx_path: Path) -> list[str]:
    ptxas = shutil.which("ptxas")
    if not ptxas:
        return []
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", "/dev/null"], capture_output=True,
                       text=True)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if m and (int(m.group(1)) or int(m.group(2))):
        return [f"register spills: {m.group(0)}"]
    return []
