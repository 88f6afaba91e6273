"""Time the portable Triton path (issue 6): two launches per LoRA linear, CUDA-graph replays,
256 MB zeroed before each replay to flush L2, median (tools/gpu_timing.time_graph).

    python tools/bench_triton.py [--shapes qkv,o,gate_up,down] [--tokens 1,16,64,256,2048]
                                 [--ranks 16,64] [--modes w8a8,w8a16] [--adapters 4] [--json FILE]

``bench_rows(shapes, tokens, ranks)`` returns one dict per (shape, tokens, rank, mode): the
microseconds of our two kernels, and for scale the microseconds of torch._scaled_mm on the same
FP8 operands (base GEMM only: no quantization, no LoRA; None where torch refuses the shape),
TFLOP/s of base + LoRA math, and GB/s of the least DRAM traffic (W, active adapters, x, y).
Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen3-8B's LoRA-carrying linears: output slice widths, K.
QWEN3_8B = {
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate_up": ([12288, 12288], 4096),
    "down": ([4096], 12288),
}
DEFAULT_TOKENS = [1, 16, 64, 256, 2048]
DEFAULT_RANKS = [16, 64]

Shapes = Union[Sequence[str], Mapping[str, tuple]]


def _layer(widths: Sequence[int], K: int, M: int, R: int, num_adapters: int, seed: int = 0):
    """Random bf16 x, FP8 weight, vLLM-layout adapters, and metadata with some tokens unadapted."""
    from epilora_cute.metadata import build_meta
    from epilora_cute.reference import quantize_fp8_per_tensor

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    x = randn(M, K).to(torch.bfloat16)
    w_q, w_scale = quantize_fp8_per_tensor(randn(sum(widths), K) / K ** 0.5)
    L = max(num_adapters, 1)
    a = [(randn(L, 1, R, K) / K ** 0.5).to(torch.bfloat16) for _ in widths]
    b = [(randn(L, 1, n, R) / R ** 0.5).to(torch.bfloat16) for n in widths]
    slots = torch.arange(M, device=dev, dtype=torch.int32) % L
    slots[4::5] = -1  # every fifth token without adapter (none when M <= 4)
    return x, w_q, w_scale, a, b, build_meta(slots, L)


def _scaled_mm_us(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor):
    """torch._scaled_mm on the same FP8 operands, row-wise scales (the base GEMM alone)."""
    from epilora_cute.reference import quantize_fp8_per_token
    from tools.gpu_timing import time_graph

    xq, sx = quantize_fp8_per_token(x)
    sw = w_scale.reshape(1, 1).expand(1, w_q.shape[0]).contiguous()
    fn = lambda: torch._scaled_mm(xq, w_q.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        fn()
    except (RuntimeError, ValueError):
        return None
    return time_graph(fn)


def bench_rows(shapes: Shapes, tokens: Iterable[int], ranks: Iterable[int], *,
               modes: Sequence[str] = ("w8a8",), num_adapters: int = 4, baseline: bool = True) -> list[dict]:
    """Time triton_lora_linear for every (shape, tokens, rank, mode). ``shapes``: names of
    QWEN3_8B or a {name: (slice widths, K)} mapping. Needs a CUDA GPU."""
    from tools.gpu_timing import time_graph
    from vllm_adapter.triton_path import triton_lora_linear

    table = dict(shapes) if isinstance(shapes, Mapping) else {name: QWEN3_8B[name] for name in shapes}
    rows = []
    for name, (widths, K) in table.items():
        N = sum(widths)
        for M in tokens:
            base_us = None
            for R in ranks:
                x, w_q, w_scale, a, b, meta = _layer(widths, K, M, R, min(num_adapters, M))
                if baseline and base_us is None:
                    base_us = _scaled_mm_us(x, w_q, w_scale)
                for mode in modes:
                    y = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
                    run = lambda: triton_lora_linear(x, w_q, w_scale, a, b, meta, w8a16=mode == "w8a16",  # noqa: E731
                                                     out=y)
                    us = time_graph(run)
                    adapters = min(num_adapters, M)
                    # Least DRAM traffic: W, the active adapters' A and B, x in, y out.
                    min_bytes = N * K + adapters * R * (len(widths) * K + N) * 2 + M * (K + N) * 2
                    rows.append(dict(shape=name, M=M, N=N, K=K, rank=R, adapters=adapters, mode=mode,
                                     us=round(us, 2), scaled_mm_us=None if base_us is None else round(base_us, 2),
                                     tflops=round(2 * M * (N * K + len(widths) * R * K + N * R) / us / 1e6, 1),
                                     gbs=round(min_bytes / us / 1e3, 1)))
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["shape", "M", "rank", "mode", "us", "scaled_mm_us", "tflops", "gbs"]
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>12}" for c in cols))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(QWEN3_8B))
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)))
    ap.add_argument("--modes", default="w8a8,w8a16")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton: no CUDA GPU on this machine; nothing to time.")
        return 0
    rows = bench_rows(args.shapes.split(","), [int(t) for t in args.tokens.split(",")],
                      [int(r) for r in args.ranks.split(",")], modes=args.modes.split(","),
                      num_adapters=args.adapters)
    print(f"# {torch.cuda.get_device_name()}; Triton path, CUDA graphs, L2 flushed, median us")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
