"""F10 on the GPU: the FP8 grouped-GEMM experts against stock TE FP8 tensorwise experts on
identical weights and inputs, the Triton quantization against the PyTorch one, the weight
cache per optimizer step, and no host sync at EP=1.

Tolerance, from FP8 rounding: E4M3's unit roundoff is u = 2**-4, E5M2's 2**-3. Both sides
quantize the fprop operands with the same per-expert scales, so their outputs differ by
accumulation order only; allowed: u of the output's largest magnitude. The gradients differ
by more: TE also quantizes wgrad's operands (here bf16), rounds gradients to E5M2 under
``hybrid`` (here E4M3: sm90's grouped GEMM takes no E5M2) and accumulates dgrad in split
precision; allowed: our rounding plus TE's gradient rounding, 2u = 2**-3 of each
gradient's largest magnitude (e4m3), u + 2**-3 (hybrid). And against the bf16 backend on
the same inputs, this backend's error must be no larger than TE FP8's (1.25x, plus a bf16 ulp).
"""

import json

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from gpu_checks import check_fp8_experts_against_stock, host_syncs_during, small_moe_kwargs
from megatron.moe_patches import apply, revert
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.testing.layer_harness import build_moe_layer, forward_backward

def kwargs_for(experts, topk, activation, dispatcher="alltoall", fp8_format="e4m3"):
    return small_moe_kwargs(experts, topk, activation, "fp8", moe_token_dispatcher_type=dispatcher, fp8=fp8_format)


CASES = [  # activation, experts, topk, tokens, dispatcher, fp8 format, expert biases, FP8 wgrad
    pytest.param("swiglu", 128, 8, 300, "alltoall", "e4m3", False, True, marks=pytest.mark.quick),  # idle experts
    ("swiglu", 64, 2, 1000, "alltoall", "hybrid", False, True),
    ("swiglu", 32, 8, 2048, "allgather", "e4m3", False, True),
    ("quick_geglu", 64, 1, 500, "alltoall", "e4m3", False, True),
    ("quick_geglu", 16, 2, 1000, "allgather", "hybrid", False, True),
    ("swiglu", 64, 8, 1000, "alltoall", "e4m3", True, True),  # FC1's bias added, FC2's scaled by the prob
    ("swiglu", 128, 8, 300, "alltoall", "e4m3", False, False),  # --no-fp8-wgrad: weight gradients in bf16
]


@pytest.mark.parametrize("activation, experts, topk, tokens, dispatcher, fp8_format, bias, fp8_wgrad", CASES)
def test_fp8_backend_matches_stock_te_fp8(single_gpu, activation, experts, topk, tokens, dispatcher, fp8_format, bias,
                                          fp8_wgrad):
    kwargs = {**kwargs_for(experts, topk, activation, dispatcher, fp8_format), "add_bias_linear": bias,
              "fp8_wgrad": fp8_wgrad}
    check_fp8_experts_against_stock(kwargs, tokens, [activation, experts, topk, tokens, dispatcher, fp8_format, bias,
                                                     fp8_wgrad])


