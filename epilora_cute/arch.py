"""Which GPU we are on and which compiled target serves it."""

from __future__ import annotations

import functools

import torch

# Compute capability -> the DSL target whose arch-specific instructions (wgmma, tcgen05) we use.
_TARGETS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a", (12, 1): "sm_121a"}
# Targets our CuTe-DSL kernels are written and tested for (the Hopper kernels need wgmma).
CUTE_GEMM_TARGETS = ("sm_90a",)
SIMPLE_KERNEL_TARGETS = ("sm_90a", "sm_100a", "sm_120a")


def device_arch(device: torch.device | int | None = None) -> str | None:
    """'sm_90a' etc. for the given CUDA device, None for CPUs and GPUs without a CuTe target."""
    if not torch.cuda.is_available():
        return None
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = device.index
    return _arch_of_index(torch.cuda.current_device() if device is None else int(device))


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str | None:
    return _TARGETS.get(tuple(torch.cuda.get_device_capability(index)))


def arch_of(t: torch.Tensor) -> str | None:
    return device_arch(t.device) if t.is_cuda else None
