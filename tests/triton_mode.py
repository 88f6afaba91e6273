"""How Triton kernels run in the tests: compiled on a GPU, under the interpreter without one.

Triton picks interpreter or compiler when it decorates each @triton.jit function (its standard
library's too, at import), so TRITON_INTERPRET=1 must be set before triton is first imported
(tests/conftest.py does that). ``skip_unless_runnable`` skips the calling test module when that
did not happen.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")


def skip_unless_runnable() -> None:
    if HAS_GPU:
        return
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.language.standard as tl_standard
    if type(tl_standard.cdiv).__name__ != "InterpretedFunction":
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set (see tests/conftest.py)",
                    allow_module_level=True)
