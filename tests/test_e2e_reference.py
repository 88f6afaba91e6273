"""tools/e2e_reference.py on the CPU at tiny sizes: the unquantized forward against HF transformers'
Qwen3ForCausalLM (in this interpreter when transformers is importable, else in .venv-vllm; skipped
when neither has it), the LoRA math against weights with the adapters merged in, the FP8 weights
as vLLM's online per-tensor quantization makes them (one scale per merged layer), and the
teacher-forced scoring's structure (tools/e2e_vllm.py's Ctx.score)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epilora_cute import reference as R  # noqa: E402
from tools import e2e_model as m  # noqa: E402
from tools import e2e_reference as er  # noqa: E402

_VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SEQS = [[5, 17, 900, 3, 44, 1000, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3], [1023, 0, 512, 77, 78]]


def write_model(directory: Path, seed: int = 0) -> Path:
    """e2e_model's tiny checkpoint, but with random norm weights (1 + N(0, 0.1^2)) so that a
    norm applied to the wrong tensor or with the wrong weight shows."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = m.model_config("tiny")
    (directory / "config.json").write_text(json.dumps(cfg))

    def make(name, shape, std):
        if std is None:
            g = torch.Generator().manual_seed(m.tensor_seed(seed, name))
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        return m.make_tensor(seed, name, shape, std)

    # dense: every layer matters as much as the embeddings, so a wrong layer op shows
    m.write_safetensors(directory / "model.safetensors", m.checkpoint_entries(cfg, "dense"), make, threads=1)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("ref") / "model")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    out = [m.write_adapter(d / f"a{i}", "tiny", rank=8, seed=100 + i, threads=1, init="dense") for i in range(2)]
    peft = json.loads((out[1] / "adapter_config.json").read_text())
    peft["lora_alpha"] = 2 * peft["r"]  # scaling 2 on the second adapter (e2e_model writes alpha = r)
    (out[1] / "adapter_config.json").write_text(json.dumps(peft))
    return out


# ----------------------------------------------------------------------------- against HF transformers

_HF_SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from transformers import Qwen3ForCausalLM
from tools import e2e_reference as er
model_dir, seqs = sys.argv[2], json.loads(sys.argv[3])
hf = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
ref = er.Reference(model_dir, quantize=False)
out = []
with torch.no_grad():
    for s, mine in zip(seqs, ref.logits(seqs)):
        theirs = hf(torch.tensor([s])).logits[0].float()
        out.append([(theirs - mine).abs().max().item(), theirs.abs().max().item()])
