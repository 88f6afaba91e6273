"""Loads that wait inside their own branch, read from a kernel's SASS.

Why this exists (docs/perf.md v0.45): when a load's value is used inside the same
`if` as the load (`if j < M: h = mH[...]; h_bf16 = convert(h)`), ptxas puts the use inside the
branch region (BSSY ... BSYNC) and the warp waits there for the load's round trip before it can
issue the next element's load. Sixteen such elements in a row cost the decode K2's epilogue
~4 us at 32 tokens on the H200; written as unconditional loads (clamped indices) followed by
selects, they all go out at once. This scan finds the pattern in the SASS of a build, so a
test can keep it out of the kernels that were cleaned of it.

`nvdisasm` comes with Triton's wheel (and with the CUDA toolkit); without it, `sass_of` returns
None and the checks that need it skip.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LOAD = re.compile(r"^(?:@!?U?P\w+\s+)?(LDG|LDS|LD|LDL)(?:\.[\w.]+)*\s+R(\d+)\s*,")
_WIDTH = re.compile(r"\.(64|128)\b")
_REG = re.compile(r"\bR(\d+)\b")
# How far ahead a branch region is searched for its end (the regions of interest are short).
_REGION_LOOKAHEAD = 400


def nvdisasm_path() -> str | None:
    """Triton's bundled nvdisasm, else one on PATH, else None."""
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if bundled.is_file():
            return str(bundled)
    return shutil.which("nvdisasm")


def sass_of(cubin: bytes) -> str | None:
    """The cubin's SASS as nvdisasm prints it (-c: code only), or None without nvdisasm."""
    tool = nvdisasm_path()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True)
    return r.stdout


def instructions(sass: str) -> list[str]:
    """The instruction texts in address order (predicate included, no trailing ';')."""
    return [m.group(2).strip() for m in map(_INSTR.match, sass.splitlines()) if m]


def _opcode_operands(ins: str) -> tuple[str, str]:
    """(opcode, operand text) of an instruction, its predicate (`@P0`, `@!UP1`) left out."""
    parts = ins.split(None, 2) if ins.startswith("@") else [""] + ins.split(None, 1)
    return parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else ""


# Opcodes whose first operand is not a register they write (stores, reductions, control).
_NO_DESTINATION = ("ST", "RED", "ATOM", "BRA", "BAR", "BSSY", "BSYNC")


def _sources(ins: str) -> set[int]:
    """Registers an instruction reads: its operands after the destination (loads and stores
    included: an address register is read)."""
    op, ops = _opcode_operands(ins)
    if op.startswith(_NO_DESTINATION) or ops.startswith(("desc", "[")):
        srcs = ops  # no destination register
    else:
        srcs = ops.split(",", 1)[1] if "," in ops else ""
    return {int(r) for r in _REG.findall(srcs)}


def _destinations(ins: str) -> set[int]:
    """The register an instruction writes first (its first operand), if any."""
    op, ops = _opcode_operands(ins)
    if not ops or op.startswith(_NO_DESTINATION):
        return set()
    m = _REG.match(ops.split(",", 1)[0].strip())
    return {int(m.group(1))} if m else set()


def _closes_region(ins: list[str], start: int) -> bool:
    """Whether a BSYNC at nesting depth 0 follows `start` (i.e. `start` sits inside a region)."""
    depth = 0
    for v in ins[start + 1: start + 1 + _REGION_LOOKAHEAD]:
        if v.startswith("BSSY"):
            depth += 1
        elif v.startswith("BSYNC"):
            if depth == 0:
                return True
            depth -= 1
    return False


def loads_waited_in_branch(sass: str) -> list[tuple[int, str, str]]:
    """(index, load, first use) for every load whose value is read inside the branch region it was
    issued in, with no other load issued in between: a round trip the warp waits for alone. A batch
    of loads followed by their uses counts once (its last load); a dependent chain (token -> slot
    -> rank) counts at its last step, whose reader is not a load."""
    ins = instructions(sass)
    found = []
    for i, text in enumerate(ins):
        m = _LOAD.match(text)
        if not m:
            continue
        w = _WIDTH.search(_opcode_operands(text)[0])
        width = int(w.group(1)) // 32 if w else 1
        dst = {int(m.group(2)) + k for k in range(width)}
        depth = 0
        others = False  # another load issued between this one and its use (they overlap)
        for j in range(i + 1, len(ins)):
            u = ins[j]
            if u.startswith("BSSY"):
                depth += 1
                continue
            if u.startswith("BSYNC"):
                if depth == 0:
                    break  # the region ends before any use
                depth -= 1
                continue
            if u.startswith(("BRA", "EXIT", "RET")) and depth == 0:
                break  # left the straight-line code (a loop back edge, an exit)
            if dst & _sources(u):
                if depth == 0 and not _LOAD.match(u) and not others and _closes_region(ins, j):
                    found.append((i, text, u))
                break
            if dst & _destinations(u):
                break  # overwritten before any read
            if _LOAD.match(u):
                others = True
    return found


def sync_counts(sass: str) -> dict[str, int]:
    """Counts of the synchronisation-related SASS of a build (the push variants' SASS facts,
    docs/perf.md v0.50 / v0.51): `membar_gpu` (MEMBAR.ALL.GPU: what a release cluster arrive or
    an acq_rel GPU atomic compiles to), `dsmem_loads` (generic LD: in the decode kernels only the
    ld.shared::cluster loads of the peers' smem compile to it), `st_async` (STAS) and
    `cluster_arrives` (UCGABAR_ARV)."""
    out = {"membar_gpu": 0, "dsmem_loads": 0, "st_async": 0, "cluster_arrives": 0}
    for ins in instructions(sass):
        op = _opcode_operands(ins)[0]
        if op == "MEMBAR.ALL.GPU":
            out["membar_gpu"] += 1
        elif op == "LD" or op.startswith("LD."):
            out["dsmem_loads"] += 1
        elif op.startswith("STAS"):
            out["st_async"] += 1
        elif op.startswith("UCGABAR_ARV"):
            out["cluster_arrives"] += 1
    return out
