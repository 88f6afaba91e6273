"""Comparison and report of tools/e2e_vllm.py (pure functions on the workers' JSON results).

Targets are issue #5's; anchors are stock vLLM on the H200 with the same setup, from
../shared/notes/vllm-on-h200.md. The anchors' tok/s are read as output tokens/s: 64 x 128 output
tokens at 6531 tok/s is 1.25 s, ~10 ms per batch-64 decode step (3.5 ms at batch 1), while 6531
total (prompt + output) tok/s would mean 6.3 s. The report gives both conventions.
"""

from __future__ import annotations

import re

from tools.e2e_model import NUM_ADAPTERS, RANK

CONFIGS = ("stock", "ours")

TARGET_TPOT_ONE_ADAPTER_MS = 3.7
TARGET_TPUT_8_ADAPTERS = 5300.0  # output tokens/s
TARGET_GREEDY_ADAPTERS = 14  # of 16 identical to stock; without adapter: all 16
ANCHORS = {"tpot_none_ms": 3.51, "tpot_one_adapter_ms": 5.97,
           "tput_none": 6531.0, "tput_one_adapter": 4160.0, "tput_eight_adapters": 3310.0}

# Teacher-forced |logprob(ours) - logprob(stock)| tolerances, nats. Both paths quantize the
# activations to the same FP8 codes and scales (bit-exact, docs/perf.md), so the base GEMMs differ
# only in accumulation order / the tensor cores' FP8 accumulation (~2^-14 relative or less): a
# few % of outputs land on the neighbouring bf16 value (2^-8 relative). With an adapter, stock
# rounds the base output to bf16, adds the LoRA update and rounds again, the fused op rounds
# once: ~1/4 of those outputs differ by one ulp, ~1.5e-3 relative rms per layer. Through 36
# random layers that is a few 1e-3 of the final hidden state: ~0.005-0.01 nats per token on
# logits of std ~1.3 (the dense init: 0.02 * sqrt(hidden)), tails ~5x that. A dropped, misrouted or
# mis-scaled adapter moves each layer's output by ~10 % (tools/e2e_model.py): 0.1-1 nats per
# token (the report shows it as "adapter effect"). The bounds sit between the two.
# Greedy identity is a much blunter check on a random model: its top-2 logit gap is
# ~ std / sqrt(2 ln vocab) ~ 0.26 on average (exponentially distributed), so a 0.01 logit
# perturbation flips a few % of the steps and 32-step runs diverge often; the report therefore
# also gives the per-position top-1 agreement and the identical count it predicts.
TOL_MEAN_NATS = 0.02
TOL_MAX_NATS = 0.2
LOG_TAIL_LINES = 15  # of a failed engine's log, in e2e.md (e2e.json keeps 40)

PLUGIN_LOG_PATTERNS = {
    "taken_over": re.compile(r"EpiLoRA: (\S+) -> (EpiLoRA\w+) \(fused FP8 LoRA\)"),
    "stays_on_vllm": re.compile(r"EpiLoRA: (\S+) stays on vLLM's (\w+): (.*)"),
    "computes_with_vllm": re.compile(r"EpiLoRA: (\S+) computes with vLLM's kernels: (.*)"),
}

# epilora_cute.dispatch's line per decision: "dispatch <key> -> <path> (<why or timings>)".
DISPATCH_LINE = re.compile(r"epilora_cute\.dispatch: dispatch (.+?) -> (\w+) \((.*)\)\s*$")


def _gain_note(spec: dict) -> str:
    """', adapter gain G' when the run set one (runs before the option used the default)."""
    g = spec.get("lora_gain")
    return "" if g is None else f", adapter gain {g:g}"


def _dispatch_summary(text: str) -> dict:
    """The timed dispatch's decisions in an engine log: the last path per key, and how many keys
    each path won per mode ("graph" / "eager", the key's last field)."""
    last: dict[str, str] = {}
    for line in text.splitlines():
        m = DISPATCH_LINE.search(line)
        if m:
            last[m.group(1)] = m.group(2)
    wins: dict[str, dict[str, int]] = {}
    for key, path in last.items():
        mode = key.rsplit("|", 1)[-1]
        wins.setdefault(mode, {})
        wins[mode][path] = wins[mode].get(path, 0) + 1
    return {"dispatch_decisions": last, "dispatch_wins": wins}


# vLLM's start-up phases as its engine log states them (seconds). Inductor's line is the one that
# exposed run32 / run33's slow start (a per-layer constant defeated vLLM's reuse of one compiled
# decoder-layer piece): compared between the engines in every report.
STARTUP_PATTERNS = {
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "inductor_s": re.compile(r"Compiling a graph for compile range .* takes ([\d.]+) s"),
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "profiling_run_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
}


def startup_summary(text: str) -> dict:
    """{phase: seconds} from an engine log (a phase logged several times is summed)."""
    out = {}
    for key, pat in STARTUP_PATTERNS.items():
        found = [float(v) for v in pat.findall(text)]
        if found:
            out[key] = round(sum(found), 2)
    return out


