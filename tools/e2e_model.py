"""Helpers of tools/e2e_vllm.py that need no vLLM: the random Qwen3 checkpoint, the PEFT
adapters, the entry-point shim that makes the plugin visible to vLLM's processes, and the probe
that vLLM mixes into its GPU worker.

Checkpoint (HF layout, what vLLM's Qwen3 loader reads): ``config.json`` + one
``model.safetensors`` of bf16 tensors, written by a small streaming safetensors writer (no
``safetensors`` package needed; 16.4 GB for Qwen3-8B's sizes never sit in memory at once).
Every tensor has its own seed derived from (seed, name), so the first N layers of a 36-layer
model are the N-layer model, and the files do not depend on the thread count.

Two initializations (``INITS``); std per tensor, gains per unit-rms input:

* ``stable`` (the default): embeddings N(0, 1); q/k/v/gate/up N(0, 1/fan_in) (gain 1); o/down
  N(0, OUT_GAIN^2 / fan_in); lm_head N(0, 1/hidden) (logits of std 1). Each layer adds a small
  update to a residual the embeddings dominate (Megatron's scaled init of output projections,
  taken further). Why: a greedy-identity test between two engines needs a model whose logits do
  not amplify rounding. In the ``dense`` model one FP8 code flip of a layer's input (two engines
  rounding one bf16 value differently moves a code by an FP8 step, 2^-3 relative) grows through 36
  layers until any two engines disagree on ~14 % of greedy steps (stock vLLM against itself,
  batched vs one at a time: 0/16 identical; ``tools/e2e_margin.py`` simulates it on the CPU).
  Small output gains shrink what a code flip adds, but not below a floor: the residual is
  bf16 in vLLM, and an update far below its ulp makes any rounding difference a whole-ulp flip.
  Simulated at 512 wide x 36 layers (tools/e2e_margin.py, 1024 scored steps): dense 14 % of
  steps flip; OUT_GAIN 2e-3 with LORA_GAIN 1.0: 0.1-0.2 % without and 0.3-0.4 % with an
  adapter (~15 and ~14 of 16 32-token continuations identical), while an adapter flips 5 %
  of steps (~13 of 16 continuations changed).
  Adapters (PEFT layout, rank r on q/k/v/o/gate/up/down, lora_alpha = r: vLLM folds alpha/r = 1
  into B): A ~ N(0, 1/in) (h = x A^T keeps the input's rms), B ~ N(0, (LORA_GAIN * g)^2 / r)
  with g the projection's gain: each update is LORA_GAIN x its projection's base output.
* ``dense`` (format 1, the runs up to run7): every linear weight and the embeddings N(0, 0.02^2)
  (q_proj's output rms 0.02 * sqrt(4096) ~ 1.3 on a unit-rms input, logits' std ~1.3), adapters'
  A as above and B ~ N(0, 0.02^2) (update ~12 % of q_proj's base output). Every layer matters
  about equally: the stronger test of the teacher-forced log-probabilities against the fp32
  reference (tests/test_e2e_reference.py uses it), useless for greedy identity.

RMSNorm weights are 1 in both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# torch is imported where it is used: tools/e2e_vllm.py's workers import this module without it.

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # CPU tests and pipeline smoke runs (dims multiples of 16 for vLLM's FP8 kernels, head_dim 64 for FA3).
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024),
}
INITS = ("stable", "dense")
DEFAULT_INIT = "stable"
OUT_GAIN = 2e-3    # stable: o/down output rms per unit-rms input (chosen with tools/e2e_margin.py)
LORA_GAIN = 1.0    # stable: an adapter's update rms / its projection's base output rms
DENSE_STD = 0.02   # dense: every linear weight and the embeddings; adapters' B
NUM_ADAPTERS = 8
RANK = 64
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMAT_VERSION = 2  # bump when the generated values change (invalidates cached checkpoints)


def model_config(size: str = "qwen3-8b", layers: int | None = None) -> dict:
    """config.json of a Qwen3 model with the given sizes."""
    s = dict(SIZES[size])
    if layers is not None:
        s["num_hidden_layers"] = layers
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **s,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
            "max_window_layers": s["num_hidden_layers"], "use_sliding_window": False, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": DENSE_STD,
            "use_cache": True, "bos_token_id": min(151643, s["vocab_size"] - 2),
            "eos_token_id": min(151645, s["vocab_size"] - 1)}


def _proj_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of a decoder layer."""
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


