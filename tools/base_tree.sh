#!/usr/bin/env bash
# The baseline side of a GPU A/B (`tools/gpu_session.sh ab`): .gpu_carry/base is this working
# tree's Python (runtime, kernels, tools) with the changed files taken back from a base commit, so
# that the two sides differ in those files only — the bench and its harness are the same code.
#   bash tools/base_tree.sh [--family F]... <base commit> <changed file>...
#   e.g. bash tools/base_tree.sh --family expand_add HEAD kernels_dsl/expand_add.py
# The carried cache must hold both sides' builds (they are keyed by their module's source, so both
# fit in one cache directory): `make carry-cache` + `tools/slim_cache.sh` for the head side, then
# each --family compiles that family in the base tree and merges its slim set (rank 64) into
# .gpu_carry/slim (`tools/carry_cache.py add`). Run it after slim_cache.sh, which starts afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
families=()
while [[ ${1:-} == --family ]]; do
  families+=("${2:?--family needs a name}")
  shift 2
done
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
if ((${#families[@]})); then
  slim=$PWD/.gpu_carry/slim/.epilora_cache
  [[ -d $slim ]] || { echo "no $slim: tools/slim_cache.sh first" >&2; exit 1; }
  build=$PWD/.gpu_carry/base_build
  py=$PWD/.venv/bin/python
  args=()
  for fam in "${families[@]}"; do args+=(--family "$fam"); done
  (cd "$dest" && EPILORA_QUIET_BUILD=1 "$py" -m epilora_cute.prebuild --arch sm_90a --cache-dir "$build" "${args[@]}" \
    --jobs 0 > /dev/null)
  (IFS=,; cd "$dest" && "$py" tools/carry_cache.py add "$build" "$slim" --families "${families[*]}")
fi
