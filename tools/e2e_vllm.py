"""End to end in vLLM: stock vLLM against vLLM with the EpiLoRA plugin, in one command (issue #5).

    python tools/e2e_vllm.py [--out DIR] [--only stock|ours] [--layers N] [--skip-throughput]
                             [--ours-env KEY=VAL ...] [--stock-env KEY=VAL ...] [--stock-from FILE]
                             [--deterministic-lora-shrink] [--sequential] [--smoke] [--reference auto|on|off]
    python tools/e2e_vllm.py --rescore E2E_JSON [--out DIR]     (the fp32 reference only)

On the GPU machine (vLLM importable, the repository as working directory, not pip-installed):
writes a random Qwen3-8B-shaped bf16 checkpoint and 8 rank-64 PEFT adapters under --work-dir
(tools/e2e_model.py; reused when already there), then runs each configuration in its own Python
process with one vLLM engine (``LLM(quantization="fp8", enable_lora=True, max_loras=8,
max_lora_rank=64, skip_tokenizer_init=True)``) doing every measurement:

* stock: the plugin's entry point visible but ``EPILORA_DISABLE=1``;
* ours: the plugin on, plus the ``--ours-env`` variables (e.g. ``EPILORA_FORCE_TRITON=1``).

``--stock-env`` sets variables in the stock engine only. ``--deterministic-lora-shrink`` makes vLLM's
own LoRA shrink deterministic in both engines (a diagnostic for the greedy comparison): below 128
tokens vLLM 0.26.0 splits its K 64 ways and sums the parts with relaxed atomics, so stock's h, and
through its bf16 rounding stock's y, vary with the order the atomics land (docs/perf.md v0.84
measured); the flag points VLLM_TUNED_CONFIG_FOLDER at a generated shrink configuration of
split_k = 1 (vLLM's default tiles otherwise), which also slows stock's LoRA: use it with the
greedy / logprobs phases, not for timings.

The plugin is found through a generated dist-info (entry point ``vllm.general_plugins:
epilora_cute``) put on PYTHONPATH with the repository root, so vLLM's engine-core process loads
it too. Each configuration gets its own VLLM_CACHE_ROOT: vLLM's AOT compile cache is keyed by the
engine config, not by the LoRA classes, so a shared cache would let one configuration run the
other's compiled model.

Both engines start at the same time (GPU memory split: gpu_memory_utilization 0.4 and a fixed
16 GiB KV cache each, so neither one's memory profiling sees the other) and measure one after the
other: nothing else runs on the GPU while one measures (``--sequential`` starts ours only after
stock has finished). Measurements, each configuration in its own engine:

1. greedy: 16 prompts of 64 random tokens, 32 tokens each, without adapter and with the 8
   adapters (prompt i uses adapter i % 8); all at once and one at a time (the same engine's
   batch-composition floor);
2. teacher-forced log-probabilities of prompt + stock's greedy tokens (``prompt_logprobs=1``):
   per position the logprob of the token and the top-1 token; also the adapter sequences
   scored without adapter (the size of an adapter's effect, what a dropped adapter would cost);
3. batch-1 time per output token, 512-token prompt, without adapter and with one, median of
   --reps: vLLM's TPOT, (last token - first token) / 128 from the engine core's timestamps of each
   129-token request (``request_timing``), beside the earlier paired estimate (t(129 tokens) -
   t(1 token)) / 128 from wall times, which also carries the prefill's scatter; and the time to
   the first token;
4. throughput: 64 requests of 512 random prompt tokens + 128 output tokens, without adapter,
   with 1 and with 8 adapters (round-robin), median wall time of --reps after a warm-up run;
   output tokens/s (the convention of the notes' anchors) and total tokens/s (vLLM's
   benchmark_throughput prints both).

Output in --out (default $OUT, else build/e2e): ``e2e.json`` (everything, raw results included),
``e2e.md`` (the tables; tools/e2e_report.py: targets, anchors, tolerances and their reasoning),
``result_<config>.json`` and ``<config>.log`` (each engine's log; the plugin's ``vllm.epilora``
lines, DEBUG included, are counted into the report, and a probe mixed into vLLM's worker
(``tools.e2e_model.WorkerProbe``) reports which class each LoRA layer got and the kernel path).
Workers save their results after every phase; an engine not up after --start-timeout is stopped
(a hang in one configuration does not cost the other's numbers), and everything stops at
--time-budget with the report written from what was measured. A dead engine is not waited for:
a worker exits when its engine fails to start or the probe RPC gets no answer, and the parent
stops a worker FATAL_GRACE_S after its log shows a fatal engine error (FATAL_LOG_PATTERNS: vLLM
0.26 lets its engine core's I/O threads die and every later call hang); the report gives the
root cause and the log's tail. Everything a worker returns over ``collective_rpc`` is plain JSON
(``e2e_model.plain``): vLLM's msgspec encoder refuses anything else, str subclasses included.

After the engines (``--reference auto``, the default, when the logprobs phase ran): the fp32
reference (tools/e2e_reference.py) scores the same teacher-forced sequences in its own process, on
the GPU the engines left (on the CPU only for tiny models), within what is left of the time
budget: the checkpoint's merged projections FP8 per tensor and the activations FP8 per token as
vLLM quantizes them, LoRA as vLLM computes it, everything else exact; again with bf16 weights
and no FP8 (the scale of FP8's own effect) and with each linear layer's input rounded to bf16
before FP8 (a diagnostic: the plugin quantizes the bf16 tensor it is handed). The report gives
each engine's distance to it (``comparison.fp32_reference``) and the verdict "ours is within X×
of stock's distance to the exact computation". ``--rescore E2E_JSON`` does only this, for an
earlier run's results (rebuilding its checkpoint under --work-dir; no vLLM needed): on the H200,
~1 min for a 4-layer smoke run's.

--smoke (SMOKE): a cheap first contact, CUDA graphs and torch.compile still on: 4 layers, the
greedy and teacher-forced logprob checks only (no TPOT, no throughput), max_num_seqs 16 (capture
sizes up to 32 tokens), max_model_len 256, a 4 GiB KV cache; ~3 min on the H200, limits 210 s
per engine start and 270 s in all. The report says it is a smoke run and what it skipped.

Time on the H200 (first run, vLLM 0.26.0: stock engine start 197 s cold with 90 s of
torch.compile): checkpoint ~1 min (16.4 GB), both engines starting together ~3.5 min, then
~1 min of measurements per configuration: ~7-8 min in all (budget 525 s); --sequential does not
fit one 10-minute device call.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import e2e_model, e2e_report  # noqa: E402
from tools.e2e_model import NUM_ADAPTERS, RANK  # noqa: E402
from tools.e2e_report import CONFIGS, compare, perf_rows, plugin_log_summary, write_markdown  # noqa: E402

PHASES = ("greedy", "logprobs", "tpot", "throughput")
OPTIONAL_PHASES = ("profile",)  # only when asked for (--phases)

# Test hook: "module:callable" building a stand-in for vllm.LLM (tests/e2e_fake.py).
FAKE_LLM_ENV = "EPILORA_E2E_LLM_FACTORY"
# Seconds the worker waits for the probe RPC (a healthy engine answers in well under one). An
# RPC whose reply cannot be sent never returns: the engine's output thread is dead.
RPC_TIMEOUT_ENV = "EPILORA_E2E_RPC_TIMEOUT"
RPC_TIMEOUT_S = 120.0
# Exit status of a worker whose engine is unusable (it wrote "fatal" into its result).
EXIT_ENGINE_UNUSABLE = 4

# --smoke: a cheap first contact with a GPU. The plugin still runs under CUDA graphs and
# torch.compile; fewer layers, fewer capture sizes (vLLM captures up to 2 x max_num_seqs tokens),
# correctness only.
SMOKE = {"layers": 4, "phases": ("greedy", "logprobs"), "reps": 1, "time_budget": 270.0, "start_timeout": 210.0,
         "engine": {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
                    "kv_cache_memory_bytes": 4 << 30}}
FULL_TIME_BUDGET_S = 525.0  # tools/gpu_session.sh kills the call at 570 s: stopping + report fit in
FULL_START_TIMEOUT_S = 420.0


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def prompts(seed: int, tag: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic random token ids (the same in both configurations)."""
    rng = random.Random(f"{seed}:{tag}")
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


