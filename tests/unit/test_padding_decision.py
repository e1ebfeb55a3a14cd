import pytest

from megatron.moe_patches import apply, capabilities as cap
from megatron.moe_patches.routed_expert_padding import (
    OP_FUSER_ALIGNMENT,
    quantization_alignment,
    skip_routed_expert_padding,
)

def test_quantization_alignment(moe_config):
    assert quantization_alignment(moe_config()) is None
    assert quantization_alignment(moe_config(fp8="e4m3")) == 16
    assert quantization_alignment(moe_config(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    # The op fuser's 256 applies only once its patch (F4) is installed.
    assert quantization_alignment(moe_config(use_transformer_engine_op_fuser=True)) is None
    assert OP_FUSER_ALIGNMENT % 32 == 0  # every recipe alignment divides it


@pytest.mark.parametrize("fused_kernel", [True, False])
def test_op_fuser_alignment_where_te_fuses_the_grouped_mlp(moe_config, reverted, monkeypatch, fused_kernel):
    monkeypatch.setattr(cap, "te_fused_grouped_mlp_kernel", lambda: fused_kernel)
    apply(["F4"])
    fused_fp8 = moe_config(fp8="e4m3", use_transformer_engine_op_fuser=True)
    assert quantization_alignment(fused_fp8) == (256 if fused_kernel else 16)
    assert quantization_alignment(moe_config(fp8="e4m3")) == 16
    assert quantization_alignment(moe_config(use_transformer_engine_op_fuser=True)) is None  # bf16 never pads


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
def test_skip_routed_expert_padding_table(moe_config, monkeypatch, reverted, overrides, f1_applied, te_kernel, expected):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: te_kernel)
    if f1_applied:
        apply(["F1"])
    assert skip_routed_expert_padding(moe_config(**overrides)) is expected
