"""weighted_glu's Triton kernels against a float64 reference of the same math (and, reported,
megatron-core's compiled functions): output, input gradient and prob gradient."""

import json

import pytest
import torch

from megatron.moe_patches.kernels.expert_amax import expert_amax_reference
from megatron.moe_patches.kernels.fp8_blockwise_quantize import quantize_rows, take_quantized_rows
from megatron.moe_patches.kernels.weighted_glu import ExpertAmax, GLUSpec, megatron_weighted_glu, weighted_glu

SWIGLU = GLUSpec("swiglu", 1.0, 0.0, None)
QUICK_GEGLU = GLUSpec("quick_geglu", 1.702, 1.0, 7.0)  # gpt-oss-like: offset 1, clamp 7


def reference(h_TF2, probs_T, da_TF, spec):
    """float64 autograd of act(x1) * (x2 + offset) * prob, the clamp applied first."""
    h = h_TF2.double().requires_grad_()
    p = probs_T.double().requires_grad_()
    x1, x2 = h.chunk(2, dim=-1)
    if spec.clamp is not None:
        x1, x2 = x1.clamp(max=spec.clamp), x2.clamp(-spec.clamp, spec.clamp)
    unweighted = x1 * torch.sigmoid(spec.alpha * x1) * (x2 + spec.linear_offset)
    a = unweighted * p[:, None]
    a.backward(da_TF.double())
    terms = unweighted.detach() * da_TF.double()  # what each row's prob gradient sums
    return a.detach(), h.grad, p.grad, terms.abs().sum(-1)


def within(got, want, rel, floor):
    """Every element within rel * |want| + floor; the worst ratio to that bound."""
    err = (got.double() - want).abs()
    return (err / (rel * want.abs() + floor)).max().item() if err.numel() else 0.0


