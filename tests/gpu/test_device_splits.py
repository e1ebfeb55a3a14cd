"""F8 + the grouped_mm expert backend on the GPU: numerics against stock TE grouped experts,
zero host syncs at EP=1, and state dicts that load both ways."""

import json

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from gpu_checks import host_syncs_during, max_rel_error, run_layer as run, run_two_gpu_worker, small_moe_kwargs
from megatron.moe_patches import apply, revert
from megatron.moe_patches.experts import grouped_mm as f8
from megatron.moe_patches.testing.layer_harness import build_moe_layer, forward_backward
from megatron.moe_patches.kernels.weighted_glu import glu_spec

# The GEMMs differ (TE/cuBLAS per expert vs one CUTLASS grouped GEMM: fp32 accumulation in
# another order) and so does the prob-weighted GLU (megatron-core's compiled kernels vs
# weighted_glu's, both fp32 inside, bf16 outputs).
# Allowed: 2**-6 of each tensor's largest magnitude (two bf16 ulps in the top binade).
TOLERANCE = 2.0**-6


def bf16_mlp(x, counts, probs, w1, w2, config, b1=None, b2=None):
    """The grouped_mm backend's bf16 MLP over rows grouped by ``counts``."""
    groups = f8.RowGroups(counts, x.shape[0], x.device)
    gemm = f8.bf16_grouped_gemm(groups)
    fc1, fc2 = (lambda x_TI: (gemm(None, x_TI, w1), b1)), (lambda x_TI: (gemm(None, x_TI, w2), b2))
    return f8.grouped_mm_mlp(x, groups, probs, fc1, fc2, glu_spec(config), glu_triton=True)


CASES = [  # activation, experts, topk, tokens
    ("swiglu", 8, 1, 600),
    ("swiglu", 8, 2, 1000),
    ("swiglu", 64, 8, 1000),
    pytest.param("swiglu", 128, 8, 300, marks=pytest.mark.quick),  # many experts get no token
    ("quick_geglu", 64, 2, 1000),
    ("quick_geglu", 128, 1, 200),
]


@pytest.mark.parametrize("activation, experts, topk, tokens", CASES + [
    pytest.param("swiglu", 64, 8, 1000, id="bias-swiglu-64-8-1000"),
    pytest.param("quick_geglu", 128, 1, 200, id="bias-quick_geglu-128-1-200"),
])
def test_grouped_mm_backend_matches_stock(single_gpu, request, activation, experts, topk, tokens):
    kwargs = small_moe_kwargs(experts, topk, activation)
    if "bias" in request.node.callspec.id:  # expert biases: FC1's added, FC2's scaled by the prob
        kwargs["add_bias_linear"] = True
    revert()
    _, stock = run(tc_module.TransformerConfig(**kwargs), tokens)
    try:
        apply()
        layer, patched = run(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True), tokens)
    finally:
        revert()
    assert layer.experts.backend.name == "grouped_mm", "sync-free backend not selected"
    errors = max_rel_error(stock, patched)
    worst = max(errors, key=errors.get)
    print(json.dumps({"case": [activation, experts, topk, tokens], "tensors": len(errors),
                      "bitwise": all(torch.equal(stock[n], patched[n]) for n in stock),
                      "max_rel": errors[worst], "worst": worst}))
    assert stock["output"].abs().sum() > 0
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])


@pytest.mark.quick
def test_zero_host_syncs_at_ep1(single_gpu, host_copies):
    kwargs = small_moe_kwargs(64, 8, "swiglu")
    try:
        apply()
        layer = build_moe_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True))
        hidden = torch.randn(1024, 1, 256, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # compile the fused activation, warm the allocator
            forward_backward(layer, hidden)
        host_copies.clear()
        syncs = host_syncs_during(lambda: forward_backward(layer, hidden))
    finally:
        revert()
    assert layer.experts.backend.name == "grouped_mm"
    assert host_copies == []
    assert not syncs, "\n".join(syncs)


def test_state_dicts_load_both_ways(single_gpu):
    kwargs = small_moe_kwargs(16, 2, "swiglu")
    revert()
    stock_layer = build_moe_layer(tc_module.TransformerConfig(**kwargs), seed=1)
    stock_state = {k: v.clone() for k, v in stock_layer.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        apply()
        layer = build_moe_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True), seed=2)
        assert set(layer.state_dict()) == set(stock_layer.state_dict())
        layer.load_state_dict(stock_layer.state_dict())
        fc1 = layer.experts.linear_fc1  # the load landed where the backend reads: the per-expert parameters
        stock_fc1 = [stock_layer.experts.linear_fc1.get_parameter(f"weight{i}") for i in range(fc1.num_gemms)]
        assert all(torch.equal(p, w) for p, w in zip(f8.weight_params(fc1), stock_fc1))
        assert torch.equal(f8.grouped_param(fc1).detach(), torch.stack(stock_fc1).detach())
        hidden = torch.randn(512, 1, 256, device="cuda", dtype=torch.bfloat16)
        patched_out, _ = forward_backward(layer, hidden)
        for param in layer.parameters():  # move away from the stock weights, then back
            param.data.add_(0.01)
        back = build_moe_layer(tc_module.TransformerConfig(**kwargs), seed=3)
        back.load_state_dict(layer.state_dict())
    finally:
        revert()
    stock_out, _ = forward_backward(stock_layer, hidden)
    assert (patched_out.float() - stock_out.float()).abs().max() <= TOLERANCE * stock_out.float().abs().max()
    for name, value in back.state_dict().items():
        if isinstance(value, torch.Tensor) and name in stock_state:
            assert torch.equal(value, layer.state_dict()[name]), name