# ============================================================================ worker (one engine)

class Ctx:
    """What the measurement phases share inside a worker."""

    def __init__(self, llm, spec: dict, reference: dict | None, result: dict):
        self.llm, self.spec, self.reference, self.result = llm, spec, reference, result
        if os.environ.get(FAKE_LLM_ENV):
            self.SP = lambda **kw: SimpleNamespace(**kw)
            self.LoRA = lambda name, iid, path: SimpleNamespace(lora_name=name, lora_int_id=iid, lora_path=path)
        else:
            from vllm import SamplingParams
            from vllm.lora.request import LoRARequest

            self.SP, self.LoRA = SamplingParams, LoRARequest

    def prompts(self, tag: str, n: int, length: int) -> list[list[int]]:
        return prompts(self.spec["seed"], tag, n, length, self.spec["vocab_size"])

    def lora(self, i: int):
        return self.LoRA(f"adapter{i}", i + 1, self.spec["adapters"][i])

    def sampling(self, max_tokens: int, **kw):
        kw = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kw)
        try:
            return self.SP(**kw)
        except TypeError:  # a vLLM without skip_reading_prefix_cache
            kw.pop("skip_reading_prefix_cache", None)
            return self.SP(**kw)

    def generate(self, seqs, sp, loras=None):
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sp, lora_request=loras, use_tqdm=False)
        return outs

    def greedy_outputs(self, seqs, max_tokens: int, loras=None) -> list:
        """vLLM's outputs of a greedy run (prefix cache not read), each checked to hold max_tokens."""
        sp = self.sampling(max_tokens, skip_reading_prefix_cache=True)
        outs = self.generate(seqs, sp, loras)
        lens = {len(o.outputs[0].token_ids) for o in outs}
        if lens - {max_tokens}:
            raise RuntimeError(f"asked {max_tokens} tokens, got {sorted(lens)}")
        return outs

    def greedy(self, seqs, max_tokens: int, loras=None) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.greedy_outputs(seqs, max_tokens, loras)]

    def score(self, seqs, loras=None) -> dict:
        """Teacher-forced: per sequence, for positions 1..L-1, the logprob of the given token and
        the top-1 token id."""
        sp = self.sampling(1, prompt_logprobs=1)
        lp, top1 = [], []
        for seq, o in zip(seqs, self.generate(seqs, sp, loras)):
            plp = o.prompt_logprobs
            lp.append([plp[i][seq[i]].logprob for i in range(1, len(seq))])
            top1.append([max(plp[i].items(), key=lambda kv: kv[1].logprob)[0] for i in range(1, len(seq))])
        return {"lp": lp, "top1": top1}


def phase_greedy(c: Ctx) -> dict:
    g = c.spec["greedy"]
    P = c.prompts("greedy", g["n"], g["prompt_len"])
    loras = [c.lora(i % NUM_ADAPTERS) for i in range(len(P))]
    out = {"prompts_sha": _sha(P), "none": c.greedy(P, g["gen_len"]), "adapters": c.greedy(P, g["gen_len"], loras)}
    out["none_single"] = [c.greedy([p], g["gen_len"])[0] for p in P]
    out["adapters_single"] = [c.greedy([p], g["gen_len"], [lo])[0] for p, lo in zip(P, loras)]
    return out


def phase_logprobs(c: Ctx) -> dict:
    g = c.spec["greedy"]
    P = c.prompts("greedy", g["n"], g["prompt_len"])
    ref, source = c.reference, "stock"
    if ref is None or ref.get("prompts_sha") != _sha(P):
        ref, source = c.result["phases"].get("greedy"), "self"
    if ref is None:
        raise RuntimeError("no greedy tokens to teacher-force (the greedy phase did not run)")
    loras = [c.lora(i % NUM_ADAPTERS) for i in range(len(P))]
    out = {"tokens_from": source}
    for case, lo in (("none", None), ("adapters", loras)):
        seqs = [p + t for p, t in zip(P, ref[case])]
        out[case] = c.score(seqs, lo)
        out[case]["seqs_sha"] = _sha(seqs)
        single = [c.score([s], None if lo is None else [lo[i]]) for i, s in enumerate(seqs)]
        out[case + "_single"] = {k: [s[k][0] for s in single] for k in ("lp", "top1")}
    out["adapters_without_lora"] = c.score([p + t for p, t in zip(P, ref["adapters"])])
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def request_timing(out) -> dict | None:
    """vLLM's own timestamps of one finished request (``RequestOutput.metrics``, filled when the
    engine logs stats: ``engine_kwargs`` sets ``disable_log_stats=False``): the decode time per
    output token after the first, from the engine core's timestamps of its first and last token
    (vLLM's TPOT), the engine core's prefill time (scheduled -> first token) and the time to the
    first token seen by the front end. None when the engine filled none of them."""
    m = getattr(out, "metrics", None)
    first, last = getattr(m, "first_token_ts", 0.0) or 0.0, getattr(m, "last_token_ts", 0.0) or 0.0
    n = int(getattr(m, "num_generation_tokens", 0) or 0)
    if m is None or not first:
        return None
    scheduled = getattr(m, "scheduled_ts", 0.0) or 0.0
    return {"decode_ms_per_token": 1e3 * (last - first) / (n - 1) if n > 1 and last >= first else None,
            "prefill_ms": 1e3 * (first - scheduled) if scheduled else None,
            "ttft_ms": 1e3 * (getattr(m, "first_token_latency", 0.0) or 0.0) or None}


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def phase_tpot(c: Ctx) -> dict:
    t = c.spec["tpot"]
    p = c.prompts("tpot", 1, t["prompt_len"])
    n = t["gen_len"] + 1
    out = {}
    for case, lo in (("none", None), ("one_adapter", [c.lora(0)])):
        c.greedy(p, 1, lo), c.greedy(p, n, lo)  # warm-up (adapter load, kernel JIT)
        t1, tn, timings, gc_runs, host_runs = [], [], [], [], []
        gc_read(c), host_read(c)  # (the collector's passes and the host's time from here on, per run)

        def run(max_tokens: int) -> float:
            start = time.perf_counter()
            outs = c.greedy_outputs(p, max_tokens, lo)
            wall = time.perf_counter() - start
            timings.append((max_tokens, request_timing(outs[0])))
            gc_runs.append((max_tokens, gc_read(c)))
            host_runs.append((max_tokens, host_read(c)))
            return wall

        # The 1-token time (prefill + one step) scatters far more than the n-token one (run11:
        # 0.03-0.09 s, while 129 tokens took 0.515 s every time), and its median is subtracted:
        # three 1-token samples per n-token one, so its median stands on 3x the samples.
        for _ in range(c.spec["reps"]):
            t1 += [run(1) for _ in range(3)]
            tn.append(run(n))
        paired = 1e3 * (statistics.median(tn) - statistics.median(t1)) / (n - 1)
        # vLLM's definition from the engine's own timestamps: the n-token runs' decode steps only.
        # The paired estimate above also carries the prefill's scatter (run34: ours' 512-token
        # prefill took 57-137 ms from one engine start to the next, i.e. +-0.4 ms of TPOT).
        decode = [tm["decode_ms_per_token"] for k, tm in timings if k == n and tm]
        decode = [d for d in decode if d is not None]
        res = {"t_1_token_s": t1, f"t_{n}_tokens_s": tn, "tpot_paired_ms": paired,
               # the least-disturbed paired estimate (interference only ever adds time)
               "tpot_min_ms": 1e3 * (min(tn) - min(t1)) / (n - 1),
               "tpot_engine_ms": decode, "ttft_ms": _median(tm["ttft_ms"] for _, tm in timings if tm),
               # run47: a host-bound prefill's TTFT samples are bimodal within one run (39-41 and
               # 59-67 ms), so the median follows the mode a run lands in; the fastest sample is
               # the least-disturbed one, as tpot_min_ms is for the decode.
               "ttft_min_ms": min((tm["ttft_ms"] for _, tm in timings if tm and tm["ttft_ms"]), default=None),
               "prefill_ms": _median(tm["prefill_ms"] for _, tm in timings if tm)}
        res["gc_1_token_runs"] = gc_summary([g for k, g in gc_runs if k == 1])
        # per 1-token run, beside its wall time: the TTFT vLLM timed and where the host spent it
        res["ttft_1_token_runs_ms"] = [tm["ttft_ms"] if tm else None for k, tm in timings if k == 1]
        res["host_1_token_runs"] = host_summary([h for k, h in host_runs if k == 1])
        if len(decode) == len(tn):
            res.update(tpot_ms=statistics.median(decode), tpot_source="engine timestamps")
        else:
            res.update(tpot_ms=paired, tpot_source="paired runs")
        out[case] = res
    return out


