"""F10 on the GPU: the FP8 experts' weight copies after a step of megatron-core's real
optimizers, built by ``get_megatron_optimizer`` over a DDP-wrapped MoE layer: the Float16
optimizer (fp32 main copies written back through ``.data``) and the distributed optimizer
(main shards written into DDP's parameter buffer, then all-gathered). Neither write moves a
parameter's version counter or storage, so only the optimizer step count tells the cache that
its copies are stale; a cache that stopped counting would keep the first step's FP8 weights.
The CPU side runs megatron-core's Float16 step itself: tests/unit/test_fp8_weight_cache_steps.py.
"""

import json

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.moe_patches import apply, revert
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.testing.layer_harness import MoEShape, build_moe_layer, fp8_context, moe_config_kwargs

SHAPE = MoEShape(hidden=256, moe_ffn=128, experts=8, topk=2)
TOKENS = 512


def _train_step(model, layer, optimizer, hidden, grad):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    x = hidden.detach().requires_grad_(True)
    with fp8_context(layer.config):
        out, _ = model(x)
    out.backward(grad)
    model.finish_grad_sync()


@pytest.mark.parametrize("distributed", [False, True], ids=["float16-optimizer", "distributed-optimizer"])
def test_fp8_weight_copies_follow_a_megatron_core_optimizer_step(single_gpu, distributed):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    try:
        apply()
        config = tc_module.TransformerConfig(**moe_config_kwargs(SHAPE, "fp8"), moe_device_tokens_per_expert=True)
        layer = build_moe_layer(config)
        backend = layer.experts.backend
        assert backend.name == "fp8_grouped_mm"
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
            layer)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0,
                            use_distributed_optimizer=distributed),
            [model], use_gloo_process_groups=False)
        generator = torch.Generator(device="cuda").manual_seed(5)
        hidden = torch.randn(TOKENS, 1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        grad = torch.randn(TOKENS, 1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)

        linears = (layer.experts.linear_fc1, layer.experts.linear_fc2)
        caches = [backend._caches[linear] for linear in linears]
        _train_step(model, layer, optimizer, hidden, grad)
        _train_step(model, layer, optimizer, hidden, grad)  # a second micro-batch before any step
        assert [c.refreshes for c in caches] == [1, 1]
        first = [c.w8_EOI.clone() for c in caches]
        sources = [backend._weight_sources(linear) for linear in linears]
        counters = [[(p.data_ptr(), p._version) for p in s] for s in sources]
        weights = [backend._grouped(linear).detach().clone() for linear in linears]

        success, _, _ = optimizer.step()
        assert success
        torch.cuda.synchronize()
        stepped = [backend._grouped(linear).detach().clone() for linear in linears]
        assert all(not torch.equal(a, b) for a, b in zip(weights, stepped)), "the step changed no expert weight"
        # the premise: the write-back is invisible to the parameters' own counters
        assert counters == [[(p.data_ptr(), p._version) for p in s] for s in sources], (
            "megatron-core's step moved a parameter's storage or version counter")

        _train_step(model, layer, optimizer, hidden, grad)
        _train_step(model, layer, optimizer, hidden, grad)
        torch.cuda.synchronize()
        refreshes = [c.refreshes for c in caches]
        changed = [not torch.equal(c.w8_EOI.view(torch.uint8), f.view(torch.uint8)) for c, f in zip(caches, first)]
        matches = []
        for cache, w_EOI in zip(caches, stepped):
            w8_EOI, w8_EIO, scale_inv_E = fp8.quantize_weights(w_EOI)
            matches.append(torch.equal(cache.w8_EOI.view(torch.uint8), w8_EOI.view(torch.uint8))
                           and torch.equal(cache.w8_EIO.view(torch.uint8), w8_EIO.view(torch.uint8))
                           and torch.equal(cache.scale_inv_E, scale_inv_E))
    finally:
        revert()
    print(json.dumps({"distributed": distributed, "refreshes": refreshes, "changed": changed, "matches": matches}))
    assert refreshes == [2, 2]  # once per step, not per micro-batch
    assert changed == [True, True] and matches == [True, True]
