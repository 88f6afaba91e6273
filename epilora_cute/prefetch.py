"""L2 prefetches of weights (kernels_dsl/l2_prefetch.py): cache hints, nothing is read into the SMs or
written, so a skipped prefetch (a CPU tensor, a GPU without sm_90a, no cached build) changes no
result, only the time of the stream that follows. Each is launched as the PDL dependent of whatever
kernel precedes it on the stream and starts its requests once that kernel has completed.

* ``prefetch_l2``: the first bytes of a weight the next projection will stream (docs/perf.md v0.77).
* ``prefetch_k2_heads``: the first bytes of every (row, split) range K2 is about to stream, launched
  on the decode path just before the shrink (v0.79, ``EPILORA_DECODE_PREFETCH``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .arch import arch_of
from .compile_cache import KernelUnavailable
from .kernels import get_kernel

log = logging.getLogger("epilora_cute")
_warned: set[str] = set()

# Targets with cp.async.bulk.prefetch.L2 (PTX ISA 8.0, sm_90+) that we build the kernel for.
PREFETCH_TARGETS = ("sm_90a",)


def byte_view(t: torch.Tensor, nbytes: int | None = None) -> torch.Tensor | None:
    """The first ``nbytes`` (default: all) of a dense tensor as a flat uint8 view, rounded down to
    a multiple of 16; None when the tensor is not one dense block of memory (its bytes would not
    be a range) or the range is empty. A tensor stored transposed (vLLM's FP8 weight is
    ``weight.t()`` of a contiguous [K, N]) is dense too: its storage order is used."""
    if t.is_contiguous():
        dense = t
    elif t.dim() == 2 and t.t().is_contiguous():
        dense = t.t()
    else:
        return None
    total = dense.numel() * dense.element_size()
    n = total if nbytes is None else min(int(nbytes), total)
    n -= n % 16
    if n <= 0 or dense.data_ptr() % 16:
        return None
    return dense.reshape(-1).view(torch.uint8)[:n]


def _target_arch(t: torch.Tensor) -> str | None:
    return arch_of(t) if t.is_cuda else None


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(t: torch.Tensor) -> int:
    return _sm_count_of(t.device.index)


def _kernel(config, arch: str, what: str):
    """The launchable build, or None (warned once) where there is no cached build and no DSL."""
    from kernels_dsl import l2_prefetch

    try:
        return get_kernel(l2_prefetch, config, arch)
    except KernelUnavailable as e:  # the hint is skipped, results unchanged
        if "unavailable" not in _warned:
            _warned.add("unavailable")
            log.warning("%s skipped: %s", what, e)
        return None


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, *, pdl: bool = True) -> int:
    """Prefetch the first ``nbytes`` of ``t`` (default: all of it) into L2; returns the bytes asked
    for, 0 when skipped (see the module docstring: skipping is always correct). ``pdl``: launch as
    the PDL dependent of the previous kernel on the stream (its requests still start only after
    that kernel completed); False: an ordinary launch."""
    arch = _target_arch(t)
    if arch not in PREFETCH_TARGETS:
        return 0
    flat = byte_view(t, nbytes)
    if flat is None:
        return 0
    from kernels_dsl import l2_prefetch

    kernel = _kernel(l2_prefetch.CONFIG, arch, "prefetch_l2")
    if kernel is None:
        return 0
    ctas, segment = l2_prefetch.plan_segments(flat.numel(), _sm_count(t))
    kernel(flat, segment, grid=(ctas, 1, 1), smem=0, pdl=pdl)
    return flat.numel()


# ---------------------------------------------------------------------------------------------
# The decode path's prefetch of K2's first stages (v0.79)
# ---------------------------------------------------------------------------------------------

DECODE_PREFETCH_ENV = "EPILORA_DECODE_PREFETCH"
DECODE_PREFETCH_DEFAULT_MB = 16.0  # ~what DRAM delivers while K2 is launched behind the shrink (~2.7 us)


def decode_prefetch_budget(value: str | None = None) -> int:
    """Bytes of K2's weight the decode path asks L2 for before its shrink: `value`, or
    EPILORA_DECODE_PREFETCH when None (unset / 0 / off: none; 1 / on: DECODE_PREFETCH_DEFAULT_MB;
    a number: that many MB)."""
    return _budget((os.environ.get(DECODE_PREFETCH_ENV, "") if value is None else value).strip().lower())


@functools.lru_cache(maxsize=None)
def _budget(v: str) -> int:
    if v in ("", "0", "off", "false", "no", "none"):
        return 0
    if v in ("1", "on", "true", "yes"):
        return int(DECODE_PREFETCH_DEFAULT_MB * (1 << 20))
    try:
        mb = float(v)
    except ValueError:
        raise ValueError(f"{DECODE_PREFETCH_ENV}: {v!r} is neither off (0), on (1) nor a number of MB") from None
    if mb < 0:
        raise ValueError(f"{DECODE_PREFETCH_ENV}: {v!r} is negative")
    return int(mb * (1 << 20))


def prefetch_k2_heads(w_q: torch.Tensor, splits: int, bk: int, budget: int, *, pdl: bool = True) -> int:
    """Ask L2 for the first bytes of every (row, split) range of K2's weight ``w_q`` ([N, K] one-byte,
    row-major; K2 with split-K ``splits`` and k-blocks of ``bk`` bytes), ``budget`` bytes in all at
    most; returns the bytes asked for, 0 when skipped (see the module docstring)."""
    arch = _target_arch(w_q)
    if arch not in PREFETCH_TARGETS or budget <= 0:
        return 0
    if w_q.dim() != 2 or w_q.element_size() != 1 or not w_q.is_contiguous() or w_q.data_ptr() % 16:
        return 0
    from kernels_dsl import l2_prefetch

    rows, row_bytes = int(w_q.shape[0]), int(w_q.shape[1])
    if rows * row_bytes >= 2**31:
        return 0
    ctas, head = l2_prefetch.plan_heads(rows, row_bytes, splits, bk, budget, _sm_count(w_q))
    if not head:
        return 0
    kernel = _kernel(l2_prefetch.HEADS, arch, "prefetch_k2_heads")
    if kernel is None:
        return 0
    kernel(w_q.reshape(-1).view(torch.uint8), row_bytes, splits, bk, head, grid=(ctas, 1, 1), smem=0, pdl=pdl)
    return rows * splits * head
