"""Timed dispatch: which path computes a projection, decided by measurement and remembered.

A decision is keyed by (device name, projection shape, token bucket, active-adapter bucket, mode):

* the projection shape is (K, output slices, rank),
* token buckets are powers of two (1, 2, 4, ..., 8192: a batch uses the bucket at or above it),
* active-adapter buckets are 0 (no adapter), 1, 2-4, 5-8, 9-32, 33+ when the number of distinct
  adapters in the batch is known on the host (``LoRABatchMeta.host_num_adapters``: set by
  ``prepare``/``build_meta`` from a host mapping, or by the caller), and ``<=`` the bucket of
  ``max_loras`` when it is not (the count lives on the device, ``meta.num_active``, and reading it
  would be a host sync; the vLLM plugin prepares from a device mapping, so it always keys by
  ``max_loras`` — which is also all a captured graph can know: it is replayed for every count),
* mode is "graph" (timed as CUDA-graph replays: what a captured decode step pays) or "eager"
  (timed as direct calls, host launch cost included: what a prefill outside graphs pays).

``lora_linear_fp8(path="auto")`` on a CUDA device calls ``auto_path``: the candidates are the
paths that apply to the call (``applicable_paths``) and are allowed (``VERIFIED_PATHS``, or
opted in through ``OPT_IN_ENV``). The call's mode is "graph" while the current stream is capturing
a CUDA graph (or inside ``with call_mode("graph")``), else "eager". On the first call of a bucket
outside capture every candidate is timed (``timing.py``) in *both* modes, so a later capture of
the same bucket finds its graph decision already made; the fastest is kept per mode, persisted as
JSON next to the kernel cache and reused on the next start. Nothing is timed during capture: a
capture that meets an undecided key takes ``default_path`` (logged as a warning) and the key is
timed at its next call outside capture. Per process, a key is timed at most once; the steady
state is a dict lookup (no host sync, no timing). In a serving engine (the vLLM plugin) the first
call of a projection outside capture also settles every other token bucket up to the batch
capacity on synthetic inputs (``bucket_warmup.py``), so no timing falls into a request's path.
Each stored decision carries the fingerprint of the code and settings it was timed with
(``code_fingerprint``: the kernel and runtime sources, the DSL and vLLM versions, the switches
that change what a path launches); a decision of another fingerprint is not reused, so a new
release or a changed switch re-times its keys instead of keeping the old winners.
``EPILORA_FORCE_PATH`` forces one path
everywhere (debugging, benchmarks; any applicable path, opted in or not, or "reference"). Each
decision is logged in one line (logger ``epilora_cute.dispatch``, INFO; defaults at WARNING), and
``python -m epilora_cute.dispatch`` prints the table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping, NamedTuple

from . import environ
from .compile_cache import cache_root
from .identity_memo import IdentityMemo

log = logging.getLogger("epilora_cute.dispatch")

# Environment switches that change the kernels a path launches (and so its time): part of the
# fingerprint a stored decision must match. (Opt-ins that change the candidate set need not be:
# an entry is reused only if it covered every current candidate.)
FINGERPRINT_ENV = ("EPILORA_HYBRID_H", "EPILORA_K2_PUSH", "EPILORA_K2_SQ_WIDE", "EPILORA_META_KERNEL",
                   "EPILORA_L2_FLUSH", "EPILORA_STREAM_PRIORITY", "EPILORA_BASE_QUANT", "EPILORA_K2_XGATE")

FORCE_ENV = "EPILORA_FORCE_PATH"
TOKEN_BUCKETS = tuple(2 ** i for i in range(14))  # 1 .. 8192
ADAPTER_BUCKETS = ((0, 0), (1, 1), (2, 4), (5, 8), (9, 32), (33, 1 << 30))
MODES = ("graph", "eager")

# Which applicable paths "auto" may time and choose without an opt-in: those with a passing GPU
# record (docs/gpu_record/). A path joins by adding it here (one line). run6 (65540fc): the op-level
# tests of decode / no_adapter / hybrid and their kernels' files all passed on the H200.
# decode_sq: run12 (docs/gpu_record/run12), its K2 tests (codes bit-exact) and op-level tests.
# hybrid_par: run13 (docs/gpu_record/run13/hybrid_par_tests_c1b330d.log): bit-identical to the
# hybrid path at 1..2048 tokens, eager and replayed from a CUDA graph with new inputs.
# decode_fh passes its GPU tests (run16) but is left out: slower than decode_sq at every size
# measured (docs/perf.md v0.43), timing it would only lengthen each key's first call.
# hybrid_par_q (hybrid_par forked after the quantization, v0.58): run22
# (docs/gpu_record/run22/hybrid_tests_441f4b6.log, where it was hybrid_par's order): bit-identical
# to the hybrid path, eager and replayed from a CUDA graph with new inputs.
# prefill (v0.60's builds): not yet GPU-verified through the op (its kernels' GPU tests passed in
# run6/run7/run15 with the serial main loop); EPILORA_PREFILL_PATH=1 lets it in. It joins here when
# tests/test_lora_linear_gpu.py -k prefill and tests/test_k2_prefill.py pass on the H200.
# hybrid_st / hybrid_par_st (the streamed shrink, v0.88): run40 calls 1-2 (docs/gpu_record/run40):
# the op-level stream tests (every Qwen3-8B projection at 1..4100 tokens, bit for bit each other,
# graphs with new inputs, mixed ranks, no adapters) and the kernel's file.
VERIFIED_PATHS = frozenset({"triton", "decode", "decode_sq", "no_adapter", "hybrid", "hybrid_par", "hybrid_par_q",
                            "hybrid_st", "hybrid_par_st", "base"})
# A path's variable overrides VERIFIED_PATHS when set: "1" lets an unverified path join the
# candidates, "0" keeps a verified one out. "no_adapter" runs K2, so it follows the decode path's.
OPT_IN_ENV = {"decode": "EPILORA_DECODE_PATH", "decode_sq": "EPILORA_DECODE_PATH", "decode_fh": "EPILORA_DECODE_PATH",
              "no_adapter": "EPILORA_DECODE_PATH",
              "hybrid": "EPILORA_HYBRID_PATH", "hybrid_par": "EPILORA_HYBRID_PAR_PATH",
              "hybrid_par_q": "EPILORA_HYBRID_PAR_PATH", "prefill": "EPILORA_PREFILL_PATH",
              "hybrid_st": "EPILORA_HYBRID_STREAM_PATH", "hybrid_par_st": "EPILORA_HYBRID_STREAM_PATH",
              "hybrid_g": "EPILORA_HYBRID_GROUPED_PATH", "hybrid_par_g": "EPILORA_HYBRID_GROUPED_PATH"}
# The streamed shrink's hybrid paths (v0.88) are candidates in the token buckets from this one
# (a whole bucket, so that every call sharing a dispatch key has the same candidates). v0.89 measured
# them below 1024 (run41, H100): with 8 adapters the layer −9 % at 512 tokens, ties at 256, +20 % at
# 128; with 32 adapters slower at 128–512 (a tile meeting many groups streams K once per group).
STREAM_MIN_TOKENS = 512
# The grouped shrink's hybrid paths (v0.90: one cluster per adapter group, the group's tokens
# gathered) are candidates in the token buckets 64..512 (33..512 tokens): below, the decode path;
# above, groups of many tokens stream their A once per 64-token chunk, where the row-tile shrinks
# are built for it. Not GPU-verified yet: EPILORA_HYBRID_GROUPED_PATH=1 lets them in.
GROUPED_TOKEN_BUCKETS = (64, 128, 256, 512)
# What a key gets when it cannot be timed (under capture, or every candidate failed): the first of
# these among the candidates — what "auto" took before the timed dispatch existed.
DEFAULT_ORDER = ("base", "decode", "decode_sq", "decode_fh", "triton", "hybrid", "hybrid_par", "hybrid_par_q",
                 "hybrid_st", "hybrid_par_st", "hybrid_g", "hybrid_par_g", "prefill", "no_adapter", "reference")
# Batches the host knows to have no adapter (vLLM's no-LoRA flag): "base" (default) computes them
# with vLLM's own FP8 linear path only (same codes, same CUTLASS GEMM), so a projection of
# base-model traffic returns exactly what stock vLLM's returns; in the engine that was no slower than
# the timed choice (run9: TPOT 3.85 -> 3.80 ms, throughput 0.91 -> 0.94x stock without adapters).
# "timed" lets every applicable path compete as for any other key.
NO_LORA_ENV = "EPILORA_NO_LORA_PATH"
NO_LORA_POLICIES = ("base", "timed")


def token_bucket(num_tokens: int) -> int:
    for b in TOKEN_BUCKETS:
        if num_tokens <= b:
            return b
    return TOKEN_BUCKETS[-1]


def stream_bucket(num_tokens: int) -> bool:
    """Whether the streamed shrink's paths are candidates at this many tokens: their whole token
    bucket from STREAM_MIN_TOKENS (the dispatch's rule; the bench times their columns by it too)."""
    return token_bucket(num_tokens) >= STREAM_MIN_TOKENS


def grouped_bucket(num_tokens: int) -> bool:
    """Whether the grouped shrink's paths are candidates at this many tokens (whole token buckets,
    GROUPED_TOKEN_BUCKETS; the bench times their columns by it too)."""
    return token_bucket(num_tokens) in GROUPED_TOKEN_BUCKETS


def adapter_bucket(num_active: int) -> str:
    for lo, hi in ADAPTER_BUCKETS:
        if lo <= num_active <= hi:
            return f"{lo}" if lo == hi else f"{lo}-{hi if hi < 1 << 30 else 'inf'}"
    raise ValueError(num_active)


def adapter_key(host_adapters: int | None, max_loras: int) -> str:
    """The adapter bucket of a batch: its own count when known on the host, else ``<=`` the
    bucket of ``max_loras`` (an upper bound, known without reading the device)."""
    if host_adapters is not None:
        return adapter_bucket(host_adapters)
    return "<=" + adapter_bucket(max(max_loras, 1))


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """What a timing depends on besides the key: the sources of the kernels and of the runtime
    that launches them (kernels_dsl, epilora_cute, the Triton path), the nvidia-cutlass-dsl and
    vLLM versions (their builds and GEMMs), and FINGERPRINT_ENV's values. 16 hex digits; computed
    once per process (~1 ms of file reads)."""
    import hashlib
    from importlib import metadata

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = sorted([*root.glob("kernels_dsl/*.py"), *root.glob("epilora_cute/*.py"),
                    *root.glob("vllm_adapter/triton_*.py")])
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    for dist in ("nvidia-cutlass-dsl", "vllm"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    for name, value in effective_switches().items():
        h.update(f"{name}={value}".encode())
    return h.hexdigest()[:16]


def effective_switches() -> dict[str, str]:
    """FINGERPRINT_ENV's switches as the code reads them, not as typed: " BF16 " and "bf16" are
    one setting (they launch the same kernels), so they share stored decisions. A value its
    parser rejects keeps its raw text (the op raises on it when it runs)."""
    from kernels_dsl import k2_gemm
    from . import metadata, ops, timing

    readers = {"EPILORA_HYBRID_H": lambda: str(ops.hybrid_h_dtype()),
               "EPILORA_K2_PUSH": lambda: ",".join(k2_gemm.push_flags()),
               "EPILORA_K2_SQ_WIDE": lambda: str(k2_gemm.sq_wide_enabled()),
               "EPILORA_META_KERNEL": lambda: str(metadata.meta_kernel_enabled()),
               "EPILORA_L2_FLUSH": timing.flush_mode,
               "EPILORA_STREAM_PRIORITY": lambda: str(ops.stream_priority_enabled()),
               "EPILORA_BASE_QUANT": ops.base_quant,
               "EPILORA_K2_XGATE": lambda: str(k2_gemm.xgate_enabled())}
    out = {}
    for name in FINGERPRINT_ENV:
        try:
            out[name] = readers[name]()
        except ValueError:
            out[name] = "raw:" + os.environ.get(name, "")
    return out


class DispatchKey(NamedTuple):  # a NamedTuple: made and hashed on every "auto" call, cheaply
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
    """Decisions in memory, mirrored to a JSON file; safe to share between threads and between
    processes (a save merges with what other processes wrote, under a file lock). An entry counts
    only under the fingerprint it was timed with (``fingerprint``, default ``code_fingerprint()``);
    others stay in the file but are neither used nor reported as decisions."""

    def __init__(self, path: Path | None = None, fingerprint: str | None = None):
        self.path = Path(path) if path is not None else cache_root() / "dispatch.json"
        self.fingerprint = fingerprint or code_fingerprint()
        self._lock = threading.Lock()
        self._mine: set[str] = set()  # keys recorded by this process: they win a merge
        self._table: dict[str, dict] = self._read()

    def _read(self) -> dict[str, dict]:
        try:
            t = json.loads(self.path.read_text())
            return t if isinstance(t, dict) else {}
        except (OSError, ValueError):
            return {}

    def _current(self, key_text: str) -> dict | None:
        """The stored entry for a key if it was timed under this table's fingerprint."""
        e = self._table.get(key_text)
        return e if isinstance(e, dict) and e.get("code") == self.fingerprint else None

    def get(self, key: DispatchKey) -> str | None:
        e = self._current(key.text())
        return e["path"] if e else None

    def lookup(self, key: DispatchKey, candidates) -> str | None:
        """The remembered path for ``key`` if that decision covered every one of ``candidates``
        (each was timed or failed then), so opting a path in later makes the key be timed again,
        and was timed with this code (fingerprint)."""
        e = self._current(key.text())
        if not e or e.get("path") not in candidates:
            return None
        covered = set(e.get("times_us", {})) | set(e.get("failed", {}))
        return e["path"] if set(candidates) <= covered else None

    def entries(self) -> dict[str, dict]:
        """The decisions timed under this fingerprint."""
        return {k: e for k in self._table if (e := self._current(k)) is not None}

    def stale_entries(self) -> dict[str, dict]:
        """Entries in the file timed with other code or settings (or before fingerprints)."""
        return {k: e for k, e in self._table.items() if self._current(k) is None}

    def record(self, key: DispatchKey, times_us: Mapping[str, float],
               failed: Mapping[str, str] | None = None) -> str:
        best = min(times_us, key=times_us.get)
        entry = {"path": best, "times_us": {k: round(v, 2) for k, v in times_us.items()}, "code": self.fingerprint}
        if failed:
            entry["failed"] = {k: str(v)[:200] for k, v in failed.items()}
        with self._lock:
            self._table[key.text()] = entry
            self._mine.add(key.text())
            self._save()
        others = ", ".join(f"{p} {t:.1f}" for p, t in sorted(times_us.items(), key=lambda kv: kv[1]))
        log.info("dispatch %s -> %s (µs: %s%s)", key.text(), best, others,
                 f"; failed: {', '.join(sorted(failed))}" if failed else "")
        return best

    def _save(self) -> None:
        try:
            from filelock import FileLock

            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=30):
                merged = {**self._table, **self._read(), **{k: self._table[k] for k in self._mine}}
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
                self._table = merged
        except OSError as e:  # a read-only cache must not break serving: keep deciding in memory
            log.warning("cannot persist the dispatch table at %s: %s", self.path, e)


def measure(table: DispatchTable, key: DispatchKey, candidates: Mapping[str, Callable[[], None]],
            timer: Callable[[Callable[[], None], str], float]) -> str:
    """Time every candidate in ``key.mode``, record the fastest (and the failures), return it."""
    times, failed = {}, {}
    for name, fn in candidates.items():
        try:
            times[name] = timer(fn, key.mode)
        except Exception as e:  # noqa: BLE001 - a broken candidate is reported, not fatal
            log.warning("dispatch: path %s failed for %s: %s: %s", name, key.text(), type(e).__name__, e)
            failed[name] = f"{type(e).__name__}: {e}"
    if not times:
        raise RuntimeError(f"every candidate path failed for {key.text()}")
    return table.record(key, times, failed)


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
    known = table.lookup(key, candidates)
    if known is not None:
        return known
    return measure(table, key, candidates, timer)


# ---------------------------------------------------------------------------------------------
# Which paths apply to a call, which of those "auto" may take.

class Call(NamedTuple):
    """What the dispatch needs to know about one ``lora_linear_fp8`` call on a CUDA device."""
    device: str  # device name (part of the key)
    arch: str | None  # CuTe target ("sm_90a", ...), None for GPUs without one
    k: int
    slices: tuple[int, ...]
    rank: int
    tokens: int
    max_loras: int
    host_adapters: int | None  # distinct adapters in the batch when known on the host
    decode_reason: str | None  # why the decode kernels can't take the call (None: they can)
    # why the prefill K2 can't take it (None: it can); the default keeps Calls built before it
    # existed (tables, tests) meaning "not applicable"
    prefill_reason: str | None = "not described"


def applicable_paths(call: Call) -> tuple[str, ...]:
    """Every path that can compute ``call`` (before the opt-in filter), in a fixed order.

    "base" (vLLM's FP8 path): the host knows no token has an adapter (it drops the adapters);
    "decode": ≤ 64 tokens on sm_90a with shapes its kernels take (two token tiles above 32); "decode_sq": the same at 1..8
    tokens where the self-quantizing K2 takes K, and "decode_fh" (K2 computing h too) with it;
    "no_adapter": the same as "decode", and the
    host knows no token has an adapter; "hybrid", "hybrid_par" (its K1 on a second stream beside
    the GEMM) and "hybrid_par_q" (that branch forked after the quantization): sm_90a; "hybrid_st" /
    "hybrid_par_st" (the streamed shrink in place of K1, v0.88): sm_90a in the token buckets from
    STREAM_MIN_TOKENS at the ranks it is compiled for; "hybrid_g" / "hybrid_par_g" (the shrink by
    adapter group, v0.90): the same in GROUPED_TOKEN_BUCKETS; "prefill" (K1, the
    gather, the prefill K2 with the adapter in its epilogue): sm_90a at 33..16384 tokens with shapes
    its kernels take; "triton": any CUDA GPU. "reference" is
    never a candidate on a GPU. Whether a kernel can be loaded (cached or compiled here) shows when
    it is timed: a candidate that fails is dropped.
    """
    paths = ["base"] if call.host_adapters == 0 else []
    if call.decode_reason is None:
        from kernels_dsl.k2_gemm import self_quant_applies

        paths.append("decode")
        if self_quant_applies(call.tokens, call.k):
            paths.append("decode_sq")
            paths.append("decode_fh")
        if call.host_adapters == 0:
            paths.append("no_adapter")
    if call.arch == "sm_90a":
        paths.append("hybrid")
        paths.append("hybrid_par")
        paths.append("hybrid_par_q")
        if stream_bucket(call.tokens) and _side_shrink_shape_reason("stream", call.rank, len(call.slices)) is None:
            paths.append("hybrid_st")
            paths.append("hybrid_par_st")
        if grouped_bucket(call.tokens) and _side_shrink_shape_reason("grouped", call.rank, len(call.slices)) is None:
            paths.append("hybrid_g")
            paths.append("hybrid_par_g")
    if call.prefill_reason is None:
        paths.append("prefill")
    paths.append("triton")
    return tuple(paths)


def _side_shrink_shape_reason(shrink: str, rank: int, num_slices: int) -> str | None:
    from .ops import side_shrink_shape_reason

    return side_shrink_shape_reason(shrink, rank, num_slices)


def _env_allows(path: str, env_value: str | None) -> bool:
    # The path's variable decides when set ("1" in, "0" out: a verified path can be turned off
    # for debugging); unset, a path is in when it is verified.
    if env_value in ("0", "1"):
        return env_value == "1"
    return path in VERIFIED_PATHS


def path_allowed(path: str) -> bool:
    """Whether "auto" may take ``path``: verified on a GPU or opted in, and not opted out."""
    env = OPT_IN_ENV.get(path)
    return _env_allows(path, os.environ.get(env) if env is not None else None)


def _allowed(paths: tuple[str, ...]) -> tuple[str, ...]:
    """``paths`` filtered by ``path_allowed``, reading each opt-in variable at most once."""
    seen: dict[str, str | None] = {}
    out = []
    for p in paths:
        env = OPT_IN_ENV.get(p)
        if env is not None and env not in seen:
            seen[env] = os.environ.get(env)
        if _env_allows(p, seen.get(env) if env is not None else None):
            out.append(p)
    return tuple(out)


def no_lora_policy() -> str:
    """``EPILORA_NO_LORA_PATH``: "base" (default) or "timed"; anything else is an error."""
    v = os.environ.get(NO_LORA_ENV) or "base"
    if v not in NO_LORA_POLICIES:
        raise ValueError(f"{NO_LORA_ENV}={v!r}: one of {NO_LORA_POLICIES}")
    return v


def candidates_for(call: Call) -> tuple[str, ...]:
    """The paths "auto" chooses among for ``call``: the allowed applicable ones; for a batch
    without adapters only "base" (vLLM's path) unless the no-LoRA policy is "timed"."""
    names = _allowed(applicable_paths(call))
    if call.host_adapters == 0 and "base" in names and no_lora_policy() == "base":
        return ("base",)
    return names


def default_path(candidates) -> str:
    for p in DEFAULT_ORDER:
        if p in candidates:
            return p
    return sorted(candidates)[0]


# The largest batch this process captures CUDA graphs for (the vLLM plugin sets vLLM's
# max_cudagraph_capture_size; 0: none, e.g. enforce_eager; None: unknown, every mode is settled).
# A token bucket above it is never replayed from a graph, so settling it outside capture times its
# eager mode only (v1.01: an engine's start timed every bucket up to 8192 tokens as graph replays
# too, ~35 s of run48's 43 s profiling run on an H100, against stock's 5 s).
_graph_max_tokens: int | None = None


def set_graph_max_tokens(n: int | None) -> int | None:
    """Set the largest batch CUDA graphs are captured for (None: unknown); returns the previous."""
    global _graph_max_tokens
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"the graph capture limit must be an int >= 0 or None, got {n!r}")
    before, _graph_max_tokens = _graph_max_tokens, n
    return before


