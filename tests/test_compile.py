"""Every kernel configuration compiles for sm_90a here (no GPU), with the instructions it must hold."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from epilora_cute.compile_cache import dsl_version, get_artifact
from epilora_cute.kernel_abi import check_params, ptx_entries
from kernels_dsl import fp8_quant

ROOT = Path(__file__).resolve().parents[1]
DSL46_PYTHON = ROOT / ".venv-dsl46" / "bin" / "python"

pytestmark = pytest.mark.skipif(dsl_version() is None, reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("cfg", fp8_quant.prebuild_configs(), ids=lambda c: c.name())
def test_fp8_quant_compiles_with_required_instructions(cfg, isolated_cache):
    art = get_artifact(fp8_quant, cfg, "sm_90a")
    check_params(fp8_quant.PARAMS, art.param_sizes, art.kernel_name)
    ptx = (art.path / "kernel.ptx").read_text()
    assert ".target sm_90a" in ptx
    assert "ld.global.v4.b32" in ptx                   # 16-byte loads of x
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx         # hardware RNE conversion
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx  # IEEE x / scale
    assert ".ftz" not in ptx                            # denormals kept, as vLLM keeps them
    assert "max.NaN" not in ptx and "min.NaN" not in ptx  # NaN-ignoring fmaxf/fminf semantics
    assert art.cubin[:4] == b"\x7fELF"
    # Chainable with PDL (ops.lora_linear_fp8(chain_pdl=True)): griddepcontrol.wait first, then
    # the trigger for K2, both before x is read or anything is written.
    lines = ptx.splitlines()
    at = lambda pat: [i for i, ln in enumerate(lines) if re.search(pat, ln)]  # noqa: E731
    wait, trig = at(r"griddepcontrol\.wait"), at(r"griddepcontrol\.launch_dependents")
    assert len(wait) == 1 and len(trig) == 1 and wait[0] < trig[0]
    assert trig[0] < min(at(r"\bld\.global")) and trig[0] < min(at(r"\bst\.global"))


def test_config_for_covers_every_supported_row_length():
    for k in range(8, fp8_quant.MAX_K + 1, 8 * 37):
        cfg = fp8_quant.config_for(k)
        assert cfg.capacity >= k and cfg.threads <= 1024
        assert cfg in set(fp8_quant.prebuild_configs()) or k not in (4096, 12288, 5120, 8208)
    for k in (4096, 5120, 8192, 8208, 12288, 14336, 29568):
        assert fp8_quant.config_for(k) in set(fp8_quant.prebuild_configs())


@pytest.mark.skipif(not DSL46_PYTHON.exists(), reason="no .venv-dsl46 (nvidia-cutlass-dsl 4.6.0) venv")
def test_everything_compiles_with_dsl_4_6(tmp_path):
    """vLLM 0.26 pins nvidia-cutlass-dsl 4.6.0: the quantization kernels must compile with it too
    (the other families' own compile tests sweep their configurations with 4.6.0)."""
    env = dict(os.environ, EPILORA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT), EPILORA_QUIET_BUILD="1")
    r = subprocess.run([str(DSL46_PYTHON), "-m", "epilora_cute.prebuild", "--arch", "sm_90a", "--family", "fp8_quant"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metas = [json.loads(p.read_text()) for p in tmp_path.rglob("meta.json")]
    assert metas and all(m["dsl_version"] == "4.6.0" for m in metas)
