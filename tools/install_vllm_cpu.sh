#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's Python code importable on a CPU machine, for tests/test_vllm_plugin.py.
# Idempotent and cached: a stamp of this script skips everything when the venv is up to date.
#
# Why not `pip install vllm`: vLLM 0.26.0 pins torch==2.11.0 plus CUDA-only packages (flashinfer,
# cutlass-dsl[cu13], ...), several GB of CUDA wheels. The plugin tests need only vLLM's Python
# modules (LoRA layers, linear layers, FP8 quant methods, punica wrappers, plugin loader), so:
#   * torch: the CPU wheel this machine kind keeps on disk (torch==2.13.0, no download);
#   * vllm: its wheel with --no-deps (its compiled extensions are unused: vllm._C does not load
#     without CUDA, and vLLM's Python code catches that);
#   * the pure-Python packages vLLM's import chain needs (found by importing until nothing was
#     missing), with vLLM's own version bounds where it declares one; xgrammar without its
#     dependencies (it would pull triton, 1 GB; vLLM only imports it).
# Env: PYTHON (python3), EPILORA_VLLM_VENV (.venv-vllm), EPILORA_VLLM_SPEC (vllm==0.26.0; the
#      same list installs vllm==0.33.0 and vllm==0.34.0, the newest supported release), EPILORA_TORCH_SPEC (torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EPILORA_VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${EPILORA_VLLM_SPEC:-vllm==0.26.0}
TORCH_SPEC=${EPILORA_TORCH_SPEC:-torch==2.13.0}
IMPORT_DEPS=(
  numpy packaging regex "transformers>=5.5.3" cbor2 psutil "pyzmq>=25.0.0" urllib3 "aiohttp>=3.13.3"
  requests "openai>=2.0.0" "openai-harmony>=0.0.3" einops pillow pybase64 cachetools msgspec cloudpickle
  uvloop py-cpuinfo "prometheus_client>=0.18.0" "llguidance>=1.7.0,<1.8.0" "compressed-tensors==0.17.0"
  apache-tvm-ffi fastapi partial-json-parser   # (the last three for vLLM 0.33's import chain)
  "pytest>=8"
)
STAMP=$( (cat "$0"; echo "$VLLM_SPEC $TORCH_SPEC $PY") | sha256sum | cut -c1-16)
CHECK="import vllm.lora.utils, vllm.lora.layers, vllm.lora.punica_wrapper.punica_cpu, \
vllm.lora.ops.triton_ops.lora_kernel_metadata, vllm.model_executor.layers.quantization.fp8, \
vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors, vllm.plugins, \
epilora_cute, vllm_adapter.plugin"

pipq() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v -e '^WARNING: Location' -e 'which is incompatible' \
  -e 'requires .*, which is not installed' -e "pip's dependency resolver" || true; }

# The stamp is written only after the import check passed, so it alone means "up to date".
if [[ -f $VENV/.stamp && $(cat "$VENV/.stamp") == "$STAMP" && -x $VENV/bin/python ]]; then
  exit 0
fi
echo "[install_vllm_cpu] creating $VENV ($VLLM_SPEC, $TORCH_SPEC)" >&2
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pipq --upgrade pip
pipq "$TORCH_SPEC"
pipq --no-deps "$VLLM_SPEC"
pipq "${IMPORT_DEPS[@]}"
pipq --no-deps "xgrammar>=0.2.1,<1.0.0"
pipq --no-deps -e . >/dev/null   # the entry point vLLM's plugin loader looks for
"$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1 || { echo "[install_vllm_cpu] $VENV is broken:" >&2; "$VENV/bin/python" -c "$CHECK"; exit 1; }
echo "$STAMP" > "$VENV/.stamp"
echo "[install_vllm_cpu] done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
