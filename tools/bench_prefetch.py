"""Bench section `prefetch`: the next projection's weight prefetched into L2 between projections
(epilora_cute.prefetch.prefetch_l2, docs/perf.md v0.77), in the engine's order.

The engine runs other kernels between a layer's projections (the attention between qkv and o,
the residual add + norm before gate_up and before the next layer's qkv, the activation before
down). Here they are spin kernels (``torch.cuda._sleep``) of EPILORA_BENCH_WINDOWS = "attn,norm,act"
microseconds (default 8,2,2): they keep the GPU busy for that long without touching DRAM, which
is what the prefetch needs to gain anything. Two Qwen3-8B layers (distinct weights) per graph, so
the last projection's prefetch of the next layer's qkv is measured paying off; µs per layer.

Rows (CUDA-graph replays, L2 flushed before each, median), rank 64, one adapter:
  section "prefetch", what "layer": per token count
    windows_us                     the spin kernels alone
    vllm_fp8_us / vllm_lora_us     vLLM's paths between the windows (when vLLM is installed)
    ours_<path>_us                 our op (chain_pdl as the plugin calls it) between the windows
    ours_<path>_pf_us              the same, each projection followed by prefetch_l2 of the next
                                   one's weight (budgets: EPILORA_L2_PREFETCH "A,B" MB, default
                                   vllm_adapter.prefetch_plan.DEFAULT_BUDGET_MB)
    ours_<path>_pf2_us             the same prefetches on a second stream (BesidePrefetch, v0.80):
                                   forked after the projection, joined before the next one, so
                                   the window overlaps them
    *_pf_gain_us, *_pf2_gain_us    the column without prefetches minus the column with them
  section "prefetch", what "projection": one projection after a window, per projection (at the
  first token count; EPILORA_BENCH_PF_PROJECTIONS=0 leaves these rows out)
    pf_alone_us                    prefetch_l2 of its whole weight, alone: ~ a launch if the
                                   requests are fire-and-forget, ~ bytes / bandwidth if not
    after_window_us                window + the projection (our decode path)
    pf_after_window_us             prefetch of its weight + window + the projection
    pf_beside_window_us            the prefetch forked to a second stream, the window beside it,
                                   joined, then the projection (v0.80)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase, VllmPath  # noqa: E402
from tools.bench_hybrid_stages import time_stages  # noqa: E402
from tools.gpu_timing import time_graph  # noqa: E402

DEFAULT_WINDOWS_US = (8.0, 2.0, 2.0)  # attention, residual add + norm, activation
LAYERS = 2


def windows_us() -> tuple[float, float, float]:
    value = os.environ.get("EPILORA_BENCH_WINDOWS", "")
    if not value:
        return DEFAULT_WINDOWS_US
    attn, norm, act = (float(v) for v in value.split(","))
    return attn, norm, act


def window_before(attn: float, norm: float, act: float) -> tuple[float, ...]:
    """The window before each projection of QWEN3_8B (qkv, o, gate_up, down)."""
    return (norm, attn, norm, act)


def budgets_bytes() -> tuple[int, int]:
    from vllm_adapter import prefetch_plan

    b = prefetch_plan.budgets() or prefetch_plan.DEFAULT_BUDGET_MB
    return int(b[0] * prefetch_plan.MB), int(b[1] * prefetch_plan.MB)


def budget_after(attn_bytes: int, other_bytes: int) -> tuple[int, ...]:
    """The prefetch budget after each projection: for the next one's weight (qkv -> o across the
    attention, the rest across a norm or the activation)."""
    return (attn_bytes, other_bytes, other_bytes, other_bytes)


class Spin:
    """torch.cuda._sleep calibrated to microseconds on this GPU (it counts clock cycles)."""

    def __init__(self):
        cycles = 200_000
        us = time_graph(lambda: torch.cuda._sleep(cycles), reps=20, warmup=3)
        self.cycles_per_us = cycles / us

    def __call__(self, us: float):
        n = int(us * self.cycles_per_us)
        return (lambda: torch.cuda._sleep(n)) if n > 0 else (lambda: None)


def _our_path(m: int) -> str:
    from kernels_dsl import k2_gemm

    return "decode_sq" if k2_gemm.self_quant_applies(m, 4096) and k2_gemm.self_quant_applies(m, 12288) else "decode"


def _op(c, path):
    """One projection through our op as the plugin calls it (chain_pdl)."""
    from epilora_cute import ops

    def launch():
        return ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path=path, chain_pdl=True)
    return launch


def _engine_order(layers, before, after=None, join=None):
    """Each layer's projections, each after its window; after[l][i](), when given, right after
    projection i of layer l; join(), when given, after each window (before the projection) and at
    the end (a CUDA-graph capture must join every stream it forked)."""
    def run():
        for li, fns in enumerate(layers):
            for i, f in enumerate(fns):
                before[i]()
                if join is not None:
                    join()
                f()
                if after is not None:
                    after[li][i]()
        if join is not None:
            join()
    return run


def bench_prefetch(quick: bool) -> list[dict]:
    from epilora_cute import prefetch

    try:
        import vllm  # noqa: F401
        have_vllm = True
    except Exception:
        have_vllm = False
        print("prefetch: vLLM is not installed: the vLLM columns are left out")
    spin = Spin()
    beside = prefetch.BesidePrefetch()  # one second stream for every _pf2 column and row
    attn, norm, act = windows_us()
    before = [spin(us) for us in window_before(attn, norm, act)]
    budget = budget_after(*budgets_bytes())
    env_tokens = os.environ.get("EPILORA_BENCH_TOKENS")
    tokens = [int(t) for t in env_tokens.split(",")] if env_tokens else ([1, 8] if quick else [1, 4, 8, 16, 32])
    rows = []
    for m in tokens:
        layers = [[LayerCase(p, m, 64, seed=s) for p in QWEN3_8B] for s in range(LAYERS)]
        flat = [c for cases in layers for c in cases]
        row = {"section": "prefetch", "what": "layer", "M": m, "rank": 64, "windows": [attn, norm, act],
               "budgets_mb": [b / (1 << 20) for b in budget[:2]],
               "windows_us": time_graph(_engine_order([[lambda: None] * 4] * LAYERS, before)) / LAYERS}

        def prefetches_for(layer_index, launch):
            nxt = [flat[(layer_index * 4 + i + 1) % len(flat)] for i in range(4)]
            return [lambda c=c, b=b: launch(c.w_q, b) for c, b in zip(nxt, budget)]

        columns = {}
        if have_vllm:
            vp = [[VllmPath(c) for c in cases] for cases in layers]
            columns["vllm_fp8"] = ([[p.base for p in ps] for ps in vp], None, None)
            columns["vllm_lora"] = ([[p.with_lora for p in ps] for ps in vp], None, None)
        for name, path in (("ours_" + _our_path(m), _our_path(m)), ("ours_no_adapter", "no_adapter")):
            fns = [[_op(c, path) for c in cases] for cases in layers]
            columns[name] = (fns, None, None)
            columns[name + "_pf"] = (fns, [prefetches_for(li, prefetch.prefetch_l2) for li in range(LAYERS)], None)
            columns[name + "_pf2"] = (fns, [prefetches_for(li, beside.launch) for li in range(LAYERS)], beside.join)
        for name, (fns, pfs, join) in columns.items():
            try:
                row[f"{name}_us"] = time_graph(_engine_order(fns, before, pfs, join)) / LAYERS
            except Exception as e:  # a column that can't run is reported, not fatal to the bench
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        for suffix in ("_pf", "_pf2"):
            for name in [k[:-len(suffix + "_us")] for k in row if k.endswith(suffix + "_us")]:
                if f"{name}_us" in row:
                    row[f"{name}{suffix}_gain_us"] = row[f"{name}_us"] - row[f"{name}{suffix}_us"]
        rows.append(row)
        _print_row(row, 1)
        if m == tokens[0] and os.environ.get("EPILORA_BENCH_PF_PROJECTIONS", "1") != "0":
            rows += _per_projection(layers[0], spin, attn, _our_path(m), beside)
    return rows


def _per_projection(cases, spin, attn, path, beside) -> list[dict]:
    from epilora_cute import ops
    from epilora_cute.prefetch import prefetch_l2

    rows = []
    window = spin(attn)  # the attention's window before every projection here: the largest one
    for c in cases:
        def proj(c=c):
            ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path=path)

        def after_window(c=c):
            window()
            proj()

        def pf_after_window(c=c):
            prefetch_l2(c.w_q)
            window()
            proj()

        def pf_beside_window(c=c):
            beside.launch(c.w_q)
            window()
            beside.join()
            proj()

        row = {"section": "prefetch", "what": "projection", "proj": c.proj.name, "M": c.m, "path": path,
               "weight_mb": c.w_q.numel() / (1 << 20), "window_us": attn}
        time_stages(row, {"pf_alone": lambda c=c: prefetch_l2(c.w_q), "after_window": after_window,
                          "pf_after_window": pf_after_window, "pf_beside_window": pf_beside_window},
                    timer=time_graph)
        rows.append(row)
        _print_row(row, 2)
    return rows


def _print_row(row: dict, digits: int) -> None:
    print("prefetch " + "  ".join(f"{k}={v:.{digits}f}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in row.items() if k != "section"), flush=True)


SECTIONS = {"prefetch": bench_prefetch}