def _probe_read(c: Ctx, method: str) -> dict | None:
    """One worker probe's reading (``method``); None when the probe does not answer (the
    measurement goes on without it)."""
    try:
        r = rpc(c.llm, method, _rpc_timeout())
    except TimeoutError:  # the engine no longer answers: the phase fails as any RPC's would
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a probe without the method: no numbers
        print(f"[e2e] {method}: {type(e).__name__}: {e}", flush=True)
        return None
    return r[0] if isinstance(r, list) else r


def gc_read(c: Ctx) -> dict | None:
    """The engine process's garbage-collector passes since the previous read (``e2e_gc_read``)."""
    return _probe_read(c, "e2e_gc_read")


def host_read(c: Ctx) -> dict | None:
    """The engine process's host time since the previous read (``e2e_host_read``): the worker's
    steps, its sampling calls and the plugin's op, wall and CPU."""
    return _probe_read(c, "e2e_host_read")


def host_summary(reads: list) -> dict | None:
    """Per run (``host_read`` each), part and field (``e2e_model.HostProbe``'s: calls, wall ms, CPU
    ms, the longest call); None entries (a run the probe did not answer for) stay None, so the
    lists line up with the runs' wall times."""
    if not any(reads):
        return None
    probe = e2e_model.HostProbe
    return {f"{part}_{f}": [(r.get(part) or {}).get(f) if r else None for r in reads]
            for part in probe.PARTS for f in probe.FIELDS}


def gc_summary(reads: list) -> dict | None:
    """The GC passes of a list of runs (``gc_read`` each): per run the milliseconds spent
    collecting (beside the runs' TTFT samples: a run with a long pass is a slow one), the passes
    per generation in all, the longest pass, and the heap objects vLLM froze out of the collector."""
    reads = [r for r in reads if r]
    if not reads:
        return None
    per_run = [round(sum(r["ms"]), 3) for r in reads]
    return {"ms_per_run": per_run, "ms_total": round(sum(per_run), 3),
            "passes": [sum(r["passes"][g] for r in reads) for g in range(3)],
            "max_ms": max(r["max_ms"] for r in reads), "frozen": reads[-1].get("frozen")}


def phase_throughput(c: Ctx) -> dict:
    t = c.spec["throughput"]
    sp = c.sampling(t["gen_len"])
    out = {}
    for case, k in (("none", 0), ("one_adapter", 1), ("eight_adapters", NUM_ADAPTERS)):
        loras = [c.lora(i % k) for i in range(t["requests"])] if k else None

        def run(tag):
            outs = c.generate(c.prompts(f"tput-{case}-{tag}", t["requests"], t["prompt_len"]), sp, loras)
            if sum(len(o.outputs[0].token_ids) for o in outs) != t["requests"] * t["gen_len"]:
                raise RuntimeError("throughput run generated a different number of tokens than asked")

        run("warm")
        walls = [_timed(lambda: run(r)) for r in range(c.spec["reps"])]
        wall = statistics.median(walls)
        out[case] = {"walls_s": walls, "wall_s": wall, "output_tok_s": t["requests"] * t["gen_len"] / wall,
                     "total_tok_s": t["requests"] * (t["prompt_len"] + t["gen_len"]) / wall}
    return out


def _rpc_timeout() -> float:
    return float(os.environ.get(RPC_TIMEOUT_ENV) or RPC_TIMEOUT_S)


def _profile_per_token(one: tuple, many: tuple, n: int) -> dict:
    """(wall s, kernel_summary) of a 1-token and an n-token run -> per generated token: wall ms,
    busy / span µs, kernels, and per kernel name (count, µs, idle µs before it), the top by time
    and the top by idle time."""
    (w1, s1), (wn, sn) = one, many

    def per(a, b):
        return (b - a) / (n - 1)

    def field(name, f):
        return per(s1["kernels"].get(name, {}).get(f, 0.0), sn["kernels"].get(name, {}).get(f, 0.0))

    rows = [[k, field(k, "count"), field(k, "total_us"), field(k, "gap_before_us")]
            for k in set(s1["kernels"]) | set(sn["kernels"])]
    return {"wall_ms_per_token": 1e3 * per(w1, wn), "busy_us_per_token": per(s1["busy_us"], sn["busy_us"]),
            "span_us_per_token": per(s1["span_us"], sn["span_us"]),
            "kernels_per_token": per(s1["n_kernels"], sn["n_kernels"]),
            "top": sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])[:40], "top_gaps": _top_gaps(rows)}


def _top_gaps(rows: list) -> list:
    """[kernel, count, µs, idle µs before it] rows the GPU idled before, the longest idle first."""
    return sorted((r for r in rows if r[3] > 0), key=lambda r: -r[3])[:20]


# The profile phase's batched case: decode steps of the throughput workload (its batch, 8 adapters),
# fewer steps than it generates (the trace of each step holds every kernel of the batch).
PROFILE_BATCH_STEPS = 32


def profile_cases(c: Ctx) -> list[tuple[str, list, list | None, int]]:
    """(case, prompts, adapters, n) of the profile phase: the TPOT runs at batch 1 without and with
    one adapter, and decode steps at the throughput phase's batch with its 8 adapters and without
    adapters (what the 8-adapter step is to be weighed against: issue 5's throughput target is
    set against stock without LoRA)."""
    t, b = c.spec["tpot"], c.spec["throughput"]
    p1 = c.prompts("tpot", 1, t["prompt_len"])
    pb = c.prompts("profile-batch", b["requests"], b["prompt_len"])
    return [("none", p1, None, t["gen_len"] + 1), ("one_adapter", p1, [c.lora(0)], t["gen_len"] + 1),
            (f"eight_adapters_b{b['requests']}", pb, [c.lora(i % NUM_ADAPTERS) for i in range(len(pb))],
             PROFILE_BATCH_STEPS + 1),
            (f"none_b{b['requests']}", pb, None, PROFILE_BATCH_STEPS + 1)]


def phase_profile(c: Ctx) -> dict:
    """The TPOT runs (and decode steps of the throughput batch) under the GPU worker's profiler: per
    generated token (per decode step in the batched case), the kernels' busy time, the span they
    cover, their count and each kernel name's time, as (n-token run - 1-token run) / (n - 1) like
    the TPOT. Tells device time from the gaps between kernels (host, launch)."""
    out = {}
    for case, p, lo, n in profile_cases(c):
        c.greedy(p, n, lo)  # warm-up
        runs = []
        for k in (1, n):
            rpc(c.llm, "e2e_profile_start", _rpc_timeout())
            wall = _timed(lambda: c.greedy(p, k, lo))
            s = rpc(c.llm, "e2e_profile_stop", _rpc_timeout())
            runs.append((wall, s[0] if isinstance(s, list) else s))
        errors = [s["error"] for _, s in runs if "error" in s]
        out[case] = {"error": errors[0]} if errors else _profile_per_token(runs[0], runs[1], n)
        if not errors:
            # The 1-token run is the prefill (+ one step): the batched case's is where a throughput
            # run's prefill chunks spend their time; the batch-1 cases' is the TTFT's 512-token
            # prefill, whose GPU idle time (span - busy, the gaps before each kernel) is the host's
            # (run48: ours' TTFT 1.35x stock's, scattering 39-71 ms where stock's stays at 40-47).
            out[case]["first_run"] = _run_kernels(*runs[0])
    return out


