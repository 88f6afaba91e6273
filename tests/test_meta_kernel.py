"""The one-launch metadata kernel (vllm_adapter/meta_kernel.py) against ``LoRABatchMeta.prepare``'s
torch ops, bit for bit, every buffer (tails included).

Without a GPU the kernel runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py before anything imports triton, as for tests/test_triton_path.py); with one
it runs compiled on CUDA buffers. The reference is always the torch implementation on the CPU.
``test_compiles_for_sm90`` compiles the real kernel for sm_90 in a subprocess without the
interpreter (no GPU needed), so a kernel the interpreter accepts but the compiler rejects shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_mode import DEVICE, HAS_GPU, skip_unless_runnable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
skip_unless_runnable()

# Every test here runs on the GPU too (compiled there, interpreted here): marked `gpu` only where
# one exists, so that the GPU record's `-m gpu` selection takes them and CPU runs still do.
pytestmark = [pytest.mark.gpu] if HAS_GPU else []

from epilora_cute import metadata  # noqa: E402
from epilora_cute.metadata import LoRABatchMeta  # noqa: E402
from vllm_adapter import meta_kernel  # noqa: E402
from vllm_adapter.custom_op import META_FIELDS  # noqa: E402

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def torch_meta(mapping: torch.Tensor, max_loras: int, cap: int) -> LoRABatchMeta:
    """The reference: ``prepare``'s torch ops on CPU buffers (the kernel is never used there)."""
    return LoRABatchMeta.make(max_loras, cap, "cpu").prepare(mapping.cpu())


def stale_meta(max_loras: int, cap: int, g: torch.Generator, device=DEVICE) -> LoRABatchMeta:
    """Buffers full of garbage, as a previous (larger, other) batch or uninitialized memory leaves them."""
    meta = LoRABatchMeta.make(max_loras, cap, "cpu")
    for f in META_FIELDS:
        t = getattr(meta, f)
        t.copy_(torch.randint(-1000, 1000, t.shape, generator=g, dtype=torch.int32))
    for f in META_FIELDS:
        setattr(meta, f, getattr(meta, f).to(device))
    return meta


def assert_same(got: LoRABatchMeta, want: LoRABatchMeta, what: str) -> None:
    for f in META_FIELDS:
        a, b = getattr(got, f).cpu(), getattr(want, f)
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, f"{what}: {f} {a.dtype}{tuple(a.shape)}"
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{what}: {f} differs at {bad}: kernel {a[bad].tolist()} torch {b[bad].tolist()}")


def random_mapping(g: torch.Generator, n: int, L: int, kind: str, dtype=torch.int32) -> torch.Tensor:
    def rnd(lo, hi):
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)
    if kind == "valid":  # ids in [-1, L), about a quarter without adapter
        m = torch.where(rnd(0, 4) == 0, -1, rnd(0, L))
    elif kind == "out_of_range":  # mostly valid, some beyond L, below -1, or far outside
        m = rnd(-1, L)
        junk = torch.tensor([L, L + 1, -2, -7, INT32_MAX, INT32_MIN, 1000, -1000])
        m = torch.where(rnd(0, 3) == 0, junk[rnd(0, junk.numel())], m)
    elif kind == "all_none":
        m = torch.full((n,), -1, dtype=torch.int64)
    elif kind == "one_adapter":
        m = torch.full((n,), int(rnd(0, L)[0]) if n else 0, dtype=torch.int64)
    elif kind == "all_slots":  # every slot, in order then shuffled
        m = torch.arange(n, dtype=torch.int64) % (L + 1) - 1
        m = m[torch.randperm(n, generator=g)]
    elif kind == "sorted_desc":
        m = torch.sort(rnd(-1, L), descending=True).values
    else:
        raise ValueError(kind)
    return m.to(dtype)


KINDS = ("valid", "out_of_range", "all_none", "one_adapter", "all_slots", "sorted_desc")
SIZES = (0, 1, 2, 3, 5, 8, 15, 17, 31, 64, 65, 127, 129, 255, 257, 383, 512, 513, 600)


