"""One ``LoRABatchMeta`` per vLLM punica wrapper, prepared inside the forward for the real row count.

Source of truth: vLLM writes the token -> adapter-slot mapping once per step into the punica
wrapper's fixed buffer ``_token_lora_indices`` (slot per token, -1 for none; first
``indices_len[0]`` entries valid, exposed as ``token_lora_indices``).

Why in the forward and not in ``update_metadata``: with CUDA graphs vLLM pads the batch, so a
layer sees M >= n rows while the mapping has n tokens, and the kernels read
``token_indices_sorted_by_lora_ids[:M]`` as a permutation of the M rows (the Triton path checks
``meta.num_tokens == M``). The padded size is known only in the forward, and a graph replay runs
no Python, so the preparation has to be an op inside the captured forward. It reads the fixed
buffer's first M entries: rows past n hold an old slot id or -1 (``prepare`` maps anything out of
range to -1), which only decides what padding rows compute, and their outputs are dropped.

Once per forward, not per layer: the first EpiLoRA layer attached to a wrapper (the first in
``named_modules`` order, i.e. layer 0's attention projection in decoder models) is the leader and
prepares; the others reuse the buffers. Outside torch.compile a follower still checks that the
buffers were prepared for its M and prepares them itself if not.

vLLM's ``LoRAKernelMeta`` is not reused: on an all-no-LoRA batch vLLM skips writing its
``token_lora_mapping`` (stale rows stay) and its ``lora_token_start_loc`` is 0 past the active
groups, and it has no tile fields; the five shared fields mean the same (tests compare them).
"""

from __future__ import annotations

import weakref

import torch

from epilora_cute.metadata import LoRABatchMeta

from . import custom_op

ATTR = "_epilora_meta_state"


class MetaState:
    def __init__(self, meta: LoRABatchMeta, leader) -> None:
        self.meta = meta
        self.leader = weakref.ref(leader)


def capacity(punica_wrapper) -> int:
    """max_num_batched_tokens of the wrapper (vLLM keeps it only as the buffer size)."""
    return int(punica_wrapper._token_lora_indices.shape[0])


def attach(punica_wrapper, layer, max_loras: int) -> MetaState:
    """The wrapper's metadata state; the first layer to attach becomes the leader."""
    state = getattr(punica_wrapper, ATTR, None)
    if state is None:
        meta = LoRABatchMeta.make(max_loras, capacity(punica_wrapper), punica_wrapper.device)
        state = MetaState(meta, layer)
        setattr(punica_wrapper, ATTR, state)
    elif state.meta.max_loras != max_loras:
        raise ValueError(f"punica wrapper metadata has {state.meta.max_loras} slots, layer has {max_loras}")
    return state


def prepare(punica_wrapper, state: MetaState, rows: int) -> None:
    """Fill ``state.meta`` for the first ``rows`` rows of this step, in place, with no host sync."""
    mapping = punica_wrapper._token_lora_indices[:rows]
    custom_op.prepare_meta(mapping, state.meta)
    if not torch.compiler.is_compiling():  # host record for eager followers; no SymInt stores
        state.meta.num_tokens = rows


def meta_for(punica_wrapper, state: MetaState, layer, rows: int) -> LoRABatchMeta:
    """The metadata for a layer about to run on ``rows`` rows (prepares it when the layer leads)."""
    return meta_and_prepared(punica_wrapper, state, layer, rows)[0]


def meta_and_prepared(punica_wrapper, state: MetaState, layer, rows: int) -> tuple[LoRABatchMeta, bool]:
    """``meta_for`` and whether this call prepared it: then the preparation's kernels run right
    before the layer's op, which must not chain onto them (``fused`` module docstring). A host
    decision, constant for a traced graph (the leader prepares, followers under torch.compile
    never do)."""
    leads = state.leader() is layer
    if leads or (not torch.compiler.is_compiling() and state.meta.num_tokens != rows):
        prepare(punica_wrapper, state, rows)
        return state.meta, True
    return state.meta, False
