#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environments; idempotent and cheap when up to date.
#   .venv        torch (CPU build on CPU machines), nvidia-cutlass-dsl 4.8.x, cuda-python, triton,
#                pytest (+ pytest-xdist: the tests run one worker per core), the package itself (editable)
#   .venv-dsl46  the same with nvidia-cutlass-dsl[cu13]==4.6.0 (vLLM 0.26's pin): the compile
#                tests check every kernel builds with it too. Skip with EPILORA_SKIP_DSL46=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${EPILORA_TORCH_SPEC:-torch==2.13.0}   # the CPU wheel this machine kind keeps on disk
stamp_of() { cat pyproject.toml tools/setup_env.sh | sha256sum | cut -c1-16; }
STAMP=$(stamp_of)

make_venv() {  # dir, dsl spec
  local dir=$1 dsl=$2
  if [[ -f $dir/.stamp && $(cat "$dir/.stamp") == "$STAMP" ]]; then return 0; fi
  echo "[setup] creating $dir ($dsl)" >&2
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$dir/bin/python" -m pip install -q "$TORCH_SPEC" 2>&1 | grep -v '^WARNING: Location' || true
  "$dir/bin/python" -m pip install -q "$dsl" "cuda-python>=12.6" filelock "pytest>=8" "pytest-xdist>=3.5" "triton>=3.4,<4" numpy \
    2>&1 | grep -v '^WARNING: Location' || true
  "$dir/bin/python" -m pip install -q --no-deps -e . 2>&1 | grep -v '^WARNING: Location' || true
  "$dir/bin/python" -c "import torch, cutlass, cuda.bindings.driver, epilora_cute" \
    || { echo "[setup] $dir is broken" >&2; exit 1; }
  echo "$STAMP" > "$dir/.stamp"
}

make_venv .venv "nvidia-cutlass-dsl>=4.8,<5"
if [[ ${EPILORA_SKIP_DSL46:-0} != 1 ]]; then
  make_venv .venv-dsl46 "nvidia-cutlass-dsl[cu13]==4.6.0"
fi
