"""Bench section `prefill`: one Qwen3-8B layer's four projections at prefill sizes (issue #4).

    python tools/bench.py --sections prefill [--quick] [--out DIR]

Per (tokens M, adapters A) one row, every column from one run (CUDA-graph replays of the whole
layer — qkv, o, gate_up, down — with the L2 flushed before each, median; tools/gpu_timing):

  floor_us        max(floor_bytes_us, floor_flops_us):
    floor_bytes_us  (FP8 weights + the A active rank-64 adapters' bf16 A and B + x read + y
                    written) / the measured read bandwidth
    floor_flops_us  base FLOPs / the measured FP8 GEMM rate (the faster of torch._scaled_mm and
                    vLLM's cutlass_scaled_mm on 8192^3) + LoRA FLOPs / half that rate (bf16)
  vllm_fp8_us     vLLM's scaled_fp8_quant + cutlass_scaled_mm (no adapter)
  vllm_lora_us    the same + vLLM's LoRA shrink/expand Triton kernels (LoRAKernelMeta, default configs)
  ours_<P>_us     epilora_cute.ops.lora_linear_fp8(..., path=P) for P in triton, hybrid, auto
  ours_auto_path  the path "auto" took for each projection (read back from the dispatch, not timed
                  again); its candidates follow EPILORA_DECODE_PATH / EPILORA_HYBRID_PATH as in
                  epilora_cute/dispatch.py, and it decides with a fresh dispatch table (a temporary
                  file), so the decision is this run's measurement, not a stale entry
  ours_<P>_over_vllm_lora, ours_<P>_over_vllm_fp8   time ratios (lower is better)
  target, ours_<P>_target                           issue #4's targets where they apply (TARGETS)

Tokens are assigned to adapters round-robin; max_loras = max(8, A). A path that raises is reported
as `<name>_error` in its row. Knobs (shared with the `layer` section): EPILORA_BENCH_TOKENS
(default 32,64,128,256,512,1024,2048; --quick 32,256,2048), EPILORA_BENCH_ADAPTERS (default 1,32),
EPILORA_BENCH_OURS (default triton,hybrid,prefill,auto; hybrid_par, hybrid_par_q and decode when named;
other names are ignored here).
Without a CUDA GPU (or FP8-capable one) the section prints why and returns no rows; without vLLM
only our columns are timed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase, Projection, VllmPath  # noqa: E402
from tools.gpu_timing import read_bandwidth_gbs, time_graph  # noqa: E402

RANK = 64
DEFAULT_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)
QUICK_TOKENS = (32, 256, 2048)
DEFAULT_ADAPTERS = (1, 32)
OUR_PATHS = ("triton", "hybrid", "prefill", "auto")  # the default columns; timing order: the GPU-verified path first
# Asked for by name only (EPILORA_BENCH_OURS): the other hybrid forms (the streamed shrink's, v0.88;
# the grouped shrink's, v0.90) and, at 33..64 tokens, the decode pair with K2's token tiles
# (docs/perf.md v0.85), beside the paths "auto" weighs them against.
EXTRA_PATHS = ("hybrid_par", "hybrid_par_q", "hybrid_st", "hybrid_par_st", "hybrid_g", "hybrid_par_g", "decode")
MIN_MAX_LORAS = 8  # as the `layer` section; 32 adapters get max_loras 32


@dataclass(frozen=True)
class Target:
    """An issue #4 target: ours / <vs> <= max_ratio for rows with these adapters and tokens."""
    adapters: int
    tokens: tuple[int, int]  # inclusive range
    vs: str  # "vllm_lora" or "vllm_fp8"
    max_ratio: float
    text: str

    def applies(self, m: int, adapters: int) -> bool:
        return adapters == self.adapters and self.tokens[0] <= m <= self.tokens[1]


TARGETS = (
    Target(32, (32, 256), "vllm_lora", 1 / 3, "32 adapters, 32-256 tokens: >= 3x faster than vLLM's LoRA path"),
    Target(1, (2048, 2048), "vllm_lora", 0.8, "1 adapter, 2048 tokens: <= 0.8x vLLM's LoRA path"),
    Target(1, (2048, 2048), "vllm_fp8", 1.1, "1 adapter, 2048 tokens: <= 1.1x vLLM's FP8 GEMM alone"),
)
# vLLM's times in issue #4 (H200), printed beside this run's own measurement of the same thing.
ISSUE4_REF_US = {(32, 32): {"vllm_lora": 869.0}, (1, 2048): {"vllm_lora": 1104.0, "vllm_fp8": 629.0}}


# ---------------------------------------------------------------------------------------------
# Settings, floors, row assembly: pure functions (tested on the CPU).

