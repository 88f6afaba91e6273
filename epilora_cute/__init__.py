"""EpiLoRA-CuTe: multi-tenant LoRA computed inside low-precision GEMMs (CuTe-DSL kernels)."""

__version__ = "0.1.0"
