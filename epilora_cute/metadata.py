"""Batch metadata: which tokens use which adapter, in the form the kernels consume.

``LoRABatchMeta`` holds the fields of vLLM's ``LoRAKernelMeta`` (same names, same meaning, so the
plugin can also hand vLLM's own object through) plus what tile kernels need:

* ``token_indices_sorted_by_lora_ids`` [max_tokens] int32: a stable sort of the tokens by adapter
  slot (-1 first, as vLLM sorts); kernels read rows in this order so that each tile meets a few
  contiguous adapter groups.
* ``active_lora_ids`` [max_loras + 1] int32: the slots present, ascending (-1 included when some
  token has none); unused entries are -1.
* ``num_tokens_per_lora`` [max_loras + 1] int32, ``lora_token_start_loc`` [max_loras + 2] int32:
  group sizes and exclusive prefix sums, aligned with ``active_lora_ids``.
* ``sorted_lora_ids`` [max_tokens] int32: the slot of each sorted row (-1: no adapter).
* ``row_group`` [max_tokens] int32: the group (index into ``active_lora_ids``) of each sorted
  row; a row tile [r0, r1) meets exactly the groups row_group[r0] .. row_group[r1 - 1].
* ``num_active`` [1] int32: how many entries of ``active_lora_ids`` are valid.

Everything is built with fixed-size device ops and no host synchronization (vLLM's own
``prepare_tensors`` syncs twice: ``torch.all(...)`` read as a bool and ``torch.unique``), so the
buffers can be refreshed in place between CUDA-graph replays. ``num_tokens`` is a host value
and it comes from the shape of the mapping.

One Triton launch instead of the torch ops (default; ``EPILORA_META_KERNEL=0`` keeps the torch
ops): ``prepare`` on CUDA buffers calls ``vllm_adapter.meta_kernel.fill_meta``, which writes the
same values into the same buffers (~50 CUDA-graph nodes per decode step become one; bit for bit
against the torch ops on the H200 and under the Triton interpreter, run9). CPU buffers always take
the torch ops.

``host_num_adapters`` (optional, host int): how many distinct adapter slots (>= 0) the tokens use,
for the timed dispatch's adapter bucket (``dispatch.py``). ``prepare`` sets it when it is given the
mapping on the host (counted there, no device read) and clears it to None for a device mapping,
where the count exists only on the device (``num_active``) and reading it would be a sync; a
caller that knows the count on the host may set it after ``prepare``. None: unknown, the
dispatch then buckets by ``max_loras``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

META_KERNEL_ENV = "EPILORA_META_KERNEL"


def meta_kernel_enabled() -> bool:
    """Whether ``prepare`` fills CUDA buffers with one Triton launch (``vllm_adapter/meta_kernel.py``):
    yes unless ``EPILORA_META_KERNEL=0`` (GPU-verified in run9: same values as the torch ops)."""
    return os.environ.get(META_KERNEL_ENV, "").strip() != "0"


def use_meta_kernel(device) -> bool:
    """Whether ``prepare`` takes the one-launch kernel for buffers on ``device`` (CUDA, switched
    on, and Triton importable: without it the torch ops compute the same values)."""
    return torch.device(device).type == "cuda" and meta_kernel_enabled() and _triton_available()


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@dataclass
class LoRABatchMeta:
    max_loras: int
    max_num_tokens: int
    num_tokens: int
    token_lora_mapping: torch.Tensor
    token_indices_sorted_by_lora_ids: torch.Tensor
    active_lora_ids: torch.Tensor
    num_tokens_per_lora: torch.Tensor
    lora_token_start_loc: torch.Tensor
    sorted_lora_ids: torch.Tensor
    row_group: torch.Tensor
    num_active: torch.Tensor
    host_num_adapters: int | None = None

    @staticmethod
    def make(max_loras: int, max_num_tokens: int, device="cpu") -> "LoRABatchMeta":
        if max_loras < 1 or max_num_tokens < 1:
            raise ValueError("max_loras and max_num_tokens must be positive")
        i32 = dict(dtype=torch.int32, device=device)
        return LoRABatchMeta(
            max_loras=max_loras,
            max_num_tokens=max_num_tokens,
            num_tokens=0,
            token_lora_mapping=torch.full((max_num_tokens,), -1, **i32),
            token_indices_sorted_by_lora_ids=torch.zeros(max_num_tokens, **i32),
            active_lora_ids=torch.full((max_loras + 1,), -1, **i32),
            num_tokens_per_lora=torch.zeros(max_loras + 1, **i32),
            lora_token_start_loc=torch.zeros(max_loras + 2, **i32),
            sorted_lora_ids=torch.full((max_num_tokens,), -1, **i32),
            row_group=torch.zeros(max_num_tokens, **i32),
            num_active=torch.zeros(1, **i32),
        )

    @property
    def device(self) -> torch.device:
        return self.token_lora_mapping.device

    def prepare(self, token_lora_mapping: torch.Tensor) -> "LoRABatchMeta":
        """Refresh every field in place from a [num_tokens] mapping (slot per token, -1: none)."""
        m = token_lora_mapping
        if m.dim() != 1:
            raise ValueError(f"token_lora_mapping must be 1-D, got shape {tuple(m.shape)}")
        if m.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token_lora_mapping must be int32 or int64, got {m.dtype}")
        n = m.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens exceed this metadata's capacity of {self.max_num_tokens}")
        dev = self.device
        L = self.max_loras
        if m.device.type == "cpu":  # host data: count the distinct valid slots here, without a sync
            self.host_num_adapters = int(torch.unique(m[(m >= 0) & (m < L)]).numel())
        else:
            self.host_num_adapters = None
        if use_meta_kernel(dev):
            # One Triton launch, same values (see the module docstring).
            from vllm_adapter.meta_kernel import fill_meta

            fill_meta(self, m if m.device == dev else m.to(device=dev))
            self.num_tokens = n
            return self
        m = m.to(device=dev, dtype=torch.int32)
        # Slot ids outside [-1, max_loras) would index adapter buffers out of bounds: map them to
        # "no adapter" rather than trust them (a validating caller checks them on the host first).
        m = torch.where((m >= -1) & (m < L), m, torch.full_like(m, -1))
        self.num_tokens = n
        self.token_lora_mapping.fill_(-1)
        self.token_lora_mapping[:n].copy_(m)

        # Group sizes for ids -1 .. L-1 at positions 0 .. L (bincount without a sync).
        counts = torch.zeros(L + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, (m + 1).to(torch.long), torch.ones_like(m))
        present = counts > 0
        # Compact the present ids in ascending order: a stable sort on "absent" keeps id order.
        order = torch.sort((~present).to(torch.int32), stable=True).indices
        num_active = present.sum(dtype=torch.int32)
        pos = torch.arange(L + 1, device=dev, dtype=torch.int32)
        valid = pos < num_active
        ids = (order.to(torch.int32) - 1)
        self.active_lora_ids.copy_(torch.where(valid, ids, torch.full_like(ids, -1)))
        self.num_tokens_per_lora.copy_(torch.where(valid, counts[order], torch.zeros_like(ids)))
        self.lora_token_start_loc.zero_()
        self.lora_token_start_loc[1:].copy_(torch.cumsum(self.num_tokens_per_lora, 0, dtype=torch.int32))
        self.num_active.copy_(num_active.reshape(1))

        sorted_ids, sorted_idx = torch.sort(m, stable=True)
        self.token_indices_sorted_by_lora_ids.zero_()
        self.token_indices_sorted_by_lora_ids[:n].copy_(sorted_idx.to(torch.int32))
        self.sorted_lora_ids.fill_(-1)
        self.sorted_lora_ids[:n].copy_(sorted_ids)
        # Group of each sorted row: how many group starts lie at or before it, minus one.
        rows = torch.arange(n, device=dev, dtype=torch.int32)
        starts = self.lora_token_start_loc[1:L + 1]  # ends of groups 0..L-1 == starts of 1..L
        grp = torch.searchsorted(starts, rows, right=True).to(torch.int32)
        self.row_group.zero_()
        self.row_group[:n].copy_(grp)
        return self

    def slot_tokens(self) -> dict[int, list[int]]:
        """Host view for tests and debugging (synchronizes): slot -> tokens, in sorted order."""
        n = self.num_tokens
        out: dict[int, list[int]] = {}
        for idx, sid in zip(self.token_indices_sorted_by_lora_ids[:n].tolist(), self.sorted_lora_ids[:n].tolist()):
            out.setdefault(sid, []).append(idx)
        return out


def build_meta(token_lora_mapping: torch.Tensor, max_loras: int, max_num_tokens: int | None = None) -> LoRABatchMeta:
    """Allocate and fill metadata for one mapping (tests, eager calls)."""
    n = token_lora_mapping.shape[0]
    meta = LoRABatchMeta.make(max_loras, max(n, max_num_tokens or 0, 1), token_lora_mapping.device)
    return meta.prepare(token_lora_mapping)
