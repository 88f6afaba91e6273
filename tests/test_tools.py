"""The GPU record and benchmark tools import and format reports on a machine without a GPU."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("name", ["tools.gpu_record", "tools.bench", "tools.bench_decode", "tools.gpu_timing",
                                  "tools.bench_triton", "tools.bench_prefill"])
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


def test_suite_paths_leave_out_named_files_and_refuse_unknown_ones():
    """`gpu_session.sh race-tests` runs suite "main" less K2's file (`race` ran it): --skip."""
    from tools import gpu_record

    main = list(gpu_record.GPU_SUITES["main"])
    assert gpu_record.suite_paths("main", [], []) == main
    rest = gpu_record.suite_paths("main", [], ["tests/test_k2_gpu.py"])
    assert rest == [p for p in main if p != "tests/test_k2_gpu.py"] and len(rest) == len(main) - 1
    assert gpu_record.suite_paths(None, ["a.py", "b.py"], ["b.py"]) == ["a.py"]
    with pytest.raises(ValueError, match="--skip"):
        gpu_record.suite_paths("main", [], ["tests/test_k2_gpu"])  # a typo must not run the file


def test_gpu_suites_hold_every_gpu_test_file_once():
    """`gpu_session.sh tests` + `tests-rest` are the whole GPU suite only if every file with a GPU
    marker is in one of tools/gpu_record.py's suites (a new GPU file left out would never run)."""
    from tools import gpu_record

    listed = [f for files in gpu_record.GPU_SUITES.values() for f in files]
    assert len(listed) == len(set(listed)), "a file in two suites runs twice"
    marker = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\b.*pytest\.mark\.gpu\b)", re.M)
    marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if marker.search(p.read_text())}
    assert marked == set(listed)


def test_gpu_session_modes_run_the_suites():
    script = (ROOT / "tools" / "gpu_session.sh").read_text()
    for mode, suite in (("tests", "main"), ("tests-rest", "rest")):
        body = script.split(f"\n  {mode})\n", 1)[1].split("\n    ;;", 1)[0]
        assert f"--suite {suite}" in body, mode


def test_a_file_cut_by_the_records_time_limit_is_not_called_a_hang(tmp_path, monkeypatch):
    from tools import gpu_record

    def slow(*a, timeout=None, **k):
        raise gpu_record.subprocess.TimeoutExpired(a[0], timeout)

    monkeypatch.setattr(gpu_record.subprocess, "run", slow)
    deadline = gpu_record.time.time() + 60  # leaves 50 s of a 290 s file limit
    cut = gpu_record.run_tests(tmp_path, ["tests/test_quant_gpu.py"], 290, deadline)["cases"][0]
    assert "time limit left it" in cut["message"] and "hang" not in cut["message"]
    own = gpu_record.run_tests(tmp_path, ["tests/test_quant_gpu.py"], 30)["cases"][0]
    assert "own limit: a kernel hang?" in own["message"]


def test_stages_section_is_registered_and_skips_without_a_hopper_gpu(capsys):
    from tools import bench, bench_stages

    bench._optional_sections()
    assert bench.SECTIONS["stages"] is bench_stages.bench_stages
    if not torch.cuda.is_available():
        assert bench_stages.bench_stages(quick=True) == []
        assert "needs an sm_90 GPU" in capsys.readouterr().out


# --- tools/bench_prefill.py (the `prefill` section): everything but the GPU timing ---------------

def test_prefill_section_registered():
    from tools import bench, bench_prefill

    bench._optional_sections()
    assert bench.SECTIONS["prefill"] is bench_prefill.bench_prefill


def test_prefill_settings():
    from tools.bench_prefill import settings

    assert settings(False, {}) == ([32, 64, 128, 256, 512, 1024, 2048], [1, 32], ["triton", "hybrid", "prefill", "auto"])
    assert settings(True, {}) == ([32, 256, 2048], [1, 32], ["triton", "hybrid", "prefill", "auto"])
    env = {"EPILORA_BENCH_TOKENS": "64,512", "EPILORA_BENCH_ADAPTERS": "32",
           "EPILORA_BENCH_OURS": "auto,decode_sq,hybrid"}  # decode_sq: a `layer` name, ignored here
    assert settings(True, env) == ([64, 512], [32], ["hybrid", "auto"])
    # The extra paths only when named, after the default ones (the decode pair at 33..64 tokens).
    env["EPILORA_BENCH_OURS"] = "decode,hybrid_par,auto"
    assert settings(True, env) == ([64, 512], [32], ["auto", "hybrid_par", "decode"])
    with pytest.raises(ValueError, match="EPILORA_BENCH_ADAPTERS"):
        settings(False, {"EPILORA_BENCH_ADAPTERS": "1,x"})