@pytest.mark.parametrize("rows, cols, experts", [(1000, 256, 8), (4097, 1536, 128), (64, 4100, 3)])
def test_triton_quantization_equals_the_pytorch_one(rows, cols, experts):
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device="cuda") * torch.rand(rows, 1, device="cuda") * 100).to(torch.bfloat16)
    x[::5] = 0  # zero rows
    expert_R = torch.sort(torch.randint(0, experts, (rows,), device="cuda")).values.to(torch.int32)
    expert_R[expert_R == 1] = 2  # expert 1 gets no row
    offsets_E = torch.bincount(expert_R.long(), minlength=experts).cumsum(0).to(torch.int32)
    q, scale_inv_R, scale_inv_E, qt = fp8.quantize_per_expert(x, expert_R, experts, fp8.PaddedColumns(offsets_E, rows))
    q_cpu, scale_inv_R_cpu, scale_inv_E_cpu, qt_cpu = fp8.quantize_per_expert(
        x.cpu(), expert_R.cpu(), experts, fp8.PaddedColumns(offsets_E.cpu(), rows))
    assert torch.equal(scale_inv_E.cpu(), scale_inv_E_cpu) and torch.equal(scale_inv_R.cpu(), scale_inv_R_cpu)
    assert torch.equal(q.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    used = int(fp8.PaddedColumns(offsets_E.cpu(), rows).offsets_E[-1])  # columns past it: no group's
    assert torch.equal(qt.cpu().view(torch.uint8)[:, :used], qt_cpu.view(torch.uint8)[:, :used])


@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("counts", [[0, 37, 16, 0, 300, 1, 0, 83], [512] * 4])
def test_fp8_grouped_linear_gradients_equal_the_dequantized_math(counts, fp8_wgrad):
    """fprop, dgrad and wgrad against float64 GEMMs of the very operands they multiply (FP8
    ones dequantized; bf16 ones for wgrad without ``fp8_wgrad``): what remains is fp32
    accumulation and the one bf16 rounding of each result. Experts with no row must get an
    exactly zero weight gradient."""
    torch.manual_seed(len(counts))
    experts, in_features, out_features = len(counts), 256, 384
    counts_E = torch.tensor(counts, device="cuda")
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    rows = sum(counts)
    expert_R = torch.repeat_interleave(torch.arange(experts, device="cuda", dtype=torch.int32), counts_E)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    linear = torch.nn.Module()  # what the cache reads of an FC: its grouped weight, the step's mark
    linear.weight = torch.nn.Parameter((torch.randn(experts, out_features, in_features, device="cuda") / 16).to(torch.bfloat16))
    linear.grouped_names = frozenset({"weight"})  # one [E, out, in] parameter (F5)
    linear.is_first_microbatch = True
    w = linear.weight
    dy = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16)
    cache = fp8.FP8WeightCache().get(linear, w)
    columns = fp8.PaddedColumns(offsets_E, rows) if fp8_wgrad else None
    y = fp8._FP8GroupedLinear.apply(x, w, offsets_E, expert_R, cache.weights, columns, None, None, None)  # no main_grad target: w.grad
    y.backward(dy)

    def dequantized(t_RC):
        q, scale_inv_R, _, _ = fp8.quantize_per_expert(t_RC, expert_R, experts)
        return q.double() * scale_inv_R.double()[:, None]

    x_deq, dy_deq = dequantized(x.detach()), dequantized(dy)
    w_deq = cache.weights.w8_EOI.double() * cache.weights.scale_inv_E.double()[:, None, None]
    want_y, want_dx = torch.empty(rows, out_features).double().cuda(), torch.empty(rows, in_features).double().cuda()
    want_dw = torch.zeros_like(w_deq)
    for e, (end, count) in enumerate(zip(offsets_E.tolist(), counts)):
        sl = slice(end - count, end)
        want_y[sl], want_dx[sl] = x_deq[sl] @ w_deq[e].t(), dy_deq[sl] @ w_deq[e]
        want_dw[e] = (dy_deq[sl].t() @ x_deq[sl]) if fp8_wgrad else (dy[sl].double().t() @ x.detach()[sl].double())
    for name, got, want in (("y", y, want_y), ("dx", x.grad, want_dx), ("dw", w.grad, want_dw)):
        err = ((got.double() - want).abs() / (want.abs().max() + 1e-30)).max().item()
        print(json.dumps({"counts": counts, "fp8_wgrad": fp8_wgrad, name: err}))
        assert err <= 2.0**-7, (name, err)  # bf16 rounding (2**-9) plus fp32/fast accumulation
    for e, count in enumerate(counts):
        if count == 0:
            assert not w.grad[e].any(), f"expert {e} has no row but a weight gradient"


GLU_AMAX_CASES = [  # activation, experts, topk, tokens, expert biases, FP8 wgrad
    ("swiglu", 128, 8, 300, False, True),  # idle experts
    ("quick_geglu", 64, 2, 1000, True, True),
    ("swiglu", 64, 8, 1000, False, False),
]


