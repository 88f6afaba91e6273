#!/usr/bin/env bash
# The slim carry cache (docs/gpu_record/README.md): .gpu_carry/.epilora_cache (`make carry-cache`)
# without the prefill K2, the trace builds and the adapter ranks other than 64, into
# .gpu_carry/slim/.epilora_cache (~25 MB), so that it fits one device call beside .devvllm/2.
# On the device, start the command with
#   mkdir -p .gpu_carry && ln -sfn $PWD/.gpu_carry/slim/.epilora_cache .gpu_carry/.epilora_cache &&
# (tools/gpu_session.sh then finds it). `--with-prefill` keeps the prefill K2's rank-64 and
# no-adapter builds (what `gpu_session.sh prefill-k2` runs); its other GPU tests need the full cache.
set -euo pipefail
cd "$(dirname "$0")/.."
src=.gpu_carry/.epilora_cache
[[ -d $src ]] || { echo "no $src: run make carry-cache first" >&2; exit 1; }
rm -rf .gpu_carry/slim && mkdir -p .gpu_carry/slim && cp -r "$src" .gpu_carry/slim/
[[ ${1:-} == --with-prefill ]] || rm -rf .gpu_carry/slim/.epilora_cache/*/k2_fp8_prefill
find .gpu_carry/slim/.epilora_cache -mindepth 3 -maxdepth 3 -type d \
  \( -name '*trace*' -o -name '*_r8_*' -o -name '*_r16_*' -o -name '*_r32_*' -o -name '*_r128_*' -o -name '*_r256_*' \) \
  -exec rm -rf {} +
du -sh .gpu_carry/slim/.epilora_cache
