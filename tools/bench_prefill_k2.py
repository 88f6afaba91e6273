"""Bench section `prefill_k2`: the prefill K2 alone against the vendor FP8 GEMM, per accumulation mode.

    python tools/bench.py --sections prefill_k2 [--quick] [--out DIR]

Issue #4 asks for ≤ 1.1× vLLM's FP8 GEMM at 2048 tokens with one adapter, which the hybrid path
cannot reach (its expand-add's y round trip alone is over the margin, docs/perf.md v0.33): the
adapter has to be in the GEMM's epilogue, so the prefill K2's main loop has to be as fast as the
vendor's. Per Qwen3-8B projection, per (tokens M, adapters A), CUDA-graph replays with the L2
flushed (median), the activations already quantized in adapter-sorted order (K1 with
sorted_codes, the same for every column):

  vllm_gemm_us        vLLM's cutlass_scaled_mm on the same codes (no adapter; absent without vLLM)
  scaled_mm_us        torch._scaled_mm on the same codes (cuBLASLt; always there)
  k2_<mode>_us        the prefill K2 without adapter, Config.accum = mode (k2_prefill.ACCUM_MODES)
  k2_lora_<mode>_us   the same with the grouped adapter epilogue (rank 64, A adapters)
  ..._vs_us           the same builds with 16-byte output stores (Config.vstore)
  expand_add_us       the hybrid's expand-add on the same h (what the epilogue replaces)
                      (so prefill = K1 + k2_lora against hybrid = K1 + GEMM + expand-add)
  <col>_tflops        base FLOPs / time
  overlap_bitwise     the "overlap" K2's y equal bit for bit to the "serial" one's (they sum in
                      the same order), with and without adapter

Plus one "layer" row per (M, A) summing the four projections. Knobs: EPILORA_BENCH_TOKENS
(default 64,256,2048,8192; --quick 2048), EPILORA_BENCH_ADAPTERS (default 1,8).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase, Projection  # noqa: E402
from tools.gpu_timing import time_graph  # noqa: E402

RANK = 64
DEFAULT_TOKENS = (64, 256, 2048, 8192)
QUICK_TOKENS = (2048,)
DEFAULT_ADAPTERS = (1, 8)


def settings(quick: bool, env=None) -> tuple[list[int], list[int]]:
    """(token counts, adapter counts) from --quick and EPILORA_BENCH_TOKENS / _ADAPTERS (the
    knobs' one parser, bench_prefill.tokens_and_adapters: a bad value is a clear error)."""
    from tools.bench_prefill import tokens_and_adapters

    env = os.environ if env is None else env
    return tokens_and_adapters(env, QUICK_TOKENS if quick else DEFAULT_TOKENS, DEFAULT_ADAPTERS)


def base_flops(p: Projection, m: int) -> float:
    return 2.0 * m * p.n * p.k


class PrefillK2Case:
    """One projection's inputs for the prefill K2: K1's codes / scales in adapter-sorted order (as
    the op's prefill path stores them) and h."""

    def __init__(self, c: LayerCase):
        from epilora_cute.ops import _full_ranks, _slice_start
        from kernels_dsl.k1_shrink import k1_quant_shrink

        self.c = c
        self.xs, self.ss, self.h = k1_quant_shrink(c.x, c.lora_a, c.meta, sorted_codes=True)
        self.slot_ranks = _full_ranks(c.max_loras, c.rank, c.x.device)
        self.slice_start = _slice_start(tuple(c.proj.slices), c.x.device)
        self.y = torch.empty(c.m, c.proj.n, dtype=torch.bfloat16, device=c.x.device)
        self.tile_counter = torch.zeros(1, dtype=torch.int32, device=c.x.device)  # persistent builds
        torch.cuda.synchronize()

    def k2(self, build, lora: bool):
        """A zero-argument launcher of the prefill K2 (select()'s tile; build: k2_prefill.Build)."""
        from epilora_cute.kernels import get_kernel
        from kernels_dsl import k2_prefill as P

        c = self.c
        c_l, c_n = P.select(tuple(c.proj.slices), c.m, c.rank, build)
        cfg = c_l if lora else c_n
        kw = {}
        if lora:
            kw = dict(h=self.h, active_lora_ids=c.meta.active_lora_ids, num_active=c.meta.num_active,
                      lora_token_start_loc=c.meta.lora_token_start_loc, slot_ranks=self.slot_ranks,
                      slice_start=self.slice_start, lora_b=c.lora_b)
        if cfg.persistent:
            kw["tile_counter"] = self.tile_counter
        spec = P.launch(cfg, w_q=c.w_q, w_scale=c.w_s, x_q_sorted=self.xs, x_scale_sorted=self.ss, y=self.y,
                        token_indices_sorted=c.meta.token_indices_sorted_by_lora_ids, **kw)
        kern = get_kernel(P, cfg, "sm_90a")
        return lambda: kern(*spec["args"], grid=spec["grid"], smem=spec["smem"], pdl=False,
                            cluster=spec["cluster"])

    def result(self, fn) -> torch.Tensor:
        self.y.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        return self.y.clone()


def scaled_mm_launcher(x_q, s_x, w_q, w_s):
    """A zero-argument cuBLASLt FP8 GEMM (`torch._scaled_mm`) on per-token activation scales and a
    per-tensor weight scale: its row-wise scaling takes both scale vectors (w_s broadcast)."""
    sw = w_s.reshape(1, 1).float().expand(1, w_q.shape[0]).contiguous()
    sx = s_x.reshape(-1, 1).float()
    return lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def _vendor(c: LayerCase, pk: PrefillK2Case) -> dict:
    # (the anchors multiply the sorted rows: a row order costs a GEMM nothing)
    fns = {"scaled_mm": scaled_mm_launcher(pk.xs, pk.ss, c.w_q, c.w_s)}
    try:
        from vllm import _custom_ops as vops
        w_t = c.w_q.t()
        fns["vllm_gemm"] = lambda: vops.cutlass_scaled_mm(pk.xs, w_t, scale_a=pk.ss, scale_b=c.w_s,
                                                          out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - no vLLM: the cuBLASLt anchor only
        pass
    return fns


def bench_projection(p: Projection, m: int, adapters: int) -> dict:
    from kernels_dsl import k2_prefill as P
    from kernels_dsl.expand_add import expand_add

    c = LayerCase(p, m, RANK, num_adapters=adapters, max_loras=max(8, adapters))
    pk = PrefillK2Case(c)
    row = {"section": "prefill_k2", "proj": p.name, "M": m, "adapters": adapters, "rank": RANK,
           "gflop": base_flops(p, m) / 1e9}
    fns = dict(_vendor(c, pk))
    launchers = {}
    for b in P.MAIN_LOOP_BUILDS:
        for lora in (False, True):
            name = f"k2_{'lora_' if lora else ''}{b.tag()}"
            try:
                launchers[name] = pk.k2(b, lora)
            except Exception as e:  # noqa: BLE001 - a build missing from the cache is reported
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    fns.update(launchers)
    y_ex = torch.zeros(m, p.n, dtype=torch.bfloat16, device=c.x.device)
    fns["expand_add"] = lambda: expand_add(y_ex, pk.h, c.lora_b, c.meta)
    for name, fn in fns.items():
        try:
            us = time_graph(fn)
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            continue
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = base_flops(p, m) / (us * 1e-6) / 1e12
    for pre in ("k2_", "k2_lora_"):  # every build writes serial's bits
        ser = launchers.get(f"{pre}serial")
        if ser is None:
            continue
        ys = pk.result(ser).view(torch.int16)
        for b in P.MAIN_LOOP_BUILDS[1:]:
            other = launchers.get(f"{pre}{b.tag()}")
            if other is not None:
                row[f"{pre}{b.tag()}_bitwise"] = bool(torch.equal(pk.result(other).view(torch.int16), ys))
    return row


def layer_row(rows: list[dict]) -> dict:
    out = {"section": "prefill_k2", "proj": "layer", "M": rows[0]["M"], "adapters": rows[0]["adapters"],
           "rank": RANK, "gflop": sum(r["gflop"] for r in rows)}
    for k in rows[0]:
        if k.endswith("_us") and all(k in r for r in rows):
            out[k] = sum(r[k] for r in rows)
            out[k[:-3] + "_tflops"] = out["gflop"] / out[k] * 1e3
    ref = out.get("vllm_gemm_us", out.get("scaled_mm_us"))
    if ref:
        for k in list(out):
            if k.startswith("k2_") and k.endswith("_us"):
                out[k[:-3] + "_over_vendor"] = out[k] / ref
    return out


def format_row(r: dict) -> str:
    cols = [k for k in r if k.endswith("_us")]
    return (f"{r['proj']:>8} M={r['M']:5d} A={r['adapters']:2d}  "
            + "  ".join(f"{k[:-3]} {r[k]:8.1f}" for k in cols))


def bench_prefill_k2(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("prefill_k2: needs a Hopper GPU; skipped")
        return []
    tokens, adapters = settings(quick)
    rows = []
    for m in tokens:
        for a in adapters:
            prow = [bench_projection(p, m, a) for p in QWEN3_8B]
            for r in prow:
                print(format_row(r), flush=True)
            lr = layer_row(prow)
            print(format_row(lr), flush=True)
            rows += prow + [lr]
    return rows


SECTIONS = {"prefill_k2": bench_prefill_k2}
