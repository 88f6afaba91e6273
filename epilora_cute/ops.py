"""Public ops: validate, pick the kernel (or the reference as a clean fallback), launch.

Every op here computes exactly what ``reference.py`` defines; a fallback to the reference is
taken only where the result is identical (the quantization) or explicitly requested.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import NamedTuple

import torch

from . import eager_memo, reference
from .arch import SIMPLE_KERNEL_TARGETS, arch_of
from .compile_cache import KernelUnavailable
from .identity_memo import IdentityMemo
from .kernels import get_kernel

log = logging.getLogger("epilora_cute")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def _check_2d(name: str, t, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda  # (one place, so that tools/host_cpu.py can time the ops' host code on a CPU)


def _quant_kernel_reason(x: torch.Tensor) -> str | None:
    """Why the CuTe quantization kernel can't take x (None: it can)."""
    from kernels_dsl import fp8_quant

    arch = arch_of(x)
    if arch not in SIMPLE_KERNEL_TARGETS:
        return f"no CuTe quantization kernel for {arch or 'this device'}"
    k = x.shape[1]
    if k % fp8_quant.ELEMS_PER_VECTOR or x.stride(1) != 1 or x.stride(0) % fp8_quant.ELEMS_PER_VECTOR:
        return "rows must be contiguous with a length and stride that are multiples of 8"
    if x.data_ptr() % 16:
        return "x must be 16-byte aligned"
    if k > fp8_quant.MAX_K:
        return f"rows longer than {fp8_quant.MAX_K}"
    return None