OUTPUT_PROJS = ("self_attn.o_proj", "mlp.down_proj")


def _check_init(init: str) -> None:
    if init not in INITS:
        raise ValueError(f"init {init!r}: one of {INITS}")


def _gain(name: str) -> float:
    """Output rms per unit-rms input of a projection's weight (stable init)."""
    return OUT_GAIN if name in OUTPUT_PROJS else 1.0


def checkpoint_entries(cfg: dict, init: str = DEFAULT_INIT) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, shape, std) of every tensor of the checkpoint; std None means all ones (norms)."""
    _check_init(init)
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    dense = init == "dense"
    out = [("model.embed_tokens.weight", (v, h), DENSE_STD if dense else 1.0)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,), None), (p + "post_attention_layernorm.weight", (h,), None),
                (p + "self_attn.q_norm.weight", (hd,), None), (p + "self_attn.k_norm.weight", (hd,), None)]
        out += [(p + name + ".weight", shape, DENSE_STD if dense else _gain(name) * shape[1] ** -0.5)
                for name, shape in _proj_shapes(cfg).items()]
    out += [("model.norm.weight", (h,), None), ("lm_head.weight", (v, h), DENSE_STD if dense else h ** -0.5)]
    return out


def adapter_entries(cfg: dict, rank: int, init: str = DEFAULT_INIT,
                    lora_gain: float = LORA_GAIN) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) of a PEFT adapter's tensors: lora_A [r, in], lora_B [out, r]; with the
    stable init each update is ``lora_gain`` x its projection's base output (rms)."""
    _check_init(init)
    out = []
    for layer in range(cfg["num_hidden_layers"]):
        for name, (n_out, n_in) in _proj_shapes(cfg).items():
            p = f"base_model.model.model.layers.{layer}.{name}."
            b_std = DENSE_STD if init == "dense" else lora_gain * _gain(name) * rank ** -0.5
            out += [(p + "lora_A.weight", (rank, n_in), n_in ** -0.5), (p + "lora_B.weight", (n_out, rank), b_std)]
    return out


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(seed: int, name: str, shape, std: float | None):
    import torch

    if std is None:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=g)


# ----------------------------------------------------------------------------- safetensors

def write_safetensors(path: Path, entries, make, threads: int | None = None, metadata: dict | None = None) -> None:
    """Write ``entries`` [(name, shape, arg)] as bf16 safetensors, tensors made by ``make(name,
    shape, arg)`` on a thread pool (torch's RNG releases the GIL) and written in order."""
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for name, shape, _ in entries:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    threads = threads or min(32, os.cpu_count() or 1)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f, ThreadPoolExecutor(threads) as pool:
        f.write(struct.pack("<Q", len(blob)) + blob)
        pending = []
        for name, shape, arg in entries:
            pending.append(pool.submit(make, name, shape, arg))
            if len(pending) >= 2 * threads:
                f.write(_bytes(pending.pop(0).result()))
        for fut in pending:
            f.write(_bytes(fut.result()))
    os.replace(tmp, path)


