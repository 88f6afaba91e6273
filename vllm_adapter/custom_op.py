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
``no_lora_flag_cpu`` is vLLM's host flag for a batch without adapters (a CPU tensor, as vLLM
passes it to its own LoRA ops, so compiled graphs read it at run time): with it set the call is
dispatched as a no-adapter call.

``prepare_meta`` refreshes the metadata buffers in place from a mapping (mutates them, returns
nothing): as one opaque op it is captured into CUDA graphs as it is, and torch.compile does not
trace ``LoRABatchMeta.prepare``'s sorts and scatters. On CUDA ``prepare`` is one Triton launch
(``meta_kernel.py``; ``EPILORA_META_KERNEL=0``: the torch ops).
"""

from __future__ import annotations

from typing import Sequence

import torch

from epilora_cute.metadata import LoRABatchMeta

from . import fused

NAMESPACE = "epilora_vllm"
OP_NAME = "lora_linear_fp8"
PREPARE_NAME = "prepare_meta"
META_FIELDS = ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids",
               "num_tokens_per_lora", "lora_token_start_loc", "sorted_lora_ids", "row_group",
               "num_active")
SCHEMA = (
    "(Tensor x, Tensor w_q, Tensor w_scale, Tensor[] lora_a, Tensor[] lora_b, "
    + ", ".join(f"Tensor {f}" for f in META_FIELDS)
    + ", Tensor? bias=None, bool chain_pdl=False, Tensor? no_lora_flag_cpu=None) -> Tensor"
)
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


def is_host_flag(flag) -> bool:
    """A one-element CPU tensor: a flag the host can read without a device sync."""
    return isinstance(flag, torch.Tensor) and flag.device.type == "cpu" and flag.numel() == 1


def _host_no_lora(flag: torch.Tensor | None) -> bool:
    """vLLM's own "no token has an adapter" flag (``LoRAKernelMeta.no_lora_flag_cpu``, set by its
    metadata preparation every step; its LoRA kernels return early on it). Read only when it is a
    host flag (no device sync) and the shortcut is on."""
    return is_host_flag(flag) and fused.no_lora_shortcut_enabled() and bool(flag.reshape(()))


def _impl(x, w_q, w_scale, lora_a, lora_b, token_lora_mapping, token_indices_sorted_by_lora_ids,
          active_lora_ids, num_tokens_per_lora, lora_token_start_loc, sorted_lora_ids, row_group,
          num_active, bias=None, chain_pdl=False, no_lora_flag_cpu=None):
    # A batch without adapters (vLLM's flag) is keyed as such: the dispatch then runs vLLM's own
    # FP8 path on it ("base"; EPILORA_NO_LORA_PATH=timed: the fastest no-adapter candidate).
    meta = _meta_from_tensors(x, (token_lora_mapping, token_indices_sorted_by_lora_ids,
                                  active_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                                  sorted_lora_ids, row_group, num_active),
                              host_num_adapters=0 if _host_no_lora(no_lora_flag_cpu) else None)
    return fused.lora_linear_fp8(x, w_q, w_scale, lora_a, lora_b, meta, bias, chain_pdl=chain_pdl)


def _fake(x, w_q, w_scale, lora_a, lora_b, *meta_and_bias, **kw):
    return x.new_empty((x.shape[0], w_q.shape[0]))


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
    lib.define(PREPARE_NAME + PREPARE_SCHEMA)
    for key in ("CUDA", "CPU"):
        lib.impl(OP_NAME, _impl, key)
        lib.impl(PREPARE_NAME, _prepare_impl, key)
    torch.library.register_fake(f"{NAMESPACE}::{OP_NAME}", _fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::{PREPARE_NAME}", _prepare_fake, lib=lib)
    _lib = lib  # the registration lives as long as this object


def lora_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                    meta: LoRABatchMeta, bias: torch.Tensor | None = None, chain_pdl: bool = False,
                    no_lora_flag_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Call the registered op with ``meta`` flattened into its tensors."""
    register()
    op = getattr(torch.ops, NAMESPACE).lora_linear_fp8
    return op(x, w_q, w_scale, list(lora_a), list(lora_b),
              *(getattr(meta, f) for f in META_FIELDS), bias, chain_pdl, no_lora_flag_cpu)


def prepare_meta(mapping: torch.Tensor, meta: LoRABatchMeta) -> None:
    """``meta.prepare(mapping)`` through the registered op (in place, no host sync)."""
    register()
    getattr(torch.ops, NAMESPACE).prepare_meta(mapping, *(getattr(meta, f) for f in META_FIELDS))