def _run_kernels(wall: float, summary: dict) -> dict:
    """One profiled run as it is: wall ms, busy / span µs, kernels, the top kernel names by time."""
    rows = [[k, v["count"], v["total_us"], v["gap_before_us"]] for k, v in summary["kernels"].items()]
    return {"wall_ms": 1e3 * wall, "busy_us": summary["busy_us"], "span_us": summary["span_us"],
            "kernels": summary["n_kernels"], "top": sorted(rows, key=lambda r: -r[2])[:40], "top_gaps": _top_gaps(rows)}


PHASE_FNS = {"greedy": phase_greedy, "logprobs": phase_logprobs, "tpot": phase_tpot, "throughput": phase_throughput,
             "profile": phase_profile}


def _make_llm(engine: dict):
    factory = os.environ.get(FAKE_LLM_ENV)
    if factory:
        mod, fn = factory.split(":")
        return getattr(importlib.import_module(mod), fn)(**engine), "fake"
    import vllm

    return vllm.LLM(**engine), vllm.__version__


def load_result(path: Path, config: str = "stock") -> dict:
    """A worker result, from result_<config>.json or from a previous e2e.json."""
    data = json.loads(Path(path).read_text())
    return data["runs"][config] if "runs" in data else data


def rpc(llm, method: str, timeout: float):
    """``llm.collective_rpc(method)``, raising TimeoutError when it does not return in time.

    vLLM's own ``timeout`` bounds the call inside the engine, not the wait for its reply: when
    the reply cannot be sent (the engine's output thread died encoding it) the caller would
    wait forever. The call runs on a daemon thread; after a timeout the engine is unusable."""
    box: dict = {}

    def call():
        try:
            box["value"] = llm.collective_rpc(method)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=call, name=f"rpc-{method}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"collective_rpc({method!r}) did not return within {timeout:.0f} s: the engine "
                           "does not answer (its output thread died? see the log)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def worker_main(config: str, spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    ctl = Path(spec["control_dir"])
    res_path = Path(spec["out"]) / f"result_{config}.json"
    res = {"config": config, "phases": {}, "errors": {}, "seconds": {}, "done": False}
    parent = os.getppid()
    t0 = time.perf_counter()
    try:
        llm, res["vllm"] = _make_llm(spec["engine"])
    except BaseException:
        res["errors"]["engine"] = traceback.format_exc()[-3000:]
        _write_json(res_path, res)
        raise
    res["engine_start_s"] = time.perf_counter() - t0
    log(f"{config}: engine up in {res['engine_start_s']:.0f} s")
    try:
        probe = rpc(llm, "e2e_lora_layers", _rpc_timeout())[0]
        bad = e2e_model.not_plain(probe, "probe")
        if bad:  # vLLM would not have delivered it; a stand-in engine might
            raise TypeError(f"the probe returned types vLLM cannot send: {bad}")
        res["probe"] = probe
    except TimeoutError as e:
        res["errors"]["probe"] = res["fatal"] = str(e)
        _write_json(res_path, res)
        log(f"{config}: {e}")
        return EXIT_ENGINE_UNUSABLE
    except Exception as e:
        res["errors"]["probe"] = f"{type(e).__name__}: {e}"
    _write_json(res_path, res)
    (ctl / f"ready_{config}").write_text("1")
    go = ctl / f"go_{config}"
    while not go.exists():  # the parent says when the GPU is ours alone
        if os.getppid() != parent:
            return 3
        time.sleep(0.2)
    ref_file = json.loads(go.read_text()).get("reference")
    reference = None
    if ref_file:
        try:
            reference = load_result(Path(ref_file))["phases"].get("greedy")
        except Exception as e:
            res["errors"]["reference"] = f"{ref_file}: {type(e).__name__}: {e}"
    ctx = Ctx(llm, spec, reference, res)
    for phase in spec["phases"]:
        t = time.perf_counter()
        try:
            res["phases"][phase] = PHASE_FNS[phase](ctx)
        except Exception:
            res["errors"][phase] = traceback.format_exc()[-3000:]
        res["seconds"][phase] = time.perf_counter() - t
        log(f"{config}: {phase} {'failed' if phase in res['errors'] else 'done'} in {res['seconds'][phase]:.1f} s")
        _write_json(res_path, res)
    res["done"] = True
    _write_json(res_path, res)
    return 0


# ============================================================================ parent (orchestration)

def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, val = p.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"expected KEY=VAL, got {p!r}")
        out[key] = val
    return out


def engine_env(config: str, base: dict, shim: Path, cache_root: Path, logging_cfg: Path,
               ours_env: dict[str, str], stock_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one configuration's worker (and, inherited, of vLLM's processes)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)] + [p for p in [base.get("PYTHONPATH")] if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_cfg)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(MULTICAST_OFF_ENV)
    if config == "stock":
        env.update(stock_env or {})
        env["EPILORA_DISABLE"] = "1"  # after --stock-env: stock stays stock
    else:
        env.pop("EPILORA_DISABLE", None)
        env.update(ours_env)
    return env


# vLLM 0.26.0's default shrink configuration below 128 tokens (vllm/lora/ops/triton_ops/utils.py,
# get_lora_op_configs) with split_k = 1: one program sums all of K, no atomics.
UNSPLIT_SHRINK = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_ctas": 1,
                  "group_size_m": 8, "num_stages": 2, "max_nreg": None}
# GPU names the configuration file is also written for (vLLM names the file after
# torch.cuda.get_device_name() with blanks and dashes made underscores).
KNOWN_GPUS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100")


def write_unsplit_shrink_configs(folder: Path, gpu_names=()) -> list[Path]:
    """A VLLM_TUNED_CONFIG_FOLDER whose shrink configuration is UNSPLIT_SHRINK for every call.
    vLLM looks a configuration up as data[max_loras][num_slices][m][k][n], the nearest key at every
    level but num_slices (exact), so one entry per slice count serves every shape."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"1": {str(s): {"1": {"4096": {"64": UNSPLIT_SHRINK}}} for s in range(1, 5)}}
    out = []
    for name in dict.fromkeys(list(gpu_names) + list(KNOWN_GPUS)):
        path = folder / f"{name.replace(' ', '_').replace('-', '_')}_SHRINK.json"
        _write_json(path, data)
        out.append(path)
    return out


def gpu_names() -> list[str]:
    """The GPU names nvidia-smi reports (empty without it): no CUDA context in this process."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []


def entry_point_check(env: dict) -> str:
    """What a fresh Python process with ``env`` finds under vllm.general_plugins: epilora_cute
    (vLLM's engine core is such a process)."""
    code = ("import importlib.metadata as md, importlib.util as u; "
            "e = [x for x in md.entry_points(group='vllm.general_plugins') if x.name == 'epilora_cute']; "
            "print(f'{e[0].value} from {e[0].dist.name} {e[0].dist.version}; module at '"
            "      f'{u.find_spec(e[0].module).origin}' if e else 'NOT FOUND')")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or (r.stderr.strip().splitlines() or ["no output"])[-1]


