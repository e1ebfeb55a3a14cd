"""GPU tests (skipped without CUDA and TE: see tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def single_gpu():
    from megatron.moe_patches.harness import init_single_gpu

    init_single_gpu()
