"""Bench section `layer`: one Qwen3-8B decoder layer's four projections at decode sizes.

Columns, all from one run (CUDA-graph replays, L2 flushed before each, median):
  floor_us       FP8 weight bytes / measured read bandwidth
  vllm_fp8_us    vLLM's scaled_fp8_quant + cutlass_scaled_mm (no adapter)
  vllm_lora_us   the same + vLLM's LoRA shrink/expand Triton kernels (default configs)
  ours_*_us      our paths, when the K2 kernels are importable (see OUR_PATH_ARGS); the *_chain
                 columns launch each projection's first kernel with PDL behind the previous
                 projection's K2 (lora_linear_fp8(chain_pdl=True)): in the layer rows that hides
                 a launch and prologue per projection boundary, in the per-projection rows (one
                 projection per graph) they should equal their unchained columns; the decode_sq
                 columns: 1..8 tokens with K2 quantizing x itself (docs/perf.md v0.29); decode_fh:
                 the same K2 computing h too, one launch per projection (v0.43)
  *_foreign_us   with EPILORA_BENCH_FOREIGN=1, every column above once more with a short foreign
                 kernel (an elementwise op on a 4096-element buffer, no PDL trigger) before each
                 projection: the engine's order, where Inductor's norm / activation kernel precedes
                 each projection, so a chained projection starts only once that kernel completed
                 (docs/perf.md, session 19: the e2e's adapter cost is the unchained one)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpu_timing import read_bandwidth_gbs, time_graph  # noqa: E402


@dataclass(frozen=True)
class Projection:
    name: str
    k: int
    slices: tuple[int, ...]

    @property
    def n(self) -> int:
        return sum(self.slices)


QWEN3_8B = (
    Projection("qkv", 4096, (4096, 1024, 1024)),
    Projection("o", 4096, (4096,)),
    Projection("gate_up", 4096, (12288, 12288)),
    Projection("down", 12288, (4096,)),
)


class LayerCase:
    """Weights, adapters and activations of one projection, built once per (projection, M, rank)."""

    def __init__(self, proj: Projection, m: int, rank: int, num_adapters: int = 1, max_loras: int = 8, seed: int = 0,
                 device: str = "cuda"):
        from epilora_cute import reference
        from epilora_cute.metadata import build_meta

        g = torch.Generator(device=device).manual_seed(seed)
        dev = device
        self.proj, self.m, self.rank = proj, m, rank
        self.x = (torch.randn(m, proj.k, device=dev, generator=g)).bfloat16()
        self.w_q, self.w_s = reference.quantize_fp8_per_tensor(
            torch.randn(proj.n, proj.k, device=dev, generator=g) * 0.02)
        self.lora_a = [torch.randn(max_loras, 1, rank, proj.k, device=dev, generator=g).bfloat16() * 0.02
                       for _ in proj.slices]
        self.lora_b = [torch.randn(max_loras, 1, n, rank, device=dev, generator=g).bfloat16() * 0.02
                       for n in proj.slices]
        self.mapping = (torch.arange(m, device=dev, dtype=torch.int32) % num_adapters)
        self.meta = build_meta(self.mapping, max_loras)
        self.y = torch.empty(m, proj.n, device=dev, dtype=torch.bfloat16)
        self.max_loras = max_loras


class VllmPath:
    """vLLM's own kernels for one projection: quant + CUTLASS FP8 GEMM (+ shrink/expand)."""

    def __init__(self, case: LayerCase):
        from vllm import _custom_ops as vops
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

        self.vops, self.shrink, self.expand = vops, lora_shrink, lora_expand
        self.c = case
        self.w_t = case.w_q.t()  # cutlass_scaled_mm takes B as [K, N] column-major
        self.meta = LoRAKernelMeta.make(case.max_loras, case.m, "cuda")
        self.meta.prepare_tensors(case.mapping)
        self.h = torch.empty(len(case.proj.slices), case.m, case.rank, device="cuda", dtype=torch.float32)

    def base(self) -> None:
        c = self.c
        xq, sx = self.vops.scaled_fp8_quant(c.x, use_per_token_if_dynamic=True)
        c.y = self.vops.cutlass_scaled_mm(xq, self.w_t, scale_a=sx, scale_b=c.w_s, out_dtype=torch.bfloat16)

    def with_lora(self) -> None:
        self.base()
        c = self.c
        args = self.meta.meta_args(c.m, False)
        self.shrink(c.x, c.lora_a, self.h, *args, 1.0)
        self.expand(self.h, c.lora_b, c.y, *args, offset_start=0, add_inputs=True)


# Our paths: name -> callable(case) returning a zero-argument launcher, or None when unavailable.
OUR_PATHS: dict[str, object] = {}