@pytest.mark.parametrize("spec", [SWIGLU, QUICK_GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("rows, features", [(1000, 768), (37, 1408), (300, 64), (0, 768)])
def test_kernels_match_a_float64_reference(spec, rows, features):
    torch.manual_seed(rows + features)
    h = (torch.randn(rows, 2 * features, device="cuda") * 4).bfloat16()  # beyond the clamp at times
    probs = torch.rand(rows, device="cuda")
    probs[::7] = 0.0  # padded rows carry prob 0
    da = torch.randn(rows, features, device="cuda").bfloat16()

    h_in, p_in = h.clone().requires_grad_(), probs.clone().requires_grad_()
    a = weighted_glu(h_in, p_in, spec, triton=True)
    a.backward(da)
    ref_a, ref_dh, ref_dp, dp_terms = reference(h, probs, da, spec)

    # Each output is computed in fp32 and rounded once to bf16 (half an ulp: 2**-9 relative);
    # the floor covers fp32 rounding where a product's factors nearly cancel.
    scale_a, scale_dh = (t.abs().max().item() if t.numel() else 1.0 for t in (ref_a, ref_dh))
    worst = {
        "output": within(a, ref_a, 2.0**-8, 2.0**-16 * scale_a),
        "input_grad": within(h_in.grad, ref_dh, 2.0**-8, 2.0**-16 * scale_dh),
        # fp32 sums of `features` fp32 products: each term off by at most 2**-23 relative
        "prob_grad": within(p_in.grad, ref_dp, 0.0, features * 2.0**-22 * dp_terms + 1e-30),
    }
    assert a.dtype == h.dtype and h_in.grad.dtype == h.dtype and p_in.grad.dtype == probs.dtype

    # megatron-core's functions (reported; they round intermediate results differently)
    versus = {}
    if rows:
        h_m, p_m = h.clone().requires_grad_(), probs.clone().requires_grad_()
        a_m = megatron_weighted_glu(h_m, p_m, spec)
        a_m.backward(da)
        versus = {"output": (a - a_m).abs().max().item(), "input_grad": (h_in.grad - h_m.grad).abs().max().item(),
                  "prob_grad": (p_in.grad - p_m.grad.view(-1)).abs().max().item()}
    print(json.dumps({"spec": spec.name, "rows": rows, "features": features, "worst_vs_bound": worst,
                      "max_abs_vs_megatron": versus}))
    assert all(v <= 1.0 for v in worst.values()), worst

    # The same inputs give the same bits (no atomics: graph replay and deterministic mode rely on it)
    h_again, p_again = h.clone().requires_grad_(), probs.clone().requires_grad_()
    a_again = weighted_glu(h_again, p_again, spec, triton=True)
    a_again.backward(da)
    assert torch.equal(a_again, a) and torch.equal(h_again.grad, h_in.grad) and torch.equal(p_again.grad, p_in.grad)


@pytest.mark.parametrize("spec", [SWIGLU, QUICK_GEGLU], ids=lambda s: s.name)
def test_rows_past_rows_used_come_out_zero(spec):
    """F12's received tensors end in rows outside every expert, holding whatever memory held:
    from ``rows_used`` on, output and gradients are zero even where the input is inf/nan."""
    torch.manual_seed(3)
    rows, used, features = 300, 211, 768
    h = (torch.randn(rows, 2 * features, device="cuda") * 4).bfloat16()
    h[used::3] = float("nan")
    h[used + 1::3] = float("inf")
    probs = torch.rand(rows, device="cuda").requires_grad_()
    h.requires_grad_()
    rows_used = torch.tensor([used], dtype=torch.int32, device="cuda")
    a = weighted_glu(h, probs, spec, rows_used=rows_used, triton=True)
    da = torch.randn_like(a)
    da[used::2] = float("nan")
    a.backward(da)
    assert not a[used:].any() and not h.grad[used:].any() and not probs.grad[used:].any()
    # The rows before it are the kernel's usual result.
    want = weighted_glu(h.detach()[:used], probs.detach()[:used], spec, triton=True)
    assert torch.equal(a[:used], want)


@pytest.mark.parametrize("spec", [SWIGLU, QUICK_GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("rows, features, experts", [(3000, 768, 128), (700, 1408, 3), (37, 64, 8)])
def test_kernels_gather_each_experts_amax_of_what_they_write(spec, rows, features, experts):
    """With an ExpertAmax: the forward's per-expert amax of its output and the backward's of
    the input gradient, equal to a separate pass over the written tensors; the values
    themselves unchanged. Rows past rows_used (zero) and experts without rows included."""
    torch.manual_seed(rows)
    h = (torch.randn(rows, 2 * features, device="cuda") * 4).bfloat16()
    h[: rows // 3] *= 64  # experts of very different ranges
    probs = torch.rand(rows, device="cuda")
    expert_T = torch.sort(torch.randint(0, experts, (rows,), device="cuda")).values.to(torch.int32)
    expert_T[expert_T == 1] = 2  # expert 1 gets no row
    rows_used = torch.tensor([rows - rows // 10], dtype=torch.int32, device="cuda")
    da = torch.randn(rows, features, device="cuda").bfloat16()

    results = []
    for amax in (ExpertAmax.zeros(expert_T, experts), None):
        h_in, p_in = h.clone().requires_grad_(), probs.clone().requires_grad_()
        a = weighted_glu(h_in, p_in, spec, rows_used=rows_used, amax=amax, triton=True)
        a.backward(da)
        results.append((a, h_in.grad, p_in.grad, amax))
    (a, dh, dp, amax), (a_plain, dh_plain, dp_plain, _) = results
    assert torch.equal(a, a_plain) and torch.equal(dh, dh_plain) and torch.equal(dp, dp_plain)
    assert torch.equal(amax.output_E, expert_amax_reference(a, expert_T, experts))
    assert torch.equal(amax.input_grad_E, expert_amax_reference(dh, expert_T, experts))
    assert amax.output_E[1] == 0 and amax.input_grad_E[1] == 0 and amax.output_E[0] > 0


@pytest.mark.parametrize("spec", [SWIGLU, QUICK_GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("rows, features", [(3000, 768), (700, 1408), (37, 384), (64, 128)])
def test_kernels_write_the_fp8_rows_of_what_they_write(spec, rows, features):
    """With quantized_rows: the activation and the input gradient unchanged, and the FP8
    copies attached to them equal quantize_rows of them bit for bit (rows past rows_used:
    zeros, scale 1; a row of a huge range and an all-zero block included)."""
    torch.manual_seed(rows + features)
    h = (torch.randn(rows, 2 * features, device="cuda") * 4).bfloat16()
    h[: rows // 3] *= 64
    h[1, :128] = 0.0
    probs = torch.rand(rows, device="cuda")
    rows_used = torch.tensor([rows - rows // 10], dtype=torch.int32, device="cuda")
    da = torch.randn(rows, features, device="cuda").bfloat16()
    results = []
    for quantized in (True, False):
        h_in, p_in = h.clone().requires_grad_(), probs.clone().requires_grad_()
        a = weighted_glu(h_in, p_in, spec, rows_used=rows_used, quantized_rows=quantized, triton=True)
        a_rows = take_quantized_rows(a)
        seen = {}
        h_in.register_hook(lambda g: seen.update(dh_rows=take_quantized_rows(g)))  # returns None: g unchanged
        a.backward(da)
        results.append((a, h_in.grad, p_in.grad, a_rows, seen["dh_rows"]))
    (a, dh, dp, a_rows, dh_rows), (a_plain, dh_plain, dp_plain, none_a, none_dh) = results
    assert torch.equal(a, a_plain) and torch.equal(dh, dh_plain)
    # each row's prob gradient: an fp32 sum over the features, which the other compiled kernel
    # may add in another order (a few float32 ulps of the row's largest term)
    torch.testing.assert_close(dp, dp_plain, rtol=2.0**-17, atol=2.0**-17 * dp_plain.abs().max().item())
    assert none_a is None and none_dh is None and a_rows is not None and dh_rows is not None
    for values, (q, scale_inv) in ((a, a_rows), (dh, dh_rows)):
        want_q, want_scale_inv = quantize_rows(values)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale_inv, want_scale_inv)