def plugin_log_summary(text: str) -> dict:
    """What the ``vllm.epilora`` lines of an engine log say (each layer counted once)."""
    found = {k: {} for k in PLUGIN_LOG_PATTERNS}
    for line in text.splitlines():
        if "EpiLoRA" not in line:
            continue
        for key, pat in PLUGIN_LOG_PATTERNS.items():
            m = pat.search(line)
            if m:
                found[key][m.group(1)] = m.group(m.lastindex)
    reasons: dict[str, int] = {}
    for key in ("stays_on_vllm", "computes_with_vllm"):
        for why in found[key].values():
            reasons[why] = reasons.get(why, 0) + 1
    return {**_dispatch_summary(text),
            "plugin_active": "EpiLoRA plugin active" in text,
            "plugin_disabled": "EpiLoRA plugin disabled" in text,
            "plugin_off": re.findall(r"EpiLoRA plugin off: .*", text)[:1],
            # vllm_adapter/logits.py: the lm_head LoRA wrapper the plugin installed, or why not
            "lm_head": (re.findall(r"lm_head LoRA(?: stays on vLLM's [^:]*)?: .*", text) or [None])[0],
            **{k: len(v) for k, v in found.items()},
            "taken_over_classes": sorted(set(found["taken_over"].values())),
            "fallback_reasons": reasons,
            "aot_cache_loaded": "Directly load AOT compilation" in text,
            "startup": startup_summary(text)}


def compare_greedy(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None if len(s) == len(t) else min(len(s), len(t)))
             for s, t in zip(a, b)]
    return {"identical": sum(f is None for f in first), "total": len(first), "first_divergence": first}


def compare_logprobs(a: dict, b: dict, prompt_len: int, gen_len: int = 32) -> dict:
    """|Δlogprob| over every scored position (and over the generated positions only) and the
    top-1 agreement; ``expected_identical`` is how many of the greedy runs (``gen_len`` tokens
    each) stay identical if every position flips independently at the measured disagreement."""
    d_all, d_gen, agree, n = [], [], 0, 0
    for la, lb, ta, tb in zip(a["lp"], b["lp"], a["top1"], b["top1"]):
        for j, (x, y) in enumerate(zip(la, lb)):
            d_all.append(abs(x - y))
            if j >= prompt_len - 1:
                d_gen.append(abs(x - y))
        agree += sum(x == y for x, y in zip(ta, tb))
        n += len(ta)
    if not d_all:
        return {"positions": 0}
    frac = agree / n
    return {"positions": len(d_all), "max_abs": max(d_all), "mean_abs": sum(d_all) / len(d_all),
            "gen_max_abs": max(d_gen, default=0.0), "gen_mean_abs": sum(d_gen) / len(d_gen) if d_gen else 0.0,
            "top1_agreement": frac, "expected_identical": len(a["lp"]) * frac ** gen_len,
            "within_tolerance": max(d_all) <= TOL_MAX_NATS and sum(d_all) / len(d_all) <= TOL_MEAN_NATS}


# Verdict of the fp32 reference comparison: ours' mean |Δlogprob| to the reference at most this
# multiple of stock's is "as close to the exact computation as stock" (both carry bf16 rounding and
# accumulation-order noise of the same kind); beyond it, ours adds an error stock does not have.
REF_RATIO_OK = 1.25
REF_MIN_TOP1 = 0.3  # below this top-1 agreement with the reference, the engines ran another model
# The stated per-prompt tolerance (issue 5: "teacher-forced log-probabilities within a stated
# tolerance for all 16"): a prompt passes when ours' mean |Δlogprob| to the fp32 reference is at most
# REF_RATIO_OK × stock's + REF_SLACK_NATS. Relative to stock because the random-weight model turns
# any rounding difference into ~0.2 nats (stock batched vs stock one at a time, run7).
REF_SLACK_NATS = 0.02


def _mean_abs(a: list, b: list) -> float | None:
    n = min(len(a), len(b))
    return sum(abs(x - y) for x, y in zip(a[:n], b[:n])) / n if n else None


def per_prompt_verdict(ref_case: dict, ours: dict, stock: dict) -> dict:
    """Per prompt: ours' and stock's mean |Δlogprob| to the reference, and how many prompts pass
    the stated tolerance (``REF_RATIO_OK`` × stock's + ``REF_SLACK_NATS``)."""
    rows = []
    for r, o, s in zip(ref_case["lp"], ours["lp"], stock["lp"]):
        do, ds = _mean_abs(o, r), _mean_abs(s, r)
        if do is not None and ds is not None:
            rows.append((do, ds))
    within = [do <= REF_RATIO_OK * ds + REF_SLACK_NATS for do, ds in rows]
    return {"within": sum(within), "total": len(rows),
            "worst_ratio": max((do / ds for do, ds in rows if ds > 0), default=None),
            "ours_mean_abs": [do for do, _ in rows], "stock_mean_abs": [ds for _, ds in rows]}


