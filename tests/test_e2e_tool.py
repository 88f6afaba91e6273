"""tools/e2e_vllm.py, e2e_model.py and e2e_report.py on the CPU, without vLLM: the checkpoint
and adapter writers at tiny sizes, the entry-point shim, the workers' environment and logging,
the comparison and the report, and the whole pipeline with a stand-in engine (tests/e2e_fake.py).
One test loads the files with vLLM 0.26.0's own Qwen3 model and LoRA loader in .venv-vllm
(tools/install_vllm_cpu.sh); it skips when that venv is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import e2e_fake  # noqa: E402
from tools import e2e_model as m  # noqa: E402
from tools import e2e_report as rpt  # noqa: E402
from tools import e2e_vllm as e  # noqa: E402

TINY = m.SIZES["tiny"]


def _hf_names(layers: int) -> set[str]:
    """The tensor names of a Hugging Face Qwen3ForCausalLM checkpoint, written out by hand."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(layers):
        names |= {f"model.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


# ----------------------------------------------------------------------------- checkpoint and adapters

def test_checkpoint_layout(tmp_path):
    d = m.write_model(tmp_path / "model", "tiny", seed=3)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"
    for k in ("rms_norm_eps", "rope_theta", "max_position_embeddings", "head_dim", "num_key_value_heads"):
        assert k in cfg
    assert m.model_config("qwen3-8b")["hidden_size"] == 4096 and m.model_config("qwen3-8b")["num_hidden_layers"] == 36
    header, t = m.read_safetensors(d / "model.safetensors")
    assert set(t) == _hf_names(2)
    h, i, hd = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    q, kv = TINY["num_attention_heads"] * hd, TINY["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
              "self_attn.q_norm": (hd,), "input_layernorm": (h,)}
    for name, shape in shapes.items():
        assert tuple(t[f"model.layers.1.{name}.weight"].shape) == shape, name
    assert tuple(t["lm_head.weight"].shape) == tuple(t["model.embed_tokens.weight"].shape) == (TINY["vocab_size"], h)
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    assert torch.equal(t["model.norm.weight"], torch.ones(h, dtype=torch.bfloat16))
    # the stable init: embeddings rms 1, logits of std 1, o/down OUT_GAIN per unit input
    assert abs(t["model.embed_tokens.weight"].float().std().item() - 1) < 0.02
    assert abs(t["lm_head.weight"].float().std().item() * h ** 0.5 - 1) < 0.02
    assert abs(t["model.layers.1.mlp.down_proj.weight"].float().std().item() * i ** 0.5 / m.OUT_GAIN - 1) < 0.05
    assert abs(t["model.layers.1.mlp.gate_proj.weight"].float().std().item() * h ** 0.5 - 1) < 0.05
    # safetensors layout: 8-byte aligned header, contiguous data to the end of the file
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    n = int.from_bytes((d / "model.safetensors").read_bytes()[:8], "little")
    assert n % 8 == 0 and (d / "model.safetensors").stat().st_size == 8 + n + ends[-1][1]


def test_checkpoint_deterministic_prefix_and_cached(tmp_path):
    a = m.write_model(tmp_path / "a", "tiny", seed=1, threads=1)
    b = m.write_model(tmp_path / "b", "tiny", seed=1, threads=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = m.write_model(tmp_path / "c", "tiny", layers=3, seed=1)
    _, ta = m.read_safetensors(a / "model.safetensors")
    _, tc = m.read_safetensors(c / "model.safetensors")
    assert all(torch.equal(v, tc[k]) for k, v in ta.items())  # layers 0-1 of 3 = the 2-layer model
    _, td = m.read_safetensors(m.write_model(tmp_path / "d", "tiny", seed=2) / "model.safetensors")
    assert not torch.equal(td["lm_head.weight"], ta["lm_head.weight"])
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    m.write_model(a, "tiny", seed=1)  # same stamp: kept
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    m.write_model(a, "tiny", seed=5)  # different: rewritten
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_adapter_layout(tmp_path):
    r = 16
    d = m.write_adapter(tmp_path / "a", "tiny", rank=r, seed=7)
    peft = json.loads((d / "adapter_config.json").read_text())
    assert peft["peft_type"] == "LORA" and peft["r"] == r and peft["lora_alpha"] == r and peft["bias"] == "none"
    assert sorted(peft["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"])
    _, t = m.read_safetensors(d / "adapter_model.safetensors")
    assert len(t) == 2 * 7 * TINY["num_hidden_layers"]
    h, i, hd = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    kv = TINY["num_key_value_heads"] * hd
    p = "base_model.model.model.layers.1."
    assert tuple(t[p + "self_attn.k_proj.lora_A.weight"].shape) == (r, h)
    assert tuple(t[p + "self_attn.k_proj.lora_B.weight"].shape) == (kv, r)
    assert tuple(t[p + "mlp.down_proj.lora_A.weight"].shape) == (r, i)
    assert tuple(t[p + "mlp.down_proj.lora_B.weight"].shape) == (h, r)
    a = torch.cat([v.float().flatten() for k, v in t.items() if "gate_proj.lora_A" in k])
    b_up = torch.cat([v.float().flatten() for k, v in t.items() if "up_proj.lora_B" in k])
    b_down = torch.cat([v.float().flatten() for k, v in t.items() if "down_proj.lora_B" in k])
    assert abs(a.std().item() * h ** 0.5 - 1) < 0.1
    assert abs(b_up.std().item() * r ** 0.5 / m.LORA_GAIN - 1) < 0.05  # update = LORA_GAIN x the base output
    assert abs(b_down.std().item() * r ** 0.5 / (m.LORA_GAIN * m.OUT_GAIN) - 1) < 0.05
    _, t2 = m.read_safetensors(m.write_adapter(tmp_path / "b", "tiny", rank=r, seed=8) / "adapter_model.safetensors")
    assert not torch.equal(t2[p + "mlp.up_proj.lora_B.weight"], t[p + "mlp.up_proj.lora_B.weight"])


def test_dense_init_and_init_in_the_stamp(tmp_path):
    d = m.write_model(tmp_path / "m", "tiny", seed=1, threads=1, init="dense")
    _, t = m.read_safetensors(d / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.self_attn.q_proj.weight"):
        assert abs(t[name].float().std().item() - m.DENSE_STD) < 0.002, name
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    m.write_model(d, "tiny", seed=1, init="stable")  # another init: rewritten, not reused
    assert (d / "model.safetensors").stat().st_mtime_ns != mtime
    _, t2 = m.read_safetensors(d / "model.safetensors")
    assert abs(t2["model.embed_tokens.weight"].float().std().item() - 1) < 0.02
    a = m.write_adapter(tmp_path / "a", "tiny", rank=8, seed=3, threads=1, init="dense")
    _, ta = m.read_safetensors(a / "adapter_model.safetensors")
    b = torch.cat([v.float().flatten() for k, v in ta.items() if "lora_B" in k])
    assert abs(b.std().item() - m.DENSE_STD) < 0.002
    with pytest.raises(ValueError, match="init"):
        m.checkpoint_entries(m.model_config("tiny"), "xavier")


# ----------------------------------------------------------------------------- plugin shim and environment

_EP_CODE = ("import importlib.metadata as md; "
            "print(json.dumps([[x.name, x.value, x.dist.version] for x in md.entry_points(group='vllm.general_plugins')]))")


def test_plugin_shim_visible_in_subprocess(tmp_path):
    shim = m.make_plugin_shim(tmp_path / "shim")
    # Only the shim on the path (-S: no site-packages, where this venv's editable install lives).
    r = subprocess.run([sys.executable, "-S", "-c", "import json; " + _EP_CODE], cwd=tmp_path, capture_output=True,
                       text=True, env={"PYTHONPATH": str(shim)}, check=True)
    assert ["epilora_cute", "vllm_adapter.plugin:register", "0.0.0"] in json.loads(r.stdout)
    # As the workers get it, through a spawned grandchild (how vLLM starts its engine core): the
    # shim comes first on the path, and the entry point loads the repository's register().
    env = e.engine_env("ours", {"PATH": os.environ.get("PATH", "")}, shim, tmp_path / "c", tmp_path / "l.json", {})
    code = textwrap.dedent("""
        import json, multiprocessing as mp
        def probe(q):
            import importlib.metadata as md
            ep = [x for x in md.entry_points(group="vllm.general_plugins") if x.name == "epilora_cute"][0]
            fn = ep.load()
            q.put([ep.dist.version, fn.__module__, fn.__name__, __import__(fn.__module__).__file__])
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=probe, args=(q,))
            p.start()
            print(json.dumps(q.get(timeout=120)))
            p.join()
    """)
    (tmp_path / "probe.py").write_text(code)
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py")], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    version, mod, name, path = json.loads(r.stdout.strip().splitlines()[-1])
    assert (version, mod, name) == ("0.0.0", "vllm_adapter.plugin", "register")
    assert Path(path).resolve().is_relative_to(ROOT)


def test_engine_env(tmp_path):
    base = {"PYTHONPATH": "/x", "EPILORA_DISABLE": "0", "EPILORA_CACHE_DIR": "/c", "HF_HUB_OFFLINE": "0"}
    args = (tmp_path / "shim", tmp_path / "cache", tmp_path / "log.json")
    stock = e.engine_env("stock", base, args[0], args[1] / "s", args[2], {"EPILORA_FORCE_TRITON": "1"})
    ours = e.engine_env("ours", base, args[0], args[1] / "o", args[2], {"EPILORA_FORCE_TRITON": "1"})
    assert stock["EPILORA_DISABLE"] == "1" and "EPILORA_FORCE_TRITON" not in stock
    assert "EPILORA_DISABLE" not in ours and ours["EPILORA_FORCE_TRITON"] == "1"
    for env in (stock, ours):
        assert env["PYTHONPATH"].split(os.pathsep) == [str(args[0]), str(ROOT), "/x"]
        assert env["EPILORA_CACHE_DIR"] == "/c" and env["HF_HUB_OFFLINE"] == "0"  # the caller's wins
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["VLLM_LOGGING_CONFIG_PATH"] == str(args[2])
    assert stock["VLLM_CACHE_ROOT"] != ours["VLLM_CACHE_ROOT"]  # no shared AOT compile cache
    assert base["EPILORA_DISABLE"] == "0"  # not modified


def test_stock_env_reaches_the_stock_engine_only(tmp_path):
    args = (tmp_path / "shim", tmp_path / "cache", tmp_path / "log.json")
    stock = e.engine_env("stock", {}, args[0], args[1] / "s", args[2], {"A": "1"}, {"B": "2"})
    ours = e.engine_env("ours", {}, args[0], args[1] / "o", args[2], {"A": "1"}, {"B": "2"})
    assert stock["B"] == "2" and "A" not in stock
    assert ours["A"] == "1" and "B" not in ours
    # the stock engine's own switch wins over a --stock-env of the same name
    assert e.engine_env("stock", {}, *args, {}, {"EPILORA_DISABLE": "0"})["EPILORA_DISABLE"] == "1"


def _vllm_lookup(data, max_loras, num_slices, m, k, n):
    """vllm/lora/ops/triton_ops/utils.py get_lora_op_configs' walk (0.26.0): the nearest key at
    every level but num_slices."""
    def near(d, v):
        return d.get(str(v)) or d[min(d.keys(), key=lambda x: abs(int(x) - v))]
    return near(near(near(near(data, max_loras)[str(num_slices)], m), k), n)


def test_unsplit_shrink_configs_serve_every_call(tmp_path):
    paths = e.write_unsplit_shrink_configs(tmp_path / "cfg", ["NVIDIA H200", "Some GPU-X"])
    names = sorted(p.name for p in paths)
    assert "NVIDIA_H200_SHRINK.json" in names and "Some_GPU_X_SHRINK.json" in names
    assert "NVIDIA_H100_80GB_HBM3_SHRINK.json" in names
    data = json.loads((tmp_path / "cfg" / "NVIDIA_H200_SHRINK.json").read_text())
    for max_loras, slices, m, k, n in [(8, 1, 1, 4096, 64), (8, 3, 64, 4096, 64), (8, 2, 512, 4096, 64),
                                       (1, 1, 8192, 12288, 16), (32, 2, 3, 4096, 256)]:
        cfg = _vllm_lookup(data, max_loras, slices, m, k, n)
        assert cfg["split_k"] == 1 and cfg == e.UNSPLIT_SHRINK


def test_worker_probe_counts_lora_classes(monkeypatch):
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")

    def layer(name, active=None):
        mod = type(name, (torch.nn.Linear,), {})(4, 4)
        if active is not None:
            mod._epilora_active = active
        return mod

    model = torch.nn.ModuleDict({"qkv": layer("EpiLoRAQKVParallelLinearWithLoRA", True),
                                 "o": layer("EpiLoRARowParallelLinearWithLoRA", False),
                                 "gate_up": layer("MergedColumnParallelLinearWithLoRA"),
                                 "norm": layer("RMSNorm")})
    worker = type("FakeWorker", (m.WorkerProbe,), {"get_model": lambda self: model, "model_runner": object()})()
    r = worker.e2e_lora_layers()
    assert r["lora_classes"] == {"EpiLoRAQKVParallelLinearWithLoRA": 1, "EpiLoRARowParallelLinearWithLoRA": 1,
                                 "MergedColumnParallelLinearWithLoRA": 1}
    assert (r["epilora_layers"], r["epilora_active"]) == (2, 1)
    assert r["env"]["EPILORA_DECODE_PATH"] == "1" and r["gpu"] == "cpu" and r["model_runner"] == "builtins.object"
    assert r["kernel_path"] == "plugin not registered"  # this process never ran register()


def test_probe_reply_is_plain_json():
    """Everything collective_rpc returns crosses vLLM's msgspec encoder, which refuses str
    subclasses such as torch.__version__ (the first H200 run lost its stock engine to that)."""
    model = torch.nn.ModuleDict({"qkv": type("EpiLoRAQKVParallelLinearWithLoRA", (torch.nn.Linear,), {})(2, 2)})
    worker = type("FakeWorker", (m.WorkerProbe,), {"get_model": lambda self: model, "model_runner": object()})()
    r = worker.e2e_lora_layers()
    assert m.not_plain(r) == [] and e2e_fake._unsendable(r) is None
    assert type(r["torch"]) is str and r["torch"] == str(torch.__version__)
    assert e2e_fake._unsendable(worker._e2e_lora_layers()) is not None  # what it was before plain()
    assert m.plain({"v": torch.__version__, "t": (1, 2.5, None), "d": torch.device("cpu"), 3: {True}}) == \
        {"v": str(torch.__version__), "t": [1, 2.5, None], "d": "cpu", "3": [True]}
    assert m.not_plain({"a": [1, torch.__version__]}) == ["result['a'][1]: torch.torch_version.TorchVersion"]


def test_engine_kwargs_overrides_replace_defaults(tmp_path):
    kw = e.engine_kwargs(tmp_path, 0, {"max_model_len": 256, "enforce_eager": True})
    assert kw["max_model_len"] == 256 and kw["enforce_eager"] is True and kw["max_num_seqs"] == 64
    assert e.engine_kwargs(tmp_path, 0)["max_model_len"] == 1024


def test_engine_kwargs_ask_for_vllms_request_timestamps(tmp_path):
    assert e.engine_kwargs(tmp_path, 0)["disable_log_stats"] is False


def test_request_timing_from_vllms_request_stats():
    stats = SimpleNamespace(num_generation_tokens=129, scheduled_ts=10.0, first_token_ts=10.05,
                            last_token_ts=10.05 + 128 * 0.0036, first_token_latency=0.06)
    t = e.request_timing(SimpleNamespace(metrics=stats))
    assert t["decode_ms_per_token"] == pytest.approx(3.6) and t["prefill_ms"] == pytest.approx(50.0)
    assert t["ttft_ms"] == pytest.approx(60.0)
    assert e.request_timing(SimpleNamespace(metrics=None)) is None  # stats off: no timestamps
    assert e.request_timing(SimpleNamespace()) is None
    one = e.request_timing(SimpleNamespace(metrics=SimpleNamespace(num_generation_tokens=1, first_token_ts=5.0,
                                                                    last_token_ts=5.0, scheduled_ts=4.9)))
    assert one["decode_ms_per_token"] is None and one["prefill_ms"] == pytest.approx(100.0)


def test_parse_env_pairs():
    assert e.parse_env_pairs(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2"):
        with pytest.raises(ValueError):
            e.parse_env_pairs([bad])


def test_logging_config_shows_plugin_debug_only(tmp_path):
    cfg = tmp_path / "log.json"
    cfg.write_text(json.dumps(e.logging_config()))
    code = ("import json, logging, logging.config, sys; logging.config.dictConfig(json.load(open(sys.argv[1]))); "
            "logging.getLogger('vllm.epilora').debug('EpiLoRA: model.layers.0.mlp.down_proj -> "
            "EpiLoRARowParallelLinearWithLoRA (fused FP8 LoRA)'); "
            "logging.getLogger('vllm.worker').debug('hidden'); logging.getLogger('vllm.worker').info('shown'); "
            "logging.getLogger('epilora_cute.dispatch').info("
            "'dispatch NVIDIA H200|K=4096|N=4096|r=64|M<=1|A=<=5-8|graph -> decode (µs: decode 20.1, triton 23.0)'); "
            "logging.getLogger('epilora_cute.dispatch').debug('hidden too')")
    out = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, check=True).stdout
    assert "hidden" not in out and "shown" in out and "vllm.epilora" in out
    s = rpt.plugin_log_summary(out)
    assert s["taken_over"] == 1 and s["taken_over_classes"] == ["EpiLoRARowParallelLinearWithLoRA"]
    assert s["dispatch_decisions"] == {"NVIDIA H200|K=4096|N=4096|r=64|M<=1|A=<=5-8|graph": "decode"}
    assert s["dispatch_wins"] == {"graph": {"decode": 1}}


def test_plugin_log_summary():
    text = "\n".join([
        "INFO vllm.epilora: EpiLoRA plugin active: fused FP8 LoRA for 12 LoRA linear classes (vLLM 0.26.0 ...)",
        "DEBUG vllm.epilora: EpiLoRA: model.layers.0.self_attn.qkv_proj -> EpiLoRAQKVParallelLinearWithLoRA (fused FP8 LoRA)",
        "DEBUG vllm.epilora: EpiLoRA: model.layers.0.self_attn.qkv_proj -> EpiLoRAQKVParallelLinearWithLoRA (fused FP8 LoRA)",
        "DEBUG vllm.epilora: EpiLoRA: model.layers.0.mlp.down_proj -> EpiLoRARowParallelLinearWithLoRA (fused FP8 LoRA)",
        "INFO vllm.epilora: EpiLoRA: model.layers.0.mlp.gate_up_proj stays on vLLM's MergedColumnParallelLinearWithLoRA: "
        "block-scaled FP8 weights (block [128, 128])",
        "INFO vllm.epilora: EpiLoRA: model.layers.1.self_attn.o_proj computes with vLLM's kernels: rank 600 > 512",
        "INFO vllm.epilora: lm_head LoRA: EpiLoRALogitsProcessorWithLoRA (vLLM's LogitsProcessorWithLoRA; no lm_head "
        "delta while no resident adapter has lm_head weights)",
        "INFO vllm: Directly load AOT compilation from path /x"])
    s = rpt.plugin_log_summary(text)
    assert s["plugin_active"] and not s["plugin_disabled"] and s["aot_cache_loaded"]
    assert (s["taken_over"], s["stays_on_vllm"], s["computes_with_vllm"]) == (2, 1, 1)
    assert s["fallback_reasons"] == {"block-scaled FP8 weights (block [128, 128])": 1, "rank 600 > 512": 1}
    assert s["lm_head"].startswith("lm_head LoRA: EpiLoRALogitsProcessorWithLoRA (vLLM's")
    assert rpt.plugin_log_summary("EpiLoRA plugin disabled by EPILORA_DISABLE")["plugin_disabled"]
    assert rpt.plugin_log_summary("x lm_head LoRA stays on vLLM's Foo: why")["lm_head"] == "lm_head LoRA stays on vLLM's Foo: why"
    assert rpt.plugin_log_summary("")["lm_head"] is None


def test_startup_phases_from_an_engine_log():
    """run33's own engine log (docs/gpu_record/run33): the phases vLLM logs while it starts, and
    the report's line comparing them between the engines (Inductor's seconds exposed the slow
    start of run32 / run33)."""
    import gzip

    text = gzip.decompress((ROOT / "docs/gpu_record/run33/e2e_ours_9bf2768.log.gz").read_bytes()).decode()
    st = rpt.startup_summary(text)
    assert st == {"dynamo_s": 10.61, "inductor_s": 81.2, "torch_compile_s": 104.89, "profiling_run_s": 32.38,
                  "graph_capture_s": 13.0}
    assert rpt.plugin_log_summary(text)["startup"] == st
    rep = {"plugin_log": {"stock": {"startup": {"inductor_s": 20.76, "profiling_run_s": 4.92}},
                          "ours": {"startup": st}}}
    assert rpt._startup_note(rep) == "; Inductor stock 20.8 s, ours 81.2 s; profiling run stock 4.9 s, ours 32.4 s"
    assert rpt._startup_note({"plugin_log": {"ours": {"startup": st}}}) == ""


# ----------------------------------------------------------------------------- comparison and report

def test_compare_greedy():
    r = rpt.compare_greedy([[1, 2, 3], [1, 2, 3], [4, 5]], [[1, 2, 3], [1, 9, 3], [4, 5, 6]])
    assert r == {"identical": 1, "total": 3, "first_divergence": [None, 1, 2]}


def test_compare_logprobs():
    a = {"lp": [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], "top1": [[1, 2, 3], [4, 5, 6]]}
    b = {"lp": [[-1.01, -2.0, -3.1], [-1.0, -1.0, -1.0]], "top1": [[1, 2, 3], [4, 5, 7]]}
    r = rpt.compare_logprobs(a, b, prompt_len=3, gen_len=4)
    assert r["positions"] == 6 and r["max_abs"] == pytest.approx(0.1) and r["mean_abs"] == pytest.approx(0.11 / 6)
    assert r["gen_max_abs"] == pytest.approx(0.1) and r["gen_mean_abs"] == pytest.approx(0.05)  # positions j >= 2
    assert r["top1_agreement"] == pytest.approx(5 / 6) and r["expected_identical"] == pytest.approx(2 * (5 / 6) ** 4)
    assert r["within_tolerance"] == (0.1 <= rpt.TOL_MAX_NATS and 0.11 / 6 <= rpt.TOL_MEAN_NATS)
    far = {"lp": [[x - 0.5 for x in s] for s in a["lp"]], "top1": a["top1"]}
    assert not rpt.compare_logprobs(a, far, 3)["within_tolerance"]
    assert rpt.compare_logprobs({"lp": [], "top1": []}, {"lp": [], "top1": []}, 3) == {"positions": 0}


def test_stock_floor_row():
    cmp_ = {"logprobs": {"adapters": {"positions": 10, "mean_abs": 0.0025}},
            "stock_floor_logprobs": {"adapters": {"positions": 10, "mean_abs": 0.0024}}}
    (row,) = rpt._stock_floor_rows(cmp_)
    assert "1.04×" in row and "0.0025 / 0.0024" in row
    assert rpt._stock_floor_rows({**cmp_, "stock_floor_logprobs": {"adapters": {"positions": 10, "mean_abs": 0.0}}}) == []
    assert rpt._stock_floor_rows({"logprobs": cmp_["logprobs"]}) == []


def test_perf_rows_and_targets():
    runs = {"stock": {"phases": {"tpot": {"one_adapter": {"tpot_ms": 6.0}},
                                 "throughput": {"eight_adapters": {"output_tok_s": 3300.0, "total_tok_s": 16500.0}}}},
            "ours": {"phases": {"tpot": {"one_adapter": {"tpot_ms": 3.6}},
                                "throughput": {"eight_adapters": {"output_tok_s": 5000.0, "total_tok_s": 25000.0}}}}}
    rows = {r["metric"]: r for r in rpt.perf_rows(runs)}
    t = rows["TPOT batch 1, one adapter (ms)"]
    assert t["met"] is True and t["ratio"] == pytest.approx(0.6) and t["anchor"] == rpt.ANCHORS["tpot_one_adapter_ms"]
    assert rows["64×(512+128), 8 adapters: output tok/s"]["met"] is False
    assert rows["TPOT batch 1, no adapter (ms)"]["stock"] is None and rows["TPOT batch 1, no adapter (ms)"]["met"] is None


def test_prompts_deterministic():
    p = e.prompts(0, "greedy", 16, 64, 151936)
    assert p == e.prompts(0, "greedy", 16, 64, 151936) and len(p) == 16 and all(len(x) == 64 for x in p)
    assert p != e.prompts(0, "tpot", 16, 64, 151936) and max(max(x) for x in p) < 151936


# ----------------------------------------------------------------------------- the whole pipeline, stand-in engine

def _run_tool(tmp_path, *extra, fail=None, slow=None, out="out", env_extra=None):
    env = dict(os.environ, EPILORA_E2E_LLM_FACTORY="tests.e2e_fake:FakeLLM", PYTHONPATH=str(ROOT), **(env_extra or {}))
    env.pop("OUT", None)
    if fail:
        env["EPILORA_E2E_FAKE_FAIL"] = fail
    if slow:
        env["EPILORA_E2E_FAKE_SLOW"] = str(slow)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "e2e_vllm.py"), "--size", "tiny", "--reps", "1",
                        "--out", str(tmp_path / out), "--work-dir", str(tmp_path / "work"), *extra],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    rep = json.loads((tmp_path / out / "e2e.json").read_text()) if (tmp_path / out / "e2e.json").exists() else None
    return r, rep


@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_pipeline_with_stand_in_engine(tmp_path, mode):
    r, rep = _run_tool(tmp_path, "--ours-env", "EPILORA_FORCE_TRITON=1", *mode)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    c = rep["comparison"]
    assert c["greedy"]["none"]["identical"] == 16
    flipped = 16 // m.NUM_ADAPTERS  # prompts on adapter id FLIP_ADAPTER_ID
    assert c["greedy"]["adapters"]["identical"] == 16 - flipped
    assert sorted(x for x in c["greedy"]["adapters"]["first_divergence"] if x is not None) == [e2e_fake.FLIP_AT] * flipped
    assert c["logprobs"]["none"]["max_abs"] == pytest.approx(e2e_fake.OURS_LP_SHIFT) and c["logprobs"]["none"]["within_tolerance"]
    assert c["logprobs"]["adapters"]["top1_agreement"] < 1 and c["logprobs"]["adapters"]["within_tolerance"]
    assert c["stock_floor_greedy"]["adapters"]["identical"] == 16 and c["stock_adapters_change_tokens"] == 16
    assert rep["runs"]["ours"]["phases"]["logprobs"]["tokens_from"] == "stock"
    assert rep["plugin_log"]["ours"]["taken_over"] == 4 * 2 and rep["plugin_log"]["stock"]["plugin_disabled"]
    assert rep["runs"]["ours"]["probe"]["epilora_active"] == 8 and rep["ours_env"] == {"EPILORA_FORCE_TRITON": "1"}
    assert rep["shared_env"] == e.shared_env(os.environ)
    assert rep["concurrent"] == (not mode)
    perf = {x["metric"]: x for x in rep["performance"]}
    assert all(x["stock"] is not None and x["ours"] is not None for x in perf.values())
    # TPOT from the engine's timestamps: the stand-in's decode steps take STEP_S each
    for cfg in rpt.CONFIGS:
        tp = rep["runs"][cfg]["phases"]["tpot"]["one_adapter"]
        assert tp["tpot_source"] == "engine timestamps" and len(tp["tpot_engine_ms"]) == 1
        assert tp["tpot_ms"] == pytest.approx(1e3 * e2e_fake.STEP_S) and tp["ttft_ms"] == pytest.approx(1e3 * e2e_fake.STEP_S)
        assert tp["ttft_min_ms"] == pytest.approx(1e3 * e2e_fake.STEP_S)
        # the engine process's GC passes, read after each run: one entry per 1-token run
        g = tp["gc_1_token_runs"]
        assert len(g["ms_per_run"]) == len(tp["t_1_token_s"]) and len(g["passes"]) == 3
        assert g["ms_total"] == pytest.approx(sum(g["ms_per_run"]), abs=1e-3) and g["max_ms"] >= 0
        # and the host's time in each: one forward step and one sampling call per 1-token run
        h = tp["host_1_token_runs"]
        assert h["step_calls"] == [1] * len(tp["t_1_token_s"]) == h["sample_calls"]
        assert all(x >= 0.4 for x in h["step_ms"]) and h["op_calls"] == [0] * len(tp["t_1_token_s"])
        assert len(tp["ttft_1_token_runs_ms"]) == len(tp["t_1_token_s"])
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "| greedy 32 tokens, no adapter: identical | 16/16 | 16/16 |" in md
    assert "TPOT rows: (stock engine timestamps, ours engine timestamps)" in md
    assert "≥ 5300" in md and "layers taken over: 8" in md
    assert "## Host time of the TTFT runs" in md and "stock, one_adapter:" in md
    assert rep["entry_point"].startswith("vllm_adapter.plugin:register from epilora-cute 0.0.0; module at " + str(ROOT))
    assert _leftover_processes(tmp_path) == []


def _leftover_processes(tmp_path) -> list[str]:
    """Processes still running whose command line names this test's directory."""
    left = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(tmp_path) in cmd and "--worker" in cmd:
            left.append(cmd)
    return left


def test_hanging_engine_start_does_not_block_the_other(tmp_path):
    # The start timeout leaves the healthy stand-in engine (a python process importing torch) room
    # on a loaded CI machine: at 4 s it missed it too when the tests ran one worker per core.
    r, rep = _run_tool(tmp_path, "--start-timeout", "40", "--phases", "greedy", slow="ours:600")
    assert r.returncode == 1 and "not up after 40 s" in rep["notes"]["ours"] and "stock" not in rep["notes"]
    assert rep["runs"]["stock"]["done"] and "greedy" in rep["runs"]["stock"]["phases"]
    assert _leftover_processes(tmp_path) == []


def test_sigterm_stops_workers_and_still_reports(tmp_path):
    env = dict(os.environ, EPILORA_E2E_LLM_FACTORY="tests.e2e_fake:FakeLLM", PYTHONPATH=str(ROOT),
               EPILORA_E2E_FAKE_SLOW="60")
    p = subprocess.Popen([sys.executable, str(ROOT / "tools" / "e2e_vllm.py"), "--size", "tiny", "--out",
                          str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:  # wait until the engines are starting
        if "starting ours" in line:
            break
    p.terminate()
    p.communicate(timeout=120)
    assert p.returncode == 1
    rep = json.loads((tmp_path / "out" / "e2e.json").read_text())
    assert rep["notes"] == {"stock": "interrupted", "ours": "interrupted"}
    assert _leftover_processes(tmp_path) == []


def test_deterministic_shrink_and_stock_env_in_the_report(tmp_path):
    r, rep = _run_tool(tmp_path, "--phases", "greedy", "--deterministic-lora-shrink", "--stock-env", "FOO=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rep["deterministic_lora_shrink"] is True and rep["stock_env"] == {"FOO": "1"}
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "- stock: env {'FOO': '1'}" in md and "unsplit (split_k = 1" in md
    assert "VLLM_TUNED_CONFIG_FOLDER=" in r.stdout + r.stderr
    assert list((tmp_path / "work").glob("run-*/lora_unsplit_shrink/NVIDIA_H200_SHRINK.json"))
    # a rescore of that run still says how it was run
    r, rep2 = _run_tool(tmp_path, "--rescore", str(tmp_path / "out" / "e2e.json"), "--reference", "off", out="second")
    assert rep2["deterministic_lora_shrink"] is True and rep2["stock_env"] == {"FOO": "1"}
    assert "unsplit (split_k = 1" in (tmp_path / "second" / "e2e.md").read_text()


def test_time_budget_stops_workers_and_still_reports(tmp_path):
    r, rep = _run_tool(tmp_path, "--time-budget", "4", slow=60)
    assert r.returncode == 1 and rep is not None
    assert "time budget ran out" in rep["notes"]["stock"]
    assert _leftover_processes(tmp_path) == []


def test_only_ours_against_earlier_stock(tmp_path):
    r, rep = _run_tool(tmp_path, "--only", "stock", "--skip-throughput", out="first")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "throughput" not in rep["runs"]["stock"]["phases"]
    r, rep = _run_tool(tmp_path, "--only", "ours", "--phases", "greedy,logprobs",
                       "--stock-from", str(tmp_path / "first" / "e2e.json"))
    assert r.returncode == 0, r.stdout[-3000:]
    assert rep["runs"]["ours"]["phases"]["logprobs"]["tokens_from"] == "stock"
    assert rep["comparison"]["greedy"]["none"]["identical"] == 16
    assert rep["comparison"]["logprobs"]["none"]["positions"] == 16 * 95


def test_failing_engine_is_reported(tmp_path):
    r, rep = _run_tool(tmp_path, "--phases", "greedy", fail="ours")
    assert r.returncode == 1
    assert rep["runs"]["stock"]["done"] and "greedy" in rep["runs"]["stock"]["phases"]
    assert "before its engine was up" in rep["notes"]["ours"] and "fake engine failure" in rep["runs"]["ours"]["log_tail"]
    assert "RuntimeError: fake engine failure" in rep["notes"]["ours"]  # the root cause, in the note
    assert "fake engine failure" in rep["runs"]["ours"]["errors"]["engine"]
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "**ours**" in md and "ours.log, last 15 lines:" in md


def test_reply_vllm_cannot_send_is_reported_at_once(tmp_path):
    """The first H200 run: the stock engine came up, its probe's reply could not be encoded, the
    engine's output thread died and the tool waited for its 420 s start limit. Now the log line
    ends it within seconds, with the root cause and the log's tail in the report."""
    import time

    t = time.time()
    r, rep = _run_tool(tmp_path, "--phases", "greedy", "--start-timeout", "250",
                       env_extra={"EPILORA_E2E_FAKE_RPC_DIES": "stock"})
    took = time.time() - t
    assert r.returncode == 1 and took < 120, (took, r.stdout[-2000:])
    note = rep["notes"]["stock"]
    assert note.startswith("its engine failed before measuring: TypeError: Object of type fake is not serializable")
    assert rep["runs"]["ours"]["done"] and "greedy" in rep["runs"]["ours"]["phases"]
    assert "process_output_sockets" in rep["runs"]["stock"]["log_tail"]
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "stock.log, last 15 lines:" in md and "Exception in thread Thread-3 (process_output_sockets)" in md
    assert _leftover_processes(tmp_path) == []


def test_probe_that_never_answers_times_out_in_the_worker(tmp_path):
    r, rep = _run_tool(tmp_path, "--phases", "greedy", "--start-timeout", "250",
                       env_extra={"EPILORA_E2E_FAKE_RPC_SILENT": "ours", e.RPC_TIMEOUT_ENV: "20"})
    assert r.returncode == 1
    assert rep["runs"]["ours"]["fatal"].startswith("collective_rpc('e2e_lora_layers') did not return within 20 s")
    assert f"exited with {e.EXIT_ENGINE_UNUSABLE} before its engine was up: collective_rpc(" in rep["notes"]["ours"]
    assert rep["runs"]["stock"]["done"]
    assert _leftover_processes(tmp_path) == []


def test_engine_dying_while_measuring_is_stopped(tmp_path):
    r, rep = _run_tool(tmp_path, "--phases", "greedy,logprobs", "--only", "ours",
                       env_extra={"EPILORA_E2E_FAKE_DIES_SCORING": "ours"})
    assert r.returncode == 1
    assert rep["notes"]["ours"].startswith("its engine failed while measuring: RuntimeError: CUDA error: an illegal "
                                           "memory access was encountered")
    assert "greedy" in rep["runs"]["ours"]["phases"] and not rep["runs"]["ours"]["done"]
    assert _leftover_processes(tmp_path) == []


def test_error_summary_finds_the_root_cause():
    ours = "\n".join([
        "(EngineCore pid=2780) INFO 10:39:01 vllm.model_executor.warmup.cutedsl_warmup: Skipping CuTeDSL warmup",
        "(EngineCore pid=2780) ERROR 10:39:11 vllm.v1.engine.core: EngineCore failed to start.",
        "(EngineCore pid=2780) Traceback (most recent call last):",
        "(EngineCore pid=2780)     return _cached(key, lambda: torch.tensor([b.data_ptr() for b in bufs]))",
        "(EngineCore pid=2780) RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture "
        "unless the CPU tensor is pinned. Please use tensor.pin_memory().",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"])
    assert e.error_summary(ours).startswith("RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph")
    assert e.error_summary("(EngineCore pid=2842) TypeError: Object of type <class 'torch.torch_version."
                           "TorchVersion'> is not serializableSet VLLM_ALLOW_INSECURE_SERIALIZATION=1") \
        .startswith("TypeError: Object of type <class 'torch.torch_version.TorchVersion'> is not serializable")
    assert e.error_summary("INFO all fine\n[W1130 socket.cpp:207] err=-3") is None
    assert any(p.search("(EngineCore pid=2842) Exception in thread Thread-3 (process_output_sockets):")
               for p in e.FATAL_LOG_PATTERNS)


def test_smoke_mode(tmp_path):
    r, rep = _run_tool(tmp_path, "--smoke")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    spec = rep["spec"]
    assert spec["layers"] == e.SMOKE["layers"] and spec["phases"] == ["greedy", "logprobs"] and spec["reps"] == 1
    assert spec["smoke"]["skipped"] == ["tpot", "throughput"] and spec["smoke"]["of_layers"] == TINY["num_hidden_layers"]
    for k, v in e.SMOKE["engine"].items():
        assert spec["engine"][k] == v
    assert "enforce_eager" not in spec["engine"] and "compilation_config" not in spec["engine"]  # graphs, compile on
    assert set(rep["runs"]["ours"]["phases"]) == {"greedy", "logprobs"}
    assert rep["comparison"]["greedy"]["none"]["identical"] == 16
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "**SMOKE RUN** (`--smoke`): 4 of the model's 2 layers" in md and "skipped: tpot, throughput" in md
    assert "Not measured: smoke run." in md and "TPOT batch 1" not in md
    assert "SMOKE RUN: 4 of 2 layers, greedy + logprobs only" in r.stdout and "Expected on an H200" in r.stdout
    assert "limits: engine start 210 s, whole run 270 s" in r.stdout
    # the fp32 reference ran after the engines (on the CPU: a tiny model), on the sequences both scored
    ref = rep["fp32_reference"]
    assert ref["mode"] == "auto" and not ref.get("skipped") and ref["device"] == "cpu" and ref["notes"] == []
    assert ref["keys"]["stock"] == ref["keys"]["ours"] and set(ref["keys"]["ours"]) == {"none", "adapters"}
    assert ref["unquantized"]["quantize"] is False and ref["with_bf16_inputs"]["bf16_inputs"] is True and len(ref["cases"]) == 2
    c = rep["comparison"]["fp32_reference"]
    for config in rpt.CONFIGS:
        for variant in ("none", "none_single", "adapters", "adapters_single"):
            assert c[config][variant]["positions"] == 16 * 95
    # the stand-in's logprobs are not a model's: far from the reference; ours' shift shows in the ratio
    v = c["verdict"]
    assert v["none"]["ours_mean_abs"] > 1 and v["worst_ratio"] == pytest.approx(1.0, abs=1e-3) and v["as_close_as_stock"]
    assert "## Distance to the exact computation" in md and "ours is within 1.00× of stock's distance" in md
    assert "(scale) the reference without FP8" in md and not (tmp_path / "out" / "reference.json").exists()
    assert c["bf16_inputs"]["ours"]["adapters"]["positions"] == 16 * 95
    assert len(list((tmp_path / "out").iterdir())) <= 6  # the device returns at most 8 files
    assert "**The engines and the reference do not compute the same model**" in md  # the stand-in is no model
    ck = spec["checkpoint"]
    assert ck["model"] == m.fingerprint(Path(spec["engine"]["model"]) / "model.safetensors") and ck["torch"]
    assert "| (diagnostic) ours, 8 adapters, vs the reference with each linear layer's input rounded" in md
    assert "| (scale) the reference with each linear layer's input rounded to bf16 before FP8, no adapter |" in md


def test_rescore_adds_the_reference_to_an_earlier_run(tmp_path):
    r, rep = _run_tool(tmp_path, "--only", "stock", "--phases", "greedy,logprobs", "--reference", "off", out="first")
    assert r.returncode == 0, r.stdout[-3000:]
    assert rep["fp32_reference"]["skipped"] == "--reference off" and "fp32_reference" not in rep["comparison"]
    assert "Not computed: --reference off." in (tmp_path / "first" / "e2e.md").read_text()
    r, rep2 = _run_tool(tmp_path, "--rescore", str(tmp_path / "first" / "e2e.json"), out="second")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rep2["runs"] == rep["runs"] and rep2["date"] == rep["date"] and rep2["rescored_from"]["file"].endswith("e2e.json")
    c = rep2["comparison"]["fp32_reference"]
    assert c["stock"]["none"]["positions"] == 16 * 95 and "ours" not in c and c["verdict"] == {}
    md = (tmp_path / "second" / "e2e.md").read_text()
    assert "fp32 reference added later" in md and "| stock, 8 adapters |" in md and "ours is within" not in md
    assert rep2["fp32_reference"]["checkpoint"]["model"] == rep["spec"]["checkpoint"]["model"]
    # a rebuilt checkpoint that is not the run's (another torch's RNG) is refused
    rep["spec"]["checkpoint"]["model"] = "0" * 16
    (tmp_path / "other.json").write_text(json.dumps(rep))
    r, rep3 = _run_tool(tmp_path, "--rescore", str(tmp_path / "other.json"), out="third")
    assert r.returncode == 1 and "the rebuilt checkpoint is not the run's" in rep3["fp32_reference"]["skipped"]
    assert "fp32_reference" not in rep3["comparison"]
    # a run from before the fingerprints: --expect-checkpoint gives them
    del rep["spec"]["checkpoint"]
    (tmp_path / "old.json").write_text(json.dumps(rep))
    r, rep4 = _run_tool(tmp_path, "--rescore", str(tmp_path / "old.json"), "--expect-checkpoint", "1" * 16,
                        out="fourth")
    assert r.returncode == 1 and "the rebuilt checkpoint is not the run's" in rep4["fp32_reference"]["skipped"]


def test_fp32_reference_request_rebuilds_the_scored_sequences():
    spec = {"seed": 0, "vocab_size": 1000, "greedy": {"n": 3, "prompt_len": 4, "gen_len": 2}}
    P = e.prompts(0, "greedy", 3, 4, 1000)
    g_stock = {"none": [[1, 2], [3, 4], [5, 6]], "adapters": [[7, 8], [9, 10], [11, 12]]}
    g_ours = {"none": [[1, 2], [3, 4], [5, 7]], "adapters": [[7, 8], [9, 10], [11, 12]]}

    def lp(greedy, cases=("none", "adapters")):
        return {c: {"lp": [], "top1": [], "seqs_sha": e._sha([p + t for p, t in zip(P, greedy[c])])} for c in cases}

    runs = {"stock": {"phases": {"greedy": g_stock, "logprobs": {"tokens_from": "self", **lp(g_stock)}}},
            "ours": {"phases": {"greedy": g_ours, "logprobs": {"tokens_from": "stock", **lp(g_stock)}}}}
    req, keys, notes = e.fp32_reference_request(runs, spec)
    assert notes == [] and keys["stock"] == keys["ours"] and len(req["cases"]) == 2
    a = req["cases"][keys["ours"]["adapters"]]
    assert a["seqs"] == [p + t for p, t in zip(P, g_stock["adapters"])] and a["adapter"] == [0, 1, 2]
    assert req["cases"][keys["stock"]["none"]]["adapter"] == [None] * 3
    # ours forced with its own tokens: its own case; a sequence hash that does not match: left out, noted
    runs["ours"]["phases"]["logprobs"] = {"tokens_from": "self", **lp(g_ours, ("none",))}
    runs["stock"]["phases"]["logprobs"]["adapters"]["seqs_sha"] = "0" * 16
    req, keys, notes = e.fp32_reference_request(runs, spec)
    assert keys == {"stock": {"none": keys["stock"]["none"]}, "ours": {"none": keys["ours"]["none"]}}
    assert keys["stock"]["none"] != keys["ours"]["none"] and len(req["cases"]) == 2
    assert len(notes) == 1 and notes[0].startswith("stock adapters: rebuilt sequences do not match")


def test_compare_fp32_reference_and_verdict():
    spec = {"greedy": {"prompt_len": 2, "gen_len": 2}}
    ref_lp = {"lp": [[-1.0, -2.0, -3.0]], "top1": [[1, 2, 3]]}

    def shifted(d, top1=(1, 2, 3)):
        return {"lp": [[x + d for x in ref_lp["lp"][0]]], "top1": [list(top1)], "seqs_sha": "s"}

    runs = {"stock": {"phases": {"logprobs": {"none": shifted(0.01), "none_single": shifted(0.02),
                                              "adapters": shifted(-0.02), "adapters_single": shifted(-0.02),
                                              "adapters_without_lora": shifted(1.0)}}},
            "ours": {"phases": {"logprobs": {"none": shifted(0.03, (1, 2, 4)), "none_single": shifted(0.03),
                                             "adapters": shifted(0.02), "adapters_single": shifted(0.02),
                                             "adapters_without_lora": shifted(1.0)}}}}
    ref = {"cases": {"n": ref_lp, "a": ref_lp}, "keys": {"stock": {"none": "n", "adapters": "a"},
                                                         "ours": {"none": "n", "adapters": "a"}},
           "unquantized": {"cases": {"n": shifted(0.5), "a": shifted(0.25)}},
           "with_bf16_inputs": {"cases": {"n": shifted(0.03), "a": shifted(0.02)}}}
    c = rpt.compare(runs, spec, ref)["fp32_reference"]
    assert c["stock"]["none"]["mean_abs"] == pytest.approx(0.01) and c["stock"]["none_single"]["mean_abs"] == pytest.approx(0.02)
    assert c["ours"]["none"]["top1_agreement"] == pytest.approx(2 / 3) and set(c["ours"]) == set(c["stock"])
    assert c["fp8_effect"]["none"]["mean_abs"] == pytest.approx(0.5) and c["fp8_effect"]["adapters"]["mean_abs"] == pytest.approx(0.25)
    assert c["bf16_inputs"]["ours"]["none"]["mean_abs"] == pytest.approx(0.0, abs=1e-12)
    assert c["bf16_inputs_effect"]["none"]["mean_abs"] == pytest.approx(0.03)
    assert c["bf16_inputs"]["stock"]["none"]["mean_abs"] == pytest.approx(0.02)
    v = c["verdict"]
    assert v["none"]["ratio"] == pytest.approx(3.0) and v["adapters"]["ratio"] == pytest.approx(1.0)
    assert v["worst_ratio"] == pytest.approx(3.0) and not v["as_close_as_stock"]
    line = rpt.verdict_line(v)
    assert line.startswith("**ours is within 3.00× of stock's distance to the exact computation**")
    assert "no adapter: stock 0.0100, ours 0.0300 (×3.00)" in line and "ours adds an error stock does not have" in line
    # Per prompt (one prompt here): ours 0.03 <= 1.25 × stock's 0.01 + 0.02 nats passes; 0.04 does not.
    assert v["none"]["per_prompt"]["within"] == 1 and v["none"]["per_prompt"]["total"] == 1
    assert v["none"]["per_prompt"]["worst_ratio"] == pytest.approx(3.0)
    assert "Per prompt, the stated tolerance" in line and "no adapter 1/1 (worst ×3.00)" in line
    runs["ours"]["phases"]["logprobs"]["none"] = shifted(0.04)
    assert rpt.compare(runs, spec, ref)["fp32_reference"]["verdict"]["none"]["per_prompt"]["within"] == 0
    runs["ours"]["phases"]["logprobs"]["none"] = shifted(0.011)
    assert rpt.compare(runs, spec, ref)["fp32_reference"]["verdict"]["as_close_as_stock"]
    assert "fp32_reference" not in rpt.compare(runs, spec, {"skipped": "x", "keys": {}})
    assert rpt.verdict_line({}) is None


# ----------------------------------------------------------------------------- vLLM's own loaders (.venv-vllm)

_VLLM = ROOT / ".venv-vllm" / "bin" / "python"

_XCHECK = r'''
import json, sys, tempfile
import torch
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
if type(platforms._current_platform).__name__ != "CpuPlatform":
    platforms._current_platform = CpuPlatform()
import vllm.utils.torch_utils as torch_utils
torch_utils.PIN_MEMORY = False
if not hasattr(torch.ops._C, "silu_and_mul"):  # vllm._C is not loaded on a CPU torch; the MLP only looks the op up
    _lib = torch.library.Library("_C", "FRAGMENT")
    _lib.define("silu_and_mul(Tensor! out, Tensor x) -> ()")
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.utils import get_supported_lora_modules
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

model_dir, adapter_dir, root = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, root)
from tools import e2e_model, e2e_vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu_worker import Worker

# the engine keywords and the worker extension, as vLLM will take them
ecfg = EngineArgs(**e2e_vllm.engine_kwargs(model_dir, 0)).create_engine_config()
out = {"engine": [ecfg.model_config.quantization, ecfg.lora_config.max_loras, ecfg.lora_config.max_lora_rank,
                  ecfg.cache_config.kv_cache_memory_bytes, ecfg.parallel_config.worker_extension_cls],
       "probe_conflicts": [a for a in dir(e2e_model.WorkerProbe) if not a.startswith("__") and hasattr(Worker, a)]}
scfg = EngineArgs(**e2e_vllm.engine_kwargs(model_dir, 0, e2e_vllm.SMOKE["engine"])).create_engine_config()
out["smoke_engine"] = [scfg.model_config.max_model_len, scfg.scheduler_config.max_num_seqs,
                       scfg.scheduler_config.max_num_batched_tokens, scfg.cache_config.kv_cache_memory_bytes]
# the probe's reply through vLLM's own msgspec encoder (what runs in the engine's output thread)
from vllm.v1.serial_utils import MsgpackEncoder
model = torch.nn.ModuleDict({"o": type("EpiLoRARowParallelLinearWithLoRA", (torch.nn.Linear,), {})(2, 2)})
worker = type("W", (e2e_model.WorkerProbe,), {"get_model": lambda self: model, "model_runner": object()})()
reply = worker.e2e_lora_layers()
MsgpackEncoder().encode([reply])
# the host probe's timers wrap methods vLLM's worker has; its reply encodes too
out["worker_step_methods"] = [callable(getattr(Worker, n, None)) for n in e2e_model.HostProbe.WORKER_METHODS]
MsgpackEncoder().encode([e2e_model.HostProbe().read()])
try:
    MsgpackEncoder().encode([{"torch": torch.__version__}])
    out["torch_version_encodes"] = True
except TypeError:
    out["torch_version_encodes"] = False
out["probe_torch"] = reply["torch"]
ctx = e2e_vllm.Ctx(None, {"adapters": [adapter_dir] * 8, "seed": 0, "vocab_size": 512}, None, {})
sp = ctx.sampling(4, skip_reading_prefix_cache=True)
out["sampling"] = [type(sp).__name__, sp.max_tokens, sp.temperature, sp.skip_reading_prefix_cache, sp.ignore_eos]
sp = ctx.sampling(1, prompt_logprobs=1)  # the teacher-forced scoring (prefix cache reads skipped by vLLM)
out["scoring"] = [sp.prompt_logprobs, sp.skip_reading_prefix_cache, sp.detokenize]
out["lora_request"] = [type(ctx.lora(2)).__name__, ctx.lora(2).lora_int_id, ctx.lora(2).lora_path]
cfg = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16"))
out.update(architecture=cfg.model_config.architectures, vllm=__import__("vllm").__version__)
with set_current_vllm_config(cfg):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    model = Qwen3ForCausalLM(vllm_config=cfg)
    loaded = model.load_weights(safetensors_weights_iterator([model_dir + "/model.safetensors"], False))
    params = {n for n, _ in model.named_parameters()}
    out["params_not_loaded"] = sorted(params - loaded)
    out["loaded_not_params"] = sorted(loaded - params)
    # the adapter, as vLLM's worker manager loads it (expected modules from the model's packing)
    expected = set()
    for mod in get_supported_lora_modules(model):
        expected |= set(model.packed_modules_mapping.get(mod, [mod]))
    helper = PEFTHelper.from_local_dir(adapter_dir, cfg.model_config.max_model_len)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_local_checkpoint(adapter_dir, expected, peft_helper=helper, lora_model_id=1, device="cpu",
                                           dtype=torch.bfloat16, model_vocab_size=cfg.model_config.get_vocab_size(),
                                           weights_mapper=mapper.get_unstacked_mapper() if mapper else None)
    out["expected_lora_modules"] = sorted(expected)
    out["lora"] = {k: [list(v.lora_a.shape), list(v.lora_b.shape), v.rank] for k, v in lora.loras.items()}
    out["scaling"] = helper.vllm_lora_scaling_factor
print("XCHECK " + json.dumps(out))
'''


@pytest.mark.skipif(not _VLLM.exists(), reason="no .venv-vllm (tools/install_vllm_cpu.sh makes it)")
def test_files_load_with_vllm_qwen3_and_lora_loaders(tmp_path):
    rank = 8
    model = m.write_model(tmp_path / "model", "tiny")
    adapter = m.write_adapter(tmp_path / "adapter", "tiny", rank=rank)
    (tmp_path / "x.py").write_text(_XCHECK)
    r = subprocess.run([str(_VLLM), str(tmp_path / "x.py"), str(model), str(adapter), str(ROOT)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=""))
    lines = [x for x in r.stdout.splitlines() if x.startswith("XCHECK ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
    out = json.loads(lines[-1][len("XCHECK "):])
    assert out["architecture"] == ["Qwen3ForCausalLM"]
    assert out["engine"] == ["fp8", 8, 64, 16 << 30, "tools.e2e_model.WorkerProbe"] and out["probe_conflicts"] == []
    assert out["worker_step_methods"] == [True, True]
    assert out["smoke_engine"] == [256, 16, 2048, 4 << 30]
    # vLLM refuses torch.__version__ (the first H200 run's stock failure); the probe's reply encodes
    assert out["torch_version_encodes"] is False and out["probe_torch"]
    assert out["sampling"] == ["SamplingParams", 4, 0.0, True, True]
    assert out["scoring"] == [1, True, False]
    assert out["lora_request"] == ["LoRARequest", 3, str(adapter)]
    assert out["params_not_loaded"] == [] and out["loaded_not_params"] == []
    assert set(m.TARGET_MODULES) <= set(out["expected_lora_modules"])
    h, i = TINY["hidden_size"], TINY["intermediate_size"]
    q = TINY["num_attention_heads"] * TINY["head_dim"]
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    dims = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    want = {f"model.layers.{layer}.{name}" for layer in range(TINY["num_hidden_layers"]) for name in dims}
    assert set(out["lora"]) == want
    for key, (a, b, r_) in out["lora"].items():
        n_out, n_in = dims[key.split(".", 3)[3]]
        assert r_ == rank and sorted([a, b]) == sorted([[rank, n_in], [n_out, rank]]), key
    assert out["scaling"] == 1.0


def test_kernel_summary_busy_span_and_per_name():
    from types import SimpleNamespace as NS

    def ev(name, t0, t1, dev="DeviceType.CUDA"):
        return NS(name=name, device_type=dev, time_range=NS(start=t0, end=t1))

    s = m.kernel_summary([ev("a", 0, 10), ev("b", 5, 12), ev("a", 20, 25), ev("host op", 0, 100, "DeviceType.CPU")])
    assert s["n_kernels"] == 3 and s["span_us"] == 25 and s["busy_us"] == 12 + 5  # [0, 12] and [20, 25]
    assert s["kernels"]["a"] == {"count": 2, "total_us": 15, "gap_before_us": 8}  # idle 12..20 before the 2nd a
    assert s["kernels"]["b"] == {"count": 1, "total_us": 7, "gap_before_us": 0}
    assert m.kernel_summary([]) == {"n_kernels": 0, "busy_us": 0.0, "span_us": 0.0, "kernels": {}}


def test_profile_phase_with_stand_in_engine(tmp_path):
    """--phases profile: the TPOT runs under the worker's profiler (no GPU here: no kernels), the
    per-token numbers and the report's section come out of the pipeline."""
    r, rep = _run_tool(tmp_path, "--phases", "profile", "--reference", "off")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for config in ("stock", "ours"):
        prof = rep["runs"][config]["phases"]["profile"]
        assert set(prof) == {"none", "one_adapter", "eight_adapters_b64", "none_b64"}, prof
        for case in prof.values():
            assert case["wall_ms_per_token"] >= 0 and case["kernels_per_token"] == 0 and case["top"] == []
        # every case keeps its 1-token run (the prefill: the batch's, or the TTFT's 512 tokens) as it is
        for case in prof.values():
            first = case["first_run"]
            assert first["kernels"] == 0 and first["top"] == [] and first["top_gaps"] == [] and first["wall_ms"] >= 0
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "Where a generated token's time goes" in md and "| ours, one_adapter |" in md
    assert "| ours, eight_adapters_b64 |" in md


def test_profile_markdown_tables():
    r = {"wall_ms_per_token": 4.1, "busy_us_per_token": 3776.0, "span_us_per_token": 4109.0, "kernels_per_token": 657.0,
         "top": [["k2", 36.0, 320.8, 40.0], ["quant", 144.0, 307.9, 200.0]], "top_gaps": [["quant", 144.0, 307.9, 200.0]]}
    md = "\n".join(rpt.profile_markdown({"ours": {"phases": {"profile": {"none": r}}}, "stock": {"phases": {}}}))
    assert "| ours, none | 4.103 | 3776 | 4109 | 657 |" not in md and "| ours, none | 4.100 | 3776 | 4109 | 657 |" in md
    assert "ours, none: kernels the GPU idles before, per token" in md and "| `quant` | 144.0 | 307.9 | 200.0 |" in md
    assert rpt.profile_markdown({"ours": {"phases": {}}}) == []
    first = {"wall_ms": 310.0, "busy_us": 290000.0, "span_us": 300000.0, "kernels": 9000,
             "top": [["gemm", 144, 150000.0, 3.0]]}
    md = "\n".join(rpt.profile_markdown({"ours": {"phases": {"profile": {"eight_adapters_b64": {**r, "first_run": first}}}}}))
    assert "ours, eight_adapters_b64: its 1-token run (the prefill and one step)" in md
    assert "| `gemm` | 144 | 150000.0 | 3.0 |" in md
    assert "kernels the GPU idles before" not in md.split("its 1-token run")[-1]  # no gaps recorded: no table
    first["top_gaps"] = [["lora_linear", 144, 900.0, 250.0]]
    md = "\n".join(rpt.profile_markdown({"ours": {"phases": {"profile": {"none": {**r, "first_run": first}}}}}))
    assert "ours, none: its 1-token run, kernels the GPU idles before" in md and "| `lora_linear` | 144 | 900.0 | 250.0 |" in md


def test_gc_probe_reads_and_resets():
    """GcProbe (the engine process's collector passes, e2e_gc_read): a forced collection shows up
    as one generation-2 pass with its time, and each read starts the count afresh."""
    import gc

    probe = m.GcProbe()
    gc.disable()  # no automatic passes in between: the counts are exactly the forced ones
    try:
        first = probe.read()
        assert first["passes"] == [0, 0, 0] and first["max_ms"] == 0.0 and probe.installed
        gc.collect()
        r = probe.read()
        assert r["passes"] == [0, 0, 1] and r["ms"][2] > 0.0 and r["max_ms"] == pytest.approx(r["ms"][2], abs=1e-3)
        assert probe.read()["passes"] == [0, 0, 0]  # each read starts afresh
        summary = e.gc_summary([r, None, {"passes": [1, 0, 0], "ms": [0.5, 0, 0], "max_ms": 0.5, "frozen": 7}])
        assert summary["ms_per_run"] == [round(sum(r["ms"]), 3), 0.5] and summary["frozen"] == 7
        assert summary["passes"][0] == r["passes"][0] + 1 and e.gc_summary([None]) is None
    finally:
        gc.enable()
        gc.callbacks.remove(probe._callback)


def test_host_probe_times_steps_sampling_and_the_op():
    """HostProbe (e2e_host_read): the worker's forward and sampling calls and the plugin's op (the
    outermost of nested entries only) each counted with wall and CPU time; each read starts
    afresh; uninstall puts back the worker's methods and vllm_adapter.fused's entries."""
    import time

    from vllm_adapter import fused

    class Worker:
        def execute_model(self, so):
            t = time.thread_time()
            while time.thread_time() - t < 0.004:  # 4 ms of CPU: wall and CPU both grow
                pass
            fused.base_linear_fp8("x")  # the op inside the forward, as the model's layers call it
            return "out"

        def sample_tokens(self, g):
            time.sleep(0.003)  # waiting, as for the GPU: wall without CPU
            return "tokens"

    real_lora, real_base = fused.lora_linear_fp8, fused.base_linear_fp8
    calls = []

    def fake_base(*a, **kw):
        calls.append("base")
        return fused.lora_linear_fp8(*a)  # nested entry: counted once, as the outermost call

    def fake_lora(*a, **kw):
        calls.append("lora")
        return "y"

    fused.lora_linear_fp8, fused.base_linear_fp8 = fake_lora, fake_base
    w, probe = Worker(), m.HostProbe()
    try:
        first = probe.read(w)
        assert probe.installed and first["step"]["calls"] == 0 and first["op"]["ms"] == 0.0
        assert w.execute_model(None) == "out" and w.sample_tokens(None) == "tokens"
        r = probe.read(w)
        assert calls == ["base", "lora"]
        assert r["step"]["calls"] == 1 and r["step"]["cpu_ms"] >= 3.5 and r["step"]["ms"] >= r["step"]["cpu_ms"] - 0.5
        assert r["sample"]["calls"] == 1 and r["sample"]["ms"] >= 2.5 and r["sample"]["cpu_ms"] < 1.5
        assert r["op"]["calls"] == 1 and r["op"]["ms"] <= r["step"]["ms"]
        assert r["step"]["max_ms"] == pytest.approx(r["step"]["ms"], abs=1e-3)
        assert probe.read(w)["step"]["calls"] == 0  # each read starts afresh
        probe.install(w)  # a second install wraps nothing twice
        w.execute_model(None)
        assert probe.read(w)["step"]["calls"] == 1
        s = e.host_summary([r, None])
        assert s["step_calls"] == [1, None] and s["op_ms"] == [r["op"]["ms"], None] and e.host_summary([None]) is None
    finally:
        probe.uninstall()
        assert "execute_model" not in vars(w) and fused.base_linear_fp8 is fake_base
        fused.lora_linear_fp8, fused.base_linear_fp8 = real_lora, real_base


def test_host_markdown_lines_up_the_runs():
    """The report's per-run table of the TTFT runs: wall, TTFT, the host's parts and GC per run."""
    tp = {"t_1_token_s": [0.0712, 0.0405], "ttft_1_token_runs_ms": [70.1, None],
          "gc_1_token_runs": {"ms_per_run": [0.3, 0.0]},
          "host_1_token_runs": {"step_calls": [1, 1], "step_ms": [60.0, 30.5], "step_cpu_ms": [31.0, 29.9],
                                "step_max_ms": [60.0, 30.5], "sample_calls": [1, 1], "sample_ms": [8.0, 7.5],
                                "sample_cpu_ms": [0.2, 0.2], "sample_max_ms": [8.0, 7.5], "op_calls": [144, 144],
                                "op_ms": [40.0, 12.0], "op_cpu_ms": [11.0, 11.5], "op_max_ms": [1.0, 0.2]}}
    md = "\n".join(rpt.host_markdown({"ours": {"phases": {"tpot": {"none": tp}}}}))
    assert "## Host time of the TTFT runs" in md and "ours, none:" in md and "stock" not in md
    assert "| 0 | 71.2 | 70.1 | 1 | 60.0 / 31.0 | 8.0 / 0.2 | 144 | 40.0 / 11.0 | 0.3 |" in md
    assert "| 1 | 40.5 | — | 1 | 30.5 / 29.9 | 7.5 / 0.2 | 144 | 12.0 / 11.5 | 0.0 |" in md
    assert rpt.host_markdown({"ours": {"phases": {"tpot": {"none": {}}}}}) == []


def test_margin_simulation_runs_and_reports(capsys):
    """tools/e2e_margin.py on a tiny model: the three flip rates and the predicted counts."""
    from tools import e2e_margin

    tiny = ["--hidden", "64", "--inter", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
            "--vocab", "512", "--layers", "2", "--prompts", "2", "--gen", "4"]
    assert e2e_margin.main(tiny) == 0
    out = capsys.readouterr().out
    assert "top-1 flips per step: noise" in out and "greedy identical expected" in out and "adapter changes" in out
    # defaults are the checkpoint's own gains
    assert f"out gain {m.OUT_GAIN} lora gain {m.LORA_GAIN}" in out


def test_profile_per_token_differences():
    """(n-token run − 1-token run) / (n − 1) for every number; names only in one run count as 0 in the other."""
    one = (0.010, {"n_kernels": 10, "busy_us": 100.0, "span_us": 120.0,
                   "kernels": {"gemm": {"count": 4, "total_us": 40.0, "gap_before_us": 2.0}}})
    many = (0.050, {"n_kernels": 50, "busy_us": 500.0, "span_us": 600.0,
                    "kernels": {"gemm": {"count": 20, "total_us": 200.0, "gap_before_us": 10.0},
                                "prep": {"count": 5, "total_us": 5.0, "gap_before_us": 0.0}}})
    r = e._profile_per_token(one, many, 5)
    assert r["wall_ms_per_token"] == pytest.approx(10.0) and r["busy_us_per_token"] == pytest.approx(100.0)
    assert r["span_us_per_token"] == pytest.approx(120.0) and r["kernels_per_token"] == pytest.approx(10.0)
    assert r["top"] == [["gemm", 4.0, 40.0, 2.0], ["prep", 1.25, 1.25, 0.0]]
    assert r["top_gaps"] == [["gemm", 4.0, 40.0, 2.0]]


def test_machine_line_names_each_machine_once():
    f = {"gpu_uuid": "GPU-1", "driver_version": "580.1", "cpu_count": 16, "cpu_model": "Xeon"}
    runs = {"stock": {"probe": {"machine": f}}, "ours": {"probe": {"machine": dict(f)}}}
    assert rpt.machine_line(runs) == "GPU GPU-1, driver 580.1, 16 × Xeon (stock, ours)"
    runs["ours"]["probe"]["machine"]["gpu_uuid"] = "GPU-2"
    assert rpt.machine_line(runs).count("GPU GPU-") == 2
    assert rpt.machine_line({"ours": {"probe": {"machine": {"error": "x"}}}}) == "not recorded"
    assert rpt.machine_line({}) == "not recorded"


def test_machine_facts_best_effort():
    from tools.gpu_timing import machine_facts

    f = machine_facts()  # no GPU here: nvidia-smi is missing, the rest is read
    assert set(f) == {"cpu_count", "cpu_model", "kernel", "gpu_uuid", "driver_version"} and f["cpu_count"] >= 1


def test_run_kernels_keeps_one_run_as_it_is():
    summary = {"n_kernels": 3, "busy_us": 30.0, "span_us": 40.0,
               "kernels": {"a": {"count": 1, "total_us": 5.0, "gap_before_us": 1.0},
                           "b": {"count": 2, "total_us": 25.0, "gap_before_us": 0.0}}}
    r = e._run_kernels(0.02, summary)
    assert r == {"wall_ms": pytest.approx(20.0), "busy_us": 30.0, "span_us": 40.0, "kernels": 3,
                 "top": [["b", 2, 25.0, 0.0], ["a", 1, 5.0, 1.0]],
                 "top_gaps": [["a", 1, 5.0, 1.0]]}  # only kernels the GPU idled before, longest idle first


def test_shared_env_keeps_the_knobs_both_engines_inherit():
    env = {"TORCHINDUCTOR_DETERMINISTIC": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "HOME": "/root",
           "EPILORA_FORCE_PATH": "triton", "NCCL_NVLS_ENABLE": "0", "PATH": "/bin"}
    assert e.shared_env(env) == {"NCCL_NVLS_ENABLE": "0", "TORCHINDUCTOR_DETERMINISTIC": "1",
                                 "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_multi_gpu_engines_keep_multicast_and_custom_all_reduce_off(tmp_path):
    """TP > 1: custom all-reduce and the all-reduce + RMSNorm fusion off, other compilation
    settings kept; TP 1 unchanged; every engine's environment has multicast off."""
    cc = {"custom_ops": ["+quant_fp8"], "pass_config": {"fuse_norm_quant": False}}
    one = e.engine_kwargs(tmp_path, 0, {"compilation_config": cc})
    assert "disable_custom_all_reduce" not in one and one["compilation_config"] == cc
    two = e.engine_kwargs(tmp_path, 0, {"tensor_parallel_size": 2, "compilation_config": cc})
    assert two["disable_custom_all_reduce"] is True
    assert two["compilation_config"] == {"custom_ops": ["+quant_fp8"],
                                         "pass_config": {"fuse_norm_quant": False, "fuse_allreduce_rms": False}}
    assert cc == {"custom_ops": ["+quant_fp8"], "pass_config": {"fuse_norm_quant": False}}  # not mutated
    bare = e.engine_kwargs(tmp_path, 0, {"tensor_parallel_size": 2})
    assert bare["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
    for config in ("stock", "ours"):
        env = e.engine_env(config, {"NCCL_NVLS_ENABLE": "1"}, tmp_path, tmp_path, tmp_path / "l.json", {})
        assert all(env[k] == v for k, v in e.MULTICAST_OFF_ENV.items())
