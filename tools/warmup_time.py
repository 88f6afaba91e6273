"""How long the dispatch's bucket warm-up takes per projection shape, with and without the CUDA-graph
limit (docs/perf.md v1.01), on the GPU machine — what an engine's start spends in it.

    python3 tools/warmup_time.py [--capacity 8192] [--graph-max 128] [--projections qkv,o,gate_up,down]
                                 [--order none,limit,none] [--out DIR]

Each entry of --order is one round: a fresh dispatcher with an empty table in a temporary
directory (so every key is timed, as on a new machine), the warm-up state reset, the graph limit
set ("none": unknown, every bucket settled in both modes as before v1.01; "limit": --graph-max,
buckets above it eager only); then per projection of Qwen3-8B one eager call of 64 tokens whose
metadata holds --capacity tokens, which settles every token bucket up to it (the plugin's first
call in vLLM's profile run). The first round also pays the first-use costs (module loads, the Triton
path's compiles): compare the later rounds. Prints a row per round and projection (seconds, keys
timed per mode) and writes warmup_time.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CALL_TOKENS = 64  # the call that starts the warm-up (its own bucket is settled by the call itself)


def run_round(setting: str, graph_max: int, capacity: int, projections, table_dir: Path) -> list[dict]:
    from epilora_cute import bucket_warmup, dispatch, ops
    from epilora_cute.metadata import build_meta
    from tools.bench_decode import LayerCase

    dispatch.set_graph_max_tokens(None if setting == "none" else graph_max)
    d = dispatch.Dispatcher(dispatch.DispatchTable(table_dir / "dispatch.json"))
    dispatch.set_dispatcher(d)
    bucket_warmup.reset()
    rows = []
    for proj in projections:
        c = LayerCase(proj, CALL_TOKENS, 64, num_adapters=8)
        meta = build_meta(c.mapping, c.max_loras, max_num_tokens=capacity)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, meta, out=c.y)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        keys = [k for k in d.decisions() if k.k == proj.k and tuple(k.slices) == tuple(proj.slices)]
        rows.append({"setting": setting, "projection": proj.name, "seconds": seconds,
                     "graph_keys": sum(k.mode == "graph" for k in keys), "eager_keys": sum(k.mode == "eager" for k in keys)})
        print(f"{setting:6s} {proj.name:8s} {seconds:6.2f} s  keys graph {rows[-1]['graph_keys']:2d} "
              f"eager {rows[-1]['eager_keys']:2d}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", type=int, default=8192, help="tokens the batch metadata holds (the warm-up's top)")
    ap.add_argument("--graph-max", type=int, default=128, help="the largest CUDA-graph batch for 'limit' rounds")
    ap.add_argument("--projections", default="qkv,o,gate_up,down")
    ap.add_argument("--order", default="none,limit,none", help="rounds: 'none' or 'limit', comma-separated")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "build")))
    args = ap.parse_args(argv)
    order = args.order.split(",")
    if not set(order) <= {"none", "limit"}:
        ap.error("--order takes 'none' and 'limit'")
    if not torch.cuda.is_available():
        print("warmup_time: needs a CUDA GPU (the warm-up times kernels)")
        return 2
    from epilora_cute import bucket_warmup
    from tools.bench_decode import QWEN3_8B

    wanted = args.projections.split(",")
    projections = [p for p in QWEN3_8B if p.name in wanted]
    os.environ[bucket_warmup.ENV] = "1"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, setting in enumerate(order):
            table_dir = Path(tmp) / f"round{i}"
            table_dir.mkdir()
            rows += [dict(r, round=i) for r in run_round(setting, args.graph_max, args.capacity, projections, table_dir)]
    for i, setting in enumerate(order):
        total = sum(r["seconds"] for r in rows if r["round"] == i)
        print(f"round {i} ({setting}): {total:.2f} s for {len(projections)} projections")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warmup_time.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "capacity": args.capacity, "graph_max": args.graph_max,
         "call_tokens": CALL_TOKENS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
