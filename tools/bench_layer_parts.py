"""Bench section `layer_parts`: hybrid_par's whole Qwen3-8B layer taken apart, one part left out at a time.

    EPILORA_BENCH_TOKENS=64 EPILORA_BENCH_ADAPTERS=8,1 python tools/bench.py --sections layer_parts

Why: the per-projection rows of `hybrid_stages` are graphs of a single kernel each and carry a
~5-6 µs launch-and-ramp floor (docs/perf.md v0.86 measured), so their sums overstate what a stage
costs inside the layer, where the engine runs it (one CUDA graph per decode step). Here every column
is ONE graph of the four projections (qkv, o, gate_up, down), L2 flushed before each replay, median
(tools/gpu_timing.time_graph), built from the hybrid path's own pieces (`launch_plans.k1_quant_shrink`,
`ops.quantize_fp8_per_token`, `ops.vendor_fp8_gemm`, `launch_plans.expand_add`) with the op's
stream order, rank 64, tokens dealt round-robin over the adapters (max_loras = max(8, adapters)):

  op_us          lora_linear_fp8(path="hybrid_par") with EPILORA_STREAM_PRIORITY=0: K1 forked, the
                 quantization + GEMM on the caller's stream (the path before v0.91)
  op_pri_us      the same with the quantization + GEMM on a high-priority stream (v0.91)
  op_q_us, op_q_pri_us, op_st_us, op_st_pri_us, op_g_us, op_g_pri_us
                 hybrid_par_q, hybrid_par_st and hybrid_par_g without and with that priority
  mirror_us      this module's re-composition of it: K1 on a side stream forked before the
                 quantization, quantization + GEMM on the main stream, the join, the expand-add
                 (should equal op_us: the check that the parts below are the op's)
  no_expand_us   mirror without the expand-add
  no_k1_us       mirror without K1's branch (the expand-add reads an h made beforehand)
  serial_us      K1, then quantization + GEMM, then the expand-add on one stream (the hybrid path's
                 order: what the fork saves)
  base_us        quantization + GEMM only (vLLM's FP8 layer)
  quant_us, gemm_us, k1_us, expand_us   each part alone, four projections in one graph

and, with EPILORA_BENCH_K1_ZSPLITS=1,2 (how the SMs are shared at 64-256 tokens: K1 with fewer CTAs
beside the GEMM; its group split leaves h's bits unchanged, kernels_dsl/k1_shrink.choose_zsplit):

  mirror_z{z}_us mirror with K1 launched at group split z (grid z; the default is choose_zsplit's)
  k1_z{z}_us     K1 alone at group split z

EPILORA_BENCH_PARTS=expand,mirror (comma-separated) times only those columns.

and, derived (µs): adapter_cost = mirror - base; expand_exposed = mirror - no_expand;
k1_exposed = mirror - no_k1; fork_saves = serial - mirror; priority_saves = op - op_pri;
z{z}_saves = mirror - mirror_z{z}. Without
vLLM the GEMM is cuBLAS (torch._scaled_mm), which is slower than vLLM's CUTLASS at these sizes:
compare within a run.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase  # noqa: E402
from tools.bench_prefill import max_loras_for, tokens_and_adapters  # noqa: E402
from tools.gpu_timing import time_graph  # noqa: E402

RANK = 64
DEFAULT_TOKENS = (32, 64)
DEFAULT_ADAPTERS = (8, 1)
# op columns -> (path, stream priority)
OP_PARTS = {"op": ("hybrid_par", False), "op_pri": ("hybrid_par", True),
            "op_q": ("hybrid_par_q", False), "op_q_pri": ("hybrid_par_q", True),
            "op_st": ("hybrid_par_st", False), "op_st_pri": ("hybrid_par_st", True),
            "op_g": ("hybrid_par_g", False), "op_g_pri": ("hybrid_par_g", True)}
PARTS = (*OP_PARTS, "mirror", "no_expand", "no_k1", "serial", "base", "quant", "gemm", "k1", "expand")
# derived column -> (minuend, subtrahend)
DERIVED = {"adapter_cost": ("mirror", "base"), "expand_exposed": ("mirror", "no_expand"),
           "k1_exposed": ("mirror", "no_k1"), "fork_saves": ("serial", "mirror"),
           "priority_saves": ("op", "op_pri")}


ZSPLITS_ENV = "EPILORA_BENCH_K1_ZSPLITS"
PARTS_ENV = "EPILORA_BENCH_PARTS"


def settings(env: Mapping[str, str] | None = None) -> tuple[list[int], list[int]]:
    """(token counts, adapter counts) from EPILORA_BENCH_TOKENS / EPILORA_BENCH_ADAPTERS."""
    return tokens_and_adapters(os.environ if env is None else env, DEFAULT_TOKENS, DEFAULT_ADAPTERS)


def zsplits(env: Mapping[str, str] | None = None) -> list[int]:
    """K1's group splits to time beside the default (EPILORA_BENCH_K1_ZSPLITS, comma-separated)."""
    text = (os.environ if env is None else env).get(ZSPLITS_ENV, "").strip()
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if not item.isdigit() or not 1 <= int(item) <= 65535:
            raise ValueError(f"{ZSPLITS_ENV}: {item!r} is not a group split in 1..65535")
        out.append(int(item))
    return out


