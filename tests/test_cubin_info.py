"""cubin_info reads the launch register count from a real cubin and flags setmaxnreg pools that
cannot be satisfied (the cause of the K2 hang on the H200)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from epilora_cute.cubin_info import register_count, register_pool_problem, stack_frame_bytes

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.fixture(scope="module")
def quant_build():
    from kernels_dsl import fp8_quant

    with tempfile.TemporaryDirectory() as d:
        fp8_quant.compile(fp8_quant.Config(), f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {d}")
        ptx = next(Path(d).glob("*.ptx")).read_text()
        cubin = next(Path(d).glob("*.cubin")).read_bytes()
    return ptx, cubin


def test_register_count_is_plausible(quant_build):
    _, cubin = quant_build
    assert 8 <= register_count(cubin) <= 255


def test_kernel_without_setmaxnreg_has_no_pool_problem(quant_build):
    ptx, cubin = quant_build
    assert "setmaxnreg" not in ptx
    assert register_pool_problem(ptx, cubin) is None


def test_small_pool_is_flagged(quant_build):
    # The quantization kernel's real register count with the warp roles of K2 grafted onto its PTX:
    # 256 threads at a few dozen registers cannot hold 128 x 40 + 128 x 232.
    ptx, cubin = quant_build
    assert register_count(cubin) * 256 < 128 * (40 + 232)
    fake = ".reqntid 256, 1, 1\n setmaxnreg.dec.sync.aligned.u32 40;\n setmaxnreg.inc.sync.aligned.u32 232;\n"
    problem = register_pool_problem(fake, cubin)
    assert problem and "wait forever" in problem
    # 384 threads (one producer, two consumers) need more still; a missing .reqntid is reported.
    assert register_pool_problem(fake.replace("256", "384"), cubin)
    assert "reqntid" in register_pool_problem(fake.split("\n", 1)[1], cubin)


def test_not_a_cubin():
    with pytest.raises(ValueError):
        register_count(b"not an elf")


def test_stack_frame_of_a_kernel_without_locals_is_zero(quant_build):
    _, cubin = quant_build
    assert stack_frame_bytes(cubin) == 0


def test_stack_frame_is_read_from_nv_info(quant_build):
    # The same cubin with one EIATTR_FRAME_SIZE record patched in place of its register count
    # record: the reader finds the attribute wherever it sits in a .nv.info section.
    _, cubin = quant_build
    rec = bytes([0x04, 0x2F, 8, 0])
    at = cubin.index(rec)
    patched = cubin[:at] + bytes([0x04, 0x11, 8, 0]) + cubin[at + 4: at + 8] + (96).to_bytes(4, "little") + cubin[at + 12:]
    assert stack_frame_bytes(patched) == 96
