"""The main job (`make run`).

On a machine with a GPU: the benchmark (tools/bench.py) against vLLM's kernels.
Without one: build the whole kernel set for sm_90a into the kernel cache (what a GPU machine
without nvidia-cutlass-dsl then loads), and run the reference and the public ops on a small
multi-adapter batch with the shapes of one Qwen3-8B layer, reporting what each produced.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from . import ops, reference
from .metadata import build_meta

ROOT = Path(__file__).resolve().parents[1]


def _cpu_demo() -> None:
    from .prebuild import prebuild

    t0 = time.perf_counter()
    rows = prebuild("sm_90a", verbose=False)
    print(f"kernel cache: {len(rows)} kernels for sm_90a ready in {time.perf_counter() - t0:.1f} s "
          f"({sum(r['cubin_bytes'] for r in rows) / 1e6:.1f} MB of cubins)")

    g = torch.Generator().manual_seed(0)
    m, k, widths, rank, loras = 7, 4096, (4096, 1024, 1024), 64, 3
    x = torch.randn(m, k, generator=g).bfloat16()
    w_q, w_s = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, generator=g) * 0.02)
    a = [torch.randn(loras, 1, rank, k, generator=g).bfloat16() * 0.01 for _ in widths]
    b = [torch.randn(loras, 1, n, rank, generator=g).bfloat16() * 0.01 for n in widths]
    mapping = torch.tensor([2, -1, 0, 2, 1, -1, 0], dtype=torch.int32)
    meta = build_meta(mapping, loras)
    codes, scales = ops.quantize_fp8_per_token(x)
    y = reference.lora_linear(x, w_q, w_s, a, b, mapping)
    base = reference.fp8_scaled_mm(codes, scales, w_q, w_s)
    delta = (y - base).norm(dim=1) / base.norm(dim=1)
    print(f"reference qkv projection (Qwen3-8B shapes, {m} tokens, {loras} rank-{rank} adapters, "
          f"slots {mapping.tolist()}):")
    print(f"  adapter groups in token order {meta.sorted_lora_ids[:m].tolist()}, "
          f"starts {meta.lora_token_start_loc[:meta.num_active.item() + 1].tolist()}")
    print("  relative adapter update per token: " + " ".join(f"{v:.3f}" for v in delta.tolist()))
    assert all(delta[i] == 0 for i in (1, 5)), "tokens without adapter must get no update"


def main() -> int:
    if torch.cuda.is_available():
        return subprocess.call([sys.executable, str(ROOT / "tools" / "bench.py")], cwd=ROOT)
    print("no GPU here: building the kernel set and running the reference (see README for the GPU record)")
    _cpu_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