def quantize_fp8_per_token(x: torch.Tensor, codes: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                           *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token FP8 quantization: (codes [M, K] e4m3, scales [M, 1] fp32).

    Bit-identical to ``reference.quantize_fp8_per_token`` (and to vLLM's ``scaled_fp8_quant``
    with ``use_per_token_if_dynamic=True``). ``codes``/``scales`` may be given to write in place.
    ``pdl``: launch the kernel with PDL (programmatic stream serialization). Always safe: it
    executes griddepcontrol.wait before it reads or writes anything; only its launch and setup
    overlap the previous kernel.
    """
    _check_2d("x", x, torch.bfloat16)
    m, k = x.shape
    if codes is None:
        codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _check_2d("codes", codes, torch.float8_e4m3fn)
    _check_2d("scales", scales, torch.float32)
    if tuple(codes.shape) != (m, k) or tuple(scales.shape) != (m, 1):
        raise ValueError(f"codes must be [{m}, {k}] and scales [{m}, 1]; got {tuple(codes.shape)}, {tuple(scales.shape)}")
    if codes.device != x.device or scales.device != x.device:
        raise ValueError("x, codes and scales must be on one device")
    if m == 0:
        return codes, scales
    reason = _quant_kernel_reason(x) if _on_gpu(x) else "x is on the CPU"
    if reason is None and (codes.stride(1) != 1 or codes.stride(0) % 8 or codes.data_ptr() % 16
                           or scales.stride(0) != 1):
        reason = "codes must be row-contiguous (stride multiple of 8, 16-byte aligned) and scales contiguous"
    if reason is not None:
        return _reference_quant_into(x, codes, scales, reason if _on_gpu(x) else None)
    from kernels_dsl import fp8_quant

    cfg = fp8_quant.config_for(k)
    try:
        kernel = get_kernel(fp8_quant, cfg, arch_of(x))
    except KernelUnavailable as e:  # no cached build and no DSL to make one: same result, slower
        return _reference_quant_into(x, codes, scales, str(e))
    kernel(x, codes, scales, grid=(m, 1, 1), smem=cfg.smem_bytes, pdl=pdl)
    return codes, scales


def _reference_quant_into(x, codes, scales, warn_reason: str | None):
    """The bit-identical torch fallback, written into the caller's buffers (warned once)."""
    if warn_reason is not None:
        _warn_once(warn_reason, f"quantize_fp8_per_token: using the torch reference ({warn_reason})")
    c, s = reference.quantize_fp8_per_token(x)
    codes.copy_(c)
    scales.copy_(s)
    return codes, scales


# ---------------------------------------------------------------------------------------------
# The fused LoRA linear: y = quant(x) @ W_q^T * s_x * s_w + per-token adapter update.

# The decode pair (shrink + K2) and the no-adapter K2: one token tile up to 32 tokens, two (the
# token-tile builds, the second reading the weights from L2) at 33..64 (k2_gemm.WIDE_MAX_TOKENS).
DECODE_MAX_TOKENS = 64
PATHS = ("auto", "base", "decode", "decode_sq", "decode_fh", "no_adapter", "hybrid", "hybrid_par", "hybrid_par_q",
         "hybrid_st", "hybrid_par_st", "hybrid_g", "hybrid_par_g", "prefill", "triton", "reference")
# The hybrid paths whose down-projection is the streamed shrink (v0.88) instead of K1.
STREAM_PATHS = ("hybrid_st", "hybrid_par_st")
# The hybrid paths whose down-projection is the shrink by adapter group (v0.90) instead of K1.
GROUPED_PATHS = ("hybrid_g", "hybrid_par_g")
# path -> (its shrink, on a second stream beside the quantization + GEMM)
SIDE_SHRINK_PATHS = {"hybrid_st": ("stream", False), "hybrid_par_st": ("stream", True),
                     "hybrid_g": ("grouped", False), "hybrid_par_g": ("grouped", True)}
# The decode and no-adapter paths' variable for "auto" (dispatch.OPT_IN_ENV): "0" keeps them out of
# the candidates, "1" lets them in if they ever leave dispatch.VERIFIED_PATHS.
DECODE_PATH_ENV = "EPILORA_DECODE_PATH"


def supports_device(device: torch.device) -> bool:
    """Whether lora_linear_fp8 has a GPU path for this device (the Triton path: sm_89 and newer)."""
    device = torch.device(device)
    return device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= (8, 9)


def lora_linear_fp8_unsupported(n: int, k: int, rank: int, num_slices: int) -> str | None:
    """Why no GPU path can take a layer of these shapes (None: one can); asked once per layer."""
    from vllm_adapter.triton_path import MAX_RANK

    if not 1 <= rank <= MAX_RANK:
        return f"rank {rank} outside 1..{MAX_RANK}"
    if k % 8:
        return f"K={k} is not a multiple of 8 (16-byte rows)"
    if num_slices < 1 or n < num_slices:
        return f"{num_slices} output slices for N={n}"
    return None


class _Persistent:
    """Small device tensors that must keep their address (CUDA graphs) or their state.

    A tensor made while the current stream captures a CUDA graph holds nothing until that graph
    replays (its fill is recorded, not run), so it is never cached: a missing key under capture
    gets its `shared` stand-in made outside capture when there is one, else a tensor private to
    the graph being captured (refilled at each of its replays), with a warning. Creators must
    therefore be capturable (device fills only, no host-to-device copies)."""

    def __init__(self):
        self._d: dict[tuple, torch.Tensor] = {}
        self._warned: set[tuple] = set()
        # Tensors made so far (not counting shared stand-ins): a call that made one has just
        # launched its fill, so it must not chain a kernel that reads the tensor before
        # griddepcontrol.wait (_decode_path).
        self.made = 0

    def get(self, key: tuple, make, shared: tuple | None = None) -> torch.Tensor:
        t = self._d.get(key)
        if t is not None:
            return t
        if not _capturing():
            self.made += 1
            t = self._d[key] = make()
            if shared is not None:
                self._d.setdefault(shared, t)
            return t
        if shared is not None and shared in self._d:
            return self._d[shared]
        if key not in self._warned:
            self._warned.add(key)
            log.warning("epilora: %s first needed inside a CUDA-graph capture: the graph gets its own copy "
                        "(run the op once outside capture to share one)", key[0])
        self.made += 1
        return make()


_persistent = _Persistent()


def _capturing() -> bool:
    # torch's CPU-only builds have no capture query at all (it raises): nothing captures there.
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


def _sync_buffer(device: torch.device, protocol: str = "sync") -> torch.Tensor:
    # Two int32 counters a kernel pair or grid counts up and re-arms itself: "sync", the shrink's
    # quantization CTAs and K2's producer (K2 re-arms); "fused_sync", decode_fh's K2 (its producing
    # CTAs' published partials of h, then the clusters done; the last cluster re-arms). One per
    # (protocol, device, stream), zeroed once: launches on one stream never overlap on it, and the
    # two protocols never share one. A graph captured on a stream that never ran the op eagerly
    # shares the device's first buffer (graphs and eager calls of one engine do not run at the same
    # time: vLLM captures on a side stream).
    stream = torch.cuda.current_stream(device).cuda_stream
    return _persistent.get((protocol, device.index, stream), lambda: torch.zeros(2, dtype=torch.int32, device=device),
                           shared=(protocol, device.index))


def _xgate_buffer(device: torch.device) -> torch.Tensor:
    # The x gate's counters (v1.03, k2_gemm.Config.xgate): int32 [4], two halves of [2] that the
    # x-gated pairs on one stream take in turn (_xgate_half). An xgate K2 is launched under the
    # kernel before its shrink and spins on its half while the previous xgate K2 (the only other
    # one that can be in flight: k2_gemm's module docstring) may still count on and re-arm its own.
    stream = torch.cuda.current_stream(device).cuda_stream
    return _persistent.get(("xgate", device.index, stream), lambda: torch.zeros(4, dtype=torch.int32, device=device),
                           shared=("xgate", device.index))


_xgate_turns: dict[int, int] = {}  # an xgate buffer's address -> the half its next call takes


def _xgate_half(buf: torch.Tensor) -> torch.Tensor:
    """The half of an xgate buffer this call takes: the other one than the last call's (a graph
    records the halves its calls took; graphs and eager calls on one stream never overlap)."""
    turn = _xgate_turns.get(buf.data_ptr(), 0)
    _xgate_turns[buf.data_ptr()] = turn ^ 1
    return buf[2 * turn:2 * turn + 2]


def _slice_start(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    def make():
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        t = torch.empty(len(starts), dtype=torch.int32, device=device)
        for i, v in enumerate(starts):  # device fills: capturable, unlike a host-to-device copy
            t[i:i + 1].fill_(v)
        return t
    return _persistent.get(("slice_start", device.index, widths), make)


def _full_ranks(max_loras: int, rank: int, device: torch.device) -> torch.Tensor:
    return _persistent.get(("ranks", device.index, max_loras, rank),
                           lambda: torch.full((max_loras,), rank, dtype=torch.int32, device=device))


def _slices(bufs) -> list:
    return list(bufs) if isinstance(bufs, (list, tuple)) else [bufs]


def _check_slices(name: str, bufs) -> None:
    for i, b in enumerate(bufs):
        if not isinstance(b, torch.Tensor) or b.dim() not in (3, 4) or (b.dim() == 4 and b.shape[1] != 1):
            raise ValueError(f"{name}[{i}] must be [max_loras, 1, rows, cols] (vLLM's layout) or 3-D")
        if b.dtype != torch.bfloat16:
            raise TypeError(f"{name}[{i}] must be bfloat16, got {b.dtype}")


class _LayerFacts(NamedTuple):
    """What a call needs to know of a layer's weight and adapter buffers (plain values only: see
    identity_memo)."""
    k: int
    n: int
    widths: tuple[int, ...]
    rank: int
    max_loras: int
    device: torch.device


_layer_facts_memo = IdentityMemo()
_layout_memo = IdentityMemo()


def _layer_key(w_q, w_scale, a, b) -> tuple:
    """IdentityMemo's (objects, extra) for a layer's buffers. The weight and its scale come as
    tensors made anew on every call — vLLM's layer passes ``weight.t()``, and in a compiled graph
    Inductor hands the op a new tensor on the weight's storage for it, without a ``_base``, on
    every call (tests/test_ops.py::test_layer_key_survives_inductors_fresh_weight_tensors) — so
    those two are keyed by plain values: address, shape, strides, dtype, device (what every fact
    drawn from them depends on, as the TMA descriptors' cache in launcher.py); the adapter slices
    are vLLM's own buffers, by identity."""
    extra = tuple(_plain_key(t) for t in (w_q, w_scale) if isinstance(t, torch.Tensor))
    return (*a, *b), extra


def _plain_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


def _layer_facts(w_q, w_scale, a, b) -> _LayerFacts:
    """Validate the layer's buffers (raises on bad input) and derive their facts."""
    _check_2d("w_q", w_q, torch.float8_e4m3fn)
    if not isinstance(w_scale, torch.Tensor) or w_scale.numel() != 1 or w_scale.dtype != torch.float32:
        raise TypeError("w_scale must be a one-element float32 tensor (per-tensor weight scale)")
    _check_slices("lora_a", a)
    _check_slices("lora_b", b)
    n, k = w_q.shape
    if len(a) != len(b):
        raise ValueError(f"{len(a)} A slices but {len(b)} B slices")
    widths = tuple(int(t.shape[-2]) for t in b)
    if sum(widths) != n:
        raise ValueError(f"B slice widths {widths} add up to {sum(widths)}, not the weight's {n} rows")
    ranks = {int(t.shape[-2]) for t in a} | {int(t.shape[-1]) for t in b}
    if len(ranks) != 1:
        raise ValueError(f"adapter ranks disagree across A/B slices: {sorted(ranks)}")
    if any(int(t.shape[-1]) != k for t in a):
        raise ValueError("every A slice must have K columns")
    loras = {int(t.shape[0]) for t in a + b}
    if len(loras) != 1:
        raise ValueError(f"max_loras disagrees across adapter buffers: {sorted(loras)}")
    devs = {t.device for t in [w_q, w_scale, *a, *b]}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    return _LayerFacts(int(k), int(n), widths, ranks.pop(), loras.pop(), w_q.device)


def _validate_linear(x, w_q, w_scale, lora_a, lora_b, meta, out):
    """The call's checks: the layer's buffers once per set of buffers (_layer_facts, memoized by
    identity: an eager call's host time is the engine's pace outside CUDA graphs), the per-call
    tensors every time."""
    a, b = _slices(lora_a), _slices(lora_b)
    objs, extra = _layer_key(w_q, w_scale, a, b)
    f = _layer_facts_memo.get(objs, lambda: _layer_facts(w_q, w_scale, a, b), extra)
    _check_2d("x", x, torch.bfloat16)
    m, k = x.shape
    if k != f.k:
        raise ValueError(f"x has K={k} but w_q is {tuple(w_q.shape)} ([N, K] expected)")
    if meta.max_loras > f.max_loras:
        raise ValueError("the metadata allows more adapter slots than the buffers hold")
    if meta.num_tokens != m:
        raise ValueError(f"metadata prepared for {meta.num_tokens} tokens, x has {m}")
    dev = f.device
    if x.device != dev or meta.token_lora_mapping.device != dev:
        raise ValueError(f"all tensors must be on one device, got x on {x.device}, the layer on {dev}, "
                         f"the metadata on {meta.token_lora_mapping.device}")
    if out is not None:
        _check_2d("out", out, torch.bfloat16)
        if out.shape != (m, f.n):
            raise ValueError(f"out must be [{m}, {f.n}], got {tuple(out.shape)}")
        if out.device != dev:
            raise ValueError(f"all tensors must be on one device, got out on {out.device}, the layer on {dev}")
    return a, b, f.widths, f.rank


def _decode_reason(x, w_q, widths, rank, a, b) -> str | None:
    from kernels_dsl import k2_gemm

    if arch_of(x) != "sm_90a":
        return f"the decode path needs an sm_90a GPU (have {arch_of(x) or x.device})"
    m, k = x.shape
    if not 1 <= m <= DECODE_MAX_TOKENS:
        return f"{m} tokens: the decode path takes 1..{DECODE_MAX_TOKENS}"
    if rank not in k2_gemm.RANKS:
        return f"rank {rank} not in {k2_gemm.RANKS}"
    if len(widths) > 3:
        return "more than 3 output slices"
    bm = k2_gemm.bm_for(widths)
    if any(w % bm for w in widths) or k % 128:
        return "slice widths must be multiples of 64 and K a multiple of 128"
    return _buffer_layout_reason(x, w_q, a, b)


def _buffer_layout_reason(x, w_q, a, b) -> str | None:
    """The buffer layout every CuTe path needs (TMA rows, 16-byte vectors)."""
    if not x.is_contiguous():
        return "x, w_q and the adapter buffers must be contiguous"
    if x.data_ptr() % 16:
        return "buffers must be 16-byte aligned"
    objs, extra = _layer_key(w_q, None, a, b)
    return _layout_memo.get(objs, lambda: _layout_reason(w_q, a, b), extra)


def _layout_reason(w_q, a, b) -> str | None:
    if not (w_q.is_contiguous() and all(t.is_contiguous() for t in a + b)):
        return "x, w_q and the adapter buffers must be contiguous"
    if any(t.data_ptr() % 16 for t in [w_q, *a, *b]):
        return "buffers must be 16-byte aligned"
    return None


def lora_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, lora_a, lora_b, meta, *,
                    out: torch.Tensor | None = None, slot_ranks: torch.Tensor | None = None,
                    path: str = "auto", pdl: bool = True, chain_pdl: bool = False) -> torch.Tensor:
    """The multi-adapter LoRA linear on an FP8 base, as ``reference.lora_linear`` defines it.

    x [M, K] bf16; w_q [N, K] e4m3 with per-tensor w_scale [1] fp32; lora_a / lora_b one buffer
    per output slice in vLLM's layout ([max_loras, 1, rank, K] and [max_loras, 1, n_s, rank],
    alpha/r folded into B); meta a prepared ``LoRABatchMeta`` for these M tokens; slot_ranks an
    optional int32 [max_loras] of effective ranks (work beyond them is skipped). Returns y [M, N]
    bf16 (written into ``out`` when given).

    Paths: "base" (only when the host knows no token has an adapter, ``meta.host_num_adapters
    == 0``, e.g. from vLLM's no-LoRA flag: the quantization + the vendor FP8 GEMM, i.e. vLLM's own
    FP8 path, so base-model traffic gets stock vLLM's results bit for bit; any CUDA GPU), "hybrid"
    (K1 + the vendor FP8 GEMM + our expand-add; any batch size on sm_90a), "hybrid_par" (the same
    y bit for bit, with K1 on a second stream beside the quantization kernel + the GEMM;
    "hybrid_par_q": the same with the branch forked after the quantization), "hybrid_st" /
    "hybrid_par_st" (the hybrid paths with the streamed shrink in place of K1 and the quantization
    kernel's codes for the GEMM, serial / on a second stream: sm_90a, v0.88), "prefill" (33..16384
    tokens, sm_90a: K1, the activations gathered into adapter-sorted order, the prefill K2 with the
    grouped epilogue; a dispatch candidate only with EPILORA_PREFILL_PATH=1 until GPU-verified),
    "decode" (≤ 64 tokens, sm_90a: the shrink kernel, then K2 as its PDL dependent — two launches;
    ``pdl=False`` serializes them; the shrink's extra CTAs quantize x), "decode_sq" (the same at
    1..8 tokens with K2 quantizing x itself and the shrink without quantization CTAs: docs/perf.md
    v0.29; the timed dispatch picks between the two per projection), "decode_fh" (1..8 tokens,
    one launch: K2 quantizes x and computes h itself, docs/perf.md v0.43), "no_adapter" (the
    quantization kernel + K2 without the epilogue add, ≤ 64 tokens: for batches where no token has
    an adapter), "triton" (the portable two-kernel path), "reference" (torch, any device). "auto" takes the reference off
    CUDA; on a GPU the timed dispatch (``dispatch.py``) takes the fastest applicable path per
    (shape, token bucket, adapter bucket, graph/eager), measured once and remembered across starts.
    Its candidates are the applicable GPU-verified paths (``dispatch.VERIFIED_PATHS``: base,
    decode, no_adapter, hybrid, triton; without adapters only "base" unless
    EPILORA_NO_LORA_PATH=timed); EPILORA_DECODE_PATH / EPILORA_HYBRID_PATH =0 take paths out, =1 let
    unverified ones in; EPILORA_FORCE_PATH forces one.

    ``chain_pdl`` (decode and no-adapter paths; ignored with ``pdl=False``): launch the call's first kernel (the
    shrink, or the quantization kernel) with PDL too, so that its launch and prologue (and the
    shrink's first A stages) overlap the tail of the kernel before it on the stream, typically
    the previous projection's K2; it executes griddepcontrol.wait before it reads x or writes
    anything. For consecutive projections (a decoder layer). Assumption: the weights (W, A, B)
    and the batch metadata (``meta``, ``slot_ranks``) are not written by the kernel that
    immediately precedes the call on the stream (the shrink reads A and the metadata before its
    wait). A call that had to make one of its cached device tensors first runs unchained.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    memo_key = None
    if path == "auto" and eager_memo.enabled():  # a settled eager hybrid call: one lookup (v1.02)
        memo_key = eager_memo.key(x, w_q, w_scale, lora_a, lora_b, meta, slot_ranks)
        if memo_key is not None and (y := eager_memo.replay(memo_key, x, w_q, w_scale, out)) is not None:
            return y
    a, b, widths, rank = _validate_linear(x, w_q, w_scale, lora_a, lora_b, meta, out)
    m, k = x.shape
    n = w_q.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    if path == "auto":  # the timed dispatch decides (epilora_cute/dispatch.py); the reference off CUDA
        from .dispatch import auto_path
        path = auto_path(x, w_q, w_scale, a, b, meta, widths=widths, rank=rank, out=out,
                         slot_ranks=slot_ranks, pdl=pdl, chain_pdl=chain_pdl)
    if path == "reference":
        y = reference.lora_linear(x, w_q, w_scale, a, b, meta.token_lora_mapping[:m])
        return out.copy_(y)
    if path == "triton":
        from vllm_adapter.triton_path import triton_lora_linear
        return triton_lora_linear(x, w_q, w_scale, a, b, meta, out=out)
    if path == "base":
        if getattr(meta, "host_num_adapters", None) != 0:
            raise ValueError("path='base' computes the base layer only: it needs meta.host_num_adapters == 0 "
                             "(the host's knowledge that no token has an adapter)")
        if not x.is_cuda:
            raise ValueError("path='base' needs a CUDA GPU (the vendor FP8 GEMM)")
        return _base_path(x, w_q, w_scale, out)
    if path in ("hybrid", "hybrid_par", "hybrid_par_q"):
        if arch_of(x) is None:
            raise ValueError(f"path={path!r} does not apply: it needs a CUDA GPU with a CuTe target")
        # The host knows no token has an adapter (vLLM's no-LoRA flag): just the quantization and
        # the vendor GEMM, vLLM's own FP8 path (run8: K1 + expand-add over zero adapters cost
        # 15-25 µs per projection), so the dispatch weighs our no-adapter K2 against exactly what
        # stock vLLM runs.
        if getattr(meta, "host_num_adapters", None) == 0:
            return _base_path(x, w_q, w_scale, out)
        if path in ("hybrid_par", "hybrid_par_q"):
            return _hybrid_par_path(x, w_q, w_scale, a, b, meta, out, slot_ranks, quant_first=path == "hybrid_par_q")
        y = _hybrid_path(x, w_q, w_scale, a, b, meta, out, slot_ranks)
        if memo_key is not None:  # "auto" settled this eager call on the hybrid path: replay it next time
            eager_memo.remember(memo_key, x, a, b, meta, slot_ranks, widths, rank)
        return y
    if path in SIDE_SHRINK_PATHS:
        shrink, par = SIDE_SHRINK_PATHS[path]
        reason = side_shrink_reason(x, shrink, rank, len(widths))
        if reason is not None:
            raise ValueError(f"path={path!r} does not apply: {reason}")
        if getattr(meta, "host_num_adapters", None) == 0:  # as the hybrid: vLLM's own FP8 path
            return _base_path(x, w_q, w_scale, out)
        return _hybrid_side_shrink_path(x, w_q, w_scale, a, b, meta, rank, out, slot_ranks, shrink, par)
    if path == "prefill":
        reason = _prefill_reason(x, w_q, widths, rank, a, b)
        if reason is not None:
            raise ValueError(f"path='prefill' does not apply: {reason}")
        return _prefill_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks)
    reason = _decode_reason(x, w_q, widths, rank, a, b)
    if reason is not None:
        raise ValueError(f"path={path!r} does not apply: {reason}")
    chain = pdl and chain_pdl  # pdl=False serializes every launch
    if path == "no_adapter":
        return _k2_no_adapter(x, w_q, w_scale, widths, out, pdl, chain)
    self_quant = path in ("decode_sq", "decode_fh")
    if self_quant:
        from kernels_dsl import k2_gemm

        if not k2_gemm.self_quant_applies(m, k):
            raise ValueError(f"path={path!r} does not apply: {m} tokens of K = {k} (it takes 1..8 tokens, "
                             "K a multiple of 128 up to 32768)")
    if path == "decode_fh":
        return _decode_fused_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks, chain)
    return _decode_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks, pdl, chain, self_quant)


def _cutlass_into(out, x_q, w_q):
    """vLLM's out-parameter CUTLASS op when `out` can take the result as is (the conditions under
    which vLLM's own wrapper calls it), else None."""
    if out is None or out.dtype != torch.bfloat16 or not out.is_contiguous():
        return None
    if out.shape != (x_q.shape[0], w_q.shape[0]) or w_q.shape[0] % 16 or w_q.shape[1] % 16:
        return None
    op = getattr(getattr(torch.ops, "_C", None), "cutlass_scaled_mm", None)
    return op


_VLLM_OPS: list = []  # [vllm._custom_ops or None], once resolved


def _vllm_ops():
    """vLLM's op module, or None where vLLM is absent or its ops are unbuilt; imported once (a
    failing import searches sys.path again on every call: ~200 µs of host time per projection on
    the H200's host, run23)."""
    if not _VLLM_OPS:
        try:
            from vllm import _custom_ops as vops
        except Exception:  # noqa: BLE001 - vLLM absent or its ops unbuilt: use cuBLAS
            vops = None
        _VLLM_OPS.append(vops)
    return _VLLM_OPS[0]


def vendor_fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The vendor FP8 GEMM with per-token x and per-tensor W scales: vLLM's CUTLASS kernel when
    vLLM is importable, else cuBLAS through torch._scaled_mm (row-wise scales)."""
    vops = _vllm_ops()
    sx = x_scale.reshape(-1, 1)
    direct = _cutlass_into(out, x_q, w_q) if vops is not None else None
    if direct is not None:
        # Straight into `out` (the hybrid path's y): no temporary and no copy, which at 2048
        # tokens would be ~2 x 160 MB of extra traffic per Qwen3-8B layer.
        direct(out, x_q, w_q.t(), sx, w_scale.reshape(1), None)
        return out
    if vops is not None and hasattr(vops, "cutlass_scaled_mm"):
        y = vops.cutlass_scaled_mm(x_q, w_q.t(), scale_a=sx, scale_b=w_scale.reshape(1), out_dtype=torch.bfloat16)
    else:
        sw = w_scale.reshape(1, 1).expand(1, w_q.shape[0]).contiguous()
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
    if out is None:
        return y
    return out.copy_(y)


def base_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Path "base" for a caller that knows no token has an adapter and need not ask the dispatch
    (its only candidate then, under the default no-LoRA policy): vLLM's FP8 linear, y [M, N] bf16.
    The checks the GEMM needs, without the adapter buffers' (the plugin's eager no-adapter calls:
    their host time sets the pace of a prefill outside CUDA graphs, run34's TTFT)."""
    _check_2d("x", x, torch.bfloat16)
    m, k = x.shape
    if w_q.dim() != 2 or w_q.dtype != torch.float8_e4m3fn or w_q.shape[1] != k:
        raise ValueError(f"w_q must be [N, {k}] float8_e4m3fn, got {tuple(w_q.shape)} {w_q.dtype}")
    if not _on_gpu(x) or w_q.device != x.device:
        raise ValueError("the base path needs x and w_q on one CUDA GPU (the vendor FP8 GEMM)")
    if out is None:
        out = torch.empty(m, w_q.shape[0], dtype=torch.bfloat16, device=x.device)
    else:
        _check_2d("out", out, torch.bfloat16)
        if out.shape != (m, w_q.shape[0]) or out.device != x.device:
            raise ValueError(f"out must be [{m}, {w_q.shape[0]}] on {x.device}, got {tuple(out.shape)} on {out.device}")
    if m == 0:
        return out
    return _base_path(x, w_q, w_scale, out)


def _base_path(x, w_q, w_scale, out):
    """vLLM's FP8 linear without LoRA: its per-token quantization (our kernel, same codes and
    scales; vLLM's own op for eager calls with EPILORA_BASE_QUANT=vllm) and its CUTLASS GEMM
    (``vendor_fp8_gemm``), written into ``out``."""
    codes, scales = _vendor_quant_eager(x) or quantize_fp8_per_token(x)
    return vendor_fp8_gemm(codes, scales, w_q, w_scale, out=out)


# v0.98 (opt-in until timed): the base path's quantization by vLLM's own C++ op on eager calls.
# The codes and scales are the same bit for bit; the point is host time: the plugin's eager
# no-adapter call is ~33 µs of host time on the CPU here, about half of it our kernel's Python launch,
# and a batch-1 prefill is host-bound (run46's TTFT without adapters 1.34× stock's). Not while a CUDA
# graph is captured: there host time is free and our kernel is 0.82–1.00× vLLM's GPU time.
BASE_QUANT_ENV = "EPILORA_BASE_QUANT"
BASE_QUANT_DEFAULT = "ours"


@functools.lru_cache(maxsize=1)
def base_quant() -> str:
    """Who quantizes on the base path's eager calls: ``ours`` (our kernel) or ``vllm`` (vLLM's op).
    Read once per process, as hybrid_h_dtype (``base_quant.cache_clear()`` reads it again)."""
    v = (os.environ.get(BASE_QUANT_ENV) or BASE_QUANT_DEFAULT).strip().lower()
    if v not in ("ours", "vllm"):
        _warn_once(f"{BASE_QUANT_ENV}={v}", f"{BASE_QUANT_ENV}={v!r} is not ours or vllm; using {BASE_QUANT_DEFAULT}")
        v = BASE_QUANT_DEFAULT
    return v


def _vendor_quant_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, scales) by vLLM's per-token op when base_quant() is ``vllm``, vLLM's op exists and no
    CUDA graph is being captured; else None (the caller quantizes with our kernel)."""
    if base_quant() != "vllm" or _vllm_ops() is None or torch.cuda.is_current_stream_capturing():
        return None
    op = getattr(getattr(torch.ops, "_C", None), "dynamic_per_token_scaled_fp8_quant", None)
    if op is None:
        return None
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    op(codes, x, scales, None)
    return codes, scales


# The dtype of h between K1 and the expand-add on the hybrid paths (v0.71). bf16 is what the
# expand-add's MMA reads either way, so y is bit for bit the same (run30: the bf16 builds' GPU tests,
# the op's hybrid paths bit for bit the fp32 ones); it halves h's bytes and drops the expand-add's
# conversions: the whole hybrid op 0.5-2 % faster in run30's two calls. The default since v0.78
# (K1's apparent bf16 slowdown there was the column's position in the bench, docs/perf.md).
HYBRID_H_ENV = "EPILORA_HYBRID_H"
HYBRID_H_DEFAULT = "bf16"
_H_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.lru_cache(maxsize=1)
def hybrid_h_dtype() -> torch.dtype:
    """h's dtype on the hybrid paths: EPILORA_HYBRID_H (fp32 | bf16), else HYBRID_H_DEFAULT (an
    unknown value is logged once and ignored: a typo must not stop an engine). Read once per
    process (an environment lookup per call was 2 % of the hybrid call's host time);
    ``hybrid_h_dtype.cache_clear()`` reads it again."""
    v = (os.environ.get(HYBRID_H_ENV) or HYBRID_H_DEFAULT).strip().lower()
    if v not in _H_DTYPES:
        _warn_once(f"{HYBRID_H_ENV}={v}", f"{HYBRID_H_ENV}={v!r} is not one of {sorted(_H_DTYPES)}; "
                   f"using {HYBRID_H_DEFAULT}")
        v = HYBRID_H_DEFAULT
    return _H_DTYPES[v]


def _hybrid_path(x, w_q, w_scale, a, b, meta, out, slot_ranks):
    """K1 (bit-exact quantization + split-K shrink, one launch), the vendor FP8 GEMM, then our
    expand-add into its output: three launches instead of vLLM's four. (A batch the host knows to
    have no adapter takes vLLM's FP8 path instead: lora_linear_fp8.)"""
    from .launch_plans import expand_add, k1_quant_shrink

    codes, scales, h = k1_quant_shrink(x, a, meta, slot_ranks=slot_ranks, h_dtype=hybrid_h_dtype())
    vendor_fp8_gemm(codes, scales, w_q, w_scale, out=out)
    return expand_add(out, h, b, meta, slot_ranks=slot_ranks)


_side_streams: dict[int, torch.cuda.Stream] = {}  # hybrid_par's second stream, one per device


def _device_stream(streams: dict[int, torch.cuda.Stream], device: torch.device,
                   priority: int = 0) -> torch.cuda.Stream:
    """The device's stream in ``streams`` (one per device, made on first use with ``priority``)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(idx)
    if stream is None:
        stream = streams[idx] = torch.cuda.Stream(torch.device("cuda", idx), priority=priority)
    return stream


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return _device_stream(_side_streams, device)


# v0.91: the branch a forked hybrid layer waits for (quantization + GEMM) on a high-priority stream.
# Forked beside a shrink, the quantization and the GEMM queued behind the shrink's CTAs for SM slots
# (run34's batch-64 decode step: our quantization kernel 6.6 µs per call against vLLM's 3.2 alone);
# with priority the block scheduler hands every SM the shrink frees to the critical branch first,
# and the shrink fills what is left. Priorities survive CUDA graphs: PyTorch instantiates with
# cudaGraphInstantiateFlagUseNodePriority, so a captured kernel keeps its stream's priority.
# EPILORA_STREAM_PRIORITY=0 keeps every kernel on the caller's stream (the paths before v0.91).
STREAM_PRIORITY_ENV = "EPILORA_STREAM_PRIORITY"
STREAM_PRIORITY_DEFAULT = "0"
_HIGHEST_PRIORITY = -100  # lower is higher; CUDA's range on Hopper is [-5, 0]
_critical_streams: dict[int, torch.cuda.Stream] = {}
_stream_priority: bool | None = None  # None: not read yet (read once per process)


def stream_priority_enabled() -> bool:
    """Whether the forked hybrid paths run their quantization + GEMM on a high-priority stream."""
    global _stream_priority
    if _stream_priority is None:
        v = (os.environ.get(STREAM_PRIORITY_ENV) or STREAM_PRIORITY_DEFAULT).strip()
        if v not in ("0", "1"):
            _warn_once(f"{STREAM_PRIORITY_ENV}={v}", f"{STREAM_PRIORITY_ENV}={v!r} is not 0 or 1; "
                       f"using {STREAM_PRIORITY_DEFAULT}")
            v = STREAM_PRIORITY_DEFAULT
        _stream_priority = v == "1"
    return _stream_priority


def set_stream_priority(on: bool | None) -> bool:
    """Set (None: re-read from the environment) the setting of stream_priority_enabled; returns the
    setting before. For benches that time both forms in one process; an engine keeps one."""
    global _stream_priority
    before = stream_priority_enabled()
    _stream_priority = None if on is None else bool(on)
    return before


def _critical_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of a forked hybrid path's quantization + GEMM: the caller's, or with
    stream_priority_enabled() one of the device's highest priority (one per device)."""
    if not stream_priority_enabled():
        return torch.cuda.current_stream(device)
    # A priority below the device's range maps to its highest (torch.cuda.Stream's contract).
    return _device_stream(_critical_streams, device, _HIGHEST_PRIORITY)


def _quant_gemm_on(stream, main, x, codes, scales, w_q, w_scale, out, fork=None) -> None:
    """The quantization and the vendor GEMM on ``stream`` (after the caller's work so far), joined
    back into ``main``; ``fork``: an event recorded on ``stream`` after the quantization (the side
    branch of hybrid_par_q waits for it)."""
    if stream is not main:
        stream.wait_stream(main)
    with torch.cuda.stream(stream):
        codes, scales = quantize_fp8_per_token(x, codes, scales)
        if fork is not None:
            fork.record(stream)
        vendor_fp8_gemm(codes, scales, w_q, w_scale, out=out)
    if stream is not main:
        main.wait_stream(stream)


def _hybrid_par_path(x, w_q, w_scale, a, b, meta, out, slot_ranks, quant_first: bool = False):
    """The hybrid path with its down-projection beside the GEMM (v0.34): the quantization kernel
    (the same codes and scales as K1's, bit for bit) feeds the vendor GEMM on the caller's stream
    while K1 computes h on a second stream that forks from and joins back into it (a fork / join a
    CUDA graph captures as two branches); expand-add runs after the join. y is bit-identical to the
    hybrid path's: the same codes, the same GEMM, the same h. The cost: one more launch and K1's
    codes written to a scratch buffer nobody reads. Why: in the hybrid K1 and the GEMM run one
    after the other although only expand-add needs h; at 64 tokens K1 is 15-27 µs of latency per
    projection with most SMs idle (run13), at 2048 it is 25 % of the op.

    Order: K1's branch forks before the quantization; ``quant_first`` (the path "hybrid_par_q",
    v0.58) forks it after the quantization and issues K1 after the GEMM, so that the critical path
    (quantization -> GEMM) does not queue behind K1's CTAs. Neither order wins everywhere (run22,
    vLLM's GEMM, 8 adapters: 64 tokens 145 vs 188 µs per layer, 256 tokens 219 vs 207): the timed
    dispatch takes either per key. With stream_priority_enabled() (v0.91) the quantization + GEMM
    run on a high-priority stream joined back before the expand-add: same kernels, same bits."""
    from .launch_plans import expand_add, k1_quant_shrink

    m, k = x.shape
    dev = x.device
    # Every buffer the side stream writes is allocated here, on the caller's stream, before the
    # fork: the caching allocator then never hands their memory to other work before the join.
    scratch_codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    scratch_scales = torch.empty((m, 1), dtype=torch.float32, device=dev)
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.empty((m, 1), dtype=torch.float32, device=dev)
    h = torch.empty((len(a), m, int(a[0].shape[-2])), dtype=hybrid_h_dtype(), device=dev)
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev)
    crit = _critical_stream(dev)
    if not quant_first:
        side.wait_stream(main)  # x, the metadata and the buffers are ready
        with torch.cuda.stream(side):
            k1_quant_shrink(x, a, meta, scratch_codes, scratch_scales, h, slot_ranks=slot_ranks)
        _quant_gemm_on(crit, main, x, codes, scales, w_q, w_scale, out)
    else:
        fork = torch.cuda.Event()  # x, the metadata and the buffers are ready (and the quantization queued)
        _quant_gemm_on(crit, main, x, codes, scales, w_q, w_scale, out, fork=fork)
        side.wait_event(fork)
        with torch.cuda.stream(side):
            k1_quant_shrink(x, a, meta, scratch_codes, scratch_scales, h, slot_ranks=slot_ranks)
    main.wait_stream(side)  # the join: h is complete before expand-add reads it
    return expand_add(out, h, b, meta, slot_ranks=slot_ranks)


