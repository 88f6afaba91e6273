"""``torch.ops.epilora_vllm.lora_linear_fp8`` (the fused op) and ``prepare_meta`` as torch custom ops.

Registered like vLLM's ``direct_register_custom_op`` does (``torch.library.Library`` define +
impl, cheaper to dispatch than ``torch.library.custom_op``) but without importing vLLM, so it
is also tested without it. The op is functional (returns a new tensor, mutates nothing), so
torch.compile needs no auto-functionalization, and its fake implementation only allocates the
output, so Dynamo traces it without a graph break. ``LoRABatchMeta`` is passed as its tensors:
a dataclass cannot cross the op boundary, and its host ``num_tokens`` must not, or compiled
graphs would specialize on it. Nothing in the call reads a device value on the host.
``chain_pdl`` (a constant per call site) lets the op overlap the kernel before it
(``fused.lora_linear_fp8``); the layer passes False right after it prepared the metadata.
vLLM's host flag for a batch without adapters (``no_lora_flag_cpu``, a one-element CPU tensor
vLLM updates in place every step) reaches the op as an int, its index in ``_HOST_FLAGS``
(``host_flag_id``), and the op reads the flag's current value when it runs: with it set the call
is dispatched as a no-adapter call. Not the tensor itself: Inductor marks every CPU graph input
unaligned and with it the output of any op that takes one (``has_unaligned_input`` in
torch/_inductor/ir.py), so the Triton kernels that read our output (the residual add + RMSNorm,
SiLU-mul) were compiled without their 16-byte hints, unlike stock's, and summed in another order
(perf.md v0.49: the no-adapter greedy mismatch with stock).

``lora_linear_fp8_out`` is the same computation written into a given ``out`` (mutated, returns
nothing), for a caller that allocates the output in the compiled graph: Inductor then knows the
buffer (its alignment, for the kernels that read it next), as it does for stock vLLM's GEMM output.
The plugin uses it with ``EPILORA_OUT_VARIANT=1`` (an experiment: run10's Inductor code showed
the norm kernels reading our op's returned tensor without the 16-byte alignment hint).

``prefetch_id`` (an int per call site, like the flag id): the layer's ``prefetch_plan`` id; with
``EPILORA_L2_PREFETCH`` on, the op ends by asking L2 for the next projection's weight.

``prepare_meta`` refreshes the metadata buffers in place from a mapping (mutates them, returns
nothing): as one opaque op it is captured into CUDA graphs as it is, and torch.compile does not
trace ``LoRABatchMeta.prepare``'s sorts and scatters. On CUDA ``prepare`` is one Triton launch
(``meta_kernel.py``; ``EPILORA_META_KERNEL=0``: the torch ops).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Sequence

import torch

from epilora_cute.metadata import LoRABatchMeta

from . import fused, prefetch_plan

logger = logging.getLogger("vllm.epilora")

NAMESPACE = "epilora_vllm"
OP_NAME = "lora_linear_fp8"
OUT_OP_NAME = "lora_linear_fp8_out"
PREPARE_NAME = "prepare_meta"
OUT_VARIANT_ENV = "EPILORA_OUT_VARIANT"
META_FIELDS = ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids",
               "num_tokens_per_lora", "lora_token_start_loc", "sorted_lora_ids", "row_group",
               "num_active")
_ARGS = (
    "Tensor x, Tensor w_q, Tensor w_scale, Tensor[] lora_a, Tensor[] lora_b, "
    + ", ".join(f"Tensor {f}" for f in META_FIELDS)
    + ", Tensor? bias=None, bool chain_pdl=False, int no_lora_flag_id=-1, int prefetch_id=-1"
)
SCHEMA = "(" + _ARGS + ") -> Tensor"
OUT_SCHEMA = "(Tensor(a!) out, " + _ARGS + ") -> ()"
PREPARE_SCHEMA = (
    "(Tensor mapping, "
    + ", ".join(f"Tensor(a{i}!) {f}" for i, f in enumerate(META_FIELDS))
    + ") -> ()"
)

_lib: torch.library.Library | None = None


def _meta_from_tensors(x: torch.Tensor, tensors: Sequence[torch.Tensor],
                       host_num_adapters: int | None = None) -> LoRABatchMeta:
    f = dict(zip(META_FIELDS, tensors))
    cap = f["token_lora_mapping"].shape[0]
    # num_tokens is only a host hint: the kernels read the device fields, rows past the
    # mapped tokens carry no adapter.
    return LoRABatchMeta(max_loras=f["active_lora_ids"].shape[0] - 1, max_num_tokens=cap,
                         num_tokens=min(x.shape[0], cap), host_num_adapters=host_num_adapters, **f)


# vLLM's host flags by id (the op's ``no_lora_flag_id``; the module docstring says why not the
# tensor). Registered outside any traced code (the layer's set_mapping). Weak references: a flag
# whose engine is gone frees its id for the next one, so a process that builds one engine after
# another keeps using id 0 (what a compiled graph loaded from vLLM's cache has baked in).
_HOST_FLAGS: list[weakref.ref] = []
_warned_missing: set[int] = set()


def host_flag_id(flag: torch.Tensor | None) -> int:
    """The id under which the op finds ``flag`` (registered on first use); -1 when it is not a
    host flag (then the op treats the batch as possibly having adapters)."""
    if not is_host_flag(flag):
        return -1
    for i, ref in enumerate(_HOST_FLAGS):
        if ref() is flag:
            return i
    for i, ref in enumerate(_HOST_FLAGS):
        if ref() is None:
            _HOST_FLAGS[i] = weakref.ref(flag)
            return i
    _HOST_FLAGS.append(weakref.ref(flag))
    return len(_HOST_FLAGS) - 1


def host_flag(flag_id: int) -> torch.Tensor | None:
    """The flag registered under ``flag_id``; None for -1, and (with a warning, once per id) for an
    id nothing is registered under (e.g. a compiled graph from vLLM's cache made in a process that
    registered its flags in another order): the call is then dispatched as one that may have
    adapters, which computes the same result, only without the no-adapter shortcut."""
    if flag_id < 0:
        return None
    flag = _HOST_FLAGS[flag_id]() if flag_id < len(_HOST_FLAGS) else None
    if flag is None and flag_id not in _warned_missing:
        _warned_missing.add(flag_id)
        logger.warning("EpiLoRA: no host flag registered under id %d (%d known): vLLM's no-adapter "
                       "flag is ignored for these calls", flag_id, len(_HOST_FLAGS))
    return flag


def is_host_flag(flag) -> bool:
    """A one-element CPU tensor: a flag the host can read without a device sync."""
    return isinstance(flag, torch.Tensor) and flag.device.type == "cpu" and flag.numel() == 1


def _host_no_lora(flag: torch.Tensor | None) -> bool:
    """vLLM's own "no token has an adapter" flag (``LoRAKernelMeta.no_lora_flag_cpu``, set by its
    metadata preparation every step; its LoRA kernels return early on it), from ``host_flag``:
    only host flags are registered there (no device sync). Read when the shortcut is on."""
    return flag is not None and fused.no_lora_shortcut_enabled() and bool(flag.item())


def _impl(x, w_q, w_scale, lora_a, lora_b, token_lora_mapping, token_indices_sorted_by_lora_ids,
          active_lora_ids, num_tokens_per_lora, lora_token_start_loc, sorted_lora_ids, row_group,
          num_active, bias=None, chain_pdl=False, no_lora_flag_id=-1, prefetch_id=-1, out=None):
    # A batch without adapters (vLLM's flag) is keyed as such: the dispatch then runs vLLM's own
    # FP8 path on it ("base"; EPILORA_NO_LORA_PATH=timed: the fastest no-adapter candidate). Where
    # it would take "base" anyway, the call goes there directly: the metadata, the adapter
    # buffers' checks and the dispatch cost host time in every eager call (a prefill outside
    # CUDA graphs: run34's no-adapter TTFT at 512 tokens, 1.43x stock's); the kernels are the same.
    no_lora = _host_no_lora(host_flag(no_lora_flag_id))
    if no_lora and fused.base_shortcut_applies(x):
        y = fused.base_linear_fp8(x, w_q, w_scale, bias, out=out)
    else:
        meta = _meta_from_tensors(x, (token_lora_mapping, token_indices_sorted_by_lora_ids,
                                      active_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                                      sorted_lora_ids, row_group, num_active),
                                  host_num_adapters=0 if no_lora else None)
        y = fused.lora_linear_fp8(x, w_q, w_scale, lora_a, lora_b, meta, bias, chain_pdl=chain_pdl, out=out)
    # The next projection's weight into L2 while the kernels between the two run (opt-in).
    prefetch_plan.run(prefetch_id, x.shape[0])
    return y


def _fake(x, w_q, w_scale, lora_a, lora_b, *meta_and_bias, **kw):
    return x.new_empty((x.shape[0], w_q.shape[0]))


def _out_impl(out, *args):
    """The functional op's computation written into ``out`` (the schema returns nothing)."""
    _impl(*args, out=out)