def engine_kwargs(model: Path, seed: int, overrides: dict | None = None) -> dict:
    """``vllm.LLM`` keywords, the same for both configurations. max_num_seqs 64 (the largest
    batch measured) keeps CUDA-graph capture to sizes <= 128; the KV cache is fixed at 16 GiB
    (the throughput batch needs ~6) and the memory check at 0.4 of the GPU, so two engines fit."""
    kw = dict(model=str(model), quantization="fp8", enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
              skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, seed=seed,
              gpu_memory_utilization=0.4, kv_cache_memory_bytes=16 << 30,
              worker_extension_cls="tools.e2e_model.WorkerProbe",
              # vLLM's per-request timestamps (RequestOutput.metrics) for the TPOT phase; the
              # offline LLM turns stats off unless asked, vLLM's server keeps them on.
              disable_log_stats=False)
    kw.update(overrides or {})  # --engine-arg / --smoke replace the defaults
    return multi_gpu_safe(kw)


# What must stay off where NVLink multicast is off (the shared H200 machines: NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1; a program using multicast there can
# take the host's GPUs out of service): run9's TP = 2 start had vLLM auto-select FlashInfer's
# all-reduce + RMSNorm fusion ("mnnvl" workspace) and its custom all-reduce, and both engines died
# with an illegal address. Set for every engine the tool starts, whatever --engine-arg says.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                     "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}


def multi_gpu_safe(kw: dict) -> dict:
    """With tensor_parallel_size > 1: vLLM's custom all-reduce off and the all-reduce + RMSNorm
    fusion pass off (it is FlashInfer's multi-GPU workspace), so only NCCL (without NVLS) all-reduces."""
    if int(kw.get("tensor_parallel_size", 1) or 1) <= 1:
        return kw
    kw = dict(kw, disable_custom_all_reduce=True)
    cc = dict(kw.get("compilation_config") or {})
    cc["pass_config"] = dict(cc.get("pass_config") or {}, fuse_allreduce_rms=False)
    kw["compilation_config"] = cc
    return kw


