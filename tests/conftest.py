import pytest


@pytest.fixture
def reverted():
    """Leave megatron-core unpatched after the test, whatever it applied."""
    from megatron.moe_patches import revert

    revert()
    yield
    revert()