@pytest.mark.quick
def test_single_grouped_weight_matches_stock_and_keeps_stock_checkpoints(single_gpu):
    kwargs = small_moe_kwargs(16, 2, "swiglu")
    revert()
    stock_layer, stock = run(tc_module.TransformerConfig(**kwargs), 800)
    try:
        apply()
        config = tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True, moe_single_grouped_weight=True)
        layer, patched = run(config, 800)
        fc1 = layer.experts.linear_fc1
        assert fc1.grouped_names == {"weight"} and tuple(fc1.weight.shape) == (16, 384, 256)
        assert "weight0" not in dict(fc1.named_parameters())
        # Its checkpoints carry the stock per-expert keys and values ...
        assert set(layer.state_dict()) == set(stock_layer.state_dict())
        for key, value in stock_layer.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(layer.state_dict()[key], value), key
        # ... and a stock TE expert layer (F6 linears) loads a grouped-key checkpoint.
        te_layer = build_moe_layer(tc_module.TransformerConfig(**kwargs), seed=9)
        grouped_ckpt = dict(stock_layer.state_dict())
        for fc in ("linear_fc1", "linear_fc2"):
            names = [f"experts.{fc}.weight{i}" for i in range(16)]
            grouped_ckpt[f"experts.{fc}.weight"] = torch.stack([grouped_ckpt.pop(n) for n in names])
        te_layer.load_state_dict(grouped_ckpt)
        assert torch.equal(te_layer.experts.linear_fc2.weight7, stock_layer.experts.linear_fc2.weight7)
    finally:
        revert()
    exact = {"output": torch.equal(stock["output"], patched["output"]),
             "input_grad": torch.equal(stock["input_grad"], patched["input_grad"])}
    for fc in ("linear_fc1", "linear_fc2"):
        grouped_grad = patched[f"grad:experts.{fc}.weight"]
        exact[fc] = all(torch.equal(stock[f"grad:experts.{fc}.weight{i}"], grouped_grad[i]) for i in range(16))
    print(json.dumps({"single_grouped_weight_bitwise": exact}))
    assert all(exact.values()), exact


@pytest.mark.quick
@pytest.mark.parametrize("grouped", [("weight",), ("bias",), ("weight", "bias")], ids="+".join)
def test_single_grouped_params_are_born_grouped_with_stock_values_and_flags(single_gpu, grouped):
    """F5 at construction, with TE: TE's GroupedLinear announces each expert's weight{i}/bias{i}
    through register_parameter and initialises them in reset_parameters; FCs born grouped never
    register them, and hold, for the same seed, bitwise the stock per-expert values stacked (the
    same draws of megatron-core's expert RNG tracker) with the same attributes."""
    kwargs = dict(small_moe_kwargs(16, 2, "swiglu"), add_bias_linear=True)
    revert()
    stock = build_moe_layer(tc_module.TransformerConfig(**kwargs), seed=11)
    try:
        apply()
        asked = {f"moe_single_grouped_{name}": True for name in grouped}
        layer = build_moe_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True, **asked),
                                seed=11)
    finally:
        revert()
    assert layer.experts.backend.name == "grouped_mm"
    for fc in ("linear_fc1", "linear_fc2"):
        born, theirs = getattr(layer.experts, fc), getattr(stock.experts, fc)
        assert born.grouped_names == set(grouped)
        names = dict(born.named_parameters())
        for name in ("weight", "bias"):
            per_expert = [theirs.get_parameter(f"{name}{i}") for i in range(16)]
            if name in grouped:
                assert not any(f"{name}{i}" in names for i in range(16))
                assert torch.equal(names[name], torch.stack(per_expert)), (fc, name)
                assert vars(names[name]) == vars(per_expert[0]), (fc, name)
            else:
                assert all(torch.equal(names[f"{name}{i}"], p) for i, p in enumerate(per_expert)), (fc, name)
                assert vars(names[f"{name}0"]) == vars(per_expert[0]), (fc, name)
        assert torch.equal(theirs.get_parameter("weight3"), born.state_dict()["weight3"])  # stock keys, values