def logging_config() -> dict:
    """vLLM's logging at INFO, the plugin's logger at DEBUG (the layers it takes over are DEBUG
    lines), the dispatch's decisions at INFO, logger names in every line."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"e2e": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s",
                                   "datefmt": "%H:%M:%S"}},
            "handlers": {"e2e": {"class": "logging.StreamHandler", "formatter": "e2e", "level": "DEBUG",
                                 "stream": "ext://sys.stdout"}},
            "loggers": {"vllm": {"handlers": ["e2e"], "level": "INFO", "propagate": False},
                        "vllm.epilora": {"level": "DEBUG"},
                        # the timed dispatch's one line per decision (which path each bucket got)
                        "epilora_cute.dispatch": {"handlers": ["e2e"], "level": "INFO", "propagate": False}}}


# Log lines after which an engine is dead or hangs for good (vLLM 0.26: an exception in the
# engine core's I/O threads kills them silently and every later call waits forever). The worker
# gets FATAL_GRACE_S to exit on its own (so its traceback lands in the log), then it is stopped.
FATAL_LOG_PATTERNS = (
    re.compile(r"Exception in thread .*\(process_\w+\)"),
    re.compile(r"EngineCore encountered a fatal error"),
    re.compile(r"EngineCore failed to start"),
    re.compile(r"\bEngineDeadError\b"),
    re.compile(r"is not serializable"),
)
FATAL_GRACE_S = 10.0
_EXC_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?"  # vLLM's process prefix
                       r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)): (.+)$")


def error_summary(log_text: str) -> str | None:
    """The root cause in an engine log: its first ``SomethingError: message`` line (the engine
    core's own, prefixed ``(EngineCore pid=N)``, comes before the worker's re-raise)."""
    for line in log_text.splitlines():
        m = _EXC_LINE.match(line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2)}"[:400]
    return None


# The driver's SIGTERM handler ends the run with SystemExit (the workers are stopped and the report
# still written). While a worker is being spawned the exit waits: raised inside Popen, after the
# fork but before Popen returned, it would leave a worker process nobody stops.
_sigterm = {"deferring": 0, "pending": False}


def _on_sigterm(*_):
    if _sigterm["deferring"]:
        _sigterm["pending"] = True
    else:
        sys.exit(143)


@contextlib.contextmanager
def _sigterm_deferred():
    _sigterm["deferring"] += 1
    try:
        yield
    finally:
        _sigterm["deferring"] -= 1
        if _sigterm["pending"] and not _sigterm["deferring"]:
            _sigterm["pending"] = False
            sys.exit(143)


class Worker:
    def __init__(self, config: str, spec_path: Path, env: dict, out: Path, control: Path):
        self.config, self.spec_path, self.env, self.out, self.control = config, spec_path, env, out, control
        self.proc: subprocess.Popen | None = None
        self.note = ""
        self.t_start = 0.0
        self.fatal_line: str | None = None
        self.fatal_t = 0.0
        self._log_pos = 0
        self._log_rest = ""

    def start(self) -> None:
        log(f"starting {self.config} (log: {self.out / (self.config + '.log')})")
        self.t_start = time.time()
        (self.out / f"result_{self.config}.json").unlink(missing_ok=True)  # an earlier run's
        logf = open(self.out / f"{self.config}.log", "w")
        with _sigterm_deferred():  # a SIGTERM inside Popen would leave its child unknown to stop()
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", self.config,
                                          "--spec", str(self.spec_path)], cwd=ROOT, env=self.env, stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        return (self.control / f"ready_{self.config}").exists()

    def poll_fatal(self) -> str | None:
        """The first line of this worker's log matching FATAL_LOG_PATTERNS (read incrementally)."""
        if self.fatal_line is None:
            p = self.out / f"{self.config}.log"
            try:
                with open(p, "rb") as f:
                    f.seek(self._log_pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            self._log_pos += len(chunk)
            lines = (self._log_rest + chunk.decode(errors="replace")).replace("\r", "\n").split("\n")
            self._log_rest = lines.pop()
            for line in lines:
                if any(pat.search(line) for pat in FATAL_LOG_PATTERNS):
                    self.fatal_line, self.fatal_t = line.strip()[:400], time.time()
                    break
        return self.fatal_line

    def dead(self) -> bool:
        """Its engine logged a fatal error FATAL_GRACE_S ago and the worker has not exited."""
        return self.poll_fatal() is not None and time.time() - self.fatal_t > FATAL_GRACE_S

    def settled(self) -> bool:
        """Started and either ready to measure, gone, or dead."""
        return self.proc is not None and (self.ready() or not self.alive() or self.dead())

    def failure(self) -> str:
        """What went wrong, in one line: the worker's own verdict, else the log's root cause."""
        res = self.result() or {}
        if res.get("fatal"):
            return res["fatal"]
        p = self.out / f"{self.config}.log"
        text = p.read_text(errors="replace") if p.exists() else ""
        return error_summary(text) or self.fatal_line or "no error in the log"

    def go(self, reference: Path | None) -> None:
        _write_json(self.control / f"go_{self.config}", {"reference": str(reference) if reference else None})

    def result(self) -> dict | None:
        p = self.out / f"result_{self.config}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def _group_alive(self) -> bool:
        self.proc.poll()  # reap the worker itself, or its zombie keeps the group alive
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        """End the worker and every process vLLM started under it (its own process group)."""
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            if not self._group_alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            t = time.time()
            while self._group_alive() and time.time() - t < grace:
                time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        p = self.out / f"{self.config}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""


def _wait(cond, deadline: float, what: str) -> bool:
    t0 = last = time.time()
    while not cond():
        if time.time() > deadline:
            return False
        if time.time() - last > 60:
            last = time.time()
            log(f"waiting for {what} ({last - t0:.0f} s)")
        time.sleep(0.5)
    return True


def run_workers(workers: list[Worker], concurrent: bool, deadline: float, reference: Path | None,
                start_timeout: float) -> None:
    """Measure one configuration at a time, in order; with ``concurrent`` all engines start at
    once and the first measures only when every engine is up (or failed, or was stopped after
    ``start_timeout``), so nothing else runs on the GPU while one measures."""
    if concurrent:
        for w in workers:
            w.start()
    for w in workers:
        if time.time() > deadline:
            w.note = "not measured: the time budget ran out"
            break
        if w.proc is None:
            w.start()
        started = [x for x in workers if x.proc is not None]
        limit = min(deadline, max(x.t_start for x in started) + start_timeout)
        if not _wait(lambda: all(x.settled() for x in started), limit,
                     "engine start: " + ", ".join(x.config for x in started if not x.settled())):
            for x in started:
                if not x.settled():
                    x.note = (f"its engine was not up after {start_timeout:.0f} s: stopped" if time.time() < deadline
                              else "the time budget ran out while the engines started")
                    x.stop()
        for x in started:  # a dead engine is stopped at once, not after the start limit
            if not x.note and x.alive() and x.dead():
                x.note = f"its engine failed before measuring: {x.failure()} (stopped; see {x.config}.log)"
                x.stop()
        if w.ready() and w.alive():
            w.go(reference)
            if not _wait(lambda: not w.alive() or (w.result() or {}).get("done") or w.dead(), deadline,
                         f"{w.config} to measure"):
                w.note = "the time budget ran out while measuring"
            elif not (w.result() or {}).get("done"):
                w.note = (f"its engine failed while measuring: {w.failure()} (stopped; see {w.config}.log)"
                          if w.alive() else f"the worker exited with {w.proc.returncode} while measuring: "
                          f"{w.failure()} (see {w.config}.log)")
        elif not w.note:
            w.note = (f"the worker exited with {w.proc.returncode} before its engine was up: {w.failure()} "
                      f"(see {w.config}.log)")
        w.stop()
        res = w.result() or {}
        log(f"{w.config}: engine start {res.get('engine_start_s', float('nan')):.0f} s; "
            + ", ".join(f"{p} {'FAILED' if p in res.get('errors', {}) else f'{t:.0f} s'}"
                        for p, t in res.get("seconds", {}).items()) + (f"; {w.note}" if w.note else ""))
        if w.config == "stock" and "greedy" in res.get("phases", {}):
            reference = w.out / "result_stock.json"


# ============================================================================ fp32 reference (parent, after the engines)

REF_MIN_S = 20.0  # the fp32 reference phase starts only with this much of the time budget left
REF_CPU_MAX_HIDDEN = 1024  # without a GPU, --reference auto scores only models this small (tests' tiny size)


def fp32_reference_request(runs: dict, spec: dict) -> tuple[dict, dict, list[str]]:
    """The teacher-forced sequences the engines scored, for tools/e2e_reference.py: (request,
    keys {config: {case: request case}}, notes). The sequences are rebuilt from the prompts and
    the greedy tokens each run was forced with (stock's, or its own: ``tokens_from``) and checked
    against the ``seqs_sha`` the run recorded; runs that scored the same sequences share a case."""
    g = spec["greedy"]
    P = prompts(spec["seed"], "greedy", g["n"], g["prompt_len"], spec["vocab_size"])
    cases, keys, notes = {}, {}, []
    for config in CONFIGS:
        lp = _phase(runs, config, "logprobs")
        if not lp:
            continue
        greedy = _phase(runs, "stock" if lp.get("tokens_from") == "stock" else config, "greedy")
        for case in ("none", "adapters"):
            if case not in lp:
                continue
            if not greedy or case not in greedy:
                notes.append(f"{config} {case}: the greedy tokens it was scored on are not in the results")
                continue
            seqs = [p + t for p, t in zip(P, greedy[case])]
            sha = _sha(seqs)
            if sha != lp[case].get("seqs_sha"):
                notes.append(f"{config} {case}: rebuilt sequences do not match the scored ones (sha {sha} != "
                             f"{lp[case].get('seqs_sha')})")
                continue
            key = f"{case}-{sha}"
            cases[key] = {"seqs": seqs, "adapter": [None if case == "none" else i % NUM_ADAPTERS
                                                    for i in range(len(seqs))]}
            keys.setdefault(config, {})[case] = key
    return {"cases": cases}, keys, notes


def checkpoint_id(model: Path, adapters: list[str]) -> dict:
    """Fingerprints of the generated files and the torch that wrote them (e2e_model.fingerprint):
    --rescore rebuilds a checkpoint and must get the same one."""
    import torch

    return {"model": e2e_model.fingerprint(Path(model) / "model.safetensors"),
            "adapter0": e2e_model.fingerprint(Path(adapters[0]) / "adapter_model.safetensors") if adapters else None,
            "torch": str(torch.__version__)}


def _phase(runs: dict, config: str, phase: str):
    return ((runs.get(config) or {}).get("phases") or {}).get(phase)


def run_fp32_reference(mode: str, runs: dict, spec: dict, model: Path, adapters: list[str], files: Path,
                       deadline: float) -> dict:
    """tools/e2e_reference.py on the sequences the engines scored, in its own process (after the
    engines stopped: the GPU is free), limited to what is left of the time budget. Returns what
    the report shows under ``fp32_reference`` (its raw results included; on failure its log's
    tail), or a note why not. Its request, result and log go to ``files`` (not --out: the device
    returns at most 8 files, and e2e.json holds everything)."""
    res: dict = {"mode": mode}
    request, keys, notes = fp32_reference_request(runs, spec)
    res.update(keys=keys, notes=notes)
    if mode == "off":
        res["skipped"] = "--reference off"
        return res
    if not request["cases"]:
        res["skipped"] = "no teacher-forced logprobs to compare with"
        return res
    left = deadline - time.time()
    if left < REF_MIN_S:
        res["skipped"] = f"the time budget ran out ({left:.0f} s left, {REF_MIN_S:.0f} s needed)"
        return res
    if mode == "auto":
        import torch

        hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
        if not torch.cuda.is_available() and hidden > REF_CPU_MAX_HIDDEN:
            res["skipped"] = (f"no GPU, and the model (hidden {hidden}) is too large for the CPU reference "
                              "(--reference on forces it)")
            return res
    files.mkdir(parents=True, exist_ok=True)
    _write_json(files / "reference_request.json", request)
    cmd = [sys.executable, str(ROOT / "tools" / "e2e_reference.py"), "--model", str(model), "--request",
           str(files / "reference_request.json"), "--out", str(files / "reference.json"), "--also-unquantized",
           "--also-bf16-inputs"]
    for a in adapters:
        cmd += ["--adapter", str(a)]
    log(f"fp32 reference: {len(request['cases'])} cases, at most {left:.0f} s")
    (files / "reference.json").unlink(missing_ok=True)
    t = time.time()
    with open(files / "reference.log", "w") as logf:
        try:
            r = subprocess.run(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, timeout=left,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                   [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])))
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = None
    res["wall_s"] = time.time() - t
    text = (files / "reference.log").read_text(errors="replace")
    partial = json.loads((files / "reference.json").read_text()) if (files / "reference.json").exists() else {}
    if rc is None:  # what it finished (it writes after each variant) is still reported
        res["log_tail"] = "\n".join(text.splitlines()[-40:])
        if partial.get("cases"):
            res.update(partial)
            res["notes"] = notes + [f"the time budget ran out after {res['wall_s']:.0f} s: only the variants "
                                    "finished by then"]
        else:
            res["skipped"] = f"the time budget ran out while it ran ({res['wall_s']:.0f} s; log tail in e2e.json)"
    elif rc != 0 or not partial.get("cases"):
        res["skipped"] = f"it failed (exit {rc}): {error_summary(text) or 'log tail in e2e.json'}"
        res["log_tail"] = "\n".join(text.splitlines()[-40:])
    else:
        res.update(partial)
    log(f"fp32 reference: {res.get('skipped') or 'done'} ({res['wall_s']:.0f} s)")
    return res


# Variables of the launching shell that change how both engines compute (Inductor's deterministic
# mode, vLLM's and torch's knobs): recorded in the report, since both engines inherit them.
SHARED_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "VLLM_", "CUDA_", "NCCL_")


def shared_env(environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(SHARED_ENV_PREFIXES)}


