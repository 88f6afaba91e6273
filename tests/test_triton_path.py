"""The portable Triton path (issue 6) against epilora_cute.reference.

Without a GPU the kernels run on CPU tensors under the Triton interpreter. Triton chooses between
interpreter and compiler when it decorates a kernel (its own library's when triton is first
imported), so TRITON_INTERPRET=1 has to be set before anything imports triton: tests/conftest.py
does that when there is no GPU, and this module sets it too when it is the first to import triton.

Tolerance on y (relative Frobenius error against reference.lora_linear, which is fp32): the FP8
codes and scales are bit-identical to the reference, so the base GEMM differs only in fp32
summation order (~1e-6 relative). The LoRA term differs by summation order in h and by tf32
rounding of h in the expand (2^-11 relative of the LoRA term). The dominant error is the bf16
rounding of y: at most 2^-9 relative per element with round-to-nearest (GPU), 2^-8 with the
interpreter's fp32->bf16 cast, which truncates. Bound = that bf16 unit + 2^-10 for the rest.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import DEVICE, HAS_GPU, skip_unless_runnable  # noqa: E402

skip_unless_runnable()

from epilora_cute import reference as ref  # noqa: E402
from epilora_cute.metadata import build_meta  # noqa: E402
from vllm_adapter import triton_path as tp  # noqa: E402
from vllm_adapter.triton_path import (  # noqa: E402
    TritonLoraConfig, triton_gemm_lora, triton_lora_linear, triton_quant_shrink, validate_token_lora_mapping)

BF16_UNIT = 2.0 ** -9 if HAS_GPU else 2.0 ** -8
Y_TOL = BF16_UNIT + 2.0 ** -10
H_TOL = 1e-5  # fp32 sums in another order
FP8_NAN_BYTE = 0x7F  # never produced: the quantizer clamps to +-448 (0x7E / 0xFE)

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------- problem builders

def _gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_problem(M, K, widths, R, num_adapters, *, seed=0, slot_ranks=None, none_fraction=0.25,
                 max_loras=None, device=DEVICE):
    """Random layer + batch. Returns a dict; A/B beyond a slot's effective rank are zero in the
    reference copies and NaN in the kernel copies (so reading them would show)."""
    g = _gen(seed, device)
    L = max_loras or max(num_adapters, 1)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    x = (randn(M, K) * 2).to(torch.bfloat16)
    w_q, w_scale = ref.quantize_fp8_per_tensor(randn(sum(widths), K) / K ** 0.5)
    a_ref = [(randn(L, 1, R, K) / K ** 0.5).to(torch.bfloat16) for _ in widths]
    b_ref = [(randn(L, 1, n, R) / R ** 0.5).to(torch.bfloat16) for n in widths]
    g_cpu = _gen(seed)
    slots = torch.randint(0, max(num_adapters, 1), (M,), generator=g_cpu, dtype=torch.int32)
    if num_adapters == 0:
        slots.fill_(-1)
    else:
        slots[torch.rand(M, generator=g_cpu) < none_fraction] = -1
    a_dev, b_dev = a_ref, b_ref
    if slot_ranks is not None:
        slot_ranks = torch.tensor(slot_ranks, dtype=torch.int32)
        a_ref = [t.clone() for t in a_ref]
        b_ref = [t.clone() for t in b_ref]
        a_dev = [t.clone() for t in a_ref]
        b_dev = [t.clone() for t in b_ref]
        for slot, r in enumerate(slot_ranks.tolist()):
            for t in a_ref:
                t[slot, :, r:] = 0
            for t in b_ref:
                t[slot, :, :, r:] = 0
            for t in a_dev:
                t[slot, :, r:] = float("nan")
            for t in b_dev:
                t[slot, :, :, r:] = float("nan")
    return dict(x=x, w_q=w_q, w_scale=w_scale, slots=slots, L=L, a_ref=a_ref, b_ref=b_ref, a=a_dev, b=b_dev,
                slot_ranks=None if slot_ranks is None else slot_ranks.to(device),
                meta=build_meta(slots.to(device), L))


def rel_err(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    y, y_ref = y.double(), y_ref.double()
    return ((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()


def reference_h(p, chunk=256):
    """reference.lora_shrink, chunked over tokens like reference_y."""
    x, slots = p["x"], p["slots"].to(p["x"].device)
    parts = [ref.lora_shrink(x[i:i + chunk], p["a_ref"], slots[i:i + chunk]) for i in range(0, x.shape[0], chunk)]
    return [torch.cat([part[s] for part in parts]) for s in range(len(p["a_ref"]))]


def reference_y(p, *, w8a16, chunk=256):
    """reference.lora_linear, chunked over tokens (it is row-wise; chunks bound its memory)."""
    outs = []
    for i in range(0, p["x"].shape[0], chunk):
        sl = slice(i, i + chunk)
        outs.append(ref.lora_linear(p["x"][sl], p["w_q"], p["w_scale"], p["a_ref"], p["b_ref"],
                                    p["slots"][sl].to(p["x"].device), quantize_activations=not w8a16))
    return torch.cat(outs)


def poisoned_k1_outputs(M, K, S, R, device=DEVICE):
    codes = torch.full((M, K), FP8_NAN_BYTE, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    scales = torch.full((M, 1), float("nan"), device=device)
    h = torch.full((S, M, R), float("nan"), device=device)
    return codes, scales, h


def check_k1(p, *, quantize=True, config=None):
    """Run K1 into poisoned buffers; codes/scales bit-exact, h close; returns (codes, scales, h)."""
    x = p["x"]
    M, K = x.shape
    S, R = len(p["a"]), p["a"][0].shape[2]
    codes, scales, h = poisoned_k1_outputs(M, K, S, R, x.device)
    out = triton_quant_shrink(x, p["a"], p["meta"], quantize=quantize, slot_ranks=p["slot_ranks"], config=config,
                              codes_out=codes if quantize else None, scales_out=scales if quantize else None,
                              h_out=h)
    assert out[2] is h
    if quantize:
        ref_codes, ref_scales = ref.quantize_fp8_per_token(x)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), "FP8 codes differ from reference"
        assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), "scales differ from reference"
    h_ref = reference_h(p)
    assert not h.isnan().any(), "h not fully written (or read NaN past a slot's rank)"
    for s in range(S):
        assert rel_err(h[s], h_ref[s]) <= H_TOL
    none = p["slots"].to(x.device) < 0
    assert torch.all(h[:, none] == 0), "tokens without adapter must have h = 0"
    return codes, scales, h


# ----------------------------------------------------------------------------- quantization, bit-exact

def test_fp8_codes_for_every_bf16_value_at_unit_scale():
    """Every bf16 value in [-448, 448] (this covers every e4m3 tie) with scale exactly 1."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = bits[(bits.float().abs() <= 448)]  # drops NaN and |v| > 448
    K = 256
    rows = -(-vals.numel() // (K - 1))
    x = torch.zeros(rows * (K - 1), dtype=torch.bfloat16)
    x[:vals.numel()] = vals
    x = torch.cat([torch.full((rows, 1), 448.0, dtype=torch.bfloat16), x.reshape(rows, K - 1)], dim=1)
    p = make_problem(1, K, [16], 8, 0)
    p.update(x=x.to(DEVICE), meta=build_meta(torch.full((rows,), -1, dtype=torch.int32, device=DEVICE), 1),
             slots=torch.full((rows,), -1, dtype=torch.int32))
    cfg = TritonLoraConfig(k1_block_m=64, k1_block_k=128, k1_block_r=16, k1_split_k=1)
    _, scales, _ = check_k1(p, config=cfg)
    assert torch.all(scales == 1.0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf / inf in the interpreter's numpy
def test_fp8_codes_special_rows():
    """NaN, +-inf, zeros, -0.0, tiny rows (MIN_SCALE), bf16's largest values, K with a tail."""
    g = _gen(3)
    K = 96
    x = torch.randn(9, K, generator=g)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 3] = -float("inf")
    x[2, 4] = float("nan")
    x[3] = 0.0
    x[4] = -0.0
    x[5] *= 1e-9  # amax / 448 < MIN_SCALE
    x[6] = torch.tensor(3.3895e38)  # bf16 max: amax / 448 is finite, big
    x[6, ::2] *= -1
    x[7] *= torch.logspace(-30, 30, K)
    x[8, :] = float("nan")
    p = make_problem(9, K, [16], 8, 0)  # no adapters: h of NaN / inf rows would be NaN in any order
    p["x"] = x.to(torch.bfloat16).to(DEVICE)
    check_k1(p)


@pytest.mark.parametrize("M,K", [(1, 64), (3, 160), (16, 256), (33, 96)])
def test_fp8_codes_random_scales(M, K):
    g = _gen(M * K)
    p = make_problem(M, K, [32], 16, 2, seed=M)
    p["x"] = (torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M)[:, None]).to(torch.bfloat16).to(DEVICE)
    check_k1(p)