# The hybrid paths' down-projections other than K1: name -> (kernel module, its entry, what to call
# it in errors).
_SIDE_SHRINKS = {"stream": ("kernels_dsl.shrink_stream", "stream_shrink", "streamed shrink"),
                 "grouped": ("kernels_dsl.shrink_grouped", "grouped_shrink", "grouped shrink")}


def _side_shrink_module(shrink: str):
    """The kernel module of a hybrid path's down-projection other than K1 ("stream" | "grouped")."""
    if shrink not in _SIDE_SHRINKS:
        raise ValueError(f"unknown shrink {shrink!r}")
    return importlib.import_module(_SIDE_SHRINKS[shrink][0])


def side_shrink_shape_reason(shrink: str, rank: int, num_slices: int) -> str | None:
    """Why the shrink ("stream" | "grouped") has no build for this adapter shape (None: it has)."""
    mod = _side_shrink_module(shrink)
    if rank not in mod.RANKS or num_slices not in mod.SLICE_COUNTS:
        return f"rank {rank} / {num_slices} slices not compiled"
    return None


def side_shrink_reason(x, shrink: str, rank: int, num_slices: int) -> str | None:
    """Why the shrink ("stream" | "grouped") can't take the call (None: it can)."""
    if arch_of(x) != "sm_90a":
        return f"the {_SIDE_SHRINKS[shrink][2]} needs an sm_90a GPU (have {arch_of(x) or x.device})"
    return side_shrink_shape_reason(shrink, rank, num_slices)