def build_report(args, spec: dict, runs: dict, notes: dict, ours_env: dict, t0: float, out: Path,
                 entry_point: str = "", fp32_reference: dict | None = None, extra: dict | None = None) -> dict:
    git = os.environ.get("EPILORA_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    logs = {c: plugin_log_summary((out / f"{c}.log").read_text(errors="replace"))
            for c in CONFIGS if (out / f"{c}.log").exists()}
    rep = {"tool": "tools/e2e_vllm.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git,
           "command": " ".join(["python", "tools/e2e_vllm.py"] + (args.argv or [])), "seconds": time.time() - t0,
           "concurrent": not args.sequential, "ours_env": ours_env, "shared_env": shared_env(os.environ),
           "spec": spec, "notes": notes,
           "entry_point": entry_point,
           "targets": {"tpot_one_adapter_ms": e2e_report.TARGET_TPOT_ONE_ADAPTER_MS,
                       "tput_eight_adapters": e2e_report.TARGET_TPUT_8_ADAPTERS,
                       "greedy_adapters_identical": e2e_report.TARGET_GREEDY_ADAPTERS},
           "tolerances": {"mean_abs_nats": e2e_report.TOL_MEAN_NATS, "max_abs_nats": e2e_report.TOL_MAX_NATS},
           "anchors": e2e_report.ANCHORS,
           "plugin_log": logs, "comparison": compare(runs, spec, fp32_reference), "performance": perf_rows(runs),
           "fp32_reference": fp32_reference, **(extra or {}), "runs": runs}
    _write_json(out / "e2e.json", rep)
    write_markdown(rep, out / "e2e.md")
    return rep


def apply_defaults(args) -> None:
    """Fill the options left unset: --smoke's values, else the full run's."""
    full = {"layers": None, "phases": ",".join(PHASES), "reps": 3, "time_budget": FULL_TIME_BUDGET_S,
            "start_timeout": FULL_START_TIMEOUT_S}
    for key, value in full.items():
        if getattr(args, key) is None:
            if args.smoke:
                value = SMOKE[key]
                value = ",".join(value) if key == "phases" else value
            setattr(args, key, value)


def smoke_banner(smoke: dict, phases: list[str], args) -> str:
    eng = smoke["engine"]
    return (f"SMOKE RUN: {smoke['layers']} of {smoke['of_layers']} layers, {' + '.join(phases)} only (skipped: "
            f"{', '.join(smoke['skipped']) or 'nothing'}); engine max_model_len {eng.get('max_model_len')}, "
            f"max_num_seqs {eng.get('max_num_seqs')} (CUDA-graph capture sizes up to "
            f"{2 * eng['max_num_seqs'] if 'max_num_seqs' in eng else '?'} tokens), CUDA graphs and torch.compile on. "
            f"Expected on an H200: ~3 min (checkpoint ~20 s; both engines starting together ~1.5-2.5 min, the "
            f"36-layer stock engine took 197 s; ~20 s of checks each; stopping ~10 s); limits: engine start "
            f"{args.start_timeout:.0f} s, whole run {args.time_budget:.0f} s")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "build" / "e2e"))
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/epilora_e2e"),
                    help="checkpoint, adapters, vLLM caches (kept for later runs on the same machine)")
    ap.add_argument("--only", choices=CONFIGS)
    ap.add_argument("--stock-from", type=Path, help="stock results of an earlier run (e2e.json or result_stock.json)")
    ap.add_argument("--stock-env", action="append", default=[], metavar="KEY=VAL",
                    help="an environment variable of the stock engine only (repeatable)")
    ap.add_argument("--deterministic-lora-shrink", action="store_true",
                    help="vLLM's LoRA shrink without split-K atomics in both engines (a diagnostic; slows stock's LoRA)")
    ap.add_argument("--ours-env", action="append", default=[], metavar="KEY=VAL",
                    help="environment of the 'ours' engine (repeatable), e.g. EPILORA_FORCE_TRITON=1")
    ap.add_argument("--size", choices=sorted(e2e_model.SIZES), default="qwen3-8b")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the size's, 36; --smoke: 4)")
    ap.add_argument("--phases", help=f"comma-separated, of {','.join(PHASES)} (default: all; --smoke: "
                    f"{','.join(SMOKE['phases'])})")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--reps", type=int, help="repetitions of the timed runs (default 3)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a cheap first GPU contact: {SMOKE['layers']} layers, correctness only (greedy, teacher-"
                    f"forced logprobs; no TPOT / throughput), engine {SMOKE['engine']}; CUDA graphs and "
                    f"torch.compile stay on; ~3 min on an H200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", choices=e2e_model.INITS, default=e2e_model.DEFAULT_INIT,
                    help="the checkpoint's initialization (tools/e2e_model.py): stable keeps rounding below the "
                    "top-1 margins (greedy identity is testable), dense is the runs up to run7's")
    ap.add_argument("--lora-gain", type=float, default=e2e_model.LORA_GAIN,
                    help="stable init: each adapter update's rms / its projection's base output rms "
                    f"(default {e2e_model.LORA_GAIN:g}; tools/e2e_margin.py --lora-gain predicts its greedy margins)")
    ap.add_argument("--sequential", action="store_true", help="start 'ours' only after 'stock' has finished")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra/overriding vllm.LLM keyword, value as JSON (e.g. enforce_eager=true)")
    ap.add_argument("--time-budget", type=float, help="seconds for the whole run; workers are stopped after it "
                    f"and the report is written with what was measured (default {FULL_TIME_BUDGET_S:.0f}; --smoke: "
                    f"{SMOKE['time_budget']:.0f})")
    ap.add_argument("--start-timeout", type=float,
                    help="seconds an engine may take to start before it is stopped (a hang must not block the "
                    f"other; default {FULL_START_TIMEOUT_S:.0f}; --smoke: {SMOKE['start_timeout']:.0f})")
    ap.add_argument("--reference", choices=("auto", "on", "off"), default="auto",
                    help="after the engines: score the same teacher-forced sequences with the fp32 reference "
                    "(tools/e2e_reference.py: FP8 weights and per-token activations as vLLM quantizes them, "
                    "everything else exact) and report each engine's distance to it; auto: when the logprobs "
                    f"phase ran, on the GPU (on the CPU only for models up to hidden {REF_CPU_MAX_HIDDEN}), with at "
                    f"least {REF_MIN_S:.0f} s of the time budget left")
    ap.add_argument("--rescore", type=Path, metavar="E2E_JSON",
                    help="no engines: rebuild the checkpoint of an earlier run's e2e.json under --work-dir, add the "
                    "fp32 reference to its results and write its report again (to --out)")
    ap.add_argument("--expect-checkpoint", metavar="MODEL_FP[/ADAPTER0_FP]",
                    help="--rescore of a run that recorded no fingerprints (before spec.checkpoint): the "
                    "e2e_model.fingerprint its checkpoint (and adapter 0) had; a rebuilt one that differs is refused")
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec)
    args.argv = argv
    t0 = time.time()
    apply_defaults(args)
    if args.rescore:
        return rescore(args, t0)
    deadline = t0 + args.time_budget
    phases = [p for p in args.phases.split(",") if p and not (args.skip_throughput and p == "throughput")]
    if set(phases) - set(PHASES + OPTIONAL_PHASES):
        ap.error(f"--phases: unknown {sorted(set(phases) - set(PHASES + OPTIONAL_PHASES))}")
    ours_env = parse_env_pairs(args.ours_env)
    stock_env = parse_env_pairs(args.stock_env)
    engine_over = dict(SMOKE["engine"]) if args.smoke else {}
    engine_over.update({k: json.loads(v) for k, v in parse_env_pairs(args.engine_arg).items()})
    out, work = args.out.resolve(), args.work_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = e2e_model.model_config(args.size, args.layers)
    layers = cfg["num_hidden_layers"]
    smoke = None
    if args.smoke:
        smoke = {"layers": layers, "of_layers": e2e_model.SIZES[args.size]["num_hidden_layers"],
                 "skipped": [p for p in PHASES if p not in phases], "engine": engine_over}
        log(smoke_banner(smoke, phases, args))

    log(f"writing/reusing the checkpoint and {NUM_ADAPTERS} adapters under {work}")
    tag = f"{args.size}-L{layers}-s{args.seed}-{args.init}"
    model = e2e_model.write_model(work / f"model-{tag}", args.size, layers, args.seed, init=args.init)
    adapters = [str(e2e_model.write_adapter(work / f"adapter-{tag}{_gain_tag(args.lora_gain)}-r{RANK}-{i}", args.size,
                                            layers, RANK, seed=1000 * (args.seed + 1) + i, init=args.init,
                                            lora_gain=args.lora_gain))
                for i in range(NUM_ADAPTERS)]
    log(f"checkpoint ready ({time.time() - t0:.0f} s)")
    shim = e2e_model.make_plugin_shim(work / "shim")
    control = work / f"run-{os.getpid()}"
    control.mkdir(parents=True, exist_ok=True)
    logging_cfg = control / "logging.json"
    _write_json(logging_cfg, logging_config())
    engine = engine_kwargs(model, args.seed, engine_over)
    spec = {"size": args.size, "layers": layers, "vocab_size": cfg["vocab_size"], "seed": args.seed, "init": args.init,
            "lora_gain": args.lora_gain, "reps": args.reps,
            "phases": phases, "adapters": adapters, "engine": engine, "out": str(out), "control_dir": str(control),
            "greedy": {"n": 16, "prompt_len": 64, "gen_len": 32}, "tpot": {"prompt_len": 512, "gen_len": 128},
            "throughput": {"requests": 64, "prompt_len": 512, "gen_len": 128}, "smoke": smoke,
            "checkpoint": checkpoint_id(model, adapters)}
    spec_path = control / "spec.json"
    _write_json(spec_path, spec)

    configs = [args.only] if args.only else list(CONFIGS)
    base_env = dict(os.environ)
    if args.deterministic_lora_shrink:
        folder = control / "lora_unsplit_shrink"
        write_unsplit_shrink_configs(folder, gpu_names())
        base_env["VLLM_TUNED_CONFIG_FOLDER"] = str(folder)
        log(f"vLLM's LoRA shrink unsplit (split_k = 1) in both engines: VLLM_TUNED_CONFIG_FOLDER={folder}")
    # vLLM's compile caches, one per configuration and environment (as --ours-env, --stock-env may
    # change what vLLM compiles); the plain stock run keeps its "stock" cache.
    cache_dirs = {"stock": "stock" + (f"-{_sha(stock_env)[:8]}" if stock_env else ""), "ours": f"ours-{_sha(ours_env)[:8]}"}
    workers = [Worker(c, spec_path, engine_env(c, base_env, shim, work / "vllm_cache" / cache_dirs[c],
                                               logging_cfg, ours_env, stock_env), out, control) for c in configs]
    entry = entry_point_check(workers[0].env)
    log(f"plugin entry point: {entry}")
    runs = {}
    if args.stock_from:
        runs["stock"] = load_result(args.stock_from)
    reference = args.stock_from.resolve() if args.stock_from else None
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop the engines and report on SIGTERM too
    interrupted = False
    try:
        run_workers(workers, concurrent=not args.sequential and len(workers) > 1, deadline=deadline,
                    reference=reference, start_timeout=args.start_timeout)
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        for w in workers:
            w.note = w.note or "interrupted"
    finally:
        for w in workers:
            w.stop()
    for w in workers:
        runs[w.config] = w.result() or {"config": w.config, "phases": {}, "errors": {"engine": w.note or "no result"}}
        if not runs[w.config].get("done"):
            runs[w.config]["log_tail"] = w.log_tail()
    fp32 = None
    if "logprobs" in phases:
        try:
            fp32 = run_fp32_reference("off" if interrupted else args.reference, runs, spec, model, adapters,
                                      control, deadline)
        except (KeyboardInterrupt, SystemExit):
            fp32 = {"mode": args.reference, "skipped": "interrupted"}
    rep = build_report(args, spec, runs, {w.config: w.note for w in workers if w.note}, ours_env, t0, out, entry,
                       fp32, extra={"stock_env": stock_env, "deterministic_lora_shrink": args.deterministic_lora_shrink})
    print((out / "e2e.md").read_text(), flush=True)
    ok = all(runs[w.config].get("done") for w in workers)
    log(f"done in {rep['seconds']:.0f} s; report: {out / 'e2e.md'}")
    return 0 if ok else 1