def _int_list(text: str, name: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{name} must list positive integers, got {text!r}")
    return vals


def tokens_and_adapters(env: Mapping[str, str], tokens: Sequence[int],
                        adapters: Sequence[int]) -> tuple[list[int], list[int]]:
    """(token counts, adapter counts) from EPILORA_BENCH_TOKENS / EPILORA_BENCH_ADAPTERS in env,
    else these defaults: the knobs every section over tokens x adapters shares."""
    return ((_int_list(env["EPILORA_BENCH_TOKENS"], "EPILORA_BENCH_TOKENS") if env.get("EPILORA_BENCH_TOKENS")
             else list(tokens)),
            (_int_list(env["EPILORA_BENCH_ADAPTERS"], "EPILORA_BENCH_ADAPTERS")
             if env.get("EPILORA_BENCH_ADAPTERS") else list(adapters)))


def settings(quick: bool, env: Mapping[str, str] | None = None) -> tuple[list[int], list[int], list[str]]:
    """(token counts, adapter counts, our paths) from --quick and the EPILORA_BENCH_* variables."""
    env = os.environ if env is None else env
    tokens, adapters = tokens_and_adapters(env, QUICK_TOKENS if quick else DEFAULT_TOKENS, DEFAULT_ADAPTERS)
    wanted = [w.strip() for w in env.get("EPILORA_BENCH_OURS", ",".join(OUR_PATHS)).split(",") if w.strip()]
    ours = [p for p in OUR_PATHS + EXTRA_PATHS if p in wanted]
    return tokens, adapters, ours


def max_loras_for(adapters: int) -> int:
    return max(MIN_MAX_LORAS, adapters)


def floor_terms(projs: Sequence[Projection], m: int, adapters: int, rank: int, bw_gbs: float,
                fp8_tflops: float | None) -> dict:
    """The layer's least DRAM traffic and FLOPs, as times at the measured rates (µs)."""
    active = min(adapters, m)
    weight = sum(p.n * p.k for p in projs)  # FP8: one byte each
    adapter = sum(active * rank * (len(p.slices) * p.k + p.n) * 2 for p in projs)
    act = sum(m * (p.k + p.n) * 2 for p in projs)  # x read, y written (bf16)
    base_flops = sum(2 * m * p.n * p.k for p in projs)
    lora_flops = sum(2 * m * rank * (len(p.slices) * p.k + p.n) for p in projs)
    out = {"weight_mb": weight / 1e6, "adapter_mb": adapter / 1e6, "act_mb": act / 1e6,
           "floor_bytes_us": (weight + adapter + act) / (bw_gbs * 1e9) * 1e6}
    if fp8_tflops:
        out["floor_flops_us"] = (base_flops + 2 * lora_flops) / (fp8_tflops * 1e12) * 1e6
    out["floor_us"] = max(out["floor_bytes_us"], out.get("floor_flops_us", 0.0))
    return out


def finish_row(row: dict, ours: Iterable[str]) -> dict:
    """Add ratios vs vLLM's two anchors, issue #4's reference numbers and the target verdicts."""
    names = [f"ours_{p}" for p in ours]
    for name in names:
        for vs in ("vllm_lora", "vllm_fp8"):
            if f"{name}_us" in row and f"{vs}_us" in row:
                row[f"{name}_over_{vs}"] = row[f"{name}_us"] / row[f"{vs}_us"]
    ref = ISSUE4_REF_US.get((row["adapters"], row["M"]))
    if ref:
        row["issue4_ref"] = ", ".join(f"{k} {v:.0f} us" for k, v in ref.items())
    targets = [t for t in TARGETS if t.applies(row["M"], row["adapters"])]
    if targets:
        row["target"] = " and ".join(f"ours <= {t.max_ratio:.2f}x {t.vs}" for t in targets)
        for name in names:
            row[f"{name}_target"] = verdict(row, name, targets)
    return row


def verdict(row: dict, name: str, targets: Sequence[Target]) -> str:
    if f"{name}_us" not in row:
        return "n/a (error)" if f"{name}_error" in row else "n/a (not timed)"
    missing = [t.vs for t in targets if f"{t.vs}_us" not in row]
    if missing:
        return f"n/a (no {', '.join(dict.fromkeys(missing))})"
    misses = [f"{row[f'{name}_over_{t.vs}']:.2f}x {t.vs} > {t.max_ratio:.2f}x" for t in targets
              if row[f"{name}_over_{t.vs}"] > t.max_ratio]
    return "missed: " + "; ".join(misses) if misses else "met"


def summarize_paths(chosen: Mapping[str, str]) -> str:
    """One path name when every projection took it, else 'qkv=hybrid o=triton ...'."""
    vals = set(chosen.values())
    if len(vals) == 1:
        return vals.pop()
    return " ".join(f"{k}={v}" for k, v in chosen.items())


def time_paths(row: dict, builders: Mapping[str, Callable[[], list[Callable[[], object]]]],
               timer: Callable[[Callable[[], object]], float] = time_graph) -> None:
    """For each name: build the per-projection launchers, time them as one layer into
    row[f"{name}_us"]; a builder or launch that raises goes to row[f"{name}_error"] instead."""
    for name, build in builders.items():
        try:
            fns = build()
            row[f"{name}_us"] = timer(lambda: [f() for f in fns])
        except Exception as e:  # noqa: BLE001 - a path that can't run is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]


def format_row(row: dict) -> str:
    head = f"prefill M={row['M']:5d} A={row['adapters']:2d}"
    parts = [f"floor {row['floor_us']:.1f}"]
    for key, label in (("vllm_fp8", "vLLM fp8"), ("vllm_lora", "vLLM LoRA")):
        if f"{key}_us" in row:
            parts.append(f"{label} {row[f'{key}_us']:.1f}")
        elif f"{key}_error" in row:
            parts.append(f"{label} ERROR")
    for key in [k[:-3] for k in row if k.startswith("ours_") and k.endswith("_us")] + \
               [k[:-6] for k in row if k.startswith("ours_") and k.endswith("_error")]:
        label = key[5:] + (f"[{row['ours_auto_path']}]" if key == "ours_auto" and "ours_auto_path" in row else "")
        if f"{key}_us" not in row:
            parts.append(f"{label} ERROR ({row[f'{key}_error'][:80]})")
            continue
        rs = [f"{row[f'{key}_over_{vs}']:.2f}x {short}" for vs, short in (("vllm_lora", "LoRA"), ("vllm_fp8", "fp8"))
              if f"{key}_over_{vs}" in row]
        parts.append(f"{label} {row[f'{key}_us']:.1f}" + (f" ({', '.join(rs)})" if rs else ""))
    line = head + "  " + "  ".join(parts) + "  (us)"
    if "target" in row:
        verdicts = ", ".join(f"{k[5:-7]} {v}" for k, v in row.items() if k.startswith("ours_") and k.endswith("_target"))
        line += f"\n    target {row['target']}: {verdicts}" + (f"  [issue #4: {row['issue4_ref']}]"
                                                               if "issue4_ref" in row else "")
    return line


def skip_reason(cuda: bool, capability: tuple[int, int] | None, have_vllm: bool, have_ours: bool) -> str | None:
    if not cuda:
        return "no CUDA GPU here (the GPU record is made on the H200: docs/gpu_record/README.md)"
    if capability is not None and tuple(capability) < (8, 9):
        return f"FP8 needs sm_89 or newer; this GPU is sm_{capability[0]}{capability[1]}"
    if not have_vllm and not have_ours:
        return ("nothing to time: vLLM's ops don't import and none of our paths is available "
                "(epilora_cute.ops, EPILORA_BENCH_OURS)")
    return None


# ---------------------------------------------------------------------------------------------
# GPU side.

def _have_vllm() -> bool:
    try:
        from vllm import _custom_ops  # noqa: F401
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001
        print(f"prefill: vLLM's ops don't import ({type(e).__name__}: {e}): the vLLM columns are left out")
        return False


def _have_ours() -> bool:
    try:
        from epilora_cute import ops  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001
        print(f"prefill: epilora_cute.ops doesn't import ({type(e).__name__}: {e}): our columns are left out")
        return False


def fp8_gemm_tflops(have_vllm: bool, n: int = 8192) -> float | None:
    """The faster measured rate of torch._scaled_mm and vLLM's cutlass_scaled_mm on n^3 FP8."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)  # [N, K]; B = b.t() is column-major
    one = torch.ones((), device="cuda")
    rates = []
    runs = [lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)]
    if have_vllm:
        from vllm import _custom_ops as vops
        sa = torch.ones(n, 1, device="cuda")
        runs.append(lambda: vops.cutlass_scaled_mm(a, b.t(), scale_a=sa, scale_b=one.reshape(1),
                                                   out_dtype=torch.bfloat16))
    for fn in runs:
        try:
            us = time_graph(fn, reps=20, warmup=3)
            rates.append(2 * n ** 3 / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001
            print(f"prefill: an FP8 GEMM rate probe failed ({type(e).__name__}: {e})")
    del a, b
    return max(rates) if rates else None


def _vllm_builders(cases: list[LayerCase]) -> dict:
    paths: list[VllmPath] = []

    def get() -> list[VllmPath]:
        if not paths:
            paths.extend(VllmPath(c) for c in cases)
        return paths
    return {"vllm_fp8": lambda: [p.base for p in get()], "vllm_lora": lambda: [p.with_lora for p in get()]}


def _our_builders(cases: list[LayerCase], outs: list[torch.Tensor], ours: Sequence[str]) -> dict:
    from epilora_cute import ops

    def make(path: str):
        return lambda: [(lambda c=c, o=o: ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta,
                                                                out=o, path=path))
                        for c, o in zip(cases, outs)]
    return {f"ours_{p}": make(p) for p in ours}


def auto_decisions(cases: list[LayerCase], outs: list[torch.Tensor]) -> tuple[dict[str, str], dict[str, str]]:
    """(projection -> path "auto" takes in a captured graph, projection -> its candidates), read
    from the dispatch after the auto timing settled every key: a dictionary lookup, no timing."""
    from epilora_cute import dispatch

    chosen, cands = {}, {}
    for c, o in zip(cases, outs):
        call = dispatch.describe(c.x, c.w_q, c.proj.slices, c.rank, c.lora_a, c.lora_b, c.meta)
        cands[c.proj.name] = ",".join(p for p in dispatch.applicable_paths(call) if dispatch.path_allowed(p))
        with dispatch.call_mode("graph"):
            chosen[c.proj.name] = dispatch.auto_path(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta,
                                                     widths=c.proj.slices, rank=c.rank, out=o)
    if os.environ.get(dispatch.FORCE_ENV):
        chosen = {k: f"{v} (forced)" for k, v in chosen.items()}
    return chosen, cands


def measure_row(m: int, adapters: int, ours: Sequence[str], have_vllm: bool, bw: float,
                fp8_tflops: float | None) -> dict:
    max_loras = max_loras_for(adapters)
    row = {"section": "prefill", "model": "Qwen3-8B", "M": m, "adapters": adapters, "rank": RANK,
           "max_loras": max_loras, "bw_gbs": bw, "fp8_tflops": fp8_tflops,
           **floor_terms(QWEN3_8B, m, adapters, RANK, bw, fp8_tflops)}
    cases = [LayerCase(p, m, RANK, num_adapters=adapters, max_loras=max_loras) for p in QWEN3_8B]
    outs = [torch.empty(m, p.n, device="cuda", dtype=torch.bfloat16) for p in QWEN3_8B]
    try:
        if have_vllm:
            time_paths(row, _vllm_builders(cases))
        if ours:
            time_paths(row, _our_builders(cases, outs, ours))
        if "ours_auto_us" in row:
            try:
                chosen, cands = auto_decisions(cases, outs)
                row["ours_auto_path"] = summarize_paths(chosen)
                row["ours_auto_candidates"] = summarize_paths(cands)
            except Exception as e:  # noqa: BLE001
                row["ours_auto_path_error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        del cases, outs
        gc.collect()
        torch.cuda.empty_cache()
    return finish_row(row, ours)


def bench_prefill(quick: bool) -> list[dict]:
    tokens, adapters, ours = settings(quick)
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability() if cuda else None
    reason = skip_reason(cuda, cap, True, True)
    if reason is None:
        have_vllm = _have_vllm()
        if ours and not _have_ours():
            ours = []
        reason = skip_reason(cuda, cap, have_vllm, bool(ours))
    if reason is not None:
        print(f"prefill: skipped: {reason}")
        return []
    bw = read_bandwidth_gbs()
    rate = fp8_gemm_tflops(have_vllm)
    print(f"prefill: tokens {tokens}, adapters {adapters}, rank {RANK}, ours {ours or 'none'}; read bandwidth "
          f"{bw:.0f} GB/s, FP8 GEMM rate {rate or float('nan'):.0f} TFLOP/s", flush=True)
    rows = []
    with _fresh_dispatch("auto" in ours):
        for a in adapters:
            for m in tokens:
                row = measure_row(m, a, ours, have_vllm, bw, rate)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


@contextlib.contextmanager
def _fresh_dispatch(active: bool) -> Iterator[None]:
    """path="auto" decides with a dispatch table of its own (a temporary file): this run's
    measurements, not decisions persisted by earlier runs with other kernels."""
    if not active:
        yield
        return
    from epilora_cute import dispatch

    optin = ", ".join(f"{env}={os.environ.get(env, '0')}" for env in sorted(set(dispatch.OPT_IN_ENV.values())))
    forced = os.environ.get(dispatch.FORCE_ENV)
    print(f"prefill: auto's opt-ins {optin}" + (f"; {dispatch.FORCE_ENV}={forced}" if forced else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="epilora_prefill_dispatch_") as tmp:
        dispatch.set_dispatcher(dispatch.Dispatcher(dispatch.DispatchTable(Path(tmp) / "dispatch.json")))
        try:
            yield
        finally:
            dispatch.set_dispatcher(None)


SECTIONS = {"prefill": bench_prefill}


if __name__ == "__main__":
    from tools import bench

    sys.exit(bench.main(["--sections", "prefill", *sys.argv[1:]]))
