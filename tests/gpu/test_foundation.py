"""apply() with every new field at its default leaves a stock MoE layer bit-for-bit unchanged,
and against an upstream megatron-core that has the features natively it installs nothing."""


import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.moe_patches import apply, revert
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.fields import PATCH_FIELD_NAMES
from megatron.moe_patches.testing.layer_harness import MoEShape, build_moe_layer, forward_backward, moe_config_kwargs

SMALL = MoEShape(hidden=512, moe_ffn=384, experts=16, topk=4)


def run_layer(config, tokens=1024):
    layer = build_moe_layer(config)
    generator = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    output, input_grad = forward_backward(layer, hidden, grad)
    params = {name: p.detach().clone() for name, p in layer.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return output, input_grad, params, grads


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.quick)])
def test_defaults_bitwise_identical_to_stock(single_gpu, dispatcher, precision):
    kwargs = moe_config_kwargs(SMALL, precision, moe_token_dispatcher_type=dispatcher)
    revert()
    stock = run_layer(tc_module.TransformerConfig(**kwargs))
    try:
        apply()
        config = tc_module.TransformerConfig(**kwargs)
        assert type(config) is PatchedTransformerConfig
        assert all(getattr(config, name) in (None, False) for name in PATCH_FIELD_NAMES)
        patched = run_layer(config)
    finally:
        revert()
    out, dx, params, grads = stock
    out_p, dx_p, params_p, grads_p = patched
    assert params.keys() == params_p.keys()
    for name in params:
        assert torch.equal(params[name], params_p[name]), f"init differs: {name}"
        assert torch.equal(grads[name], grads_p[name]), f"grad differs: {name}"
    assert torch.equal(out, out_p)
    assert torch.equal(dx, dx_p)
    assert out.abs().sum() > 0 and dx.abs().sum() > 0  # a real computation, not zeros
