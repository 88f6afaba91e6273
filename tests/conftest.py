import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh kernel cache for the test (and for subprocesses it starts)."""
    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EPILORA_QUIET_BUILD", "1")
    return tmp_path / "cache"

# The Triton path's tests (tests/test_triton_path.py) run its kernels under the Triton interpreter
# when there is no GPU. Triton chooses interpreter or compiler as it decorates each @triton.jit
# function -- its own standard library's too, when triton is first imported -- so the variable has
# to be set here, before any test module imports triton.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
