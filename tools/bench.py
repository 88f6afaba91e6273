"""Benchmarks, side by side with vLLM's kernels in one run (CUDA-graph replays, L2 flushed, median).

    python tools/bench.py [--sections quant,launch,...] [--out DIR] [--quick]

Sections:
  quant   per-token FP8 quantization: ours vs vLLM's scaled_fp8_quant (issue 2's target: not slower)
  launch  host time per launch of our cuda-python launcher vs vLLM's op, eager
  layer   the decode path on one Qwen3-8B layer (when the K2 kernels are present)
  prefill one Qwen3-8B layer at 32-2048 tokens, 1 and 32 adapters: vLLM vs our paths (tools/bench_prefill.py)
Prints a table, writes bench.json (+ bench.png when matplotlib is present) into --out.
Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epilora_cute.timing import flush_mode  # noqa: E402
from tools.gpu_timing import host_launch_us, read_bandwidth_gbs, time_eager, time_graph  # noqa: E402


def vllm_ops():
    """vLLM's custom ops module, or None (the anchors are then left out, and the table says so)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm import _custom_ops
        return _custom_ops
    except Exception as e:  # pragma: no cover
        print(f"vllm is installed but its ops don't import: {e}", file=sys.stderr)
        return None


def bench_quant(quick: bool) -> list[dict]:
    from epilora_cute import ops

    vops = vllm_ops()
    rows = []
    ms = [1, 16, 255, 2048] if quick else [1, 3, 16, 255, 2048, 8192]
    for k in [4096, 5120, 12288, 8208]:
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
            scales = torch.empty(m, 1, device="cuda")
            ours = time_graph(lambda: ops.quantize_fp8_per_token(x, codes, scales))
            row = {"section": "quant", "M": m, "K": k, "ours_us": ours,
                   "floor_us": (m * k * 3 + m * 4) / 4.4e12 * 1e6}
            if vops is not None:
                vl = time_graph(lambda: vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True))
                row.update(vllm_us=vl, ratio=ours / vl)
            rows.append(row)
            print(f"quant M={m:5d} K={k:5d}: ours {ours:7.2f} us"
                  + (f"  vLLM {row['vllm_us']:7.2f} us  ratio {row['ratio']:.2f}" if vops else "  (no vLLM)"),
                  flush=True)
    return rows


def bench_launch(quick: bool) -> list[dict]:
    from epilora_cute import ops

    x = torch.randn(1, 4096, device="cuda").bfloat16()
    codes = torch.empty(1, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(1, 1, device="cuda")
    rows = [{"section": "launch", "what": "ours quantize_fp8_per_token (validation + cuda-python launch)",
             "host_us": host_launch_us(lambda: ops.quantize_fp8_per_token(x, codes, scales)),
             "eager_gpu_us": time_eager(lambda: ops.quantize_fp8_per_token(x, codes, scales))}]
    from kernels_dsl import fp8_quant
    from epilora_cute.kernels import get_kernel
    from epilora_cute.arch import arch_of
    cfg = fp8_quant.config_for(4096)
    k = get_kernel(fp8_quant, cfg, arch_of(x))
    rows.append({"section": "launch", "what": "ours raw Kernel.__call__ (pack + cuLaunchKernelEx)",
                 "host_us": host_launch_us(lambda: k(x, codes, scales, grid=(1, 1, 1), smem=cfg.smem_bytes))})
    rows.append({"section": "launch", "what": "ours raw Kernel.__call__ with PDL attribute",
                 "host_us": host_launch_us(lambda: k(x, codes, scales, grid=(1, 1, 1), smem=cfg.smem_bytes, pdl=True))})
    rows += _op_host_rows()
    vops = vllm_ops()
    if vops is not None:
        rows.append({"section": "launch", "what": "vLLM scaled_fp8_quant (torch custom op)",
                     "host_us": host_launch_us(lambda: vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True))})
    for r in rows:
        extra = (f" (TMA descriptors encoded each call: {r['host_us_tma_encoded_each_call']:.2f})"
                 if "host_us_tma_encoded_each_call" in r else "")
        print(f"launch: {r['what']}: " + (f"host {r['host_us']:.2f} us/launch{extra}" if "host_us" in r
                                          else r.get("error", "")), flush=True)
        for fn, n, own, cum in r.get("host_profile", [])[:8]:
            print(f"    {own:7.1f} us own, {cum:7.1f} cumulative, {n:5.1f} calls  {fn}", flush=True)
    return rows


def _op_host_rows() -> list[dict]:
    """Host time of one eager LoRA projection call (Qwen3-8B qkv, one token, one rank-64 adapter)
    per path, with the launcher's TMA descriptors reused (the default) and encoded anew each call
    (the launcher before session 19), and a host profile of the call: what an eager step pays per
    projection (the Triton path: what the dispatch's eager keys at small batches took in run21)."""
    from epilora_cute import launcher, ops
    from tools.bench_decode import QWEN3_8B, LayerCase

    c = LayerCase(QWEN3_8B[0], 1, 64)
    rows = []
    for path in ("decode_sq", "decode", "hybrid", "hybrid_par", "triton"):
        def call():
            ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path=path)

        def call_uncached():
            launcher._TENSORMAPS.clear()
            call()
        try:
            rows.append({"section": "launch", "what": f"ours lora_linear_fp8 path={path}, qkv, 1 token",
                         "host_us": host_launch_us(call, reps=200),
                         "host_us_tma_encoded_each_call": host_launch_us(call_uncached, reps=200),
                         "host_profile": host_profile(call)})
        except Exception as e:  # a path that cannot run here is reported, not fatal
            rows.append({"section": "launch", "what": f"ours lora_linear_fp8 path={path}",
                         "error": f"{type(e).__name__}: {e}"[:200]})
    return rows + _dispatched_host_rows()


