"""Bench section `hybrid_stages`: the hybrid path (issue #4) taken apart, stage by stage.

    python tools/bench.py --sections hybrid_stages [--quick] [--out DIR]

Per Qwen3-8B projection, rank 64, M in {32, 256, 2048} tokens, 1 and 32 adapters (tokens
assigned round-robin, max_loras as in the `prefill` section: max(8, adapters)), CUDA-graph
replays with the L2 flushed before each (median, tools/gpu_timing):

  k1_us          our K1 alone (kernels_dsl/k1_shrink.py: quantization + split-K shrink), outputs
                 preallocated
  k1_sorted_us   the same storing codes / scales in adapter-sorted row order (sorted_codes=True:
                 the prefill path's K1, v0.69)
  gemm_us        the vendor FP8 GEMM alone (ops.vendor_fp8_gemm: vLLM's cutlass_scaled_mm
                 writing y in place, cuBLAS without vLLM) on K1's codes and scales
  expand_add_us  our expand-add alone (kernels_dsl/expand_add.py) on K1's h, adding into y
  hybrid_us      the whole op, lora_linear_fp8(path="hybrid") (validation + the three launches), h fp32
  hybrid_par_us  the same with K1 on a second stream beside the quantization + GEMM (v0.34)
  hybrid_par_q_us  hybrid_par with that branch forked after the quantization (v0.58)
  hybrid_st_us, hybrid_par_st_us   the hybrid paths with the streamed shrink (v0.88) in place of K1,
                 serial / beside the quantization + GEMM (where dispatch.stream_bucket)
  hybrid_g_us, hybrid_par_g_us   the same with the shrink by adapter group (v0.90; where
                 dispatch.grouped_bucket, 33..512 tokens)
  shrink_grouped_us  the grouped shrink alone (kernels_dsl/shrink_grouped.py), h as bf16;
                 shrink_grouped_bn<N>_us / _s<S>_us: other token tiles, half / twice its split
  quant_us       our quantization kernel alone (ops.quantize_fp8_per_token: the streamed and
                 grouped paths' codes)
  shrink_stream_us   the streamed shrink alone (kernels_dsl/shrink_stream.py), h as bf16: with
                 quant_us, what replaces k1_hb_us on the streamed paths
  k1_hb_us, expand_add_hb_us, hybrid_hb_us, hybrid_par_hb_us, hybrid_par_q_hb_us   the same with h
                 stored / read as bf16 (v0.71: K1's h_bf16 builds, the op under EPILORA_HYBRID_H=bf16)
  k1_z1_us, expand_add_z1_us     the same kernels with the group split (grid z) forced to 1: the
                 launch geometry before v0.6 (timed only where the default z is > 1)
  k1_zN_us, expand_add_zN_us     with EPILORA_BENCH_ZSWEEP=1, also z = 2, 4, ..., 64 where it differs
                 from the default and a tile can have that many adapter groups: data for the
                 group-split rule (`choose_zsplit`), e.g. K1 at 32 tokens x 32 adapters (4x its floor)
  vllm_fp8_us, vllm_lora_us      vLLM's quantization + GEMM, and + its LoRA shrink/expand, for the
                 same projection (when vLLM imports), so vllm_lora - vllm_fp8 is vLLM's adapter cost
  k1_bm<B>_st<S>_us, expand_add_bm<B>_bn<N>_us   with EPILORA_BENCH_K1SWEEP=1, K1 and expand-add
                 under the alternative configurations of k1_shrink.sweep_configs (rows per CTA,
                 ring depth) and expand_add.sweep_configs (tile shape; `_ct<C>`: C column
                 tiles per CTA, v0.72; `_hb`: on the bf16 h): CTAs per SM; EPILORA_BENCH_EASWEEP=1:
                 the expand-add's sweep alone (=0: K1's without it);
                 expand_add_again_us, the selected expand-add timed again after every other column
  k1_again_us    the selected K1 timed again after every other column (always): the position
                 drift of compute-bound kernels (clocks after the GEMM columns, session 31)
  k1_floor_us / expand_floor_us   least DRAM traffic at the measured read bandwidth: x read +
                 codes written + the active adapters' A / y read and written + their B
  k1_cfg, k1_grid, expand_cfg, expand_grid   the launch geometry the op uses (host-side, no GPU)

One extra row per (M, adapters) with proj = "layer" sums the four projections. A stage that raises
is reported as `<stage>_error`. Knobs: EPILORA_BENCH_TOKENS, EPILORA_BENCH_ADAPTERS (as `prefill`).
Budget: 24 projection rows x <= 8 timed graphs of <= ~1 ms: well under a minute on the H200 (the
z sweep adds <= 12 graphs to each many-adapter row).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase, Projection  # noqa: E402
from tools.bench_prefill import max_loras_for, tokens_and_adapters  # noqa: E402
from tools.gpu_timing import read_bandwidth_gbs, time_graph  # noqa: E402

from epilora_cute.dispatch import grouped_bucket, stream_bucket  # noqa: E402

RANK = 64
TOKENS = (32, 256, 2048)
ADAPTERS = (1, 32)
STAGES = ("k1", "gemm", "expand_add", "hybrid", "hybrid_par", "hybrid_par_q")
HYBRID_PATHS = ("hybrid", "hybrid_par", "hybrid_par_q")
ZSWEEP = (2, 4, 8, 16, 32, 64)
ZSWEEP_ENV = "EPILORA_BENCH_ZSWEEP"
K1SWEEP_ENV = "EPILORA_BENCH_K1SWEEP"  # "1": also K1 / expand-add under their sweep_configs
EASWEEP_ENV = "EPILORA_BENCH_EASWEEP"  # "1": the expand-add's sweep_configs; "0": not with K1's


def _sweeps() -> tuple[bool, bool]:
    """(K1's sweep, the expand-add's sweep) as the environment asks for them: K1SWEEP=1 brings
    the expand-add's along unless EASWEEP=0; EASWEEP=1 alone sweeps the expand-add only."""
    k1 = os.environ.get(K1SWEEP_ENV) == "1"
    ea = os.environ.get(EASWEEP_ENV)
    return k1, ea == "1" or (k1 and ea != "0")