@pytest.mark.parametrize("activation, experts, topk, tokens, bias, fp8_wgrad", GLU_AMAX_CASES)
def test_amaxes_the_glu_gathers_give_the_bits_of_separate_amax_passes(single_gpu, monkeypatch, activation, experts,
                                                                     topk, tokens, bias, fp8_wgrad):
    """Tensorwise: FC2's input and FC1's output gradient are scaled by the amaxes the weighted
    GLU gathers as it writes them. Same layer, same inputs, with the GLU's amaxes and with an
    amax pass over each tensor: every output and gradient bit equal, and two amax passes
    fewer per forward+backward."""
    kwargs = {**kwargs_for(experts, topk, activation), "add_bias_linear": bias, "fp8_wgrad": fp8_wgrad}
    passes = []
    amax_pass = fp8._expert_amax_triton
    monkeypatch.setattr(fp8, "_expert_amax_triton", lambda *args: passes.append(1) or amax_pass(*args))
    try:
        apply()
        torch.manual_seed(tokens)
        layer = build_moe_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True))
        assert layer.experts.backend.name == "fp8_grouped_mm"
        hidden = torch.randn(tokens, 1, 256, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn_like(hidden)
        results = {}
        for gathered in (True, False):
            if not gathered:
                monkeypatch.setattr(fp8.FP8GroupedMMBackend, "glu_amax", lambda self, groups: None)
            passes.clear()
            layer.zero_grad(set_to_none=True)
            out, dx = forward_backward(layer, hidden, grad)
            results[gathered] = dict(out=out, dx=dx, passes=len(passes),
                                     **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    finally:
        revert()
    with_glu, separate = results[True], results[False]
    assert (with_glu.pop("passes"), separate.pop("passes")) == (2, 4)  # FC1's input and FC2's output gradient remain
    assert with_glu.keys() == separate.keys() and len(with_glu) > 3
    differ = [name for name in with_glu if not torch.equal(with_glu[name], separate[name])]
    assert not differ, differ


@pytest.mark.parametrize("experts, out_features, in_features", [(8, 384, 256), (3, 100, 70)])
def test_weight_quantization_in_both_layouts_equals_the_pytorch_one(experts, out_features, in_features):
    torch.manual_seed(experts)
    w = (torch.randn(experts, out_features, in_features, device="cuda") / 16).to(torch.bfloat16)
    w[1] = 0  # an all-zero expert keeps scale 1
    w8, w8_t, scale_inv = fp8.quantize_weights(w)
    w8_cpu, w8_t_cpu, scale_inv_cpu = fp8.quantize_weights(w.cpu())
    assert torch.equal(scale_inv.cpu(), scale_inv_cpu) and scale_inv_cpu[1] == 1
    assert torch.equal(w8.cpu().view(torch.uint8), w8_cpu.view(torch.uint8))
    assert torch.equal(w8_t.cpu().view(torch.uint8), w8_t_cpu.view(torch.uint8))


@pytest.mark.quick
def test_weights_quantized_once_per_step_and_no_host_sync(single_gpu, host_copies, quantizations):
    try:
        apply()
        layer = build_moe_layer(tc_module.TransformerConfig(**kwargs_for(64, 8, "swiglu"), moe_device_tokens_per_expert=True))
        hidden = torch.randn(1024, 1, 256, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # compile the kernels, warm the allocator
            forward_backward(layer, hidden)
        caches = list(layer.experts.backend._caches.values())
        assert [quantizations[c] for c in caches] == [1, 1]  # two micro-batches, one quantization
        torch.optim.SGD(layer.parameters(), lr=1e-3).step()
        host_copies.clear()
        syncs = host_syncs_during(lambda: forward_backward(layer, hidden))
    finally:
        revert()
    assert [quantizations[c] for c in caches] == [2, 2]  # the step made the cache stale
    assert host_copies == []
    assert not syncs, "\n".join(syncs)