def _hybrid_side_shrink_path(x, w_q, w_scale, a, b, meta, rank, out, slot_ranks, shrink: str, par: bool):
    """The hybrid path with a down-projection that does not quantize in place of K1: the streamed
    shrink (v0.88, kernels_dsl/shrink_stream.py: prefill sizes, where K1 runs at 4-8x its bytes'
    floor) or the shrink by adapter group (v0.90, kernels_dsl/shrink_grouped.py: many small
    groups, where both row-tile shrinks stream an adapter's A once per tile it meets). The
    quantization kernel's codes (the ones K1 wrote, bit for bit) feed the vendor GEMM, the shrink
    computes h, then our expand-add. ``par``: the shrink on the second stream beside the
    quantization + GEMM (hybrid_par's fork / join), else after the GEMM on the caller's stream.
    On hybrid_par K1's codes were a scratch copy nobody read."""
    from .launch_plans import expand_add

    run_shrink = getattr(_side_shrink_module(shrink), _SIDE_SHRINKS[shrink][1])

    m, k = x.shape
    dev = x.device
    h = torch.empty((len(a), m, rank), dtype=hybrid_h_dtype(), device=dev)  # before the fork (see hybrid_par)
    if par:
        codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.empty((m, 1), dtype=torch.float32, device=dev)
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        side.wait_stream(main)  # x, the metadata and the buffers are ready
        with torch.cuda.stream(side):
            run_shrink(x, a, meta, h, slot_ranks)
        _quant_gemm_on(_critical_stream(dev), main, x, codes, scales, w_q, w_scale, out)
        main.wait_stream(side)  # the join: h is complete before expand-add reads it
    else:
        codes, scales = quantize_fp8_per_token(x)
        vendor_fp8_gemm(codes, scales, w_q, w_scale, out=out)
        run_shrink(x, a, meta, h, slot_ranks)
    return expand_add(out, h, b, meta, slot_ranks=slot_ranks)