def settings(env: Mapping[str, str] | None = None) -> tuple[list[int], list[int]]:
    return tokens_and_adapters(os.environ if env is None else env, TOKENS, ADAPTERS)


def floors(p: Projection, m: int, adapters: int, rank: int, bw_gbs: float) -> dict:
    """Least DRAM traffic of each adapter kernel at the measured bandwidth (µs)."""
    active = min(adapters, m)
    k1_bytes = m * p.k * 2 + m * p.k + active * rank * p.k * len(p.slices) * 2  # x, codes, A
    ex_bytes = 2 * m * p.n * 2 + active * p.n * rank * 2  # y read + written, B
    per_us = 1e6 / (bw_gbs * 1e9)
    return {"k1_floor_us": k1_bytes * per_us, "expand_floor_us": ex_bytes * per_us}


def geometry(p: Projection, m: int, rank: int, max_loras: int) -> dict:
    """The launch geometry the hybrid op uses for this projection (host code only)."""
    from kernels_dsl import expand_add as ea
    from kernels_dsl import k1_shrink as k1

    kc = k1.select(len(p.slices), p.k, rank, m)
    ec = ea.select(len(p.slices), m, rank)
    (g1, _) = k1.grid(p.k, m, kc, max_loras=max_loras)
    g2 = ea.grid(p.slices, m, ec, max_loras=max_loras)
    return {"k1_cfg": kc.name(), "k1_grid": "x".join(map(str, g1)),
            "expand_cfg": ec.name(), "expand_grid": "x".join(map(str, g2))}