# ----------------------------------------------------------------------------- the whole layer

CASES = [
    # id, M, K, widths, R, adapters, w8a16, slot_ranks, config
    ("m1-r8", 1, 64, [32], 8, 1, False, None, None),
    ("m3-qkv-r16", 3, 128, [48, 16, 16], 16, 2, False, None, None),
    ("m16-gateup-r64-mixed", 16, 192, [40, 40], 64, 4, False, [64, 8, 16, 0], None),
    ("m33-qkv-r16-split4", 33, 256, [64, 16, 16], 16, 3, False, None,
     TritonLoraConfig(k1_split_k=4, k1_block_r=16, k2_block_n=32, k2_block_k=64, k2_block_r=16)),
    ("m33-r8-w8a16", 33, 160, [48], 8, 4, True, None, None),
    ("m16-r64-w8a16-mixed", 16, 64, [32, 24], 64, 2, True, [16, 64], None),
    ("m3-no-adapter", 3, 96, [32, 16], 16, 0, False, None, None),
    ("m33-one-adapter-r24", 33, 128, [24, 40], 24, 1, False, None,
     TritonLoraConfig(k1_block_m=32, k2_block_m=32, k2_block_n=16, k2_block_r=16)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lora_linear_against_reference(case):
    _, M, K, widths, R, adapters, w8a16, slot_ranks, cfg = case
    p = make_problem(M, K, widths, R, adapters, seed=M + K + R, slot_ranks=slot_ranks)
    codes, scales, h = check_k1(p, quantize=not w8a16, config=cfg)
    y = torch.full((M, sum(widths)), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_gemm_lora(p["x"] if w8a16 else codes, None if w8a16 else scales, p["w_q"], p["w_scale"], h, p["b"],
                     p["meta"], w8a16=w8a16, slot_ranks=p["slot_ranks"], config=cfg, out=y)
    assert not y.isnan().any(), "y not fully written (or read NaN past a slot's rank)"
    err = rel_err(y, reference_y(p, w8a16=w8a16))
    assert err <= Y_TOL, f"relative Frobenius error {err:.2e} > {Y_TOL:.2e}"
    # The one-call API composes the same two launches.
    y2 = triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"], w8a16=w8a16,
                            slot_ranks=p["slot_ranks"], config=cfg)
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))


