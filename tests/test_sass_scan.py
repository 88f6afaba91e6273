"""sass_scan finds loads a warp waits for inside their own branch (docs/perf.md v0.45), on
hand-written SASS and on the decode K2 builds that were cleaned of them (a ratchet: each build's
count may only go down)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from epilora_cute.sass_scan import instructions, loads_waited_in_branch, nvdisasm_path, sass_of


def _sass(*lines):
    return "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(lines))


SERIAL = _sass(
    "BSSY B0, `(.L_x_1)", "@P0 BRA `(.L_x_1)", "LDG.E R4, desc[UR4][R2.64]", "F2FP.BF16.F32.PACK_AB R4, RZ, R4",
    "BSYNC B0",
    "BSSY B0, `(.L_x_2)", "@P1 BRA `(.L_x_2)", "LDG.E R5, desc[UR4][R6.64]", "F2FP.BF16.F32.PACK_AB R5, RZ, R5",
    "BSYNC B0")
BATCHED = _sass(
    "LDG.E R4, desc[UR4][R2.64]", "LDG.E R5, desc[UR4][R6.64]",
    "BSSY B0, `(.L_x_1)", "@P0 BRA `(.L_x_1)", "F2FP.BF16.F32.PACK_AB R4, RZ, R4", "F2FP.BF16.F32.PACK_AB R5, RZ, R5",
    "BSYNC B0")
BATCH_IN_REGION = _sass(
    "BSSY B0, `(.L_x_1)", "LDG.E.128 R8, desc[UR4][R2.64]", "LDG.E.128 R12, desc[UR4][R6.64]",
    "IMAD.U32 R5, R8, 0x10000, RZ", "IMAD.U32 R7, R12, 0x10000, RZ", "BSYNC B0")


def test_instructions_parse_the_listing():
    assert instructions(SERIAL)[2] == "LDG.E R4, desc[UR4][R2.64]"


def test_each_load_used_in_its_own_branch_is_one_wait():
    found = loads_waited_in_branch(SERIAL)
    assert [f[1] for f in found] == ["LDG.E R4, desc[UR4][R2.64]", "LDG.E R5, desc[UR4][R6.64]"]


def test_unconditional_loads_used_later_are_not_waits():
    assert loads_waited_in_branch(BATCHED) == []


def test_a_batch_inside_a_region_waits_once():
    found = loads_waited_in_branch(BATCH_IN_REGION)
    assert len(found) == 1 and found[0][1].startswith("LDG.E.128 R12")  # the last of the batch


# Counts of K2 builds (Qwen3-8B's qkv: three slices, rank 64) after v0.45-v0.47; before v0.45 the
# adapter builds had 35 (bn 32) and 11 (bn 8): the epilogue's h loads one round trip each. The
# ones left are the adapter table's dependent reads and the self-quantizing builds' cluster
# maxima and quotient operands (docs/gpu_record/README.md's plan, item 1).
K2_WAIT_BOUNDS = {
    (8, True, False): 3, (16, True, False): 3, (32, True, False): 3,
    (8, False, False): 1, (32, False, False): 1,
    (8, True, True): 10, (8, False, True): 8,
}


@pytest.mark.parametrize("bn,lora,sq", list(K2_WAIT_BOUNDS), ids=lambda v: str(v))
def test_k2_builds_keep_their_loads_out_of_branches(bn, lora, sq):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (Triton's wheel or the CUDA toolkit)")
    from kernels_dsl import k2_gemm

    cfg = (k2_gemm.default_config(bn, 128, lora=True, num_slices=3, rank=64, self_quant=sq) if lora
           else k2_gemm.default_config(bn, 128, lora=False, self_quant=sq))
    with tempfile.TemporaryDirectory() as d:
        k2_gemm.compile(cfg, f"--gpu-arch sm_90a --keep-cubin --dump-dir {d}")
        cubin = next(Path(d).glob("*.cubin")).read_bytes()
    found = loads_waited_in_branch(sass_of(cubin))
    bound = K2_WAIT_BOUNDS[(bn, lora, sq)]
    assert len(found) <= bound, (f"{cfg.name()}: {len(found)} loads waited for inside their branch "
                                 f"(at most {bound}): " + "; ".join(f"{a} -> {b}" for _, a, b in found[:6]))


# The push variants (Config.push_maxima / push_partials, EPILORA_K2_PUSH): MEMBAR.ALL.GPU and DSMEM
# loads of each against its default build (DSL 4.8.1, sm_90a). (bn, lora, self_quant, maxima,
# partials): (MEMBAR.ALL.GPU, DSMEM loads) of the push build; the defaults hold 3 (x_q builds: the
# two release arrives of the partials' phase and the counter's acq_rel atomic) or 4 (self_quant:
# the maxima's phase too) MEMBAR.ALL.GPU.
PUSH_SASS = {
    (8, True, False, False, True): (1, 0), (32, True, False, False, True): (1, 0),
    (16, False, False, False, True): (1, 0),
    (8, False, True, True, False): (1, 24), (8, False, True, True, True): (0, 0),
    (8, True, True, True, False): (1, 24), (8, True, True, False, True): (2, 16), (8, True, True, True, True): (0, 0),
}


def _k2_sass(cfg):
    from kernels_dsl import k2_gemm

    with tempfile.TemporaryDirectory() as d:
        k2_gemm.compile(cfg, f"--gpu-arch sm_90a --keep-cubin --dump-dir {d}")
        return sass_of(next(Path(d).glob("*.cubin")).read_bytes())


@pytest.mark.parametrize("key", list(PUSH_SASS), ids=lambda v: "bn{}_{}_{}_{}_{}".format(
    v[0], "lora" if v[1] else "nolora", "sq" if v[2] else "xq", "pm" if v[3] else "", "pp" if v[4] else ""))
def test_k2_push_builds_drop_membar_and_dsmem_loads(key):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (Triton's wheel or the CUDA toolkit)")
    import dataclasses

    from epilora_cute.sass_scan import sync_counts
    from kernels_dsl import k2_gemm

    bn, lora, sq, pm, pp = key
    base = (k2_gemm.default_config(bn, 128, lora=True, num_slices=3 if bn == 8 else 1, rank=64, self_quant=sq)
            if lora else k2_gemm.default_config(bn, 128, lora=False, self_quant=sq))
    cfg = dataclasses.replace(base, push_maxima=pm, push_partials=pp)
    d, p = sync_counts(_k2_sass(base)), sync_counts(_k2_sass(cfg))
    assert d["membar_gpu"] == (4 if sq else 3) and d["dsmem_loads"] > 0 and d["st_async"] == 0, d
    assert (p["membar_gpu"], p["dsmem_loads"]) == PUSH_SASS[key], (cfg.name(), d, p)
    assert p["st_async"] > 0, p
    if pp:  # each thread's partials go out as st.async, never as DSMEM loads
        assert p["dsmem_loads"] <= (16 if sq and not pm else 0)
    # ...and the loads the cleaned builds keep out of branches stay out (at most two more with
    # push_maxima, both local smem: a sender's maximum read for its st.async, a receiver's after
    # the acquire wait - no DSMEM round trip)
    if (bn, lora, sq) in K2_WAIT_BOUNDS:
        assert len(loads_waited_in_branch(_k2_sass(cfg))) <= K2_WAIT_BOUNDS[(bn, lora, sq)] + (2 if pm else 0)


@pytest.mark.parametrize("bn,rank", [(128, 64), (64, 8)])
def test_prefill_k2_hmask_loads_are_not_waited_in_branch(bn, rank):
    """The prefill K2's adapter epilogue stages h for each item: no global load waits inside its
    position test (before v0.61, one LDG per element did: ~8 L2 round trips in a row per thread
    and item); the one local smem read left is the output scatter's token index."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (Triton's wheel or the CUDA toolkit)")
    from kernels_dsl import k2_prefill

    cfg = k2_prefill.Config(bn=bn, lora=True, num_slices=3 if rank == 64 else 1, rank=rank)
    with tempfile.TemporaryDirectory() as d:
        k2_prefill.compile(cfg, f"--gpu-arch sm_90a --keep-cubin --dump-dir {d}")
        sass = sass_of(next(Path(d).glob("*.cubin")).read_bytes())
    found = loads_waited_in_branch(sass)
    assert not [f for f in found if "LDG" in f[1]], found
    assert len(found) <= 1, found
    assert sum(1 for i in instructions(sass) if i.split()[0].startswith("LDG.E.128")) == bn * cfg.rank_chunk // 4 // 256