def _prefill_reason(x, w_q, widths, rank, a, b) -> str | None:
    from kernels_dsl import k2_prefill

    if arch_of(x) != "sm_90a":
        return f"the prefill K2 needs an sm_90a GPU (have {arch_of(x) or x.device})"
    m, k = x.shape
    if not k2_prefill.M_MIN <= m <= k2_prefill.M_MAX:
        return f"{m} tokens: the prefill K2 takes {k2_prefill.M_MIN}..{k2_prefill.M_MAX}"
    if rank not in k2_prefill.RANKS or len(widths) > 4:
        return f"rank {rank} / {len(widths)} slices not compiled"
    if any(w % k2_prefill.bm_for(widths) for w in widths) or k % 128:
        return "slice widths must be multiples of 64 and K a multiple of 128"
    return _buffer_layout_reason(x, w_q, a, b)


def _prefill_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks):
    """K1 (bit-exact quantization + split-K shrink, its codes and scales stored in adapter-sorted
    order), then the prefill K2 with the grouped epilogue, writing y once (rows scattered back).
    An "auto" candidate with EPILORA_PREFILL_PATH=1 (dispatch.VERIFIED_PATHS once GPU-verified).
    The K2 build is k2_prefill.OP_BUILD (its scalar-store twin where out's rows are not 16-byte
    aligned)."""
    from kernels_dsl import k2_prefill
    from kernels_dsl.k1_shrink import k1_quant_shrink

    if getattr(meta, "host_num_adapters", None) == 0:  # as the hybrid: vLLM's own FP8 path
        return _base_path(x, w_q, w_scale, out)
    m = x.shape[0]
    dev = x.device
    if slot_ranks is None:
        slot_ranks = _full_ranks(int(a[0].shape[0]), rank, dev)
    # Sorted rows straight from K1 (v0.69): no gather kernel between K1 and K2.
    xs, ss, h = k1_quant_shrink(x, a, meta, slot_ranks=slot_ranks, sorted_codes=True)
    tok = meta.token_indices_sorted_by_lora_ids
    build = k2_prefill.OP_BUILD
    if build.vstore and not k2_prefill.vstore_fits(out):
        build = k2_prefill.unaligned_twin(build)
    cfg, _ = k2_prefill.select(widths, m, rank, build)
    spec = k2_prefill.launch(cfg, w_q=w_q, w_scale=w_scale, x_q_sorted=xs, x_scale_sorted=ss, y=out,
                             token_indices_sorted=tok, h=h, active_lora_ids=meta.active_lora_ids,
                             num_active=meta.num_active, lora_token_start_loc=meta.lora_token_start_loc,
                             slot_ranks=slot_ranks, slice_start=_slice_start(widths, dev), lora_b=b)
    _launch_spec(get_kernel(k2_prefill, cfg, "sm_90a"), spec, pdl=False)
    return out