def test_bitwise_deterministic_with_split_k():
    cfg = TritonLoraConfig(k1_split_k=3, k1_block_r=16, k2_block_n=32, k2_block_k=64, k2_block_r=16)
    p = make_problem(17, 192, [32, 16, 16], 32, 4, seed=11, slot_ranks=[32, 16, 8, 32])
    outs = [triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"],
                               slot_ranks=p["slot_ranks"], config=cfg) for _ in range(2)]
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int16), outs[0].view(torch.int16))
    hs = [triton_quant_shrink(p["x"], p["a"], p["meta"], slot_ranks=p["slot_ranks"], config=cfg)[2] for _ in range(2)]
    assert torch.equal(hs[0].view(torch.int32), hs[1].view(torch.int32))
    # Split-K only reorders fp32 sums, and the arrival counters are left at zero for the next launch.
    h1 = triton_quant_shrink(p["x"], p["a"], p["meta"], slot_ranks=p["slot_ranks"],
                             config=TritonLoraConfig(k1_split_k=1, k1_block_r=16))[2]
    assert rel_err(hs[0], h1) <= H_TOL
    assert int(tp._COUNTERS[str(p["x"].device)].abs().sum()) == 0


def test_token_order_and_adapter_groups_survive_shuffled_slots():
    """Tokens of one adapter scattered through the batch: y must come back in token order."""
    p = make_problem(17, 64, [32], 16, 3, seed=5, none_fraction=0.4)
    y = triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"])
    y_ref = reference_y(p, w8a16=False)
    per_row = ((y.double() - y_ref.double()).norm(dim=1) / y_ref.double().norm(dim=1))
    assert per_row.max().item() <= 4 * Y_TOL