def _bytes(t) -> memoryview:
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def read_safetensors(path: Path, names=None) -> tuple[dict, dict]:
    """(header, tensors) of a bf16 safetensors file (tests; no safetensors package needed)."""
    import torch

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base, tensors = 8 + n, {}
        for name, e in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            assert e["dtype"] == "BF16", e
            b0, b1 = e["data_offsets"]
            f.seek(base + b0)
            raw = bytearray(f.read(b1 - b0))
            tensors[name] = torch.frombuffer(raw, dtype=torch.bfloat16).reshape(e["shape"]) if raw else \
                torch.empty(e["shape"], dtype=torch.bfloat16)
    return header, tensors


# ----------------------------------------------------------------------------- model and adapters

def _cached(directory: Path, stamp: dict) -> bool:
    p = directory / "e2e_stamp.json"
    return p.exists() and json.loads(p.read_text()) == stamp


def write_model(directory: Path, size: str = "qwen3-8b", layers: int | None = None, seed: int = 0,
                threads: int | None = None, init: str = DEFAULT_INIT) -> Path:
    """The random checkpoint in ``directory`` (kept when a previous call wrote the same one)."""
    directory = Path(directory)
    cfg = model_config(size, layers)
    entries = checkpoint_entries(cfg, init)
    stamp = {"config": cfg, "seed": seed, "init": init, "format": FORMAT_VERSION}
    if _cached(directory, stamp):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "e2e_stamp.json").unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(directory / "model.safetensors", entries,
                      lambda name, shape, std: make_tensor(seed, name, shape, std), threads)
    (directory / "e2e_stamp.json").write_text(json.dumps(stamp))
    return directory


def write_adapter(directory: Path, size: str = "qwen3-8b", layers: int | None = None, rank: int = 64,
                  seed: int = 1, threads: int | None = None, init: str = DEFAULT_INIT,
                  lora_gain: float = LORA_GAIN) -> Path:
    directory = Path(directory)
    cfg = model_config(size, layers)
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
            "target_modules": list(TARGET_MODULES), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": "e2e-qwen3"}
    entries = adapter_entries(cfg, rank, init, lora_gain)
    stamp = {"config": cfg, "peft": peft, "seed": seed, "init": init, "format": FORMAT_VERSION}
    if lora_gain != LORA_GAIN:  # stamps of the default gain stay as they were (cached adapters reused)
        stamp["lora_gain"] = lora_gain
    if _cached(directory, stamp):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "e2e_stamp.json").unlink(missing_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(peft, indent=1))
    write_safetensors(directory / "adapter_model.safetensors", entries,
                      lambda name, shape, std: make_tensor(seed, name, shape, std), threads)
    (directory / "e2e_stamp.json").write_text(json.dumps(stamp))
    return directory


