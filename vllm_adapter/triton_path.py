"""The portable Triton path: every tenant of a batch in two fused launches (the Ada / sm_89 fallback).

Public entry points:

* ``triton_lora_linear(x, w_q, w_scale, lora_a_slices, lora_b_slices, meta, *, w8a16=False,
  out=None, slot_ranks=None, config=None) -> y`` runs K1 (per-token FP8 quant + LoRA shrink) and
  K2 (FP8 GEMM + grouped LoRA expand); semantics are ``reference.lora_linear``.
* ``triton_quant_shrink`` / ``triton_gemm_lora`` run one kernel each (tests, debugging).
* ``triton_path_forced()`` / ``triton_path_applies(device)``: the switch the plugin reads
  (``EPILORA_FORCE_TRITON=1`` forces this path on any CUDA GPU).

Kernels and layouts are described in ``vllm_adapter/triton_kernels.py``. Without a GPU the kernels
run on CPU tensors under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before
``vllm_adapter.triton_kernels`` is imported (Triton picks interpreter or compiler when it decorates).

CUDA graphs: the per-layer pointer and tile tables and the split-K arrival counters are cached
device tensors. ``prepare_tables(lora_a, lora_b)`` builds all of a layer's, for every token count,
before any capture (the vLLM plugin calls it when vLLM creates the layer's adapter buffers); tables
a capture used are never evicted or replaced, and one still missing during a capture is made for
that graph alone (see "cached device tables" below). The counters are shared per device: do not
run this path on two streams of one device at the same time.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
ENV_FORCE_TRITON = "EPILORA_FORCE_TRITON"
MAX_RANK = 512
# The last split-K program sums every partial with unrolled loads: keep that unrolling short.
MAX_K1_SPLITS = 16


# ----------------------------------------------------------------------------- when this path applies

def triton_path_forced() -> bool:
    """True when ``EPILORA_FORCE_TRITON=1`` asks for the Triton path on any CUDA GPU."""
    return os.environ.get(ENV_FORCE_TRITON, "").strip() == "1"


def triton_path_applies(device) -> bool:
    """True for CUDA devices of compute capability 8.9 (Ada), or any CUDA device when forced.

    The FP8 (W8A8) kernel needs FP8 tensor cores, i.e. sm_89 or newer; forcing the path on an
    older GPU is the caller's choice and fails at compile time there.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if triton_path_forced():
        return True
    return torch.cuda.get_device_capability(device) == (8, 9)