def _launch_spec(kernel, spec, pdl: bool) -> None:
    kernel(*spec["args"], grid=spec["grid"], smem=spec["smem"], pdl=pdl, cluster=spec["cluster"])


def _k2_no_adapter(x, w_q, w_scale, widths, out, pdl: bool = True, chain: bool = False):
    from kernels_dsl import k2_gemm

    m, k = x.shape
    n = w_q.shape[0]
    sync = _sync_buffer(x.device)  # (first call: its fill goes before the quantization kernel)
    # Chained: the quantization kernel waits for its predecessor before it touches anything, so
    # this needs no assumption about that kernel.
    codes, scales = quantize_fp8_per_token(x, pdl=chain)
    _, cfg = k2_gemm.select(widths, m)
    spec = k2_gemm.launch(cfg, w_q=w_q, w_scale=w_scale, x_q=codes, x_scale=scales, y=out,
                          sync=sync, n_quant=0, split=k2_gemm.split_for(cfg, n, k, m))
    # K2 as the quantization kernel's PDL dependent: its weight stream starts under the
    # quantization (it waits with griddepcontrol.wait before reading x_q).
    _launch_spec(get_kernel(k2_gemm, cfg, "sm_90a"), spec, pdl=pdl)
    return out


def _checked_slot_ranks(slot_ranks, a, rank, dev):
    max_loras = int(a[0].shape[0])
    if slot_ranks is None:
        return _full_ranks(max_loras, rank, dev)
    if slot_ranks.dtype != torch.int32 or slot_ranks.numel() != max_loras:
        raise ValueError(f"slot_ranks must be int32 [{max_loras}]")
    return slot_ranks


