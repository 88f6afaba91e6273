"""How much of the prefill K2's time is per tile and how much per k-block: the same output (M
tokens × N features, so the same tiles and waves) at several K, for our K2 (no adapter, the op's
main-loop build, `k2`, and its persistent twin, `k2_pers`, v0.65; run26 also swept the since
removed W-multicast `k2_mc`, v0.67, and six-stage `k2_st6`, v0.68) and cuBLASLt
(`torch._scaled_mm`) side by side.

    python tools/bench_k_sweep.py [--m 2048] [--n 24576] [--ks 512,1024,2048,4096,8192] [--out DIR]

A least-squares line time = fixed + slope · K per kernel: `fixed` is what every tile pays whatever
its main loop (launch, prologue until the first WGMMA, epilogue, the tail wave), the part a
persistent kernel that overlaps one tile's epilogue with the next tile's main loop can hide;
`slope` is the main loop's cost per unit of K. perf.md (session 23) predicted from Nsight
Compute's stall samples that about half of the K2's time at gate_up × 2048 tokens is outside its
main loop. CUDA-graph replays with the L2 flushed, median (tools/gpu_timing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("the points need two different x")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def measure(m: int, n: int, k: int) -> dict:
    from epilora_cute.kernels import get_kernel
    from epilora_cute.reference import quantize_fp8_per_tensor, quantize_fp8_per_token
    from kernels_dsl import k2_prefill as P
    from tools.bench_prefill_k2 import scaled_mm_launcher
    from tools.gpu_timing import time_graph

    g = torch.Generator(device="cpu").manual_seed(k)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) * 0.02).cuda()
    w_q, w_s = quantize_fp8_per_tensor(w)
    x_q, s_x = quantize_fp8_per_token(x)
    tok = torch.arange(m, dtype=torch.int32, device="cuda")
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")  # the persistent build's (re-armed per launch)

    def k2(build):
        _, cfg = P.select((n,), m, build=build)
        spec = P.launch(cfg, w_q=w_q, w_scale=w_s, x_q_sorted=x_q, x_scale_sorted=s_x.reshape(-1), y=y,
                        token_indices_sorted=tok, tile_counter=counter if cfg.persistent else None)
        kern = get_kernel(P, cfg, "sm_90a")
        return cfg, lambda: kern(*spec["args"], grid=spec["grid"], smem=spec["smem"], pdl=False,
                                 cluster=spec["cluster"])

    cfg, fn = k2(P.OP_BUILD)
    fns = {"k2": fn, "k2_pers": k2(P.PERSISTENT_BUILD)[1], "scaled_mm": scaled_mm_launcher(x_q, s_x, w_q, w_s)}
    T, NT = -(-m // cfg.bn), n // cfg.bm
    row = {"M": m, "N": n, "K": k, "config": cfg.name(), "tiles": T * NT}
    for name, fn in fns.items():
        row[f"{name}_us"] = time_graph(fn)
    return row


def summarize(rows: list[dict]) -> dict:
    out = {}
    ks = [r["K"] for r in rows]
    for name in [k[:-3] for k in rows[0] if k.endswith("_us")]:
        fixed, slope = fit_line(ks, [r[f"{name}_us"] for r in rows])
        out[name] = {"fixed_us": fixed, "us_per_1k_K": slope * 1024}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--ks", default="512,1024,2048,4096,8192")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_k_sweep: needs a CUDA GPU")
        return 1
    rows = [measure(args.m, args.n, int(k)) for k in args.ks.split(",")]
    for r in rows:
        cols = "  ".join(f"{k[:-3]} {v:8.1f}" for k, v in r.items() if k.endswith("_us"))
        print(f"M={r['M']} N={r['N']} K={r['K']:6d} tiles={r['tiles']}  {cols} us", flush=True)
    fit = summarize(rows)
    for name, f in fit.items():
        print(f"{name:10s} fixed {f['fixed_us']:7.1f} us  + {f['us_per_1k_K']:6.1f} us per 1024 of K")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "k_sweep.json").write_text(json.dumps({"rows": rows, "fit": fit}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
