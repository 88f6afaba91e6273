"""Is a random e2e checkpoint fit for a greedy-identity test? A CPU simulation of two bf16 FP8
engines that differ only in rounding (engine B perturbs every GEMM's fp32 accumulator by a
relative --noise before its bf16 output: 2^-20 is a different accumulation order, the default
2^-10 the one-ulp differences two LoRA computations leave), on a narrow model with the depth and
vocabulary of the real one and tools/e2e_model.py's stable init (gains per unit-rms input).

    python tools/e2e_margin.py [--out-gain G] [--lora-gain L] [--noise E] [--prompts 32] [--hidden 512]

Teacher-forced on random sequences (64 prompt tokens + --gen scored positions), it prints the
per-step top-1 flip rates between the engines (without and with an adapter) and between no
adapter and an adapter, and the greedy-identity counts they imply for --gen-token continuations
((1 - p)^gen per prompt). A checkpoint is fit when the engines agree on (almost) every prompt
while an adapter changes most of them.

Why the width can be small: what reaches the logits is set by how FP8 code flips of each layer's
input (a flip moves one element by an FP8 step) grow through the depth relative to the residual;
the gains are per unit-rms input, so a GEMM's relative error does not depend on its width to
first order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from epilora_cute import reference as R  # noqa: E402
from tools import e2e_model  # noqa: E402

BF16 = torch.bfloat16


def bf(x):
    return x.to(BF16).to(torch.float32)


class Model:
    """The narrow Qwen3-like model, as a bf16 engine runs it: bf16 residual and activations,
    FP8 per-token activations and per-tensor weights in every projection (vLLM's codes), causal
    GQA attention with q/k norms and RoPE."""

    def __init__(self, a):
        g = torch.Generator().manual_seed(a.seed)
        h, i, hd, nq, nkv, v = a.hidden, a.inter, a.head_dim, a.heads, a.kv_heads, a.vocab
        self.a = a

        def w(shape, std):
            return bf(torch.empty(shape).normal_(0, std, generator=g))

        # gains per unit-rms input (width-free): input projections 1, output projections a.out_gain,
        # an adapter's update a.lora_gain x its projection's; embeddings rms 1, logits std 1
        self.embed = w((v, h), 1.0)
        self.lm_head = w((v, h), h ** -0.5)
        self.layers = []
        for _ in range(a.layers):
            shapes = {"qkv": ((nq + 2 * nkv) * hd, h), "o": (h, nq * hd), "gate_up": (2 * i, h), "down": (h, i)}
            gain = {k: a.out_gain if k in ("o", "down") else 1.0 for k in shapes}
            lay = {k: w(s, gain[k] * s[1] ** -0.5) for k, s in shapes.items()}
            q = {k: R.quantize_fp8_per_tensor(t.to(BF16)) for k, t in lay.items()}
            lora = [{k: (w((a.rank, s[1]), s[1] ** -0.5), w((s[0], a.rank), a.lora_gain * gain[k] * a.rank ** -0.5))
                     for k, s in shapes.items()} for _ad in range(a.adapters)]
            self.layers.append((q, lora))

    def linear(self, x, q, lora, noise, gen):
        """One projection: the FP8 GEMM's fp32 result times (1 + noise * N(0, 1)) (engine B's
        rounding differences), rounded to bf16; the LoRA update added and rounded again."""
        xq, sx = R.quantize_fp8_per_token(x.to(BF16))
        y = R.fp8_scaled_mm(xq, sx, *q)
        if noise:
            y = y * (1 + noise * torch.randn(y.shape, generator=gen))
        y = bf(y)
        if lora is not None:
            A, B = lora
            y = bf(y + bf(x @ A.t()) @ B.t())
        return y

    @torch.no_grad()
    def logits(self, seqs, adapter, noise=0.0, seed=0, all_positions=False):
        """fp32 logits of the last position of each sequence (every position with all_positions)."""
        a = self.a
        gen = torch.Generator().manual_seed(seed)
        hd, nq, nkv = a.head_dim, a.heads, a.kv_heads
        T = len(seqs[0])
        ids = torch.tensor(seqs)
        B = ids.shape[0]
        pos = torch.arange(T)
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd))
        f = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()

        def rope(x):
            r = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
            return x * cos[None, :, None] + r * sin[None, :, None]

        def norm(x):
            return bf(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

        h = self.embed[ids]  # [B, T, H]
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        for q, lora in self.layers:
            lo = (lambda k: None) if adapter is None else (lambda k: (lora[adapter][k][0], lora[adapter][k][1]))
            x = norm(h).reshape(B * T, -1)
            qkv = self.linear(x, q["qkv"], lo("qkv"), noise, gen).reshape(B, T, -1)
            qq, kk, vv = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
            qq = bf(rope(norm(qq.reshape(B, T, nq, hd))))
            kk = bf(rope(norm(kk.reshape(B, T, nkv, hd))))
            vv = vv.reshape(B, T, nkv, hd)
            rep = nq // nkv
            kk, vv = kk.repeat_interleave(rep, 2), vv.repeat_interleave(rep, 2)
            s = torch.einsum("bthd,bshd->bhts", qq, kk) * hd ** -0.5
            p = s.masked_fill(mask, float("-inf")).softmax(-1)
            att = bf(torch.einsum("bhts,bshd->bthd", p, vv)).reshape(B * T, -1)
            h = bf(h + self.linear(att, q["o"], lo("o"), noise, gen).reshape(B, T, -1))
            x = norm(h).reshape(B * T, -1)
            gu = self.linear(x, q["gate_up"], lo("gate_up"), noise, gen)
            gt, up = gu.chunk(2, -1)
            m = bf(torch.nn.functional.silu(gt) * up)
            h = bf(h + self.linear(m, q["down"], lo("down"), noise, gen).reshape(B, T, -1))
        hn = norm(h)
        if not all_positions:
            hn = hn[:, -1]
        return hn @ self.lm_head.t()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--out-gain", type=float, default=e2e_model.OUT_GAIN, help="o/down output rms per unit-rms input")
    ap.add_argument("--lora-gain", type=float, default=e2e_model.LORA_GAIN, help="an adapter's update rms / its projection's")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=2)
    ap.add_argument("--noise", type=float, default=2.0 ** -10, help="relative accumulator perturbation of engine B")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    m = Model(a)
    g = torch.Generator().manual_seed(a.seed + 7)
    # random sequences of prompt + continuation; the continuation positions are scored teacher-forced
    seqs = torch.randint(0, a.vocab, (a.prompts, 64 + a.gen), generator=g).tolist()
    sl = slice(63, 63 + a.gen)
    la = m.logits(seqs, None, 0.0, 5, all_positions=True)[:, sl]
    lb = m.logits(seqs, None, a.noise, 6, all_positions=True)[:, sl]
    ll = m.logits(seqs, 0, 0.0, 5, all_positions=True)[:, sl]
    llb = m.logits(seqs, 0, a.noise, 6, all_positions=True)[:, sl]
    top2 = la.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    p_noise = (la.argmax(-1) != lb.argmax(-1)).float().mean().item()
    p_noise_l = (ll.argmax(-1) != llb.argmax(-1)).float().mean().item()
    p_lora = (la.argmax(-1) != ll.argmax(-1)).float().mean().item()
    keep = lambda p: (1 - p) ** a.gen  # a greedy continuation of gen tokens stays identical
    print(f"config: out gain {a.out_gain} lora gain {a.lora_gain} "
          f"hidden {a.hidden} layers {a.layers} noise {a.noise:.2e}")
    print(f"  top-1 flips per step: noise {p_noise:.4f} (with adapter {p_noise_l:.4f}), adapter {p_lora:.4f}")
    print(f"  -> greedy identical expected: no adapter {a.prompts * keep(p_noise):.1f}/{a.prompts}, "
          f"with adapter {a.prompts * keep(p_noise_l):.1f}/{a.prompts}; "
          f"adapter changes {a.prompts * (1 - keep(p_lora)):.1f}/{a.prompts}")
    print(f"  logit std {la.std(-1).mean():.3f}, median top-1 margin {margin.median():.4f}, "
          f"rms logit change: noise {(la - lb).pow(2).mean().sqrt():.5f}, adapter {(la - ll).pow(2).mean().sqrt():.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
