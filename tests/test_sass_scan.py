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
