"""Facts read from a compiled kernel (cubin ELF + PTX) that the launch depends on.

The register-pool check exists because of a real failure: a warp-specialized kernel that moves
registers between warpgroups (setmaxnreg) launched with the per-thread register count ptxas chose
for it (~40-90). Its pool (count x threads) could never satisfy `setmaxnreg.inc 232`, so the
consumer warpgroup waited forever. The build refuses such a kernel instead of shipping a hang.
"""

from __future__ import annotations

import re
import struct

_EIATTR_REGCOUNT = 0x2F  # .nv.info attribute: (symbol index u32, registers per thread u32)
_EIATTR_FRAME_SIZE = 0x11  # .nv.info.<kernel> attribute: (symbol index u32, stack frame bytes u32)


def _nv_info_values(cubin: bytes, attr_wanted: int) -> list[int]:
    """The u32 values of every (symbol, value) record of one attribute in the .nv.info* sections."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    values = []
    for sec in sections:
        sh_name, sh_offset, sh_size = sec[0], sec[4], sec[5]
        name = cubin[names_at + sh_name: cubin.index(b"\0", names_at + sh_name)]
        if name != b".nv.info" and not name.startswith(b".nv.info."):
            continue
        p, end = sh_offset, sh_offset + sh_size
        while p < end:  # records: format byte, attribute byte, payload
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size + payload
                n, = struct.unpack_from("<H", cubin, p + 2)
                if attr == attr_wanted and n >= 8:
                    values.append(struct.unpack_from("<II", cubin, p + 4)[1])
                p += 4 + n
            elif fmt == 0x03:  # EIFMT_HVAL: u16 value
                p += 4
            elif fmt == 0x02:  # EIFMT_BVAL: u8 value
                p += 3
            else:  # EIFMT_NVAL: no value
                p += 2
    return values


def register_count(cubin: bytes) -> int:
    """Registers per thread the cubin's (single) kernel is launched with."""
    counts = _nv_info_values(cubin, _EIATTR_REGCOUNT)
    if len(counts) != 1:
        raise ValueError(f"expected one kernel register count in .nv.info, found {counts}")
    return counts[0]


def stack_frame_bytes(cubin: bytes) -> int:
    """Bytes of per-thread stack frame (local memory) of the cubin's kernel and its callees: the
    "N bytes stack frame" of ptxas -v; register spills live there. 0 when the kernel has none."""
    return max(_nv_info_values(cubin, _EIATTR_FRAME_SIZE), default=0)


def register_pool_problem(ptx: str, cubin: bytes) -> str | None:
    """None, or why `setmaxnreg` in this kernel can deadlock.

    Warpgroups of 128 threads; every setmaxnreg target must fit, summed over the warpgroups, in
    the pool the launch gets (registers per thread x threads). The kernel's warpgroups are the
    .reqntid threads / 128; each one ends at one of the targets, the worst case is every warpgroup
    but one at the lowest and one at the highest (the layout our kernels use).
    """
    incs = [int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)]
    decs = [int(v) for v in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)]
    if not incs:
        return None
    m = re.search(r"\.reqntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", ptx)
    if not m:
        return "setmaxnreg without .reqntid: the register pool cannot be checked"
    threads = 1
    for g in m.groups():
        threads *= int(g) if g else 1
    groups = threads // 128
    need = 128 * (max(incs) + (groups - 1) * (min(decs) if decs else max(incs)))
    regs = register_count(cubin)
    if regs * threads < need:
        return (f"launch register pool {regs} x {threads} = {regs * threads} < {need} needed by "
                f"setmaxnreg.inc {max(incs)}: the increasing warpgroup would wait forever "
                "(compile with min_blocks_per_mp=1 so ptxas reserves the full budget)")
    return None