def sum_layer(rows: list[dict]) -> dict:
    """The four projections of one (M, adapters) as one layer row: every *_us column summed where
    all projections have it."""
    out = {k: rows[0][k] for k in ("section", "M", "adapters", "max_loras", "rank")}
    out["proj"] = "layer"
    keys = [k for k in rows[0] if k.endswith("_us")]
    for k in keys:
        if all(k in r for r in rows):
            out[k] = sum(r[k] for r in rows)
    if "hybrid_us" in out and all(f"{s}_us" in out for s in ("k1", "gemm", "expand_add")):
        out["stages_sum_us"] = out["k1_us"] + out["gemm_us"] + out["expand_add_us"]
    return out


def format_row(row: dict) -> str:
    head = f"hybrid_stages {row['proj']:>7s} M={row['M']:5d} A={row['adapters']:2d}"
    parts = [f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith("_us") and isinstance(v, float)]
    parts += [f"{k} ERROR ({v[:60]})" for k, v in row.items() if k.endswith("_error")]
    geo = [f"{k}={row[k]}" for k in ("k1_cfg", "k1_grid", "expand_cfg", "expand_grid") if k in row]
    return head + "  " + "  ".join(parts) + "  (us)" + ("\n    " + " ".join(geo) if geo else "")


def time_stages(row: dict, fns: Mapping[str, Callable[[], object]],
                timer: Callable[[Callable[[], object]], float] = time_graph) -> None:
    for name, fn in fns.items():
        try:
            row[f"{name}_us"] = timer(fn)
        except Exception as e:  # noqa: BLE001 - a stage that can't run is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]


