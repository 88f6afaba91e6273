"""vLLM general plugin entry point: ``vllm.general_plugins: epilora_cute = vllm_adapter.plugin:register``.

vLLM calls ``register()`` in every process it starts (engine, each worker), before the model
and its LoRA wrappers are built, and possibly more than once per process; it does not catch
exceptions from plugins, so ``register()`` never raises: on any problem it logs and leaves vLLM
unchanged. Installed means on; ``EPILORA_DISABLE=1`` turns it off.

What it changes: our LoRA linear subclasses go in front of ``vllm.lora.utils._all_lora_classes``
(the tuple ``from_layer`` walks), ``vllm.lora.model_manager.from_layer_logits_processor`` (how
vLLM builds its lm_head LoRA wrapper) hands its result to ``logits.adopt`` (no lm_head delta while
no resident adapter has lm_head weights), and the custom op is registered. Nothing in vLLM's
source is patched; ``unregister()`` restores both names (tests).
"""

from __future__ import annotations

import logging

from . import eligibility, versions

logger = logging.getLogger("vllm.epilora")

ENV_DISABLE = "EPILORA_DISABLE"


class _State:
    registered = False
    original: tuple | None = None  # vLLM's tuple before ours
    classes: tuple = ()
    logits_builder = None  # vLLM's from_layer_logits_processor, where ours wraps it


def is_registered() -> bool:
    return _State.registered


def register() -> bool:
    """Install the plugin; True when it is active in this process. Idempotent, never raises."""
    if eligibility.env_flag(ENV_DISABLE):
        logger.info("EpiLoRA plugin disabled by %s", ENV_DISABLE)
        return False
    if _State.registered:
        return True
    ok, message = versions.check()
    if not ok:
        logger.warning("EpiLoRA plugin off: %s", message)
        return False
    try:
        _install()
    except Exception as e:  # an API drift must not take vLLM down with it
        logger.warning("EpiLoRA plugin off: could not hook into vLLM's LoRA layers (%s: %s)",
                       type(e).__name__, e)
        return False
    logger.info("EpiLoRA plugin active: fused FP8 LoRA for %d LoRA linear classes (%s)",
                len(_State.classes), message)
    return True


def _install() -> None:
    import vllm.lora.utils as lora_utils

    from . import layers

    current = tuple(lora_utils._all_lora_classes)
    stock = tuple(c for c in current if not issubclass(c, layers.EpiLoRALinearMixin))
    classes = layers.build(stock)
    if not classes:
        raise RuntimeError("none of the expected LoRA linear classes found in vllm.lora.layers")
    lora_utils._all_lora_classes = classes + stock
    _State.original, _State.classes, _State.registered = current, classes, True
    _install_logits_hook()
    # A serving engine: settle every token bucket at a projection's first call (vLLM's profile
    # run), not on a request's first contact with a batch size (epilora_cute/bucket_warmup.py).
    from epilora_cute import bucket_warmup

    bucket_warmup.enable_by_default()


def _install_logits_hook() -> None:
    """vLLM's model manager builds the lm_head wrapper with its module-level name
    from_layer_logits_processor: wrap that name so the result goes through logits.adopt. Optional:
    without the name (another vLLM layout) the lm_head wrapper stays vLLM's, said in one line."""
    try:
        import vllm.lora.model_manager as model_manager
    except Exception as e:
        logger.info("lm_head LoRA stays on vLLM's wrapper: vllm.lora.model_manager (%s: %s)", type(e).__name__, e)
        return
    build = getattr(model_manager, "from_layer_logits_processor", None)
    if not callable(build):
        logger.info("lm_head LoRA stays on vLLM's wrapper: no vllm.lora.model_manager.from_layer_logits_processor")
        return
    from . import logits

    def from_layer_logits_processor(*args, **kwargs):
        return logits.adopt(build(*args, **kwargs))

    model_manager.from_layer_logits_processor = from_layer_logits_processor
    _State.logits_builder = build


def unregister() -> None:
    """Put vLLM's tuple and lm_head builder back (tests; a process that wants stock behaviour again)."""
    if not _State.registered:
        return
    import vllm.lora.utils as lora_utils

    lora_utils._all_lora_classes = _State.original
    if _State.logits_builder is not None:
        import vllm.lora.model_manager as model_manager

        model_manager.from_layer_logits_processor = _State.logits_builder
    _State.original, _State.classes, _State.registered, _State.logits_builder = None, (), False, None
    from epilora_cute import bucket_warmup

    bucket_warmup.enable_by_default(False)
