import pytest
import torch

GPU_DIRS = ("tests/gpu/", "tests/functional/")


def _gpu_unavailable() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (see README, 'Running the GPU tests')"
    from megatron.moe_patches import capabilities

    if capabilities.te_version() is None:
        return "needs Transformer Engine (pip install -e '.[te]')"
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


# Stock TransformerConfig validation asks TE about these at construction; a CPU machine
# has no TE, so MoE config tests set them right after construction instead.
TE_CHECKED_FIELDS = ("moe_permute_fusion", "fp8", "fp8_recipe", "moe_router_padding_for_quantization")
MOE_BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
)


@pytest.fixture
def moe_config():
    """Factory: a PatchedTransformerConfig for a small TE-grouped MoE (permute fusion on)."""
    from megatron.moe_patches.config import PatchedTransformerConfig

    def build(**overrides):
        overrides.setdefault("moe_permute_fusion", True)
        late = {k: overrides.pop(k) for k in TE_CHECKED_FIELDS if k in overrides}
        config = PatchedTransformerConfig(**{**MOE_BASE, **overrides})
        for name, value in late.items():
            setattr(config, name, value)
        return config

    return build