def _gain_tag(lora_gain: float) -> str:
    """The adapter directories' tag part for a non-default adapter gain ('' for the default)."""
    return "" if lora_gain == e2e_model.LORA_GAIN else f"-g{lora_gain:g}"


def rescore(args, t0: float) -> int:
    """--rescore: the fp32 reference for an earlier run's results (no engines), report rewritten."""
    prev = json.loads(args.rescore.read_text())
    spec, runs = prev["spec"], prev["runs"]
    out, work = args.out.resolve(), args.work_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    init = spec.get("init", "dense")  # runs before the init choice (up to run7) used the dense one
    tag = f"{spec['size']}-L{spec['layers']}-s{spec['seed']}-{init}"
    log(f"rescoring {args.rescore}: writing/reusing its checkpoint and {NUM_ADAPTERS} adapters under {work}")
    model = e2e_model.write_model(work / f"model-{tag}", spec["size"], spec["layers"], spec["seed"], init=init)
    gain = spec.get("lora_gain", e2e_model.LORA_GAIN)  # runs before the option: the default gain
    adapters = [str(e2e_model.write_adapter(work / f"adapter-{tag}{_gain_tag(gain)}-r{RANK}-{i}", spec["size"],
                                            spec["layers"], RANK, seed=1000 * (spec["seed"] + 1) + i, init=init,
                                            lora_gain=gain))
                for i in range(len(spec["adapters"]))]
    now, then = checkpoint_id(model, adapters), spec.get("checkpoint")
    if not then and args.expect_checkpoint:
        fp_model, _, fp_adapter = args.expect_checkpoint.partition("/")
        then = {"model": fp_model, "adapter0": fp_adapter or None, "torch": "--expect-checkpoint"}
    if then and (now["model"] != then["model"] or (then["adapter0"] and now["adapter0"] != then["adapter0"])):
        fp32 = {"mode": args.reference, "checkpoint": now,
                "skipped": f"the rebuilt checkpoint is not the run's (fingerprints {now['model']}/{now['adapter0']} "
                f"with torch {now['torch']}, the run's {then['model']}/{then['adapter0']} with torch {then['torch']}): "
                "rescore where the run's torch wrote it"}
    else:
        fp32 = run_fp32_reference("on" if args.reference == "auto" else args.reference, runs, spec, model, adapters,
                                  work / f"rescore-{os.getpid()}", t0 + args.time_budget)
        fp32["checkpoint"] = now
        if not then:
            fp32.setdefault("notes", []).append(
                f"the run recorded no checkpoint fingerprint: rebuilt with torch {now['torch']} (fingerprint "
                f"{now['model']}); torch's CPU RNG changed across versions, so a top-1 agreement near 0 % means "
                "another checkpoint, not another computation")
    git = os.environ.get("EPILORA_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    keep = {k: prev[k] for k in ("date", "git", "command", "seconds", "concurrent", "plugin_log", "stock_env",
                                 "deterministic_lora_shrink") if k in prev}
    keep["rescored_from"] = {"file": str(args.rescore), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git,
                             "command": " ".join(["python", "tools/e2e_vllm.py"] + (args.argv or [])),
                             "seconds": time.time() - t0}
    build_report(args, spec, runs, prev.get("notes", {}), prev.get("ours_env", {}), t0, out,
                 prev.get("entry_point", ""), fp32, extra=keep)
    print((out / "e2e.md").read_text(), flush=True)
    return 0 if not fp32.get("skipped") else 1


if __name__ == "__main__":
    rc = main()
    if "--worker" in sys.argv:  # leave vLLM's teardown to the parent's process-group kill
        sys.stdout.flush()
        os._exit(rc)
    sys.exit(rc)
