"""Debug mode ``EPILORA_SHADOW_STOCK=1``: every eager call of an EpiLoRA layer also runs the stock
class's ``apply`` on the same input and compares (numerics hunting in a real engine).

Why: without adapters our layer runs vLLM's own FP8 path (our quantization with vLLM's codes +
vLLM's CUTLASS GEMM), so on a no-adapter batch the two outputs must be bit-identical; with
adapters they differ by rounding only (vLLM adds the LoRA terms in its own kernels). The e2e run
has shown ours differing from stock without adapters (greedy 13/16); this mode tells whether the
layers' outputs differ in situ (on the engine's real activations) or the difference comes from
elsewhere. Eager only (``enforce_eager=True`` engines): under torch.compile the comparison would
be traced into the graph, and it syncs with the host.

Output: ``vllm.epilora`` log lines — the first ``MAX_REPORTS`` no-adapter mismatches (layer, rows,
differing elements, max |Δ|) and a summary every ``SUMMARY_EVERY`` compared calls and at exit.
"""

from __future__ import annotations

import atexit
import functools
import logging

import torch

from .eligibility import env_flag

logger = logging.getLogger("vllm.epilora")

ENV_SHADOW = "EPILORA_SHADOW_STOCK"
MAX_REPORTS = 20
SUMMARY_EVERY = 2000


@functools.lru_cache(maxsize=1)
def enabled() -> bool:
    """EPILORA_SHADOW_STOCK (default off), read once."""
    on = env_flag(ENV_SHADOW)
    if on:
        atexit.register(_log_summary_at_exit)
    return on


def _log_summary_at_exit() -> None:
    if STATS.calls["none"] or STATS.calls["adapters"]:
        logger.warning("EpiLoRA shadow at exit: %s", STATS.summary())


class ShadowStats:
    """Counts of compared calls, by whether vLLM flagged the batch as having no adapter."""

    def __init__(self) -> None:
        self.calls = {"none": 0, "adapters": 0}
        self.mismatches = {"none": 0, "adapters": 0}
        self.max_abs = {"none": 0.0, "adapters": 0.0}
        self.max_rel = {"none": 0.0, "adapters": 0.0}  # max |Δ| / max |stock| of a call
        self.reports = 0

    def record(self, name: str, no_lora: bool, ours: torch.Tensor, stock: torch.Tensor) -> None:
        kind = "none" if no_lora else "adapters"
        self.calls[kind] += 1
        if not torch.equal(ours, stock):
            diff = (ours.float() - stock.float()).abs()
            n_diff = int((diff != 0).sum())
            max_abs = float(diff.max())
            rel = max_abs / max(float(stock.float().abs().max()), 1e-30)
            self.mismatches[kind] += 1
            self.max_abs[kind] = max(self.max_abs[kind], max_abs)
            self.max_rel[kind] = max(self.max_rel[kind], rel)
            # A no-adapter call must be bit-identical: report each one (up to a limit).
            if no_lora and self.reports < MAX_REPORTS:
                self.reports += 1
                logger.warning("EpiLoRA shadow mismatch (no adapter): %s rows=%d differing=%d of %d "
                               "max|d|=%.3g rel=%.3g", name, ours.shape[0], n_diff, ours.numel(), max_abs, rel)
        total = self.calls["none"] + self.calls["adapters"]
        if total % SUMMARY_EVERY == 0:
            logger.warning("EpiLoRA shadow: %s", self.summary())

    def summary(self) -> str:
        return ", ".join(f"{k}: {self.mismatches[k]}/{self.calls[k]} calls differ (max|d| {self.max_abs[k]:.3g}, "
                         f"rel {self.max_rel[k]:.3g})" for k in ("none", "adapters"))


STATS = ShadowStats()


def compare(name: str, no_lora_flag: torch.Tensor | None, ours: torch.Tensor, stock_apply) -> None:
    """Run ``stock_apply()`` (the stock class's apply on the same input) and record the comparison.
    Skipped under torch.compile or CUDA-graph capture (eager engines only)."""
    if torch.compiler.is_compiling() or (ours.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    no_lora = bool(no_lora_flag.item()) if no_lora_flag is not None else False
    stock = stock_apply()
    STATS.record(name, no_lora, ours, stock)
