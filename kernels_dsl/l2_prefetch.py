"""L2 prefetch of weights a later kernel will stream (a cache hint, no data moved to the SMs).

Two uses, one build each:

* range (docs/perf.md v0.77): the first bytes of the *next* projection's weight, launched right
  after a projection's last kernel, so that while attention / norms / the activation leave DRAM
  nearly idle the next stream fills L2 (H100 / H200: 50 MB). Lane l of CTA c asks for the byte
  segment c * 32 + l of ``w`` (a flat byte view) with one ``cp.async.bulk.prefetch.L2``; the host
  picks the segment size (``plan_segments``).
* heads (v0.79): on the decode path, launched just before the shrink, the first ``head`` bytes of
  every (weight row, K2 split) range — exactly the first stages every K2 CTA streams (K2's split s
  starts at k-block s * nk // S) — while K2 is being launched behind the shrink (~2.7 us per
  projection of DRAM idle on the H200). Those bytes are the first K2 reads, so they are still in
  L2 when it does, however large the weight.

One warp per CTA, one request per lane per item. PDL: every CTA executes
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

LANES = 32  # one warp per CTA, one bulk prefetch per lane and item
SEGMENT_ALIGN = 16  # cp.async.bulk: 16-byte aligned address and size
MIN_SEGMENT = 4096  # range mode: below this, fewer CTAs rather than smaller requests
MIN_HEAD = 128  # heads mode: one L2 line per (row, split) at least, or nothing


@dataclass(frozen=True)
class Config:
    threads: int = LANES
    heads: bool = False  # the (row, split) heads of K2's weight instead of one byte range

    def name(self) -> str:
        return f"t{self.threads}" + ("_heads" if self.heads else "")

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return 0


CONFIG = Config()
HEADS = Config(heads=True)


def params(config: Config) -> list:
    """Launch-order parameters. w: the weight as flat bytes. Range mode: the segment each lane asks
    for (bytes, a multiple of 16; the length of w is the byte count). Heads mode: the row's bytes
    (K), K2's split, K2's k-block bytes, the bytes asked for per (row, split)."""
    w = TensorParam("w", torch.uint8, 1, dynamic_shape=(0,), align=SEGMENT_ALIGN)
    if config.heads:
        return [w, ScalarParam("row_bytes", "i"), ScalarParam("splits", "i"), ScalarParam("bk", "i"),
                ScalarParam("head", "i")]
    return [w, ScalarParam("segment", "i")]


def prebuild_configs() -> list[Config]:
    return [CONFIG, HEADS]


@functools.lru_cache(maxsize=256)  # a pure function of two ints, asked on every launch
def plan_segments(nbytes: int, sm_count: int) -> tuple[int, int]:
    """Range mode: (CTAs, segment bytes) covering ``nbytes`` (a positive multiple of 16): one segment
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


def shortest_split_bytes(row_bytes: int, bk: int, splits: int) -> int:
    """Bytes of a row in K2's shortest split (splits take nk // splits k-blocks or one more)."""
    return (-(-row_bytes // bk) // splits) * bk


@functools.lru_cache(maxsize=256)
def plan_heads(rows: int, row_bytes: int, splits: int, bk: int, budget: int, sm_count: int) -> tuple[int, int]:
    """Heads mode: (CTAs, head bytes per (row, split)) so that all heads fit ``budget``: a multiple
    of 16, at most the shortest split, at least MIN_HEAD (else (0, 0): nothing worth asking for);
    CTAs enough for one (row, split) per lane, at most one per SM."""
    if budget <= 0 or rows <= 0 or splits <= 0 or row_bytes % SEGMENT_ALIGN or bk % SEGMENT_ALIGN:
        return 0, 0
    head = min(budget // (rows * splits), shortest_split_bytes(row_bytes, bk, splits))
    head -= head % SEGMENT_ALIGN
    if head < MIN_HEAD:
        return 0, 0
    return max(1, min(sm_count, -(-(rows * splits) // LANES))), head


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

    class _HeadsKernel:
        def __init__(self, config: Config):
            self.cfg = config

        @cute.jit
        def __call__(self, m_w: cute.Tensor, row_bytes: cutlass.Int32, splits: cutlass.Int32, bk: cutlass.Int32,
                     head: cutlass.Int32, stream):
            # (the grid comes from the launcher: plan_heads)
            self.kernel(m_w, row_bytes, splits, bk, head).launch(grid=[1, 1, 1], block=[self.cfg.threads, 1, 1],
                                                                  smem=0, stream=stream)

        @cute.kernel
        def kernel(self, m_w: cute.Tensor, row_bytes: cutlass.Int32, splits: cutlass.Int32, bk: cutlass.Int32,
                   head: cutlass.Int32):
            _enter()
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            grid = cute.arch.grid_dim()
            rows = m_w.shape[0] // row_bytes
            nk = (row_bytes + bk - 1) // bk
            base = m_w.iterator.toint()
            # Item i = (row r, split s): K2's CTA of split s starts its stream at k-block s * nk // S.
            for i in cutlass.range(cta * self.cfg.threads + tidx, rows * splits, grid[0] * self.cfg.threads,
                                   unroll=1):
                r = i // splits
                s = i - r * splits
                D.prefetch_bulk_l2(base + cutlass.Int64(r) * cutlass.Int64(row_bytes)
                                   + cutlass.Int64((s * nk // splits) * bk), head)


def compile(config: Config, options: str):
    """Compile for the target in ``options`` from a fake flat byte tensor (no GPU needed)."""
    n = cute.sym_int32(divisibility=SEGMENT_ALIGN)
    w = cute.runtime.make_fake_tensor(cutlass.Uint8, (n,), stride=(1,), assumed_align=SEGMENT_ALIGN)
    stream = cute.runtime.make_fake_stream()
    if config.heads:
        return cute.compile(_HeadsKernel(config), w, cutlass.Int32(4096), cutlass.Int32(1), cutlass.Int32(128),
                            cutlass.Int32(1024), stream, options=options)
    return cute.compile(_RangeKernel(config), w, cutlass.Int32(MIN_SEGMENT), stream, options=options)
