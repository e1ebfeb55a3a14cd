"""F4 wiring on CPU: fallback decisions, and the pipeline a fake TE ops package receives
(which ops, in which order, sharing the experts' parameters by identity). Numerics: tests/gpu."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.plan import backend_blocker
from megatron.moe_patches.experts import op_fuser as f4

E = 3


@pytest.fixture
def te_ops_present(monkeypatch):
    monkeypatch.setattr(cap, "te_op_fuser_grouped_mlp", lambda: True)
    monkeypatch.setattr(cap, "te_ops_grouped_linear_has", lambda option: True)
    monkeypatch.setattr(cap, "te_attr", lambda path: object())


def test_blocker_accepts_plain_swiglu_and_quick_geglu(moe_config, te_ops_present):
    on = dict(gated_linear_unit=True, use_transformer_engine_op_fuser=True)
    assert backend_blocker(f4.OpFuserBackend, moe_config(**on, activation_func=F.silu)) is None
    assert backend_blocker(f4.OpFuserBackend, moe_config(**on, activation_func=quick_gelu)) is None
    assert backend_blocker(f4.OpFuserBackend, moe_config(**on, activation_func=F.silu, add_bias_linear=True)) is None
    assert "is off" in backend_blocker(f4.OpFuserBackend, moe_config(gated_linear_unit=True, activation_func=F.silu))


@pytest.mark.parametrize("change, words", [
    (dict(gated_linear_unit=False), "activation"),
    (dict(activation_func=F.gelu), "activation"),
    (dict(use_te_activation_func=True), "activation"),
    (dict(expert_tensor_parallel_size=2), "tensor parallelism"),
    (dict(moe_mlp_glu_interleave_size=16), "multiple of 32"),
    (dict(moe_apply_probs_on_input=True), "probs-on-input"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), "offloading"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "recompute"),
    (dict(fp4="nvfp4"), "FP4"),
    (dict(fp8="e4m3", fp8_param=True), "FP8 parameters"),
    (dict(moe_single_grouped_weight=True), "single grouped parameters"),
])
def test_blocker_names_each_unsupported_setting(moe_config, te_ops_present, change, words):
    config = moe_config(gated_linear_unit=True, activation_func=F.silu, use_transformer_engine_op_fuser=True)
    for name, value in change.items():  # set after validation: only the decision is tested
        setattr(config, name, value)
    reason = backend_blocker(f4.OpFuserBackend, config)
    assert reason is not None and words in reason, reason


def test_blocker_names_te_gaps(moe_config, monkeypatch, te_ops_present):
    config = moe_config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
                        use_transformer_engine_op_fuser=True)
    monkeypatch.setattr(cap, "te_ops_grouped_linear_has", lambda option: option != "scale_bias")
    assert "FC2 bias" in backend_blocker(f4.OpFuserBackend, config)
    monkeypatch.setattr(cap, "te_op_fuser_grouped_mlp", lambda: False)
    assert "no te.pytorch.ops" in backend_blocker(f4.OpFuserBackend, config)


# --- the pipeline, built against a fake te.pytorch.ops -------------------------------------

class FakeGroupedLinear(torch.nn.Module):
    def __init__(self, num_groups, in_features, out_features, **options):
        super().__init__()
        self.shape, self.options, self.log = (num_groups, in_features, out_features), options, None

    def backward_dw(self):
        self.log.append(("op.backward_dw", self.shape[2]))


class FakeScaledGLU(torch.nn.Module):
    def __init__(self, glu_interleave_size=None, **options):
        super().__init__()
        self.glu_interleave_size, self.options = glu_interleave_size, options


class FakeSequential:
    def __init__(self, *ops):
        self.ops, self.calls = ops, []

    def __call__(self, x, *extra_inputs):
        self.calls.append(extra_inputs)
        return x * 2


@pytest.fixture
def fake_te(monkeypatch):
    ops = types.SimpleNamespace(GroupedLinear=FakeGroupedLinear, ScaledSwiGLU=type("ScaledSwiGLU", (FakeScaledGLU,), {}),
                                ScaledClampedQGeGLU=type("ScaledClampedQGeGLU", (FakeScaledGLU,), {}),
                                Sequential=FakeSequential)
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.ops = ops
    package = types.ModuleType("transformer_engine")
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    return ops


class FakeLinear(torch.nn.Module):
    def __init__(self, out_features, in_features, bias, log, name):
        super().__init__()
        for i in range(E):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features)))
            self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(out_features)) if bias else None)
        self.fuse_wgrad_accumulation = True
        self.log, self.name = log, name

    def _trigger_wgrad_accumulation_and_reduce_hooks(self):
        self.log.append(("hooks", self.name))


def experts(config, log, interleave=None):
    """The op-fuser backend of an experts shell with fake TE linears (the real experts need TE)."""
    from megatron.moe_patches.experts.padding import NOBODY, PaddingPlan

    mlp = torch.nn.Module()
    bias = config.add_bias_linear
    mlp.config, mlp.num_local_experts = config, E
    mlp.linear_fc1 = FakeLinear(2 * 6, 4, bias, log, "fc1")
    mlp.linear_fc2 = FakeLinear(4, 6, bias, log, "fc2")
    mlp.padding_plan = PaddingPlan(None, NOBODY)
    config.moe_mlp_glu_interleave_size = interleave
    return mlp, f4.OpFuserBackend(mlp)


@pytest.mark.parametrize("bias", [False, True])
def test_pipeline_shares_parameters_and_passes_probs(moe_config, fake_te, bias):
    config = moe_config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=bias,
                        use_transformer_engine_op_fuser=True)
    mlp, backend = experts(config, [], interleave=2)
    pre_hook_calls = []
    mlp.linear_fc1.register_forward_pre_hook(lambda module, args: pre_hook_calls.append(module))
    x, counts, probs = torch.randn(5, 4), torch.tensor([2, 0, 3]), torch.rand(5)
    out, out_bias = backend.forward(mlp, x, counts, probs)
    fc1_op, act, fc2_op = backend._ops
    assert torch.equal(out, x * 2) and out_bias is None
    assert type(act).__name__ == "ScaledSwiGLU" and act.glu_interleave_size == 2
    assert fc1_op.shape == (E, 4, 12) and fc2_op.shape == (E, 6, 4)
    for op, linear in ((fc1_op, mlp.linear_fc1), (fc2_op, mlp.linear_fc2)):
        assert all(getattr(op, f"weight{i}") is getattr(linear, f"weight{i}") for i in range(E))
        assert all(getattr(op, f"bias{i}") is getattr(linear, f"bias{i}") for i in range(E))
        assert op.options["device"] == "meta" and op.options["accumulate_into_main_grad"] is True
    assert fc1_op.options.get("scale_bias", False) is False
    assert fc2_op.options.get("scale_bias", False) is bias  # FC2's bias is scaled by the probs
    # Extra inputs in op order: FC1 splits, GLU scales, FC2 splits (+ its bias scales).
    extra = backend._sequential.calls[0]
    assert extra[0] is counts and extra[1] is probs and extra[2] is counts
    assert len(extra) == (4 if bias else 3) and (not bias or extra[3] is probs)
    assert pre_hook_calls == [mlp.linear_fc1]
    # The pipeline is not a submodule: parameters and state dict are the experts' own.
    assert len(list(mlp.parameters())) == len(list(mlp.linear_fc1.parameters())) * 2
    backend.forward(mlp, x, counts, probs)
    assert backend._ops[0] is fc1_op  # built once


def test_quick_geglu_op_gets_clamp_and_offset(moe_config, fake_te):
    config = moe_config(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                        activation_func_clamp_value=7.0, use_transformer_engine_op_fuser=True)
    mlp, backend = experts(config, [])
    backend.forward(mlp, torch.randn(2, 4), torch.tensor([1, 1, 0]), torch.rand(2))
    act = backend._ops[1]
    assert type(act).__name__ == "ScaledClampedQGeGLU"
    assert act.options == dict(limit=7.0, alpha=1.702, glu_linear_offset=1.0)


@pytest.mark.parametrize("delay", [True, False])
def test_backward_dw_fc2_then_fc1_then_the_original_modules_hooks(moe_config, fake_te, delay):
    config = moe_config(gated_linear_unit=True, activation_func=F.silu, use_transformer_engine_op_fuser=True)
    config.delay_wgrad_compute = delay
    log = []
    mlp, backend = experts(config, log)
    backend.forward(mlp, torch.randn(2, 4), torch.tensor([1, 1, 0]), torch.rand(2))
    for op in backend._ops[::2]:
        op.log = log
    assert backend._ops[0].options["delay_wgrad_compute"] is delay
    backend.backward_dw(mlp)
    expected = [("op.backward_dw", 4), ("hooks", "fc2"), ("op.backward_dw", 12), ("hooks", "fc1")]
    assert log == (expected if delay else [])
