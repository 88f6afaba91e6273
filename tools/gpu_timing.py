"""Timing as the project reports it: CUDA-graph replays, L2 flushed before each, median.

``time_graph(fn)`` captures ``fn`` once into a CUDA graph, then for every repetition empties the
L2 (``epilora_cute.timing.flush_l2``: reads a buffer 4x the L2 by default, EPILORA_L2_FLUSH=write
zeroes it as up to run8; outside the graph), records an event, replays, records an event; the
median over repetitions is the reported time. ``time_eager`` times direct calls the same way,
host launch cost included, and ``host_launch_us`` the host time per call alone.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from epilora_cute.timing import flush_l2 as _flush  # one L2 flush for the runtime and the bench


def _median_us(run: Callable[[], None], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        _flush()
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _flush()
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_graph(fn: Callable[[], None], reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of one replay of ``fn`` captured as a CUDA graph, L2 flushed."""
    g = capture(fn)
    return _median_us(g.replay, reps, warmup)


def time_eager(fn: Callable[[], None], reps: int = 50, warmup: int = 5) -> float:
    return _median_us(fn, reps, warmup)


def host_launch_us(fn: Callable[[], None], reps: int = 2000) -> float:
    """Host microseconds per call (launch cost; the GPU work queues asynchronously)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def read_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Measured device read bandwidth (GB/s): a large reduction reads every byte once."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    us = time_graph(lambda: x.sum(dtype=torch.float32), reps=20, warmup=3)
    return nbytes / (us * 1e-6) / 1e9


def machine_facts() -> dict:
    """Which machine a measurement ran on, so that runs can be told apart (run22: two H200
    machines of one session gave our engine's TPOT 0.15-0.33 ms more than run21's, stock's not):
    the GPU's UUID and driver build (nvidia-smi), the host's CPU model and count, the kernel
    string (/proc/version: Firecracker and gVisor machines differ there). Best effort: a fact that
    cannot be read is None."""
    import os
    import subprocess

    facts: dict = {"cpu_count": os.cpu_count(), "cpu_model": None, "kernel": None, "gpu_uuid": None,
                   "driver_version": None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        facts["kernel"] = Path("/proc/version").read_text().strip()[:160]
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        if out:
            uuid, driver = (v.strip() for v in out[0].split(",", 1))
            facts.update(gpu_uuid=uuid, driver_version=driver)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return facts

