"""GPU tests: need CUDA and Transformer Engine; skipped with the reason otherwise."""

import pytest
import torch


def _unavailable() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (run on the device machine, see README 'GPU tests')"
    from megatron.moe_patches import capabilities

    if capabilities.te_version() is None:
        return "needs Transformer Engine (pip install -e '.[te]' or the device kit)"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = _unavailable()
    if reason:
        for item in items:
            if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def single_gpu():
    from megatron.moe_patches.harness import init_single_gpu

    init_single_gpu()