def _out_fake(out, *args, **kw):
    return None


def _prepare_impl(mapping, *fields):
    meta = _meta_from_tensors(mapping, fields)
    meta.prepare(mapping)


def _prepare_fake(mapping, *fields):
    return None


def register() -> None:
    """Define the op once per process (vLLM loads plugins in every process, maybe twice)."""
    global _lib
    if _lib is not None or hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
        return
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(OP_NAME + SCHEMA)
    lib.define(OUT_OP_NAME + OUT_SCHEMA)
    lib.define(PREPARE_NAME + PREPARE_SCHEMA)
    for key in ("CUDA", "CPU"):
        lib.impl(OP_NAME, _impl, key)
        lib.impl(OUT_OP_NAME, _out_impl, key)
        lib.impl(PREPARE_NAME, _prepare_impl, key)
    torch.library.register_fake(f"{NAMESPACE}::{OP_NAME}", _fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::{OUT_OP_NAME}", _out_fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::{PREPARE_NAME}", _prepare_fake, lib=lib)
    _lib = lib  # the registration lives as long as this object


def lora_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                    meta: LoRABatchMeta, bias: torch.Tensor | None = None, chain_pdl: bool = False,
                    no_lora_flag_cpu: torch.Tensor | None = None, no_lora_flag_id: int = -1,
                    prefetch_id: int = -1) -> torch.Tensor:
    """Call the registered op with ``meta`` flattened into its tensors. vLLM's no-adapter flag:
    ``no_lora_flag_id`` (``host_flag_id``; what traced callers pass) or, in eager code,
    ``no_lora_flag_cpu`` itself. ``prefetch_id``: this layer's ``prefetch_plan`` id (-1: none)."""
    register()
    op = getattr(torch.ops, NAMESPACE).lora_linear_fp8
    return op(x, w_q, w_scale, list(lora_a), list(lora_b), *(getattr(meta, f) for f in META_FIELDS),
              bias, chain_pdl, _flag_id(no_lora_flag_cpu, no_lora_flag_id), prefetch_id)


