"""F1 + F3 on the GPU: TE's fused permute+pad against the pure PyTorch reference, and a
megatron-core MoE layer with the fused path against the stock explicit-padding path."""

import json

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from gpu_checks import compare, run_layer, run_two_gpu_worker
from megatron.moe_patches import apply, revert
from megatron.moe_patches.dispatch.permute_pad import (
    StaticPaddedPermute, permute_and_pad, static_padded_rows, unpermute_and_unpad)
from megatron.moe_patches.kernels import fp8_blockwise_quantize as bq
from megatron.moe_patches.kernels.fp8_blockwise_quantize import take_quantized_rows
from megatron.moe_patches.testing.reference import reference_permute_and_pad, reference_unpermute_and_unpad
from megatron.moe_patches.testing.layer_harness import MoEShape, moe_config_kwargs


def random_routing(num_tokens, num_experts, topk, seed, empty_experts=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=generator)
    scores[:, :empty_experts] = -1.0  # these experts get no token
    top = scores.topk(topk, dim=1).indices
    routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device="cuda").scatter_(1, top, True)
    probs = torch.where(routing, scores.softmax(dim=1), torch.zeros_like(scores))
    return routing, probs


KERNEL_CASES = [  # tokens, experts, topk, empty experts, align
    (300, 8, 1, 0, 16),
    (300, 8, 2, 2, 16),
    pytest.param(1000, 64, 8, 5, 16, marks=pytest.mark.quick),
    (257, 128, 8, 17, 32),
    (128, 8, 1, 0, 16),  # routing below puts exactly 16 tokens on each expert: no padding
]


@pytest.mark.parametrize("tokens, experts, topk, empty, align", KERNEL_CASES)
def test_te_permute_pad_matches_reference(tokens, experts, topk, empty, align):
    if (tokens, experts, topk) == (128, 8, 1):
        routing = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
        routing[torch.arange(tokens), torch.arange(tokens) % experts] = True
        probs = routing.float() * 0.5
    else:
        routing, probs = random_routing(tokens, experts, topk, seed=tokens + experts, empty_experts=empty)
    hidden = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    out, out_probs, row_id_map, pad_offsets, padded = permute_and_pad(hidden, probs, routing, align)
    ref, ref_probs, dest, ref_offsets, ref_padded = reference_permute_and_pad(hidden, probs, routing, align)
    assert torch.equal(padded.cpu(), ref_padded.cpu())
    assert all(c % align == 0 for c in padded.tolist()) and int(padded.sum()) == out.shape[0]
    assert torch.equal(out, ref) and torch.equal(out_probs, ref_probs)
    if pad_offsets is None:  # TE's "nothing to pad"
        assert int(ref_offsets.sum()) == 0
    else:
        assert torch.equal(pad_offsets.cpu(), ref_offsets.cpu())
    expert_out = torch.randn_like(out)
    restored = unpermute_and_unpad(expert_out, row_id_map, pad_offsets, hidden.shape)
    expected = reference_unpermute_and_unpad(expert_out.float(), dest).to(restored.dtype)
    torch.testing.assert_close(restored, expected, rtol=1.6e-2, atol=1e-2)  # bf16 sum order