def fingerprint(path: Path, nbytes: int = 4 << 20) -> str:
    """sha256 (16 hex digits) of a safetensors file's first ``nbytes`` (its header and first
    tensor's values). The generated values come from torch's CPU RNG, whose bf16 ``normal_`` has
    changed between torch versions (pytorch#179834 moved bf16 to the vectorized path): the same
    seed need not give the same checkpoint on another machine; results record this to tell."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(nbytes)).hexdigest()[:16]


# ----------------------------------------------------------------------------- plugin visibility

SHIM_DIST = "epilora_cute-0.0.0.dist-info"
ENTRY_POINT = ("vllm.general_plugins", "epilora_cute", "vllm_adapter.plugin:register")


def make_plugin_shim(directory: Path) -> Path:
    """A minimal installed-distribution record for the plugin's entry point (the repository is not
    pip-installed on the GPU machine). Put ``directory`` and the repository root on PYTHONPATH
    and ``importlib.metadata.entry_points(group="vllm.general_plugins")`` lists the plugin in every
    process vLLM starts (they inherit the environment)."""
    d = Path(directory) / SHIM_DIST
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: epilora-cute\nVersion: 0.0.0\n")
    group, name, value = ENTRY_POINT
    (d / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")
    return Path(directory)


# ----------------------------------------------------------------------------- worker probe

def plain(obj):
    """A copy of ``obj`` made of exactly dict / list / str / int / float / bool / None.

    What a worker returns over ``collective_rpc`` crosses vLLM's msgspec encoder, which refuses
    anything else, subclasses of str included (``torch.__version__`` is a ``TorchVersion``); it
    raises in the engine's output thread, which dies, and the caller waits forever (the first H200
    run). Unknown objects become their ``str``."""
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, dict):
        return {str.__str__(k) if isinstance(k, str) else str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    return str(obj)


def not_plain(obj, where: str = "result") -> list[str]:
    """Where ``obj`` holds something other than the exact plain JSON types (empty: nothing)."""
    if obj is None or type(obj) in (bool, int, float, str):
        return []
    if type(obj) is dict:
        bad = [f"{where} key {k!r} ({type(k).__name__})" for k in obj if type(k) is not str]
        return bad + [b for k, v in obj.items() for b in not_plain(v, f"{where}[{k!r}]")]
    if type(obj) is list:
        return [b for i, v in enumerate(obj) for b in not_plain(v, f"{where}[{i}]")]
    return [f"{where}: {type(obj).__module__}.{type(obj).__qualname__}"]


def kernel_summary(events) -> dict:
    """GPU kernels of a torch.profiler recording: per kernel name the count, total µs and the idle
    time right before its kernels (the GPU ran nothing between the end of everything before and
    its start: launch latency, host waits), the busy time (union of kernel intervals) and the span
    from the first kernel's start to the last one's end. ``events``: FunctionEvents
    (``prof.events()``); those without device time are host-side and skipped."""
    kernels = []
    for ev in events:
        dt = getattr(ev, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        t0, t1 = ev.time_range.start, ev.time_range.end
        if t1 > t0:
            kernels.append((t0, t1, ev.name))
    per: dict[str, list] = {}
    busy, end = 0.0, None
    for t0, t1, name in sorted(kernels):
        e = per.setdefault(name[:120], [0, 0.0, 0.0])
        e[0] += 1
        e[1] += t1 - t0
        if end is None or t0 >= end:
            if end is not None:
                e[2] += t0 - end
            busy += t1 - t0
            end = t1
        elif t1 > end:
            busy += t1 - end
            end = t1
    span = (max(k[1] for k in kernels) - min(k[0] for k in kernels)) if kernels else 0.0
    return {"n_kernels": len(kernels), "busy_us": busy, "span_us": span,
            "kernels": {k: {"count": c, "total_us": t, "gap_before_us": g} for k, (c, t, g) in per.items()}}


class GcProbe:
    """The garbage collector's passes in this process (``gc.callbacks``), read and reset together:
    per generation the count and milliseconds, the longest pass. Installed on the first read."""

    def __init__(self):
        self.installed = False
        self._t0 = None
        self._reset()

    def _reset(self):
        self.passes, self.ms, self.max_ms = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = 1e3 * (time.perf_counter() - self._t0)
            g = min(max(int(info.get("generation", 2)), 0), 2)
            self.passes[g] += 1
            self.ms[g] += dt
            self.max_ms = max(self.max_ms, dt)
            self._t0 = None

    def read(self) -> dict:
        import gc

        if not self.installed:
            gc.callbacks.append(self._callback)
            self.installed = True
        out = {"passes": list(self.passes), "ms": [round(v, 3) for v in self.ms], "max_ms": round(self.max_ms, 3),
               "frozen": gc.get_freeze_count(), "counts": list(gc.get_count())}
        self._reset()
        return out


_GC_PROBE = GcProbe()


class HostProbe:
    """Where the engine process's host time goes, read and reset per run (run48: ours' TTFT
    samples sit at one level for ~1 s at a time, 39-71 ms without adapter, stock's at 40-47; is
    the level in the forward's host code, in the plugin's op, in the wait for the GPU, or outside
    the model?). Per run, wall and this thread's CPU time (``time.thread_time``: a thread waiting
    for the GIL, the GPU or the OS scheduler spends wall time but no CPU time) of:

    * ``step``: the worker's ``execute_model`` (the forward: a prefill outside CUDA graphs is
      launched from Python here, so a host-bound prefill is long here);
    * ``sample``: the worker's ``sample_tokens`` (vLLM 0.26 samples in a second call; it waits
      for the forward's kernels the host ran ahead of);
    * ``op``: the plugin's computation inside the registered op (``vllm_adapter.fused``'s two
      entries that ``custom_op._impl`` calls by module attribute; the outermost call counts).

    Installed on the first read (``install``): the worker instance's methods are shadowed by timed
    wrappers (vLLM's wrapper calls ``self.worker.execute_model``; ``sample_tokens`` is found
    through its ``__getattr__``), the module's functions replaced. Two timer reads per call."""

    WORKER_METHODS = ("execute_model", "sample_tokens")
    OP_ENTRIES = ("lora_linear_fp8", "base_linear_fp8")
    PARTS = ("step", "sample", "op")
    FIELDS = ("calls", "ms", "cpu_ms", "max_ms")  # per part in each reading

    def __init__(self):
        self.installed = False
        self._op_depth = 0
        self._restore: list = []
        self._reset()

    def _reset(self):
        self.calls = dict.fromkeys(self.PARTS, 0)
        self.ms = dict.fromkeys(self.PARTS, 0.0)
        self.cpu_ms = dict.fromkeys(self.PARTS, 0.0)
        self.max_ms = dict.fromkeys(self.PARTS, 0.0)

    def _add(self, part: str, wall_s: float, cpu_s: float) -> None:
        self.calls[part] += 1
        self.ms[part] += 1e3 * wall_s
        self.cpu_ms[part] += 1e3 * cpu_s
        self.max_ms[part] = max(self.max_ms[part], 1e3 * wall_s)

    def _timed(self, part: str, fn):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            outer = part != "op" or self._op_depth == 0
            if part == "op":
                self._op_depth += 1
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if part == "op":
                    self._op_depth -= 1
                if outer:
                    self._add(part, time.perf_counter() - w0, time.thread_time() - c0)

        timed.__wrapped_by_host_probe__ = True
        return timed

    def install(self, worker) -> None:
        """Wrap ``worker``'s step methods and the plugin's op entries (once; what is missing — a
        vLLM without ``sample_tokens``, an engine without the plugin — is left out)."""
        if self.installed:
            return
        self.installed = True
        for name in self.WORKER_METHODS:
            fn = getattr(worker, name, None)
            if callable(fn) and not getattr(fn, "__wrapped_by_host_probe__", False):
                part = "step" if name == "execute_model" else "sample"
                had = name in getattr(worker, "__dict__", {})
                setattr(worker, name, self._timed(part, fn))
                self._restore.append((worker, name, fn if had else None))
        try:
            from vllm_adapter import fused
        except Exception:  # noqa: BLE001 - no plugin in this engine's environment: no op rows
            fused = None
        for name in self.OP_ENTRIES if fused is not None else ():
            fn = getattr(fused, name, None)
            if callable(fn) and not getattr(fn, "__wrapped_by_host_probe__", False):
                setattr(fused, name, self._timed("op", fn))
                self._restore.append((fused, name, fn))

    def uninstall(self) -> None:
        """Put back what ``install`` replaced (tests; an engine keeps the probe until it exits)."""
        for obj, name, fn in reversed(self._restore):
            if fn is None:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)
        self._restore.clear()
        self.installed = False

    def read(self, worker=None) -> dict:
        if not self.installed and worker is not None:
            self.install(worker)
        out = {p: {"calls": self.calls[p], "ms": round(self.ms[p], 3), "cpu_ms": round(self.cpu_ms[p], 3),
                   "max_ms": round(self.max_ms[p], 3)} for p in self.PARTS}
        self._reset()
        return out