# Which of our paths to time (EPILORA_BENCH_OURS, comma-separated; default all but OPT_IN_COLUMNS):
# name -> (path, pdl, chain_pdl[, environment the launches run under]).
OUR_PATH_ARGS = {"no_adapter": ("no_adapter", True, False), "decode": ("decode", True, False),
                 "decode_nopdl": ("decode", False, False), "triton": ("triton", True, False),
                 "decode_chain": ("decode", True, True), "no_adapter_chain": ("no_adapter", True, True),
                 "decode_sq": ("decode_sq", True, False), "decode_sq_chain": ("decode_sq", True, True),
                 "decode_fh": ("decode_fh", True, False), "decode_fh_chain": ("decode_fh", True, True),
                 # decode_sq with the wide self-quantizing builds (perf.md v0.54), whatever the
                 # process's EPILORA_K2_SQ_WIDE says
                 "decode_sq_wide_chain": ("decode_sq", True, True, {"EPILORA_K2_SQ_WIDE": "1"}),
                 # decode_sq with the x-gated pair (perf.md v1.03; chained calls only)
                 "decode_sq_xg_chain": ("decode_sq", True, True, {"EPILORA_K2_XGATE": "1"})}
# Columns timed only when EPILORA_BENCH_OURS names them: experiments no GPU has verified yet (a
# hang there must not cost a record's whole bench).
OPT_IN_COLUMNS = ("decode_sq_xg_chain",)


def _under_env(env: dict, fn):
    """fn() with these environment variables set (the ops read their EPILORA_K2_* switches per
    call, so a graph captured here holds the kernels they pick)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _register_our_paths() -> None:
    try:
        from epilora_cute import ops
    except Exception:
        return
    default = ",".join(n for n in OUR_PATH_ARGS if n not in OPT_IN_COLUMNS)
    wanted = os.environ.get("EPILORA_BENCH_OURS", default).split(",")

    def make(path: str, pdl: bool, chain: bool, env: dict | None = None):
        def build(c: LayerCase):
            def launch():
                return ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y,
                                           path=path, pdl=pdl, chain_pdl=chain)
            return launch if not env else lambda: _under_env(env, launch)
        return build
    for name in wanted:
        if name in OUR_PATH_ARGS:
            OUR_PATHS[f"ours_{name}"] = make(*OUR_PATH_ARGS[name])


def bench_layer(quick: bool) -> list[dict]:
    try:
        import vllm  # noqa: F401
        have_vllm = True
    except Exception:
        have_vllm = False
        print("layer: vLLM is not installed: the vLLM anchor columns are left out")
    _register_our_paths()
    bw = read_bandwidth_gbs()
    rows = []
    env_tokens = os.environ.get("EPILORA_BENCH_TOKENS")
    tokens = ([int(t) for t in env_tokens.split(",")] if env_tokens else
              [1, 4, 16, 32] if quick else [1, 2, 4, 8, 16, 32])
    ranks = [64] if quick else [16, 64, 128]
    for rank in ranks:
        for m in tokens:
            cases = [LayerCase(p, m, rank) for p in QWEN3_8B]
            weight_bytes = sum(p.n * p.k for p in QWEN3_8B)
            row = {"section": "layer", "model": "Qwen3-8B", "M": m, "rank": rank,
                   "floor_us": weight_bytes / (bw * 1e9) * 1e6}
            columns = {}  # name -> one launcher per projection
            if have_vllm:
                vp = [VllmPath(c) for c in cases]
                columns["vllm_fp8"] = [p.base for p in vp]
                columns["vllm_lora"] = [p.with_lora for p in vp]
            for name, build in OUR_PATHS.items():
                try:
                    columns[name] = [build(c) for c in cases]
                except Exception as e:  # a path that can't run is reported, not fatal to the bench
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            foreign = _foreign_kernel() if os.environ.get("EPILORA_BENCH_FOREIGN") == "1" else None
            for name, fns in columns.items():
                for suffix, before in (("", None), ("_foreign", foreign)):
                    if suffix and before is None:
                        continue
                    try:
                        row[f"{name}{suffix}_us"] = time_graph(_in_order(fns, before))
                    except Exception as e:
                        row[f"{name}{suffix}_error"] = f"{type(e).__name__}: {e}"[:200]
            for suffix in ("", "_foreign"):
                if f"vllm_lora{suffix}_us" in row:
                    for name in OUR_PATHS:
                        if f"{name}{suffix}_us" in row:
                            row[f"{name}{suffix}_over_vllm"] = row[f"{name}{suffix}_us"] / row[f"vllm_lora{suffix}_us"]
            rows.append(row)
            print("layer " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items() if k != "section"), flush=True)
            if not quick and rank == 64:
                rows += _per_projection(cases, have_vllm, bw)
    return rows


def _in_order(fns, before=None):
    """One layer: each projection's launches, `before()` ahead of each one when given."""
    def run():
        for f in fns:
            if before is not None:
                before()
            f()
    return run


def _foreign_kernel():
    """A short kernel that is not ours (one elementwise launch, ~2 us, no PDL trigger): what
    precedes each projection in the engine."""
    buf = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    return lambda: buf.add_(1.0)


def _per_projection(cases: list[LayerCase], have_vllm: bool, bw: float) -> list[dict]:
    rows = []
    for c in cases:
        row = {"section": "projection", "proj": c.proj.name, "M": c.m, "rank": c.rank,
               "floor_us": c.proj.n * c.proj.k / (bw * 1e9) * 1e6}
        if have_vllm:
            vp = VllmPath(c)
            row["vllm_fp8_us"] = time_graph(vp.base)
            row["vllm_lora_us"] = time_graph(vp.with_lora)
        for name, build in OUR_PATHS.items():
            try:
                row[f"{name}_us"] = time_graph(build(c))
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


SECTIONS = {"layer": bench_layer}