@pytest.mark.parametrize("tokens, experts, topk, empty", [(1000, 64, 8, 5), (300, 8, 2, 2), (512, 4, 1, 0)])
def test_static_padded_permute_matches_reference_and_replays_in_a_graph(tokens, experts, topk, empty):
    """128-row groups in a static row count: the reference's rows, probs, pad offsets and
    padded counts, zero rows after them; the unpermute and both gradients as the
    reference's; and a CUDA graph of it, captured on one routing and replayed on another,
    gives the eager results."""
    align = 128
    step = StaticPaddedPermute(align, topk)
    rows = static_padded_rows(tokens, topk, experts, align)
    routing, probs = random_routing(tokens, experts, topk, seed=tokens, empty_experts=empty)
    hidden = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    x = hidden.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    permuted = step.permute(x, p, routing)
    ref, ref_probs, dest, ref_offsets, ref_padded = reference_permute_and_pad(hidden, probs, routing, align)
    n = ref.shape[0]
    assert permuted.x_RH.shape[0] == rows and int(permuted.tokens_per_expert.sum()) == n <= rows
    assert torch.equal(permuted.tokens_per_expert.cpu(), ref_padded.cpu().to(permuted.tokens_per_expert.dtype))
    assert torch.equal(permuted.pad_offsets.cpu(), ref_offsets.cpu())
    assert torch.equal(permuted.x_RH[:n], ref) and not permuted.x_RH[n:].any()
    assert torch.equal(permuted.probs_R[:n], ref_probs) and not permuted.probs_R[n:].any()
    expert_out = torch.randn_like(permuted.x_RH)
    restored = step.unpermute(expert_out, permuted.row_id_map, permuted.pad_offsets, hidden.shape, routing)
    expected = reference_unpermute_and_unpad(expert_out[:n].float(), dest).to(restored.dtype)
    torch.testing.assert_close(restored, expected, rtol=1.6e-2, atol=1e-2)  # bf16 sum order
    (permuted.x_RH.float() * expert_out.float()).sum().add((permuted.probs_R * 3).sum()).backward()
    want_dx = reference_unpermute_and_unpad(expert_out[:n].float(), dest)
    torch.testing.assert_close(x.grad.float(), want_dx, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(p.grad, torch.where(routing, 3.0, 0.0).to(p.grad.dtype))
    assert torch.equal(step.align_splits(None, routing, routing.sum(0)), permuted.tokens_per_expert)

    check_graph_replays_on_another_routing(step, hidden, routing, probs, seed=tokens + 1, empty=empty)


def check_graph_replays_on_another_routing(step, hidden, routing, probs, seed, empty):
    """The step's permute captured as a CUDA graph on this routing and replayed on another
    equals the eager permute of the other, the attached FP8 rows (if any) included."""
    s_x, s_map, s_probs = hidden.clone(), routing.clone(), probs.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        take_quantized_rows(step.permute(s_x, s_probs, s_map).x_RH)  # Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step.permute(s_x, s_probs, s_map)
        captured_rows = take_quantized_rows(captured.x_RH)
    routing2, probs2 = random_routing(*routing.shape, int(routing[0].sum()), seed=seed, empty_experts=empty)
    hidden2 = torch.randn_like(hidden)
    s_x.copy_(hidden2), s_map.copy_(routing2), s_probs.copy_(probs2)
    graph.replay()
    eager = step.permute(hidden2, probs2, routing2)
    eager_rows = take_quantized_rows(eager.x_RH)
    for name in ("x_RH", "probs_R", "pad_offsets", "tokens_per_expert"):
        assert torch.equal(getattr(captured, name), getattr(eager, name)), name
    assert (captured_rows is None) == (eager_rows is None)
    if eager_rows is not None:
        assert torch.equal(captured_rows[0].view(torch.uint8), eager_rows[0].view(torch.uint8))
        assert torch.equal(captured_rows[1], eager_rows[1])


def _run_step(step, hidden, probs, routing, expert_out, dout):
    """Forward through the step's permute and unpermute, backward: the permuted rows, the
    unpermuted output, every gradient, and the FP8 copies attached to the permuted rows and
    to the unpermute's row gradient (None where none)."""
    x = hidden.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    permuted = step.permute(x, p, routing)
    attached = take_quantized_rows(permuted.x_RH)
    y = expert_out.clone().requires_grad_()
    seen = {}
    y.register_hook(lambda g: seen.update(dy=(g.clone(), take_quantized_rows(g))))  # returns None: g unchanged
    out = step.unpermute(y, permuted.row_id_map, permuted.pad_offsets, hidden.shape, routing)
    loss = (out.float() * dout.float()).sum() + (permuted.x_RH.float() * expert_out.float()).sum()
    loss.add((permuted.probs_R * 3).sum()).backward()
    return permuted, attached, out, x.grad, p.grad, seen["dy"]


@pytest.mark.parametrize("tokens, experts, topk, empty, hidden_size", [
    pytest.param(1000, 64, 8, 5, 256, marks=pytest.mark.quick), (300, 8, 2, 2, 384), (512, 4, 1, 0, 2048)])
def test_quantizing_static_permute_writes_te_rows_and_their_fp8_copy_in_one_pass(tokens, experts, topk, empty,
                                                                                  hidden_size):
    """With ``quantized_rows`` the static permute's rows, probs, unpermute and gradients equal
    TE's (the same step without it) bit for bit; the FP8 copies attached to the permuted rows
    and to the unpermute's row gradient equal ``quantize_rows`` of them bit for bit (padding
    and tail rows: zeros, scale 1), a token with a zero prob included; a CUDA graph replays
    it on another routing as eager computes it."""
    align = 128
    routing, probs = random_routing(tokens, experts, topk, seed=tokens, empty_experts=empty)
    probs[0, routing[0].nonzero()[0, 0]] = 0.0  # TE writes this copy as a zero row
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16) * 3
    hidden[1, :128] = 0.0  # an all-zero block: scale 1
    rows = static_padded_rows(tokens, topk, experts, align)
    expert_out = torch.randn(rows, hidden_size, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(hidden)
    fused = _run_step(StaticPaddedPermute(align, topk, quantized_rows=True), hidden, probs, routing, expert_out, dout)
    plain = _run_step(StaticPaddedPermute(align, topk), hidden, probs, routing, expert_out, dout)
    (permuted, attached, out, dx, dp, (dy_rows, dy_attached)) = fused
    (want, none_attached, want_out, want_dx, want_dp, (want_dy_rows, _)) = plain
    assert none_attached is None and attached is not None and dy_attached is not None
    for name in ("x_RH", "probs_R", "pad_offsets", "tokens_per_expert"):
        assert torch.equal(getattr(permuted, name), getattr(want, name)), name
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx) and torch.equal(dp, want_dp)
    assert torch.equal(dy_rows, want_dy_rows)
    for rows_bf16, (x8, scale_inv) in ((permuted.x_RH, attached), (dy_rows, dy_attached)):
        want_x8, want_scale_inv = bq.quantize_rows(rows_bf16)
        assert torch.equal(x8.view(torch.uint8), want_x8.view(torch.uint8))
        assert torch.equal(scale_inv, want_scale_inv)

    step = StaticPaddedPermute(align, topk, quantized_rows=True)
    check_graph_replays_on_another_routing(step, hidden, routing, probs, seed=tokens + 1, empty=empty)


