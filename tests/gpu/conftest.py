"""GPU tests (skipped without CUDA and TE: see tests/conftest.py)."""

import sys
from pathlib import Path

import pytest

# Test modules and torchrun workers import their shared helpers from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def single_gpu():
    from megatron.moe_patches.testing.layer_harness import init_single_gpu

    init_single_gpu()