def _decode_fused_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks, chain=False):
    """decode_fh: one K2 launch that quantizes x, computes h (its first CTAs, partials over K in a
    workspace) and adds h.B^T in its epilogue. Chained, it is launched with PDL behind the kernel
    before it and waits for it before it reads x; it reads the metadata before that wait (the
    assumption documented on lora_linear_fp8)."""
    from kernels_dsl import k2_gemm

    made = _persistent.made
    m, k = x.shape
    n = w_q.shape[0]
    dev = x.device
    slot_ranks = _checked_slot_ranks(slot_ranks, a, rank, dev)
    sync = _sync_buffer(dev, "fused_sync")
    cfg, _ = k2_gemm.select(widths, m, rank, fused_h=True)
    partials = torch.empty(k2_gemm.fused_h_workspace_shape(cfg, k), dtype=torch.float32, device=dev)
    spec = k2_gemm.launch(cfg, w_q=w_q, w_scale=w_scale, y=out, split=k2_gemm.split_for(cfg, n, k), x=x,
                          sync=sync, h=partials, token_lora=meta.token_lora_mapping[:m],
                          active_lora_ids=meta.active_lora_ids, num_active=meta.num_active,
                          slot_ranks=slot_ranks, slice_start=_slice_start(widths, dev), lora_b=b, lora_a=a)
    chain = chain and _persistent.made == made
    _launch_spec(get_kernel(k2_gemm, cfg, "sm_90a"), spec, pdl=chain)
    return out