def test_empty_batch():
    p = make_problem(4, 64, [32], 16, 1)
    x = p["x"][:0]
    y = triton_lora_linear(x, p["w_q"], p["w_scale"], p["a"], p["b"], build_meta(p["slots"][:0].to(DEVICE), 1))
    assert y.shape == (0, 32)


# ----------------------------------------------------------------------------- CUDA-graph capture and the cached tables
#
# The first vLLM run on the H200 failed in CUDA-graph capture: a pointer table missing from the
# cache was made inside the capture with torch.tensor(host list, device=cuda), a pageable copy
# CUDA refuses there. It was missing because the 256-entry LRU held fewer tables than Qwen3-8B's
# 144 layers use per forward (288 pointer tables), so every lookup missed, warm-up or not. These
# tests model a capture on the CPU: ``tp._capturing()`` is True inside ``capture()``, and
# torch.tensor(..., device=...) raises there as CUDA does.

class FakeCapture:
    def __init__(self, monkeypatch):
        self.on = False
        monkeypatch.setattr(tp, "_capturing", lambda: self.on, raising=False)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.on)
        real = torch.tensor

        def guarded(data, *args, **kw):
            if self.on and kw.get("device") is not None:
                raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless "
                                   "the CPU tensor is pinned")
            return real(data, *args, **kw)

        monkeypatch.setattr(torch, "tensor", guarded)

    def __enter__(self):
        self.on = True
        return self

    def __exit__(self, *exc):
        self.on = False


@pytest.fixture
def capture(monkeypatch):
    for name, value in (("_TABLE_CACHE", tp.OrderedDict()), ("_GRAPH_TABLES", {}), ("_CAPTURE_ONLY", []),
                        ("_COUNTERS", {}), ("_RETIRED_COUNTERS", []), ("_WARNED", set())):
        monkeypatch.setattr(tp, name, value, raising=False)
    return FakeCapture(monkeypatch)


def _layer_buffers(L=2, R=16, K=64, widths=(32, 16, 16)):
    a = [torch.zeros(L, 1, R, K, dtype=torch.bfloat16, device=DEVICE) for _ in widths]
    b = [torch.zeros(L, 1, n, R, dtype=torch.bfloat16, device=DEVICE) for n in widths]
    return a, b


def _layer_tables(a, b, block_n=32):
    """The tables a launch of this layer reads, looked up as _launch_k1 / _launch_k2 do."""
    a3, b3 = [t[:, 0] for t in a], [t[:, 0] for t in b]
    return (tp._pointer_table(a3, DEVICE), tp._pointer_table(b3, DEVICE),
            tp._col_tile_table([t.shape[1] for t in b3], block_n, DEVICE))


def test_warm_up_then_capture_over_more_tables_than_an_lru_holds(capture):
    """vLLM's flow without prepare_tables: every layer runs eagerly, then the same step is
    captured. 150 layers (300 pointer tables): no table may be made inside the capture, and the
    capture must get the very tensors the warm-up made."""
    layers = [_layer_buffers() for _ in range(150)]
    eager = [_layer_tables(a, b) for a, b in layers]
    with capture:
        captured = [_layer_tables(a, b) for a, b in layers]
    assert tp._CAPTURE_ONLY == []
    assert all(x is y for e, c in zip(eager, captured) for x, y in zip(e, c))


def test_tables_a_capture_used_are_never_evicted(capture, monkeypatch):
    monkeypatch.setattr(tp, "_TABLE_CACHE_SIZE", 3)  # one layer's tables
    a, b = _layer_buffers()
    first = _layer_tables(a, b)
    with capture:
        in_graph = _layer_tables(a, b)
    assert all(x is y for x, y in zip(first, in_graph))
    for _ in range(20):  # eager traffic through the small LRU
        _layer_tables(*_layer_buffers())
    assert all(x is y for x, y in zip(_layer_tables(a, b), in_graph))
    assert all(any(t is g for g in tp._GRAPH_TABLES.values()) for t in in_graph)


