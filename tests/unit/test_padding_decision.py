import pytest
import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.plan import backends as plan_backends
from megatron.moe_patches.experts.op_fuser import FUSED_KERNEL_ALIGNMENT, OpFuserBackend
from megatron.moe_patches.experts.padding import EXPERTS, HYBRIDEP, NOBODY, PERMUTE, ROUTER


def padding_plan(config):
    return moe_plan.plan_for(config).padding


def quantization_alignment(config):
    return padding_plan(config).align


def skip_routed_expert_padding(config):
    return padding_plan(config).earlier_stage_pads


def test_quantization_alignment(moe_config):
    assert quantization_alignment(moe_config()) is None
    assert quantization_alignment(moe_config(fp8="e4m3")) == 16
    assert quantization_alignment(moe_config(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    assert FUSED_KERNEL_ALIGNMENT % 32 == 0  # every recipe alignment divides it


@pytest.mark.parametrize("fused_kernel", [True, False])
def test_op_fuser_alignment_where_te_fuses_the_grouped_mlp(moe_config, monkeypatch, fused_kernel):
    monkeypatch.setattr(cap, "te_fused_grouped_mlp_kernel", lambda: fused_kernel)
    monkeypatch.setattr(OpFuserBackend, "unavailable", classmethod(lambda cls, config: None))
    swiglu = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, use_transformer_engine_op_fuser=True)
    fused_fp8 = moe_config(fp8="e4m3", **swiglu)
    assert moe_plan.plan_for(fused_fp8).backend is OpFuserBackend
    assert quantization_alignment(fused_fp8) == (256 if fused_kernel else 16)
    assert quantization_alignment(moe_config(**swiglu)) is None  # bf16 never pads


def test_op_fuser_alignment_only_where_the_op_fuser_runs(moe_config, monkeypatch):
    # Requested but unable to run (no TE ops here): the experts run TE's path, recipe alignment.
    monkeypatch.setattr(cap, "te_fused_grouped_mlp_kernel", lambda: True)
    assert quantization_alignment(moe_config(fp8="e4m3", use_transformer_engine_op_fuser=True)) == 16


TABLE = [
    # (config overrides, TE has the fused permute+pad kernel, who pads)
    (dict(fp8="e4m3"), True, PERMUTE),
    (dict(fp8="e4m3"), False, EXPERTS),  # F1 falls back: experts must pad
    (dict(fp8="e4m3", moe_token_dispatcher_type="allgather"), True, PERMUTE),
    (dict(fp8="e4m3", moe_permute_fusion=False), True, EXPERTS),
    (dict(fp8="e4m3", moe_router_padding_for_quantization=True), False, ROUTER),
    (dict(fp8="e4m3", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"), False, HYBRIDEP),
    (dict(fp8="e4m3", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"), True, EXPERTS),
    (dict(), True, NOBODY),  # bf16: nothing pads anywhere
]


@pytest.mark.parametrize("overrides, te_kernel, padded_by", TABLE)
def test_padding_plan_names_the_one_stage_that_pads(moe_config, monkeypatch, overrides, te_kernel, padded_by):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: te_kernel)
    config = moe_config(**overrides)
    plan = padding_plan(config)
    assert plan.padded_by == padded_by
    assert plan.experts_pad == (padded_by == EXPERTS)
    assert plan.dispatcher_pads == (padded_by == PERMUTE)
    assert skip_routed_expert_padding(config) == (padded_by in (ROUTER, HYBRIDEP, PERMUTE))


def test_plan_does_not_depend_on_what_is_applied(moe_config, monkeypatch, reverted):
    from megatron.moe_patches import apply

    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: True)
    before = padding_plan(moe_config(fp8="e4m3"))
    apply()
    assert padding_plan(moe_config(fp8="e4m3")) == before


def test_fp4_needs_alignment_too(moe_config):
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    config = moe_config()
    config.fp4 = "nvfp4"  # set late: megatron-core asks TE about FP4 at construction
    assert quantization_alignment(config) == get_align_size_for_quantization(config) is not None


# One rule of the fused permute+pad (F1) at a time: where it cannot run, the experts pad.
F1_BLOCKED = [
    (dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0), "pads to capacity instead"),
    (dict(moe_grouped_gemm=False), "it needs TE grouped experts"),
    (dict(transformer_impl="local"), "it needs TE grouped experts"),
    (dict(moe_use_legacy_grouped_gemm=True), "it needs TE grouped experts"),
    (dict(expert_tensor_parallel_size=2), "expert tensor parallelism > 1"),
    (dict(moe_permute_fusion=False), "it needs --moe-permute-fusion"),
    (dict(moe_token_dispatcher_type="flex"), "the flex dispatcher pads by its own means"),
]


@pytest.mark.parametrize("fields, reason", F1_BLOCKED, ids=[r for _, r in F1_BLOCKED])
def test_each_f1_rule_hands_the_padding_to_the_experts(moe_config, monkeypatch, fields, reason):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: True)
    config = moe_config(fp8="e4m3")
    assert moe_plan.fused_permute_pad_blocker(config) is None and padding_plan(config).padded_by == PERMUTE
    for name, value in fields.items():  # set late: the rule alone decides, not megatron-core's checks
        setattr(config, name, value)
    assert reason in (moe_plan.fused_permute_pad_blocker(config) or "")
    assert padding_plan(config).padded_by == EXPERTS and not skip_routed_expert_padding(config)
    assert reason in padding_plan(config).reason


def test_an_alignment_of_one_means_nobody_pads(moe_config, monkeypatch):
    """A backend that takes any row count (alignment 1) needs no padding anywhere,
    whatever the recipe's own GEMM alignment."""
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: True)
    monkeypatch.setattr(moe_plan.FALLBACK, "alignment", 1)  # the TE backend
    monkeypatch.setattr(plan_backends, "BACKENDS", ())
    config = moe_config(fp8="e4m3")
    assert quantization_alignment(config) is None
    assert padding_plan(config).padded_by == NOBODY and not skip_routed_expert_padding(config)