def _decode_path(x, w_q, w_scale, a, b, meta, widths, rank, out, slot_ranks, pdl, chain=False, self_quant=False):
    from kernels_dsl import k2_gemm, lora_shrink

    made = _persistent.made
    m, k = x.shape
    n = w_q.shape[0]
    dev = x.device
    max_loras = int(a[0].shape[0])
    slot_ranks = _checked_slot_ranks(slot_ranks, a, rank, dev)
    h = torch.empty(len(widths), m, rank, dtype=torch.float32, device=dev)
    token_lora = meta.token_lora_mapping[:m]
    split_s = lora_shrink.choose_split(k, len(widths), rank, min(m, max_loras + 1))
    common = dict(token_lora=token_lora, active_lora_ids=meta.active_lora_ids, num_active=meta.num_active,
                  slot_ranks=slot_ranks)
    gate = None
    if self_quant:
        # The shrink is the down-projection alone; K2 quantizes x itself.
        s_cfg = lora_shrink.select(len(widths), m, rank, quant=False)
        s_args = dict(x=x, lora_a=a, h=h, split=split_s, **common)
        # (k: the wide builds where EPILORA_K2_SQ_WIDE asks for them and they lower the split)
        k_cfg, _ = k2_gemm.select(widths, m, rank, self_quant=True, k=k)
        xs = dict(x=x)
        # Chained, the x-gated pair where asked for and built (v1.03): K2 launched under the
        # kernel before the shrink. Its buffer is got now, so that a first call (which fills it)
        # does not chain below.
        if chain and k2_gemm.xgate_enabled():
            gated = (lora_shrink.xgate_variant(s_cfg), k2_gemm.xgate_variant(k_cfg))
            if None not in gated:
                gate = _xgate_buffer(dev)
    else:
        x_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
        x_scale = torch.empty(m, dtype=torch.float32, device=dev)
        sync = _sync_buffer(dev)
        s_cfg = lora_shrink.select(len(widths), m, rank)
        s_args = dict(x=x, lora_a=a, h=h, x_q=x_q, x_scale=x_scale, sync=sync, split=split_s, **common)
        k_cfg, _ = k2_gemm.select(widths, m, rank)
        xs = dict(x_q=x_q, x_scale=x_scale, sync=sync)
    slice_start = _slice_start(widths, dev)
    # Chained, the shrink reads slot_ranks before its griddepcontrol.wait (and an xgate K2 reads
    # B, token_lora and slot_ranks before its gate): not right after the fill that made it (nor
    # any other of our tensors, to keep it simple).
    chain = chain and _persistent.made == made
    if gate is not None and chain:
        s_cfg, k_cfg = gated
        half = _xgate_half(gate)
        s_args["sync"] = half
        xs.update(sync=half, n_quant=lora_shrink.XGATE_COUNT)
    k_split = k2_gemm.split_for(k_cfg, n, k, m)
    s_spec = lora_shrink.launch(s_cfg, **s_args)
    if not self_quant:
        xs["n_quant"] = s_spec["n_quant"]
    k_spec = k2_gemm.launch(k_cfg, w_q=w_q, w_scale=w_scale, y=out, split=k_split, h=h,
                            slice_start=slice_start, lora_b=b, **xs, **common)
    _launch_spec(get_kernel(lora_shrink, s_cfg, "sm_90a"), s_spec, pdl=chain)
    _launch_spec(get_kernel(k2_gemm, k_cfg, "sm_90a"), k_spec, pdl=pdl)
    return out
