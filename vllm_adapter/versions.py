"""Which vLLM releases the plugin supports, checked before it touches anything.

The range matches the ``vllm`` extra in pyproject.toml (a test keeps the two equal). Inside it,
the hooks the plugin uses were read in each release's source: ``vllm.lora.utils._all_lora_classes``
read by ``from_layer``, the LoRA linear classes, ``PunicaWrapperBase.update_metadata`` /
``token_lora_indices``, and the per-tensor FP8 linear methods storing the weight as a
column-major [K, N] view with a scalar scale (docs/plugin.md lists what was verified where).
"""

from __future__ import annotations

import re
from importlib import metadata

MIN_VERSION = (0, 26, 0)  # inclusive
MAX_VERSION = (0, 35)  # exclusive
SUPPORTED_SPEC = ">=0.26.0,<0.35"


def parse_release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string: '0.27.1rc2+cu129' -> (0, 27, 1).

    Pre-releases, dev builds and local tags count as their release, so a source build of a
    supported release is accepted. None when there is no leading number.
    """
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def _pad(t: tuple[int, ...], n: int = 3) -> tuple[int, ...]:
    return t + (0,) * (n - len(t))


def is_supported(version: str) -> bool:
    rel = parse_release(version)
    if rel is None:
        return False
    return _pad(MIN_VERSION) <= _pad(rel) < _pad(MAX_VERSION)


def installed_vllm_version() -> str | None:
    """vLLM's version from its distribution metadata, without importing vllm."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check(version: str | None = None) -> tuple[bool, str]:
    """(supported, message). ``version`` None reads the installed one."""
    if version is None:
        version = installed_vllm_version()
    if version is None:
        return False, "vllm is not installed"
    if not is_supported(version):
        return False, (f"vLLM {version} is outside the supported range vllm{SUPPORTED_SPEC}; "
                       "the EpiLoRA plugin stays off and vLLM runs unchanged")
    return True, f"vLLM {version} is supported (vllm{SUPPORTED_SPEC})"
