import pytest

from megatron.moe_patches import apply, capabilities as cap
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.routed_expert_padding import (
    OP_FUSER_ALIGNMENT,
    quantization_alignment,
    skip_routed_expert_padding,
)

BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
)


def cfg(**overrides):
    # Stock validation asks TE about permute fusion and FP8 at construction; a CPU
    # machine has no TE, so those fields are set afterwards.
    late = dict(moe_permute_fusion=overrides.pop("moe_permute_fusion", True))
    late.update({k: overrides.pop(k) for k in ("fp8", "fp8_recipe", "moe_router_padding_for_quantization") if k in overrides})
    config = PatchedTransformerConfig(**{**BASE, **overrides})
    for name, value in late.items():
        setattr(config, name, value)
    return config


def test_quantization_alignment():
    assert quantization_alignment(cfg()) is None
    assert quantization_alignment(cfg(fp8="e4m3")) == 16
    assert quantization_alignment(cfg(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    # The op fuser's 256 applies only once its patch (F4) is installed.
    assert quantization_alignment(cfg(use_transformer_engine_op_fuser=True)) is None
    assert OP_FUSER_ALIGNMENT % 32 == 0  # every recipe alignment divides it


TABLE = [
    # (config overrides, F1 applied, TE kernel, experts skip their padding)
    (dict(fp8="e4m3"), False, True, False),
    (dict(fp8="e4m3"), True, True, True),
    (dict(fp8="e4m3"), True, False, False),  # F1 falls back: experts must pad
    (dict(fp8="e4m3", moe_permute_fusion=False), True, True, False),
    (dict(fp8="e4m3", moe_router_padding_for_quantization=True), False, False, True),
    (dict(fp8="e4m3", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"), False, False, True),
    (dict(fp8="e4m3", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"), True, True, False),
    (dict(), True, True, False),  # bf16: nothing pads anywhere
]


@pytest.mark.parametrize("overrides, f1_applied, te_kernel, expected", TABLE)
def test_skip_routed_expert_padding_table(monkeypatch, reverted, overrides, f1_applied, te_kernel, expected):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: te_kernel)
    if f1_applied:
        apply(["F1"])
    assert skip_routed_expert_padding(cfg(**overrides)) is expected
