"""The walkthrough's toy backend (patches/README.md, "Adding an expert backend"): registered,
the plan picks it where its declarations allow and says why not elsewhere; its forward matches
a float64 row-by-row reference of the experts' math."""

import pytest
import torch

from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.plan import backends as plan_backends
from megatron.moe_patches.config import PatchedTransformerConfig
from expert_shells import experts_shell
from toy_backend import LoopBackend

E, HIDDEN, FFN = 3, 8, 6
BASE = dict(
    num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=FFN,
    moe_grouped_gemm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(plan_backends, "BACKENDS", plan_backends.BACKENDS)  # restored after the test
    return moe_plan.register_backend(LoopBackend)


def config(**overrides):
    return PatchedTransformerConfig(**{**BASE, **overrides})


def test_registering_the_toy_makes_the_plan_pick_it(registered):
    c = config()
    assert moe_plan.plan_for(c).backend is LoopBackend
    assert dict(moe_plan.plan_for(c).backend_refusals) == {
        "op_fuser": "use_transformer_engine_op_fuser is off",
        "fp8_grouped_mm": "moe_device_tokens_per_expert is off",
        "grouped_mm": "moe_device_tokens_per_expert is off",
    }
    # where it is asked for, the sync-free grouped_mm backend comes first
    assert moe_plan.plan_for(config(moe_device_tokens_per_expert=True)).backend.name == "grouped_mm"


def test_a_plan_made_before_the_registration_is_made_again(monkeypatch):
    c = config()
    assert moe_plan.plan_for(c).backend is moe_plan.FALLBACK
    monkeypatch.setattr(plan_backends, "BACKENDS", plan_backends.BACKENDS)
    moe_plan.register_backend(LoopBackend)
    assert moe_plan.plan_for(c).backend is LoopBackend


@pytest.mark.parametrize("late, reason", [
    (dict(add_bias_linear=True), "expert biases"),
    (dict(activation_func=torch.nn.functional.gelu), "it supports SwiGLU activations only"),
    (dict(params_dtype=torch.float32), "it needs bf16 parameters"),
    (dict(fp8="e4m3"), "it computes bf16 only"),
    (dict(expert_tensor_parallel_size=2), "expert tensor parallelism > 1"),
])
def test_the_plan_says_why_not_the_toy(registered, late, reason):
    c = config()
    for name, value in late.items():  # set late: the plan alone decides
        setattr(c, name, value)
    plan = moe_plan.plan_for(c)
    assert plan.backend is moe_plan.FALLBACK and reason in dict(plan.backend_support)["loop"]


def _experts(c):
    # FC1 and FC2 from the classes the toy's expert_submodules returns (TE's weight{i} on CPU)
    return experts_shell(LoopBackend, c, E, (2 * FFN, HIDDEN), (HIDDEN, FFN))


def _reference(experts, x_TH, counts, probs_T):
    """Row by row in float64: y = W2_e (silu(gate) * up * prob), [gate; up] = W1_e x."""
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    rows = []
    for r, e in enumerate(expert_of_row):
        w1 = getattr(experts.linear_fc1, f"weight{e}").double()
        w2 = getattr(experts.linear_fc2, f"weight{e}").double()
        h = w1 @ x_TH[r].double()
        gate, up = h[:FFN], h[FFN:]
        rows.append(w2 @ (gate * torch.sigmoid(gate) * up * probs_T[r].double()))
    return torch.stack(rows)


def test_the_toy_computes_the_experts(registered):
    c = config()
    experts = _experts(c)
    backend = moe_plan.plan_for(c).backend(experts)  # as PatchedTEGroupedMLP builds it
    counts = [2, 0, 3]  # expert 1 gets no token
    generator = torch.Generator().manual_seed(1)
    x_TH = torch.randn(sum(counts), HIDDEN, generator=generator).to(torch.bfloat16)
    probs_T = torch.rand(sum(counts), generator=generator)
    out_TH, bias = backend.forward(experts, x_TH, torch.tensor(counts), probs_T)
    assert bias is None and out_TH.dtype == torch.bfloat16 and out_TH.shape == (sum(counts), HIDDEN)
    torch.testing.assert_close(out_TH.double(), _reference(experts, x_TH, counts, probs_T), rtol=0.05, atol=0.02)
    out_TH.float().sum().backward()  # autograd reaches the experts' parameters
    assert experts.linear_fc1.weight2.grad.abs().sum() > 0 and not experts.linear_fc2.weight1.grad.any()  # expert 1: no rows


def test_a_backend_asked_for_by_its_flag_owns_the_experts(registered):
    c = config(use_transformer_engine_op_fuser=True)  # no TE ops here: the op fuser cannot run
    plan = moe_plan.plan_for(c)
    assert plan.backend is moe_plan.FALLBACK
    assert dict(plan.backend_support)["loop"] == (
        "the op_fuser backend owns the experts' compute (--use-transformer-engine-op-fuser)")