def test_device_built_tables_hold_the_host_values():
    for widths in ([4096, 1024, 1024], [12288, 12288], [48], [16, 40, 8]):
        for block_n in tp.COL_BLOCK_NS:
            want = torch.tensor(tp._col_tile_rows(widths, block_n), dtype=torch.int32).reshape(-1, 4)
            assert torch.equal(tp._make_col_tile_table(widths, block_n, DEVICE).cpu(), want)
    a, _ = _layer_buffers()
    assert tp._make_pointer_table([t.data_ptr() for t in a], DEVICE).tolist() == [t.data_ptr() for t in a]


CAPTURE_CONFIGS = [TritonLoraConfig(k1_split_k=3, k1_block_r=16, k2_block_n=bn, k2_block_k=64, k2_block_r=16)
                   for bn in (16, 32, 64)] + [None]


def test_prepared_layer_runs_under_capture_at_any_token_count(capture):
    """prepare_tables (what the plugin calls when vLLM creates the buffers) covers every config:
    a capture at a token count never run eagerly makes nothing, and computes what eager does."""
    p = make_problem(9, 128, [32, 16, 16], 16, 3, seed=4)
    tp.prepare_tables(p["a"], p["b"])
    made = (len(tp._GRAPH_TABLES), tp._COUNTERS[str(DEVICE)])
    for cfg in CAPTURE_CONFIGS:
        for M in (1, 9):
            meta = build_meta(p["slots"][:M].to(DEVICE), p["L"])
            with capture:
                y = triton_lora_linear(p["x"][:M], p["w_q"], p["w_scale"], p["a"], p["b"], meta, config=cfg)
            assert torch.equal(y.view(torch.int16), triton_lora_linear(p["x"][:M], p["w_q"], p["w_scale"], p["a"],
                                                                       p["b"], meta, config=cfg).view(torch.int16))
    assert tp._CAPTURE_ONLY == [] and tp._TABLE_CACHE == {}
    assert (len(tp._GRAPH_TABLES), tp._COUNTERS[str(DEVICE)]) == made
    with capture, pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        tp.prepare_tables(p["a"], p["b"])


def test_capture_miss_makes_a_graph_private_table(capture, caplog):
    """Nothing prepared, nothing run eagerly: the capture still works, with tables of its own
    (device fills the graph re-runs at each replay) that never enter the shared cache."""
    p = make_problem(5, 128, [32, 16], 16, 2, seed=8)
    cfg = TritonLoraConfig(k1_split_k=2, k1_block_r=16, k2_block_n=32, k2_block_k=64, k2_block_r=16)
    with caplog.at_level("WARNING", logger="vllm.epilora"), capture:
        y = triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"], config=cfg)
    assert len(tp._CAPTURE_ONLY) == 4  # A and B pointers, column tiles, counters
    assert tp._TABLE_CACHE == {} and tp._GRAPH_TABLES == {} and tp._COUNTERS == {}
    assert sum("not prepared before this CUDA-graph capture" in r.getMessage() for r in caplog.records) == 3
    y_eager = triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"], config=cfg)
    assert torch.equal(y.view(torch.int16), y_eager.view(torch.int16))
    assert len(tp._TABLE_CACHE) == 3 and len(tp._CAPTURE_ONLY) == 4


def test_split_k_counters_a_graph_uses_are_never_replaced(capture):
    dev = str(DEVICE)
    small = tp._split_k_counters(DEVICE, 8)
    with capture:
        assert tp._split_k_counters(DEVICE, 8) is small  # big enough: shared
        own = tp._split_k_counters(DEVICE, small.numel() + 1)  # too small: the graph's own
    assert own is not small and tp._COUNTERS[dev] is small and tp._CAPTURE_ONLY == [own]
    assert int(own.abs().sum()) == 0
    bigger = tp._split_k_counters(DEVICE, small.numel() + 1)  # eager growth keeps the old alive
    assert bigger.numel() > small.numel() and tp._COUNTERS[dev] is bigger and tp._RETIRED_COUNTERS == [small]


