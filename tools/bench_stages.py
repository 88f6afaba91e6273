"""Bench section `stages`: the decode path taken apart, one stage left out at a time.

Per Qwen3-8B projection, rank 64, one adapter (EPILORA_BENCH_ADAPTERS: 1..8 distinct adapters, token i
on adapter i mod A; rows with A != 1 carry `adapters`), M in {1, 8, 32} (EPILORA_BENCH_TOKENS overrides),
CUDA-graph replays with the L2 flushed (median), all in one run:
  quant_us          our standalone per-token quantization kernel
  k2_us             K2 without adapter, x_q given (no quantization, no flag wait)
  k2_epilogue_us    K2 with the adapter epilogue, x_q and h given (no shrink, no PDL)
  shrink_us         the shrink kernel with its quantization planes, alone
  shrink_noquant_us the shrink kernel's down-projection alone
  shrink_st4_us     the shrink with the former 4-stage pipeline (the default has 8)
  decode_us         shrink then K2 as the decode path runs them (PDL)
  decode_nopdl_us   the same without PDL
  decode_x2_us, decode_x2_chain_us   the decode path twice back to back, the second shrink
                    launched without / with PDL behind the first K2 (chained, as
                    lora_linear_fp8(chain_pdl=True) does): the difference is the gain of one
                    projection boundary
  k2_{c1,c1st8}_us, k2_epilogue_{c1,c1st8}_us   the K2 rows with the former default (one CTA per SM,
                    4 stages) and one CTA per SM with 8 stages (where built)
  decode_s{S}_us, shrink_s{S}_us   the decode path (and the shrink alone) with the shrink's split-K
                    forced to S in {2, 4, 8, 16} where it differs from the default (shrink_split in
                    the row): does the shrink, slowed beside K2's full-bandwidth stream, hold K2's
                    epilogue back (more CTAs, each a bandwidth share), or do its CTAs take SM room
                    that K2's CTAs wait for (fewer)?
  decode_st4_us     the decode path with the 4-stage shrink (less shared memory per shrink CTA)
  decode_c1_us, decode_c1st8_us   the decode path with the one-CTA-per-SM K2 builds
  decode_e1_us      the decode path with K2 requesting one weight stage (not all) before x_q is
                    ready (1..8 tokens, rank 64 builds)
  k2_sq_us, k2_epilogue_sq_us, decode_sq_us   1..8 tokens: the self-quantizing K2 (bf16 x in;
                    the shrink without quantization planes beside it), alone, with the epilogue (h
                    given) and as the decode pair (docs/perf.md v0.29): the path "decode_sq", which
                    the timed dispatch weighs against "decode" (the rows above: the quantization in
                    the shrink kernel)
  decode_fh_us      1..8 tokens: the self-quantizing K2 computing h itself (the path "decode_fh",
                    one launch, no shrink; docs/perf.md v0.43)
  k2_sq_wide_us, k2_epilogue_sq_wide_us, decode_sq_wide_us   the same with the wide builds
                    (Config.sq_xblocks: 32 resident k-blocks, docs/perf.md v0.54) where they run the
                    batch at a smaller split (gate_up and down at 1..4 tokens)
  k2_sqr_us, decode_sqr_us   the same with the sq_rowmax builds (each CTA takes the token maxima
                    over the whole rows where M * K <= k2_gemm.ROWMAX_ELEMS: no cluster exchange)
  k2_fixed_us, k2_epilogue_fixed_us   the k2 / k2_epilogue rows' build, grid and cluster on one
                    k-block per CTA (K = bk x split): launch, prologue, pipeline fill, the cluster
                    reduction and the stores without the weight stream, i.e. K2's fixed cost
                    (k2 - k2_fixed is what streaming the rest of the weights adds)
The differences place the decode path's time (docs/perf.md): e.g. decode - k2 is what the adapter
and the quantization cost on top of streaming the weights.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_decode import QWEN3_8B, LayerCase  # noqa: E402
from tools.bench_prefill import _int_list  # noqa: E402
from tools.gpu_timing import read_bandwidth_gbs, time_graph  # noqa: E402


class DecodeStages:
    """Buffers and launch specs of one projection's decode path, built once."""

    def __init__(self, c: LayerCase):
        from epilora_cute.ops import _full_ranks, _slice_start, quantize_fp8_per_token
        from kernels_dsl import k2_gemm, lora_shrink

        self.k2, self.shrink = k2_gemm, lora_shrink
        self.c = c
        m, k = c.x.shape
        widths = c.proj.slices
        n = c.proj.n
        dev = c.x.device
        L = c.max_loras
        self.x_q, self.x_scale = [t.contiguous() for t in quantize_fp8_per_token(c.x)]
        self.x_scale = self.x_scale.reshape(-1).contiguous()
        self.h = torch.zeros(len(widths), m, c.rank, device=dev)
        self.sync = torch.zeros(2, dtype=torch.int32, device=dev)  # shrink + K2 pairs only
        self.sync_alone = torch.zeros(2, dtype=torch.int32, device=dev)  # counts up, never read
        ranks = _full_ranks(L, c.rank, dev)
        tok = c.meta.token_lora_mapping[:m]
        common = dict(token_lora=tok, active_lora_ids=c.meta.active_lora_ids, num_active=c.meta.num_active,
                      slot_ranks=ranks)
        split_s = lora_shrink.choose_split(k, len(widths), c.rank, min(m, L + 1))
        s_cfg = lora_shrink.select(len(widths), m, c.rank)
        self.s_cfg, self.s_cfg_nq = s_cfg, dataclasses.replace(s_cfg, quant=False)
        self.s_cfg_st4 = dataclasses.replace(s_cfg, stages=4)
        shrink_args = dict(x=c.x, lora_a=c.lora_a, h=self.h, x_q=self.x_q, x_scale=self.x_scale, split=split_s,
                           **common)
        self.s_spec = lora_shrink.launch(s_cfg, sync=self.sync, **shrink_args)
        self.s_spec_alone = lora_shrink.launch(s_cfg, sync=self.sync_alone, **shrink_args)
        self.s_spec_nq = lora_shrink.launch(self.s_cfg_nq, sync=self.sync_alone, **shrink_args)
        self.s_spec_st4 = lora_shrink.launch(self.s_cfg_st4, sync=self.sync_alone, **shrink_args)
        l_cfg, n_cfg = k2_gemm.select(widths, m, c.rank)
        self.l_cfg, self.n_cfg = l_cfg, n_cfg
        split = k2_gemm.split_for(l_cfg, n, k, m)
        k2_common = dict(w_q=c.w_q, w_scale=c.w_s, x_q=self.x_q, x_scale=self.x_scale, y=c.y, split=split)
        lora_args = dict(h=self.h, slice_start=_slice_start(widths, dev), lora_b=c.lora_b, **common)
        self.k2_spec = k2_gemm.launch(n_cfg, sync=self.sync_alone, n_quant=0, **k2_common)
        self.k2_epi_spec = k2_gemm.launch(l_cfg, sync=self.sync_alone, n_quant=0, **k2_common, **lora_args)
        self.k2_pair_spec = k2_gemm.launch(l_cfg, sync=self.sync, n_quant=self.s_spec["n_quant"], **k2_common,
                                           **lora_args)
        # K2's fixed cost: the same builds and geometry on one k-block per CTA. A failure here
        # leaves these two rows out, not the projection's others.
        self.fixed = {}
        try:
            kf = split * max(n_cfg.bk, l_cfg.bk)
            fixed_common = dict(k2_common, w_q=c.w_q[:, :kf].contiguous(), x_q=self.x_q[:, :kf].contiguous())
            self.fixed["k2_fixed"] = (n_cfg, k2_gemm.launch(n_cfg, sync=self.sync_alone, n_quant=0, **fixed_common))
            self.fixed["k2_epilogue_fixed"] = (
                l_cfg, k2_gemm.launch(l_cfg, sync=self.sync_alone, n_quant=0, **fixed_common, **lora_args))
        except Exception as e:  # noqa: BLE001 - reported in the row, the other stages still run
            self.fixed_error = f"{type(e).__name__}: {e}"[:200]
        # The decode pair with other shrink splits, the 4-stage shrink, the one-CTA-per-SM K2 builds:
        # each pair has its own counter (n_quant follows the shrink's grid).
        self.split_s = split_s
        self.pairs = {}
        nk_s = -(-k // s_cfg.bk)
        pair_shrinks = {f"s{sv}": (s_cfg, sv) for sv in (2, 4, 8, 16) if sv != split_s and nk_s // sv >= 2}
        pair_shrinks["st4"] = (self.s_cfg_st4, split_s)
        for tag, (scfg, sv) in pair_shrinks.items():
            sync_v = torch.zeros(2, dtype=torch.int32, device=dev)
            sspec = lora_shrink.launch(scfg, sync=sync_v, **dict(shrink_args, split=sv))
            kspec = k2_gemm.launch(l_cfg, sync=sync_v, n_quant=sspec["n_quant"], **k2_common, **lora_args)
            self.pairs[f"decode_{tag}"] = (scfg, sspec, l_cfg, kspec)
            if tag.startswith("s"):
                self.pairs[f"shrink_{tag}"] = (scfg, lora_shrink.launch(scfg, sync=self.sync_alone,
                                                                        **dict(shrink_args, split=sv)), None, None)
        for tag, kw in (("c1", dict(ctas=1, stages=4)), ("c1st8", dict(ctas=1, stages=8))):
            lv, _ = k2_gemm.select(widths, m, c.rank, **kw)
            if lv != l_cfg:
                sync_v = torch.zeros(2, dtype=torch.int32, device=dev)
                sspec = lora_shrink.launch(s_cfg, sync=sync_v, **shrink_args)
                kspec = k2_gemm.launch(lv, sync=sync_v, n_quant=sspec["n_quant"],
                                       **dict(k2_common, split=k2_gemm.split_for(lv, n, k, m)), **lora_args)
                self.pairs[f"decode_{tag}"] = (s_cfg, sspec, lv, kspec)
        # K2 requesting one weight stage, not all, before x_q is ready (Config.early, perf.md v0.27).
        le = (None if l_cfg.token_tiles  # (no early builds with token tiles)
              else dataclasses.replace(l_cfg, early=1, push_maxima=False, push_partials=False))
        if le is not None and le in k2_gemm.early_configs():
            sync_v = torch.zeros(2, dtype=torch.int32, device=dev)
            sspec = lora_shrink.launch(s_cfg, sync=sync_v, **shrink_args)
            kspec = k2_gemm.launch(le, sync=sync_v, n_quant=sspec["n_quant"], **k2_common, **lora_args)
            self.pairs["decode_e1"] = (s_cfg, sspec, le, kspec)
        # The self-quantizing K2 (1..8 tokens): alone, with the epilogue, and beside the shrink
        # without quantization planes (what lora_linear_fp8 runs there).
        if k2_gemm.self_quant_applies(m, k):
            lq, nq = k2_gemm.select(widths, m, c.rank, self_quant=True)
            sq_common = dict(w_q=c.w_q, w_scale=c.w_s, x=c.x, y=c.y, split=k2_gemm.split_for(lq, n, k))
            nq_common = dict(sq_common, split=k2_gemm.split_for(nq, n, k))
            self.fixed["k2_sq"] = (nq, k2_gemm.launch(nq, **nq_common))
            self.fixed["k2_epilogue_sq"] = (lq, k2_gemm.launch(lq, **sq_common, **lora_args))
            # (one shrink spec for both pairs: without quantization planes it has no counter)
            sspec = lora_shrink.launch(self.s_cfg_nq, **shrink_args)
            self.pairs["decode_sq"] = (self.s_cfg_nq, sspec, lq, k2_gemm.launch(lq, **sq_common, **lora_args))
            # The wide builds (Config.sq_xblocks, perf.md v0.54) where they lower the split, beside
            # the default ones in the same run whatever EPILORA_K2_SQ_WIDE says.
            lw, nw = (k2_gemm.sq_wide_applies(cf, n, k, m) for cf in (lq, nq))
            if nw is not None:
                self.fixed["k2_sq_wide"] = (nw, k2_gemm.launch(nw, **dict(sq_common, split=k2_gemm.split_for(nw, n, k, m))))
            if lw is not None:
                w_common = dict(sq_common, split=k2_gemm.split_for(lw, n, k, m))
                self.fixed["k2_epilogue_sq_wide"] = (lw, k2_gemm.launch(lw, **w_common, **lora_args))
                self.pairs["decode_sq_wide"] = (self.s_cfg_nq, sspec, lw, k2_gemm.launch(lw, **w_common, **lora_args))
            # decode_fh: the same K2 computing h too (one launch; its own counters and workspace).
            lf, _ = k2_gemm.select(widths, m, c.rank, fused_h=True)
            self.sync_fh = torch.zeros(2, dtype=torch.int32, device=dev)
            self.partials = torch.empty(k2_gemm.fused_h_workspace_shape(lf, k), dtype=torch.float32, device=dev)
            self.fixed["decode_fh"] = (lf, k2_gemm.launch(
                lf, **dict(sq_common, split=k2_gemm.split_for(lf, n, k)), sync=self.sync_fh,
                **dict(lora_args, h=self.partials), lora_a=c.lora_a))
            lr, nr = (dataclasses.replace(cf, sq_rowmax=True, push_maxima=False, push_partials=False) for cf in (lq, nq))
            if lr in k2_gemm.rowmax_configs() and nr in k2_gemm.rowmax_configs():
                self.fixed["k2_sqr"] = (nr, k2_gemm.launch(nr, **nq_common))
                self.pairs["decode_sqr"] = (self.s_cfg_nq, sspec, lr, k2_gemm.launch(lr, **sq_common, **lora_args))
        # The same two K2 runs with the experimental builds (k2_gemm.select: ctas / stages).
        self.variants = {}
        for tag, kw in (("c1", dict(ctas=1, stages=4)), ("c1st8", dict(ctas=1, stages=8))):
            lv, nv = k2_gemm.select(widths, m, c.rank, **kw)
            common_v = dict(k2_common, split=k2_gemm.split_for(lv, n, k, m))
            if nv != n_cfg:
                self.variants[f"k2_{tag}"] = (nv, k2_gemm.launch(nv, sync=self.sync_alone, n_quant=0, **common_v))
            if lv != l_cfg:
                self.variants[f"k2_epilogue_{tag}"] = (
                    lv, k2_gemm.launch(lv, sync=self.sync_alone, n_quant=0, **common_v, **lora_args))

    def _kernel(self, mod, cfg):
        from epilora_cute.kernels import get_kernel

        return get_kernel(mod, cfg, "sm_90a")

    def _run(self, mod, cfg, spec, pdl=False):
        # The kernel is loaded at the first launch (the timing's warm-up, outside capture): a build
        # missing from the cache costs its own column, not the row.
        kern = []

        def run():
            if not kern:
                kern.append(self._kernel(mod, cfg))
            kern[0](*spec["args"], grid=spec["grid"], smem=spec["smem"], pdl=pdl, cluster=spec["cluster"])
        return run

    def launchers(self) -> dict:
        from epilora_cute.ops import quantize_fp8_per_token

        c = self.c
        shrink = self._run(self.shrink, self.s_cfg, self.s_spec)
        shrink_chained = self._run(self.shrink, self.s_cfg, self.s_spec, pdl=True)
        pair_pdl = self._run(self.k2, self.l_cfg, self.k2_pair_spec, pdl=True)
        pair = self._run(self.k2, self.l_cfg, self.k2_pair_spec)
        return {
            "quant": lambda: quantize_fp8_per_token(c.x),
            "k2": self._run(self.k2, self.n_cfg, self.k2_spec),
            "k2_epilogue": self._run(self.k2, self.l_cfg, self.k2_epi_spec),
            "shrink": self._run(self.shrink, self.s_cfg, self.s_spec_alone),
            "shrink_noquant": self._run(self.shrink, self.s_cfg_nq, self.s_spec_nq),
            "shrink_st4": self._run(self.shrink, self.s_cfg_st4, self.s_spec_st4),
            "decode": lambda: (shrink(), pair_pdl()),
            "decode_nopdl": lambda: (shrink(), pair()),
            "decode_x2": lambda: (shrink(), pair_pdl(), shrink(), pair_pdl()),
            "decode_x2_chain": lambda: (shrink(), pair_pdl(), shrink_chained(), pair_pdl()),
        } | {name: self._run(self.k2, cfg, spec) for name, (cfg, spec) in (self.variants | self.fixed).items()
             } | {name: self._pair(*v) for name, v in self.pairs.items()}

    def _pair(self, s_cfg, s_spec, k_cfg, k_spec):
        shrink = self._run(self.shrink, s_cfg, s_spec)
        if k_cfg is None:
            return shrink
        k2 = self._run(self.k2, k_cfg, k_spec, pdl=True)
        return lambda: (shrink(), k2())


def stage_adapters() -> list[int]:
    """EPILORA_BENCH_ADAPTERS (the `prefill` / `hybrid_stages` knob): distinct adapters among the
    tokens (token i takes adapter i mod A of the bench's 8 slots), default one."""
    env = os.environ.get("EPILORA_BENCH_ADAPTERS")
    out = _int_list(env, "EPILORA_BENCH_ADAPTERS") if env else [1]
    bad = [a for a in out if a > 8]
    if bad:
        raise ValueError(f"stages: EPILORA_BENCH_ADAPTERS {bad} outside 1..8 (the bench's 8 adapter slots)")
    return out


def bench_stages(quick: bool) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("stages: needs an sm_90 GPU; skipped")
        return []
    env = os.environ.get("EPILORA_BENCH_TOKENS")
    tokens = [int(t) for t in env.split(",")] if env else [1, 8, 32]
    adapters = stage_adapters()
    bw = read_bandwidth_gbs()
    rows = []
    for m, a in ((m, a) for a in adapters for m in tokens):
        for p in QWEN3_8B:
            c = LayerCase(p, m, 64, num_adapters=a)
            row = {"section": "stages", "proj": p.name, "M": m, "floor_us": p.n * p.k / (bw * 1e9) * 1e6}
            if a != 1:  # rows of the default (one adapter) keep their old keys
                row["adapters"] = a
            try:
                stages = DecodeStages(c)
                fns = stages.launchers()
            except Exception as e:  # a missing kernel build is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                continue
            row["shrink_split"] = stages.split_s
            if getattr(stages, "fixed_error", None):
                row["k2_fixed_error"] = stages.fixed_error
            for name, fn in fns.items():
                try:
                    row[f"{name}_us"] = time_graph(fn)
                except Exception as e:
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print("stages " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in row.items() if k != "section"), flush=True)
    return rows


SECTIONS = {"stages": bench_stages}