def graph_mode_used(bucket: int) -> bool:
    """Whether a batch of this token bucket can run as a CUDA-graph replay in this process."""
    n = _graph_max_tokens
    return n is None or (n > 0 and bucket <= token_bucket(n))


def modes_to_settle(bucket: int) -> tuple[str, ...]:
    """The modes a bucket is settled in outside capture: both, or eager alone above the graphs."""
    return MODES if graph_mode_used(bucket) else tuple(m for m in MODES if m != "graph")


def key_for(call: Call, mode: str) -> DispatchKey:
    return DispatchKey(call.device, call.k, tuple(call.slices), call.rank, token_bucket(call.tokens),
                       adapter_key(call.host_adapters, call.max_loras), mode)


# ---------------------------------------------------------------------------------------------
# The call's mode.

_override = threading.local()


@contextlib.contextmanager
def call_mode(mode: str) -> Iterator[None]:
    """Declare the mode of the calls inside (e.g. warm-up runs of a step that will be captured);
    without it a call is "graph" while the current stream captures, else "eager"."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    prev = getattr(_override, "mode", None)
    _override.mode = mode
    try:
        yield
    finally:
        _override.mode = prev


def capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def current_mode(is_capturing: bool) -> str:
    return getattr(_override, "mode", None) or ("graph" if is_capturing else "eager")


# ---------------------------------------------------------------------------------------------
# The dispatcher: this process's decisions.

class Dispatcher:
    """Decides per key, at most one timing per key per process; ``timer`` and the candidate
    runner are injectable (tests use fakes on the CPU)."""

    def __init__(self, table: DispatchTable | None = None,
                 timer: Callable[[Callable[[], None], str], float] | None = None):
        self._table = table
        self.timer = timer or cuda_timer
        self._decided: dict[DispatchKey, str] = {}
        self._provisional: set[DispatchKey] = set()  # defaults taken under capture, to be timed
        self._timed: set[DispatchKey] = set()
        self._noted: set[tuple] = set()
        # auto_path's settled answers by what they depend on (``_settled_signature``): a call that
        # finds its signature here skips the description and the decision.
        self.settled: dict[tuple, str] = {}
        # the eager calls settled on the hybrid path, replayed from one lookup (eager_memo.py);
        # dropped with ``settled``
        self.eager_plans = IdentityMemo()
        self._lock = threading.RLock()

    @property
    def table(self) -> DispatchTable:
        if self._table is None:
            self._table = DispatchTable()
        return self._table

    def decisions(self) -> dict[DispatchKey, str]:
        return dict(self._decided)

    def path_for(self, call: Call, run: Callable[[str], None], *, mode: str, capturing: bool) -> str:
        """The path for ``call``. ``run(path)`` computes the call with ``path`` into scratch
        output (only invoked to time candidates, never while ``capturing``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        applicable = applicable_paths(call)
        key = key_for(call, mode)
        forced = os.environ.get(FORCE_ENV)
        if forced:
            if forced not in applicable and forced != "reference":
                raise ValueError(f"{FORCE_ENV}={forced} is not a path for {key.text()}; "
                                 f"applicable: {sorted(applicable + ('reference',))}")
            self._note(key, forced, f"forced by {FORCE_ENV}")
            return forced
        names = candidates_for(call)
        if not names:
            raise ValueError(f"no allowed path for {key.text()} (applicable: {list(applicable)}; "
                             f"VERIFIED_PATHS / {sorted(set(OPT_IN_ENV.values()))} decide)")
        path = self._decided.get(key)
        if path is None or (not capturing and self._provisional and self._unsettled(key)):
            with self._lock:
                path = self._settle_all(key, names, run, capturing)
        if path not in names:  # this call's inputs rule the key's path out (e.g. alignment)
            path = default_path(names)
            self._note(key, path, "default: the key's decision does not apply to this call")
        return path

    def _unsettled(self, key: DispatchKey) -> bool:
        """Whether a mode of ``key``'s bucket still holds a default taken under capture."""
        return any(key._replace(mode=m) in self._provisional for m in MODES)

    def _settle_all(self, key: DispatchKey, names: tuple[str, ...], run, capturing: bool) -> str:
        if key in self._decided and (capturing or not self._unsettled(key)):
            return self._decided[key]  # another thread settled it while we waited
        candidates = {p: functools.partial(run, p) for p in names}
        if capturing:
            return self._settle(key, candidates, may_time=False)
        # Outside capture: settle this bucket in every mode it can run in now — a graph key cannot
        # be timed later, under capture (a bucket above the graph limit: eager alone).
        timed_before = len(self._timed)
        try:
            for m in (key.mode,) + tuple(m for m in MODES if m != key.mode):
                k = key._replace(mode=m)
                if m != key.mode and m not in modes_to_settle(key.tokens) and k not in self._provisional:
                    continue  # never run in this mode here (a graph above the capture sizes: unless one was met)
                if k not in self._decided or k in self._provisional:
                    self._settle(k, candidates, may_time=True)
        finally:
            if len(self._timed) != timed_before and self.timer is cuda_timer:
                from . import timing

                timing.release()  # the L2-flush buffer: serving needs the memory
        return self._decided[key]

    def _settle(self, key: DispatchKey, candidates: Mapping[str, Callable[[], None]], may_time: bool) -> str:
        names = tuple(candidates)
        provisional = False
        if len(names) == 1:
            path, why, level = names[0], "the only candidate", logging.INFO
        elif (known := self.table.lookup(key, names)) is not None:
            path, why, level = known, f"from {self.table.path}", logging.INFO
        elif may_time and key not in self._timed:
            self._timed.add(key)
            try:
                path, why, level = measure(self.table, key, candidates, self.timer), None, logging.INFO
            except RuntimeError as e:
                path, why, level = default_path(names), f"default: {e}", logging.WARNING
        else:
            provisional = not may_time
            path, level = default_path(names), logging.WARNING
            why = ("default: not timed during CUDA-graph capture; timed at the next call outside capture"
                   if provisional else "default")
        self._decided[key] = path
        (self._provisional.add if provisional else self._provisional.discard)(key)
        if why is not None:
            self._note(key, path, why, level)
        return path

    def _note(self, key: DispatchKey, path: str, why: str, level: int = logging.INFO) -> None:
        if (key, path, why) not in self._noted:
            self._noted.add((key, path, why))
            log.log(level, "dispatch %s -> %s (%s)", key.text(), path, why)


_default: Dispatcher | None = None
_default_lock = threading.Lock()


def dispatcher() -> Dispatcher:
    """The process's dispatcher (its table: ``<kernel cache>/dispatch.json``)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Dispatcher()
    return _default


def set_dispatcher(d: Dispatcher | None) -> None:
    """Replace the process's dispatcher (tests, benchmarks); None: a fresh one on next use."""
    global _default
    _default = d


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def describe(x, w_q, widths, rank, lora_a, lora_b, meta) -> Call | None:
    """The dispatch's view of a validated ``lora_linear_fp8`` call; None off CUDA."""
    from . import ops

    if not ops._on_gpu(x):
        return None
    import torch

    from .arch import arch_of

    arch = arch_of(x)
    decode_reason = (ops._decode_reason(x, w_q, widths, rank, lora_a, lora_b) if arch == "sm_90a"
                     else "the decode path needs sm_90a")
    # Asked only when the prefill path could join the candidates (its reason walks the buffers).
    prefill_reason = (ops._prefill_reason(x, w_q, widths, rank, lora_a, lora_b) if path_allowed("prefill")
                      else "not a candidate (EPILORA_PREFILL_PATH)")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return Call(device=_device_name(index), arch=arch, k=int(x.shape[1]), slices=tuple(widths), rank=int(rank),
                tokens=int(x.shape[0]), max_loras=int(meta.max_loras),
                host_adapters=getattr(meta, "host_num_adapters", None), decode_reason=decode_reason,
                prefill_reason=prefill_reason)


def auto_path(x, w_q, w_scale, lora_a, lora_b, meta, *, widths, rank, out, slot_ranks=None, pdl=True,
              chain_pdl=False) -> str:
    """The path ``lora_linear_fp8(path="auto")`` takes for this call: "reference" off CUDA, else
    the process dispatcher's decision (timing the candidates first if the key is new; the timed
    runs write into a scratch output, never into ``out``). Once a call's decision is final, later
    calls with the same ``_settled_signature`` take it without describing the call again."""
    from . import ops

    d = dispatcher()
    is_capturing = capturing()
    mode = current_mode(is_capturing)
    sig = _settled_signature(x, w_q, widths, rank, lora_a, lora_b, meta, mode) if ops._on_gpu(x) else None
    if sig is not None and (path := d.settled.get(sig)) is not None:
        return path
    call = describe(x, w_q, widths, rank, lora_a, lora_b, meta)
    if call is None:
        return "reference"
    scratch = []

    def run(path: str) -> None:
        if not scratch:
            scratch.append(out.new_empty(out.shape))
        ops.lora_linear_fp8(x, w_q, w_scale, lora_a, lora_b, meta, out=scratch[0], slot_ranks=slot_ranks,
                            path=path, pdl=pdl, chain_pdl=chain_pdl)

    if not is_capturing:
        from . import bucket_warmup

        def make_case(b: int) -> tuple[Call, Callable[[str], None]]:
            xb, run_b = _synthetic_runner(x, w_q, w_scale, lora_a, lora_b, meta, b, out.shape[1],
                                          slot_ranks=slot_ranks, pdl=pdl)
            # b's own view of the call (the decode kernels apply only up to 64 tokens), keyed
            # with the live call's adapter knowledge.
            return describe(xb, w_q, widths, rank, lora_a, lora_b, meta)._replace(tokens=b), run_b

        bucket_warmup.maybe_warm_up(call, int(meta.max_num_tokens), d, make_case)
    path = d.path_for(call, run, mode=mode, capturing=is_capturing)
    # Remembered only outside capture: there path_for settles the bucket in every mode and the
    # bucket warm-up has run for this shape (under capture a default would be timed later).
    if sig is not None and not is_capturing:
        if len(d.settled) >= SETTLED_MAX:
            d.settled.clear()
            d.eager_plans.clear()
        d.settled[sig] = path
    return path


# auto_path's memo holds at most this many signatures (one per projection shape, token count and
# mode in use; cleared when full, e.g. after a long run of new prefill chunk sizes).
SETTLED_MAX = 16384
# Everything the environment contributes to a decision: the forced path, the no-adapter policy,
# the opt-ins (read per call: a variable set later still takes effect on the next call).
DECISION_ENV = (FORCE_ENV, NO_LORA_ENV, *sorted(set(OPT_IN_ENV.values())))


def _settled_signature(x, w_q, widths, rank, lora_a, lora_b, meta, mode: str) -> tuple:
    """What a call's decision depends on, cheap to compute: ``describe``'s inputs (the device and
    its arch, the exact token count — which kernels apply can change inside a bucket: the top one
    holds every count above 8192, the prefill K2 stops at 16384 —, the shape, the adapter
    knowledge, whether x and the buffers have the layout the CuTe kernels need), the mode, the
    switches (environment, the allowed set, the bucket warm-up: one turned on later still runs)."""
    from . import ops

    layout_ok = ops._buffer_layout_reason(x, w_q, lora_a, lora_b) is None
    return (x.device, x.shape[0], x.shape[1], tuple(widths), rank, meta.max_loras,
            getattr(meta, "host_num_adapters", None), mode, layout_ok, *decision_switches())


def decision_switches() -> tuple:
    """The switches a settled decision depends on besides the call: the environment
    (DECISION_ENV), the allowed set, the bucket warm-up (on, and its generation)."""
    from . import bucket_warmup

    return environ.values(DECISION_ENV_KEYS), VERIFIED_PATHS, bucket_warmup.enabled(), bucket_warmup.generation


# Read per settled call (environ: ~1 µs per unset name through os.environ, a third of a settled
# call's host time for DECISION_ENV).
DECISION_ENV_KEYS = environ.keys(DECISION_ENV)
_BASE_SHORTCUT_KEYS = environ.keys((FORCE_ENV, NO_LORA_ENV))


def base_is_the_no_adapter_path() -> bool:
    """Whether "auto" takes "base" for every batch the host knows has no adapter: "base" allowed,
    the default no-LoRA policy and no forced path (read now, as the dispatch reads them per call;
    asked by every eager no-adapter call of the plugin, hence the direct read)."""
    forced, policy = environ.values(_BASE_SHORTCUT_KEYS)
    if forced:
        return False
    if policy and no_lora_policy() != "base":  # set: validated (an unknown value raises) and read
        return False
    return path_allowed("base")


def _synthetic_runner(x, w_q, w_scale, lora_a, lora_b, meta, tokens: int, n: int, *, slot_ranks, pdl):
    """(activations, candidate runner) for a ``tokens``-token batch of the same projection (the
    bucket warm-up): the call's activations repeated to ``tokens`` rows, tokens dealt round-robin
    over all adapter slots (scratch metadata, prepared on the device so its key stays the ``<=``
    one), a scratch output. Not chained: nothing before it is in flight."""
    import torch

    from . import ops
    from .metadata import build_meta

    xb = x.repeat(-(-tokens // x.shape[0]), 1)[:tokens].contiguous()
    mapping = torch.arange(tokens, device=x.device, dtype=torch.int32) % max(int(meta.max_loras), 1)
    mb = build_meta(mapping, int(meta.max_loras), max_num_tokens=tokens)
    ob = x.new_empty((tokens, n))

    def run(path: str) -> None:
        ops.lora_linear_fp8(xb, w_q, w_scale, lora_a, lora_b, mb, out=ob, slot_ranks=slot_ranks,
                            path=path, pdl=pdl)

    return xb, run


def cuda_timer(fn: Callable[[], None], mode: str) -> float:
    """The runtime's timing (``timing.py``): graph replays with the L2 flushed, or eager calls
    with host time included."""
    from .timing import cuda_timer as timer

    return timer(fn, mode)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the dispatch table")
    ap.add_argument("--path", type=Path, default=None)
    args = ap.parse_args(argv)
    t = DispatchTable(args.path)
    opted = ", ".join(f"{p} ({env}=1)" for p, env in sorted(OPT_IN_ENV.items()))
    print(f"# table: {t.path}\n# auto candidates: {', '.join(sorted(VERIFIED_PATHS))}; opt-in: {opted}")
    print(f"# code fingerprint {t.fingerprint}; {len(t.stale_entries())} entries timed with other code or "
          "settings are not used")
    if not t.entries():
        print(f"no decisions recorded yet at {t.path} for this code")
        return 0
    for key, e in sorted(t.entries().items()):
        times = "  ".join(f"{p}={v}" for p, v in sorted(e["times_us"].items(), key=lambda kv: kv[1]))
        failed = f"  failed: {', '.join(sorted(e['failed']))}" if e.get("failed") else ""
        print(f"{key:70s} -> {e['path']:18s} {times}{failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
