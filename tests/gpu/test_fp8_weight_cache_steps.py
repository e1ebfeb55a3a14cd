"""F10 on the GPU: the FP8 experts' weight copies through megatron-core's own training step:
its schedule (``forward_backward_no_pipelining``, two micro-batches per step) and its real
optimizers, built by ``get_megatron_optimizer`` over a DDP-wrapped MoE layer: the Float16
optimizer (fp32 main copies written back through ``.data``) and the distributed optimizer (main
shards written into DDP's parameter buffer, then all-gathered). Neither write moves a
parameter's version counter or storage; the schedule marks each step's first micro-batch
(``set_is_first_microbatch``, as for TE's FP8 layers), and that is what refreshes the copies.
The CPU side runs megatron-core's Float16 step itself: tests/unit/test_fp8_weight_cache_steps.py.
"""

import json

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.moe_patches import apply, revert
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.experts.grouped_mm import grouped_param, weight_params
from megatron.moe_patches.testing.layer_harness import MoEShape, build_moe_layer, fp8_context, moe_config_kwargs

SHAPE = MoEShape(hidden=256, moe_ffn=128, experts=8, topk=2)
TOKENS = 512
MICRO_BATCHES = 2


def _stage(layer):
    """The MoE layer as the one stage megatron-core's schedule runs (a model type, an input
    tensor setter for pipelines, one output)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class Stage(MegatronModule):
        model_type = ModelType.encoder_or_decoder

        def __init__(self):
            super().__init__(layer.config)
            self.layer = layer

        def set_input_tensor(self, tensor):
            pass

        def forward(self, hidden):
            with fp8_context(self.config):
                return self.layer(hidden)[0]

    return Stage()


def _train_step(model, optimizer, hidden, grad, step_optimizer=True):
    """megatron-core's schedule over MICRO_BATCHES micro-batches, then (optionally) its optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        x = next(data_iterator).detach().requires_grad_(True)
        return model(x), lambda out: ((out.float() * grad.float()).sum(), {})

    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([hidden] * MICRO_BATCHES), model=[model],
        num_microbatches=MICRO_BATCHES, seq_length=TOKENS, micro_batch_size=1, forward_only=False)
    model.finish_grad_sync()
    if step_optimizer:
        success, _, _ = optimizer.step()
        assert success


@pytest.mark.parametrize("distributed", [False, True], ids=["float16-optimizer", "distributed-optimizer"])
def test_fp8_weight_copies_follow_a_megatron_core_optimizer_step(single_gpu, distributed, quantizations):
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
            _stage(layer))
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0,
                            use_distributed_optimizer=distributed),
            [model], use_gloo_process_groups=False)
        generator = torch.Generator(device="cuda").manual_seed(5)
        hidden = torch.randn(TOKENS, 1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        grad = torch.randn(TOKENS, 1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)

        linears = (layer.experts.linear_fc1, layer.experts.linear_fc2)
        caches = [backend._caches[linear] for linear in linears]
        counters = [[(p.data_ptr(), p._version) for p in weight_params(linear)] for linear in linears]
        weights = [grouped_param(linear).detach().clone() for linear in linears]
        _train_step(model, optimizer, hidden, grad)  # two micro-batches, then the step
        assert [quantizations[c] for c in caches] == [1, 1]  # once for both micro-batches
        first = [c.weights.w8_EOI.clone() for c in caches]
        torch.cuda.synchronize()
        stepped = [grouped_param(linear).detach().clone() for linear in linears]
        assert all(not torch.equal(a, b) for a, b in zip(weights, stepped)), "the step changed no expert weight"
        # the premise: the write-back is invisible to the parameters' own counters
        assert counters == [[(p.data_ptr(), p._version) for p in weight_params(linear)] for linear in linears], (
            "megatron-core's step moved a parameter's storage or version counter")

        _train_step(model, optimizer, hidden, grad, step_optimizer=False)  # the next step's micro-batches
        torch.cuda.synchronize()
        refreshes = [quantizations[c] for c in caches]
        changed = [not torch.equal(c.weights.w8_EOI.view(torch.uint8), f.view(torch.uint8)) for c, f in zip(caches, first)]
        matches = []
        for cache, w_EOI in zip(caches, stepped):
            w8_EOI, w8_EIO, scale_inv_E = fp8.quantize_weights(w_EOI)
            matches.append(torch.equal(cache.weights.w8_EOI.view(torch.uint8), w8_EOI.view(torch.uint8))
                           and torch.equal(cache.weights.w8_EIO.view(torch.uint8), w8_EIO.view(torch.uint8))
                           and torch.equal(cache.weights.scale_inv_E, scale_inv_E))
    finally:
        revert()
    print(json.dumps({"distributed": distributed, "refreshes": refreshes, "changed": changed, "matches": matches}))
    assert refreshes == [2, 2]  # once per step, not per micro-batch
    assert changed == [True, True] and matches == [True, True]
