"""What the adapter costs at prefill sizes with our kernels, and what it would cost with the
vendor's bf16 GEMM per request segment (a candidate, measured before any of it is built).

In a prefill chunk every request's tokens are contiguous and carry one adapter, so the batch is a
few long segments (the throughput run: 32 requests of 512 tokens per 16384-token chunk). Our
hybrid path spends K1 (quantization + split-K shrink) and expand-add on them: run22's profile put
them at 435 and 388 µs per call at 16384 tokens, against floors of ~100 and ~150 µs. Per segment,
the shrink h[seg] = x[seg] A_l^T and the expand y[seg] += h[seg] B_l^T are dense GEMMs the vendor
library runs near its peak — if the host knows the segments (vLLM's mapping is built on the host
each step; nothing here reads the device).

Columns per Qwen3-8B projection, µs (CUDA-graph replays, L2 flushed, median):
  k1            our K1 (codes, scales and h in one launch)
  quant         our quantization kernel alone (what the segment variant still needs)
  seg_shrink    torch.mm per segment and slice into h (bf16 out, as cuBLAS writes it)
  expand_add    our expand-add
  seg_expand    torch.addmm per segment and slice into y's columns of that slice

    python3 tools/bench_segments.py [--tokens 16384] [--segment 512] [--adapters 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def measure(tokens: int, segment: int, adapters: int, rank: int = 64, max_loras: int = 8) -> list[dict]:
    from epilora_cute.metadata import build_meta
    from epilora_cute.ops import quantize_fp8_per_token
    from kernels_dsl.expand_add import expand_add
    from kernels_dsl.k1_shrink import k1_quant_shrink
    from tools.bench_decode import QWEN3_8B
    from tools.gpu_timing import time_graph

    dev = "cuda"
    nseg = -(-tokens // segment)
    seg_lora = [s % adapters for s in range(nseg)]
    mapping = torch.tensor([seg_lora[t // segment] for t in range(tokens)], dtype=torch.int32, device=dev)
    meta = build_meta(mapping, max_loras)
    bounds = [(s * segment, min(tokens, (s + 1) * segment)) for s in range(nseg)]
    rows = []
    for proj in QWEN3_8B:
        k, widths = proj.k, proj.slices
        x = torch.randn(tokens, k, device=dev).bfloat16()
        a = [(torch.randn(max_loras, 1, rank, k, device=dev) * 0.02).bfloat16() for _ in widths]
        b = [(torch.randn(max_loras, 1, n, rank, device=dev) * 0.02).bfloat16() for n in widths]
        y = torch.zeros(tokens, sum(widths), device=dev, dtype=torch.bfloat16)
        h32 = torch.empty(len(widths), tokens, rank, device=dev)
        h16 = torch.empty(len(widths), tokens, rank, device=dev, dtype=torch.bfloat16)
        starts = [sum(widths[:i]) for i in range(len(widths))]

        def k1():
            k1_quant_shrink(x, a, meta, h=h32)

        def quant():
            quantize_fp8_per_token(x)

        def seg_shrink():
            for (lo, hi), lid in zip(bounds, seg_lora):
                for s in range(len(widths)):
                    torch.mm(x[lo:hi], a[s][lid, 0].t(), out=h16[s, lo:hi])

        def ea():
            expand_add(y, h32, b, meta)

        def seg_expand():
            for (lo, hi), lid in zip(bounds, seg_lora):
                for s, (c0, n) in enumerate(zip(starts, widths)):
                    ys = y[lo:hi, c0:c0 + n]
                    ys.addmm_(h16[s, lo:hi], b[s][lid, 0].t())

        row = {"proj": proj.name, "tokens": tokens, "segment": segment, "adapters": adapters}
        for name, fn in (("k1", k1), ("quant", quant), ("seg_shrink", seg_shrink), ("expand_add", ea),
                         ("seg_expand", seg_expand)):
            try:
                row[name] = time_graph(fn, reps=20, warmup=3)
            except Exception as e:  # noqa: BLE001 - one column failing is reported, not fatal
                row[name] = None
                row[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)
        del x, a, b, y, h32, h16
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--segment", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "build" / "bench")))
    args = ap.parse_args(argv)
    rows = measure(args.tokens, args.segment, args.adapters)
    layer = {c: sum(r[c] for r in rows if r.get(c) is not None) for c in ("k1", "quant", "seg_shrink",
                                                                              "expand_add", "seg_expand")}
    print("layer: " + " ".join(f"{c}={v:.1f}" for c, v in layer.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"segments_{args.tokens}_{args.segment}_{args.adapters}.json").write_text(
        json.dumps({"rows": rows, "layer": layer}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
