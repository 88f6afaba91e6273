"""L2 prefetch of weights a later kernel will stream (a cache hint, no data moved to the SMs).

docs/perf.md v0.77: the first bytes of the *next* projection's weight, launched right after a
projection's last kernel, so that while attention / norms / the activation leave DRAM nearly idle
the next stream fills L2 (H100 / H200: 50 MB). Lane l of CTA c asks for the byte segment
c * 32 + l of ``w`` (a flat byte view) with one ``cp.async.bulk.prefetch.L2``; the host picks the
segment size (``plan_segments``). run32 (H100): the prefetched lines hit, but the kernel lasts as
long as its bytes take at DRAM rate and the window's kernels start only after it — opt-in until it
runs beside them (perf.md "v0.77 – v0.79 measured").

One warp per CTA, one request per lane. PDL: every CTA executes
griddepcontrol.launch_dependents first (the next kernel keeps its overlap), then
griddepcontrol.wait, and only then issues its requests: they never compete with the stream of the
kernel before it, and this kernel completes only after that one, so whatever follows on the stream
is ordered after both. It reads and writes nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import ScalarParam, TensorParam

try:  # the DSL is needed to compile, not to launch a cached build
    import cutlass
    import cutlass.cute as cute

    from . import _dsl as D
except ImportError:  # pragma: no cover - GPU machines without nvidia-cutlass-dsl
    cutlass = cute = None

FAMILY = "l2_prefetch"
RUNTIME_CONTRACT = True

LANES = 32  # one warp per CTA, one bulk prefetch per lane
SEGMENT_ALIGN = 16  # cp.async.bulk: 16-byte aligned address and size
MIN_SEGMENT = 4096  # below this, fewer CTAs rather than smaller requests


@dataclass(frozen=True)
class Config:
    threads: int = LANES

    def name(self) -> str:
        return f"t{self.threads}"

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return 0


CONFIG = Config()


def params(config: Config) -> list:
    """Launch-order parameters. w: the weight as flat bytes (its length is the byte count); segment:
    the bytes each lane asks for (a multiple of 16)."""
    return [TensorParam("w", torch.uint8, 1, dynamic_shape=(0,), align=SEGMENT_ALIGN), ScalarParam("segment", "i")]


def prebuild_configs() -> list[Config]:
    return [CONFIG]


@functools.lru_cache(maxsize=256)  # a pure function of two ints, asked on every launch
def plan_segments(nbytes: int, sm_count: int) -> tuple[int, int]:
    """(CTAs, segment bytes) covering ``nbytes`` (a positive multiple of 16): one segment
    per lane, at most one CTA per SM, segments of at least MIN_SEGMENT bytes (a small prefetch takes
    fewer CTAs), every segment a multiple of 16 so each lane's address and size are aligned."""
    if nbytes <= 0 or nbytes % SEGMENT_ALIGN:
        raise ValueError(f"the byte count must be a positive multiple of {SEGMENT_ALIGN}, got {nbytes}")
    lanes = max(1, min(nbytes // MIN_SEGMENT, sm_count * LANES))
    segment = -(-nbytes // lanes)
    segment = -(-segment // SEGMENT_ALIGN) * SEGMENT_ALIGN
    if segment >= 2**31:
        raise ValueError(f"{nbytes} bytes need segments beyond int32 over {lanes} lanes")
    ctas = -(-nbytes // (segment * LANES))  # the last CTA's last lanes may be idle
    return ctas, segment


if cute is not None:  # the kernels themselves exist only where the DSL is importable

    @cute.jit
    def _enter():
        # First let a chained next kernel be scheduled, then wait for the kernel before us: our
        # requests start when its weight stream has ended.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

    class _RangeKernel:
        def __init__(self, config: Config):
            self.cfg = config

        @cute.jit
        def __call__(self, m_w: cute.Tensor, segment: cutlass.Int32, stream):
            # (the grid comes from the launcher: plan_segments)
            self.kernel(m_w, segment).launch(grid=[1, 1, 1], block=[self.cfg.threads, 1, 1], smem=0, stream=stream)

        @cute.kernel
        def kernel(self, m_w: cute.Tensor, segment: cutlass.Int32):
            _enter()
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            nbytes = cutlass.Int64(m_w.shape[0])
            seg = cutlass.Int64(segment)
            start = (cutlass.Int64(cta) * cutlass.Int64(self.cfg.threads) + cutlass.Int64(tidx)) * seg
            if start < nbytes:
                rest = nbytes - start
                size = seg
                if rest < seg:
                    size = rest
                D.prefetch_bulk_l2(m_w.iterator.toint() + start, cutlass.Int32(size))


def compile(config: Config, options: str):
    """Compile for the target in ``options`` from a fake flat byte tensor (no GPU needed)."""
    n = cute.sym_int32(divisibility=SEGMENT_ALIGN)
    w = cute.runtime.make_fake_tensor(cutlass.Uint8, (n,), stride=(1,), assumed_align=SEGMENT_ALIGN)
    stream = cute.runtime.make_fake_stream()
    return cute.compile(_RangeKernel(config), w, cutlass.Int32(MIN_SEGMENT), stream, options=options)
