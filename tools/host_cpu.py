"""The host time of one eager LoRA projection call, measured on a machine without a GPU.

The op's Python (validation, path selection, launch specs, parameter packing) runs as on the
H200; only what needs a GPU is faked: the device queries (arch, stream, capture), the module load,
the TMA descriptor encoding and ``cuLaunchKernelEx`` itself (counted, not run). The cached kernel
artifacts (``make prebuild``) supply the real parameter declarations, so the packed bytes are the
ones a GPU launch would get. Absolute numbers are this CPU's (the H200 machine's host measured
~3-4x slower per call in run22/run23); the point is to compare versions of the host code here,
before a GPU session confirms the gain with ``bench.py --sections launch``.

    python3 tools/host_cpu.py [--paths decode_sq,decode,hybrid,auto:decode_sq,plugin_none,plugin:hybrid,...]
                              [--tokens 1,64]
                              [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _FakeStream:
    cuda_stream = 0

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, ev) -> None:
        pass


@contextlib.contextmanager
def gpu_faked(launches: list | None = None):
    """Patch what needs a GPU so the ops' host code runs on CPU tensors as if on an sm_90a device."""
    from epilora_cute import arch, launcher, ops
    from kernels_dsl import _abi

    real = launcher._driver()
    success = (real.CUresult.CUDA_SUCCESS,)

    def launch(cfg, fn, params, extra):
        if launches is not None:
            launches.append((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ))
        return success

    drv = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    drv.cuLaunchKernelEx = launch
    stream = _FakeStream()
    patches = [
        (launcher, "_driver", lambda: drv),
        (launcher.Kernel, "_load", lambda self: (0, launcher._Loaded(None, None))),
        (launcher.Kernel, "_ensure_attrs", lambda self, *a: None),
        (_abi, "encode_tensormap", lambda t, spec, *a, **k: bytes(128)),
        (ops, "arch_of", lambda t: "sm_90a"),
        (arch, "arch_of", lambda t: "sm_90a"),
        (ops, "_on_gpu", lambda t: True),
        (torch.cuda, "current_stream", lambda *a, **k: stream),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "is_current_stream_capturing", lambda: False),
        (torch.cuda, "Stream", lambda *a, **k: _FakeStream()),
        (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        (torch.cuda, "Event", lambda *a, **k: types.SimpleNamespace(record=lambda *a: None)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, val in patches:
            setattr(obj, name, val)
        yield
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)


def _vendor_gemm_faked(x_q, x_scale, w_q, w_scale, out=None):
    return out


def engine_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight as the plugin's op receives it in vLLM's compiled graph: a new tensor on the
    weight's storage on every call, without a ``_base`` (Inductor's view of ``weight.t()``;
    tests/test_ops.py::test_layer_key_survives_inductors_fresh_weight_tensors). The "plugin" rows
    pass one, so that what the ops memoize by identity is measured as the engine meets it
    (session 49: before ops._layer_key keyed the weight by plain values, every engine call missed
    the layer's memos: 109 against 81 µs here)."""
    return torch.empty(0, dtype=w.dtype, device=w.device).set_(w.untyped_storage(), w.storage_offset(), w.shape,
                                                               w.stride())


def host_us(call, reps: int = 300, rounds: int = 7) -> float:
    """The mean host time per call (µs) of the fastest of `rounds` rounds."""
    for _ in range(20):
        call()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        per.append((time.perf_counter() - t0) / reps * 1e6)
    return min(per)  # the least disturbed round: this is a shared 2-core machine


@contextlib.contextmanager
def dispatch_decided(path: str):
    """path="auto" as in a warmed-up engine: the process's dispatcher (a throw-away table) has
    decided every key for ``path`` (its fake timer ranks ``path`` first), no bucket warm-up."""
    import tempfile

    from epilora_cute import bucket_warmup, dispatch

    def timer(fn, mode):
        return 1.0 if fn.args[0] == path else 2.0

    with tempfile.TemporaryDirectory() as tmp:
        saved = (dispatch._default, dispatch._device_name, bucket_warmup.enabled)
        dispatch.set_dispatcher(dispatch.Dispatcher(dispatch.DispatchTable(Path(tmp) / "dispatch.json"), timer))
        dispatch._device_name = lambda index: "NVIDIA H200 (faked)"
        bucket_warmup.enabled = lambda: False
        try:
            yield
        finally:
            dispatch.set_dispatcher(saved[0])
            dispatch._device_name, bucket_warmup.enabled = saved[1], saved[2]


@contextlib.contextmanager
def plugin_op(decided: str = "base"):
    """The plugin's registered op (``vllm_adapter.custom_op``) as vLLM's compiled graph calls it,
    with the CuTe op taken as this device's kernel path and the dispatch decided for ``decided``."""
    from vllm_adapter import fused

    saved = fused.kernel_path
    fused.kernel_path = lambda device: "cute"
    try:
        with dispatch_decided(decided):  # where the op still asks the dispatch
            yield
    finally:
        fused.kernel_path = saved


def measure(paths, tokens, profile: bool = False) -> list[dict]:
    """Host µs per call of each path ("auto:<path>": through the timed dispatch, decided for
    <path>; "plugin_none": the plugin's op on a batch vLLM flagged as having no adapter;
    "plugin:<path>": the plugin's op on a batch with adapters, the dispatch decided for <path>) at
    each token count."""
    from epilora_cute import ops
    from tools.bench import host_profile
    from tools.bench_decode import QWEN3_8B, LayerCase
    from vllm_adapter import custom_op

    no_lora_flag = torch.ones(1, dtype=torch.bool)
    lora_flag = torch.zeros(1, dtype=torch.bool)

    rows = []
    launches: list = []
    with gpu_faked(launches):
        saved_gemm = ops.vendor_fp8_gemm
        ops.vendor_fp8_gemm = _vendor_gemm_faked  # the hybrid paths' vendor GEMM: a torch op on the GPU
        try:
            for m in tokens:
                c = LayerCase(QWEN3_8B[0], m, 64, device="cpu")
                for name in paths:
                    path, _, decided = name.partition(":")

                    if path == "plugin_none":
                        def call():
                            custom_op.lora_linear_fp8(c.x, engine_weight(c.w_q), c.w_s, c.lora_a, c.lora_b, c.meta,
                                                      no_lora_flag_cpu=no_lora_flag)
                        ctx = plugin_op()
                    elif path == "plugin":
                        def call():
                            custom_op.lora_linear_fp8(c.x, engine_weight(c.w_q), c.w_s, c.lora_a, c.lora_b, c.meta,
                                                      no_lora_flag_cpu=lora_flag)
                        ctx = plugin_op(decided or "hybrid")
                    else:
                        def call():
                            ops.lora_linear_fp8(c.x, c.w_q, c.w_s, c.lora_a, c.lora_b, c.meta, out=c.y, path=path)
                        ctx = dispatch_decided(decided) if decided else contextlib.nullcontext()
                    try:
                        ctx.__enter__()
                        launches.clear()
                        call()
                        n = len(launches)
                        row = {"path": name, "tokens": m, "launches": n, "host_us": host_us(call)}
                        if profile:
                            row["host_profile"] = host_profile(call, reps=200, top=12)
                    except Exception as e:  # noqa: BLE001 - a path that does not apply is reported
                        row = {"path": name, "tokens": m, "error": f"{type(e).__name__}: {e}"[:160]}
                    finally:
                        ctx.__exit__(None, None, None)
                    rows.append(row)
        finally:
            ops.vendor_fp8_gemm = saved_gemm
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="decode_sq,decode,no_adapter,hybrid,hybrid_par,auto:decode_sq,auto:hybrid")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.paths.split(","), [int(t) for t in args.tokens.split(",")], args.profile)
    for r in rows:
        if "error" in r:
            print(f"{r['path']:>14} M={r['tokens']:<5} {r['error']}")
            continue
        print(f"{r['path']:>14} M={r['tokens']:<5} host {r['host_us']:7.1f} us/call ({r['launches']} launches)")
        for fn, n, own, cum in r.get("host_profile", [])[:12]:
            print(f"    {own:7.1f} us own, {cum:7.1f} cumulative, {n:5.1f} calls  {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