# ----------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class TritonLoraConfig:
    """Tile shapes. k1_* for quant+shrink, k2_* for GEMM+expand. Block dims are powers of two."""
    k1_block_m: int = 16
    k1_block_k: int = 64
    k1_block_r: int = 64
    k1_split_k: int = 1  # requested splits of K; the wrapper rounds chunks to k1_block_k
    k1_num_warps: int = 4
    k2_block_m: int = 16
    k2_block_n: int = 64
    k2_block_k: int = 128
    k2_block_r: int = 64
    k2_group_m: int = 8
    k2_num_warps: int = 4
    k2_num_stages: int = 3


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def pick_config(M: int, K: int, R: int, num_slices: int, device, *, w8a16: bool = False,
                N: Optional[int] = None) -> TritonLoraConfig:
    """Heuristic tiles by batch size (measured on an H200 with Triton 3.6; Ada untested).

    Decode (small M) is bandwidth bound: split-K in K1 spreads the A reads over the SMs, and K2
    takes 16-row tiles with deep K steps. Larger batches take the largest K2 tile that still
    gives every two SMs a program."""
    device = torch.device(device)
    r_pad = _pow2_at_least(R)
    if device.type != "cuda":  # interpreter: small tiles so small test shapes still span several
        split = 2 if K >= 128 else 1
        return TritonLoraConfig(k1_block_m=16, k1_block_k=64, k1_block_r=min(r_pad, 32), k1_split_k=split,
                                k2_block_m=16, k2_block_n=32, k2_block_k=64, k2_block_r=min(r_pad, 32))
    sms = _num_sms(device)
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    # Tiles by the batch's power-of-two bucket (the dispatch's token bucket), not its exact size:
    # every size of a bucket then runs the kernels its warm-up compiled (epilora_cute/bucket_warmup.py),
    # never a Triton compile in a request's path.
    M = _pow2_at_least(M, lo=1)
    k1_bm, k1_bk, k1_br = 16, 128, min(r_pad, 64)
    base_programs = max(1, -(-M // k1_bm) * num_slices * -(-R // k1_br))
    split = max(1, min(-(-4 * sms // base_programs), K // (2 * k1_bk), MAX_K1_SPLITS))
    # A power of two: SPLIT_K (and the quantizer tile that follows it) are compile-time constants,
    # and every new value is a Triton compile (~1-3 s) in the middle of serving. Any split from 1
    # to 16 made batch sizes of one dispatch bucket compile up to ten variants (run9: 1-3 s stalls
    # in 4 of 9 throughput repetitions); powers of two make it five per kernel shape.
    split = 1 << (split.bit_length() - 1)
    bm, bn, bk, warps, stages = _k2_tiles(M, N or 4096, sms, w8a16, hopper)
    if not hopper:
        stages = min(stages, 3)
    return TritonLoraConfig(k1_block_m=k1_bm, k1_block_k=k1_bk, k1_block_r=k1_br, k1_split_k=split,
                            k2_block_m=bm, k2_block_n=bn, k2_block_k=bk, k2_num_warps=warps, k2_num_stages=stages,
                            k2_block_r=min(r_pad, 32 if bm >= 128 else 64))


def _k2_tiles(M: int, N: int, sms: int, w8a16: bool, hopper: bool) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, warps, stages) for K2, from H200 sweeps. Off Hopper the
    stages (capped at 3 by the caller) x bytes per stage stay within Ada's ~100 KB per block."""
    if M <= 16:
        if w8a16:
            return 16, 32, 128, 4, 4
        return (16, 32, 256, 4, 4) if N < 16384 else (16, 64, 256, 4, 3)
    if M <= 64:
        wide = N >= 16384
        if w8a16:
            return (32 if M <= 32 else 64), 64 if wide else 32, 128, 4, 4
        return (32, 64, 128, 4, 4) if wide else (32, 32, 256, 4, 4)
    if M <= 512:
        if -(-M // 128) * -(-N // 128) * 2 >= sms:
            return 128, 128, 128 if hopper else 64, 8, 4 if hopper else 3
        return 64, 64, 128, 4, 4
    return (256, 128, 64, 8, 3) if hopper else (128, 128, 64, 8, 3)


def _check_config(cfg: TritonLoraConfig) -> None:
    if cfg.k1_split_k > MAX_K1_SPLITS:
        raise ValueError(f"config.k1_split_k must be <= {MAX_K1_SPLITS}, got {cfg.k1_split_k}")
    for name in ("k1_block_m", "k1_block_k", "k1_block_r", "k2_block_m", "k2_block_n", "k2_block_k", "k2_block_r"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16 (tl.dot's minimum), got {v}")
    if cfg.k1_split_k < 1 or cfg.k2_group_m < 1:
        raise ValueError("config.k1_split_k and config.k2_group_m must be >= 1")


# ----------------------------------------------------------------------------- input validation

def _as_slices(t) -> list[torch.Tensor]:
    return list(t) if isinstance(t, (list, tuple)) else [t]


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but x is on {device}")


def _kernels_interpreted() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (then they take CPU tensors)."""
    return type(_kernels().quant_shrink_kernel).__name__ == "InterpretedFunction"


def _check_runnable_device(device: torch.device) -> None:
    if device.type == "cuda" and not _kernels_interpreted():
        return
    if device.type == "cpu" and _kernels_interpreted():
        return
    raise ValueError(f"the Triton path runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was "
                     f"set before vllm_adapter.triton_kernels was imported; got tensors on {device}")


def _check_activation(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [tokens, hidden] tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"x's last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")


def _check_weight(w_q: torch.Tensor, w_scale: torch.Tensor, K: int, device) -> int:
    if w_q.dtype != FP8_DTYPE:
        raise TypeError(f"w_q must be float8_e4m3fn, got {w_q.dtype}")
    if w_q.dim() != 2 or w_q.shape[1] != K:
        raise ValueError(f"w_q must be [N, K={K}] (vLLM layout), got shape {tuple(w_q.shape)}")
    if not w_q.is_contiguous():
        raise ValueError(f"w_q must be contiguous, got strides {tuple(w_q.stride())}")
    if w_scale.dtype != torch.float32 or w_scale.numel() != 1:
        raise TypeError(f"w_scale must be a one-element float32 tensor (per-tensor scale), got "
                        f"{w_scale.dtype} with {w_scale.numel()} elements")
    _check_device("w_q", w_q, device)
    _check_device("w_scale", w_scale, device)
    return w_q.shape[0]


def _squeeze_vllm(name: str, buf: torch.Tensor) -> torch.Tensor:
    """[L, 1, rows, cols] (vLLM) or [L, rows, cols] -> [L, rows, cols] view."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(buf)}")
    if buf.dim() == 4 and buf.shape[1] == 1:
        buf = buf[:, 0]
    if buf.dim() != 3:
        raise ValueError(f"{name} must be [max_loras, 1, rows, cols] (vLLM) or [max_loras, rows, cols], "
                         f"got shape {tuple(buf.shape)}")
    if buf.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(buf.stride())}")
    if buf.data_ptr() % 16:  # the kernels load slices through a pointer table marked 16-byte aligned
        raise ValueError(f"{name} must start at a 16-byte aligned address, got {buf.data_ptr():#x}")
    return buf


def _check_lora_a(lora_a_slices, K: int, device) -> tuple[list[torch.Tensor], int, int]:
    a = [_squeeze_vllm(f"lora_a_slices[{i}]", t) for i, t in enumerate(_as_slices(lora_a_slices))]
    if not a:
        raise ValueError("lora_a_slices is empty: give one A buffer per output slice")
    L, R, _ = a[0].shape
    for i, t in enumerate(a):
        _check_device(f"lora_a_slices[{i}]", t, device)
        if t.shape[2] != K:
            raise ValueError(f"lora_a_slices[{i}] has K={t.shape[2]}, x has K={K}")
        if t.shape[0] != L:
            raise ValueError(f"lora_a_slices[{i}] holds {t.shape[0]} adapter slots, slice 0 holds {L}")
        if t.shape[1] != R:
            raise ValueError(f"rank mismatch: lora_a_slices[{i}] has rank {t.shape[1]}, slice 0 has {R}")
    if not 1 <= R <= MAX_RANK:
        raise ValueError(f"LoRA rank must be in [1, {MAX_RANK}], got {R}")
    return a, L, R


def _check_lora_b(lora_b_slices, num_slices: int, L: int, R: int, N: Optional[int], device) -> list[torch.Tensor]:
    b = [_squeeze_vllm(f"lora_b_slices[{i}]", t) for i, t in enumerate(_as_slices(lora_b_slices))]
    if len(b) != num_slices:
        raise ValueError(f"{len(b)} B buffers for {num_slices} A buffers: give one of each per output slice")
    for i, t in enumerate(b):
        _check_device(f"lora_b_slices[{i}]", t, device)
        if t.shape[0] != L:
            raise ValueError(f"lora_b_slices[{i}] holds {t.shape[0]} adapter slots, lora_a_slices hold {L}")
        if t.shape[2] != R:
            raise ValueError(f"rank mismatch: lora_b_slices[{i}] has rank {t.shape[2]}, lora_a_slices have {R}")
    widths = [t.shape[1] for t in b]
    if N is not None and sum(widths) != N:
        raise ValueError(f"slice widths {widths} add up to {sum(widths)}, but w_q has N={N} rows")
    return b


_META_FIELDS = ("token_indices_sorted_by_lora_ids", "sorted_lora_ids", "row_group", "active_lora_ids")


def _check_meta(meta, M: int, L: int, device) -> None:
    missing = [f for f in _META_FIELDS if not hasattr(meta, f)]
    if missing:
        raise TypeError(f"meta lacks {missing}: build it with epilora_cute.metadata.build_meta / LoRABatchMeta")
    if getattr(meta, "num_tokens", M) != M:
        raise ValueError(f"meta describes {meta.num_tokens} tokens, x has {M}")
    if getattr(meta, "max_loras", L) > L:
        raise ValueError(f"slot ids out of range: meta allows slots < {meta.max_loras}, adapter buffers hold {L}")
    for f in _META_FIELDS:
        t = getattr(meta, f)
        _check_device(f"meta.{f}", t, device)
        if t.dtype != torch.int32:
            raise TypeError(f"meta.{f} must be int32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"meta.{f} must be contiguous")
    if meta.token_indices_sorted_by_lora_ids.numel() < M:
        raise ValueError(f"meta holds {meta.token_indices_sorted_by_lora_ids.numel()} rows, x has {M} tokens")


def _check_slot_ranks(slot_ranks: Optional[torch.Tensor], L: int, device) -> None:
    if slot_ranks is None:
        return
    if slot_ranks.dtype != torch.int32:
        raise TypeError(f"slot_ranks must be int32, got {slot_ranks.dtype}")
    if slot_ranks.dim() != 1 or slot_ranks.numel() < L or not slot_ranks.is_contiguous():
        raise ValueError(f"slot_ranks must be a contiguous int32 [max_loras={L}] tensor, got shape "
                         f"{tuple(slot_ranks.shape)}")
    _check_device("slot_ranks", slot_ranks, device)


def validate_token_lora_mapping(token_lora_mapping: torch.Tensor, max_loras: int) -> None:
    """Raise on slot ids outside [-1, max_loras). Reads the mapping on the host (synchronizes).

    Call it before ``build_meta``: ``LoRABatchMeta.prepare`` maps such ids to -1 silently.
    """
    m = token_lora_mapping
    if m.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_lora_mapping must be int32 or int64, got {m.dtype}")
    bad = ((m < -1) | (m >= max_loras)).nonzero().flatten()
    if bad.numel():
        idx = bad[:8].tolist()
        raise ValueError(f"slot ids out of range [-1, {max_loras}) at tokens {idx}: {m[bad[:8]].tolist()}")


def _check_out(name: str, out: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {tuple(out.stride())}")
    if name != "out" and not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    _check_device(name, out, device)


# ----------------------------------------------------------------------------- cached device tables
#
# A launch reads small device tables: the adapter slices' base addresses (one per A and B buffer
# set), K2's column tiles (per slice widths and block_n) and K1's split-K arrival counters. A
# CUDA graph bakes their addresses in, so a table a graph may read must
#
# * exist, filled, before the capture: a capture records fills and copies, it does not run them
#   (a table made inside one holds its values only while that graph replays, and a pageable
#   host -> device copy is refused there: the first GPU e2e run failed on exactly that), and
# * live as long as the graph.
#
# Hence: ``prepare_tables(lora_a, lora_b)`` builds everything a layer can need at any token
# count (both pointer tables, the column tiles for every block_n in COL_BLOCK_NS, the counters)
# and keeps it for good; the plugin calls it when vLLM has created the layer's adapter buffers.
# A table first used while the stream captures is kept for good from then on (``_GRAPH_TABLES``);
# only tables never seen by a capture are evicted (``_TABLE_CACHE``, LRU: vLLM's Qwen3-8B alone
# has 288 pointer tables, and cycling through more tables than an LRU holds misses every time).
# A table still missing during a capture (a caller that skipped prepare_tables, a block_n outside
# COL_BLOCK_NS) is made for that graph alone, by device fills that the graph re-runs at every
# replay before its kernels, kept alive with the graph and never cached (warned once).

_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE = 4096
_GRAPH_TABLES: dict = {}  # tables a captured graph may read: never evicted, never replaced
_CAPTURE_ONLY: list = []  # tables and counters made inside a capture, alive as long as their graphs
_COUNTERS: dict = {}  # device -> the shared split-K arrival counters
_RETIRED_COUNTERS: list = []  # counters replaced by larger ones (a captured graph may still use them)
_WARNED: set = set()
# K2 column tiles are built ahead for every power-of-two block_n up to 256 (pick_config uses 16-256).
COL_BLOCK_NS = (16, 32, 64, 128, 256)
_MIN_COUNTERS = 1024


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (tests replace this to model one on
    the CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _warn_capture_miss(what: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        import logging

        logging.getLogger("vllm.epilora").warning(
            "EpiLoRA Triton path: %s was not prepared before this CUDA-graph capture; made for this "
            "graph only (re-filled at every replay). Call vllm_adapter.triton_path.prepare_tables() "
            "for the layer's adapter buffers before capturing.", what)


def _table(key: tuple, make) -> torch.Tensor:
    """The cached table for ``key``; ``make()`` builds it with device ops only (no host copy)."""
    t = _GRAPH_TABLES.get(key)
    if t is not None:
        return t
    capturing = _capturing()
    t = _TABLE_CACHE.pop(key, None)
    if t is not None:
        if capturing:  # a graph reads it from now on: it must outlive the graph
            _GRAPH_TABLES[key] = t
        else:
            _TABLE_CACHE[key] = t  # most recently used
        return t
    t = make()
    if capturing:
        _warn_capture_miss(f"a {key[0]} table")
        _CAPTURE_ONLY.append(t)
        return t
    _TABLE_CACHE[key] = t
    while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return t


def _make_pointer_table(ptrs: Sequence[int], device) -> torch.Tensor:
    t = torch.empty(len(ptrs), dtype=torch.int64, device=device)
    for i, p in enumerate(ptrs):  # one fill per slice (<= 4): device ops, capturable
        t[i].fill_(p)
    return t


def _pointer_key(bufs: Sequence[torch.Tensor], device) -> tuple:
    # Keyed by address and shape (as vLLM caches its own): the contents are the addresses, so a
    # table stays right for any buffer that later occupies the same addresses.
    return ("pointer", str(device)) + tuple((b.data_ptr(), tuple(b.shape)) for b in bufs)


def _pointer_table(bufs: Sequence[torch.Tensor], device) -> torch.Tensor:
    """int64 [S] of the slices' base addresses."""
    return _table(_pointer_key(bufs, device), lambda: _make_pointer_table([b.data_ptr() for b in bufs], device))


def _col_tile_rows(widths: Sequence[int], block_n: int) -> list[tuple[int, int, int, int]]:
    """(slice, first column in slice, slice's first column in y, slice width) per K2 column tile."""
    rows, col0 = [], 0
    for s, n in enumerate(widths):
        rows += [(s, t * block_n, col0, n) for t in range(-(-n // block_n))]
        col0 += n
    return rows


def _make_col_tile_table(widths: Sequence[int], block_n: int, device) -> torch.Tensor:
    t = torch.empty((sum(-(-n // block_n) for n in widths), 4), dtype=torch.int32, device=device)
    r0, col0 = 0, 0
    for s, n in enumerate(widths):  # four small device ops per slice, capturable
        tiles = -(-n // block_n)
        seg = t[r0:r0 + tiles]
        seg[:, 0].fill_(s)
        seg[:, 1].copy_(torch.arange(0, tiles * block_n, block_n, dtype=torch.int32, device=device))
        seg[:, 2].fill_(col0)
        seg[:, 3].fill_(n)
        r0, col0 = r0 + tiles, col0 + n
    return t


def _col_key(widths: Sequence[int], block_n: int, device) -> tuple:
    return ("column-tile", str(device), tuple(int(n) for n in widths), int(block_n))


def _col_tile_table(widths: Sequence[int], block_n: int, device) -> torch.Tensor:
    """int32 [T, 4]: ``_col_tile_rows`` on the device."""
    return _table(_col_key(widths, block_n, device), lambda: _make_col_tile_table(widths, block_n, device))


def _counters_wanted(device) -> int:
    # pick_config splits K only while a launch has fewer than 4 programs per SM, so its launches
    # need fewer than 4 * SMs counters.
    return max(_MIN_COUNTERS, 4 * _num_sms(torch.device(device)))


def _split_k_counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, at least n; K1 leaves them zero after every launch."""
    key = str(device)
    t = _COUNTERS.get(key)
    if t is not None and t.numel() >= n:
        return t
    if _capturing():  # this graph's own, zeroed by a memset node at every replay
        _warn_capture_miss(f"{n} split-K counters")
        t = torch.zeros(max(n, 1), dtype=torch.int32, device=device)
        _CAPTURE_ONLY.append(t)
        return t
    if t is not None:
        _RETIRED_COUNTERS.append(t)  # graphs captured with it keep reading it
    t = torch.zeros(max(n, _counters_wanted(device), 2 * (0 if t is None else t.numel())),
                    dtype=torch.int32, device=device)
    _COUNTERS[key] = t
    return t


def prepare_tables(lora_a_slices, lora_b_slices) -> None:
    """Build every device table a layer with these adapter buffers can read, for any token count,
    and keep them for as long as the process: call it before capturing CUDA graphs that run the
    layer (the vLLM plugin does, when vLLM has created the layer's buffers). Buffers in vLLM's
    layout ([L, 1, rows, cols]) or 3-D, as ``triton_lora_linear`` takes them."""
    if _capturing():
        raise RuntimeError("prepare_tables builds device tables: call it outside CUDA-graph capture")
    a = [_squeeze_vllm(f"lora_a_slices[{i}]", t) for i, t in enumerate(_as_slices(lora_a_slices))]
    b = [_squeeze_vllm(f"lora_b_slices[{i}]", t) for i, t in enumerate(_as_slices(lora_b_slices))]
    if not a or not b:
        raise ValueError("prepare_tables needs the A and the B buffers")
    device = a[0].device
    for bufs in (a, b):
        key = _pointer_key(bufs, device)
        if key not in _GRAPH_TABLES:
            _GRAPH_TABLES[key] = _TABLE_CACHE.pop(key, None)
            if _GRAPH_TABLES[key] is None:
                _GRAPH_TABLES[key] = _make_pointer_table([t.data_ptr() for t in bufs], device)
    widths = [t.shape[1] for t in b]
    for block_n in COL_BLOCK_NS:
        key = _col_key(widths, block_n, device)
        if key not in _GRAPH_TABLES:
            _GRAPH_TABLES[key] = _TABLE_CACHE.pop(key, None)
            if _GRAPH_TABLES[key] is None:
                _GRAPH_TABLES[key] = _make_col_tile_table(widths, block_n, device)
    _split_k_counters(device, _counters_wanted(device))


# ----------------------------------------------------------------------------- launches

def _kernels():
    # Imported late so that TRITON_INTERPRET, read when the kernels are decorated, can be set first.
    from vllm_adapter import triton_kernels
    return triton_kernels


def _quant_tile(K: int, cfg: TritonLoraConfig, splits: int) -> tuple[int, int]:
    """(rows, columns) of K1's quantizer tile. The row tile's k1_block_m rows are shared by its
    `splits` quantizer programs; columns make ~8K elements a tile (its loops are latency bound)."""
    rows = _pow2_at_least(-(-cfg.k1_block_m // splits), lo=1)
    return rows, max(16, min(8192 // rows, _pow2_at_least(K)))


def _k1_split(K: int, cfg: TritonLoraConfig) -> tuple[int, int]:
    """(splits, columns per split): chunks are whole k1_block_k tiles and none is empty."""
    per_split = -(-K // cfg.k1_split_k)
    per_split = max(cfg.k1_block_k, -(-per_split // cfg.k1_block_k) * cfg.k1_block_k)
    return max(1, -(-K // per_split)), per_split


def triton_quant_shrink(x: torch.Tensor, lora_a_slices, meta, *, quantize: bool = True,
                        slot_ranks: Optional[torch.Tensor] = None, config: Optional[TritonLoraConfig] = None,
                        codes_out: Optional[torch.Tensor] = None, scales_out: Optional[torch.Tensor] = None,
                        h_out: Optional[torch.Tensor] = None):
    """K1 alone. Returns ``(codes [M, K] fp8 | None, scales [M, 1] fp32 | None, h [S, M, R] fp32)``."""
    _check_activation(x)
    device = x.device
    _check_runnable_device(device)
    M, K = x.shape
    a, L, R = _check_lora_a(lora_a_slices, K, device)
    _check_meta(meta, M, L, device)
    _check_slot_ranks(slot_ranks, L, device)
    cfg = config or pick_config(M, K, R, len(a), device)
    _check_config(cfg)
    return _launch_k1(x, a, R, meta, quantize, slot_ranks, cfg, codes_out, scales_out, h_out)


def _launch_k1(x, a, R, meta, quantize, slot_ranks, cfg, codes_out=None, scales_out=None, h_out=None):
    device = x.device
    M, K = x.shape
    S = len(a)
    _check_out("codes_out", codes_out, (M, K), FP8_DTYPE, device)
    _check_out("scales_out", scales_out, (M, 1), torch.float32, device)
    _check_out("h_out", h_out, (S, M, R), torch.float32, device)
    codes = scales = None
    if quantize:
        codes = codes_out if codes_out is not None else torch.empty((M, K), dtype=FP8_DTYPE, device=device)
        scales = scales_out if scales_out is not None else torch.empty((M, 1), dtype=torch.float32, device=device)
    h = h_out if h_out is not None else torch.empty((S, M, R), dtype=torch.float32, device=device)
    if M == 0:
        return codes, scales, h
    splits, per_split = _k1_split(K, cfg)
    rank_blocks = -(-R // cfg.k1_block_r)
    row_tiles = -(-M // cfg.k1_block_m)
    if splits > 1:
        ws = torch.empty((splits, S, M, R), dtype=torch.float32, device=device)
        counters = _split_k_counters(device, row_tiles * S * rank_blocks)
    else:
        ws, counters = h, meta.active_lora_ids  # unused
    quant_rows, quant_block_k = _quant_tile(K, cfg, splits)
    grid = (S * rank_blocks + (1 if quantize else 0), splits, row_tiles)
    _kernels().quant_shrink_kernel[grid](
        x, x.stride(0),
        codes.view(torch.uint8) if quantize else h, scales if quantize else h,
        _pointer_table(a, device), a[0].stride(0), a[0].stride(1),
        h, ws, counters,
        meta.token_indices_sorted_by_lora_ids, meta.sorted_lora_ids, meta.row_group, meta.active_lora_ids,
        slot_ranks if slot_ranks is not None else meta.active_lora_ids,
        M, K, R, per_split,
        NUM_SLICES=S, NUM_RANK_BLOCKS=rank_blocks, SPLIT_K=splits, QUANTIZE=quantize,
        HAS_SLOT_RANKS=slot_ranks is not None,
        BLOCK_M=cfg.k1_block_m, BLOCK_K=cfg.k1_block_k, BLOCK_R=cfg.k1_block_r,
        QUANT_ROWS=quant_rows, QUANT_BLOCK_K=quant_block_k, BF16_DOT_VIA_FP32=_kernels_interpreted(),
        num_warps=cfg.k1_num_warps)
    return codes, scales, h


def _launch_k2(act, scales, w_q, w_scale, h, b, R, meta, w8a16, slot_ranks, cfg, y):
    device = act.device
    M, K = act.shape
    widths = [t.shape[1] for t in b]
    col_tiles = _col_tile_table(widths, cfg.k2_block_n, device)
    num_col_tiles = col_tiles.shape[0]
    grid = (-(-M // cfg.k2_block_m) * num_col_tiles,)
    _kernels().gemm_lora_kernel[grid](
        act if w8a16 else act.view(torch.uint8), act.stride(0), scales if not w8a16 else w_scale,
        w_q.view(torch.uint8), w_scale,
        y, y.stride(0), h, _pointer_table(b, device), col_tiles,
        meta.token_indices_sorted_by_lora_ids, meta.sorted_lora_ids, meta.row_group, meta.active_lora_ids,
        slot_ranks if slot_ranks is not None else meta.active_lora_ids,
        M, K, R, num_col_tiles,
        W8A16=w8a16, HAS_SLOT_RANKS=slot_ranks is not None,
        BLOCK_M=cfg.k2_block_m, BLOCK_N=cfg.k2_block_n, BLOCK_K=cfg.k2_block_k, BLOCK_R=cfg.k2_block_r,
        GROUP_M=cfg.k2_group_m, BF16_DOT_VIA_FP32=_kernels_interpreted(),
        num_warps=cfg.k2_num_warps, num_stages=cfg.k2_num_stages)
    return y


def triton_gemm_lora(act: torch.Tensor, scales: Optional[torch.Tensor], w_q: torch.Tensor, w_scale: torch.Tensor,
                     h: torch.Tensor, lora_b_slices, meta, *, w8a16: bool = False,
                     slot_ranks: Optional[torch.Tensor] = None, config: Optional[TritonLoraConfig] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """K2 alone: y = act * scales @ (W * s_w)^T + expand(h). ``act`` is FP8 codes (scales [M, 1])
    or, with ``w8a16``, bf16 x (scales ignored). ``h`` is [S, M, R] fp32 as K1 writes it."""
    device = act.device
    _check_runnable_device(device)
    M, K = act.shape
    if w8a16:
        _check_activation(act)
    else:
        if act.dtype != FP8_DTYPE or not act.is_contiguous():
            raise TypeError(f"act must be contiguous float8_e4m3fn codes, got {act.dtype}")
        if scales is None or scales.dtype != torch.float32 or scales.numel() != M or not scales.is_contiguous():
            raise ValueError(f"scales must be contiguous float32 [M={M}, 1]")
    N = _check_weight(w_q, w_scale, K, device)
    if h.dim() != 3 or h.dtype != torch.float32 or not h.is_contiguous() or h.shape[1] != M:
        raise ValueError(f"h must be contiguous float32 [S, M={M}, R], got {h.dtype} {tuple(h.shape)}")
    S, _, R = h.shape
    b_raw = _as_slices(lora_b_slices)
    L = _squeeze_vllm("lora_b_slices[0]", b_raw[0]).shape[0] if b_raw else 0
    b = _check_lora_b(b_raw, S, L, R, N, device)
    _check_meta(meta, M, L, device)
    _check_slot_ranks(slot_ranks, L, device)
    _check_out("out", out, (M, N), torch.bfloat16, device)
    cfg = config or pick_config(M, K, R, S, device, w8a16=w8a16, N=N)
    _check_config(cfg)
    y = out if out is not None else torch.empty((M, N), dtype=torch.bfloat16, device=device)
    if M == 0:
        return y
    return _launch_k2(act, scales, w_q, w_scale, h, b, R, meta, w8a16, slot_ranks, cfg, y)


def triton_lora_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, lora_a_slices, lora_b_slices,
                       meta, *, w8a16: bool = False, out: Optional[torch.Tensor] = None,
                       slot_ranks: Optional[torch.Tensor] = None,
                       config: Optional[TritonLoraConfig] = None) -> torch.Tensor:
    """Multi-adapter LoRA linear over FP8 weights in two launches; ``reference.lora_linear`` semantics.

    * ``x`` [M, K] bf16 (last dim contiguous); ``w_q`` [N, K] float8_e4m3fn; ``w_scale`` [1] fp32.
    * ``lora_a_slices`` / ``lora_b_slices``: one buffer per output slice in vLLM's layout,
      A [L, 1, R, K], B [L, 1, n_s, R] bf16 (alpha/r folded into B); sum(n_s) = N.
    * ``meta``: ``LoRABatchMeta`` for this batch (``num_tokens == M``).
    * ``w8a16``: bf16 activations against FP8 weights (``quantize_activations=False``).
    * ``slot_ranks``: optional int32 [L] effective rank per slot; rank columns at or beyond it are
      neither read nor computed (the buffers must be zero-padded there for the reference to agree).
    * ``out``: optional bf16 [M, N] (last dim contiguous), written once, in token order.
    """
    _check_activation(x)
    device = x.device
    _check_runnable_device(device)
    M, K = x.shape
    N = _check_weight(w_q, w_scale, K, device)
    a, L, R = _check_lora_a(lora_a_slices, K, device)
    b = _check_lora_b(lora_b_slices, len(a), L, R, N, device)
    _check_meta(meta, M, L, device)
    _check_slot_ranks(slot_ranks, L, device)
    _check_out("out", out, (M, N), torch.bfloat16, device)
    cfg = config or pick_config(M, K, R, len(a), device, w8a16=w8a16, N=N)
    _check_config(cfg)
    y = out if out is not None else torch.empty((M, N), dtype=torch.bfloat16, device=device)
    if M == 0:
        return y
    codes, scales, h = _launch_k1(x, a, R, meta, not w8a16, slot_ranks, cfg)
    act = x if w8a16 else codes
    return _launch_k2(act, scales, w_q, w_scale, h, b, R, meta, w8a16, slot_ranks, cfg, y)


__all__ = [
    "ENV_FORCE_TRITON", "TritonLoraConfig", "pick_config", "prepare_tables", "triton_gemm_lora",
    "triton_lora_linear", "triton_path_applies", "triton_path_forced", "triton_quant_shrink",
    "validate_token_lora_mapping",
]