# With EP > 1 the zero rows sit between source-rank chunks inside an expert's group
# instead of at its end, so the weight-grad GEMMs split their token (K) reduction
# differently: same math, other fp32 summation order, then a bf16 rounding. Allowed:
# 2**-7 of the tensor's largest magnitude, one bf16 ulp in the top binade.
WGRAD_REORDER_TOLERANCE = 2.0**-7


def aligned_routing(num_experts, topk):
    """A router stand-in: token t goes to experts t, t+1, ... (mod E) with fixed probs."""

    def route(hidden_states, *args, **kwargs):
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        rows = torch.arange(tokens, device="cuda").unsqueeze(1)
        cols = (rows + torch.arange(topk, device="cuda")) % num_experts
        routing = torch.zeros(tokens, num_experts, dtype=torch.bool, device="cuda").scatter_(1, cols, True)
        return routing.float() / topk, routing

    return route


LAYER_CASES = [  # precision, dispatcher, experts, topk, tokens, routing
    ("fp8-tensorwise", "alltoall", 8, 2, 1000, None),
    ("fp8-tensorwise", "alltoall", 64, 8, 1000, None),
    ("fp8-tensorwise", "alltoall", 128, 8, 512, None),
    pytest.param("fp8-tensorwise", "alltoall", 128, 1, 200, None, marks=pytest.mark.quick),  # most experts get no token
    ("fp8-tensorwise", "allgather", 64, 2, 1000, None),
    ("fp8-delayed", "alltoall", 64, 8, 1000, None),
    ("fp8-delayed", "allgather", 8, 1, 700, None),
    ("fp8-tensorwise", "alltoall", 8, 1, 128, "aligned"),  # 16 tokens per expert: nothing to pad
    ("bf16", "alltoall", 64, 8, 1000, None),  # F1 inactive in bf16: the stock path
]


@pytest.mark.parametrize("precision, dispatcher, experts, topk, tokens, routing", LAYER_CASES)
def test_moe_layer_fused_matches_stock(single_gpu, precision, dispatcher, experts, topk, tokens, routing):
    shape = MoEShape(hidden=256, moe_ffn=192, experts=experts, topk=topk)
    precision_kwargs = {}
    if precision.startswith("fp8"):
        precision_kwargs = dict(fp8="e4m3", fp8_recipe=precision.split("-")[1])
    kwargs = moe_config_kwargs(shape, "bf16", moe_token_dispatcher_type=dispatcher, **precision_kwargs)
    routing_fn = aligned_routing(experts, topk) if routing == "aligned" else None
    revert()
    _, stock = run_layer(tc_module.TransformerConfig(**kwargs), tokens, routing_fn=routing_fn)
    try:
        apply()
        layer, patched = run_layer(tc_module.TransformerConfig(**kwargs), tokens, routing_fn=routing_fn)
    finally:
        revert()
    dispatcher_obj = layer.token_dispatcher
    fused = precision != "bf16"
    assert dispatcher_obj.permute_step.pads == fused, "fused permute+pad path not taken"
    assert layer.experts.padding_plan.dispatcher_pads == fused and not layer.experts.padding_plan.experts_pad
    if fused and routing == "aligned":
        assert dispatcher_obj.pad_offsets is None  # TE found nothing to pad
    report = compare(stock, patched)
    print(json.dumps({"case": [precision, dispatcher, experts, topk, tokens, routing], **report}))
    assert stock["output"].abs().sum() > 0
    assert report["bitwise"], json.dumps(report)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP=2 needs 2 GPUs")
def test_ep2_alltoall_fused_matches_stock(tmp_path):
    for rank_result in run_two_gpu_worker("ep_fused_permute_pad_worker.py", tmp_path):
        assert rank_result["fused"], rank_result
        assert rank_result["activations"]["bitwise"], json.dumps(rank_result)
        assert rank_result["expert_wgrads"]["max_rel"] <= WGRAD_REORDER_TOLERANCE, json.dumps(rank_result)