class HybridStages:
    """Buffers of one projection's hybrid path, K1 run once so that every stage has real inputs."""

    def __init__(self, c: LayerCase):
        from kernels_dsl.k1_shrink import k1_quant_shrink

        self.c = c
        m, k = c.x.shape
        dev = c.x.device
        self.codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
        self.scales = torch.empty(m, 1, dtype=torch.float32, device=dev)
        self.h = torch.empty(len(c.proj.slices), m, c.rank, dtype=torch.float32, device=dev)
        self.h_bf16 = torch.empty(len(c.proj.slices), m, c.rank, dtype=torch.bfloat16, device=dev)
        self.y = torch.empty(m, c.proj.n, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty_like(self.y)
        k1_quant_shrink(c.x, c.lora_a, c.meta, self.codes, self.scales, self.h)
        self.h_bf16.copy_(self.h)  # what K1's bf16 store writes (the GPU tests check it bit for bit)
        torch.cuda.synchronize()

    def launchers(self) -> dict[str, Callable[[], object]]:
        from epilora_cute import ops
        from kernels_dsl.expand_add import expand_add
        from kernels_dsl.k1_shrink import k1_quant_shrink

        c = self.c

        def k1(h=self.h, **kw):
            return lambda: k1_quant_shrink(c.x, c.lora_a, c.meta, self.codes, self.scales, h, **kw)

        def ex(h=self.h, **kw):
            return lambda: expand_add(self.y, h, c.lora_b, c.meta, **kw)

        def op(path, h_env=None):
            def run():
                return ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=self.out, path=path)
            return run if h_env is None else _with_env(ops.HYBRID_H_ENV, h_env, run)

        # Columns compared with each other are timed next to each other: a column timed after the
        # large GEMMs can run at lower clocks (run30: the same K1 build 44.5 µs first, 47.8 after
        # the hybrid columns; docs/perf.md session 31), and k1_again repeats K1 at the end.
        fns = {"k1": k1(),
               # v0.71: h stored / read as bf16 (kernels alone, then the op with EPILORA_HYBRID_H=bf16)
               "k1_hb": k1(h=self.h_bf16),
               # the prefill path's K1: codes / scales stored in adapter-sorted row order (v0.69)
               "k1_sorted": k1(sorted_codes=True),
               "gemm": lambda: ops.vendor_fp8_gemm(self.codes, self.scales, c.w_q, c.w_s, out=self.y),
               "expand_add": ex(),
               "expand_add_hb": ex(h=self.h_bf16),
               # the whole op, per path, with fp32 h, then with bf16 h (the default since v0.78)
               **{path: op(path, "fp32") for path in HYBRID_PATHS},
               **{f"{path}_hb": op(path, "bf16") for path in HYBRID_PATHS}}
        if stream_bucket(c.m) or grouped_bucket(c.m):  # the codes the streamed / grouped paths' GEMM reads
            fns["quant"] = lambda: ops.quantize_fp8_per_token(c.x, self.codes, self.scales)
        if stream_bucket(c.m):  # v0.88: the streamed shrink and its paths (bf16 h, their default)
            from kernels_dsl.shrink_stream import stream_shrink

            fns["shrink_stream"] = lambda: stream_shrink(c.x, c.lora_a, c.meta, self.h_bf16)
            fns.update({path: op(path, "bf16") for path in ops.STREAM_PATHS})
        if grouped_bucket(c.m):  # v0.90: the shrink by adapter group and its paths (bf16 h)
            from kernels_dsl import shrink_grouped as sg

            fns["shrink_grouped"] = lambda: sg.grouped_shrink(c.x, c.lora_a, c.meta, self.h_bf16)
            fns.update({path: op(path, "bf16") for path in ops.GROUPED_PATHS})
            for name, kw in grouped_variants(c).items():
                fns[f"shrink_grouped_{name}"] = (lambda kw=kw: sg.grouped_shrink(c.x, c.lora_a, c.meta, self.h_bf16,
                                                                                   **kw))
        k1_sweep, ea_sweep = _sweeps()
        if k1_sweep:
            from kernels_dsl import k1_shrink as k1mod
            for name, cfg in k1mod.sweep_configs(len(c.proj.slices), c.proj.k, c.rank).items():
                fns[f"k1_{name}"] = k1(config=cfg)
        if ea_sweep:
            from kernels_dsl import expand_add as eamod
            for name, cfg in eamod.sweep_configs(len(c.proj.slices), c.rank).items():
                fns[f"expand_add_{name}"] = ex(h=self.h_bf16 if cfg.h_bf16 else self.h, config=cfg)
        for name, (k1_kw, ex_kw) in launch_variants(c, zsweep=os.environ.get(ZSWEEP_ENV) == "1").items():
            if k1_kw is not None:
                fns[f"k1_{name}"] = k1(**k1_kw)
            if ex_kw is not None:
                fns[f"expand_add_{name}"] = ex(**ex_kw)
        return fns