def test_prefill_floor_terms():
    from tools.bench_decode import QWEN3_8B
    from tools.bench_prefill import floor_terms

    one = floor_terms(QWEN3_8B, 32, 1, 64, 4000.0, None)
    assert one["weight_mb"] == pytest.approx(192.94, abs=0.01)  # the 192.9 MB of docs/perf.md
    per_adapter = 64 * (3 * 4096 + 6144 + 4096 + 4096 + 2 * 4096 + 24576 + 12288 + 4096) * 2
    assert one["adapter_mb"] == pytest.approx(per_adapter / 1e6)
    assert "floor_flops_us" not in one and one["floor_us"] == one["floor_bytes_us"]
    many = floor_terms(QWEN3_8B, 32, 32, 64, 4000.0, 1500.0)
    assert many["adapter_mb"] == pytest.approx(32 * per_adapter / 1e6)  # ~310 MB
    assert floor_terms(QWEN3_8B, 8, 32, 64, 4000.0, None)["adapter_mb"] == pytest.approx(8 * per_adapter / 1e6)
    big = floor_terms(QWEN3_8B, 2048, 1, 64, 4000.0, 1500.0)
    base_flops = 2 * 2048 * sum(p.n * p.k for p in QWEN3_8B)
    assert big["floor_flops_us"] > base_flops / 1.5e18 * 1e6 * 0.999
    assert big["floor_us"] == max(big["floor_flops_us"], big["floor_bytes_us"])


def _prefill_row(m, adapters, **times):
    row = {"section": "prefill", "M": m, "adapters": adapters, "floor_us": 50.0}
    row.update({f"{k}_us": v for k, v in times.items()})
    return row


def test_prefill_row_ratios_and_targets():
    from tools.bench_prefill import finish_row, format_row

    # 32 adapters at 32 tokens: ours must be >= 3x faster than vLLM's LoRA path.
    row = finish_row(_prefill_row(32, 32, vllm_fp8=100.0, vllm_lora=869.0, ours_triton=500.0, ours_hybrid=250.0,
                                  ours_auto=250.0), ["triton", "hybrid", "prefill", "auto"])
    assert row["ours_hybrid_over_vllm_lora"] == pytest.approx(250 / 869)
    assert row["ours_hybrid_over_vllm_fp8"] == pytest.approx(2.5)
    assert row["ours_hybrid_target"] == "met" and row["ours_auto_target"] == "met"
    assert row["ours_triton_target"].startswith("missed: 0.58x vllm_lora > 0.33x")
    assert row["issue4_ref"] == "vllm_lora 869 us"
    text = format_row(row)
    assert "hybrid 250.0 (0.29x LoRA, 2.50x fp8)" in text and "triton missed" in text

    # 1 adapter at 2048 tokens: <= 0.8x vLLM's LoRA path and <= 1.1x its FP8 GEMM alone.
    row = finish_row(_prefill_row(2048, 1, vllm_fp8=629.0, vllm_lora=1104.0, ours_hybrid=690.0, ours_triton=700.0),
                     ["triton", "hybrid", "prefill", "auto"])
    assert row["target"] == "ours <= 0.80x vllm_lora and ours <= 1.10x vllm_fp8"
    assert row["ours_hybrid_target"] == "met"
    assert row["ours_triton_target"] == "missed: 1.11x vllm_fp8 > 1.10x"
    assert row["ours_auto_target"] == "n/a (not timed)"

    # No target at 512 tokens; no vLLM: no ratios, targets n/a; errors reported as such.
    row = finish_row(_prefill_row(512, 32, ours_hybrid=300.0), ["hybrid"])
    assert "target" not in row and not any("_over_" in k for k in row)
    row = _prefill_row(64, 32, ours_triton=300.0)
    row["ours_hybrid_error"] = "RuntimeError: boom"
    row = finish_row(row, ["triton", "hybrid"])
    assert row["ours_triton_target"] == "n/a (no vllm_lora)" and row["ours_hybrid_target"] == "n/a (error)"
    assert "hybrid ERROR (RuntimeError: boom)" in format_row(row)


def test_prefill_time_paths_reports_errors():
    from tools.bench_prefill import time_paths

    calls = []

    def broken_launch():
        raise RuntimeError("kernel unavailable")

    def timer(fn):
        fn()
        return 42.0

    row = {}
    time_paths(row, {"vllm_fp8": lambda: [lambda: calls.append(1)] * 4,
                     "ours_hybrid": lambda: [broken_launch],
                     "ours_triton": lambda: (_ for _ in ()).throw(ValueError("does not apply"))}, timer=timer)
    assert row["vllm_fp8_us"] == 42.0 and len(calls) == 4
    assert row["ours_hybrid_error"] == "RuntimeError: kernel unavailable"
    assert row["ours_triton_error"] == "ValueError: does not apply"


def test_prefill_summarize_paths():
    from tools.bench_prefill import summarize_paths

    assert summarize_paths({"qkv": "hybrid", "o": "hybrid"}) == "hybrid"
    assert summarize_paths({"qkv": "hybrid", "o": "triton"}) == "qkv=hybrid o=triton"


def test_prefill_skips(capsys, monkeypatch):
    from tools import bench_prefill

    assert bench_prefill.skip_reason(False, None, True, True).startswith("no CUDA GPU")
    assert "sm_80" in bench_prefill.skip_reason(True, (8, 0), True, True)
    assert bench_prefill.skip_reason(True, (9, 0), False, False).startswith("nothing to time")
    assert bench_prefill.skip_reason(True, (9, 0), False, True) is None

    monkeypatch.setattr(bench_prefill.torch.cuda, "is_available", lambda: False)
    assert bench_prefill.bench_prefill(True) == []
    assert "prefill: skipped: no CUDA GPU" in capsys.readouterr().out


