"""A stand-in for ``vllm.LLM`` so tests/test_e2e_tool.py can run tools/e2e_vllm.py's whole pipeline
(checkpoint, processes, phases, comparison, report) on a CPU without vLLM.

Selected by EPILORA_E2E_LLM_FACTORY=tests.e2e_fake:FakeLLM. Greedy tokens and logprobs are
deterministic functions of the context and the adapter id. The 'ours' configuration (plugin on,
i.e. EPILORA_DISABLE unset) shifts every logprob by OURS_LP_SHIFT and, for adapter id
FLIP_ADAPTER_ID, changes the greedy token at generated position FLIP_AT, so the tests know
exactly what the comparison must find. EPILORA_E2E_FAKE_FAIL=<config> makes that engine fail,
EPILORA_E2E_FAKE_SLOW=[<config>:]<seconds> makes that engine (or every one) start that slowly.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

OURS_LP_SHIFT = 1e-3
FLIP_ADAPTER_ID = 8
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
        if self.ours:
            print("INFO 00:00:00 vllm.epilora: EpiLoRA plugin active: fused FP8 LoRA for 12 LoRA linear classes")
            for _ in range(2):  # two processes log the same layers
                for i in range(self.layers):
                    for p in PROJS:
                        print(f"DEBUG 00:00:00 vllm.epilora: EpiLoRA: model.layers.{i}.{p} -> EpiLoRAFakeWithLoRA "
                              "(fused FP8 LoRA)")
        else:
            print("INFO 00:00:00 vllm.epilora: EpiLoRA plugin disabled by EPILORA_DISABLE")

    def collective_rpc(self, method):
        assert method == "e2e_lora_layers"
        n = 4 * self.layers
        return [{"lora_classes": {"EpiLoRAFakeWithLoRA" if self.ours else "FakeWithLoRA": n},
                 "epilora_layers": n if self.ours else 0, "epilora_active": n if self.ours else 0,
                 "gpu": "fake", "kernel_path": "triton" if self.ours else "unknown", "env": {}}]

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
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=gen)], prompt_logprobs=plp))
        return outs
