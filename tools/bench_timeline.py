"""Bench section `timeline`: when each CTA of the decode path's two kernels reaches each step.

The trace builds (`Config.trace` in kernels_dsl/k2_gemm.py and lora_shrink.py) store %globaltimer
(ns, one clock for all SMs) at fixed points of every CTA: the shrink's entry, its
griddepcontrol.wait, x_q published (quantization CTAs) or main loop done (down-projection CTAs)
and h stored (also with the shrink alone); K2's entry, x_q ready (its producer past the spin), main loop done, h ready (the
epilogue's griddepcontrol.wait passed), partials written and the end. Per Qwen3-8B projection,
rank 64, one adapter, M in {1, 8} (EPILORA_BENCH_TOKENS: any of 1..32): the pair as the decode path launches it (shrink, then K2 as
its PDL dependent) captured in a CUDA graph, the L2 flushed before each replay, and K2 alone on
x_q and h given. Each step is reported as first / median / last CTA in µs after the first
shrink CTA started (K2 alone: after its own first CTA), medians over the replays. The
stamps show what `stages` can only infer: how late K2's CTAs start, how long they wait for x_q,
and whether the epilogue waits for h. `pair_sq` / `k2_sq_alone`: the same for the self-quantizing
K2 beside the shrink without quantization planes (the path "decode_sq" at 1..8 tokens), with
K2's own quantization steps (its CTA's token maxima, the scales after the cluster's exchange, the
codes stored = x_q ready). `fh`: the K2 of the path "decode_fh" alone (it computes h itself): its
CTA's units of h done and published, h ready = the epilogue past its wait for every unit.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase  # noqa: E402
from tools.bench_prefill import _int_list  # noqa: E402

REPLAYS = 7


def _events(trace: torch.Tensor, names, t0: int, kinds=None) -> dict:
    """{(kind, event): (first, median, last, count)} in µs after t0, over the CTAs that stamped it."""
    out = {}
    tr = trace.cpu()
    for k, name in enumerate(names):
        col = tr[:, k]
        for kind in sorted(set(kinds)) if kinds is not None else [None]:
            sel = col if kind is None else col[[i for i, kd in enumerate(kinds) if kd == kind]]
            v = sorted(((x - t0) / 1e3) for x in sel.tolist() if x > 0)
            if v:
                out[(kind or "", name)] = (v[0], statistics.median(v), v[-1], len(v))
    return out


class Timeline:
    """Trace-build specs of one projection's decode pair and of K2 alone."""

    def __init__(self, c: LayerCase):
        from epilora_cute.ops import _full_ranks, _slice_start, quantize_fp8_per_token
        from kernels_dsl import k2_gemm, lora_shrink

        self.k2, self.shrink = k2_gemm, lora_shrink
        m, k = c.x.shape
        widths, n, dev = c.proj.slices, c.proj.n, c.x.device
        L = c.max_loras
        x_q, x_scale = [t.contiguous() for t in quantize_fp8_per_token(c.x)]
        x_scale = x_scale.reshape(-1).contiguous()
        self.h = torch.zeros(len(widths), m, c.rank, device=dev)
        self.sync = torch.zeros(2, dtype=torch.int32, device=dev)
        self.sync_alone = torch.zeros(2, dtype=torch.int32, device=dev)
        common = dict(token_lora=c.meta.token_lora_mapping[:m], active_lora_ids=c.meta.active_lora_ids,
                      num_active=c.meta.num_active, slot_ranks=_full_ranks(L, c.rank, dev))
        self.s_cfg = dataclasses.replace(lora_shrink.select(len(widths), m, c.rank), trace=True)
        split_s = lora_shrink.choose_split(k, len(widths), c.rank, min(m, L + 1))
        g = self.s_grid = lora_shrink.launch_grid(self.s_cfg, m, split_s, L)
        self.zq = lora_shrink.quant_planes(m, g[0] * g[1])
        self.s_trace = torch.zeros(g[0] * g[1] * g[2], lora_shrink.TRACE_SLOTS, dtype=torch.int64, device=dev)
        self.s_spec = lora_shrink.launch(self.s_cfg, x=c.x, lora_a=c.lora_a, h=self.h, x_q=x_q, x_scale=x_scale,
                                         sync=self.sync, split=split_s, trace=self.s_trace, **common)
        # The shrink alone (nothing beside it): its counter only counts up, nobody waits on it.
        self.s_trace_alone = torch.zeros_like(self.s_trace)
        self.s_spec_alone = lora_shrink.launch(self.s_cfg, x=c.x, lora_a=c.lora_a, h=self.h, x_q=x_q,
                                               x_scale=x_scale, sync=self.sync_alone, split=split_s,
                                               trace=self.s_trace_alone, **common)
        bm = k2_gemm.bm_for(widths)
        self.k_cfg = k2_gemm.default_config(k2_gemm.token_tile(m), bm, lora=True, num_slices=len(widths), rank=c.rank,
                                            trace=True)
        split = k2_gemm.split_for(self.k_cfg, n, k)
        self.k_trace = torch.zeros(split * (n // bm), k2_gemm.TRACE_SLOTS, dtype=torch.int64, device=dev)
        self.k_trace_alone = torch.zeros_like(self.k_trace)
        k2_common = dict(w_q=c.w_q, w_scale=c.w_s, x_q=x_q, x_scale=x_scale, y=c.y, split=split, h=self.h,
                         slice_start=_slice_start(widths, dev), lora_b=c.lora_b, **common)
        self.k_spec = k2_gemm.launch(self.k_cfg, sync=self.sync, n_quant=self.s_spec["n_quant"],
                                     trace=self.k_trace, **k2_common)
        self.k_spec_alone = k2_gemm.launch(self.k_cfg, sync=self.sync_alone, n_quant=0, trace=self.k_trace_alone,
                                           **k2_common)
        # The self-quantizing pair (no quantization planes in the shrink, x given to K2).
        self.sq = k2_gemm.self_quant_applies(m, k)
        if self.sq:
            self.s_cfg_nq = dataclasses.replace(self.s_cfg, quant=False)
            gq = lora_shrink.launch_grid(self.s_cfg_nq, m, split_s, L)
            self.s_trace_nq = torch.zeros(gq[0] * gq[1] * gq[2], lora_shrink.TRACE_SLOTS, dtype=torch.int64,
                                          device=dev)
            self.s_spec_nq = lora_shrink.launch(self.s_cfg_nq, x=c.x, lora_a=c.lora_a, h=self.h, split=split_s,
                                                trace=self.s_trace_nq, **common)
            self.kq_cfg = k2_gemm.default_config(8, bm, lora=True, num_slices=len(widths), rank=c.rank, trace=True,
                                                 self_quant=True)
            kq_common = dict(k2_common, split=k2_gemm.split_for(self.kq_cfg, n, k), x=c.x)
            for drop in ("x_q", "x_scale"):
                kq_common.pop(drop)
            nq = kq_common["split"] * (n // bm)
            self.kq_trace = torch.zeros(nq, k2_gemm.TRACE_SLOTS, dtype=torch.int64, device=dev)
            self.kq_trace_alone = torch.zeros_like(self.kq_trace)
            self.kq_spec = k2_gemm.launch(self.kq_cfg, trace=self.kq_trace, **kq_common)
            self.kq_spec_alone = k2_gemm.launch(self.kq_cfg, trace=self.kq_trace_alone, **kq_common)
            # decode_fh: the same K2 computing h itself (one launch, its own counters and workspace).
            self.kf_cfg = dataclasses.replace(self.kq_cfg, fused_h=True)
            self.kf_sync = torch.zeros(2, dtype=torch.int32, device=dev)
            self.kf_partials = torch.empty(k2_gemm.fused_h_workspace_shape(self.kf_cfg, k), dtype=torch.float32,
                                           device=dev)
            self.kf_trace = torch.zeros_like(self.kq_trace)
            self.kf_spec = k2_gemm.launch(self.kf_cfg, trace=self.kf_trace, sync=self.kf_sync, lora_a=c.lora_a,
                                          **dict(kq_common, h=self.kf_partials))

    def _run(self, mod, cfg, spec, pdl=False):
        from epilora_cute.kernels import get_kernel

        kern = get_kernel(mod, cfg, "sm_90a")
        return lambda: kern(*spec["args"], grid=spec["grid"], smem=spec["smem"], pdl=pdl, cluster=spec["cluster"])

    def cases(self) -> dict:
        shrink = self._run(self.shrink, self.s_cfg, self.s_spec)
        k2_pdl = self._run(self.k2, self.k_cfg, self.k_spec, pdl=True)
        out = {"pair": (lambda: (shrink(), k2_pdl()), (self.s_trace, self.k_trace)),
               "k2_alone": (self._run(self.k2, self.k_cfg, self.k_spec_alone), (None, self.k_trace_alone)),
               "shrink_alone": (self._run(self.shrink, self.s_cfg, self.s_spec_alone), (self.s_trace_alone, None))}
        if self.sq:
            shrink_nq = self._run(self.shrink, self.s_cfg_nq, self.s_spec_nq)
            kq_pdl = self._run(self.k2, self.kq_cfg, self.kq_spec, pdl=True)
            out["pair_sq"] = (lambda: (shrink_nq(), kq_pdl()), (self.s_trace_nq, self.kq_trace))
            out["k2_sq_alone"] = (self._run(self.k2, self.kq_cfg, self.kq_spec_alone), (None, self.kq_trace_alone))
            out["fh"] = (self._run(self.k2, self.kf_cfg, self.kf_spec), (None, self.kf_trace))
        return out

    def summarize(self, s_trace, k_trace, planes: int | None = None, k_names=None) -> dict:
        """planes: the shrink's quantization planes (default: the quantizing build's; 0 for pair_sq)."""
        per = self.s_grid[0] * self.s_grid[1]
        zq = self.zq if planes is None else planes
        starts = [t for t in ((s_trace[:, 0].tolist() if s_trace is not None else [])
                              + (k_trace[:, 0].tolist() if k_trace is not None else [])) if t > 0]
        t0 = min(starts)
        ev = {}
        if s_trace is not None:
            kinds = ["shrink-quant" if i // per < zq else "shrink-down" for i in range(s_trace.shape[0])]
            ev.update(_events(s_trace, self.shrink.TRACE_SHRINK, t0, kinds))
        if k_trace is not None:
            ev.update({("k2", e): v for (_, e), v in _events(k_trace, k_names or self.k2.TRACE_K2, t0).items()})
        return ev


def timeline_tokens() -> list[int]:
    """The token counts to trace: EPILORA_BENCH_TOKENS (as the other sections) within the trace
    builds' 1..32, else 1 and 8."""
    env = os.environ.get("EPILORA_BENCH_TOKENS")
    if not env:
        return [1, 8]
    out = _int_list(env, "EPILORA_BENCH_TOKENS")
    bad = [m for m in out if m > 32]
    if bad:
        raise ValueError(f"timeline: EPILORA_BENCH_TOKENS {bad} outside the decode path's 1..32")
    return out


def bench_timeline(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("timeline: needs an sm_90 GPU; skipped")
        return []
    from tools.gpu_timing import _flush, capture

    rows = []
    for m in timeline_tokens():
        for p in QWEN3_8B:
            base = {"section": "timeline", "proj": p.name, "M": m}
            try:
                tl = Timeline(LayerCase(p, m, 64))
                cases = tl.cases()
            except Exception as e:  # a missing trace build is reported, not fatal
                rows.append(base | {"error": f"{type(e).__name__}: {e}"[:200]})
                continue
            for case, (fn, (s_tr, k_tr)) in cases.items():
                try:
                    g = capture(fn)
                    for _ in range(3):
                        g.replay()
                    samples = []
                    for _ in range(REPLAYS):
                        for t in (s_tr, k_tr):
                            if t is not None:
                                t.zero_()
                        _flush()
                        g.replay()
                        torch.cuda.synchronize()
                        samples.append(tl.summarize(s_tr, k_tr, planes=0 if case.endswith("_sq") else None,
                                                    k_names=tl.k2.TRACE_K2_FH if case == "fh" else None))
                except Exception as e:  # noqa: BLE001
                    rows.append(base | {"case": case, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                for key in samples[0]:
                    vals = [s[key] for s in samples if key in s]
                    rows.append(base | {"case": case, "kernel": key[0], "event": key[1],
                                        "first_us": statistics.median(v[0] for v in vals),
                                        "median_us": statistics.median(v[1] for v in vals),
                                        "last_us": statistics.median(v[2] for v in vals), "ctas": vals[0][3]})
            for r in rows:
                if r.get("proj") == p.name and r.get("M") == m and "event" in r:
                    print(f"timeline {p.name} M={m} {r['case']:8s} {r['kernel']:12s} {r['event']:26s} "
                          f"{r['first_us']:7.2f} {r['median_us']:7.2f} {r['last_us']:7.2f}  ({r['ctas']} CTAs)", flush=True)
    return rows


SECTIONS = {"timeline": bench_timeline}