def test_single_grouped_bias_holds_the_biases_and_keeps_stock_checkpoints(single_gpu):
    kwargs = dict(small_moe_kwargs(16, 2, "swiglu"), add_bias_linear=True)
    revert()
    stock_layer, stock = run(tc_module.TransformerConfig(**kwargs), 800)
    try:
        apply()
        config = tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True,
                                             moe_single_grouped_weight=True, moe_single_grouped_bias=True)
        layer, patched = run(config, 800)
        fc2 = layer.experts.linear_fc2
        assert tuple(fc2.bias.shape) == (16, 256) and "bias0" not in dict(fc2.named_parameters())
        assert set(layer.state_dict()) == set(stock_layer.state_dict())
        assert torch.equal(layer.state_dict()["experts.linear_fc2.bias3"], stock_layer.state_dict()["experts.linear_fc2.bias3"])
    finally:
        revert()
    for fc in ("linear_fc1", "linear_fc2"):
        patched.update({f"grad:experts.{fc}.bias{i}": patched[f"grad:experts.{fc}.bias"][i] for i in range(16)})
        patched.update({f"grad:experts.{fc}.weight{i}": patched[f"grad:experts.{fc}.weight"][i] for i in range(16)})
    errors = max_rel_error(stock, {k: patched[k] for k in stock})
    worst = max(errors, key=errors.get)
    print(json.dumps({"case": "single grouped weight+bias", "max_rel": errors[worst], "worst": worst}))
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])


def test_grouped_mm_padded_rows_cost_nothing_and_change_nothing(single_gpu):
    """Counts padded to an alignment (zero rows, as F1 produces) give the same real rows,
    and zero outputs and zero input grads on the padding rows."""
    torch.manual_seed(0)
    config = tc_module.TransformerConfig(**small_moe_kwargs(8, 2, "swiglu"))
    counts = torch.tensor([5, 0, 17, 1, 30, 2, 9, 16], device="cuda")
    padded = (counts + 15) // 16 * 16
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(int(counts.sum()), device="cuda")
    w1 = (torch.randn(8, 384, 256, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    w2 = (torch.randn(8, 256, 192, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    rows = torch.cat([torch.arange(int(c), device="cuda") + int(s) for c, s in zip(counts, torch.cumsum(padded, 0) - padded)])
    x_pad = torch.zeros(int(padded.sum()), 256, device="cuda", dtype=torch.bfloat16).index_copy_(0, rows, x)
    p_pad = torch.zeros(int(padded.sum()), device="cuda").index_copy_(0, rows, probs)
    x.requires_grad_(), x_pad.requires_grad_()
    out = bf16_mlp(x, counts, probs, w1, w2, config)
    out.sum().backward()
    grads = (x.grad, w1.grad.clone(), w2.grad.clone())
    w1.grad = w2.grad = None
    out_pad = bf16_mlp(x_pad, padded, p_pad, w1, w2, config)
    out_pad.sum().backward()
    pad_rows = torch.ones(int(padded.sum()), dtype=torch.bool, device="cuda").index_fill_(0, rows, False)
    assert torch.equal(out_pad[rows], out) and not out_pad[pad_rows].any()
    assert torch.equal(x_pad.grad[rows], grads[0])
    # Zero rows add nothing to the weight grads (the K-split may move: within a bf16 ulp).
    for got, want in ((w1.grad, grads[1]), (w2.grad, grads[2])):
        assert (got.float() - want.float()).abs().max() <= 2.0**-7 * want.float().abs().max()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP=2 needs 2 GPUs")
def test_ep2_device_splits_match_stock(tmp_path):
    for result in run_two_gpu_worker("ep_device_splits_worker.py", tmp_path):
        assert result["backend"] == "grouped_mm" and result["max_rel"] <= TOLERANCE, result
