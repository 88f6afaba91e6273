"""A stand-in for ``vllm.LLM`` so tests/test_e2e_tool.py can run tools/e2e_vllm.py's whole pipeline
(checkpoint, processes, phases, comparison, report) on a CPU without vLLM.

Selected by EPILORA_E2E_LLM_FACTORY=tests.e2e_fake:FakeLLM. Greedy tokens and logprobs are
deterministic functions of the context and the adapter id. The 'ours' configuration (plugin on,
i.e. EPILORA_DISABLE unset) shifts every logprob by OURS_LP_SHIFT and, for adapter id
FLIP_ADAPTER_ID, changes the greedy token at generated position FLIP_AT, so the tests know
exactly what the comparison must find. EPILORA_E2E_FAKE_FAIL=<config> makes that engine fail,
EPILORA_E2E_FAKE_SLOW=[<config>:]<seconds> makes that engine (or every one) start that slowly.

``collective_rpc`` runs the real ``tools.e2e_model.WorkerProbe`` on a stand-in worker and, like
vLLM 0.26, sends the reply only when it holds exactly dict / list / str / int / float / bool /
None (msgspec refuses the rest, str subclasses included); otherwise, as in vLLM, the engine's
output thread dies with a log line and the call never returns. Failure switches (value: the
configuration, "stock" or "ours"): EPILORA_E2E_FAKE_RPC_DIES (the output thread dies on the
probe's reply whatever it holds), EPILORA_E2E_FAKE_RPC_SILENT (the probe never returns, nothing
logged), EPILORA_E2E_FAKE_DIES_SCORING (the engine dies at the first prompt-logprobs request,
logging vLLM's fatal-error line, and the call hangs).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

OURS_LP_SHIFT = 1e-3
FLIP_ADAPTER_ID = 8
# Wall time of one decode step (every request of a generate call advances together): a real engine's
# n-token run outlasts its 1-token run, so the profile / TPOT phases' per-token differences are
# positive by construction, not by the luck of a loaded CI machine's scheduler (seen negative).
STEP_S = 5e-4
FLIP_AT = 20
PROJS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class FakeLLM:
    def __init__(self, model: str, **engine):
        self.ours = os.environ.get("EPILORA_DISABLE") != "1"
        if os.environ.get("EPILORA_E2E_FAKE_FAIL") == ("ours" if self.ours else "stock"):
            raise RuntimeError("fake engine failure")
        who, _, secs = os.environ.get("EPILORA_E2E_FAKE_SLOW", "0").rpartition(":")
        if who in ("", "ours" if self.ours else "stock"):
            time.sleep(float(secs))
        cfg = json.loads((Path(model) / "config.json").read_text())
        self.vocab, self.layers = cfg["vocab_size"], cfg["num_hidden_layers"]
        self.log_stats = engine.get("disable_log_stats") is False  # vLLM's LLM: off unless asked
        if self.ours:
            print("INFO 00:00:00 vllm.epilora: EpiLoRA plugin active: fused FP8 LoRA for 12 LoRA linear classes")
            for _ in range(2):  # two processes log the same layers
                for i in range(self.layers):
                    for p in PROJS:
                        print(f"DEBUG 00:00:00 vllm.epilora: EpiLoRA: model.layers.{i}.{p} -> EpiLoRAFakeWithLoRA "
                              "(fused FP8 LoRA)")
        else:
            print("INFO 00:00:00 vllm.epilora: EpiLoRA plugin disabled by EPILORA_DISABLE")

    def _fails(self, switch: str) -> bool:
        return os.environ.get(switch) == ("ours" if self.ours else "stock")

    @staticmethod
    def _hang():
        while True:
            time.sleep(3600)

    def _worker(self):
        if getattr(self, "_worker_obj", None) is None:  # one worker, as an engine has (state across RPCs)
            self._worker_obj = self._make_worker()
        return self._worker_obj

    def _make_worker(self):
        import torch

        from tools.e2e_model import WorkerProbe

        name = "EpiLoRAFakeWithLoRA" if self.ours else "FakeWithLoRA"
        cls = type(name, (torch.nn.Linear,), {"_epilora_active": self.ours})
        model = torch.nn.ModuleList(cls(2, 2) for _ in range(4 * self.layers))
        # one engine step: the forward (execute_model) and the sampling call, as vLLM 0.26's worker
        # has them (the host probe times both)
        step = {"execute_model": lambda w, so: time.sleep(STEP_S), "sample_tokens": lambda w, g: None}
        return type("FakeWorker", (WorkerProbe,), {"get_model": lambda w: model, "model_runner": object(), **step})()

    def collective_rpc(self, method):
        if self._fails("EPILORA_E2E_FAKE_RPC_SILENT"):
            self._hang()
        reply = [getattr(self._worker(), method)()]
        unsendable = _unsendable(reply)
        if unsendable or self._fails("EPILORA_E2E_FAKE_RPC_DIES"):
            # what vLLM 0.26 logs when its output thread cannot encode a reply; the caller waits forever
            print("(EngineCore pid=1) Exception in thread Thread-3 (process_output_sockets):\n"
                  "(EngineCore pid=1) Traceback (most recent call last):\n"
                  f"(EngineCore pid=1) TypeError: Object of type {unsendable or 'fake'} is not serializable", flush=True)
            self._hang()
        return reply

    def _base(self, ctx, lid):
        return (sum(ctx[-4:]) * 2654435761 + 97 * lid) % self.vocab

    def _next(self, ctx, lid, n_gen):
        t = self._base(ctx, lid)
        if self.ours and lid == FLIP_ADAPTER_ID and n_gen == FLIP_AT:  # a near-tie that flipped
            t = (t + 1) % self.vocab
        return t

    def _lp(self, ctx, tok, lid):
        return -1.0 - ((sum(ctx[-4:]) + tok + lid) % 1000) / 100.0 + (OURS_LP_SHIFT if self.ours else 0.0)

    def generate(self, prompts, sp, lora_request=None, use_tqdm=True):
        if getattr(sp, "prompt_logprobs", None) is not None and self._fails("EPILORA_E2E_FAKE_DIES_SCORING"):
            print("(EngineCore pid=1) ERROR 00:00:00 vllm.v1.engine.core: EngineCore encountered a fatal error.\n"
                  "(EngineCore pid=1) RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
            self._hang()
        arrival = time.monotonic()
        worker = self._worker()
        for _ in range(sp.max_tokens):  # every request of the call advances together, one step a token
            worker.execute_model(None)
            worker.sample_tokens(None)
        outs = []
        for k, p in enumerate(prompts):
            ids = list(p["prompt_token_ids"])
            lora = lora_request[k] if isinstance(lora_request, list) else lora_request
            lid = lora.lora_int_id if lora is not None else 0
            ctx, gen = list(ids), []
            for j in range(sp.max_tokens):
                gen.append(self._next(ctx, lid, j))
                ctx.append(gen[-1])
            plp = None
            if getattr(sp, "prompt_logprobs", None) is not None:
                plp = [None]
                for i in range(1, len(ids)):
                    top = self._next(ids[:i], lid, i - 64)
                    shift = OURS_LP_SHIFT if self.ours else 0.0
                    d = {top: SimpleNamespace(logprob=-0.5 + shift)}
                    if top != self._base(ids[:i], lid):
                        d[self._base(ids[:i], lid)] = SimpleNamespace(logprob=-0.51 + shift)
                    d.setdefault(ids[i], SimpleNamespace(logprob=self._lp(ids[:i], ids[i], lid)))
                    plp.append(d)
            metrics = None
            if self.log_stats:  # vLLM's RequestStateStats: engine-core timestamps, one step per token
                first = arrival + STEP_S
                metrics = SimpleNamespace(num_generation_tokens=sp.max_tokens, scheduled_ts=arrival,
                                          first_token_ts=first, last_token_ts=first + STEP_S * (sp.max_tokens - 1),
                                          first_token_latency=STEP_S)
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=gen)], prompt_logprobs=plp,
                                        metrics=metrics))
        return outs


def _unsendable(obj) -> str | None:
    """The first type in ``obj`` that msgspec would refuse (exact types only), else None."""
    if obj is None or type(obj) in (bool, int, float, str):
        return None
    if type(obj) is dict:
        return next((u for k, v in obj.items() for u in (_unsendable(k), _unsendable(v)) if u), None)
    if type(obj) is list:
        return next((u for v in obj if (u := _unsendable(v))), None)
    return f"<class '{type(obj).__module__}.{type(obj).__qualname__}'>"
