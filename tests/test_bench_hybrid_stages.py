"""tools/bench_hybrid_stages.py (the `hybrid_stages` bench section): everything but the GPU timing."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_registered():
    from tools import bench, bench_hybrid_stages

    bench._optional_sections()
    assert bench.SECTIONS["hybrid_stages"] is bench_hybrid_stages.bench_hybrid_stages


def test_skips_without_a_hopper_gpu(capsys, monkeypatch):
    from tools import bench_hybrid_stages as bh

    monkeypatch.setattr(bh.torch.cuda, "is_available", lambda: False)
    assert bh.bench_hybrid_stages(True) == []
    assert "needs an sm_90 GPU" in capsys.readouterr().out


def test_settings():
    from tools.bench_hybrid_stages import settings

    assert settings({}) == ([32, 256, 2048], [1, 32])
    assert settings({"EPILORA_BENCH_TOKENS": "64", "EPILORA_BENCH_ADAPTERS": "8"}) == ([64], [8])
    with pytest.raises(ValueError):
        settings({"EPILORA_BENCH_TOKENS": "x"})


def test_floors():
    from tools.bench_decode import QWEN3_8B
    from tools.bench_hybrid_stages import floors

    qkv = QWEN3_8B[0]
    f = floors(qkv, 32, 32, 64, 1000.0)  # 1000 GB/s -> µs = bytes / 1e6
    assert f["k1_floor_us"] == pytest.approx((32 * 4096 * 3 + 32 * 64 * 4096 * 3 * 2) / 1e6)
    assert f["expand_floor_us"] == pytest.approx((4 * 32 * 6144 + 32 * 6144 * 64 * 2) / 1e6)
    # adapters beyond the token count cannot be active
    assert floors(qkv, 32, 64, 64, 1000.0) == f


def test_geometry_is_host_only():
    from tools.bench_decode import QWEN3_8B
    from tools.bench_hybrid_stages import geometry

    for p in QWEN3_8B:
        for m in (32, 256, 2048):
            for max_loras in (8, 32):
                g = geometry(p, m, 64, max_loras)
                assert set(g) == {"k1_cfg", "k1_grid", "expand_cfg", "expand_grid"}
                assert all(int(v) >= 1 for v in g["k1_grid"].split("x"))
                assert all(int(v) >= 1 for v in g["expand_grid"].split("x"))


def test_geometry_group_split_and_variants():
    from tools.bench_decode import QWEN3_8B
    from tools.bench_hybrid_stages import geometry, launch_variants

    g = geometry(QWEN3_8B[0], 32, 64, 32)  # qkv, 32 tokens, 32 adapter slots
    # K1 v0.31: bm 16 up to 1024 tokens, grid y = row tiles x 3 slices; z (v0.20) a power of two up
    # to ~3 CTAs per SM; on WGMMA there (v0.76); above, 64 rows on 8 warps (v0.76)
    assert g["k1_cfg"] == "r64_s3_bm16_kc512_st4_wg" and g["k1_grid"] == "8x6x8"
    assert g["expand_grid"].startswith("48x1x")
    big = geometry(QWEN3_8B[0], 2048, 64, 32)
    assert big["k1_cfg"] == "r64_s3_bm64_kc512_st3_wn2" and big["k1_grid"] == "8x96x1"
    # the expand-add from WIDE_M: 8 narrow column tiles per CTA on qkv (96 tiles -> 12 CTAs wide)
    assert big["expand_cfg"] == "r64_s3_bm64_bn64_ct8" and big["expand_grid"] == "12x32x1"
    k1_z = int(g["k1_grid"].split("x")[2])

    class Case:  # what launch_variants reads of a LayerCase
        proj, m, rank, max_loras = QWEN3_8B[0], 32, 64, 32
    assert launch_variants(Case()) == {"z1": ({"zsplit": 1}, {"zsplit": 1})}
    # The sweep: every z up to the 32 adapters + the no-adapter group a tile can meet, except
    # each kernel's default (left out where it is; a z that is both defaults is no variant).
    sweep = launch_variants(Case(), zsweep=True)
    ex_z = int(g["expand_grid"].split("x")[2])
    zs = [z for z in (2, 4, 8, 16, 32) if not z == k1_z == ex_z]
    assert set(sweep) == {"z1"} | {f"z{z}" for z in zs}
    assert all(sweep[f"z{z}"][0] == (None if z == k1_z else {"zsplit": z}) for z in zs)
    assert all(sweep[f"z{z}"][1] == (None if z == ex_z else {"zsplit": z}) for z in zs)
    Case.m = 2048
    assert launch_variants(Case()) == {} and launch_variants(Case(), zsweep=True) == {}


def test_sum_layer_and_format():
    from tools.bench_hybrid_stages import format_row, sum_layer

    base = {"section": "hybrid_stages", "M": 32, "adapters": 32, "max_loras": 32, "rank": 64}
    rows = [dict(base, proj=p, k1_us=10.0, gemm_us=20.0, expand_add_us=5.0, hybrid_us=40.0) for p in "abcd"]
    rows[1]["vllm_lora_us"] = 7.0  # missing in the others: not summed
    rows[2]["k1_error"] = "boom"
    layer = sum_layer(rows)
    assert layer["proj"] == "layer" and layer["k1_us"] == 40.0 and layer["hybrid_us"] == 160.0
    assert layer["stages_sum_us"] == 140.0 and "vllm_lora_us" not in layer
    line = format_row(dict(rows[2], k1_cfg="r64_s3_bm64_kc512_st3", k1_grid="8x1x1"))
    assert "k1 10.0" in line and "k1_error ERROR (boom)" in line and "k1_grid=8x1x1" in line


def test_time_stages_reports_errors():
    from tools.bench_hybrid_stages import time_stages

    def bad():
        raise RuntimeError("no kernel")
    row = {}
    time_stages(row, {"k1": lambda: None, "gemm": bad}, timer=lambda fn: (fn(), 3.0)[1])
    assert row["k1_us"] == 3.0 and row["gemm_error"].startswith("RuntimeError: no kernel")


def test_orchestration_with_the_gpu_parts_faked(capsys, monkeypatch):
    from tools import bench_hybrid_stages as bh

    monkeypatch.setattr(bh.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bh.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(bh, "read_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bh, "LayerCase", lambda p, m, r, num_adapters, max_loras: (p, m, num_adapters, max_loras))
    seen = []

    class Fake:
        def __init__(self, c):
            seen.append(c)

        def launchers(self):
            return {s: (lambda: None) for s in bh.STAGES}
    monkeypatch.setattr(bh, "HybridStages", Fake)
    monkeypatch.setattr(bh, "_vllm_launchers", lambda c: {"_vllm_error": "no vllm"})
    monkeypatch.setattr(bh, "time_graph", lambda fn: 1.0)
    monkeypatch.setattr(bh.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.delenv("EPILORA_BENCH_TOKENS", raising=False)
    monkeypatch.delenv("EPILORA_BENCH_ADAPTERS", raising=False)
    rows = bh.bench_hybrid_stages(True)
    assert len(rows) == 2 * 3 * 5  # (adapters, tokens) x (4 projections + the layer row)
    assert {c[3] for c in seen if c[2] == 1} == {8} and {c[3] for c in seen if c[2] == 32} == {32}
    layer = [r for r in rows if r["proj"] == "layer"]
    assert len(layer) == 6 and all(r["hybrid_us"] == 4.0 and r["stages_sum_us"] == 12.0 for r in layer)
    assert "vLLM columns left out" in capsys.readouterr().out


def test_with_env_sets_the_variable_only_during_the_call(monkeypatch):
    """The *_hb op columns: EPILORA_HYBRID_H is set while the op runs (and a graph is captured
    from it), and restored after, also when the call raises."""
    import os

    from epilora_cute import ops
    from tools.bench_hybrid_stages import _with_env

    monkeypatch.setenv(ops.HYBRID_H_ENV, "fp32")
    seen = []
    _with_env(ops.HYBRID_H_ENV, "bf16", lambda: seen.append(ops.hybrid_h_dtype()))()
    assert seen == [torch.bfloat16] and ops.hybrid_h_dtype() == torch.float32

    def boom():
        raise RuntimeError("x")
    monkeypatch.delenv(ops.HYBRID_H_ENV)
    with pytest.raises(RuntimeError):
        _with_env(ops.HYBRID_H_ENV, "bf16", boom)()
    assert ops.HYBRID_H_ENV not in os.environ


def test_sweep_switches(monkeypatch):
    """EPILORA_BENCH_K1SWEEP=1 sweeps K1 and the expand-add (EPILORA_BENCH_EASWEEP=0: K1 alone),
    EPILORA_BENCH_EASWEEP=1 the expand-add alone (v0.72's column-sweeping builds without K1's)."""
    from tools.bench_hybrid_stages import EASWEEP_ENV, K1SWEEP_ENV, _sweeps

    monkeypatch.delenv(K1SWEEP_ENV, raising=False)
    monkeypatch.delenv(EASWEEP_ENV, raising=False)
    assert _sweeps() == (False, False)
    monkeypatch.setenv(EASWEEP_ENV, "1")
    assert _sweeps() == (False, True)
    monkeypatch.setenv(K1SWEEP_ENV, "1")
    monkeypatch.delenv(EASWEEP_ENV)
    assert _sweeps() == (True, True)
    monkeypatch.setenv(EASWEEP_ENV, "0")
    assert _sweeps() == (True, False)


def test_compared_columns_are_timed_next_to_each_other(monkeypatch):
    """k1 / k1_hb and expand_add / expand_add_hb adjacent, the op's fp32-h paths before its bf16-h
    ones (session 31: a column timed after the GEMM columns ran slower, whatever its build), and
    the caller's k1_again last (checked in the bench's own loop, faked here)."""
    from types import SimpleNamespace

    from tools import bench_hybrid_stages as bh

    monkeypatch.delenv("EPILORA_BENCH_K1SWEEP", raising=False)
    monkeypatch.delenv("EPILORA_BENCH_EASWEEP", raising=False)
    hs = object.__new__(bh.HybridStages)
    hs.c = SimpleNamespace(proj=SimpleNamespace(slices=(64,), k=128, name="o"), rank=16, x=None, lora_a=None,
                           lora_b=None, meta=None, w_q=None, w_s=None, m=1)
    hs.codes = hs.scales = hs.h = hs.h_bf16 = hs.y = hs.out = None
    monkeypatch.setattr(bh, "launch_variants", lambda c, zsweep: {})
    names = list(hs.launchers())
    assert names.index("k1_hb") == names.index("k1") + 1
    assert names.index("expand_add_hb") == names.index("expand_add") + 1
    assert max(names.index(p) for p in bh.HYBRID_PATHS) < min(names.index(f"{p}_hb") for p in bh.HYBRID_PATHS)
    timed = []
    monkeypatch.setattr(bh.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bh.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(bh, "read_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bh, "LayerCase", lambda p, m, r, num_adapters, max_loras: None)
    monkeypatch.setattr(bh, "HybridStages", lambda c: SimpleNamespace(launchers=lambda: {n: n for n in names}))
    monkeypatch.setattr(bh, "_vllm_launchers", lambda c: {"_vllm_error": "no vllm"})
    monkeypatch.setattr(bh, "time_stages", lambda row, fns, timer: timed.append(list(fns)))
    monkeypatch.setattr(bh.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("EPILORA_BENCH_TOKENS", "64")
    monkeypatch.setenv("EPILORA_BENCH_ADAPTERS", "1")
    bh.bench_hybrid_stages(True)
    assert timed and all(t[-1] == "k1_again" for t in timed)