def compare_fp32_reference(runs: dict, spec: dict, ref: dict) -> dict:
    """Each engine's teacher-forced logprobs against the fp32 reference's for the same sequences
    (tools/e2e_reference.py via tools/e2e_vllm.py's reference phase): per configuration and case
    (``none``, ``adapters`` and their one-at-a-time runs), compare_logprobs(reference, engine);
    ``fp8_effect``: the reference with FP8 against the reference without (bf16 weights in fp32);
    ``verdict``: ours' mean distance over stock's, per case."""
    pl, gl = spec["greedy"]["prompt_len"], spec["greedy"]["gen_len"]
    cases, out = ref.get("cases") or {}, {}
    for config, keys in (ref.get("keys") or {}).items():
        lp = ((runs.get(config) or {}).get("phases") or {}).get("logprobs") or {}
        for case, key in keys.items():
            if key not in cases:
                continue
            for variant in (case, case + "_single"):
                if variant in lp:
                    out.setdefault(config, {})[variant] = compare_logprobs(cases[key], lp[variant], pl, gl)
    unq = (ref.get("unquantized") or {}).get("cases") or {}
    fp8 = {}
    for keys in (ref.get("keys") or {}).values():
        for case, key in keys.items():
            if key in cases and key in unq and case not in fp8:
                fp8[case] = compare_logprobs(unq[key], cases[key], pl, gl)
    if fp8:
        out["fp8_effect"] = fp8
    b16 = (ref.get("with_bf16_inputs") or {}).get("cases") or {}
    eff = {}
    for keys in (ref.get("keys") or {}).values():  # the exact computation's own sensitivity to that rounding
        for case, key in keys.items():
            if key in cases and key in b16 and case not in eff:
                eff[case] = compare_logprobs(cases[key], b16[key], pl, gl)
    if eff:
        out["bf16_inputs_effect"] = eff
    for config, keys in (ref.get("keys") or {}).items():  # diagnostic: linear inputs rounded to bf16 first
        lp = ((runs.get(config) or {}).get("phases") or {}).get("logprobs") or {}
        for case, key in keys.items():
            if key in b16 and case in lp:
                out.setdefault("bf16_inputs", {}).setdefault(config, {})[case] = compare_logprobs(b16[key], lp[case],
                                                                                                   pl, gl)
    verdict = {}
    for case in ("none", "adapters"):
        s, o = _get(out, "stock", case), _get(out, "ours", case)
        if s and o and s.get("positions") and o.get("positions"):
            ratio = o["mean_abs"] / s["mean_abs"] if s["mean_abs"] > 0 else float("inf")
            verdict[case] = {"stock_mean_abs": s["mean_abs"], "ours_mean_abs": o["mean_abs"], "ratio": ratio,
                             "stock_top1": s["top1_agreement"], "ours_top1": o["top1_agreement"]}
            keys = ref.get("keys") or {}
            rk = (keys.get("ours") or {}).get(case)
            lp_o = ((runs.get("ours") or {}).get("phases") or {}).get("logprobs") or {}
            lp_s = ((runs.get("stock") or {}).get("phases") or {}).get("logprobs") or {}
            if rk in cases and case in lp_o and case in lp_s and (keys.get("stock") or {}).get(case) == rk:
                verdict[case]["per_prompt"] = per_prompt_verdict(cases[rk], lp_o[case], lp_s[case])
    if verdict:
        worst = max(v["ratio"] for v in verdict.values())
        verdict["worst_ratio"] = worst
        verdict["as_close_as_stock"] = worst <= REF_RATIO_OK
    out["verdict"] = verdict
    return out


def verdict_line(v: dict) -> str | None:
    """The report's one-line verdict of the fp32 reference comparison."""
    if not v or "worst_ratio" not in v:
        return None
    parts = [f"{'no adapter' if c == 'none' else f'{NUM_ADAPTERS} adapters'}: stock {v[c]['stock_mean_abs']:.4f}, "
             f"ours {v[c]['ours_mean_abs']:.4f} (×{v[c]['ratio']:.2f})" for c in ("none", "adapters") if c in v]
    pp = [f"{'no adapter' if c == 'none' else f'{NUM_ADAPTERS} adapters'} {v[c]['per_prompt']['within']}/"
          f"{v[c]['per_prompt']['total']} (worst ×{v[c]['per_prompt']['worst_ratio']:.2f})"
          for c in ("none", "adapters") if c in v and v[c].get("per_prompt", {}).get("total")]
    return (f"**ours is within {v['worst_ratio']:.2f}× of stock's distance to the exact computation** (mean abs "
            f"Δlogprob to the fp32 reference, nats; " + "; ".join(parts) + "): "
            + ("as close to it as stock" if v["as_close_as_stock"] else
               f"**more than {REF_RATIO_OK}× stock's: ours adds an error stock does not have**")
            + (f". Per prompt, the stated tolerance (ours ≤ {REF_RATIO_OK}× stock's distance + {REF_SLACK_NATS} "
               f"nats): " + ", ".join(pp) if pp else ""))


def compare(runs: dict, spec: dict, fp32_reference: dict | None = None) -> dict:
    """Every comparison the report shows, from the raw worker results (missing parts skipped)."""
    out: dict = {}
    if fp32_reference and fp32_reference.get("cases"):
        out["fp32_reference"] = compare_fp32_reference(runs, spec, fp32_reference)
    pl, gl = spec["greedy"]["prompt_len"], spec["greedy"]["gen_len"]
    for name, run in runs.items():
        g = run.get("phases", {}).get("greedy")
        if g:  # same engine: batched vs one at a time, and the adapters' effect on the tokens
            out[f"{name}_floor_greedy"] = {c: compare_greedy(g[c], g[c + "_single"]) for c in ("none", "adapters")}
            out[f"{name}_adapters_change_tokens"] = len(g["none"]) - compare_greedy(g["none"], g["adapters"])["identical"]
        lp = run.get("phases", {}).get("logprobs")
        if lp:
            out[f"{name}_floor_logprobs"] = {c: compare_logprobs(lp[c], lp[c + "_single"], pl, gl) for c in ("none", "adapters")}
            out[f"{name}_adapter_effect"] = compare_logprobs(lp["adapters"], lp["adapters_without_lora"], pl, gl)
    s, o = (runs.get(c, {}).get("phases", {}) for c in CONFIGS)
    if "greedy" in s and "greedy" in o:
        out["greedy"] = {c: compare_greedy(s["greedy"][c], o["greedy"][c]) for c in ("none", "adapters")}
    if "logprobs" in s and "logprobs" in o:
        lp = {}
        for c in ("none", "adapters"):
            if s["logprobs"][c]["seqs_sha"] == o["logprobs"][c]["seqs_sha"]:
                lp[c] = compare_logprobs(s["logprobs"][c], o["logprobs"][c], pl, gl)
            else:
                lp[c] = {"positions": 0, "note": "different token sequences (ours had no stock tokens)"}
        out["logprobs"] = lp
    return out


