"""Shared by the op-fuser GPU tests and their torchrun worker: one MoE layer run with the
stock unfused TE experts or with F4's op-fuser pipeline, from identical seeds."""

import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.moe_patches import apply, revert
from megatron.moe_patches.experts.glu_interleave import to_concatenated
from megatron.moe_patches.testing.layer_harness import MoEShape, build_moe_layer, fp8_context, moe_config_kwargs


def kwargs_for(activation="swiglu", bias=False, precision="bf16", experts=16, topk=4, **extra):
    shape = MoEShape(hidden=256, moe_ffn=192, experts=experts, topk=topk)
    extra = dict(dict(bias_activation_fusion=True, add_bias_linear=bias), **extra)
    if activation == "quick_geglu":
        extra.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    return moe_config_kwargs(shape, precision, **extra)


def make_config(kwargs, fused, interleave=None, delay=False):
    """A config for the stock path (patches reverted) or the op-fuser path (applied)."""
    if fused:
        apply()
        config = tc_module.TransformerConfig(
            **kwargs, use_transformer_engine_op_fuser=True, moe_mlp_glu_interleave_size=interleave
        )
    else:
        revert()
        config = tc_module.TransformerConfig(**kwargs)
    # megatron-core only allows it with the EP-overlap schedule; the experts honour it alone.
    config.delay_wgrad_compute = delay
    return config


def standard_layout(layer, name, tensor):
    """A parameter-shaped tensor of ``layer`` in the checkpoint (concatenated GLU) layout."""
    size = getattr(getattr(layer.experts, "backend", None), "glu_interleave_size", None)
    if size and name.startswith("experts.linear_fc1."):
        return to_concatenated(tensor, size)
    return tensor


def inputs(config, tokens, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (tokens, 1, config.hidden_size)
    hidden = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    return hidden, grad


def step(model, layer, hidden, grad):
    """Forward, backward and (delayed) weight gradients; returns (output, input grad)."""
    hidden = hidden.detach().requires_grad_(True)
    with fp8_context(layer.config):
        output, _ = model(hidden)
    output.backward(grad)
    layer.backward_dw()
    return output.detach(), hidden.grad


def ddp_main_grads(kwargs, fused, tokens, seed, distributed_optimizer=False, interleave=None, delay=True):
    """Megatron DDP (overlap_grad_reduce, delayed wgrad) over one MoE layer: every param's
    main_grad after one step and the grad sync, in the checkpoint layout."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = make_config(kwargs, fused, interleave=interleave, delay=delay)
    layer = build_moe_layer(config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed_optimizer,
        delay_wgrad_compute=delay,
        bucket_size=1 << 16,  # several buckets: reductions fire while backward runs
    )
    model = DistributedDataParallel(config, ddp_config, layer)
    model.zero_grad_buffer()
    hidden, grad = inputs(config, tokens, seed)
    output, _ = step(model, layer, hidden, grad)
    model.finish_grad_sync()
    grads = {name: standard_layout(layer, name, p.main_grad.detach().clone()) for name, p in layer.named_parameters()}
    used_pipeline = getattr(getattr(layer.experts, "backend", None), "_ops", None) is not None
    revert()
    return output, grads, used_pipeline