# ----------------------------------------------------------------------------- input validation

def _bad(p, **over):
    args = dict(x=p["x"], w_q=p["w_q"], w_scale=p["w_scale"], lora_a_slices=p["a"], lora_b_slices=p["b"],
                meta=p["meta"])
    kw = {k: over.pop(k) for k in ("w8a16", "out", "slot_ranks", "config") if k in over}
    args.update(over)
    return lambda: triton_lora_linear(args["x"], args["w_q"], args["w_scale"], args["lora_a_slices"],
                                      args["lora_b_slices"], args["meta"], **kw)


BAD_INPUTS = [
    ("x-dtype", TypeError, "x must be bfloat16", lambda p: dict(x=p["x"].float())),
    ("x-3d", ValueError, "2-D", lambda p: dict(x=p["x"][None])),
    ("x-stride", ValueError, "contiguous", lambda p: dict(x=p["x"].t().contiguous().t())),
    ("w-dtype", TypeError, "float8_e4m3fn", lambda p: dict(w_q=p["w_q"].to(torch.bfloat16))),
    ("w-k", ValueError, "K=64", lambda p: dict(w_q=p["w_q"][:, :32].contiguous())),
    ("w-stride", ValueError, "contiguous", lambda p: dict(w_q=p["w_q"].t().contiguous().t())),
    ("w-scale", TypeError, "one-element float32", lambda p: dict(w_scale=torch.ones(2, device=DEVICE))),
    ("a-dtype", TypeError, "bfloat16", lambda p: dict(lora_a_slices=[t.float() for t in p["a"]])),
    ("a-stride", ValueError, "contiguous", lambda p: dict(lora_a_slices=[t.transpose(2, 3).contiguous().transpose(2, 3)
                                                                          for t in p["a"]])),
    ("a-align", ValueError, "16-byte aligned",
     lambda p: dict(lora_a_slices=[torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)[1:].view(t.shape)
                                   for t in p["a"]])),
    ("a-k", ValueError, "has K=32", lambda p: dict(lora_a_slices=[t[..., :32].contiguous() for t in p["a"]])),
    ("a-rank", ValueError, "rank mismatch",
     lambda p: dict(lora_a_slices=[p["a"][0], p["a"][1][:, :, :8].contiguous()])),
    ("b-rank", ValueError, "rank mismatch", lambda p: dict(lora_b_slices=[t[..., :8].contiguous() for t in p["b"]])),
    ("b-count", ValueError, "one of each", lambda p: dict(lora_b_slices=p["b"][:1])),
    ("b-widths", ValueError, "add up", lambda p: dict(lora_b_slices=[p["b"][0], p["b"][1][:, :, :8].contiguous()])),
    ("a-slots", ValueError, "adapter slots", lambda p: dict(lora_a_slices=[t[:1].contiguous() for t in p["a"]])),
    ("meta-tokens", ValueError, "describes 3 tokens",
     lambda p: dict(meta=build_meta(torch.zeros(3, dtype=torch.int32, device=DEVICE), 2))),
    ("meta-slots", ValueError, "slot ids out of range",
     lambda p: dict(meta=build_meta(p["slots"].to(DEVICE), 7))),
    ("meta-kind", TypeError, "build_meta", lambda p: dict(meta=object())),
    ("slot-ranks-dtype", TypeError, "int32",
     lambda p: dict(slot_ranks=torch.ones(2, dtype=torch.int64, device=DEVICE))),
    ("slot-ranks-shape", ValueError, "max_loras=2",
     lambda p: dict(slot_ranks=torch.ones(1, dtype=torch.int32, device=DEVICE))),
    ("out-shape", ValueError, "out must be",
     lambda p: dict(out=torch.empty(5, 47, dtype=torch.bfloat16, device=DEVICE))),
    ("out-dtype", ValueError, "out must be", lambda p: dict(out=torch.empty(5, 48, device=DEVICE))),
    ("config", ValueError, "power of two", lambda p: dict(config=TritonLoraConfig(k2_block_n=48))),
]