def selected_parts(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The columns to time (EPILORA_BENCH_PARTS, comma-separated names of PARTS; unset: all of
    them), in PARTS' order: an A/B of one part need not time the other sixteen."""
    text = (os.environ if env is None else env).get(PARTS_ENV, "").strip()
    names = {t.strip() for t in text.split(",") if t.strip()}
    unknown = sorted(names - set(PARTS))
    if unknown:
        raise ValueError(f"{PARTS_ENV}: {', '.join(unknown)} not among {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in names) if names else PARTS


def zsplit_parts(zs: Sequence[int]) -> tuple[str, ...]:
    return tuple(name for z in zs for name in (f"mirror_z{z}", f"k1_z{z}"))


def derived_pairs(row: dict) -> dict[str, tuple[str, str]]:
    """DERIVED, and z{z}_saves = mirror - mirror_z{z} for every group split the row timed."""
    parts = [k[: -len("_us")] for k in row if k.startswith("mirror_z") and k.endswith("_us")]
    return {**DERIVED, **{p[len("mirror_"):] + "_saves": ("mirror", p) for p in sorted(parts)}}


def derive(row: dict) -> dict:
    """The derived differences of a row whose parts were timed (a part missing: its differences too)."""
    out = {}
    for name, (a, b) in derived_pairs(row).items():
        if f"{a}_us" in row and f"{b}_us" in row:
            out[f"{name}_us"] = row[f"{a}_us"] - row[f"{b}_us"]
    return out


def format_row(row: dict, parts: Sequence[str] = PARTS) -> str:
    head = f"layer_parts M={row['M']:5d} A={row['adapters']:2d}"
    cells = [f"{p} {row[f'{p}_us']:.1f}" if f"{p}_us" in row else f"{p} ERROR" for p in parts]
    cells += [f"{d} {row[f'{d}_us']:+.1f}" for d in derived_pairs(row) if f"{d}_us" in row]
    return head + "  " + "  ".join(cells) + "  (us)"


# ---------------------------------------------------------------------------------------------
# GPU side.

class LayerParts:
    """One projection's buffers and the hybrid path's pieces as launchers (no validation on the
    timed path beyond what the op's own entries do)."""

    def __init__(self, c: LayerCase, side: torch.cuda.Stream):
        from epilora_cute import ops

        self.c, self.side = c, side
        m, k = c.x.shape
        dev = c.x.device
        self.codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        self.scales = torch.empty((m, 1), dtype=torch.float32, device=dev)
        self.scratch_codes = torch.empty_like(self.codes)
        self.scratch_scales = torch.empty_like(self.scales)
        self.h = torch.empty((len(c.lora_a), m, RANK), dtype=ops.hybrid_h_dtype(), device=dev)
        self.out = torch.empty(m, c.proj.n, dtype=torch.bfloat16, device=dev)
        self.k1()  # h for the parts that read it without K1 (and the builds loaded)
        self.quant()
        torch.cuda.synchronize()

    def op(self, path: str = "hybrid_par", priority: bool = False) -> None:
        from epilora_cute import ops

        c = self.c
        before = ops.set_stream_priority(priority)  # read while the graph is captured
        try:
            ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=self.out, path=path)
        finally:
            ops.set_stream_priority(before)

    def quant(self) -> None:
        from epilora_cute import ops

        ops.quantize_fp8_per_token(self.c.x, self.codes, self.scales)

    def gemm(self) -> None:
        from epilora_cute import ops

        ops.vendor_fp8_gemm(self.codes, self.scales, self.c.w_q, self.c.w_s, out=self.out)

    def k1(self, zsplit: int | None = None) -> None:
        """K1 as the op launches it (its plan), or through the family's entry at group split zsplit."""
        c = self.c
        if zsplit is None:
            from epilora_cute.launch_plans import k1_quant_shrink

            k1_quant_shrink(c.x, c.lora_a, c.meta, self.scratch_codes, self.scratch_scales, self.h)
        else:
            from kernels_dsl import k1_shrink

            k1_shrink.k1_quant_shrink(c.x, c.lora_a, c.meta, self.scratch_codes, self.scratch_scales, self.h,
                                      zsplit=zsplit)

    def expand(self) -> None:
        from epilora_cute.launch_plans import expand_add

        expand_add(self.out, self.h, self.c.lora_b, self.c.meta)

    def forked(self, expand: bool = True, k1: bool = True, zsplit: int | None = None) -> None:
        """hybrid_par's order (ops._hybrid_par_path, quant_first=False), parts optional."""
        main = torch.cuda.current_stream()
        if k1:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self.k1(zsplit)
        self.quant()
        self.gemm()
        if k1:
            main.wait_stream(self.side)
        if expand:
            self.expand()

    def serial(self) -> None:
        self.k1()
        self.quant()
        self.gemm()
        self.expand()

    def launchers(self, zs: Sequence[int] = ()) -> dict[str, Callable[[], None]]:
        ops = {name: (lambda p=path, pri=pri: self.op(p, pri)) for name, (path, pri) in OP_PARTS.items()}
        for z in zs:
            ops[f"mirror_z{z}"] = lambda z=z: self.forked(zsplit=z)
            ops[f"k1_z{z}"] = lambda z=z: self.k1(z)
        return {**ops, "mirror": self.forked, "no_expand": lambda: self.forked(expand=False),
                "no_k1": lambda: self.forked(k1=False), "serial": self.serial,
                "base": lambda: (self.quant(), self.gemm()), "quant": self.quant, "gemm": self.gemm,
                "k1": self.k1, "expand": self.expand}


def measure_row(m: int, adapters: int, side: torch.cuda.Stream,
                timer: Callable[[Callable[[], None]], float] = time_graph, zs: Sequence[int] = (),
                parts_timed: Sequence[str] = PARTS) -> dict:
    row = {"section": "layer_parts", "model": "Qwen3-8B", "M": m, "adapters": adapters, "rank": RANK}
    parts: Sequence[LayerParts] = []
    try:
        max_loras = max_loras_for(adapters)
        parts = [LayerParts(LayerCase(p, m, RANK, num_adapters=adapters, max_loras=max_loras), side)
                 for p in QWEN3_8B]
        per = [lp.launchers(zs) for lp in parts]
        for name in (*parts_timed, *zsplit_parts(zs)):
            try:
                row[f"{name}_us"] = timer(lambda name=name: [fns[name]() for fns in per])
            except Exception as e:  # noqa: BLE001 - a part that can't run is reported, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        del parts
        gc.collect()
        torch.cuda.empty_cache()
    row.update(derive(row))
    return row


def bench_layer_parts(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("layer_parts: needs an sm_90 GPU; skipped")
        return []
    tokens, adapters = settings()
    zs = zsplits()
    timed = selected_parts()
    side = torch.cuda.Stream()
    rows = []
    for a in adapters:
        for m in tokens:
            row = measure_row(m, a, side, zs=zs, parts_timed=timed)
            rows.append(row)
            print(format_row(row, (*timed, *zsplit_parts(zs))), flush=True)
    return rows


SECTIONS = {"layer_parts": bench_layer_parts}
