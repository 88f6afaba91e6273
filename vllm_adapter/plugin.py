"""vLLM general plugin entry point: ``vllm.general_plugins: epilora_cute = vllm_adapter.plugin:register``.

vLLM calls ``register()`` in every process it starts (engine, each worker), before the model
and its LoRA wrappers are built, and possibly more than once per process; it does not catch
exceptions from plugins, so ``register()`` never raises: on any problem it logs and leaves vLLM
unchanged. Installed means on; ``EPILORA_DISABLE=1`` turns it off.

What it changes: our LoRA linear subclasses go in front of ``vllm.lora.utils._all_lora_classes``
(the tuple ``from_layer`` walks) and the custom op is registered. Nothing in vLLM's source is
patched; ``unregister()`` restores the tuple (tests).
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
    # A serving engine: settle every token bucket at a projection's first call (vLLM's profile
    # run), not on a request's first contact with a batch size (epilora_cute/bucket_warmup.py).
    from epilora_cute import bucket_warmup

    bucket_warmup.enable_by_default()


def unregister() -> None:
    """Put vLLM's tuple back (tests; a process that wants stock behaviour again)."""
    if not _State.registered:
        return
    import vllm.lora.utils as lora_utils

    lora_utils._all_lora_classes = _State.original
    _State.original, _State.classes, _State.registered = None, (), False
    from epilora_cute import bucket_warmup

    bucket_warmup.enable_by_default(False)
