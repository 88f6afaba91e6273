"""The kernel families and the in-process table of loaded kernels."""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

from .compile_cache import get_artifact
from .launcher import Kernel

# Every family the prebuild compiles; module path -> imported lazily.
FAMILY_MODULES = ("kernels_dsl.fp8_quant",)
OPTIONAL_FAMILY_MODULES = ("kernels_dsl.lora_shrink", "kernels_dsl.k2_gemm", "kernels_dsl.expand_add",
                           "kernels_dsl.k1_shrink", "kernels_dsl.k2_prefill", "kernels_dsl.l2_prefetch",
                           "kernels_dsl.shrink_stream", "kernels_dsl.shrink_grouped")

_loaded: dict[tuple, Kernel] = {}
_lock = threading.Lock()


def families(include_optional: bool = True) -> list[ModuleType]:
    mods = [importlib.import_module(m) for m in FAMILY_MODULES]
    if include_optional:
        for m in OPTIONAL_FAMILY_MODULES:
            try:
                mod = importlib.import_module(m)
            except ImportError as e:  # not built on this DSL version / work in progress: skip it
                logging.getLogger("epilora_cute").warning("kernel family %s unavailable: %s", m, e)
                continue
            # A family joins the prebuild set once it declares the runtime contract (FAMILY,
            # Config.name(), Config.block, params(config) or PARAMS, prebuild_configs()).
            if getattr(mod, "RUNTIME_CONTRACT", False):
                mods.append(mod)
    return mods


def get_kernel(module: ModuleType, config, arch: str) -> Kernel:
    """The launchable kernel for (family, config, arch), compiled or loaded from disk once."""
    key = (module.FAMILY, config, arch)
    k = _loaded.get(key)
    if k is None:
        with _lock:
            k = _loaded.get(key)
            if k is None:
                params = module.params(config) if hasattr(module, "params") else module.PARAMS
                k = Kernel(get_artifact(module, config, arch), params, config.block)
                _loaded[key] = k
    return k
