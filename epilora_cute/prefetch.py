"""L2 prefetches of weights (kernels_dsl/l2_prefetch.py): cache hints, nothing is read into the SMs or
written, so a skipped prefetch (a CPU tensor, a GPU without sm_90a, no cached build) changes no
result, only the time of the stream that follows. Each is launched as the PDL dependent of whatever
kernel precedes it on the stream and starts its requests once that kernel has completed.

``prefetch_l2``: the first bytes of a weight the next projection will stream (docs/perf.md v0.77;
opt-in through vllm_adapter/prefetch_plan.py). v0.79's prefetch of K2's first stages before the
decode path's shrink was measured slower whatever its budget (the extra link in the PDL chain) and
removed (perf.md "v0.77 – v0.79 measured").
"""

from __future__ import annotations

import functools
import logging

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
