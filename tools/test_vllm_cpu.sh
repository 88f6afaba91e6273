#!/usr/bin/env bash
# The vLLM plugin tests against vLLM's real classes on the CPU: makes .venv-vllm when needed
# (tools/install_vllm_cpu.sh, cached) and runs tests/test_vllm_*.py in it. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_vllm_cpu.sh
exec "${EPILORA_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_logic.py tests/test_vllm_plugin.py "$@"