print("HFCHECK " + json.dumps(out))
'''


def _hf_python() -> str | None:
    if importlib.util.find_spec("transformers") is not None:
        return sys.executable
    return str(_VLLM_PY) if _VLLM_PY.exists() else None


@pytest.mark.skipif(_hf_python() is None, reason="transformers not installed (here or in .venv-vllm)")
def test_unquantized_forward_matches_hf_transformers(model_dir):
    r = subprocess.run([_hf_python(), "-c", _HF_SCRIPT, str(ROOT), str(model_dir), json.dumps(SEQS)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1"))
    lines = [x for x in r.stdout.splitlines() if x.startswith("HFCHECK ")]
    if not lines and "No module named 'transformers'" in r.stderr:
        pytest.skip("transformers not importable")
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    for diff, scale in json.loads(lines[-1][len("HFCHECK "):]):
        assert scale > 0.3 and diff < 1e-4, (diff, scale)


# ----------------------------------------------------------------------------- LoRA

def test_lora_matches_merged_weights(model_dir, adapters):
    """Unquantized, y = x W^T + (x A^T)(s B)^T = x (W + s B A)^T: the adapter's forward equals
    the forward of a model whose weights have the adapters merged in (in fp32)."""
    torch.manual_seed(0)
    with_lora = er.Reference(model_dir, adapters, quantize=False)
    merged = er.Reference(model_dir, quantize=False)
    for j, scale in ((0, 1.0), (1, 2.0)):
        _, t = m.read_safetensors(Path(adapters[j]) / "adapter_model.safetensors")
        for i, layer in enumerate(merged.layers):
            for key, group in er.PROJ_GROUPS.items():
                delta = torch.cat([scale * t[f"base_model.model.model.layers.{i}.{n}.lora_B.weight"].float()
                                   @ t[f"base_model.model.model.layers.{i}.{n}.lora_A.weight"].float() for n in group])
                layer[key].w = with_lora.layers[i][key].w + delta
        seqs = SEQS[:2]
        got = with_lora.logits(seqs, [j, j])
        want = merged.logits(seqs)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=2e-5, rtol=0), (a - b).abs().max()
    base = er.Reference(model_dir, quantize=False).logits(SEQS[:1])[0]
    # the adapter changes the output (by ~10 % of a layer's, e2e_model), and mixed batches route per sequence
    assert (with_lora.logits(SEQS[:1], [0])[0] - base).abs().max() > 1e-2
    mixed = with_lora.logits(SEQS, [1, None, 0])
    alone = [with_lora.logits([s], [a])[0] for s, a in zip(SEQS, [1, None, 0])]
    for a, b in zip(mixed, alone):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.allclose(mixed[1], er.Reference(model_dir, quantize=False).logits([SEQS[1]])[0], atol=1e-5, rtol=0)


def test_lora_scaling_follows_peft_config():
    assert er.lora_scaling({"r": 64, "lora_alpha": 64}) == 1.0
    assert er.lora_scaling({"r": 16, "lora_alpha": 32}) == 2.0
    assert er.lora_scaling({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0
    with pytest.raises(NotImplementedError):
        er.lora_scaling({"r": 16, "lora_alpha": 16, "use_dora": True})


# ----------------------------------------------------------------------------- FP8 as vLLM serves it

def test_fp8_weights_one_scale_per_merged_layer(model_dir):
    ref = er.Reference(model_dir, quantize=True)
    _, t = m.read_safetensors(model_dir / "model.safetensors")
    p = "model.layers.1."
    for key, group in er.PROJ_GROUPS.items():
        w = torch.cat([t[p + n + ".weight"] for n in group])
        codes, scale = R.quantize_fp8_per_tensor(w)
        lin = ref.layers[1][key]
        assert lin.w_scale.numel() == 1 and torch.equal(lin.w_scale, scale)
        assert torch.equal(lin.w_codes.view(torch.uint8), codes.view(torch.uint8))
        assert lin.widths == [t[p + n + ".weight"].shape[0] for n in group]
    # the merged scale is the largest of the parts' (q, k and v share k's or v's or q's amax)
    qkv = [R.quantize_fp8_per_tensor(t[p + n + ".weight"])[1] for n in er.PROJ_GROUPS["qkv"]]
    assert torch.equal(ref.layers[1]["qkv"].w_scale, torch.stack(qkv).max().reshape(1))
    # activations quantized per token: the layer computes fp8_scaled_mm of the per-token codes
    x = torch.randn(5, t[p + "self_attn.q_proj.weight"].shape[1])
    lin = ref.layers[1]["qkv"]
    xq, sx = R.quantize_fp8_per_token(x)
    assert torch.equal(lin(x, None), R.fp8_scaled_mm(xq, sx, lin.w_codes, lin.w_scale))
    # FP8 moves the logits a little, not a lot
    a = ref.logits(SEQS[:1])[0]
    b = er.Reference(model_dir, quantize=False).logits(SEQS[:1])[0]
    assert 1e-4 < (a - b).abs().max() < 0.2


# ----------------------------------------------------------------------------- teacher-forced scoring

def test_score_structure_like_ctx_score(model_dir, adapters):
    ref = er.Reference(model_dir, adapters, quantize=True)
    s = ref.score(SEQS, [None, 0, 1])
    assert set(s) == {"lp", "top1"}
    assert [len(x) for x in s["lp"]] == [len(x) - 1 for x in SEQS] == [len(x) for x in s["top1"]]
    for seq, lp, top1, logits in zip(SEQS, s["lp"], s["top1"], ref.logits(SEQS, [None, 0, 1])):
        logp = torch.log_softmax(logits.double(), -1)
        for i in range(1, len(seq)):  # position i scored from the logits at i - 1
            assert lp[i - 1] == pytest.approx(logp[i - 1, seq[i]].item(), abs=1e-5)
            assert top1[i - 1] == int(logits[i - 1].argmax())
        assert all(isinstance(x, float) and x <= 0 for x in lp) and all(isinstance(x, int) for x in top1)


def test_cli_request(model_dir, adapters, tmp_path):
    req = {"cases": {"none": {"seqs": SEQS[:2], "adapter": [None, None]},
                     "adapters": {"seqs": SEQS[:2], "adapter": [0, 1]}}}
    (tmp_path / "req.json").write_text(json.dumps(req))
    args = ["--model", str(model_dir), "--request", str(tmp_path / "req.json"), "--out", str(tmp_path / "r.json"),
            "--device", "cpu", "--also-unquantized", "--also-bf16-inputs"] + [x for a in adapters for x in ("--adapter", str(a))]
    assert er.main(args) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["quantize"] is True and r["device"] == "cpu" and r["unquantized"]["quantize"] is False
    assert r["with_bf16_inputs"]["bf16_inputs"] is True and r["with_bf16_inputs"]["quantize"] is True
    assert r["bf16_inputs"] is False and r["unquantized"]["bf16_inputs"] is False
    assert r["cases"]["none"]["seqs_sha"] == er.seqs_sha(SEQS[:2])
    direct = er.Reference(model_dir, adapters, quantize=True).score(SEQS[:2], [0, 1])
    for got, want in zip(r["cases"]["adapters"]["lp"], direct["lp"]):
        assert got == pytest.approx(want, abs=1e-6)
    assert r["cases"]["adapters"]["lp"] != r["cases"]["none"]["lp"]


def test_bf16_inputs_variant(model_dir, adapters):
    """bf16_inputs: each linear layer quantizes (and runs LoRA on) its input rounded to bf16."""
    exact = er.Reference(model_dir, adapters, quantize=True)
    b16 = er.Reference(model_dir, adapters, quantize=True, bf16_inputs=True)
    x = torch.randn(4, exact.layers[0]["qkv"].w_codes.shape[1])
    ids = torch.tensor([0, -1, 1, 0])
    want = exact.layers[0]["qkv"](x.to(torch.bfloat16).float(), ids)
    assert torch.equal(b16.layers[0]["qkv"](x, ids), want)
    assert not torch.equal(exact.layers[0]["qkv"](x, ids), want)
    a, b = exact.logits(SEQS[:1], [1])[0], b16.logits(SEQS[:1], [1])[0]
    assert 0 < (a - b).abs().max() < 0.2