_HOST_PROBE = HostProbe()


class WorkerProbe:
    """Mixed into vLLM's GPU worker (``LLM(worker_extension_cls="tools.e2e_model.WorkerProbe")``);
    ``llm.collective_rpc("e2e_lora_layers")`` returns, from inside the engine, which class each
    LoRA layer got and which kernel path the plugin routes to, as plain JSON types (``plain``)."""

    def e2e_lora_layers(self) -> dict:
        return plain(self._e2e_lora_layers())

    def e2e_gc_read(self) -> dict:
        """The garbage collector's passes in the engine process (where the model and the plugin
        run) since the previous call (``GcProbe``; the first call installs the hook)."""
        return plain(_GC_PROBE.read())

    def e2e_host_read(self) -> dict:
        """The engine process's host time since the previous call: the worker's steps, its
        sampling calls and the plugin's op, wall and CPU (``HostProbe``; the first call installs
        the timers on this worker)."""
        return plain(_HOST_PROBE.read(self))

    def e2e_profile_start(self) -> bool:
        """Start recording the GPU's kernels in this worker (torch.profiler, CUDA activity only:
        kernels replayed from CUDA graphs included)."""
        import torch

        act = torch.profiler.ProfilerActivity
        # without a GPU (the stand-in engine of the tests) a CPU recording: no kernels in it
        prof = torch.profiler.profile(activities=[act.CUDA if torch.cuda.is_available() else act.CPU])
        prof.__enter__()
        self._e2e_prof = prof
        return True

    def e2e_profile_stop(self) -> dict:
        """Stop the recording; what ``kernel_summary`` makes of it."""
        prof = self.__dict__.pop("_e2e_prof", None)
        if prof is None:
            return {"error": "e2e_profile_start was not called"}
        prof.__exit__(None, None, None)
        return plain(kernel_summary(prof.events()))

    def _e2e_lora_layers(self) -> dict:
        import torch

        model = self.get_model()
        classes: dict[str, int] = {}
        epi = active = 0
        for _, mod in model.named_modules():
            name = type(mod).__name__
            if "WithLoRA" in name or "WithShardedLoRA" in name:
                classes[name] = classes.get(name, 0) + 1
                if name.startswith("EpiLoRA"):
                    epi += 1
                    active += bool(getattr(mod, "_epilora_active", False))
        device = next(model.parameters()).device
        out = {"lora_classes": classes, "epilora_layers": epi, "epilora_active": active,
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
               "torch": torch.__version__, "env": {k: v for k, v in os.environ.items() if k.startswith("EPILORA_")}}
        try:
            from tools.gpu_timing import machine_facts

            out["machine"] = machine_facts()
        except Exception as e:  # a probe never fails the run
            out["machine"] = {"error": f"{type(e).__name__}: {e}"}
        runner = getattr(self, "model_runner", None)
        out["model_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
        try:
            from vllm_adapter import fused, plugin

            out["kernel_path"] = fused.kernel_path(device) if plugin.is_registered() else "plugin not registered"
        except Exception as e:  # the plugin is not importable
            out["kernel_path"] = f"unknown ({type(e).__name__}: {e})"
        tp = sys.modules.get("vllm_adapter.triton_path")
        if tp is not None:  # tables made inside a capture: 0 when create_lora_weights prepared them all
            out["triton_tables"] = {"kept_for_graphs": len(tp._GRAPH_TABLES), "eager_cache": len(tp._TABLE_CACHE),
                                    "made_inside_a_capture": len(tp._CAPTURE_ONLY)}
        if out["kernel_path"] == "cute":  # epilora_cute.ops.lora_linear_fp8, path="auto"
            from epilora_cute import dispatch

            paths = [p for p in dispatch.DEFAULT_ORDER if p != "reference"]
            out["ops_auto_path"] = "timed dispatch among " + ", ".join(p for p in paths if dispatch.path_allowed(p))
        return out
