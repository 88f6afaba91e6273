"""The GPU record and benchmark tools import and format reports on a machine without a GPU."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("name", ["tools.gpu_record", "tools.bench", "tools.bench_decode", "tools.gpu_timing",
                                  "tools.bench_triton"])
def test_tools_import(name):
    importlib.import_module(name)


def test_report_markdown(tmp_path):
    from tools import gpu_record

    rep = {"date": "2026-11-30", "git": "abc", "seconds": 12.0, "kernel_builds": "nvidia-cutlass-dsl 4.8.1",
           "tests": {"exit_code": 1, "counts": {"passed": 2, "failed": 1, "error": 0, "skipped": 1},
                     "cases": [{"test": "t::a", "outcome": "failed", "message": "boom", "seconds": 1.0},
                               {"test": "t::b", "outcome": "skipped", "message": "no vllm", "seconds": 0.0}]},
           "bench": {"env": {"gpu": "H200", "read_bandwidth_gbs": 4200.0},
                     "rows": [{"section": "quant", "M": 1, "K": 4096, "ours_us": 5.5, "vllm_us": 5.9}]}}
    gpu_record.write_markdown(rep, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "2 passed, 1 failed" in text and "**failed** `t::a`: boom" in text
    assert "| M | K | ours_us | vllm_us |" in text and "| 1 | 4096 | 5.50 | 5.90 |" in text


def test_test_file_discovery():
    from tools import gpu_record

    files = gpu_record._gpu_test_files(["tests"])
    assert ROOT / "tests" / "test_quant_gpu.py" in files
    assert gpu_record._gpu_test_files(["tests/test_quant_gpu.py"]) == [ROOT / "tests" / "test_quant_gpu.py"]


def test_stages_section_is_registered_and_skips_without_a_hopper_gpu(capsys):
    from tools import bench, bench_stages

    bench._optional_sections()
    assert bench.SECTIONS["stages"] is bench_stages.bench_stages
    if not torch.cuda.is_available():
        assert bench_stages.bench_stages(quick=True) == []
        assert "needs an sm_90 GPU" in capsys.readouterr().out