def _dispatched_host_rows() -> list[dict]:
    """The same call as an engine makes it once warmed up, at 1 and 512 tokens (a prefill chunk
    outside CUDA graphs): path="auto" with the dispatch decided for the hybrid path (a throw-away
    table, nothing timed), and the plugin's registered op on a batch with adapters (torch's
    dispatcher, vLLM's host flag, the same decision)."""
    from epilora_cute import ops
    from tools.bench_decode import QWEN3_8B, LayerCase
    from tools.host_cpu import dispatch_decided, plugin_op
    from vllm_adapter import custom_op

    flag = torch.zeros(1, dtype=torch.bool)  # vLLM's no-LoRA flag, unset
    rows = []
    for m in (1, 512):
        c = LayerCase(QWEN3_8B[0], m, 64)
        calls = {
            "auto (decided: hybrid)": (dispatch_decided("hybrid"), lambda: ops.lora_linear_fp8(
                c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path="auto")),
            "plugin op (decided: hybrid)": (plugin_op("hybrid"), lambda: custom_op.lora_linear_fp8(
                c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, no_lora_flag_cpu=flag)),
        }
        for what, (ctx, call) in calls.items():
            row = {"section": "launch", "what": f"ours {what}, qkv, {m} tokens"}
            try:
                with ctx:
                    row.update(host_us=host_launch_us(call, reps=200), host_profile=host_profile(call))
            except Exception as e:  # reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
    return rows


def host_profile(fn, reps: int = 100, top: int = 15) -> list[list]:
    """Where an eager call's host time goes (run22: one qkv call at one token took 395 µs of host
    time on the H200 for two ~27 µs launches): cProfile over ``reps`` calls, the functions with the
    most own time, as [function, calls per call, own µs per call, cumulative µs per call]."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [[f"{Path(f).name}:{line}({name})", nc / reps, 1e6 * tt / reps, 1e6 * ct / reps]
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


SECTIONS = {"quant": bench_quant, "launch": bench_launch}


def _optional_sections() -> None:
    """Sections that exist once their kernels do (tools/bench_*.py modules with a ``SECTIONS`` dict)."""
    for name in ("tools.bench_decode", "tools.bench_stages", "tools.bench_k2sweep", "tools.bench_triton",
                 "tools.bench_prefill", "tools.bench_prefill_k2", "tools.bench_hybrid_stages", "tools.bench_timeline",
                 "tools.bench_prefetch", "tools.bench_layer_parts"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        SECTIONS.update(getattr(mod, "SECTIONS", {}))


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "torch": torch.__version__,
           "python": platform.python_version()}
    for pkg in ("vllm", "triton", "nvidia-cutlass-dsl", "cuda-bindings"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except Exception:
            env[pkg] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
                   driver=torch.version.cuda)
    from tools.gpu_timing import machine_facts

    env["machine"] = machine_facts()
    return env


def plot(rows: list[dict], path: Path) -> None:
    """bench.png: the layer section (µs per layer against tokens, one panel per rank: the floor,
    vLLM's paths and ours) and the quantization ratios, whichever the run has."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = []
    layer = [r for r in rows if r["section"] == "layer"]
    for rank in sorted({r["rank"] for r in layer}):
        panels.append(("layer", rank, [r for r in layer if r["rank"] == rank]))
    q = [r for r in rows if r["section"] == "quant" and "vllm_us" in r]
    if q:
        panels.append(("quant", None, q))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (kind, rank, rs) in zip(axes[0], panels):
        if kind == "layer":
            cols = [k for k in rs[0] if k.endswith("_us")]
            for r in rs[1:]:
                cols += [k for k in r if k.endswith("_us") and k not in cols]
            for col in cols:
                pts = [(r["M"], r[col]) for r in rs if isinstance(r.get(col), float)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=col[:-3], ls="--" if col == "floor_us" else "-")
            ax.set_ylabel("µs per layer (lower is better)")
            ax.set_title(f"{rs[0].get('model', '')} layer, one rank-{rank} adapter")
        else:
            for k in sorted({r["K"] for r in rs}):
                kr = [r for r in rs if r["K"] == k]
                ax.plot([r["M"] for r in kr], [r["ratio"] for r in kr], marker="o", label=f"K={k}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_ylabel("ours / vLLM scaled_fp8_quant (lower is better)")
            ax.set_title("Per-token FP8 quantization")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (M)")
        ax.legend(fontsize=8)
    fig.suptitle("H200, CUDA-graph replays, L2 flushed, median")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    _optional_sections()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated; 'none' writes only the environment (GPU, versions, bandwidth)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "build" / "bench")))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: no CUDA GPU here; nothing to time (the GPU record is produced by tools/gpu_record.py on the H200)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["read_bandwidth_gbs"] = read_bandwidth_gbs()
    env["l2_flush"] = flush_mode()  # "read" from session 6 on; "write" before (docs/perf.md v0.16)
    print(f"GPU {env.get('gpu')}  measured read bandwidth {env['read_bandwidth_gbs']:.0f} GB/s  vLLM {env['vllm']}")
    rows = []
    (args.out / "bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    for name in [] if args.sections == "none" else args.sections.split(","):
        if name not in SECTIONS:
            print(f"unknown section {name}; have {sorted(SECTIONS)}")
            return 2
        rows += SECTIONS[name](args.quick)
        # After every section: a run cut short by the device's call limit keeps what it measured.
        (args.out / "bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    plot(rows, args.out / "bench.png")
    print(f"wrote {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
