# The two commands of the README. Both set up everything they need on a fresh machine.
.PHONY: run test prebuild gpu-record carry-cache

run:            ## the main job: prebuild the kernel set + reference demo (no GPU) or benchmark (GPU)
	@tools/setup_env.sh
	@.venv/bin/python -m epilora_cute.main

test:           ## the test suite (GPU tests skip cleanly without a GPU), then the plugin against real vLLM
	@tools/setup_env.sh
	@.venv/bin/python -m pytest -q -n auto --dist worksteal
	@tools/test_vllm_cpu.sh tests/test_metadata.py

prebuild:       ## compile every kernel for sm_90a into ./.epilora_cache (carried to the H200)
	@tools/setup_env.sh
	@EPILORA_CACHE_DIR=.epilora_cache .venv/bin/python -m epilora_cute.prebuild --arch sm_90a --jobs 0 --prune

carry-cache: prebuild  ## the cache without PTX (the GPU machine loads cubins) -> .gpu_carry/.epilora_cache
	@rm -rf .gpu_carry/.epilora_cache && mkdir -p .gpu_carry && cp -r .epilora_cache .gpu_carry/.epilora_cache
	@find .gpu_carry/.epilora_cache -name kernel.ptx -delete && du -sh .gpu_carry/.epilora_cache
