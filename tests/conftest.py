import pytest
import torch

GPU_DIRS = ("tests/gpu/", "tests/functional/")


def _gpu_unavailable() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (run on the device machine, see README 'GPU tests')"
    from megatron.moe_patches import capabilities

    if capabilities.te_version() is None:
        return "needs Transformer Engine (pip install -e '.[te]' or the device kit)"
    return ""


def pytest_collection_modifyitems(config, items):
    """GPU and functional tests skip themselves, with the reason, where they cannot run."""
    reason = _gpu_unavailable()
    if reason:
        for item in items:
            if any(d in str(item.fspath).replace("\\", "/") for d in GPU_DIRS):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def reverted():
    """Leave megatron-core unpatched after the test, whatever it applied."""
    from megatron.moe_patches import revert

    revert()
    yield
    revert()