def grouped_variants(c: LayerCase) -> dict[str, dict]:
    """The grouped shrink's launch choices around its rule (data for `select` / `choose_splits`):
    "bn<N>" every other token tile at the rule's split for that tile, "s<S>" half and twice the
    rule's split at the rule's tile."""
    from kernels_dsl import shrink_grouped as sg

    groups = sg.expected_groups(c.meta, c.max_loras)
    S = len(c.proj.slices)
    rule = sg.select(S, c.rank, c.m, groups)
    out = {}
    for bn in sg.TOKEN_TILES:
        if bn != rule.bn:
            cfg = sg.Config(bn=bn, rank=c.rank, num_slices=S, stages=sg.STAGES[bn])
            out[f"bn{bn}"] = {"config": cfg, "splits": sg.choose_splits(c.proj.k, cfg, groups)}
    split = sg.choose_splits(c.proj.k, rule, groups)
    nkb = -(-c.proj.k // sg.BK)
    for s in (split // 2, split * 2):
        if 1 <= s <= min(sg.MAX_SPLITS, nkb) and s != split:
            out[f"s{s}"] = {"config": rule, "splits": s}
    return out


def _with_env(name: str, value: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with os.environ[name] = value (restored after): the op reads it on the host, so a
    CUDA graph captured from this call keeps the launches it chose. The op caches its reading of
    EPILORA_HYBRID_H, so the cache is cleared on the way in and out."""
    from epilora_cute import ops

    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        ops.hybrid_h_dtype.cache_clear()
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
            ops.hybrid_h_dtype.cache_clear()
    return run


def launch_variants(c: LayerCase, zsweep: bool = False) -> dict[str, tuple[dict | None, dict | None]]:
    """name -> (K1 keyword args or None, expand-add keyword args or None) for this case: "z1", the
    group split forced off (the geometry before v0.6), for the kernels whose default z is > 1; with
    ``zsweep`` also "z2" ... "z64" where z differs from the kernel's default and is at most the
    adapter groups a tile can meet (more z-CTAs would find no group)."""
    g = geometry(c.proj, c.m, c.rank, c.max_loras)
    k1_z = int(g["k1_grid"].split("x")[2])
    ex_z = int(g["expand_grid"].split("x")[2])
    if k1_z == 1 and ex_z == 1:
        return {}
    out = {"z1": ({"zsplit": 1} if k1_z > 1 else None, {"zsplit": 1} if ex_z > 1 else None)}
    if zsweep:
        groups = min(c.m, c.max_loras + 1)  # no tile meets more groups than this
        for z in ZSWEEP:
            k1_kw = {"zsplit": z} if k1_z > 1 and z != k1_z and z <= groups else None
            ex_kw = {"zsplit": z} if ex_z > 1 and z != ex_z and z <= groups else None
            if k1_kw or ex_kw:
                out[f"z{z}"] = (k1_kw, ex_kw)
    return out


def _vllm_launchers(c: LayerCase) -> dict[str, Callable[[], object]]:
    try:
        from tools.bench_decode import VllmPath
        vp = VllmPath(c)
    except Exception as e:  # noqa: BLE001 - no vLLM: our columns only
        return {"_vllm_error": str(e)}
    return {"vllm_fp8": vp.base, "vllm_lora": vp.with_lora}


def bench_hybrid_stages(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("hybrid_stages: needs an sm_90 GPU; skipped")
        return []
    tokens, adapters = settings()
    bw = read_bandwidth_gbs()
    rows: list[dict] = []
    vllm_note = None
    for a in adapters:
        max_loras = max_loras_for(a)
        for m in tokens:
            proj_rows = []
            for p in QWEN3_8B:
                row = {"section": "hybrid_stages", "proj": p.name, "M": m, "adapters": a, "max_loras": max_loras,
                       "rank": RANK, **floors(p, m, a, RANK, bw)}
                try:
                    row.update(geometry(p, m, RANK, max_loras))
                    c = LayerCase(p, m, RANK, num_adapters=a, max_loras=max_loras)
                    fns = HybridStages(c).launchers()
                    vl = _vllm_launchers(c)
                    if "_vllm_error" in vl:
                        vllm_note = vllm_note or vl["_vllm_error"]
                    else:
                        fns.update(vl)
                    if _sweeps()[1]:
                        # the selected expand-add once more, timed last: v0.37 found the first
                        # expand-add column ~18 % slower than an identical later one at 8192 tokens
                        fns["expand_add_again"] = fns["expand_add"]
                    # K1 once more, timed last: how far the columns timed in between drifted
                    fns["k1_again"] = fns["k1"]
                    time_stages(row, fns, timer=time_graph)
                except Exception as e:  # noqa: BLE001 - a case that can't be built is reported
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                proj_rows.append(row)
                rows.append(row)
                print(format_row(row), flush=True)
                c = fns = None  # noqa: F841
                gc.collect()
                torch.cuda.empty_cache()
            layer = sum_layer(proj_rows)
            rows.append(layer)
            print(format_row(layer), flush=True)
    if vllm_note:
        print(f"hybrid_stages: vLLM columns left out ({vllm_note[:120]})")
    return rows


SECTIONS = {"hybrid_stages": bench_hybrid_stages}


if __name__ == "__main__":
    from tools import bench

    sys.exit(bench.main(["--sections", "hybrid_stages", *sys.argv[1:]]))
