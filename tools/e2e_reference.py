"""fp32 reference forward of tools/e2e_model.py's Qwen3 checkpoint: how far each engine of
tools/e2e_vllm.py is from an exact computation of what vLLM is asked to compute.

    python tools/e2e_reference.py --model DIR [--adapter DIR ...] --request FILE --out FILE
                                  [--device auto|cpu|cuda] [--no-quantize]

The math mirrors vLLM 0.26's Qwen3 (``vllm/model_executor/models/qwen3.py``) with every
activation in fp32 and no rounding to bf16 anywhere:

* embedding (bf16 table) -> per layer: RMSNorm -> merged qkv projection -> per-head q_norm /
  k_norm (RMSNorm over head_dim) -> RoPE (neox / HF ``rotate_half`` convention: the two halves
  of head_dim, inv_freq = rope_theta^(-2i/d), positions 0.. per sequence) -> causal GQA attention
  (softmax(q k^T / sqrt(head_dim)); query head h reads kv head h // (heads / kv_heads)) -> o_proj
  -> residual -> RMSNorm -> SiLU(gate) * up (merged gate_up projection) -> down_proj ->
  residual; final RMSNorm; lm_head (untied: ``tie_word_embeddings`` is false in the checkpoint
  e2e_model writes).
* linear layers as vLLM serves them with ``quantization="fp8"`` on a bf16 checkpoint
  (``Fp8PerTensorOnlineLinearMethod``): the *merged* weight (q|k|v, gate|up) quantized per tensor
  with one scale (``ops.scaled_fp8_quant(layer.weight, scale=None)`` in
  ``process_weights_after_loading``), activations quantized per token dynamically
  (``kFp8DynamicTokenSym`` where cutlass FP8 is supported, i.e. Hopper), then the scaled GEMM:
  ``epilora_cute.reference`` (quantize_fp8_per_tensor, quantize_fp8_per_token, fp8_scaled_mm),
  the project's one reference. The embedding and lm_head are not LinearBase: they stay bf16.
  ``quantize=False``: the bf16 checkpoint weights in fp32, no FP8 at all (the model HF
  transformers runs; tests/test_e2e_reference.py checks it against Qwen3ForCausalLM).
  ``bf16_inputs=True``: each linear layer's input rounded to bf16 first, as the tensor vLLM
  hands to a linear op holds it (the plugin's op quantizes that bf16 tensor, as vLLM's CUDA
  quantization kernel does). Under torch.compile, Inductor fuses vLLM's native RMSNorm /
  SiLU-and-mul with the native per-token quantization (``QuantFP8.forward_native``: x *
  reciprocal(scale)) and, without ``emulate_precision_casts``, need not round the intermediate
  to bf16: stock's FP8 codes may then come from the unrounded values, closer to the default
  (fp32 inputs) reference. The two variants tell the cases apart.
* LoRA (PEFT adapters, vLLM's semantics): per projection and per token of that adapter,
  y += (x A^T) (s B)^T with x the unquantized input and s = lora_alpha / r (alpha / sqrt(r) with
  rslora; vLLM folds s into B at load time), through ``epilora_cute.reference.lora_shrink`` /
  ``lora_expand`` (one slice per projection of a merged layer). DoRA is refused.

Teacher-forced scoring (``Reference.score``) returns what ``tools/e2e_vllm.py``'s ``Ctx.score``
returns: per sequence, for positions i = 1 .. L-1, the log-probability (log_softmax over the
whole vocabulary of the logits computed at position i-1) of token seq[i], and the top-1 token
of that distribution.

The request file (written by tools/e2e_vllm.py's reference phase) is
``{"cases": {name: {"seqs": [[token ids]], "adapter": [index into --adapter or null per seq]}}}``;
the output ``{"cases": {name: {"lp", "top1", "seqs_sha"}}, "quantize", "device", "seconds", ...}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from epilora_cute import reference as R  # noqa: E402
from tools import e2e_model  # noqa: E402

PROJ_GROUPS = {  # vLLM's merged linear layers and the checkpoint projections they hold, in order
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
MAX_TOKENS_PER_CHUNK = 4096  # tokens of one forward (logits are [tokens, vocab] fp32)


def seqs_sha(seqs) -> str:
    """tools/e2e_vllm.py's ``_sha`` of a list of token sequences."""
    return hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] (HF's default RoPE: the frequencies repeated over both halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                                .to(torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; rotate_half: (x1, x2) -> (-x2, x1) over the two halves."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def lora_scaling(peft: dict) -> float:
    """vLLM's ``PEFTHelper.vllm_lora_scaling_factor``: alpha / r, alpha / sqrt(r) with rslora."""
    if peft.get("use_dora"):
        raise NotImplementedError("DoRA adapters: vLLM does not serve them")
    r, alpha = peft["r"], peft.get("lora_alpha", peft["r"])
    return alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r


class Linear:
    """One of vLLM's (merged) linear layers: base weight + the adapters' stacked A / B per slice."""

    def __init__(self, parts: list[torch.Tensor], quantize: bool, device, bf16_inputs: bool = False):
        w = torch.cat(parts, 0).to(device)  # bf16 [N, K], the merged parameter vLLM quantizes
        self.widths = [p.shape[0] for p in parts]
        self.quantize, self.bf16_inputs = quantize, bf16_inputs
        if quantize:
            self.w_codes, self.w_scale = R.quantize_fp8_per_tensor(w)
            self.w = None
        else:
            self.w = w.to(torch.float32)
        self.lora_a: list[torch.Tensor] | None = None  # per slice [n_adapters, r, K] fp32
        self.lora_b: list[torch.Tensor] | None = None  # per slice [n_adapters, n_s, r] fp32, scaling folded in

    def __call__(self, x: torch.Tensor, token_lora: torch.Tensor | None) -> torch.Tensor:
        if self.bf16_inputs:  # the input as a bf16 tensor holds it (what a linear op is handed in vLLM)
            x = x.to(torch.bfloat16).to(torch.float32)
        if self.quantize:
            xq, sx = R.quantize_fp8_per_token(x)
            y = R.fp8_scaled_mm(xq, sx, self.w_codes, self.w_scale)
        else:
            y = x @ self.w.t()
        if self.lora_a is not None and token_lora is not None and bool((token_lora >= 0).any()):
            y = y + R.lora_expand(R.lora_shrink(x, self.lora_a, token_lora), self.lora_b, token_lora)
        return y


class Reference:
    """The e2e checkpoint in ``model_dir`` (and PEFT adapters), loaded for the fp32 reference."""

    def __init__(self, model_dir, adapters=(), quantize: bool = True, device="cpu", bf16_inputs: bool = False):
        model_dir = Path(model_dir)
        self.cfg = cfg = json.loads((model_dir / "config.json").read_text())
        if cfg.get("model_type") != "qwen3":
            raise ValueError(f"not a Qwen3 checkpoint: model_type {cfg.get('model_type')!r}")
        if cfg.get("rope_scaling"):
            raise NotImplementedError(f"rope_scaling {cfg['rope_scaling']} (e2e_model writes none)")
        self.device = torch.device(device)
        self.quantize, self.bf16_inputs = quantize, bf16_inputs
        self.eps = float(cfg["rms_norm_eps"])
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.n_layers = cfg["num_hidden_layers"]
        path = model_dir / "model.safetensors"
        dev = self.device

        def load(names):
            return e2e_model.read_safetensors(path, set(names))[1]

        t = load(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"])
        self.embed = t["model.embed_tokens.weight"].to(dev)  # bf16, rows gathered then widened
        self.norm = t["model.norm.weight"].to(dev, torch.float32)
        lm = t.get("lm_head.weight")
        if cfg.get("tie_word_embeddings") or lm is None:
            lm = t["model.embed_tokens.weight"]
        self.lm_head = lm.to(dev, torch.float32)
        del t
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            names = [p + n + ".weight" for g in PROJ_GROUPS.values() for n in g]
            names += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                  "self_attn.q_norm", "self_attn.k_norm")]
            t = load(names)
            layer = {k: Linear([t[p + n + ".weight"] for n in g], quantize, dev, bf16_inputs)
                     for k, g in PROJ_GROUPS.items()}
            for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
                layer[n.split(".")[-1]] = t[p + n + ".weight"].to(dev, torch.float32)
            self.layers.append(layer)
            del t
        self.n_adapters = 0
        if adapters:
            self._load_adapters([Path(a) for a in adapters])

    def _load_adapters(self, dirs: list[Path]) -> None:
        """Every adapter's A and B per projection, stacked over adapters (zero-padded to the
        largest rank; a projection an adapter does not target gets zeros)."""
        loaded = []
        for d in dirs:
            peft = json.loads((d / "adapter_config.json").read_text())
            s = lora_scaling(peft)
            _, t = e2e_model.read_safetensors(d / "adapter_model.safetensors")
            loaded.append((peft["r"], s, t))
        rank = max(r for r, _, _ in loaded)
        self.n_adapters = len(loaded)
        for i, layer in enumerate(self.layers):
            for key, group in PROJ_GROUPS.items():
                lin = layer[key]
                k_in = (lin.w_codes if lin.quantize else lin.w).shape[1]
                a_s, b_s = [], []
                for name, n_out in zip(group, lin.widths):
                    a = torch.zeros(len(loaded), rank, k_in, dtype=torch.float32)
                    b = torch.zeros(len(loaded), n_out, rank, dtype=torch.float32)
                    for j, (r, s, t) in enumerate(loaded):
                        pre = f"base_model.model.model.layers.{i}.{name}."
                        if pre + "lora_A.weight" in t:
                            a[j, :r] = t[pre + "lora_A.weight"].to(torch.float32)
                            b[j, :, :r] = t[pre + "lora_B.weight"].to(torch.float32) * s
                    a_s.append(a.to(self.device))
                    b_s.append(b.to(self.device))
                lin.lora_a, lin.lora_b = a_s, b_s

    # ------------------------------------------------------------------------- forward

    @torch.no_grad()
    def logits(self, seqs: list[list[int]], adapter: list[int | None] | None = None) -> list[torch.Tensor]:
        """fp32 logits [len(seq), vocab] of every position of every sequence (each sequence on
        its own: positions from 0, attention within the sequence; the linear layers see all
        tokens at once, as in vLLM's flattened batch)."""
        adapter = adapter or [None] * len(seqs)
        if any(a is not None and not 0 <= a < self.n_adapters for a in adapter):
            raise ValueError(f"adapter indices {adapter} outside the {self.n_adapters} loaded adapters")
        out = []
        start = 0
        while start < len(seqs):  # chunks of whole sequences
            end, n = start, 0
            while end < len(seqs) and (end == start or n + len(seqs[end]) <= MAX_TOKENS_PER_CHUNK):
                n += len(seqs[end])
                end += 1
            out += self._forward(seqs[start:end], adapter[start:end])
            start = end
        return out

    def _forward(self, seqs, adapter) -> list[torch.Tensor]:
        dev = self.device
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        token_lora = torch.tensor([-1 if a is None else a for a, n in zip(adapter, lens) for _ in range(n)],
                                  dtype=torch.long, device=dev)
        if not bool((token_lora >= 0).any()):
            token_lora = None
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        h = self.embed[ids].to(torch.float32)
        hd, nq, nkv = self.head_dim, self.heads, self.kv_heads
        for layer in self.layers:
            x = rms_norm(h, layer["input_layernorm"], self.eps)
            qkv = layer["qkv"](x, token_lora)
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q = apply_rope(rms_norm(q.reshape(-1, nq, hd), layer["q_norm"], self.eps), cos, sin)
            k = apply_rope(rms_norm(k.reshape(-1, nkv, hd), layer["k_norm"], self.eps), cos, sin)
            v = v.reshape(-1, nkv, hd)
            attn = torch.cat([self._attention(qs, ks, vs) for qs, ks, vs in
                              zip(q.split(lens), k.split(lens), v.split(lens))])
            h = h + layer["o"](attn.reshape(-1, nq * hd), token_lora)
            x = rms_norm(h, layer["post_attention_layernorm"], self.eps)
            gate, up = layer["gate_up"](x, token_lora).chunk(2, dim=-1)
            h = h + layer["down"](torch.nn.functional.silu(gate) * up, token_lora)
        h = rms_norm(h, self.norm, self.eps)
        return list((h @ self.lm_head.t()).split(lens))

    def _attention(self, q, k, v) -> torch.Tensor:
        """Causal GQA attention of one sequence: q [T, H, D], k / v [T, Hkv, D] -> [T, H, D]."""
        g = self.heads // self.kv_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) * self.head_dim ** -0.5
        T = q.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        p = s.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", p, v)

    def score(self, seqs: list[list[int]], adapter: list[int | None] | None = None) -> dict:
        """Teacher-forced, as ``tools/e2e_vllm.py``'s ``Ctx.score``: per sequence, for positions
        i = 1 .. L-1, the logprob of seq[i] and the top-1 token, from the logits at i-1."""
        lp, top1 = [], []
        for seq, logits in zip(seqs, self.logits(seqs, adapter)):
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nxt = torch.tensor(seq[1:], dtype=torch.long, device=logp.device)
            lp.append(logp.gather(1, nxt[:, None])[:, 0].double().cpu().tolist())
            top1.append(logits[:-1].argmax(-1).cpu().tolist())
        return {"lp": lp, "top1": top1}


