"""Which weight each of our layers asks L2 to prefetch for the projection after it (opt-in).

At decode sizes every projection streams its weight from DRAM while the kernels between two
projections (attention, the norms, the activation) leave DRAM nearly idle. With
``EPILORA_L2_PREFETCH`` on, each layer's op ends with ``epilora_cute.prefetch.prefetch_l2`` of
the next projection's FP8 weight (its first bytes, up to a budget per window), so that stream
starts from L2 (docs/perf.md v0.77). run32 measured it slower in the stream: the prefetch kernel
lasts as long as its bytes take and vLLM's kernels of the window start only after it, although the
prefetched lines save the next projection 3–5 µs; on a second stream beside the window (v0.80,
bench only) run33 measured ≤ +2.2 µs per layer, too little to build here. Off by default.

What follows what is read from vLLM's module names (the decoder layers of Llama / Qwen / Mistral):
``…self_attn.qkv_proj`` → ``…self_attn.o_proj`` (across the attention: the "attention" window),
``o_proj`` → ``…mlp.gate_up_proj`` (residual add + norm), ``gate_up_proj`` → ``…mlp.down_proj``
(the activation), ``…layers.{i}.mlp.down_proj`` → ``…layers.{i+1}.self_attn.qkv_proj`` (residual
add + norm): the "other" windows. Any other name prefetches nothing.

Layers are registered as vLLM builds their LoRA wrappers (outside traced code) and known to the
op by an int id (the op's ``prefetch_id``), like vLLM's host flag in ``custom_op``: a compiled
graph holds the id, and the id is resolved to the successor's weight when the op runs, so the
successor may be registered after its predecessor. Ids are given in registration order, which is
the model's module order: the same in every process that builds the same model.

Layers register only when ``EPILORA_L2_PREFETCH`` is on as they are built; the others pass id -1.
A per-layer id is a per-layer constant in the traced graph, so vLLM's compiler no longer finds the
decoder layers' graph pieces isomorphic and compiles each one instead of reusing the first: with
ids on every layer (run32, run33) Inductor took 81–98 s instead of 19–25 s and the engine came up
60–80 s later than stock. Turning the prefetch on after the engine is built does nothing.

``EPILORA_L2_PREFETCH``: unset / "0" off; "1" on with DEFAULT_BUDGET_MB; "A,B" on with A MB
for the attention window and B MB for the others. ``EPILORA_L2_PREFETCH_MAX_TOKENS`` (default
32): larger batches prefetch nothing (their attention reads enough KV cache to keep DRAM busy).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import weakref

import torch

logger = logging.getLogger("vllm.epilora")

ENV = "EPILORA_L2_PREFETCH"
ENV_MAX_TOKENS = "EPILORA_L2_PREFETCH_MAX_TOKENS"
DEFAULT_BUDGET_MB = (32.0, 8.0)  # (attention window, other windows)
DEFAULT_MAX_TOKENS = 32
MB = 1 << 20

_QKV = re.compile(r"^(?P<p>.*)\.self_attn\.qkv_proj$")
_O = re.compile(r"^(?P<p>.*)\.self_attn\.o_proj$")
_GATE_UP = re.compile(r"^(?P<p>.*)\.mlp\.gate_up_proj$")
_DOWN = re.compile(r"^(?P<p>.*\.layers)\.(?P<i>\d+)\.mlp\.down_proj$")


@functools.lru_cache(maxsize=4096)  # asked on every op call: one regex match per module name, once
def successor(prefix: str) -> tuple[str, str] | None:
    """(the next projection's module name, the window between them: "attention" / "other"), or
    None for a name outside the decoder-layer pattern."""
    if m := _QKV.match(prefix):
        return f"{m['p']}.self_attn.o_proj", "attention"
    if m := _O.match(prefix):
        return f"{m['p']}.mlp.gate_up_proj", "other"
    if m := _GATE_UP.match(prefix):
        return f"{m['p']}.mlp.down_proj", "other"
    if m := _DOWN.match(prefix):
        return f"{m['p']}.{int(m['i']) + 1}.self_attn.qkv_proj", "other"
    return None


def budgets(value: str | None = None) -> tuple[float, float] | None:
    """The budgets (MB) that ``EPILORA_L2_PREFETCH`` asks for, None when off. A malformed value
    turns it off with one warning (a hint must not take the engine down)."""
    return _parse_budgets(os.environ.get(ENV, "") if value is None else value)


@functools.lru_cache(maxsize=64)  # asked on every op call
def _parse_budgets(value: str) -> tuple[float, float] | None:
    value = value.strip()
    if value in ("", "0"):
        return None
    if value == "1":
        return DEFAULT_BUDGET_MB
    try:
        attn, other = (float(v) for v in value.split(","))
    except ValueError:
        attn = other = -1.0
    if attn < 0 or other < 0:
        _warn_once(f"bad {ENV}", f"EpiLoRA: {ENV}={value!r} is not 0, 1 or 'A,B' (MB): L2 prefetch off")
        return None
    return attn, other


def max_tokens() -> int:
    value = os.environ.get(ENV_MAX_TOKENS, "")
    try:
        return int(value) if value else DEFAULT_MAX_TOKENS
    except ValueError:
        _warn_once(f"bad {ENV_MAX_TOKENS}", f"EpiLoRA: {ENV_MAX_TOKENS}={value!r} is not an int: "
                   f"{DEFAULT_MAX_TOKENS} used")
        return DEFAULT_MAX_TOKENS


_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


class _Registry:
    prefixes: list[str] = []  # id -> module name
    layers: list[weakref.ref] = []  # id -> the base layer (its .weight read when the op runs)
    ids: dict[str, int] = {}  # module name -> id


def register(prefix: str, base_layer: torch.nn.Module) -> int:
    """The id under which the op finds this layer (-1 for a layer without a name). A name seen
    before keeps its id and now means this layer (a process that builds a second engine)."""
    if not prefix:
        return -1
    i = _Registry.ids.get(prefix)
    if i is None:
        i = len(_Registry.prefixes)
        _Registry.prefixes.append(prefix)
        _Registry.layers.append(weakref.ref(base_layer))
        _Registry.ids[prefix] = i
    else:
        _Registry.layers[i] = weakref.ref(base_layer)
    return i


def target(layer_id: int, tokens: int) -> tuple[torch.Tensor, int] | None:
    """(the weight to prefetch after layer ``layer_id`` ran on ``tokens`` tokens, bytes to ask
    for), or None: prefetch off, too many tokens, no successor by name, or the successor is not
    (or no longer) registered."""
    if layer_id < 0 or layer_id >= len(_Registry.prefixes):
        return None
    b = budgets()
    if b is None or tokens > max_tokens():
        return None
    nxt = successor(_Registry.prefixes[layer_id])
    if nxt is None:
        return None
    name, window = nxt
    j = _Registry.ids.get(name)
    layer = _Registry.layers[j]() if j is not None else None
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    nbytes = int((b[0] if window == "attention" else b[1]) * MB)
    return (weight, nbytes) if nbytes > 0 else None


def run(layer_id: int, tokens: int) -> int:
    """Launch the prefetch that ``target`` names (bytes asked for; 0 when none)."""
    t = target(layer_id, tokens)
    if t is None:
        return 0
    from epilora_cute.prefetch import prefetch_l2

    return prefetch_l2(*t)


def reset() -> None:
    """Forget every registration (tests)."""
    _Registry.prefixes, _Registry.layers, _Registry.ids = [], [], {}
