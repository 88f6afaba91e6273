#!/usr/bin/env bash
# The baseline side of a GPU A/B (`tools/gpu_session.sh ab`): .gpu_carry/base is this working
# tree's Python (runtime, kernels, tools) with the changed files taken back from a base commit, so
# that the two sides differ in those files only — the bench and its harness are the same code.
#   bash tools/base_tree.sh <base commit> <changed file>...
#   e.g. bash tools/base_tree.sh HEAD kernels_dsl/expand_add.py
# The carried cache must hold both sides' builds (they are keyed by their module's source, so both
# fit in one cache directory): `make carry-cache` + `tools/slim_cache.sh` builds the head side;
# copy the base side's entries in from a cache built at the base commit.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?base commit}
shift
(($#)) || { echo "name the changed files" >&2; exit 2; }
dest=.gpu_carry/base
rm -rf "$dest" && mkdir -p "$dest"
cp -r epilora_cute kernels_dsl tools vllm_adapter pyproject.toml "$dest"/
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
for f in "$@"; do
  git show "$base:$f" > "$dest/$f"
done
echo "$dest: this tree with $* from $(git rev-parse --short "$base") ($(du -sh "$dest" | cut -f1))"