def _f(v, fmt="{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def _divergence(r: dict) -> str:
    at = [x for x in r["first_divergence"] if x is not None]
    return f" (diverged at generated token {', '.join(map(str, at))})" if at else ""


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def perf_rows(runs: dict) -> list[dict]:
    rows = []
    for label, path, anchor, target in [
            ("TPOT batch 1, no adapter (ms)", ("tpot", "none", "tpot_ms"), ANCHORS["tpot_none_ms"], None),
            ("TPOT batch 1, one adapter (ms)", ("tpot", "one_adapter", "tpot_ms"), ANCHORS["tpot_one_adapter_ms"],
             f"≤ {TARGET_TPOT_ONE_ADAPTER_MS}"),
            ("TPOT batch 1, no adapter, paired runs (ms)", ("tpot", "none", "tpot_paired_ms"), None, None),
            ("TPOT batch 1, one adapter, paired runs (ms)", ("tpot", "one_adapter", "tpot_paired_ms"), None, None),
            ("TPOT batch 1, no adapter, paired runs' fastest samples (ms)", ("tpot", "none", "tpot_min_ms"),
             None, None),
            ("TPOT batch 1, one adapter, paired runs' fastest samples (ms)", ("tpot", "one_adapter", "tpot_min_ms"),
             None, None),
            ("TTFT batch 1, 512-token prompt, no adapter (ms)", ("tpot", "none", "ttft_ms"), None, None),
            ("TTFT batch 1, 512-token prompt, one adapter (ms)", ("tpot", "one_adapter", "ttft_ms"), None, None),
            ("TTFT batch 1, 512-token prompt, no adapter, fastest sample (ms)", ("tpot", "none", "ttft_min_ms"),
             None, None),
            ("TTFT batch 1, 512-token prompt, one adapter, fastest sample (ms)",
             ("tpot", "one_adapter", "ttft_min_ms"), None, None),
            # run48: ours' TTFT samples scatter (39-71 ms) where stock's do not; the engine process's
            # garbage-collector passes in those runs, summed and the longest
            ("GC in the TTFT runs (1-token requests), no adapter: ms in all", ("tpot", "none", "gc_1_token_runs", "ms_total"),
             None, None),
            ("GC in the TTFT runs (1-token requests), one adapter: ms in all",
             ("tpot", "one_adapter", "gc_1_token_runs", "ms_total"), None, None),
            ("GC in the TTFT runs, longest pass (ms), one adapter", ("tpot", "one_adapter", "gc_1_token_runs", "max_ms"),
             None, None),
            ("64×(512+128), no adapter: output tok/s", ("throughput", "none", "output_tok_s"), ANCHORS["tput_none"], None),
            ("64×(512+128), 1 adapter: output tok/s", ("throughput", "one_adapter", "output_tok_s"),
             ANCHORS["tput_one_adapter"], None),
            ("64×(512+128), 8 adapters: output tok/s", ("throughput", "eight_adapters", "output_tok_s"),
             ANCHORS["tput_eight_adapters"], f"≥ {TARGET_TPUT_8_ADAPTERS:.0f}"),
            ("64×(512+128), no adapter: total tok/s", ("throughput", "none", "total_tok_s"), None, None),
            ("64×(512+128), 1 adapter: total tok/s", ("throughput", "one_adapter", "total_tok_s"), None, None),
            ("64×(512+128), 8 adapters: total tok/s", ("throughput", "eight_adapters", "total_tok_s"), None, None)]:
        s, o = (_get(runs.get(c, {}), "phases", *path) for c in CONFIGS)
        met = None
        if target and o is not None:
            met = o <= TARGET_TPOT_ONE_ADAPTER_MS if "TPOT" in label else o >= TARGET_TPUT_8_ADAPTERS
        rows.append({"metric": label, "stock": s, "ours": o, "ratio": o / s if s and o else None,
                     "target": target, "met": met, "anchor": anchor})
    return rows


def tpot_note(runs: dict) -> list[str]:
    """Where each engine's TPOT comes from (tools/e2e_vllm.py phase_tpot): vLLM's definition from
    the engine's timestamps of the 129-token requests, or the paired estimate where the engine gave
    none (then the TPOT rows and the paired rows are the same number)."""
    src = {c: _get(runs.get(c, {}), "phases", "tpot", "one_adapter", "tpot_source") for c in CONFIGS}
    if not any(src.values()):
        return []
    said = ", ".join(f"{c} {s or 'not measured'}" for c, s in src.items())
    return ["", f"TPOT rows: ({said}) — vLLM's TPOT is (last token − first token) / 128 from the engine "
            "core's timestamps of each 129-token request; the paired rows, the method of the runs before run34, "
            "are (t(129 tokens) − t(1 token)) / 128 from wall times and also carry the scatter of the "
            "512-token prefill."]


def fp32_reference_markdown(rep: dict) -> list[str]:
    """The report's section on the fp32 reference (empty when the phase was not part of the run)."""
    ref = rep.get("fp32_reference")
    if not ref:
        return []
    L = ["", "## Distance to the exact computation (fp32 reference, `tools/e2e_reference.py`)", ""]
    if ref.get("skipped"):
        return L + [f"Not computed: {ref['skipped']}."] + [f"- {n}" for n in ref.get("notes", [])]
    L += [f"The same teacher-forced sequences scored by an fp32 forward of the checkpoint: the merged "
          f"projections' weights FP8 per tensor and the activations FP8 per token as vLLM quantizes them, "
          f"LoRA as vLLM computes it, everything else (bf16 roundings, accumulation) exact; "
          f"{ref.get('device', '?')}{' (' + ref['gpu'] + ')' if ref.get('gpu') else ''}, "
          f"{_f(ref.get('wall_s'), '{:.0f}')} s; checkpoint fingerprint "
          f"{(ref.get('checkpoint') or rep['spec'].get('checkpoint') or {}).get('model', '—')}.", ""]
    c = _get(rep, "comparison", "fp32_reference") or {}
    line = verdict_line(c.get("verdict") or {})
    if line:
        L += [line, ""]
    agree = [r["top1_agreement"] for config in CONFIGS for r in (c.get(config) or {}).values() if r.get("positions")]
    if agree and max(agree) < REF_MIN_TOP1:
        L += [f"**The engines and the reference do not compute the same model** (top-1 agreement at most "
              f"{100 * max(agree):.1f} %; an FP8 model agrees with its reference on most positions): another "
              "checkpoint (see the fingerprints) or a reference that is wrong for this model; the distances "
              "below are not rounding errors.", ""]
    L += ["| vs the fp32 reference | max / mean abs Δ (nats) | generated positions: max / mean | top-1 agreement |",
          "|---|---|---|---|"]
    for config in CONFIGS:
        for variant, lab in (("none", "no adapter"), ("none_single", "no adapter, one at a time"),
                             ("adapters", f"{NUM_ADAPTERS} adapters"),
                             ("adapters_single", f"{NUM_ADAPTERS} adapters, one at a time")):
            r = _get(c, config, variant)
            if r and r.get("positions"):
                L.append(f"| {config}, {lab} | {r['max_abs']:.4f} / {r['mean_abs']:.4f} | {r['gen_max_abs']:.4f} / "
                         f"{r['gen_mean_abs']:.4f} | {100 * r['top1_agreement']:.2f} % |")
    for case, r in (c.get("fp8_effect") or {}).items():
        lab = "no adapter" if case == "none" else f"{NUM_ADAPTERS} adapters"
        L.append(f"| (scale) the reference without FP8 (bf16 weights in fp32), {lab} | {r['max_abs']:.4f} / "
                 f"{r['mean_abs']:.4f} | {r['gen_max_abs']:.4f} / {r['gen_mean_abs']:.4f} | "
                 f"{100 * r['top1_agreement']:.2f} % |")
    for case, r in (c.get("bf16_inputs_effect") or {}).items():
        lab = "no adapter" if case == "none" else f"{NUM_ADAPTERS} adapters"
        L.append(f"| (scale) the reference with each linear layer's input rounded to bf16 before FP8, {lab} | "
                 f"{r['max_abs']:.4f} / {r['mean_abs']:.4f} | {r['gen_max_abs']:.4f} / {r['gen_mean_abs']:.4f} | "
                 f"{100 * r['top1_agreement']:.2f} % |")
    for config in CONFIGS:  # the diagnostic variant: where each engine sits between the two roundings
        for case, r in (_get(c, "bf16_inputs", config) or {}).items():
            lab = "no adapter" if case == "none" else f"{NUM_ADAPTERS} adapters"
            L.append(f"| (diagnostic) {config}, {lab}, vs the reference with each linear layer's input rounded "
                     f"to bf16 before FP8 | {r['max_abs']:.4f} / {r['mean_abs']:.4f} | {r['gen_max_abs']:.4f} / "
                     f"{r['gen_mean_abs']:.4f} | {100 * r['top1_agreement']:.2f} % |")
    if c.get("bf16_inputs"):
        L += ["", "The plugin quantizes the bf16 tensor vLLM hands to the layer (as vLLM's CUDA quantization "
              "kernel does); under torch.compile stock's RMSNorm / SiLU-and-mul and per-token quantization are "
              "fused by Inductor and may quantize unrounded values. An engine closer to the diagnostic row than "
              "to the main one quantizes bf16-rounded inputs."]
    L += [f"- {n}" for n in ref.get("notes", [])]
    return L


def machine_line(runs: dict) -> str:
    """The machine the engines ran on (their probes' ``machine`` facts; runs differ by machine)."""
    facts = [(c, _get(runs, c, "probe", "machine")) for c in CONFIGS]
    facts = [(c, f) for c, f in facts if isinstance(f, dict) and "error" not in f]
    if not facts:
        return "not recorded"
    seen: dict[str, list[str]] = {}
    for c, f in facts:
        text = (f"GPU {f.get('gpu_uuid') or '?'}, driver {f.get('driver_version') or '?'}, "
                f"{f.get('cpu_count') or '?'} × {f.get('cpu_model') or '?'}")
        seen.setdefault(text, []).append(c)
    return "; ".join(f"{t} ({', '.join(cs)})" for t, cs in seen.items())


def _at(xs: list, i: int):
    """xs[i], or None past its end (a run a list has no entry for)."""
    return xs[i] if i < len(xs) else None


def host_markdown(runs: dict) -> list[str]:
    """The TTFT runs one by one (``tpot`` phase, the 1-token requests in their order): wall time,
    vLLM's TTFT, and the engine process's host time in that run (``host_1_token_runs``: the worker's
    forward steps, its sampling calls and the plugin's op, wall / CPU ms) beside its GC time. A
    slow run whose forward is long in CPU too ran more host code; long in wall only, it waited
    (the GPU, the GIL, the scheduler); a slow run with a short forward lost its time elsewhere."""
    L = []
    for c in CONFIGS:
        for case in ("none", "one_adapter"):
            tp = _get(runs.get(c, {}), "phases", "tpot", case) or {}
            host = tp.get("host_1_token_runs")
            if not host:
                continue
            if not L:
                L = ["", "## Host time of the TTFT runs (the 1-token requests in their order; ms, wall / CPU of "
                     "the engine thread)"]
            walls = tp.get("t_1_token_s") or []
            ttft = tp.get("ttft_1_token_runs_ms") or []
            gc_ms = (tp.get("gc_1_token_runs") or {}).get("ms_per_run") or []
            L += ["", f"{c}, {case}:", "",
                  "| run | wall | TTFT | forward steps | forward wall / CPU | sampling wall / CPU | op calls | "
                  "op wall / CPU | GC |", "|---|---|---|---|---|---|---|---|---|"]
            for i in range(len(host.get("step_ms") or [])):
                wall = _at(walls, i)
                L.append(f"| {i} | {_f(None if wall is None else 1e3 * wall, '{:.1f}')} | {_f(_at(ttft, i), '{:.1f}')} | "
                         f"{_f(_at(host['step_calls'], i), '{}')} | {_f(_at(host['step_ms'], i), '{:.1f}')} / "
                         f"{_f(_at(host['step_cpu_ms'], i), '{:.1f}')} | {_f(_at(host['sample_ms'], i), '{:.1f}')} / "
                         f"{_f(_at(host['sample_cpu_ms'], i), '{:.1f}')} | {_f(_at(host['op_calls'], i), '{}')} | "
                         f"{_f(_at(host['op_ms'], i), '{:.1f}')} / {_f(_at(host['op_cpu_ms'], i), '{:.1f}')} | "
                         f"{_f(_at(gc_ms, i), '{:.1f}')} |")
    return L


def profile_markdown(runs: dict, top: int = 12) -> list[str]:
    """The ``profile`` phase (tools/e2e_vllm.py): per engine and case, a generated token's kernels
    (busy time, span, count) beside its wall time, and the kernels that take the most time."""
    prof = {c: ((runs.get(c) or {}).get("phases") or {}).get("profile") for c in CONFIGS}
    if not any(prof.values()):
        return []
    L = ["", "## Where a generated token's time goes (`profile` phase: GPU worker's profiler, "
         "(n-token run − 1-token run) / (n − 1); batch 1, and `eight_adapters_bN` / `none_bN`: one decode step "
         "of the throughput batch of N requests with its 8 adapters / without adapters, per step)", "",
         "| engine, case | wall ms/token | kernels busy µs | kernels span µs | kernels per token |", "|---|---|---|---|---|"]
    for c, cases in prof.items():
        for case, r in (cases or {}).items():
            if "error" in r:
                L.append(f"| {c}, {case} | {r['error']} | | | |")
                continue
            L.append(f"| {c}, {case} | {r['wall_ms_per_token']:.3f} | {r['busy_us_per_token']:.0f} | "
                     f"{r['span_us_per_token']:.0f} | {r['kernels_per_token']:.0f} |")
    for c, cases in prof.items():
        for case, r in (cases or {}).items():
            if "error" in r or not r.get("top"):
                continue
            for key, title in (("top", "top kernels"), ("top_gaps", "kernels the GPU idles before")):
                if not r.get(key):
                    continue
                L += ["", f"{c}, {case}: {title}, per token", "", "| kernel | count | µs | idle before, µs |",
                      "|---|---|---|---|"]
                L += [f"| `{row[0][:90]}` | {row[1]:.1f} | {row[2]:.1f} | {_f(row[3] if len(row) > 3 else None, '{:.1f}')} |"
                      for row in r[key][:top]]
            first = r.get("first_run")
            if first and first.get("top"):  # the 1-token run: the prefill (the batch's, or the TTFT's)
                whole = (f"its 1-token run (the prefill and one step), whole run: wall {first['wall_ms']:.1f} ms, "
                         f"busy {first['busy_us']:.0f} µs, span {first['span_us']:.0f} µs, {first['kernels']} kernels")
                # and where the GPU waited for the host in that run
                for key, title in (("top", whole), ("top_gaps", "its 1-token run, kernels the GPU idles before")):
                    if not first.get(key):
                        continue
                    L += ["", f"{c}, {case}: {title}", "", "| kernel | count | µs | idle before, µs |", "|---|---|---|---|"]
                    L += [f"| `{row[0][:90]}` | {row[1]} | {row[2]:.1f} | {row[3]:.1f} |" for row in first[key][:top]]
    return L


def _startup_note(rep: dict) -> str:
    """'; Inductor stock 20.8 s, ours 81.2 s; ...' for the phases both engines' logs state."""
    logs = rep.get("plugin_log") or {}
    st, ou = ((logs.get(c) or {}).get("startup") or {} for c in ("stock", "ours"))
    names = {"inductor_s": "Inductor", "profiling_run_s": "profiling run", "graph_capture_s": "graph capture"}
    parts = [f"{name} stock {st[k]:.1f} s, ours {ou[k]:.1f} s" for k, name in names.items() if k in st and k in ou]
    return "; " + "; ".join(parts) if parts else ""


def _stock_floor_rows(cmp_: dict) -> list[str]:
    """Ours-vs-stock log-prob distance with adapters over stock's own (the same prompts batched vs
    one at a time): vLLM's shrink sums split-K parts with atomics, so stock's adapter outputs vary
    from run to run; a ratio near or below 1 is as close as stock is to itself (perf.md v0.84)."""
    ours = _get(cmp_, "logprobs", "adapters") or {}
    floor = _get(cmp_, "stock_floor_logprobs", "adapters") or {}
    if not (ours.get("positions") and floor.get("positions") and floor.get("mean_abs")):
        return []
    ratio = ours["mean_abs"] / floor["mean_abs"]
    return [f"| teacher-forced, {NUM_ADAPTERS} adapters: mean abs Δ ours vs stock over stock's own (batched vs one "
            f"at a time) | {ratio:.2f}× ({ours['mean_abs']:.4f} / {floor['mean_abs']:.4f} nats; ≤ 1: within stock's "
            f"own variation) | |"]


def write_markdown(rep: dict, path: Path) -> None:
    runs, cmp_, spec = rep["runs"], rep["comparison"], rep["spec"]
    L = [f"# vLLM end to end: stock vs EpiLoRA plugin — {rep['date']}", "",
         f"- command: `{rep['command']}` ({rep['seconds']:.0f} s), git {rep['git']}",
         f"- model: random Qwen3 ({spec['size']}, {spec['layers']} layers, {spec.get('init', 'dense')} init{_gain_note(spec)}), "
         f"FP8 online per-tensor, "
         f"{NUM_ADAPTERS} rank-{RANK} adapters; vLLM {_get(runs, 'stock', 'vllm') or _get(runs, 'ours', 'vllm') or '—'}, "
         f"GPU {_get(runs, 'ours', 'probe', 'gpu') or _get(runs, 'stock', 'probe', 'gpu') or '—'}",
         f"- both engines inherit: {rep.get('shared_env') or '{}'}",
         f"- machine: {machine_line(runs)}",
         *([f"- stock: env {rep['stock_env']}"] if rep.get("stock_env") else []),
         *(["- vLLM's LoRA shrink unsplit (split_k = 1, no atomics) in both engines (--deterministic-lora-shrink): "
            "a diagnostic; its timings are not stock's"] if rep.get("deterministic_lora_shrink") else []),
         f"- ours: env {rep['ours_env'] or '{}'}; engine start stock "
         f"{_f(_get(runs, 'stock', 'engine_start_s'), '{:.0f}')} s, ours {_f(_get(runs, 'ours', 'engine_start_s'), '{:.0f}')} s"
         + (" (started together)" if rep["concurrent"] else "") + _startup_note(rep)]
    rs = rep.get("rescored_from")
    if rs:
        L.append(f"- fp32 reference added later: `{rs['command']}` ({rs['date']}, git {rs['git']}) from {rs['file']}")
    smoke = spec.get("smoke")
    if smoke:
        eng = smoke.get("engine", {})
        L[1:1] = ["", f"**SMOKE RUN** (`--smoke`): {smoke['layers']} of the model's {smoke['of_layers']} layers, "
                  f"correctness checks only; skipped: {', '.join(smoke['skipped']) or 'nothing'}. Engine: "
                  + ", ".join(f"{k} {v}" for k, v in eng.items())
                  + "; CUDA graphs and torch.compile on. Not issue #5's numbers: a first contact."]
    for c in CONFIGS:
        for k, v in (runs.get(c, {}).get("errors") or {}).items():
            L.append(f"- **{c}: {k} failed**: `{(str(v).strip().splitlines() or ['?'])[-1][:300]}`")
        if rep["notes"].get(c):
            L.append(f"- **{c}**: {rep['notes'][c]}")
    pr, pl = _get(runs, "ours", "probe") or {}, rep["plugin_log"].get("ours") or {}
    L += ["", "## Plugin in the 'ours' engine", "",
          f"- entry point seen by a fresh process with the engines' environment: {rep.get('entry_point', '—')}",
          f"- layers taken over: {pl.get('taken_over', '—')} by the `vllm.epilora` log "
          f"({', '.join(pl.get('taken_over_classes', []))}); in the engine: {pr.get('epilora_layers', '—')} EpiLoRA "
          f"layers, {pr.get('epilora_active', '—')} computing fused, of {4 * spec['layers']} LoRA linear layers expected",
          f"- left on vLLM: {pl.get('stays_on_vllm', '—')} (class), {pl.get('computes_with_vllm', '—')} (kernel); "
          f"reasons: {pl.get('fallback_reasons') or 'none'}",
          f"- {pl.get('lm_head') or 'lm_head LoRA: no log line (vLLM built no lm_head LoRA wrapper, or a plugin before session 19)'}",
          f"- kernel path: {pr.get('kernel_path', '—')}"
          + (f" (epilora_cute.ops auto: {pr['ops_auto_path']})" if pr.get("ops_auto_path") else "")
          + f"; EPILORA_* in the engine: {pr.get('env', '—')}; model runner {pr.get('model_runner', '—')}"
          + (f"; Triton tables: {pr['triton_tables']['kept_for_graphs']} kept for CUDA graphs, "
             f"{pr['triton_tables']['made_inside_a_capture']} made inside a capture (expected 0)"
             if pr.get("triton_tables") else ""),
          f"- timed dispatch, keys won per path (`epilora_cute.dispatch` log): {pl.get('dispatch_wins') or '—'}",
          f"- stock engine: plugin disabled {(rep['plugin_log'].get('stock') or {}).get('plugin_disabled', '—')}, "
          f"LoRA classes {_get(runs, 'stock', 'probe', 'lora_classes') or '—'}", "",
          "## Correctness (ours vs stock, same prompts)", "",
          "| check | result | target |", "|---|---|---|"]
    g = cmp_.get("greedy", {})
    n = spec["greedy"]["n"]
    for c, tgt in (("none", f"{n}/{n}"), ("adapters", f"≥ {TARGET_GREEDY_ADAPTERS}/{n}")):
        r = g.get(c)
        lab = "no adapter" if c == "none" else f"{NUM_ADAPTERS} adapters"
        L.append(f"| greedy {spec['greedy']['gen_len']} tokens, {lab}: identical | "
                 + (f"{r['identical']}/{r['total']}" + _divergence(r) if r else "—") + f" | {tgt} |")
    for c in ("none", "adapters"):
        r = _get(cmp_, "logprobs", c) or {}
        lab = "no adapter" if c == "none" else f"{NUM_ADAPTERS} adapters"
        if r.get("positions"):
            L.append(f"| teacher-forced logprob, {lab}: max / mean abs Δ (nats), {r['positions']} positions | "
                     f"{r['max_abs']:.4f} / {r['mean_abs']:.4f} ({'within' if r['within_tolerance'] else '**outside**'}"
                     f" tolerance) | ≤ {TOL_MAX_NATS} / ≤ {TOL_MEAN_NATS} |")
            L.append(f"| teacher-forced top-1 agreement, {lab} | {100 * r['top1_agreement']:.2f} % (predicts "
                     f"{r['expected_identical']:.1f}/{n} identical greedy runs) | |")
        else:
            L.append(f"| teacher-forced logprob, {lab} | {r.get('note', '—')} | |")
    L += _stock_floor_rows(cmp_)
    L += ["", "Reference points, each engine against itself:", "", "| | stock | ours |", "|---|---|---|"]
    for key, lab in (("floor_greedy", "greedy identical, all at once vs one at a time (none / adapters)"),):
        cells = []
        for c in CONFIGS:
            r = cmp_.get(f"{c}_{key}")
            cells.append(f"{r['none']['identical']}/{n} / {r['adapters']['identical']}/{n}" if r else "—")
        L.append(f"| {lab} | {cells[0]} | {cells[1]} |")
    cells = []
    for c in CONFIGS:
        r = cmp_.get(f"{c}_floor_logprobs")
        cells.append(" / ".join(f"{r[k]['max_abs']:.4f}, {r[k]['mean_abs']:.4f}" for k in ("none", "adapters")) if r else "—")
    L.append(f"| logprob max, mean abs Δ, all at once vs one at a time (none / adapters) | {cells[0]} | {cells[1]} |")
    cells = [str(cmp_.get(f"{c}_adapters_change_tokens", "—")) + f"/{n}" for c in CONFIGS]
    L.append(f"| greedy runs an adapter changes (vs no adapter) | {cells[0]} | {cells[1]} |")
    cells = []
    for c in CONFIGS:
        r = cmp_.get(f"{c}_adapter_effect")
        cells.append(f"{r['mean_abs']:.3f} (max {r['max_abs']:.2f})" if r and r.get("positions") else "—")
    L.append(f"| adapter effect: mean abs Δlogprob with vs without the adapter, nats | {cells[0]} | {cells[1]} |")
    L += fp32_reference_markdown(rep)
    if smoke and not {"tpot", "throughput"} & set(spec.get("phases", ())):
        L += ["", "## Performance", "", "Not measured: smoke run."]
    else:
        L += ["", "## Performance (median of %d; tok/s = tokens / wall time of `LLM.generate`)" % spec["reps"], "",
              "| metric | stock | ours | ours/stock | target | stock anchor (notes) |", "|---|---|---|---|---|---|"]
        for r in rep["performance"]:
            tgt = (r["target"] or "") + ("" if r["met"] is None else (" ✔" if r["met"] else " ✘"))
            fmt = "{:.2f}" if "TPOT" in r["metric"] else "{:.1f}" if "TTFT" in r["metric"] else "{:.0f}"
            L.append(f"| {r['metric']} | {_f(r['stock'], fmt)} | {_f(r['ours'], fmt)} | {_f(r['ratio'], '{:.3f}')} | "
                     f"{tgt} | {_f(r['anchor'], fmt)} |")
        L += tpot_note(runs)
    L += host_markdown(runs)
    L += profile_markdown(runs)
    tails = [(c, runs[c]["log_tail"]) for c in CONFIGS if (runs.get(c) or {}).get("log_tail")]
    if tails:
        L += ["", "## Log tails of the engines that did not finish", ""]
        for c, tail in tails:
            L += [f"{c}.log, last {LOG_TAIL_LINES} lines:", "", "```",
                  *[line[:300] for line in tail.splitlines()[-LOG_TAIL_LINES:]], "```", ""]
    path.write_text("\n".join(L) + "\n")
