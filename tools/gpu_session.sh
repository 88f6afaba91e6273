#!/usr/bin/env bash
# The device calls of one GPU session, as commands (docs/gpu_record/README.md explains the plan).
#   call A (carry .devvllm/1):                    nvidia-smi -L
#   call B (carry .devvllm/2 .epilora_cache):     bash tools/gpu_session.sh record <commit>   (~8 min)
#   call C (carry .epilora_cache, machine warm):  bash tools/gpu_session.sh tests <commit>    (~9 min)
#                                       then:     bash tools/gpu_session.sh tests-rest <commit> (~4 min)
#   call D (carry .epilora_cache, machine warm):  bash tools/gpu_session.sh e2e <commit> [e2e_vllm.py args] (~9 min)
#   or, after call A, one call (carry .devvllm/2 .epilora_cache): bash tools/gpu_session.sh check <commit>
#   (~6.5 min: diagnostics, racecheck, layer + stages, the decode path's GPU test files)
#   e2e smoke (carry .devvllm/2 after call A, or none on a machine where vLLM is unpacked):
#                                                 bash tools/gpu_session.sh e2e-smoke <commit> (~4-5 min)
#   after call A, carry .devvllm/2 .gpu_carry/.epilora_cache (the next-session plan, ~5-6 min each):
#                                                 bash tools/gpu_session.sh hybrid-identity <commit>
#                                                 bash tools/gpu_session.sh e2e-perf <commit>
#                                                 bash tools/gpu_session.sh out-variant <commit>
#   fp32 reference for a recorded e2e run, no vLLM needed (carry nothing):
#                                                 bash tools/gpu_session.sh e2e-rescore <commit> [E2E_JSON] (~1-2 min)
# A call carries <= 64 MiB with the working tree: with .devvllm/2 (29 MB) carry a cache subset,
# e.g. `python tools/carry_cache.py slim --families k1_quant_shrink,k2_fp8_prefill,expand_add,fp8_quant,lora_shrink_quant`
# (run27: 24 MB) or `slim` (rank 64 only, 12 MB), copied to .gpu_carry/.epilora_cache, and move
# docs/gpu_record (15 MB) out of the tree for the call.
# Each call stays under the device's 10-minute limit; B, C and D each write one report.
# Everything goes to $OUT (the device returns at most 8 files from it).
set -uo pipefail
mode=${1:?xgate, record, tests, ab, warmup-time, ttft, priority, race, race-tests, race-rest, stream, grouped, tt, tt-diag, layer-parts, tests-rest, e2e, e2e-smoke, e2e-rescore, check, verify, hybrid-identity, e2e-perf, out-variant, profile, profile-decode, k1, h-bf16, retune, prefetch, decode, push-tests, push-bench, wide-tests, wide-bench, fh, prefill-k2 or prefill-path}
export EPILORA_GIT_COMMIT=${2:-unknown}
# The carried cache: .gpu_carry/.epilora_cache (cubins + meta only, `make carry-cache`) when present.
cache=$PWD/.epilora_cache; [[ -d .gpu_carry/.epilora_cache ]] && cache=$PWD/.gpu_carry/.epilora_cache
export EPILORA_CACHE_DIR=$cache PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
# The engines' compilation settings of every e2e run since run7 (our op and stock both quantize
# with a CUDA kernel; Inductor's norm/act + quant fusions off, they would bypass both).
E2E_CC='compilation_config={"custom_ops":["+quant_fp8"],"pass_config":{"fuse_norm_quant":false,"fuse_act_quant":false}}'
# An Nsight Compute report DIR/prof.ncu-rep as text (what tools/ncu_summary.py reads): the details
# page of every launch and each launch's SASS with its stall samples.
ncu_text_exports() {
  ncu -i "$1/prof.ncu-rep" --page details > "$1/details.txt" 2>&1
  local n i
  n=$(grep -c '^  [A-Za-z_].*(.*)x(.*)' "$1/details.txt" || true)
  for ((i = 0; i < ${n:-0}; i++)); do
    ncu -i "$1/prof.ncu-rep" --page source --csv --print-source sass --launch-skip $i --launch-count 1 \
      > "$1/sass_$i.csv" 2>&1
  done
}
unpack_vllm() {
  if ! python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' 2> /dev/null \
      && [[ -f .devvllm/2/unpack.sh ]]; then
    timeout -s KILL 80 bash .devvllm/2/unpack.sh > /tmp/unpack.log 2>&1 || echo "vLLM unpack failed"
  fi
}
case $mode in
  xgate)
    # v1.03 (the x-gated decode_sq pair, EPILORA_K2_XGATE; carry the slim cache, and .devvllm/2 after
    # call A for vLLM's layer anchors; ~5 min): its GPU tests (chained sequences bit for bit the
    # unchained ones, eager and in a CUDA graph, one projection back to back) beside the chain and
    # decode tests, then the layer at 1 / 2 / 4 / 8 tokens with decode_sq_chain and
    # decode_sq_xg_chain side by side, then at 1 / 4 tokens in the engine's order (a foreign kernel
    # before every projection, EPILORA_BENCH_FOREIGN=1). Then the e2e with
    # `--ours-env EPILORA_K2_XGATE=1` in a call of its own.
    unpack_vllm
    # One small chain first (a hang here costs 30 s, not the test file's limit), then racecheck.
    timeout -s KILL 30 python3 tools/kernel_diag.py decode_xgate 1 2>&1 | tail -2 | tee "$OUT/tests.log"
    timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py decode_xgate 1 2>&1 | tail -4 | tee -a "$OUT/tests.log"
    timeout -s KILL 180 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py \
      -k "xgate or chained or decode_path_matches or bitwise" 2>&1 | tail -5 | tee -a "$OUT/tests.log"
    EPILORA_BENCH_TOKENS=1,2,4,8 EPILORA_BENCH_OURS=no_adapter_chain,decode_sq_chain,decode_sq_xg_chain \
      timeout -s KILL 110 python3 tools/bench.py --quick --sections layer --out "$OUT/ly" 2>&1 | tail -8
    EPILORA_BENCH_FOREIGN=1 EPILORA_BENCH_TOKENS=1,4 EPILORA_BENCH_OURS=no_adapter_chain,decode_sq_chain,decode_sq_xg_chain \
      timeout -s KILL 80 python3 tools/bench.py --quick --sections layer --out "$OUT/lyf" 2>&1 | tail -8
    (cd "$OUT" && tar czf xgate.tgz ly lyf 2> /dev/null && rm -rf ly lyf)
    ;;
  warmup-time)
    # v1.01: the dispatch's bucket warm-up per Qwen3-8B projection, rounds on fresh tables with and
    # without the CUDA-graph limit (round 0 pays the first-use compiles: compare rounds 1 and 2);
    # the slim cache is enough, no vLLM (~2-3 min on an H100).
    timeout -s KILL 400 python3 tools/warmup_time.py --capacity "${WARMUP_CAPACITY:-4096}" \
      --order "${WARMUP_ORDER:-limit,none,limit}" --out "$OUT" 2>&1 | grep -v -i warning | tail -20
    ;;
  ttft)
    # Ours' TTFT scatter (session 48's plan): stock, then ours, one engine at a time, the TPOT/TTFT
    # runs with the engine's GC passes and the profile phase's prefill runs with their idle gaps
    # (carry .devvllm/2 and the slim cache after a call that carried .devvllm/1; ~6-8 min).
    unpack_vllm
    timeout -s KILL 515 python3 tools/e2e_vllm.py --out "$OUT" --sequential --phases tpot,profile --reps 8 \
      --time-budget 480 --engine-arg "$E2E_CC" "${@:3}" 2>&1 | tail -60
    ;;
  hybrid-identity)
    # perf.md v0.19 (the hybrid rows under the read flush, K1 / expand-add at every group split)
    # and v0.17's experiment (greedy identity with Inductor's numerics-changing autotuning off in
    # both engines), one archive each.
    unpack_vllm
    # `stages` too: its k2_fixed rows (K2 on one k-block per CTA) are the decode path's fixed cost.
    EPILORA_BENCH_ZSWEEP=1 timeout -s KILL 180 python3 tools/gpu_record.py --out "$OUT/hs" --quick \
      --bench-sections stages,hybrid_stages --tests 2>&1 | tail -30
    TORCHINDUCTOR_DETERMINISTIC=1 timeout -s KILL 330 python3 tools/e2e_vllm.py --out "$OUT/det" \
      --phases greedy,logprobs --lora-gain 0.5 --reference off --time-budget 310 --engine-arg "$E2E_CC" 2>&1 | tail -40
    (cd "$OUT" && for d in hs det; do [[ -d $d ]] && tar czf $d.tgz $d && rm -rf $d; done)
    ;;
  e2e-perf)
    # perf.md v0.18 (Triton K1 splits: repetition walls) and the profile's batch-64 case.
    unpack_vllm
    timeout -s KILL 500 python3 tools/e2e_vllm.py --out "$OUT/perf" --phases tpot,throughput,profile \
      --lora-gain 0.5 --reference off --time-budget 480 --engine-arg "$E2E_CC" 2>&1 | tail -40
    (cd "$OUT" && [[ -d perf ]] && tar czf perf.tgz perf && rm -rf perf)
    # Both engines' Inductor output code (the no-adapter greedy mismatch: does our op change what
    # Inductor generates around it?), diffed on the CPU.
    find /tmp/epilora_e2e/vllm_cache /tmp/torchinductor_* -name '*.py' -size -4M 2> /dev/null > /tmp/pyl
    timeout -s KILL 15 tar czf "$OUT/inductor_code.tgz" -T /tmp/pyl 2> /dev/null; wc -l < /tmp/pyl
    ;;
  out-variant)
    # perf.md run10 / plugin.md: the output allocated in the compiled graph (EPILORA_OUT_VARIANT=1)
    # — greedy identity without adapters (13/16 in every run since run9) and TPOT, ours vs stock.
    unpack_vllm
    EPILORA_OUT_VARIANT=1 timeout -s KILL 480 python3 tools/e2e_vllm.py --out "$OUT/ov" \
      --phases greedy,logprobs,tpot --lora-gain 0.5 --reference off --time-budget 460 --engine-arg "$E2E_CC" 2>&1 | tail -40
    (cd "$OUT" && [[ -d ov ]] && tar czf ov.tgz ov && rm -rf ov)
    ;;
  record)
    if [[ -f .devvllm/2/unpack.sh ]]; then bash .devvllm/2/unpack.sh > /dev/null 2>&1 || echo "vLLM unpack failed"; fi
    {
      for c in "decode 1" "decode 4" "shrink 1" "k2_nolora 1"; do
        echo "== kernel_diag $c"; timeout -s KILL 30 python3 tools/kernel_diag.py $c 2>&1 | tail -2
      done
      echo "== racecheck decode 1"
      timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no \
        python3 tools/kernel_diag.py decode 1 2>&1 | tail -4
    } > "$OUT/diag.log" 2>&1
    cat "$OUT/diag.log"
    # The benchmark only (vLLM anchors, decode stages and experiments, the K2 sweep, prefill); the
    # bench writes its JSON after every section, so a call cut short keeps what it measured.
    timeout -s KILL 400 python3 tools/gpu_record.py --out "$OUT" --quick \
      --bench-sections layer,stages,k2sweep,prefill --tests 2>&1 | tail -60
    ;;
  tests)
    # The GPU test files of tools/gpu_record.py's suite "main" (K2's decode path, the op level,
    # quantization, Triton, K1, expand-add), each with its own time limit (a hang costs one file,
    # not the call), after the host-launch bench. K2's file alone needs ~270 s; run33 (an H100):
    # 549 s for the lot. Then `tests-rest` for the others: the whole suite needs both calls.
    timeout -s KILL 580 python3 tools/gpu_record.py --out "$OUT" --quick --bench-sections launch \
      --suite main --file-timeout 290 --time-limit 560 2>&1 | tail -60
    ;;
  tt)
    # perf.md v0.85 (session 38): the decode pair at 33..64 tokens (K2's token tiles, the shrink's
    # 64-token tile; every earlier cubin byte-identical to run33's verified set, so only the new
    # builds need the GPU): the `decode_wide` cases of K2's and the op's GPU files, racecheck of the
    # pair at 40 tokens (split 2), then the Qwen3-8B layer at 32..64 tokens with 8 and 1 adapters:
    # decode against hybrid_par / hybrid_par_q / vLLM, and the path "auto" takes (~9 min; carry
    # .devvllm/2 and the slim cache).
    unpack_vllm
    timeout -s KILL 300 python3 -m pytest -q -rf -m "gpu and decode_wide" -p no:cacheprovider tests/test_k2_gpu.py \
      tests/test_lora_linear_gpu.py > "$OUT/tests_tt.log" 2>&1; tail -30 "$OUT/tests_tt.log"
    echo "== racecheck kernel_diag decode_tt 2" | tee "$OUT/racecheck_tt.log"
    timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no python3 tools/kernel_diag.py \
      decode_tt 2 2>&1 | tail -5 | tee -a "$OUT/racecheck_tt.log"
    EPILORA_BENCH_TOKENS=32,48,64 EPILORA_BENCH_ADAPTERS=8,1 EPILORA_BENCH_OURS=hybrid_par,hybrid_par_q,decode,auto \
      timeout -s KILL 150 python3 tools/bench.py --sections prefill --out "$OUT/bench_tt" 2>&1 | tail -12
    ;;
  tt-diag)
    # perf.md v0.85 measured (session 38, after `tt`): racecheck of the token-tile pair (40 tokens)
    # against the one-tile bn 32 / bn 8 pairs (32 / 8 tokens) and with the pushes off: is the
    # hazard on the adapter table (written by producer warp 1's lanes, released by lane 0's
    # mbarrier arrive after a __syncwarp) the known s_x-style report or new? Then `stages` at 32 and
    # 64 tokens with 8 adapters: where the pair's time goes (K2 alone, with the epilogue, the shrink).
    # vLLM unpacked first for the e2e call that follows (~7 min; carry .devvllm/2 and the slim cache).
    unpack_vllm
    echo "== racecheck decode_tt 2 40" | tee "$OUT/racecheck_diag.log"
    timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no python3 tools/kernel_diag.py \
      decode_tt 2 40 2>&1 | tail -4 | tee -a "$OUT/racecheck_diag.log"
    echo "== racecheck decode_xq 2 32" | tee -a "$OUT/racecheck_diag.log"
    timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no python3 tools/kernel_diag.py \
      decode_xq 2 32 2>&1 | tail -4 | tee -a "$OUT/racecheck_diag.log"
    echo "== racecheck decode_xq 2 8" | tee -a "$OUT/racecheck_diag.log"
    timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no python3 tools/kernel_diag.py \
      decode_xq 2 8 2>&1 | tail -4 | tee -a "$OUT/racecheck_diag.log"
    echo "== racecheck EPILORA_K2_PUSH=none decode_tt 2 40" | tee -a "$OUT/racecheck_diag.log"
    EPILORA_K2_PUSH=none timeout -s KILL 60 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py decode_tt 2 40 2>&1 | tail -4 | tee -a "$OUT/racecheck_diag.log"
    EPILORA_BENCH_TOKENS=32,64 EPILORA_BENCH_ADAPTERS=8 timeout -s KILL 200 python3 tools/bench.py \
      --sections stages --out "$OUT/stages_tt" 2>&1 | tail -12
    ;;
  layer-parts)
    # Issue 5's throughput lever (perf.md "v0.86 measured", gpu_record README's plan): hybrid_par's
    # whole layer with one part left out at a time, beside the prefill section's layer rows (vLLM's
    # FP8 and LoRA layers, hybrid_par, auto) at 32 / 64 tokens x 8 / 1 adapters (~3 min; carry
    # .devvllm/2 and the slim cache after a call that carried .devvllm/1).
    unpack_vllm
    EPILORA_BENCH_TOKENS=32,64 EPILORA_BENCH_ADAPTERS=8,1 EPILORA_BENCH_OURS=hybrid_par,auto timeout -s KILL 300 \
      python3 tools/bench.py --sections layer_parts,prefill --out "$OUT/layer_parts" 2>&1 | grep -E "^layer_parts|^prefill M" | cut -c1-900
    ;;
  race)
    # K2 releases s_x and the adapter table from every lane of their producer warp (session 39):
    # racecheck of the pairs that reported the hand-off hazard (run38: the one-tile bn 32 pair at
    # 32 tokens 24, the token-tile pair at 40 tokens 48; run19: k2_nolora 4 on s_x) and the bn 8
    # pair, then K2's GPU test file (~5 min; run39: 306 s; carry the K2 / shrink / quantization
    # builds, no vLLM).
    for c in "decode_xq 2 32" "decode_tt 2 40" "k2_nolora 4" "decode_xq 2 8" "decode 2"; do
      echo "== racecheck $c"
      timeout -s KILL 50 compute-sanitizer --tool racecheck --report-api-errors no python3 tools/kernel_diag.py \
        $c 2>&1 | grep -E "hazard|ok|rror" | tail -4
    done 2>&1 | tee "$OUT/racecheck.log"
    timeout -s KILL 320 python3 tools/gpu_record.py --out "$OUT" --tests tests/test_k2_gpu.py --file-timeout 290 \
      --time-limit 300 --bench-sections none 2>&1 | tail -12
    ;;
  race-tests)
    # After `race`, on the warm machine: the rest of suite "main" (the op level, which launches K2
    # too, quantization, Triton, K1, the expand-add; ~5 min; carry as for `race` plus K1 and the
    # expand-add's builds). With `race`: the whole suite "main" at this commit.
    timeout -s KILL 500 python3 tools/gpu_record.py --out "$OUT" --suite main --skip tests/test_k2_gpu.py \
      --file-timeout 200 --time-limit 480 --bench-sections none 2>&1 | tail -16
    ;;
  race-rest)
    # After `race` / `race-tests` (whose carry left out the prefill K2): suite "rest" and the op
    # level's prefill cases (carry the prefill K2, K1, quantization, expand-add and prefetch builds).
    timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_linear_gpu.py -k prefill \
      2>&1 | tail -3 | tee "$OUT/tests_prefill_op.log"
    timeout -s KILL 400 python3 tools/gpu_record.py --out "$OUT" --suite rest --file-timeout 290 \
      --time-limit 380 --bench-sections none 2>&1 | tail -20
    ;;
  stream)
    # perf.md v0.88 (carry the slim cache with the streamed shrink at every rank, and .devvllm/2
    # after call A): its GPU file, the op's stream paths, then hybrid_stages (K1 beside the
    # quantization + streamed shrink, every hybrid form) and the prefill section's whole-layer rows.
    unpack_vllm
    timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_shrink_stream.py \
      2>&1 | tail -12 | tee "$OUT/tests_stream.log"
    timeout -s KILL 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_linear_gpu.py -k "stream or hybrid_par_st" \
      2>&1 | tail -12 | tee -a "$OUT/tests_stream.log"
    EPILORA_BENCH_TOKENS=${STREAM_TOKENS:-1024,2048,8192,16384} EPILORA_BENCH_ADAPTERS=${STREAM_ADAPTERS:-1,8} timeout -s KILL 170 \
      python3 tools/bench.py --sections hybrid_stages --out "$OUT/hs" 2>&1 | grep -E "layer|ERROR" | cut -c1-700
    EPILORA_BENCH_TOKENS=${STREAM_TOKENS:-1024,2048,8192,16384} EPILORA_BENCH_ADAPTERS=${STREAM_ADAPTERS:-1,8} \
      EPILORA_BENCH_OURS=hybrid,hybrid_par,hybrid_st,hybrid_par_st,auto EPILORA_HYBRID_STREAM_PATH=1 \
      timeout -s KILL 110 python3 tools/bench.py --sections prefill --out "$OUT/prefill" 2>&1 | grep -E "^prefill M" | cut -c1-700
    (cd "$OUT" && for d in hs prefill; do [[ -d $d ]] && tar czf $d.tgz $d && rm -rf $d; done)
    ;;
  grouped)
    # perf.md v0.90 (carry the slim cache with the grouped shrink, and .devvllm/2 after call A): its
    # GPU file, the op's grouped paths, then hybrid_stages (K1 beside the quantization + grouped
    # shrink, its token tiles and splits) and the prefill section's whole-layer rows.
    unpack_vllm
    timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_shrink_grouped.py \
      2>&1 | tail -12 | tee "$OUT/tests_grouped.log"
    timeout -s KILL 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_linear_gpu.py -k "grouped or hybrid_par_g" \
      2>&1 | tail -12 | tee -a "$OUT/tests_grouped.log"
    EPILORA_BENCH_TOKENS=${GROUPED_TOKENS:-64,256,512} EPILORA_BENCH_ADAPTERS=${GROUPED_ADAPTERS:-8,32} timeout -s KILL 170 \
      python3 tools/bench.py --sections hybrid_stages --out "$OUT/hs" 2>&1 | grep -E "layer|ERROR" | cut -c1-900
    EPILORA_BENCH_TOKENS=${GROUPED_TOKENS:-64,256,512} EPILORA_BENCH_ADAPTERS=${GROUPED_ADAPTERS:-8,32} \
      EPILORA_BENCH_OURS=hybrid,hybrid_par,hybrid_par_g,auto EPILORA_HYBRID_GROUPED_PATH=1 \
      timeout -s KILL 110 python3 tools/bench.py --sections prefill --out "$OUT/prefill" 2>&1 | grep -E "^prefill M" | cut -c1-700
    (cd "$OUT" && for d in hs prefill; do [[ -d $d ]] && tar czf $d.tgz $d && rm -rf $d; done)
    ;;
  priority)
    # perf.md v0.91 (carry the slim cache, and .devvllm/2 after call A): the op-level GPU tests of
    # the forked hybrid paths (priority on and off, eager and in CUDA graphs), then layer_parts:
    # every forked path with and without the high-priority stream, one graph per layer (~4-5 min).
    # Then v0.92's metadata kernel (tails by their own programs), compiled here, bit for bit the torch ops.
    unpack_vllm
    timeout -s KILL 20 python3 -c "import torch; print('critical stream priority', torch.cuda.Stream(priority=-100).priority)"
    timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_linear_gpu.py \
      -k "hybrid_par or priority or stream_paths or grouped_paths" 2>&1 | tail -12 | tee "$OUT/tests_priority.log"
    timeout -s KILL 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_meta_kernel.py 2>&1 | tail -4 \
      | tee -a "$OUT/tests_priority.log"
    # With K1 at group splits 1 and 2 beside the default (mirror_z*: fewer K1 CTAs beside the GEMM).
    EPILORA_BENCH_TOKENS=${PRIORITY_TOKENS:-64,256,2048} EPILORA_BENCH_ADAPTERS=${PRIORITY_ADAPTERS:-8,1,32} \
      EPILORA_BENCH_K1_ZSPLITS=${PRIORITY_ZSPLITS-1,2} timeout -s KILL 280 python3 tools/bench.py --sections layer_parts --out "$OUT/layer_parts" 2>&1 \
      | grep -E "^layer_parts" | cut -c1-1200
    ;;
  ab)
    # A kernel change against its base commit, both on this one warm machine (perf.md v0.96, the
    # expand-add's prologue). Carry .gpu_carry/slim (holding both sides' builds) and .gpu_carry/base
    # (`tools/slim_cache.sh`, then `tools/base_tree.sh --family <F> <base> <changed files>`, which
    # merges the base side's builds into the slim cache; .devvllm/2 too on a fresh machine after call A).
    # The changed family's GPU tests (AB_TESTS), then layer_parts (AB_PARTS, AB_TOKENS,
    # AB_ADAPTERS) for each side of AB_SIDES (default base, head, base, head: the two runs of one
    # side show the machine's drift); a side other than head runs in .gpu_carry/<side> (base, or a
    # variant tree built as base_tree.sh builds it).
    unpack_vllm
    [[ -d .gpu_carry/base ]] || { echo "no .gpu_carry/base: tools/base_tree.sh first"; exit 2; }
    timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m gpu ${AB_TESTS:-tests/test_expand_add.py} \
      2>&1 | tail -8 | tee "$OUT/tests_ab.log"
    i=0
    for side in ${AB_SIDES:-base head base head}; do
      i=$((i + 1)); dir=$PWD; [[ $side != head ]] && dir=$PWD/.gpu_carry/$side
      (cd "$dir" && EPILORA_BENCH_TOKENS=${AB_TOKENS:-64,256} EPILORA_BENCH_ADAPTERS=${AB_ADAPTERS:-1,8,32} \
        EPILORA_BENCH_PARTS=${AB_PARTS:-expand,mirror,no_expand} timeout -s KILL 70 \
        python3 tools/bench.py --sections layer_parts --out "$OUT/lp_${i}_$side" 2>&1 | grep -E "^layer_parts" | cut -c1-400 \
        | sed "s/^/$side /")
    done
    (cd "$OUT" && tar czf layer_parts_ab.tgz lp_* && rm -rf lp_*)
    ;;
  tests-rest)
    # Suite "rest": the prefill K2 (~180 s on an H100, run33), the L2 prefetch, the metadata kernel.
    timeout -s KILL 400 python3 tools/gpu_record.py --out "$OUT" --suite rest --file-timeout 290 \
      --time-limit 380 --bench-sections none 2>&1 | tail -40
    ;;
  e2e)
    # The tool stops its engines at its time budget (pass --time-budget ≤ 480: its default 525 s
    # outlasts this limit) and still writes the report. vLLM unpacked here when this call carries
    # .devvllm/2 (~16 s; run41 call 1 started both engines without it).
    unpack_vllm
    timeout -s KILL 515 python3 tools/e2e_vllm.py --out "$OUT" "${@:3}" 2>&1 | tail -60
    ;;
  e2e-smoke)
    # vLLM unpacked first when this machine has not got it yet (parts carried in calls A and this one).
    if ! python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' 2> /dev/null \
        && [[ -f .devvllm/2/unpack.sh ]]; then
      timeout -s KILL 150 bash .devvllm/2/unpack.sh 2>&1 | tail -1 || echo "vLLM unpack failed"
    fi
    # 4 layers, correctness only, CUDA graphs and torch.compile on (tools/e2e_vllm.py SMOKE): budget 270 s.
    timeout -s KILL 330 python3 tools/e2e_vllm.py --smoke --out "$OUT" "${@:3}" 2>&1 | tail -80
    ;;
  e2e-rescore)
    # tools/e2e_reference.py on the teacher-forced sequences of a recorded run (default: run5's smoke
    # run): rebuilds its 4-layer checkpoint (~20 s), scores on the GPU, writes e2e.{md,json} again.
    # run5 recorded no fingerprints: its checkpoint's, as torch 2.11 writes it (docs/gpu_record/run5/e2e_reference_cpu_check.md).
    if [[ -n ${3:-} ]]; then expect=(); else expect=(--expect-checkpoint 16321d179fe9f6d9/701b18d94f080559); fi
    timeout -s KILL 300 python3 tools/e2e_vllm.py --rescore "${3:-docs/gpu_record/run5/e2e_smoke_ce10c4b.json}" \
      "${expect[@]}" --time-budget 280 --out "$OUT" 2>&1 | tail -60
    ;;
  verify)
    echo "verify (check + the e2e smoke) no longer fits one 10-minute call since the K2 test file grew"
    echo "(session 10: 221 tests, ~145 s): run \`check\`, then \`e2e-smoke\` on the warm machine"; exit 2 ;;
  check)
    # After kernel changes (call A carried .devvllm/1, this one .devvllm/2 and the cache; ~8.5 min):
    # the decode path's diagnostics and racecheck (the split-2 pair: at split 1 the racecheck of the
    # self-quantizing pair did not finish in 150 s), the layer and stage benches, the K2 /
    # quantization / op-level test files. The e2e in a call of its own.
    timeout -s KILL 60 bash .devvllm/2/unpack.sh > /dev/null 2>&1 || echo "vLLM unpack failed"
    timeout -s KILL 20 python3 tools/kernel_diag.py decode 1 2>&1 | tail -2 | tee "$OUT/diag.log"
    timeout -s KILL 70 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py decode 2 2>&1 | tail -4 | tee -a "$OUT/diag.log"
    # (K2's file takes ~250 s since decode_fh's tests joined it: 290 s per file, 425 s in all.)
    timeout -s KILL 440 python3 tools/gpu_record.py --out "$OUT" --quick --bench-sections layer,stages \
      --tests tests/test_k2_gpu.py tests/test_quant_gpu.py tests/test_lora_linear_gpu.py \
      --file-timeout 290 --time-limit 425 2>&1 | tail -40
    # The device returns at most 8 files: the logs travel as one archive.
    (cd "$OUT" && tar czf record_logs.tgz diag.log bench.log gpu_tests.log 2> /dev/null && rm -f diag.log bench.log gpu_tests.log)
    ;;
  k1)
    # After K1 / expand-add changes (carry the cache, and .devvllm/2 after call A for vLLM's columns;
    # ~2-4 min): K1's GPU test file and the hybrid op tests, hybrid_stages at 64 / 256 / 2048 tokens
    # x 1 / 8 / 32 adapters with K1's configuration sweep (bm 64 tiles, v0.73's 8-warp builds, v0.74's
    # WGMMA builds, after a racecheck of one of them; K1_TOKENS / K1_ADAPTERS override; K1_EASWEEP=1
    # adds the expand-add's sweep). The profile is a call of its own (`profile`, on the warm machine).
    unpack_vllm  # when .devvllm/2 was carried: vLLM's columns (vendor GEMM = vLLM's CUTLASS)
    timeout -s KILL 150 python3 -m pytest -q -m gpu tests/test_k1_shrink.py 2>&1 | tail -4 | tee "$OUT/k1_tests.log"
    timeout -s KILL 60 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py -k hybrid 2>&1 | tail -3 | tee -a "$OUT/k1_tests.log"
    echo "== racecheck kernel_diag k1_wg" | tee -a "$OUT/k1_tests.log"
    timeout -s KILL 40 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py k1_wg 2>&1 | tail -4 | tee -a "$OUT/k1_tests.log"
    EPILORA_BENCH_K1SWEEP=1 EPILORA_BENCH_EASWEEP=${K1_EASWEEP:-0} EPILORA_BENCH_TOKENS=${K1_TOKENS:-64,256,2048} EPILORA_BENCH_ADAPTERS=${K1_ADAPTERS:-1,8,32} \
      timeout -s KILL 180 python3 tools/bench.py --quick --sections hybrid_stages --out "$OUT/hs" 2>&1 | tail -45
    (cd "$OUT" && [[ -d hs ]] && tar czf hs.tgz hs && rm -rf hs)
    ;;
  retune)
    # perf.md v0.76 (`select` takes run30's fastest K1 / expand-add builds; carry the full cache,
    # run30: 106 s, limits add up to ~10 min): the K1, expand-add and op-level GPU files whole (every selection against the
    # reference, the hybrid paths bit for bit each other, CUDA graphs), then hybrid_stages at
    # RT_TOKENS x RT_ADAPTERS (vLLM's columns when .devvllm/2 was carried after call A).
    unpack_vllm
    timeout -s KILL 120 python3 -m pytest -q -m gpu tests/test_k1_shrink.py 2>&1 | tail -4 | tee "$OUT/retune_tests.log"
    timeout -s KILL 90 python3 -m pytest -q -m gpu tests/test_expand_add.py 2>&1 | tail -4 | tee -a "$OUT/retune_tests.log"
    timeout -s KILL 150 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py 2>&1 | tail -4 | tee -a "$OUT/retune_tests.log"
    EPILORA_BENCH_TOKENS=${RT_TOKENS:-64,256,2048,8192} EPILORA_BENCH_ADAPTERS=${RT_ADAPTERS:-1,8,32} \
      timeout -s KILL 150 python3 tools/bench.py --quick --sections hybrid_stages --out "$OUT/hs" 2>&1 | tail -45
    (cd "$OUT" && [[ -d hs ]] && tar czf hs.tgz hs && rm -rf hs)
    ;;
  prefetch)
    # perf.md v0.77 + v0.80 (the next projection's weight prefetched into L2 between projections, in
    # the stream and on a second stream beside the window; carry the slim cache, and .devvllm/2 after
    # call A for vLLM's columns; limits add up to ~6.5 min): the prefetch GPU tests (every planned
    # byte range; chained projections and CUDA graphs, the second stream's fork / join among them,
    # bit for bit the plain run), the `prefetch` bench section (`_pf` and `_pf2` columns) at
    # PF_TOKENS with spin windows of PF_WINDOWS (attention, norm, activation µs) and budgets
    # PF_BUDGETS (MB: attention window, the others), then its layer rows at one token for two more
    # budget pairs. run32: 45 s on an H100.
    unpack_vllm
    timeout -s KILL 120 python3 -m pytest -q -m gpu tests/test_l2_prefetch_gpu.py 2>&1 | tail -4 | tee "$OUT/prefetch_tests.log"
    EPILORA_BENCH_WINDOWS=${PF_WINDOWS:-8,2,2} EPILORA_L2_PREFETCH=${PF_BUDGETS:-32,8} EPILORA_BENCH_TOKENS=${PF_TOKENS:-1,4,8,32} \
      timeout -s KILL 150 python3 tools/bench.py --quick --sections prefetch --out "$OUT/pf" 2>&1 | tail -30
    for b in 32,0 48,24; do
      EPILORA_BENCH_WINDOWS=${PF_WINDOWS:-8,2,2} EPILORA_L2_PREFETCH=$b EPILORA_BENCH_TOKENS=1 EPILORA_BENCH_PF_PROJECTIONS=0 \
        timeout -s KILL 55 python3 tools/bench.py --quick --sections prefetch --out "$OUT/pf_${b/,/_}" 2>&1 | grep 'what=layer'
    done
    (cd "$OUT" && tar czf pf.tgz pf pf_* 2> /dev/null && rm -rf pf pf_*)
    ;;
  h-bf16)
    # perf.md v0.71 + v0.72 (carry the cache with K1's and the expand-add's builds (--families
    # k1_quant_shrink,expand_add,fp8_quant), .devvllm/2 after call A for vLLM's columns; ~9 min):
    # K1 storing h as bf16 and the expand-add reading it, bit for bit against the fp32 h, the op's
    # hybrid paths under EPILORA_HYBRID_H=bf16 bit for bit the fp32 ones, the expand-add sweeping
    # column tiles bit for bit its one-tile build, racecheck of the new builds, then hybrid_stages
    # (its *_hb columns beside the fp32 ones, and the expand-add's sweep with its _ct builds) at
    # HB_TOKENS x HB_ADAPTERS.
    unpack_vllm
    timeout -s KILL 150 python3 -m pytest -q -m gpu tests/test_k1_shrink.py tests/test_expand_add.py \
      -k "bf16_h or h_bf16 or matches_reference or bitwise" 2>&1 | tail -4 | tee "$OUT/h_bf16_tests.log"
    timeout -s KILL 80 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py -k hybrid 2>&1 | tail -3 \
      | tee -a "$OUT/h_bf16_tests.log"
    for c in k1_hb expand_hb expand_ct; do
      echo "== racecheck kernel_diag $c" | tee -a "$OUT/h_bf16_tests.log"
      timeout -s KILL 35 compute-sanitizer --tool racecheck --report-api-errors no \
        python3 tools/kernel_diag.py $c 2>&1 | tail -4 | tee -a "$OUT/h_bf16_tests.log"
    done
    EPILORA_BENCH_EASWEEP=1 EPILORA_BENCH_TOKENS=${HB_TOKENS:-256,2048} EPILORA_BENCH_ADAPTERS=${HB_ADAPTERS:-1,32} \
      timeout -s KILL 175 python3 tools/bench.py --quick --sections hybrid_stages --out "$OUT/hs" 2>&1 | tail -45
    (cd "$OUT" && [[ -d hs ]] && tar czf hs.tgz hs && rm -rf hs)
    ;;
  prefill-k2)
    # perf.md v0.60 (carry the cache with the prefill K2's rank-64 / no-adapter builds, ~2-3 min;
    # .devvllm/2 after call A adds vLLM's GEMM column): the accumulation modes' GPU tests (overlap
    # bit for bit serial, sums that add up within tolerance, the 16-byte stores bit for bit the scalar ones),
    # then the prefill K2 alone against the vendor GEMM (PK2_TOKENS / PK2_ADAPTERS override), then
    # the K sweep (fixed cost per tile; v0.65: the persistent build beside the one-tile build).
    unpack_vllm
    timeout -s KILL 150 python3 -m pytest -q -m gpu tests/test_k2_prefill.py \
      -k "accum_modes or promotion or bitwise or model_shapes or 16384 or persistent" \
      2>&1 | tail -6 | tee "$OUT/prefill_k2_tests.log"
    timeout -s KILL 60 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py -k prefill 2>&1 | tail -3 \
      | tee -a "$OUT/prefill_k2_tests.log"
    for c in "prefill_pers 3" "prefill_pers 1"; do
      timeout -s KILL 35 compute-sanitizer --tool racecheck --report-api-errors no \
        python3 tools/kernel_diag.py $c 2>&1 | tail -4 | tee -a "$OUT/prefill_k2_tests.log"
    done
    EPILORA_BENCH_TOKENS=${PK2_TOKENS:-64,256,2048,8192} EPILORA_BENCH_ADAPTERS=${PK2_ADAPTERS:-1,8} \
      timeout -s KILL 170 python3 tools/bench.py --sections prefill_k2 --out "$OUT/pk2" 2>&1 | tee "$OUT/prefill_k2_bench.log" | tail -45
    timeout -s KILL 60 python3 tools/bench_k_sweep.py --out "$OUT/ks" 2>&1 | tee "$OUT/k_sweep.log" | tail -8
    ;;
  prefill-path)
    # perf.md v0.69 (carry the cache with K1's and the prefill K2's builds, .devvllm/2 after call A
    # for vLLM's columns; ~8 min): K1's GPU tests (its sorted_codes rows among them), the op's
    # prefill tests, the prefill K2's GPU tests on K1's sorted codes, then the `prefill` section
    # (the hybrid, prefill and auto paths per layer beside vLLM's) at PP_TOKENS x PP_ADAPTERS.
    unpack_vllm
    timeout -s KILL 90 python3 -m pytest -q -m gpu tests/test_k1_shrink.py -k "sorted or matches_reference or bitwise" \
      2>&1 | tail -4 | tee "$OUT/prefill_path_tests.log"
    timeout -s KILL 60 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py -k prefill 2>&1 | tail -3 \
      | tee -a "$OUT/prefill_path_tests.log"
    # (run27: 91 passed in 114 s, then the 120 s limit killed the exiting process: 150 s)
    timeout -s KILL 150 python3 -m pytest -q -m gpu tests/test_k2_prefill.py \
      -k "accum_modes or bitwise or model_shapes or persistent" 2>&1 | tail -4 | tee -a "$OUT/prefill_path_tests.log"
    EPILORA_PREFILL_PATH=1 EPILORA_BENCH_OURS=hybrid,prefill,auto EPILORA_BENCH_TOKENS=${PP_TOKENS:-2048} \
      EPILORA_BENCH_ADAPTERS=${PP_ADAPTERS:-1,8} \
      timeout -s KILL 180 python3 tools/bench.py --quick --sections prefill --out "$OUT/pp" 2>&1 | tail -30
    ;;
  decode)
    # After decode-path kernel changes (perf.md v0.45-v0.47; carry the cache; no vLLM: the layer's
    # anchors come from a `check` call; ~8 min): K2's and the op-level GPU test files, racecheck
    # of the split-2 pair, `stages` at 1 / 8 / 16 / 32 tokens and `layer` at 1 / 4 / 16 / 32.
    timeout -s KILL 290 python3 -m pytest -q -m gpu tests/test_k2_gpu.py 2>&1 | tail -3 | tee "$OUT/tests.log"
    timeout -s KILL 60 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py 2>&1 | tail -3 | tee -a "$OUT/tests.log"
    timeout -s KILL 70 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py decode 2 2>&1 | tail -4 | tee -a "$OUT/tests.log"
    EPILORA_BENCH_TOKENS=1,8,16,32 timeout -s KILL 90 python3 tools/bench.py --quick --sections stages \
      --out "$OUT/st" 2>&1 | tail -2
    EPILORA_BENCH_TOKENS=1,4,16,32 timeout -s KILL 70 python3 tools/bench.py --quick --sections layer \
      --out "$OUT/ly" 2>&1 | tail -8
    (cd "$OUT" && tar czf decode.tgz st ly 2> /dev/null && rm -rf st ly)
    ;;
  push-tests)
    # The K2 push variants (perf.md v0.50-v0.52, EPILORA_K2_PUSH; carry the cache; ~9 min): their
    # bitwise comparisons with the builds without pushes (tests/test_k2_push_gpu.py, 262 tests at
    # ~1.5 s each in session 17), then racecheck / synccheck of the pushed pair at split 2 and 4,
    # the x_q pair and the no-adapter K2 (kernel_diag prints the build it launched).
    timeout -s KILL 400 python3 -m pytest -q -m gpu tests/test_k2_push_gpu.py 2>&1 | tail -6 | tee "$OUT/tests_push.log"
    for c in "racecheck maxima,partials decode 2" "racecheck maxima,partials decode 4" \
             "racecheck partials decode_xq 2" "racecheck partials k2_nolora 4" "synccheck maxima,partials decode 2"; do
      set -- $c
      echo "== $1 EPILORA_K2_PUSH=$2 kernel_diag ${*:3}" | tee -a "$OUT/tests_push.log"
      EPILORA_K2_PUSH=$2 timeout -s KILL 35 compute-sanitizer --tool $1 --report-api-errors no \
        python3 tools/kernel_diag.py "${@:3}" 2>&1 | tail -4 | tee -a "$OUT/tests_push.log"
    done
    ;;
  wide-tests)
    # The wide self-quantizing K2 builds (perf.md v0.54, EPILORA_K2_SQ_WIDE; carry the cache; ~7 min):
    # their own GPU file, then K2's file with them on (the model shapes at 1 token take them for
    # gate_up / down; every other case runs the shipped default builds, the push ones), racecheck
    # of the wide pair at split 1 and 2 (K = 2560: split 1 only runs on the wide build).
    timeout -s KILL 200 python3 -m pytest -q -m gpu tests/test_k2_wide_gpu.py 2>&1 | tail -4 | tee "$OUT/tests_wide.log"
    EPILORA_K2_SQ_WIDE=1 timeout -s KILL 290 python3 -m pytest -q -m gpu tests/test_k2_gpu.py 2>&1 | tail -4 \
      | tee -a "$OUT/tests_wide.log"
    for s in 1 2; do
      echo "== racecheck kernel_diag decode_wide $s" | tee -a "$OUT/tests_wide.log"
      timeout -s KILL 45 compute-sanitizer --tool racecheck --report-api-errors no \
        python3 tools/kernel_diag.py decode_wide $s 2>&1 | tail -4 | tee -a "$OUT/tests_wide.log"
    done
    ;;
  wide-bench)
    # After wide-tests (carry the cache, and .devvllm/2 after call A for vLLM's anchors; ~7 min):
    # the wide file's cases other than the model shapes (split-K, codes, repeats), the op-level GPU
    # file with the wide builds on, racecheck of the wide pair at split 1, `stages` at 1 / 4 tokens
    # (the default and the wide rows of one run) and the chained layer at 1 / 4 tokens with and
    # without them.
    unpack_vllm
    timeout -s KILL 110 python3 -m pytest -q -m gpu tests/test_k2_wide_gpu.py -k "not model_shapes" 2>&1 | tail -3 \
      | tee "$OUT/tests_wide2.log"
    EPILORA_K2_SQ_WIDE=1 timeout -s KILL 80 python3 -m pytest -q -m gpu tests/test_lora_linear_gpu.py 2>&1 | tail -3 \
      | tee -a "$OUT/tests_wide2.log"
    echo "== racecheck kernel_diag decode_wide 1" | tee -a "$OUT/tests_wide2.log"
    timeout -s KILL 100 compute-sanitizer --tool racecheck --report-api-errors no \
      python3 tools/kernel_diag.py decode_wide 1 2>&1 | tail -4 | tee -a "$OUT/tests_wide2.log"
    EPILORA_BENCH_TOKENS=${WIDE_TOKENS:-1,4} timeout -s KILL 90 python3 tools/bench.py --quick --sections stages \
      --out "$OUT/st" 2>&1 | tail -2
    EPILORA_BENCH_TOKENS=${WIDE_LAYER_TOKENS:-1,4} EPILORA_BENCH_OURS=no_adapter_chain,decode_sq_chain,decode_sq_wide_chain \
      timeout -s KILL 90 python3 tools/bench.py --quick --sections layer --out "$OUT/ly" 2>&1 | tail -14
    (cd "$OUT" && tar czf wide_bench.tgz st ly 2> /dev/null && rm -rf st ly)
    ;;
  push-bench)
    # The push variants beside the builds without them (carry nothing after push-tests; ~1 min):
    # `stages` and the chained `layer` rows at the same token counts, once per EPILORA_K2_PUSH value.
    for p in none maxima,partials; do
      d=${p/,/_}
      EPILORA_K2_PUSH=$p EPILORA_BENCH_TOKENS=${PUSH_TOKENS:-1,8,32} timeout -s KILL 100 python3 tools/bench.py --quick \
        --sections stages --out "$OUT/st_$d" 2>&1 | tail -2
      EPILORA_K2_PUSH=$p EPILORA_BENCH_TOKENS=${PUSH_LAYER_TOKENS:-1,4,32} \
        EPILORA_BENCH_OURS=no_adapter_chain,decode_chain,decode_sq_chain \
        timeout -s KILL 80 python3 tools/bench.py --quick --sections layer --out "$OUT/ly_$d" 2>&1 | tail -12
    done
    (cd "$OUT" && tar czf push_bench.tgz st_* ly_* 2> /dev/null && rm -rf st_* ly_*)
    ;;
  fh)
    # After decode-path kernel changes at 1..8 tokens (perf.md v0.43, decode_fh; carry the cache,
    # and .devvllm/2 after call A for vLLM's layer anchors; ~3-5 min): decode_fh's K2 tests, the
    # op-level decode tests (every path incl. chained sequences and CUDA graphs), `stages` at 1 / 8
    # tokens and `layer` at 1 / 4 / 8 tokens with the chained columns. A hang is cut by its timeout.
    unpack_vllm
    timeout -s KILL 180 python3 -m pytest -q -x -m gpu tests/test_k2_gpu.py -k "fused_h or self_quant_codes" 2>&1 \
      | tail -8 | tee "$OUT/tests_fh.log"
    timeout -s KILL 100 python3 -m pytest -q -x -m gpu tests/test_lora_linear_gpu.py -k "decode" 2>&1 | tail -8 \
      | tee -a "$OUT/tests_fh.log"
    EPILORA_BENCH_TOKENS=${FH_TOKENS:-1,8} timeout -s KILL 100 python3 tools/bench.py --quick --sections stages \
      --out "$OUT/st" 2>&1 | grep -E "^stages|Error" | tail -12
    EPILORA_BENCH_TOKENS=${FH_LAYER_TOKENS:-1,4,8} \
      EPILORA_BENCH_OURS=${FH_OURS:-no_adapter_chain,decode_chain,decode_sq_chain,decode_fh_chain,decode_sq,decode_fh} \
      timeout -s KILL 100 python3 tools/bench.py --quick --sections layer --out "$OUT/ly" 2>&1 | tail -30
    (cd "$OUT" && for d in st ly; do [[ -d $d ]] && tar czf $d.tgz $d && rm -rf $d; done)
    ;;
  profile-decode)
    # Nsight Compute on the decode paths' K2 at 1..8 tokens (perf.md v0.43: where decode_fh's and
    # decode_sq's CTAs stall; carry the cache only): one launch each, the details page and each
    # launch's SASS with its stall samples (tools/ncu_summary.py reads them).
    cases=${PROFILE_CASES:-"qkv:1:1 qkv:8:1"}
    mkdir -p "$OUT/prof"
    timeout -s KILL 300 ncu --clock-control none --set full --import-source no --kernel-name regex:'K2Kernel' \
      -f -o "$OUT/prof/prof" \
      python3 tools/profile_kernels.py --launches 1 --paths "${PROFILE_PATHS:-decode_sq,decode_fh}" $cases 2>&1 | tail -8
    if [[ -f $OUT/prof/prof.ncu-rep ]]; then
      ncu_text_exports "$OUT/prof"
      rm -f "$OUT/prof/prof.ncu-rep"
      (cd "$OUT" && tar czf prof.tgz prof && rm -rf prof)
    fi
    ;;
  profile)
    # Nsight Compute on the large-batch kernels (K1, expand-add; tools/profile_kernels.py launches
    # them once per case): the details page of every launch (stall reasons, memory throughput,
    # occupancy) and each launch's SASS with its sampled stalls, as text. Carry the cache only.
    # Cases and stages: PROFILE_CASES (default below), PROFILE_PATHS (default k1,expand_add);
    # PROFILE_KERNELS: the kernel-name regex (add e.g. nvjet for cuBLASLt's GEMM of stage gemm).
    cases=${PROFILE_CASES:-"qkv:2048:1 down:2048:1 qkv:256:32 down:256:32 gate_up:64:8"}
    paths=${PROFILE_PATHS:-k1,expand_add}
    mkdir -p "$OUT/prof"
    # PROFILE_CLOCK: ncu's --clock-control (none: the GPU's own clocks; base: fixed, to compare
    # designs apart from the power limit); PROFILE_ARGS: more profile_kernels.py options
    # (e.g. --k2-builds overlap_vs,overlap_vs_pers --k2-no-adapter).
    timeout -s KILL 360 ncu --clock-control "${PROFILE_CLOCK:-none}" --set full --import-source no \
      --kernel-name regex:"${PROFILE_KERNELS:-K1Kernel|ExpandAdd|K2Prefill|gemm_lora|quant_shrink}" -f -o "$OUT/prof/prof" \
      python3 tools/profile_kernels.py --launches 1 --paths "$paths" ${PROFILE_ARGS:-} $cases 2>&1 | tail -25
    if [[ -f $OUT/prof/prof.ncu-rep ]]; then
      ncu_text_exports "$OUT/prof"
      ncu -i "$OUT/prof/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/prof/sass_all.csv" 2>&1
      ls -la "$OUT/prof" | head -20
    fi
    (cd "$OUT" && tar czf prof.tgz prof && rm -rf prof)
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
