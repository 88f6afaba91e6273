"""vllm_adapter.shadow (EPILORA_SHADOW_STOCK): the debug comparison of our layer's output with the
stock class's, without vLLM (the real classes: tests/test_vllm_plugin.py)."""

from __future__ import annotations

import logging

import torch

from vllm_adapter import shadow


def test_equal_outputs_count_as_calls_only():
    st = shadow.ShadowStats()
    y = torch.randn(3, 8).to(torch.bfloat16)
    st.record("l0", True, y, y.clone())
    assert st.calls == {"none": 1, "adapters": 0} and st.mismatches == {"none": 0, "adapters": 0}


def test_a_no_adapter_mismatch_is_reported_with_its_size(caplog):
    st = shadow.ShadowStats()
    y = torch.zeros(2, 4, dtype=torch.bfloat16)
    z = y.clone()
    z[1, 2] = 0.5
    with caplog.at_level(logging.WARNING, logger="vllm.epilora"):
        st.record("model.layers.0.mlp.down_proj", True, z, y)
    assert st.mismatches["none"] == 1 and st.max_abs["none"] == 0.5
    msg = caplog.records[-1].getMessage()
    assert "down_proj" in msg and "differing=1 of 8" in msg


def test_adapter_batches_are_counted_apart_and_not_reported(caplog):
    st = shadow.ShadowStats()
    y = torch.ones(2, 4, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="vllm.epilora"):
        st.record("l", False, y * 1.01, y)
    assert st.mismatches == {"none": 0, "adapters": 1} and 0 < st.max_rel["adapters"] < 0.02
    assert not caplog.records
    assert "adapters: 1/1 calls differ" in st.summary()


def test_compare_runs_the_stock_apply_and_reads_the_host_flag(monkeypatch):
    monkeypatch.setattr(shadow, "STATS", shadow.ShadowStats())
    y = torch.randn(2, 4)
    called = []
    shadow.compare("l", torch.tensor([True]), y, lambda: called.append(1) or y.clone())
    shadow.compare("l", None, y, lambda: y + 1)
    assert called == [1]
    assert shadow.STATS.calls == {"none": 1, "adapters": 1} and shadow.STATS.mismatches["adapters"] == 1
