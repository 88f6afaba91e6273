"""Keep one ``LoRABatchMeta`` per vLLM punica wrapper, refreshed when vLLM refreshes its own.

vLLM writes the token -> adapter-slot mapping once per step in
``PunicaWrapper.update_metadata`` (``_token_lora_indices``, exposed as ``token_lora_indices``:
slot per token, -1 for none). Every LoRA layer of the model shares that wrapper, so the plugin
wraps that one bound method on the instance (no vLLM source change) and refreshes its metadata
right after, once per step instead of once per layer. ``LoRABatchMeta.prepare`` works in place
on fixed buffers with no host sync, so CUDA-graph replays see the new batch.

Why not reuse vLLM's ``LoRAKernelMeta`` buffers directly: on an all-no-LoRA batch vLLM returns
before writing ``token_lora_mapping`` (stale rows stay), and its ``lora_token_start_loc`` is 0
past the active groups where ours keeps the running total; the tile fields (``row_group``,
``sorted_lora_ids``) rely on ours. The five shared fields mean the same (tests compare them).
"""

from __future__ import annotations

import functools

import torch

from epilora_cute.metadata import LoRABatchMeta

ATTR = "_epilora_meta"


def capacity(punica_wrapper) -> int:
    """max_num_batched_tokens of the wrapper (it is only stored as the buffer size)."""
    return int(punica_wrapper._token_lora_indices.shape[0])


def current_mapping(punica_wrapper) -> torch.Tensor | None:
    """The mapping of the current step, or None before vLLM's first update."""
    if punica_wrapper.indices_len[0] is None:
        return None
    return punica_wrapper.token_lora_indices


def attach(punica_wrapper, max_loras: int) -> LoRABatchMeta:
    """The wrapper's metadata, created and hooked on first use (idempotent)."""
    meta = getattr(punica_wrapper, ATTR, None)
    if meta is not None:
        if meta.max_loras < max_loras:
            raise ValueError(f"punica wrapper metadata holds {meta.max_loras} slots, layer needs {max_loras}")
        return meta
    meta = LoRABatchMeta.make(max_loras, capacity(punica_wrapper), punica_wrapper.device)
    original = punica_wrapper.update_metadata

    @functools.wraps(original)
    def update_metadata(*args, **kwargs):
        result = original(*args, **kwargs)
        refresh(punica_wrapper)
        return result

    punica_wrapper.update_metadata = update_metadata
    setattr(punica_wrapper, ATTR, meta)
    refresh(punica_wrapper)  # a mapping may already be set
    return meta


def refresh(punica_wrapper) -> None:
    meta: LoRABatchMeta = getattr(punica_wrapper, ATTR)
    mapping = current_mapping(punica_wrapper)
    if mapping is not None:
        meta.prepare(mapping)
