#!/usr/bin/env bash
# The slim carry cache (docs/gpu_record/README.md): .gpu_carry/.epilora_cache (`make carry-cache`)
# without the prefill K2, the trace builds and the adapter ranks other than 64, into
# .gpu_carry/slim/.epilora_cache, so that it fits one device call beside .devvllm/2; then every
# build it should hold is looked up as the GPU machine will (tools/carry_cache.py: a failing check
# lists what is missing, before any device time is spent). `--with-prefill` keeps the prefill K2's
# rank-64 and no-adapter builds (what `gpu_session.sh prefill-k2` runs). On the device, start the
# command with
#   mkdir -p .gpu_carry && ln -sfn $PWD/.gpu_carry/slim/.epilora_cache .gpu_carry/.epilora_cache &&
# (tools/gpu_session.sh then finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python tools/carry_cache.py slim "$@"
