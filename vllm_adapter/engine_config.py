"""What the plugin reads from vLLM's engine configuration for the runtime (no vLLM needed to test).

The bucket warm-up settles every token bucket of a projection at its first call (vLLM's profile
run) in each mode a batch of that size can run in. A batch above vLLM's largest CUDA-graph size is
never replayed from a graph, so ``note_graph_limit`` tells the dispatch that size
(``dispatch.set_graph_max_tokens``) and the warm-up skips timing those buckets as graph replays
(docs/perf.md v1.01). Read where vLLM has its configuration current: while it builds the model's
LoRA layers (``create_lora_weights``, inside the worker's ``set_current_vllm_config``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def graph_max_tokens_of(vllm_config) -> int | None:
    """The largest batch vLLM captures CUDA graphs for under ``vllm_config``: 0 when it captures
    none (``cudagraph_mode`` NONE, as ``enforce_eager`` sets it, or no capture sizes), None when
    the configuration does not say (then every bucket is settled in both modes, as before)."""
    cc = getattr(vllm_config, "compilation_config", None)
    if cc is None:
        return None
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", None) == "NONE":
        return 0
    sizes = getattr(cc, "cudagraph_capture_sizes", None)
    if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
        return max(sizes) if sizes else 0
    n = getattr(cc, "max_cudagraph_capture_size", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def current_vllm_config():
    """vLLM's current configuration, or None (outside its context, or a vLLM without the getter)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def note_graph_limit(vllm_config=None) -> int | None:
    """Tell the dispatch the largest batch this engine captures CUDA graphs for (``vllm_config``,
    default vLLM's current one); returns what was set (None: nothing known, nothing changed)."""
    from epilora_cute import dispatch

    n = graph_max_tokens_of(vllm_config if vllm_config is not None else current_vllm_config())
    if n is not None and dispatch.set_graph_max_tokens(n) != n:
        logger.info("EpiLoRA: CUDA graphs up to %d tokens in this engine: the dispatch warm-up times "
                    "larger token buckets in eager mode only", n)
    return n
