"""L2 prefetches of weights (kernels_dsl/l2_prefetch.py): cache hints, nothing is read into the SMs or
written, so a skipped prefetch (a CPU tensor, a GPU without sm_90a, no cached build) changes no
result, only the time of the stream that follows. The kernel starts its requests once the kernel
before it has completed.

``prefetch_l2``: the first bytes of a weight the next projection will stream, in the stream as the
PDL dependent of its last kernel (docs/perf.md v0.77; opt-in through vllm_adapter/prefetch_plan.py).
``BesidePrefetch``: the same on a second stream, so that the kernels between two projections
overlap it (v0.80, bench section ``prefetch`` only; run33: +2.2 µs per layer at one token, +0.6 …
+1.6 without a fork across the attention — too little for the plugin, closed). v0.79's prefetch
of K2's first stages before the decode path's shrink was measured slower whatever its budget (the
extra link in the PDL chain) and removed (perf.md "v0.77 – v0.79 measured").
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


def _planned(t: torch.Tensor, nbytes: int | None):
    """(kernel, flat bytes, CTAs, segment) of a prefetch of ``t``'s first ``nbytes``, or None where
    it is skipped (not sm_90a, not one dense range, no build)."""
    arch = _target_arch(t)
    if arch not in PREFETCH_TARGETS:
        return None
    flat = byte_view(t, nbytes)
    if flat is None:
        return None
    from kernels_dsl import l2_prefetch

    kernel = _kernel(l2_prefetch.CONFIG, arch, "prefetch_l2")
    if kernel is None:
        return None
    return (kernel, flat) + l2_prefetch.plan_segments(flat.numel(), _sm_count(t))


def _launch(plan, pdl: bool) -> int:
    kernel, flat, ctas, segment = plan
    kernel(flat, segment, grid=(ctas, 1, 1), smem=0, pdl=pdl)
    return flat.numel()


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, *, pdl: bool = True) -> int:
    """Prefetch the first ``nbytes`` of ``t`` (default: all of it) into L2; returns the bytes asked
    for, 0 when skipped (see the module docstring: skipping is always correct). ``pdl``: launch as
    the PDL dependent of the previous kernel on the stream (its requests still start only after
    that kernel completed); False: an ordinary launch."""
    plan = _planned(t, nbytes)
    return _launch(plan, pdl) if plan is not None else 0


class BesidePrefetch:
    """``prefetch_l2`` on a second stream (docs/perf.md v0.80). In the stream itself a prefetch
    kernel lasts as long as its bytes take at DRAM rate and the kernels after it (vLLM's attention,
    norms, activation: the windows it is meant to fill) start only when it has completed (run32).
    Forked from the current stream after its last kernel instead, it runs beside them; ``join()``
    makes the current stream wait for every prefetch launched since the last join — before the
    projection that reads those bytes, and before a CUDA-graph capture ends (a capture must join
    every stream it forked). Both are event record / wait pairs, which CUDA graphs capture."""

    def __init__(self):
        self._side: dict[int, torch.cuda.Stream] = {}
        self._forked: list[tuple[torch.cuda.Stream, torch.cuda.Stream]] = []

    def launch(self, t: torch.Tensor, nbytes: int | None = None) -> int:
        """Fork, prefetch the first ``nbytes`` of ``t`` on the side stream; the bytes asked for (0:
        skipped, and then nothing is forked)."""
        plan = _planned(t, nbytes)
        if plan is None:
            return 0
        main = torch.cuda.current_stream(t.device)
        side = self._side.get(t.device.index)
        if side is None:
            side = self._side[t.device.index] = torch.cuda.Stream(t.device)
        side.wait_stream(main)  # its requests start after the projection's last kernel
        with torch.cuda.stream(side):
            n = _launch(plan, pdl=False)
        self._forked.append((main, side))
        return n

    def join(self) -> None:
        for main, side in self._forked:
            main.wait_stream(side)
        self._forked.clear()

    @property
    def pending(self) -> int:
        """Prefetches launched and not yet joined."""
        return len(self._forked)