def _flag_id(flag: torch.Tensor | None, flag_id: int) -> int:
    return host_flag_id(flag) if flag is not None else flag_id


def out_variant_enabled() -> bool:
    """``EPILORA_OUT_VARIANT=1``: the plugin allocates the output and calls ``lora_linear_fp8_out``."""
    return os.environ.get(OUT_VARIANT_ENV) == "1"


def lora_linear_fp8_out(out: torch.Tensor, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                        meta: LoRABatchMeta, bias: torch.Tensor | None = None, chain_pdl: bool = False,
                        no_lora_flag_cpu: torch.Tensor | None = None, no_lora_flag_id: int = -1,
                        prefetch_id: int = -1) -> torch.Tensor:
    """``lora_linear_fp8`` written into ``out`` ([M, N], x's dtype, contiguous); returns ``out``."""
    register()
    getattr(torch.ops, NAMESPACE).lora_linear_fp8_out(
        out, x, w_q, w_scale, list(lora_a), list(lora_b), *(getattr(meta, f) for f in META_FIELDS),
        bias, chain_pdl, _flag_id(no_lora_flag_cpu, no_lora_flag_id), prefetch_id)
    return out


def prepare_meta(mapping: torch.Tensor, meta: LoRABatchMeta) -> None:
    """``meta.prepare(mapping)`` through the registered op (in place, no host sync)."""
    register()
    getattr(torch.ops, NAMESPACE).prepare_meta(mapping, *(getattr(meta, f) for f in META_FIELDS))
