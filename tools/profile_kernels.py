"""Launch the large-batch kernels of given cases a few times each, for a profiler (Nsight Compute).

    python tools/profile_kernels.py [--launches N] [--paths k1,gemm,expand_add,triton] CASE [CASE ...]

CASE is ``proj:M:adapters`` with proj one of Qwen3-8B's qkv / o / gate_up / down (rank 64, tokens
assigned round-robin, max_loras = max(8, adapters) as in the `hybrid_stages` bench section), e.g.
``qkv:2048:1 down:256:32``. Each selected stage runs ``--launches`` times (default 2: the first
pays the module load) on the same preallocated buffers, eagerly, with a device synchronize after
each case. Timing is not this tool's job (tools/bench.py is); it gives a profiler the launches:

    ncu --clock-control none --set full --kernel-name regex:'K1Kernel|ExpandAdd' --launch-skip 1 \
        -o prof python3 tools/profile_kernels.py qkv:2048:1

Stages: k1 (kernels_dsl/k1_shrink), gemm (the vendor FP8 GEMM on K1's codes), expand_add
(kernels_dsl/expand_add on K1's h), shrink_stream (kernels_dsl/shrink_stream, bf16 h), shrink_grouped
(kernels_dsl/shrink_grouped at its launch rule, bf16 h), prefill_k2
(kernels_dsl/k2_prefill, the op's build with the adapter epilogue, on K1's codes stored in adapter
order), triton (the whole Triton path: its quant+shrink and gemm_lora kernels); the decode paths
(`gpu_session.sh profile-decode`): decode (the shrink + K2 on its x_q, 1..32 tokens), at 1..8
tokens decode_sq / decode_fh (the shrink + the self-quantizing K2, or the K2 that computes h
itself), and no_adapter (K2 without the adapter's epilogue).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase  # noqa: E402
from tools.bench_prefill import max_loras_for  # noqa: E402

from kernels_dsl import k2_prefill  # noqa: E402

RANK = 64
# The prefill K2 builds --k2-builds names, by Build.tag().
K2_BUILDS = {b.tag(): b for b in k2_prefill.MAIN_LOOP_BUILDS + (k2_prefill.OP_BUILD,)}
STAGES = ("k1", "gemm", "expand_add", "shrink_stream", "shrink_grouped", "prefill_k2", "triton", "decode", "decode_sq",
          "decode_fh", "no_adapter")


def parse_case(text: str) -> tuple[str, int, int]:
    """'qkv:2048:1' -> ('qkv', 2048, 1), with the projection name checked."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"case {text!r}: expected proj:M:adapters")
    proj, m, a = parts[0], int(parts[1]), int(parts[2])
    names = [p.name for p in QWEN3_8B]
    if proj not in names:
        raise ValueError(f"case {text!r}: projection must be one of {names}")
    if m < 1 or a < 1:
        raise ValueError(f"case {text!r}: M and adapters must be >= 1")
    return proj, m, a


def launchers(case: LayerCase, stages, k2_builds=("overlap_vs",), k2_lora=True) -> dict:
    """stage -> zero-argument launch on buffers allocated once: the `hybrid_stages` bench's
    (tools/bench_hybrid_stages.HybridStages: K1 run once so that every stage has real inputs)."""
    from epilora_cute import ops
    from tools.bench_hybrid_stages import HybridStages

    c = case

    def op(path):
        return lambda: ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path=path)

    fns = {k: op(k) for k in ("triton", "decode", "decode_sq", "decode_fh", "no_adapter")}
    if any(k in stages for k in ("k1", "gemm", "expand_add", "shrink_stream", "shrink_grouped")):
        hs = HybridStages(case)
        fns |= {k: fn for k, fn in hs.launchers().items() if k in ("k1", "gemm", "expand_add")}
        if "shrink_stream" in stages:  # at any size (the bench times it only where the dispatch may take it)
            from kernels_dsl.shrink_stream import stream_shrink

            fns["shrink_stream"] = lambda: stream_shrink(c.x, c.lora_a, c.meta, hs.h_bf16)
        if "shrink_grouped" in stages:  # at any size (the dispatch offers it at 33..512 tokens)
            from kernels_dsl.shrink_grouped import grouped_shrink

            fns["shrink_grouped"] = lambda: grouped_shrink(c.x, c.lora_a, c.meta, hs.h_bf16)
    if "prefill_k2" in stages:  # the chosen builds (tags; default the op's), on K1's sorted codes and h
        from tools.bench_prefill_k2 import PrefillK2Case

        pk = PrefillK2Case(case)
        for tag in k2_builds:
            fns[f"prefill_k2[{tag}]"] = pk.k2(K2_BUILDS[tag], k2_lora)
    names = [n for k in stages for n in ([f"prefill_k2[{t}]" for t in k2_builds] if k == "prefill_k2" else [k])]
    return {n: fns[n] for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--paths", default="k1,expand_add")
    ap.add_argument("--k2-builds", default="overlap_vs",
                    help="prefill_k2: the builds to launch, by k2_prefill.Build.tag() (comma-separated)")
    ap.add_argument("--k2-no-adapter", action="store_true", help="prefill_k2: the no-adapter variant")
    args = ap.parse_args(argv)
    stages = [s for s in args.paths.split(",") if s]
    k2_builds = tuple(args.k2_builds.split(","))
    if set(k2_builds) - set(K2_BUILDS):
        ap.error(f"unknown --k2-builds {sorted(set(k2_builds) - set(K2_BUILDS))}; choose from {sorted(K2_BUILDS)}")
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stages {bad}; choose from {STAGES}")
    cases = [parse_case(t) for t in args.cases]
    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA GPU")
        return 1
    byname = {p.name: p for p in QWEN3_8B}
    for proj, m, a in cases:
        case = LayerCase(byname[proj], m, RANK, num_adapters=a, max_loras=max_loras_for(a))
        fns = launchers(case, stages, k2_builds, not args.k2_no_adapter)
        torch.cuda.synchronize()
        for name, fn in fns.items():
            for _ in range(args.launches):
                fn()
            torch.cuda.synchronize()
            print(f"{proj}:{m}:{a} {name} x{args.launches}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
