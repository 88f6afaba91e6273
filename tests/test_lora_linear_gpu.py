"""The public fused op on the GPU, every path it can take, against the reference."""

import pytest
import torch

from epilora_cute import ops, reference
from epilora_cute.metadata import build_meta

pytestmark = pytest.mark.gpu

QWEN3_8B = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gate_up": ((12288, 12288), 4096),
            "down": ((4096,), 12288)}


def _case(widths, k, m, rank=64, loras=4, adapters=3, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).bfloat16()
    wq, ws = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, device="cuda", generator=g) * 0.02)
    a = [(torch.randn(loras, 1, rank, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in widths]
    b = [(torch.randn(loras, 1, n, rank, device="cuda", generator=g) * 0.02).bfloat16() for n in widths]
    mapping = torch.randint(-1, adapters, (m,), device="cuda", generator=g, dtype=torch.int32)
    return x, wq, ws, a, b, mapping


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def _reference(x, wq, ws, a, b, mapping):
    return reference.lora_linear(x, wq, ws, a, b, mapping)


@pytest.mark.parametrize("proj", list(QWEN3_8B))
@pytest.mark.parametrize("m", [1, 3, 8, 16, 31, 32])
@pytest.mark.parametrize("path", ["decode", "auto"])
def test_decode_path_matches_reference(proj, m, path, monkeypatch):
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m)
    meta = build_meta(mapping, 4)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)
    assert not torch.isnan(y).any()
    # bf16 output and bf16 h in the epilogue (as vLLM's expand): well under 1e-2 relative.
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 32])
def test_pdl_off_is_identical_and_runs_are_bitwise_reproducible(m):
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=100 + m)
    meta = build_meta(mapping, 4)
    y0 = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode", pdl=True).clone()
    for _ in range(10):
        assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode", pdl=True), y0)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode", pdl=False), y0)


def test_no_adapter_path_is_the_base_gemm():
    widths, k = QWEN3_8B["down"]
    x, wq, ws, a, b, _ = _case(widths, k, 16, seed=7)
    mapping = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    meta = build_meta(mapping, 4)
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="no_adapter")
    ref = _reference(x, wq, ws, a, b, mapping)
    assert _rel_err(y, ref) < 5e-3
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode"),
                       ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode"))


def test_decode_path_in_a_cuda_graph_with_new_inputs():
    widths, k = QWEN3_8B["gate_up"]
    x, wq, ws, a, b, mapping = _case(widths, k, 8, seed=9)
    meta = build_meta(mapping, 4, 8)
    out = torch.empty(8, sum(widths), dtype=torch.bfloat16, device="cuda")
    ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="decode")  # load modules eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="decode")
    for seed in (10, 11):
        x2, _, _, _, _, mapping2 = _case(widths, k, 8, seed=seed)
        x.copy_(x2)
        meta.prepare(mapping2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(x, wq, ws, a, b, mapping2)) < 1e-2


@pytest.mark.parametrize("m", [33, 100, 511])
def test_auto_above_decode_sizes_takes_the_triton_path(m):
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m)
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4))
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [33, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_hybrid_path_matches_reference(proj, m):
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 1)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4), out=out, path="hybrid")
    assert not torch.isnan(y).any()
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [33, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_prefill_path_matches_reference(proj, m):
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 2)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4), out=out, path="prefill")
    assert not torch.isnan(y).any()
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


def test_vendor_gemm_is_the_base_gemm():
    widths, k = QWEN3_8B["o"]
    x, wq, ws, _, _, _ = _case(widths, k, 64, seed=3)
    codes, scales = ops.quantize_fp8_per_token(x)
    y = ops.vendor_fp8_gemm(codes, scales, wq, ws)
    assert _rel_err(y, reference.fp8_scaled_mm(codes, scales, wq, ws)) < 5e-3
