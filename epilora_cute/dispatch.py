"""Timed dispatch: which path computes a projection, decided by measurement and remembered.

A decision is keyed by (device name, projection shape, token bucket, active-adapter bucket, mode):

* the projection shape is (K, output slices, rank),
* token buckets are powers of two (1, 2, 4, ..., 8192: a batch uses the bucket at or above it),
* active-adapter buckets are 0 (no adapter), 1, 2-4, 5-8, 9-32, 33+,
* mode is "graph" (timed as CUDA-graph replays: what a captured decode step pays) or "eager"
  (timed as direct calls, host launch cost included: what a prefill outside graphs pays).

Every applicable candidate path is timed once per key, the fastest is kept, and the table is
persisted as JSON next to the kernel cache, so the next start reuses it. ``EPILORA_FORCE_PATH``
forces one path everywhere (debugging, benchmarks). Each new decision is logged in one line, and
``python -m epilora_cute.dispatch`` prints the table.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .compile_cache import cache_root

log = logging.getLogger("epilora_cute.dispatch")

FORCE_ENV = "EPILORA_FORCE_PATH"
TOKEN_BUCKETS = tuple(2 ** i for i in range(14))  # 1 .. 8192
ADAPTER_BUCKETS = ((0, 0), (1, 1), (2, 4), (5, 8), (9, 32), (33, 1 << 30))


def token_bucket(num_tokens: int) -> int:
    for b in TOKEN_BUCKETS:
        if num_tokens <= b:
            return b
    return TOKEN_BUCKETS[-1]


def adapter_bucket(num_active: int) -> str:
    for lo, hi in ADAPTER_BUCKETS:
        if lo <= num_active <= hi:
            return f"{lo}" if lo == hi else f"{lo}-{hi if hi < 1 << 30 else 'inf'}"
    raise ValueError(num_active)


@dataclass(frozen=True)
class DispatchKey:
    device: str
    k: int
    slices: tuple[int, ...]
    rank: int
    tokens: int  # the bucket
    adapters: str  # the bucket
    mode: str  # "graph" or "eager"

    def text(self) -> str:
        return (f"{self.device}|K={self.k}|N={'+'.join(map(str, self.slices))}|r={self.rank}|"
                f"M<={self.tokens}|A={self.adapters}|{self.mode}")


class DispatchTable:
    """Decisions in memory, mirrored to a JSON file; safe to share between threads."""

    def __init__(self, path: Path | None = None):
        self.path = path or (cache_root() / "dispatch.json")
        self._lock = threading.Lock()
        self._table: dict[str, dict] = {}
        try:
            self._table = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._table = {}

    def get(self, key: DispatchKey) -> str | None:
        e = self._table.get(key.text())
        return e["path"] if e else None

    def entries(self) -> dict[str, dict]:
        return dict(self._table)

    def record(self, key: DispatchKey, times_us: Mapping[str, float]) -> str:
        best = min(times_us, key=times_us.get)
        with self._lock:
            self._table[key.text()] = {"path": best, "times_us": {k: round(v, 2) for k, v in times_us.items()}}
            self._save()
        others = ", ".join(f"{p} {t:.1f}" for p, t in sorted(times_us.items(), key=lambda kv: kv[1]))
        log.info("dispatch %s -> %s (µs: %s)", key.text(), best, others)
        return best

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self._table, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache must not break serving: keep deciding in memory
            log.warning("cannot persist the dispatch table at %s: %s", self.path, e)


def choose(table: DispatchTable, key: DispatchKey, candidates: Mapping[str, Callable[[], None]],
           timer: Callable[[Callable[[], None], str], float]) -> str:
    """The path for ``key``: forced, remembered, or measured now over ``candidates``.

    ``timer(fn, mode)`` returns microseconds for one call of ``fn`` in the key's mode. A candidate
    that raises while being timed is dropped (and logged), never chosen.
    """
    if not candidates:
        raise ValueError(f"no candidate path for {key.text()}")
    forced = os.environ.get(FORCE_ENV)
    if forced:
        if forced not in candidates:
            raise ValueError(f"{FORCE_ENV}={forced} is not a path for {key.text()}; have {sorted(candidates)}")
        return forced
    known = table.get(key)
    if known in candidates:
        return known
    times = {}
    for name, fn in candidates.items():
        try:
            times[name] = timer(fn, key.mode)
        except Exception as e:  # noqa: BLE001 - a broken candidate is reported, not fatal
            log.warning("dispatch: path %s failed for %s: %s", name, key.text(), e)
    if not times:
        raise RuntimeError(f"every candidate path failed for {key.text()}")
    return table.record(key, times)


def cuda_timer(fn: Callable[[], None], mode: str) -> float:
    """The project's timing: graph replays with the L2 flushed, or eager calls (host included)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.gpu_timing import time_eager, time_graph

    return time_graph(fn, reps=20, warmup=3) if mode == "graph" else time_eager(fn, reps=20, warmup=3)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the dispatch table")
    ap.add_argument("--path", type=Path, default=None)
    args = ap.parse_args(argv)
    t = DispatchTable(args.path)
    if not t.entries():
        print(f"no decisions recorded yet at {t.path}")
        return 0
    for key, e in sorted(t.entries().items()):
        times = "  ".join(f"{p}={v}" for p, v in sorted(e["times_us"].items(), key=lambda kv: kv[1]))
        print(f"{key:70s} -> {e['path']:18s} {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
