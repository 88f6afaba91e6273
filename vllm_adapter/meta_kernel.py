"""``LoRABatchMeta.prepare`` as ONE Triton launch (default on CUDA; ``EPILORA_META_KERNEL=0`` turns it off).

The torch implementation of ``prepare`` (``epilora_cute/metadata.py``) is ~35 small ops; inside
vLLM's CUDA graph they are ~50 graph nodes per decode step (~80 us of GPU time plus ~25 us of
gaps per generated token, measured on the H200). ``prepare_meta_kernel`` fills the same buffers
with exactly the same values in a single launch (program 0 the metadata, the others the buffers'
tails), with no host synchronization;
the token count ``n`` is a runtime argument (not specialized), so one compiled kernel serves every
CUDA-graph size, each graph capturing its own launch.

Tested bit for bit against the torch implementation (``tests/test_meta_kernel.py``): compiled on
the H200 (run9, CUDA-graph replays included) and under the Triton interpreter here. In the engine
(run9) it took 52 kernels out of each decode step.

Algorithm (column ``c`` of a one-hot row stands for slot id ``c - 1``, column 0 for "no adapter"):

1. Pass 1 over token blocks: load the mapping (int32 or int64; int64 truncated to int32 first, as
   ``m.to(torch.int32)`` does), map ids outside ``[-1, L)`` to -1, write ``token_lora_mapping``,
   and count tokens per id with a one-hot ``[BLOCK, IDS]`` sum.
2. In registers: ``present = counts > 0``; the group index of a present id is the exclusive
   cumsum of ``present`` (ids ascending, as the torch sort of "absent" keeps them); its group's
   first sorted row is the exclusive cumsum of ``counts``. ``active_lora_ids``,
   ``num_tokens_per_lora``, ``lora_token_start_loc`` and ``num_active`` are written by scatter
   (present ids to their group index) plus fills past ``num_active``: disjoint addresses.
3. Pass 2 over the same blocks (the mapping is read again, not the buffer just written, so no
   thread reads another thread's store): a token's sorted row is its id's group start + the
   tokens of its id in earlier blocks (a running count) + those earlier in its block (exclusive
   ``tl.cumsum`` of the one-hot along the block), i.e. a stable sort. Writes
   ``token_indices_sorted_by_lora_ids``, ``sorted_lora_ids`` and ``row_group`` at that row.
4. Tails ``[n, capacity)`` of the four token-sized buffers: -1 / 0 / -1 / 0, as the torch code's
   ``fill_`` / ``zero_`` leave them (the sorted rows of step 3 are all ``< n``: no overlap), written
   by programs 1.. of the grid, ``TAIL_CHUNK`` tokens each, beside program 0's steps 1-3. (One
   program writing them all took 11.3 µs of each decode step at batch 1 in run34's profile: 4 × 16 K
   int32 from 4 warps, the capacity being vLLM's max_num_batched_tokens.)

Every address is written by exactly one store, so no barrier is needed. If the mapping is the
``token_lora_mapping`` buffer itself, the result is the same: step 3 then reads either the raw or
the cleaned id, and cleaning is idempotent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a [BLOCK, IDS] one-hot tile (BLOCK tokens x IDS id columns): 32 per thread at 4 warps.
TILE_ELEMS = 4096
MAX_BLOCK = 1024
MIN_BLOCK = 16
NUM_WARPS = 4
TAIL_CHUNK = 1024  # tail tokens per program (4 stores of 4 KB each)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tail_programs(n: int, cap: int) -> int:
    """Programs after program 0, one per TAIL_CHUNK tokens of the tail [n, cap)."""
    return -(-max(0, cap - n) // TAIL_CHUNK)


def block_sizes(max_loras: int) -> tuple[int, int]:
    """(IDS, BLOCK): id columns (power of two >= max_loras + 1) and tokens per loop iteration."""
    ids = _pow2_at_least(max_loras + 1)
    return ids, max(MIN_BLOCK, min(MAX_BLOCK, TILE_ELEMS // ids))


@triton.jit
def _clean_ids(map_ptr, stride_map, offs, ok, L: tl.constexpr):
    """Slot ids of tokens ``offs`` as int32, anything outside [-1, L) -> -1 (masked lanes: -1)."""
    ids = tl.load(map_ptr + offs * stride_map, mask=ok, other=-1).to(tl.int32)
    return tl.where((ids >= -1) & (ids < L), ids, -1)


@triton.jit(do_not_specialize=["n"])
def prepare_meta_kernel(
        map_ptr, stride_map, n, cap,
        mapping_ptr, sorted_idx_ptr, active_ids_ptr, num_tokens_ptr, start_loc_ptr,
        sorted_lora_ptr, row_group_ptr, num_active_ptr,
        L: tl.constexpr, IDS: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """Grid (1 + tail_programs(n, cap),). ``n`` tokens in ``map_ptr``; ``cap`` = capacity of the
    token-sized buffers. Program 0 computes the metadata of the n tokens, program p >= 1 writes the
    tail's tokens [n + (p - 1) * TAIL, n + p * TAIL) (clipped at cap)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    if pid > 0:
        t_end = tl.minimum(n + pid * TAIL, cap)
        minus1 = tl.full([BLOCK], -1, tl.int32)
        zero = tl.zeros([BLOCK], dtype=tl.int32)
        for t0 in range(n + (pid - 1) * TAIL, t_end, BLOCK):
            offs = t0 + rows
            ok = offs < t_end
            tl.store(mapping_ptr + offs, minus1, mask=ok)
            tl.store(sorted_idx_ptr + offs, zero, mask=ok)
            tl.store(sorted_lora_ptr + offs, minus1, mask=ok)
            tl.store(row_group_ptr + offs, zero, mask=ok)
        return
    cols = tl.arange(0, IDS)  # column c <-> slot id c - 1

    # Pass 1: cleaned mapping, tokens per id.
    counts = tl.zeros([IDS], dtype=tl.int32)
    for t0 in range(0, n, BLOCK):
        offs = t0 + rows
        ok = offs < n
        ids = _clean_ids(map_ptr, stride_map, offs, ok, L)
        tl.store(mapping_ptr + offs, ids, mask=ok)
        hot = ((ids[:, None] + 1) == cols[None, :]) & ok[:, None]
        counts += tl.sum(hot.to(tl.int32), axis=0)

    # Groups: present ids ascending; group index and first sorted row of each id.
    present = counts > 0
    pres = present.to(tl.int32)
    num_active = tl.sum(pres, axis=0)
    group = tl.cumsum(pres, axis=0) - pres
    start = tl.cumsum(counts, axis=0) - counts
    total = tl.sum(counts, axis=0)  # == n
    fill = (cols >= num_active) & (cols < L + 1)  # entries past the active groups
    tl.store(active_ids_ptr + group, cols - 1, mask=present)
    tl.store(active_ids_ptr + cols, tl.full([IDS], -1, tl.int32), mask=fill)
    tl.store(num_tokens_ptr + group, counts, mask=present)
    tl.store(num_tokens_ptr + cols, tl.zeros([IDS], dtype=tl.int32), mask=fill)
    # lora_token_start_loc = [0, cumsum(num_tokens_per_lora)]: group g ends at start + count.
    tl.store(start_loc_ptr + cols, tl.zeros([IDS], dtype=tl.int32), mask=cols == 0)
    tl.store(start_loc_ptr + 1 + group, start + counts, mask=present)
    tl.store(start_loc_ptr + 1 + cols, tl.zeros([IDS], dtype=tl.int32) + total, mask=fill)
    tl.store(num_active_ptr + cols, tl.zeros([IDS], dtype=tl.int32) + num_active, mask=cols == 0)

    # Pass 2: stable placement of every token at its sorted row.
    run = start  # next free sorted row of each id
    for t0 in range(0, n, BLOCK):
        offs = t0 + rows
        ok = offs < n
        ids = _clean_ids(map_ptr, stride_map, offs, ok, L)
        hot = (((ids[:, None] + 1) == cols[None, :]) & ok[:, None]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # tokens of the same id earlier in this block
        dest = tl.sum(hot * (run[None, :] + before), axis=1)
        grp = tl.sum(hot * group[None, :], axis=1)
        tl.store(sorted_idx_ptr + dest, offs, mask=ok)
        tl.store(sorted_lora_ptr + dest, ids, mask=ok)
        tl.store(row_group_ptr + dest, grp, mask=ok)
        run += tl.sum(hot, axis=0)


def fill_meta(meta, mapping: torch.Tensor, *, block: int | None = None) -> None:
    """Fill ``meta``'s buffers from ``mapping`` in one launch (what ``meta.prepare`` computes).

    ``mapping``: 1-D int32/int64 on the buffers' device, at most the capacity long (``prepare``
    has checked that). Sets neither ``num_tokens`` nor ``host_num_adapters`` (``prepare`` does).
    Only shapes are read on the host: no synchronization, capturable in a CUDA graph.
    ``block`` (tests): tokens per loop iteration instead of ``block_sizes``' choice (a power of two).
    """
    L = meta.max_loras
    cap = meta.token_lora_mapping.shape[0]
    n = mapping.shape[0]
    for name, want in (("token_lora_mapping", cap), ("token_indices_sorted_by_lora_ids", cap),
                       ("sorted_lora_ids", cap), ("row_group", cap), ("active_lora_ids", L + 1),
                       ("num_tokens_per_lora", L + 1), ("lora_token_start_loc", L + 2), ("num_active", 1)):
        t = getattr(meta, name)
        if t.shape != (want,) or t.dtype != torch.int32 or not t.is_contiguous() or t.device != mapping.device:
            raise ValueError(f"meta.{name}: want contiguous int32 [{want}] on {mapping.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if n > cap:
        raise ValueError(f"{n} tokens exceed this metadata's capacity of {cap}")
    ids, default_block = block_sizes(L)
    block = block or default_block
    prepare_meta_kernel[(1 + tail_programs(n, cap),)](
        mapping, mapping.stride(0) if n > 0 else 1, n, cap,
        meta.token_lora_mapping, meta.token_indices_sorted_by_lora_ids, meta.active_lora_ids,
        meta.num_tokens_per_lora, meta.lora_token_start_loc, meta.sorted_lora_ids, meta.row_group,
        meta.num_active,
        L=L, IDS=ids, BLOCK=block, TAIL=TAIL_CHUNK, num_warps=NUM_WARPS)