@pytest.mark.parametrize("j,L", list(enumerate([1, 2, 3, 4, 7, 8, 15, 16])))
def test_random_mappings_bitwise(j, L):
    """A third of SIZES per L (each size meets two or three L), kinds, int32 and int64, capacity
    == n or larger, stale buffers. (Each interpreted launch costs ~25 ms: the cases are few.)"""
    g = torch.Generator().manual_seed(1000 + L)
    for k, n in enumerate(SIZES[j % 3::3]):
        kind = KINDS[(k + j) % len(KINDS)]
        dtype = (torch.int32, torch.int64)[(k + j) % 2]
        cap = max(n, 1) + (0, 1, 13, 200)[(k + L) % 4]
        m = random_mapping(g, n, L, kind, dtype)
        got = stale_meta(L, cap, g)
        meta_kernel.fill_meta(got, m.to(DEVICE))
        assert_same(got, torch_meta(m, L, cap), f"L={L} n={n} cap={cap} {kind} {dtype}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_many_blocks(kind):
    """Small token blocks: the running per-id counts carry across many loop iterations."""
    g = torch.Generator().manual_seed(7)
    for L, n, block in ((1 + KINDS.index(kind) % 2, 37, 16), (16 - KINDS.index(kind), 333, 32)):
        m = random_mapping(g, n, L, kind)
        got = stale_meta(L, n + 9, g)
        meta_kernel.fill_meta(got, m.to(DEVICE), block=block)
        assert_same(got, torch_meta(m, L, n + 9), f"{kind} L={L} n={n} block={block}")


def test_int64_ids_truncate_like_torch():
    """int64 ids go through int32 first (``m.to(torch.int32)``), then the range check."""
    L = 4
    m = torch.tensor([2 ** 32 + 1, -(2 ** 40), 2 ** 33 - 1, 2 ** 32 + 3, 3, -1, 2 ** 62, -2, 2 ** 31],
                     dtype=torch.int64)
    got = stale_meta(L, 12, torch.Generator().manual_seed(3))
    meta_kernel.fill_meta(got, m.to(DEVICE))
    want = torch_meta(m, L, 12)
    assert want.token_lora_mapping[:4].tolist() == [1, 0, -1, 3]  # the truncation this test is about
    assert_same(got, want, "int64 wrap")


def test_strided_and_aliased_mapping():
    g = torch.Generator().manual_seed(5)
    L, n = 6, 77
    base = random_mapping(g, 2 * n, L, "out_of_range")
    m = base[::2]  # non-contiguous
    got = stale_meta(L, 90, g)
    meta_kernel.fill_meta(got, base.to(DEVICE)[::2])
    assert_same(got, torch_meta(m, L, 90), "strided")
    # The mapping may be the metadata's own token_lora_mapping buffer.
    got2 = stale_meta(L, 90, g)
    got2.token_lora_mapping[:n].copy_(m.to(DEVICE))
    meta_kernel.fill_meta(got2, got2.token_lora_mapping[:n])
    assert_same(got2, torch_meta(m, L, 90), "aliased")


def test_refill_in_place_shrinking_batch():
    """The same buffers refilled with fewer tokens: the tails of the bigger batch must go."""
    g = torch.Generator().manual_seed(11)
    L, cap = 8, 300
    got = LoRABatchMeta.make(L, cap, DEVICE)
    ptrs = [getattr(got, f).data_ptr() for f in META_FIELDS]
    for n in (300, 257, 40, 1, 0, 128):
        m = random_mapping(g, n, L, "valid")
        meta_kernel.fill_meta(got, m.to(DEVICE))
        assert_same(got, torch_meta(m, L, cap), f"refill n={n}")
    assert ptrs == [getattr(got, f).data_ptr() for f in META_FIELDS]


def test_long_tails_over_several_programs():
    """Tails longer than one program's TAIL_CHUNK (the engine's capacity is vLLM's
    max_num_batched_tokens, thousands of tokens past a decode batch): every program's share, the
    last one partial, over stale buffers."""
    g = torch.Generator().manual_seed(17)
    L, cap = 4, 2 * meta_kernel.TAIL_CHUNK + 77
    assert meta_kernel.tail_programs(0, cap) == 3 and meta_kernel.tail_programs(cap, cap) == 0
    for n in (0, 1, 700, meta_kernel.TAIL_CHUNK + 3, cap - 1):
        m = random_mapping(g, n, L, "valid")
        got = stale_meta(L, cap, g)
        meta_kernel.fill_meta(got, m.to(DEVICE))
        assert_same(got, torch_meta(m, L, cap), f"n={n} cap={cap}")


def test_prepare_wiring(monkeypatch):
    """``prepare`` with the kernel switched in: same fields, num_tokens and host_num_adapters."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for L, n, cap in ((3, 10, 16), (16, 200, 256)):
        m = random_mapping(g, n, L, "out_of_range")
        cases.append((L, n, cap, m, torch_meta(m, L, cap)))  # before the switch: torch ops
    monkeypatch.setattr(metadata, "use_meta_kernel", lambda device: True)
    for L, n, cap, m, want in cases:
        got = stale_meta(L, cap, g)
        got.prepare(m)  # a host mapping: copied to the buffers' device first, counted on the host
        assert_same(got, want, f"prepare L={L} n={n}")
        assert got.num_tokens == want.num_tokens == n
        assert got.host_num_adapters == want.host_num_adapters
        got.prepare(m.to(DEVICE))
        assert_same(got, want, f"prepare device mapping L={L} n={n}")
        assert got.host_num_adapters == (want.host_num_adapters if DEVICE.type == "cpu" else None)


def test_switch_default_on_for_cuda(monkeypatch):
    monkeypatch.delenv(metadata.META_KERNEL_ENV, raising=False)
    assert metadata.meta_kernel_enabled()
    assert metadata.use_meta_kernel("cuda") and not metadata.use_meta_kernel("cpu")
    for value, on in (("1", True), ("0", False), (" 0 ", False), ("", True)):
        monkeypatch.setenv(metadata.META_KERNEL_ENV, value)
        assert metadata.use_meta_kernel(torch.device("cuda", 0)) is on
        assert metadata.use_meta_kernel("cpu") is False  # CPU buffers: always the torch ops


def test_switch_on_cpu_keeps_torch_ops(monkeypatch):
    monkeypatch.setenv(metadata.META_KERNEL_ENV, "1")

    def boom(*a, **k):
        raise AssertionError("the kernel must not run for CPU buffers")
    monkeypatch.setattr(meta_kernel, "fill_meta", boom)
    m = torch.tensor([2, -1, 0, 2, 9], dtype=torch.int32)
    meta = LoRABatchMeta.make(3, 8).prepare(m)
    assert meta.token_lora_mapping.tolist() == [2, -1, 0, 2, -1, -1, -1, -1]


def test_bad_buffers_are_refused():
    meta = LoRABatchMeta.make(3, 8, DEVICE)
    with pytest.raises(ValueError, match="capacity"):
        meta_kernel.fill_meta(meta, torch.zeros(9, dtype=torch.int32, device=DEVICE))
    meta.row_group = meta.row_group[:7]
    with pytest.raises(ValueError, match="row_group"):
        meta_kernel.fill_meta(meta, torch.zeros(4, dtype=torch.int32, device=DEVICE))


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_adapter import meta_kernel as mk
for L, map_type in ((1, "*i64"), (16, "*i32")):
    ids, block = mk.block_sizes(L)
    sig = {"map_ptr": map_type, "stride_map": "i32", "n": "i32", "cap": "i32"}
    sig.update({k: "*i32" for k in ("mapping_ptr", "sorted_idx_ptr", "active_ids_ptr", "num_tokens_ptr",
                                     "start_loc_ptr", "sorted_lora_ptr", "row_group_ptr", "num_active_ptr")})
    sig.update(L="constexpr", IDS="constexpr", BLOCK="constexpr", TAIL="constexpr")
    src = ASTSource(mk.prepare_meta_kernel, sig, constexprs={"L": L, "IDS": ids, "BLOCK": block,
                                                              "TAIL": mk.TAIL_CHUNK})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": mk.NUM_WARPS})
    assert k.asm["cubin"], L
print("compiled")
"""


def test_compiles_for_sm90():
    """The real compiler (not the interpreter) accepts the kernel: sm_90 cubins, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("No module named 'triton.backends.nvidia'" in r.stderr):
        pytest.skip("this triton has no NVIDIA backend")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_cuda_graph_replay_refreshes_in_place():
    """Captured once for a size, replayed with new mapping contents: the fields follow."""
    g = torch.Generator().manual_seed(13)
    L, n, cap = 8, 48, 512
    mapping = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    meta = LoRABatchMeta.make(L, cap, DEVICE)
    meta_kernel.fill_meta(meta, mapping)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta_kernel.fill_meta(meta, mapping)
    for kind in KINDS:
        m = random_mapping(g, n, L, kind)
        mapping.copy_(m.to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(meta, torch_meta(m, L, cap), f"replay {kind}")
