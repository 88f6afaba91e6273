"""Settle every token bucket of a projection at its first call, before serving needs them.

The timed dispatch decides a key on its first call outside capture. In a serving engine that first
call can be a request's: chunked prefill meets batch sizes (a few hundred to thousands of tokens)
that neither vLLM's profile run nor graph capture reach, and timing a new bucket costs ~1 s plus
the first-use compiles of the Triton path (run10: the 1-2 s stalls in 1 of 3 throughput
repetitions were exactly such timings). So the first call of a (projection shape, adapter key)
outside capture, normally vLLM's profile run, settles all token buckets up to the batch capacity:
each bucket on synthetic inputs (random activations, scratch metadata mapping the tokens over all
adapter slots, the projection's own weights and adapter buffers), timed in both modes unless the
dispatch table already holds it, and every path it chose run once so that its kernels are loaded
and compiled. On by default in a serving engine (the vLLM plugin calls ``enable_by_default``),
off elsewhere (benchmarks and tests time what they call); ``EPILORA_WARMUP_BUCKETS=1`` / ``0``
overrides both (off: buckets settle on first contact).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterable

from .dispatch import MODES, TOKEN_BUCKETS, Call, Dispatcher, key_for, modes_to_settle, token_bucket

log = logging.getLogger("epilora_cute.dispatch")

ENV = "EPILORA_WARMUP_BUCKETS"

_done: set[tuple] = set()
_lock = threading.Lock()
generation = 0  # bumped by reset(): the dispatch's memo of settled answers keys on it
_default_on = False


def enable_by_default(on: bool = True) -> None:
    """Make the warm-up the default for this process (the vLLM plugin: a serving engine)."""
    global _default_on
    _default_on = on


def enabled() -> bool:
    v = os.environ.get(ENV)
    return v == "1" if v in ("0", "1") else _default_on


def shape_id(call: Call) -> tuple:
    """What one warm-up covers: a call's key without its token bucket and mode."""
    k = key_for(call, MODES[0])
    return (k.device, k.k, k.slices, k.rank, k.adapters)


def buckets_to_settle(tokens: int, capacity: int) -> list[int]:
    """Token buckets other than ``tokens``' own, up to the one ``capacity`` tokens fall in."""
    top = token_bucket(max(1, capacity))
    own = token_bucket(tokens)
    return [b for b in TOKEN_BUCKETS if b <= top and b != own]


def settle_buckets(call: Call, capacity: int, dispatcher: Dispatcher,
                   make_case: Callable[[int], tuple[Call, Callable[[str], None]]],
                   buckets: Iterable[int] | None = None) -> dict[int, dict[str, str]]:
    """For every bucket b (default ``buckets_to_settle``): ``make_case(b)`` gives b's call (its own
    view: which paths apply depends on the token count, e.g. the decode kernels' <= 32) and a
    candidate runner; decide b's keys in the modes it can run in (``dispatch.modes_to_settle``:
    both, or eager alone above the engine's CUDA-graph sizes) with them (timing unless known), then
    run each decided path once. Returns {bucket: {mode: path}}. A bucket whose inputs cannot be
    built or run is logged and left to settle on first contact."""
    out: dict[int, dict[str, str]] = {}
    for b in (buckets_to_settle(call.tokens, capacity) if buckets is None else buckets):
        try:
            call_b, run = make_case(b)
            paths = {m: dispatcher.path_for(call_b, run, mode=m, capturing=False) for m in modes_to_settle(b)}
            for p in dict.fromkeys(paths.values()):
                run(p)  # loads the chosen kernels (and compiles the Triton path's) now
            out[b] = paths
        except Exception as e:  # noqa: BLE001 - a warm-up must never break the call it precedes
            log.warning("dispatch warm-up: bucket %d of %s skipped: %s: %s",
                        b, key_for(call, MODES[0]).text(), type(e).__name__, e)
    return out


def maybe_warm_up(call: Call, capacity: int, dispatcher: Dispatcher,
                  make_case: Callable[[int], tuple[Call, Callable[[str], None]]]) -> bool:
    """``settle_buckets`` once per process and ``shape_id``; only for calls that may carry adapters
    (a batch the host knows to be adapter-free has one candidate, nothing to time). Returns whether
    it ran now."""
    if not enabled() or call.host_adapters == 0:
        return False
    sid = shape_id(call)
    with _lock:
        if sid in _done:
            return False
        _done.add(sid)
    t0 = time.perf_counter()
    settled = settle_buckets(call, capacity, dispatcher, make_case)
    log.info("dispatch warm-up: %s settled %d token buckets up to %d tokens in %.1f s",
             key_for(call, MODES[0]).text().rsplit("|M<=", 1)[0], len(settled), capacity,
             time.perf_counter() - t0)
    return True


def reset() -> None:
    """Forget which shapes were warmed (tests)."""
    global generation
    with _lock:
        _done.clear()
        generation += 1
