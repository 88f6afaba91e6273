"""Batch metadata against a host restatement of vLLM's LoRAKernelMeta (and vLLM itself if present)."""

import importlib.util

import pytest
import torch

from epilora_cute.metadata import LoRABatchMeta, build_meta


def vllm_style(mapping: torch.Tensor, max_loras: int):
    """What vLLM's prepare_tensors computes, with torch.unique and a stable sort."""
    order = torch.sort(mapping, stable=True).indices
    ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
    active = torch.full((max_loras + 1,), -1, dtype=torch.int32)
    num = torch.zeros(max_loras + 1, dtype=torch.int32)
    start = torch.zeros(max_loras + 2, dtype=torch.int32)
    active[: ids.numel()] = ids.int()
    num[: counts.numel()] = counts.int()
    start[1: 1 + counts.numel()] = torch.cumsum(counts, 0).int()
    start[1 + counts.numel():] = start[counts.numel()]
    return order.int(), active, num, start


@pytest.mark.parametrize("seed,n,max_loras", [(0, 1, 1), (1, 7, 4), (2, 33, 8), (3, 257, 32), (4, 2048, 16)])
def test_matches_vllm_semantics(seed, n, max_loras):
    g = torch.Generator().manual_seed(seed)
    mapping = torch.randint(-1, max_loras, (n,), generator=g, dtype=torch.int32)
    meta = build_meta(mapping, max_loras)
    order, active, num, start = vllm_style(mapping, max_loras)
    assert torch.equal(meta.token_indices_sorted_by_lora_ids[:n], order)
    assert torch.equal(meta.active_lora_ids, active)
    assert torch.equal(meta.num_tokens_per_lora, num)
    assert torch.equal(meta.lora_token_start_loc, start)
    assert meta.num_active.item() == int((num > 0).sum())
    # Tile fields: slot and group of every sorted row.
    assert torch.equal(meta.sorted_lora_ids[:n], mapping[order.long()])
    for r in range(n):
        g_ = meta.row_group[r].item()
        assert start[g_] <= r < start[g_ + 1]
        assert active[g_].item() == meta.sorted_lora_ids[r].item()


def test_all_tokens_without_adapter_and_refresh_in_place():
    meta = LoRABatchMeta.make(max_loras=4, max_num_tokens=16)
    ptrs = [t.data_ptr() for t in (meta.active_lora_ids, meta.token_indices_sorted_by_lora_ids, meta.row_group)]
    meta.prepare(torch.tensor([-1, -1, -1], dtype=torch.int32))
    assert meta.active_lora_ids.tolist() == [-1, -1, -1, -1, -1]
    assert meta.num_tokens_per_lora.tolist() == [3, 0, 0, 0, 0]
    assert meta.num_active.item() == 1
    meta.prepare(torch.tensor([3, 0, 3, 1, 0], dtype=torch.int64))
    assert meta.active_lora_ids.tolist() == [0, 1, 3, -1, -1]
    assert meta.num_tokens_per_lora.tolist() == [2, 1, 2, 0, 0]
    assert meta.lora_token_start_loc.tolist() == [0, 2, 3, 5, 5, 5]
    assert meta.slot_tokens() == {0: [1, 4], 1: [3], 3: [0, 2]}
    # The buffers are updated in place (CUDA graphs capture their addresses).
    assert ptrs == [t.data_ptr() for t in (meta.active_lora_ids, meta.token_indices_sorted_by_lora_ids, meta.row_group)]


def test_bad_mappings():
    meta = LoRABatchMeta.make(max_loras=2, max_num_tokens=4)
    with pytest.raises(ValueError, match="capacity"):
        meta.prepare(torch.zeros(5, dtype=torch.int32))
    with pytest.raises(TypeError):
        meta.prepare(torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ValueError):
        meta.prepare(torch.zeros(2, 2, dtype=torch.int32))
    # Out-of-range slots are treated as "no adapter" rather than indexing past the buffers.
    meta.prepare(torch.tensor([5, 1, -7], dtype=torch.int32))
    assert meta.sorted_lora_ids[:3].tolist() == [-1, -1, 1]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_against_vllm_lora_kernel_meta():
    try:
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    except Exception as e:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's LoRAKernelMeta is not importable here: {e}")
    g = torch.Generator().manual_seed(7)
    mapping = torch.randint(-1, 6, (41,), generator=g, dtype=torch.int32)
    theirs = LoRAKernelMeta.make(max_loras=6, max_num_tokens=64, device="cpu")
    theirs.prepare_tensors(mapping)
    ours = build_meta(mapping, 6, 64)
    n = mapping.numel()
    assert torch.equal(ours.token_indices_sorted_by_lora_ids[:n], theirs.token_indices_sorted_by_lora_ids[:n])
    assert torch.equal(ours.active_lora_ids, theirs.active_lora_ids)
    assert torch.equal(ours.num_tokens_per_lora, theirs.num_tokens_per_lora)
    k = int((ours.num_tokens_per_lora > 0).sum()) + 1
    assert torch.equal(ours.lora_token_start_loc[:k], theirs.lora_token_start_loc[:k])