def test_prefill_without_vllm_times_ours_only(capsys, monkeypatch):
    """The orchestration with the GPU parts faked: no vLLM -> our columns only, one row per
    (adapters, tokens), auto decided under a temporary dispatcher that is dropped afterwards."""
    from epilora_cute import dispatch
    from tools import bench_prefill as bp

    monkeypatch.setattr(bp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(bp, "_have_vllm", lambda: False)
    monkeypatch.setattr(bp, "_have_ours", lambda: True)
    monkeypatch.setattr(bp, "read_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bp, "fp8_gemm_tflops", lambda have_vllm: None)
    monkeypatch.setenv("EPILORA_BENCH_ADAPTERS", "1,32")
    monkeypatch.delenv("EPILORA_BENCH_TOKENS", raising=False)
    monkeypatch.delenv("EPILORA_BENCH_OURS", raising=False)
    seen = []

    def fake_measure(m, adapters, ours, have_vllm, bw, rate):
        seen.append((m, adapters, tuple(ours), have_vllm, dispatch._default is not None))
        row = {"section": "prefill", "M": m, "adapters": adapters,
               **bp.floor_terms(bp.QWEN3_8B, m, adapters, bp.RANK, bw, rate)}
        row.update({f"ours_{p}_us": 100.0 for p in ours}, ours_auto_path="hybrid")
        return bp.finish_row(row, ours)
    monkeypatch.setattr(bp, "measure_row", fake_measure)
    dispatch.set_dispatcher(None)
    rows = bp.bench_prefill(True)
    assert [(r["M"], r["adapters"]) for r in rows] == [(32, 1), (256, 1), (2048, 1), (32, 32), (256, 32), (2048, 32)]
    assert all(s[2] == ("triton", "hybrid", "prefill", "auto") and s[3] is False and s[4] for s in seen)
    assert dispatch._default is None
    assert not any(k.startswith("vllm") for r in rows for k in r)
    out = capsys.readouterr().out
    assert "auto[hybrid] 100.0" in out and "n/a (no vllm_lora)" in out


def test_gpu_session_script_parses_and_keeps_calls_under_the_device_limit():
    import re
    import shlex
    import subprocess

    script = ROOT / "tools" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    modes = ("hybrid-identity)", "e2e-perf)", "out-variant)", "record)", "tests)", "tt)", "tt-diag)", "layer-parts)", "tests-rest)", "e2e)", "e2e-smoke)", "e2e-rescore)", "verify)", "check)", "k1)", "h-bf16)", "retune)", "prefetch)", "profile)", "fh)",
             "profile-decode)", "decode)", "push-tests)", "push-bench)", "wide-tests)", "wide-bench)", "prefill-k2)",
             "prefill-path)", "race)", "race-tests)", "race-rest)", "stream)", "grouped)", "priority)", "ab)",
             "warmup-time)", "ttft)", "xgate)")
    for mode in modes:
        assert mode in text
    # Each mode's time limits must add up to less than one device call (600 s).
    head, *blocks = re.split(r"\n  [\w|-]+\)\n", text)
    assert len(blocks) == len(modes)  # one per mode
    unpack = [int(t) for t in re.findall(r"timeout -s KILL (\d+)", head.split("unpack_vllm()", 1)[1])]
    assert unpack  # the shared unpack step has a limit too, counted where a mode calls it
    def seconds(text):  # the limits in `text`, those inside a `for x in ITEMS; do ... done` once per item
        loop = re.search(r"for \w+ in (.*?); do\n(.*?)\n\s*done", text, re.S)
        if loop is None:
            return sum(int(t) for t in re.findall(r"timeout -s KILL (\d+)", text))
        items = len(shlex.split(loop.group(1).replace("\\\n", " ")))
        return seconds(text[:loop.start()]) + items * seconds(loop.group(2)) + seconds(text[loop.end():])

    for block in blocks:
        total = seconds(block) + (sum(unpack) if "unpack_vllm" in block else 0)
        assert total < 600, (block[:60], total)


def test_bench_plot_draws_the_layer_section(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from tools.bench import plot

    rows = json.loads((ROOT / "docs" / "gpu_record" / "run5" / "bench_ce10c4b.json").read_text())["rows"]
    plot(rows, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_k2sweep_builds_per_token_count():
    """EPILORA_SWEEP_TOKENS=32 must time bn-32 builds (the sweep set has bn 8 only), all prebuilt."""
    from kernels_dsl import k2_gemm
    from tools.bench_k2sweep import sweep_builds

    assert sweep_builds(1) == k2_gemm.sweep_configs() and sweep_builds(8) == k2_gemm.sweep_configs()
    prebuilt = set(k2_gemm.prebuild_configs())
    for m, bn in ((9, 16), (32, 32)):
        builds = sweep_builds(m)
        assert builds and all(c.bn == bn and not c.lora and c in prebuilt for c in builds)
        assert {c.ctas for c in builds} == {1, 2}  # the default (two per SM) and the one-per-SM variants
    with pytest.raises(ValueError, match="token tiles"):
        sweep_builds(33)


def test_stages_decode_pairs_keep_the_counter_protocol():
    """bench_stages' decode variants (other shrink splits, the 4-stage shrink, the one-CTA-per-SM
    K2 builds) each pair a shrink with a K2 that waits for exactly that shrink's quantization CTAs,
    on a counter of their own; built on the CPU (launch specs only)."""
    from tools.bench_decode import QWEN3_8B, LayerCase
    from tools.bench_stages import DecodeStages

    down = next(p for p in QWEN3_8B if p.name == "down")
    st = DecodeStages(LayerCase(down, 1, 64, device="cpu"))
    assert st.split_s == 8
    assert {"decode_s2", "decode_s4", "decode_s16", "decode_st4", "shrink_s16", "decode_e1"} <= set(st.pairs)
    assert st.pairs["decode_e1"][2].early == 1
    assert st.pairs["decode_sq"][2].self_quant and not st.pairs["decode_sq"][0].quant
    assert st.pairs["decode_sqr"][2].sq_rowmax and st.fixed["k2_sqr"][0].sq_rowmax
    syncs = set()
    for name, (s_cfg, s_spec, k_cfg, k_spec) in st.pairs.items():
        if k_cfg is None:
            continue
        if k_cfg.self_quant:  # the self-quantizing pair: no counter, no quantization planes
            assert not s_cfg.quant and s_spec["n_quant"] == 0, name
            counters = {st.sync.data_ptr(), st.sync_alone.data_ptr()}
            assert not any(isinstance(a, torch.Tensor) and a.data_ptr() in counters
                           for a in list(s_spec["args"]) + list(k_spec["args"])), name
            continue
        k_sync, n_quant = k_spec["args"][7], k_spec["args"][8]
        s_sync = [a for a in s_spec["args"] if isinstance(a, torch.Tensor) and a.dtype == torch.int32
                  and a.shape == (2,)]
        assert n_quant == s_spec["n_quant"], name
        assert [t.data_ptr() for t in s_sync] == [k_sync.data_ptr()], name  # the pair's own counter
        assert s_spec["cluster"][0] == s_spec["grid"][0]
        syncs.add(k_sync.data_ptr())
    assert len(syncs) == len([v for v in st.pairs.values() if v[2] is not None and not v[2].self_quant])


def test_timeline_specs_and_summary_on_the_cpu():
    """bench_timeline: the trace builds' launch specs (trace buffers sized to the grids, the pair's
    K2 waiting for exactly its shrink's quantization CTAs) and the summary of stamped timelines."""
    from kernels_dsl import k2_gemm, lora_shrink
    from tools.bench_decode import QWEN3_8B, LayerCase
    from tools.bench_timeline import Timeline

    qkv = next(p for p in QWEN3_8B if p.name == "qkv")
    tl = Timeline(LayerCase(qkv, 1, 64, device="cpu"))
    assert tl.s_cfg.trace and tl.k_cfg.trace and tl.k_cfg in k2_gemm.prebuild_configs()
    assert tl.s_cfg in lora_shrink.prebuild_configs()
    assert tl.s_spec["args"][-1] is tl.s_trace and tl.k_spec["args"][-1] is tl.k_trace
    assert tl.k_spec["args"][8] == tl.s_spec["n_quant"] and tl.k_spec_alone["args"][8] == 0
    s_tr, k_tr = tl.s_trace.clone(), tl.k_trace.clone()
    per = tl.s_grid[0] * tl.s_grid[1]
    s_tr[:, 0] = 1_000_000  # every shrink CTA starts at t0 = 1 ms
    s_tr[:per, 2] = 1_003_000  # the quantization CTAs publish 3 µs later
    k_tr[:, 0] = 1_002_000
    k_tr[:, 1] = torch.arange(k_tr.shape[0]) * 10 + 1_004_000  # x_q ready 4.00 ... µs
    ev = tl.summarize(s_tr, k_tr)
    assert ev["shrink-quant", "published_or_mainloop_done"] == (3.0, 3.0, 3.0, per)
    assert ev["k2", "start"][:3] == (2.0, 2.0, 2.0)
    first, med, last, n = ev["k2", "xq_ready"]
    assert first == 4.0 and n == k_tr.shape[0] and last == pytest.approx(4.0 + (n - 1) * 0.01)
    assert ("k2", "h_ready") not in ev  # never stamped: absent, not zero
    alone = tl.summarize(s_tr, None)  # the shrink alone: no K2 rows
    assert alone["shrink-quant", "published_or_mainloop_done"][0] == 3.0 and not any(k == "k2" for k, _ in alone)
    # The self-quantizing pair: prebuilt trace builds, no counter, every shrink CTA a down-projection one.
    assert tl.sq and tl.kq_cfg.self_quant and tl.kq_cfg in k2_gemm.prebuild_configs()
    assert tl.s_cfg_nq in lora_shrink.prebuild_configs() and tl.s_spec_nq["n_quant"] == 0
    assert tl.kq_spec["args"][-1] is tl.kq_trace and {"pair_sq", "k2_sq_alone"} <= set(tl.cases())
    q_tr = tl.s_trace_nq.clone()
    q_tr[:, 0] = 1_000_000
    q_tr[:, 2] = 1_005_000
    ev = tl.summarize(q_tr, None, planes=0)
    assert ev["shrink-down", "published_or_mainloop_done"][3] == q_tr.shape[0] and ("shrink-quant", "start") not in ev


def test_timeline_section_is_registered_and_skips_without_a_hopper_gpu():
    from tools import bench, bench_timeline

    bench._optional_sections()
    assert bench.SECTIONS["timeline"] is bench_timeline.bench_timeline
    if not torch.cuda.is_available():
        assert bench_timeline.bench_timeline(quick=True) == []


def test_profile_kernels_parses_cases():
    from tools.profile_kernels import parse_case

    assert parse_case("qkv:2048:1") == ("qkv", 2048, 1)
    assert parse_case("down:256:32") == ("down", 256, 32)
    for bad in ("qkv:2048", "attn:64:1", "o:0:1", "o:64:0"):
        with pytest.raises(ValueError):
            parse_case(bad)


def test_ncu_summary_reads_the_text_exports(tmp_path):
    """tools/ncu_summary.py on a minimal details page + SASS export of two launches."""
    from tools.ncu_summary import parse_details, summarize

    details = """  kernel_cutlass_kernel_kernels_dslk1_shrink_K1Kernel_object_at_x (8, 192, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %         3.54
    Duration                         us       113.38
    Grid Size                                                  1,536
    Registers Per Thread             register/thread              64
    Executed Instructions                           inst   28,041,250
  kernel_cutlass_kernel_kernels_dslexpand_add_ExpandAddKernel_object_at_y (48, 32, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us        31.71
"""
    (tmp_path / "details.txt").write_text(details)
    launches = parse_details(details)
    assert len(launches) == 2
    assert launches[0]["duration_us"] == 113.38 and launches[0]["grid"] == 1536 and launches[0]["regs"] == 64
    assert launches[0]["instructions"] == 28041250 and launches[1]["duration_us"] == 31.71
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait", "stall_long_sb"]
    rows = [["0x0", "LDC R1", "10", "64", "8", "2"], ["0x10", "LDG R2", "30", "64", "0", "30"],
            ["0x20", "EXIT", "0", "64", "0", "0"]]
    import csv
    with (tmp_path / "sass_0.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k1"])
        w.writerow(hdr)
        w.writerows(rows)
    md = summarize(tmp_path, ["qkv:2048:1", "expand"], bins=3)
    assert "| 0 | k1_shrink_K1Kernel_object_at | qkv:2048:1 | 113.38 | 1536 | 64 |" in md
    assert "long_sb 80%" in md and "wait 20%" in md  # 32 of 40 samples, 8 of 40
    assert "| 1–2 | 75.0 | 64 |" in md  # the second instruction's bin


def test_stages_adapter_counts_from_the_environment(monkeypatch):
    from tools.bench_stages import stage_adapters

    monkeypatch.delenv("EPILORA_BENCH_ADAPTERS", raising=False)
    assert stage_adapters() == [1]
    monkeypatch.setenv("EPILORA_BENCH_ADAPTERS", "1,8")
    assert stage_adapters() == [1, 8]
    monkeypatch.setenv("EPILORA_BENCH_ADAPTERS", "1,9")
    with pytest.raises(ValueError, match="outside 1..8"):
        stage_adapters()
    monkeypatch.setenv("EPILORA_BENCH_ADAPTERS", "0")
    with pytest.raises(ValueError, match="positive integers"):
        stage_adapters()


def test_layer_bench_foreign_kernel_before_each_projection(monkeypatch):
    """EPILORA_BENCH_FOREIGN=1: every layer column once more with the foreign kernel launched before
    each projection (the engine's order); without it, no such column."""
    import types

    import tools.bench_decode as bd

    log, orders = [], []

    def fake_time_graph(fn):  # one replay: the launch order, and the launch count as the "time"
        log.clear()
        fn()
        orders.append(list(log))
        return float(len(log))

    monkeypatch.setattr(bd, "time_graph", fake_time_graph)
    monkeypatch.setattr(bd, "read_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(bd, "_foreign_kernel", lambda: (lambda: log.append("foreign")))
    monkeypatch.setattr(bd, "LayerCase", lambda p, m, r: types.SimpleNamespace(proj=p))
    monkeypatch.setattr(bd, "_register_our_paths", lambda: None)
    monkeypatch.setattr(bd, "OUR_PATHS", {"ours_x": lambda c: (lambda: log.append(c.proj.name))})
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM: our columns only
    monkeypatch.setenv("EPILORA_BENCH_TOKENS", "1")
    monkeypatch.setenv("EPILORA_BENCH_FOREIGN", "1")
    (row,) = bd.bench_layer(quick=True)
    names = [p.name for p in bd.QWEN3_8B]
    assert row["ours_x_us"] == 4 and row["ours_x_foreign_us"] == 8
    assert orders == [names, [x for n in names for x in ("foreign", n)]]
    monkeypatch.delenv("EPILORA_BENCH_FOREIGN")
    (row,) = bd.bench_layer(quick=True)
    assert "ours_x_foreign_us" not in row and row["ours_x_us"] == 4


def test_bench_host_profile_ranks_own_time():
    """bench's launch section profiles an eager call on the host: the rows say which function
    spends the time, per call."""
    import time as _time

    from tools import bench

    def slow():
        _time.sleep(0.0005)

    def call():
        slow()
        sum(range(10))

    rows = bench.host_profile(call, reps=20, top=5)
    assert rows and all(len(r) == 4 for r in rows)
    assert any("sleep" in r[0] for r in rows[:2]), rows
    assert rows[0][2] >= 400  # µs of own time per call: the sleep



def test_host_cpu_times_an_eager_call_with_the_gpu_faked():
    """tools/host_cpu.py runs the op's host code on CPU tensors (GPU calls faked): both launches of
    the no-adapter path happen, through the dispatch too, and nothing is left patched."""
    import torch

    from epilora_cute import launcher, ops
    from tools import host_cpu

    rows = host_cpu.measure(["no_adapter", "auto:no_adapter"], [1])
    assert [r.get("launches") for r in rows] == [2, 2], rows
    assert all(r["host_us"] > 0 for r in rows)
    assert ops.arch_of.__module__ == "epilora_cute.arch" and launcher._driver.__module__ == "epilora_cute.launcher"
    assert not hasattr(torch.cuda.current_stream, "__wrapped__") and ops._on_gpu(torch.zeros(1)) is False


def test_host_cpu_times_the_plugins_op_on_a_flagged_batch():
    """The "plugin_none" row: the plugin's op on a batch vLLM flagged as having no adapter goes
    straight to vLLM's FP8 path (one launch: the quantization; the vendor GEMM is faked), and the
    plugin's kernel-path choice is restored."""
    from tools import host_cpu
    from vllm_adapter import fused

    before = fused.kernel_path
    rows = host_cpu.measure(["plugin_none"], [1, 64])
    assert [r.get("launches") for r in rows] == [1, 1], rows
    assert all(r["host_us"] > 0 for r in rows) and fused.kernel_path is before


# --- tools/bench_prefill_k2.py (the `prefill_k2` section): everything but the GPU timing --------


def test_prefill_k2_section_registered_and_skips_without_a_hopper_gpu(capsys, monkeypatch):
    from tools import bench, bench_prefill_k2 as bk

    bench._optional_sections()
    assert bench.SECTIONS["prefill_k2"] is bk.bench_prefill_k2
    monkeypatch.setattr(bk.torch.cuda, "is_available", lambda: False)
    assert bk.bench_prefill_k2(True) == []
    assert "needs a Hopper GPU" in capsys.readouterr().out


def test_prefill_k2_settings_and_layer_row():
    from tools import bench_prefill_k2 as bk

    assert bk.settings(True, {}) == ([2048], [1, 8])
    assert bk.settings(False, {"EPILORA_BENCH_TOKENS": "64,300", "EPILORA_BENCH_ADAPTERS": "32"}) == ([64, 300], [32])
    for bad in ("0", "64,x", "-3"):  # the shared parser's errors, not a traceback from int()
        with pytest.raises(ValueError, match="EPILORA_BENCH_TOKENS"):
            bk.settings(True, {"EPILORA_BENCH_TOKENS": bad})
    rows = [{"M": 2048, "adapters": 1, "gflop": g, "scaled_mm_us": t, "k2_serial_us": 2 * t, "k2_overlap_us": t}
            for g, t in ((100.0, 100.0), (300.0, 200.0))]
    rows[1].pop("k2_overlap_us")  # a column missing from one projection is left out of the layer
    lr = bk.layer_row(rows)
    assert lr["proj"] == "layer" and lr["gflop"] == 400.0
    assert lr["scaled_mm_us"] == 300.0 and lr["k2_serial_us"] == 600.0 and "k2_overlap_us" not in lr
    assert lr["k2_serial_over_vendor"] == 2.0
    assert abs(lr["scaled_mm_tflops"] - 400.0 / 300.0 * 1e3) < 1e-9  # GFLOP / µs = PFLOP/s
    assert "layer" in bk.format_row(lr)


def test_k_sweep_fit_separates_fixed_and_per_k_cost():
    from tools.bench_k_sweep import fit_line, summarize

    assert fit_line([1, 2, 3], [12, 14, 16]) == (10.0, 2.0)
    with pytest.raises(ValueError):
        fit_line([4], [1])
    with pytest.raises(ValueError):
        fit_line([4, 4], [1, 2])
    rows = [{"K": k, "k2_us": 100 + 0.05 * k, "k2_pers_us": 60 + 0.05 * k, "scaled_mm_us": 20 + 0.04 * k}
            for k in (1024, 2048, 4096)]
    fit = summarize(rows)
    assert abs(fit["k2"]["fixed_us"] - 100) < 1e-9 and abs(fit["k2"]["us_per_1k_K"] - 51.2) < 1e-9
    assert abs(fit["k2_pers"]["fixed_us"] - 60) < 1e-9
    assert abs(fit["scaled_mm"]["fixed_us"] - 20) < 1e-9


def test_kernel_diag_cases_named_by_gpu_session_exist():
    """Every kernel_diag case a gpu_session.sh mode runs (directly or through a `for c in ...`
    loop) exists, and the tool names its cases when called without one, instead of a traceback
    inside a device call."""
    import re
    import shlex
    import subprocess

    from tools import kernel_diag

    text = (ROOT / "tools" / "gpu_session.sh").read_text()
    named = set(re.findall(r"kernel_diag\.py (\w+)", text))
    for items, body in re.findall(r"for c in (.*?); do\n(.*?)\n\s*done", text, re.S):
        if "kernel_diag.py $c" in body:
            named |= {shlex.split(item)[0] for item in shlex.split(items)}
    assert {"k1_wg", "expand_ct", "decode"} <= named
    assert named <= set(kernel_diag.CASES), named - set(kernel_diag.CASES)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_diag.py")], capture_output=True, text=True)
    assert r.returncode == 1 and "usage" in r.stderr and "k1_wg" in r.stderr


def test_bench_prefetch_section_windows_and_budgets(monkeypatch):
    """bench_prefetch (perf.md v0.77): registered as a bench section; the windows before qkv / o /
    gate_up / down are norm / attention / norm / activation, the budget after qkv is the attention
    window's (o's weight across the attention), the plugin's budgets when EPILORA_L2_PREFETCH sets them."""
    from tools import bench, bench_prefetch as bp
    from vllm_adapter import prefetch_plan

    bench._optional_sections()
    assert bench.SECTIONS["prefetch"] is bp.bench_prefetch
    monkeypatch.delenv("EPILORA_BENCH_WINDOWS", raising=False)
    assert bp.windows_us() == bp.DEFAULT_WINDOWS_US
    monkeypatch.setenv("EPILORA_BENCH_WINDOWS", "10,3,1.5")
    assert bp.window_before(*bp.windows_us()) == (3.0, 10.0, 3.0, 1.5)
    monkeypatch.delenv(prefetch_plan.ENV, raising=False)
    mb = prefetch_plan.MB
    assert bp.budgets_bytes() == (32 * mb, 8 * mb)
    monkeypatch.setenv(prefetch_plan.ENV, "16,4")
    assert bp.budget_after(*bp.budgets_bytes()) == (16 * mb, 4 * mb, 4 * mb, 4 * mb)


def test_bench_prefetch_runs_the_engine_order_with_the_next_weight_prefetched(monkeypatch):
    """bench_prefetch's graphs, run once each on fakes (no GPU): every projection follows its window,
    each `_pf` column prefetches the next projection's weight (the next layer's qkv after down) with
    the window's budget, and the gain columns pair each `_pf` column with its plain one."""
    from types import SimpleNamespace

    from epilora_cute import prefetch
    from tools import bench_prefetch as bp

    events = []
    monkeypatch.setattr(bp, "Spin", lambda: (lambda us: (lambda: events.append(("window", us)))))
    cases = {}

    def fake_case(p, m, rank, seed=0):
        c = SimpleNamespace(proj=p, m=m, rank=rank, w_q=torch.zeros(8, 16, dtype=torch.float8_e4m3fn), name=f"{seed}:{p.name}")
        cases[c.name] = c
        return c
    monkeypatch.setattr(bp, "LayerCase", fake_case)
    monkeypatch.setattr(bp, "_op", lambda c, path: (lambda: events.append(("op", c.name, path))))
    monkeypatch.setattr(prefetch, "prefetch_l2", lambda t, nbytes=None: events.append(("pf", t, nbytes)))

    class FakeBeside:  # the second stream's fork and join, as events
        def launch(self, t, nbytes=None):
            events.append(("fork", t, nbytes))

        def join(self):
            events.append(("join",))
    monkeypatch.setattr(prefetch, "BesidePrefetch", FakeBeside)
    graphs = []  # the events of every timed graph, in timing order
    times = iter(range(1, 1000))

    def fake_time_graph(fn):
        events.clear()
        fn()
        graphs.append(list(events))
        return float(next(times))
    monkeypatch.setattr(bp, "time_graph", fake_time_graph)
    monkeypatch.setenv("EPILORA_BENCH_TOKENS", "1")
    monkeypatch.setenv("EPILORA_BENCH_WINDOWS", "8,2,2")
    monkeypatch.setenv("EPILORA_BENCH_PF_PROJECTIONS", "0")
    monkeypatch.delenv("EPILORA_L2_PREFETCH", raising=False)
    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError("no vllm"))
                        if name == "vllm" else real_import(name, *a, **k))
    rows = bp.bench_prefetch(quick=True)
    (row,) = rows
    cols = ["ours_decode_sq", "ours_decode_sq_pf", "ours_decode_sq_pf2", "ours_no_adapter", "ours_no_adapter_pf",
            "ours_no_adapter_pf2"]
    assert {c + "_us" for c in cols} <= set(row)
    assert not any("spf" in k for k in row)  # v0.79's columns went with it
    for base in ("ours_decode_sq", "ours_no_adapter"):
        for suffix in ("_pf", "_pf2"):
            assert row[f"{base}{suffix}_gain_us"] == row[f"{base}_us"] - row[f"{base}{suffix}_us"]
    assert "ours_decode_sq_pf_pf_gain_us" not in row and "ours_decode_sq_pf_pf2_gain_us" not in row
    order = [f"{s}:{p}" for s in (0, 1) for p in ("qkv", "o", "gate_up", "down")]
    mb = 1 << 20
    # graphs after the spin calibration and the windows alone: one per column, in `cols` order
    plain, pf, pf2 = graphs[-6:-3]
    assert [e for e in plain if e[0] == "op"] == [("op", n, "decode_sq") for n in order]
    assert [e[0] for e in plain if e[0] != "window"] == ["op"] * 8
    # _pf: window, op, prefetch of the next weight in the same stream, per projection
    assert [e[0] for e in pf if e[0] != "window"] == ["op", "pf"] * 8
    pfs = [e for e in pf if e[0] == "pf"]
    assert [e[1] is cases[order[(i + 1) % 8]].w_q for i, e in enumerate(pfs)] == [True] * 8
    assert [e[2] for e in pfs] == [32 * mb, 8 * mb, 8 * mb, 8 * mb] * 2
    assert [e[1] for e in pf if e[0] == "window"] == [2.0, 8.0, 2.0, 2.0] * 2
    # _pf2: window, join, op, fork of the next weight's prefetch; the capture ends joined
    assert [e[0] for e in pf2] == ["window", "join", "op", "fork"] * 8 + ["join"]
    forks = [e for e in pf2 if e[0] == "fork"]
    assert [e[1] is cases[order[(i + 1) % 8]].w_q for i, e in enumerate(forks)] == [True] * 8
    assert [e[2] for e in forks] == [32 * mb, 8 * mb, 8 * mb, 8 * mb] * 2


def test_layer_parts_settings_derive_and_format():
    """tools/bench_layer_parts.py's CPU side: the knobs, the derived differences (left out when a
    part is missing) and the printed row; the section is registered with tools/bench.py."""
    from tools import bench
    from tools import bench_layer_parts as lp

    assert lp.settings({}) == ([32, 64], [8, 1])
    assert lp.settings({"EPILORA_BENCH_TOKENS": "48", "EPILORA_BENCH_ADAPTERS": "4"}) == ([48], [4])
    with pytest.raises(ValueError, match="EPILORA_BENCH_TOKENS"):
        lp.settings({"EPILORA_BENCH_TOKENS": "0"})
    row = {"M": 64, "adapters": 8, "op_us": 155.0, "mirror_us": 156.0, "no_expand_us": 130.0, "no_k1_us": 140.0,
           "serial_us": 180.0, "base_us": 100.0}
    d = lp.derive(row)
    assert d == {"adapter_cost_us": 56.0, "expand_exposed_us": 26.0, "k1_exposed_us": 16.0, "fork_saves_us": 24.0}
    del row["base_us"]
    assert "adapter_cost_us" not in lp.derive(row) and "k1_exposed_us" in lp.derive(row)
    row.update(lp.derive(row), gemm_error="boom")
    text = lp.format_row(row)
    assert text.startswith("layer_parts M=   64 A= 8") and "base ERROR" in text and "expand_exposed +26.0" in text
    assert lp.zsplits({}) == [] and lp.zsplits({"EPILORA_BENCH_K1_ZSPLITS": "1, 2"}) == [1, 2]
    assert lp.selected_parts({}) == lp.PARTS
    assert lp.selected_parts({"EPILORA_BENCH_PARTS": "mirror, expand,base"}) == ("mirror", "base", "expand")
    with pytest.raises(ValueError, match="expnd"):
        lp.selected_parts({"EPILORA_BENCH_PARTS": "expnd"})
    for bad in ("0", "x", "70000"):
        with pytest.raises(ValueError, match="EPILORA_BENCH_K1_ZSPLITS"):
            lp.zsplits({"EPILORA_BENCH_K1_ZSPLITS": bad})
    assert lp.zsplit_parts([1, 2]) == ("mirror_z1", "k1_z1", "mirror_z2", "k1_z2")
    zrow = {"M": 64, "adapters": 8, "mirror_us": 150.0, "mirror_z1_us": 146.5, "k1_z1_us": 20.0}
    assert lp.derive(zrow) == {"z1_saves_us": 3.5}
    zrow.update(lp.derive(zrow))
    text = lp.format_row(zrow, (*lp.PARTS, *lp.zsplit_parts([1, 2])))
    assert "mirror_z1 146.5" in text and "mirror_z2 ERROR" in text and "z1_saves +3.5" in text
    bench._optional_sections()
    assert bench.SECTIONS["layer_parts"] is lp.bench_layer_parts