# fp32 means fp32: no TF32 in the reference's matmuls (torch's default, made explicit)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_request(model, adapters, request: dict, device: str = "auto", quantize: bool = True,
                bf16_inputs: bool = False) -> dict:
    """Score every case of ``request`` (the format in the module doc) with one loaded reference."""
    t0 = time.time()
    device = pick_device(device)
    ref = Reference(model, adapters, quantize=quantize, device=device, bf16_inputs=bf16_inputs)
    t_load = time.time() - t0
    cases = {}
    for name, case in request["cases"].items():
        r = ref.score(case["seqs"], case.get("adapter"))
        r["seqs_sha"] = seqs_sha(case["seqs"])
        cases[name] = r
    return {"cases": cases, "quantize": quantize, "bf16_inputs": bf16_inputs, "device": device,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "load_s": t_load, "seconds": time.time() - t0, "torch": str(torch.__version__)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, action="append", default=[])
    ap.add_argument("--request", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-quantize", action="store_true", help="bf16 weights in fp32, no FP8 (the model as HF runs it)")
    ap.add_argument("--bf16-inputs", action="store_true",
                    help="round each linear layer's input to bf16 first (FP8 codes and LoRA from the bf16 tensor)")
    ap.add_argument("--also-unquantized", action="store_true",
                    help="score the cases a second time without FP8 (result key 'unquantized')")
    ap.add_argument("--also-bf16-inputs", action="store_true",
                    help="score the cases again with --bf16-inputs (result key 'with_bf16_inputs')")
    args = ap.parse_args(argv)
    request = json.loads(args.request.read_text())
    def save(res):  # after each variant: a caller that stops this process keeps what it finished
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(args.out)

    res = run_request(args.model, args.adapter, request, args.device, quantize=not args.no_quantize,
                      bf16_inputs=args.bf16_inputs)
    save(res)
    print(f"reference: {len(res['cases'])} cases on {res['device']} in {res['seconds']:.1f} s", flush=True)
    for flag, key, kw in ((args.also_bf16_inputs and not args.bf16_inputs, "with_bf16_inputs",
                           dict(quantize=not args.no_quantize, bf16_inputs=True)),
                          (args.also_unquantized and not args.no_quantize, "unquantized", dict(quantize=False))):
        if flag:
            if res["device"].startswith("cuda"):
                torch.cuda.empty_cache()
            res[key] = run_request(args.model, args.adapter, request, args.device, **kw)
            save(res)
            print(f"reference ({key}): {res[key]['seconds']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
