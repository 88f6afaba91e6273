"""The runtime's timer for the timed dispatch (``dispatch.py``): small, self-contained, CUDA only.

Two modes, matching how a path is later run:

* ``"graph"``: ``fn`` is captured once into a CUDA graph (warm-up and capture on one side stream,
  so per-stream state such as the decode path's sync buffer is made outside the capture), then
  each repetition empties the L2 (``flush_l2``, outside the graph), records an event,
  replays, records an event. Result: the median replay time, GPU only — what a captured decode
  step pays.
* ``"eager"``: each repetition flushes the L2, synchronizes, then measures with the host clock one
  direct call of ``fn`` up to its completion (``torch.cuda.synchronize``). Result: the median of
  host launch time + GPU time (+ one synchronization round trip, the same for every candidate) —
  what a call outside graphs pays when the host cannot run ahead of the GPU.

``tools/gpu_timing.py`` is the benchmark's timer (same graph method, more repetitions); the
runtime does not import ``tools/``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

REPS = 20
WARMUP = 3
_MIN_FLUSH_BYTES = 64 * 1024 * 1024
_flush_bufs: dict[int, torch.Tensor] = {}
_side_streams: dict[int, torch.cuda.Stream] = {}  # one per device: per-stream state is made once


FLUSH_ENV = "EPILORA_L2_FLUSH"
FLUSH_MODES = ("read", "write")


def flush_mode() -> str:
    """How the L2 is emptied before a timed run (EPILORA_L2_FLUSH). "read" (the default): read a
    buffer 4x the L2, which leaves only clean lines in it. "write": zero that buffer (the method up
    to run8); it leaves up to a whole L2 of dirty lines (~60 MB on an H200) that the timed kernels'
    first reads must write back: ~14 µs of DRAM time charged to whatever is timed next, which
    nothing in a serving engine pays (run8: vLLM's FP8 GEMMs took 58 µs per layer in the engine and
    84 µs in the write-flushed layer bench)."""
    mode = os.environ.get(FLUSH_ENV) or "read"
    if mode not in FLUSH_MODES:
        raise ValueError(f"{FLUSH_ENV}={mode!r}: one of {FLUSH_MODES}")
    return mode


def flush_l2(device: torch.device | None = None) -> None:
    """Empty the L2 of ``device`` (default: the current one) of anything a timed run could reuse."""
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    mode = flush_mode()
    buf = _flush_bufs.get(idx)
    if buf is None:
        l2 = int(getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or 0)
        nbytes = max(4 * l2, _MIN_FLUSH_BYTES)
        buf = _flush_bufs[idx] = torch.zeros(nbytes // 4, dtype=torch.int32, device=torch.device("cuda", idx))
    if mode == "write":
        buf.zero_()
    else:
        buf.amax()  # reads every line once; its dirty lines were written back by an earlier flush


def release() -> None:
    """Drop the L2-flush buffers (called after a round of timing: serving needs the memory)."""
    _flush_bufs.clear()


def time_graph(fn: Callable[[], None], reps: int = REPS, warmup: int = WARMUP) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn``, L2 flushed before each."""
    device = torch.device("cuda", torch.cuda.current_device())
    side = _side_streams.get(device.index)
    if side is None:
        side = _side_streams[device.index] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # first use: module loads, lazy allocations, per-stream buffers
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.synchronize(device)
    try:
        for _ in range(warmup):
            flush_l2(device)
            graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            flush_l2(device)
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3
    finally:
        del graph


def time_eager(fn: Callable[[], None], reps: int = REPS, warmup: int = WARMUP) -> float:
    """Median microseconds of one direct call of ``fn`` to completion, host time included."""
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush_l2(device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cuda_timer(fn: Callable[[], None], mode: str) -> float:
    """The dispatch's timer: ``time_graph`` for mode "graph", ``time_eager`` for "eager"."""
    if mode == "graph":
        return time_graph(fn)
    if mode == "eager":
        return time_eager(fn)
    raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