@pytest.mark.parametrize("name,exc,msg,change", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(name, exc, msg, change):
    p = make_problem(5, 64, [32, 16], 16, 2, seed=1)
    with pytest.raises(exc, match=msg):
        _bad(p, **change(p))()


def test_slot_id_validation():
    validate_token_lora_mapping(torch.tensor([-1, 0, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"slot ids out of range \[-1, 4\) at tokens \[1, 2\]"):
        validate_token_lora_mapping(torch.tensor([0, 4, -2], dtype=torch.int32), 4)
    with pytest.raises(TypeError):
        validate_token_lora_mapping(torch.tensor([0.0]), 4)


@pytest.mark.skipif(HAS_GPU, reason="CPU-only check")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(tp, "_kernels_interpreted", lambda: False)
    p = make_problem(2, 64, [32], 16, 1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _bad(p)()


# ----------------------------------------------------------------------------- the plugin's switch

def test_force_switch(monkeypatch):
    monkeypatch.delenv(tp.ENV_FORCE_TRITON, raising=False)
    assert not tp.triton_path_forced()
    monkeypatch.setenv(tp.ENV_FORCE_TRITON, "1")
    assert tp.triton_path_forced()
    assert not tp.triton_path_applies("cpu")
    monkeypatch.setenv(tp.ENV_FORCE_TRITON, "0")
    assert not tp.triton_path_forced()


@gpu
def test_applies_on_gpu(monkeypatch):
    monkeypatch.setenv(tp.ENV_FORCE_TRITON, "1")
    assert tp.triton_path_applies("cuda")
    monkeypatch.delenv(tp.ENV_FORCE_TRITON)
    assert tp.triton_path_applies("cuda") == (torch.cuda.get_device_capability() == (8, 9))


# ----------------------------------------------------------------------------- GPU, full shapes

QWEN3_8B = {
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate_up": ([12288, 12288], 4096),
    "down": ([4096], 12288),
}
GPU_TOKENS = [1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 100, 256, 511, 2048]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("M", GPU_TOKENS)
@pytest.mark.parametrize("shape", list(QWEN3_8B))
def test_gpu_full_shapes(shape, M):
    widths, K = QWEN3_8B[shape]
    p = make_problem(M, K, widths, 64, min(4, M), seed=M, max_loras=4, slot_ranks=[64, 16, 32, 8])
    for w8a16 in (False, True):
        codes, scales, h = check_k1(p, quantize=not w8a16)
        y = torch.full((M, sum(widths)), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"], w8a16=w8a16,
                           slot_ranks=p["slot_ranks"], out=y)
        assert not y.isnan().any()
        err = rel_err(y, reference_y(p, w8a16=w8a16))
        assert err <= Y_TOL, f"{shape} M={M} w8a16={w8a16}: relative error {err:.2e} > {Y_TOL:.2e}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("R", [8, 16, 256])
def test_gpu_ranks(R):
    widths, K = QWEN3_8B["qkv"]
    for M in (5, 300):
        p = make_problem(M, K, widths, R, 3, seed=R + M, max_loras=4)
        y = triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"])
        assert rel_err(y, reference_y(p, w8a16=False)) <= Y_TOL


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 33, 2048])
def test_gpu_bitwise_deterministic(M):
    widths, K = QWEN3_8B["qkv"]
    p = make_problem(M, K, widths, 64, 4, seed=7, max_loras=4)
    runs = [triton_lora_linear(p["x"], p["w_q"], p["w_scale"], p["a"], p["b"], p["meta"]) for _ in range(5)]
    for y in runs[1:]:
        assert torch.equal(y.view(torch.int16), runs[0].view(torch.int16))
    assert int(tp._COUNTERS[str(p["x"].device)].abs().sum()) == 0


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Capture once, then refresh x and the metadata in place: replays match eager runs."""
    widths, K = QWEN3_8B["qkv"]
    M = 24
    p = make_problem(M, K, widths, 64, 4, seed=9, max_loras=4)
    x, meta = p["x"].clone(), p["meta"]
    run = lambda: triton_lora_linear(x, p["w_q"], p["w_scale"], p["a"], p["b"], meta)  # noqa: E731
    run()  # builds the cached tables outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = run()
    for seed in range(3):
        g = _gen(100 + seed)
        x.copy_((torch.randn(M, K, generator=g) * 2).to(torch.bfloat16))
        slots = torch.randint(-1, 4, (M,), generator=g, dtype=torch.int32)
        meta.prepare(slots.to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph.view(torch.int16), run().view(torch.int16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "graph-private-tables"])
def test_gpu_capture_of_a_layer_never_run_eagerly(prepared, monkeypatch):
    """vLLM's flow: the tables are prepared when the adapter buffers are made, and a capture size
    may be the layer's first call. Without prepare_tables the capture makes its own tables (device
    fills re-run at each replay). Either way replays match eager runs. The kernels are compiled
    first on another layer of the same shapes (a JIT compile cannot happen inside a capture)."""
    # Fresh table registries: tables are keyed by buffer address, and the allocator hands this
    # case's buffers the addresses an earlier case prepared (run6: the unprepared case found them).
    monkeypatch.setattr(tp, "_GRAPH_TABLES", {})
    monkeypatch.setattr(tp, "_TABLE_CACHE", type(tp._TABLE_CACHE)())
    widths, K = QWEN3_8B["qkv"]
    M = 8
    other = make_problem(M, K, widths, 64, 4, seed=20, max_loras=4)
    triton_lora_linear(other["x"], other["w_q"], other["w_scale"], other["a"], other["b"], other["meta"])
    p = make_problem(M, K, widths, 64, 4, seed=21, max_loras=4)
    if prepared:
        tp.prepare_tables(p["a"], p["b"])
    before = len(tp._CAPTURE_ONLY)
    x, meta = p["x"].clone(), p["meta"]
    run = lambda: triton_lora_linear(x, p["w_q"], p["w_scale"], p["a"], p["b"], meta)  # noqa: E731
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = run()
    assert (len(tp._CAPTURE_ONLY) == before) == prepared
    for seed in range(3):
        g = _gen(200 + seed)
        x.copy_((torch.randn(M, K, generator=g) * 2).to(torch.bfloat16))
        meta.prepare(torch.randint(-1, 4, (M,), generator=g, dtype=torch.int32).to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph.view(torch.int16), run().view(torch.int16))


@pytest.mark.parametrize("sms,cc", [(132, (9, 0)), (142, (8, 9))])
def test_k1_split_counts_are_powers_of_two(monkeypatch, sms, cc):
    """Few compile-time variants: every batch size and projection shape gets a power-of-two K1
    split (each distinct SPLIT_K is a separate Triton compile during serving). The CUDA branch of
    pick_config with the device's SM count and capability stubbed (an H200, an L40S)."""
    monkeypatch.setattr(tp, "_num_sms", lambda device: sms)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    seen = set()
    for m in list(range(1, 600)) + [1000, 2048, 4096, 8192]:
        for k, slices in ((4096, 3), (4096, 2), (4096, 1), (12288, 1), (14336, 1)):
            cfg = tp.pick_config(m, k, 64, slices, torch.device("cuda"))
            split = cfg.k1_split_k
            assert split & (split - 1) == 0, (m, k, slices, split)
            assert tp._k1_split(k, cfg)[0] == split  # whole k-tiles per split: the count holds
            seen.add(split)
    assert seen == {1, 2, 4, 8, 16}


@pytest.mark.parametrize("sms,cc", [(132, (9, 0)), (142, (8, 9))])
def test_configs_depend_on_the_token_bucket_only(monkeypatch, sms, cc):
    """Every batch size of a dispatch token bucket gets the configuration of the bucket's top, so
    the bucket warm-up's compile serves them all (run10: first-use compiles stalled serving)."""
    from epilora_cute.dispatch import token_bucket

    monkeypatch.setattr(tp, "_num_sms", lambda device: sms)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    for k, slices, n in ((4096, 3, 6144), (4096, 2, 24576), (12288, 1, 4096)):
        for m in list(range(1, 300)) + [511, 513, 1000, 1025, 3000, 8191]:
            top = token_bucket(m)
            assert (tp.pick_config(m, k, 64, slices, torch.device("cuda"), N=n)
                    == tp.pick_config(top, k, 64, slices, torch.device("cuda"), N=n)), (m, k, slices)
