"""Bench section `k2sweep`: where the no-adapter K2 loses its bandwidth, one knob at a time.

Per Qwen3-8B projection at one token (EPILORA_SWEEP_TOKENS for another count; ``sweep_builds``),
CUDA-graph replays with the L2 flushed (median): every sweep build (bm, stages, CTAs per SM) at every split-K
(cluster size) that divides the k-blocks sensibly, next to
  vllm_gemm_us   vLLM's cutlass_scaled_mm alone on the same pre-quantized x (the anchor)
  null_us        a graph holding one trivial kernel (the timing method's own floor)
  floor_us       weight bytes / measured read bandwidth
Rows: one per (projection, build, split); `gbs` is the weight bytes over the time. The best
row per projection says which knob the decode path's defaults should turn (docs/perf.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase  # noqa: E402
from tools.gpu_timing import read_bandwidth_gbs, time_graph  # noqa: E402

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def _vllm_gemm(c: LayerCase, x_q, x_s):
    try:
        from vllm import _custom_ops as vops
    except Exception:
        return None
    w_t = c.w_q.t()
    return lambda: vops.cutlass_scaled_mm(x_q, w_t, scale_a=x_s, scale_b=c.w_s, out_dtype=torch.bfloat16)


def sweep_builds(m: int) -> list:
    """The no-adapter K2 builds timed at ``m`` tokens: at one to eight tokens (bn 8) the sweep set
    (`k2_gemm.sweep_configs`); above, the prebuilt no-adapter builds of the smallest token tile
    that holds ``m`` (the default and its one-CTA-per-SM variants), so that EPILORA_SWEEP_TOKENS=32
    times something (the sweep set alone has bn 8 only)."""
    from kernels_dsl import k2_gemm

    bn = next((t for t in k2_gemm.TOKEN_TILES if t >= m), None)
    if bn is None:
        raise ValueError(f"k2sweep: {m} tokens exceed the decode token tiles {k2_gemm.TOKEN_TILES}")
    if bn == 8:
        return k2_gemm.sweep_configs()
    return sorted({c for c in k2_gemm.prebuild_configs() if not c.lora and c.bn == bn},
                  key=lambda c: (c.bm, c.ctas, c.stages))


def bench_k2sweep(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("k2sweep: needs an sm_90 GPU; skipped")
        return []
    from epilora_cute.kernels import get_kernel
    from epilora_cute.ops import quantize_fp8_per_token
    from kernels_dsl import k2_gemm

    bw = read_bandwidth_gbs()
    one = torch.zeros(1, device="cuda")
    rows = [{"section": "k2sweep", "proj": "-", "build": "null graph", "null_us": time_graph(lambda: one.add_(1))}]
    m = int(os.environ.get("EPILORA_SWEEP_TOKENS", "1"))
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    for p in QWEN3_8B:
        c = LayerCase(p, m, 64)
        x_q, x_s = quantize_fp8_per_token(c.x)
        x_s = x_s.reshape(-1).contiguous()
        nbytes = p.n * p.k
        base = {"section": "k2sweep", "proj": p.name, "M": m, "floor_us": nbytes / (bw * 1e9) * 1e6}
        vg = _vllm_gemm(c, x_q, x_s.reshape(-1, 1))
        if vg is not None:
            rows.append(base | {"build": "vLLM cutlass_scaled_mm", "us": time_graph(vg)})
            rows[-1]["gbs"] = nbytes / rows[-1]["us"] / 1e3
        nk = p.k // 128
        for cfg in sweep_builds(m):
            if any(w % cfg.bm for w in p.slices) or cfg.bn < m:
                continue
            try:
                kern = get_kernel(k2_gemm, cfg, "sm_90a")
            except Exception as e:
                rows.append(base | {"build": cfg.name(), "error": f"{type(e).__name__}: {e}"[:160]})
                continue
            for split in SPLITS:
                if nk // split < 2 or (quick and split not in (1, 2, 4, 8)):
                    continue
                spec = k2_gemm.launch(cfg, w_q=c.w_q, w_scale=c.w_s, x_q=x_q, x_scale=x_s, y=c.y, sync=sync,
                                      n_quant=0, split=split)
                row = base | {"build": cfg.name(), "split": split, "ctas": spec["grid"][0] * spec["grid"][1]}
                try:
                    row["us"] = time_graph(lambda: kern(*spec["args"], grid=spec["grid"], smem=spec["smem"],
                                                        pdl=False, cluster=spec["cluster"]))
                    row["gbs"] = nbytes / row["us"] / 1e3
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:160]
                rows.append(row)
        best = min((r for r in rows if r.get("proj") == p.name and "split" in r and "us" in r),
                   key=lambda r: r["us"], default=None)
        if best:
            print(f"k2sweep {p.name}: best {best['build']} split {best['split']} {best['us']:.1f} us "
                  f"({best['gbs']:.0f} GB/s; floor {base['floor_us']:.1f} us)", flush=True)
    return rows


SECTIONS = {"k2sweep": bench_k2sweep}
