"""vLLM's lm_head LoRA wrapper, without its work when no resident adapter has lm_head weights.

vLLM wraps the logits processor in ``LogitsProcessorWithLoRA`` whenever LoRA is on. Every step
with an active adapter it then runs ``punica_wrapper.add_lora_logits``: a shrink of the hidden
states and an expand over the whole vocabulary (Qwen3: 151936 x rank bf16 of B per adapter),
eagerly, outside the CUDA graphs, even when no loaded adapter targets ``lm_head`` and every B it
reads is zero (``reset_lora`` zeroes a slot whose adapter has no weights for the module). The
delta is then exactly zero: the logits are the base layer's, bit for bit (adding +-0 changes no
value but the sign of a zero).

``adopt()`` turns the stock wrapper vLLM built into ``EpiLoRALogitsProcessorWithLoRA``, which
tracks the slots ``set_lora`` filled (``reset_lora`` empties them) and, while none is filled, runs
vLLM's own ``_get_logits`` with the delta's call answered by "no change" instead of the two
kernels. With a filled slot it is vLLM's code unchanged. The plugin installs it through
``vllm.lora.model_manager.from_layer_logits_processor`` (the function vLLM builds the wrapper with;
``plugin._install``); ``EPILORA_LOGITS_LORA_SKIP=0`` keeps vLLM's wrapper as it is.
"""

from __future__ import annotations

import inspect
import logging

from . import eligibility

logger = logging.getLogger("vllm.epilora")

ENV_SKIP = "EPILORA_LOGITS_LORA_SKIP"  # 0: vLLM's wrapper unchanged


class _NoDelta:
    """Stands in for the punica wrapper during a logits call that no resident adapter contributes
    to: ``add_lora_logits`` leaves the logits as they are (returns them, for the platforms that
    do not update in place); everything else is the wrapper's."""

    __slots__ = ("_wrapped",)

    def __init__(self, wrapped):
        self._wrapped = wrapped

    @staticmethod
    def add_lora_logits(y, *args, **kwargs):
        return y

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


_classes: dict[type, type] = {}


def epi_class(stock_cls: type) -> type:
    """Our subclass of vLLM's LogitsProcessorWithLoRA class (one per stock class)."""
    if stock_cls not in _classes:
        class EpiLoRALogitsProcessorWithLoRA(stock_cls):
            # Set by set_lora, cleared by reset_lora: the slots holding lm_head weights. Adopted
            # instances start from vLLM's zeroed buffers (create_lora_weights), i.e. none.
            _epi_filled: frozenset = frozenset()

            def reset_lora(self, index: int):
                super().reset_lora(index)
                self._epi_filled = self._epi_filled - {index}

            def set_lora(self, index: int, *args, **kwargs):
                super().set_lora(index, *args, **kwargs)
                self._epi_filled = self._epi_filled | {index}

            def _get_logits(self, *args, **kwargs):
                if self._epi_filled:
                    return super()._get_logits(*args, **kwargs)
                wrapper = self.punica_wrapper
                self.punica_wrapper = _NoDelta(wrapper)
                try:
                    return super()._get_logits(*args, **kwargs)
                finally:
                    self.punica_wrapper = wrapper

        EpiLoRALogitsProcessorWithLoRA.__qualname__ = EpiLoRALogitsProcessorWithLoRA.__name__
        _classes[stock_cls] = EpiLoRALogitsProcessorWithLoRA
    return _classes[stock_cls]


def hook_problem(stock_cls: type) -> str | None:
    """Why vLLM's class cannot be adopted (its methods are not the ones this module wraps), or None."""
    for name in ("_get_logits", "set_lora", "reset_lora"):
        if not callable(getattr(stock_cls, name, None)):
            return f"{stock_cls.__name__} has no {name}"
    try:
        src = inspect.getsource(stock_cls._get_logits)
    except (OSError, TypeError):
        return f"{stock_cls.__name__}._get_logits has no readable source"
    if "self.punica_wrapper.add_lora_logits(" not in src:
        return f"{stock_cls.__name__}._get_logits does not add the delta through punica_wrapper.add_lora_logits"
    return None


def adopt(module):
    """`module` (vLLM's freshly built LogitsProcessorWithLoRA, its buffers zeroed) as our subclass,
    or unchanged where that does not apply (EPILORA_LOGITS_LORA_SKIP=0, an unknown class)."""
    if not eligibility.env_flag(ENV_SKIP, default=True):
        return module
    stock_cls = type(module)
    if stock_cls in _classes.values():
        return module
    problem = hook_problem(stock_cls)
    if problem:
        logger.info("lm_head LoRA stays on vLLM's %s: %s", stock_cls.__name__, problem)
        return module
    module.__class__ = epi_class(stock_cls)
    logger.info("lm_head LoRA: %s (vLLM's %s; no lm_head delta while no resident adapter has lm_head "
                "weights)", module.__class__.__name__, stock_cls.__name__)
    return module
