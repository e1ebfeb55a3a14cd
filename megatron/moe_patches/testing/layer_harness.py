"""A standalone megatron-core MoE layer on one GPU, for the GPU tests and benchmarks.

Builds ``MoELayer`` from megatron-core's own TE layer spec, so the stock path and
a patched path differ only in the config they get. Needs CUDA and TE.
"""

import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    moe_ffn: int
    experts: int
    topk: int


# DESIGN.md §6: the MoE layers of three public model families.
SHAPES: Dict[str, MoEShape] = {
    "qwen3-30b-a3b": MoEShape(hidden=2048, moe_ffn=768, experts=128, topk=8),
    "deepseek-v2-lite": MoEShape(hidden=2048, moe_ffn=1408, experts=64, topk=6),
    "mixtral": MoEShape(hidden=4096, moe_ffn=14336, experts=8, topk=2),
}


def init_single_gpu(seed: int = 1234) -> None:
    """A one-rank process group and megatron-core's parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def init_expert_parallel(seed: int = 1234) -> int:
    """Under torchrun: one NCCL process group over every rank, expert parallelism across all
    of them (EP = world size), megatron-core's parallel state and seeds. Returns the EP size."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    world = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(seed)
    return world


PRECISIONS = ("bf16", "fp8", "fp8-bf16-wgrad", "fp8-blockwise", "fp8-blockwise-bf16-wgrad")


def moe_config_kwargs(shape: MoEShape, precision: str = "bf16", **overrides) -> dict:
    """Constructor kwargs of a TransformerConfig for one SwiGLU MoE layer of ``shape``.

    ``precision``: "bf16"; "fp8" for FP8 tensorwise (current scaling) on bf16 params;
    "fp8-blockwise" for FP8 blockwise (1x128 / 128x128 scales); a "-bf16-wgrad" suffix on
    either FP8 one sets ``fp8_wgrad=False`` (weight gradients in bf16).
    """
    kwargs = dict(
        num_layers=1,
        hidden_size=shape.hidden,
        num_attention_heads=16,
        ffn_hidden_size=shape.moe_ffn,
        moe_ffn_hidden_size=shape.moe_ffn,
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_router_load_balancing_type="none",
        moe_router_pre_softmax=shape.topk == 1,  # megatron-core requires it for top-1
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True,
        moe_permute_fusion=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    if precision in PRECISIONS[1:]:
        recipe = "blockwise" if precision.startswith("fp8-blockwise") else "tensorwise"
        kwargs.update(fp8="e4m3", fp8_recipe=recipe, fp8_wgrad=not precision.endswith("-bf16-wgrad"))
    elif precision != "bf16":
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    kwargs.update(overrides)
    return kwargs


def build_moe_layer(config, seed: int = 1234):
    """megatron-core's MoELayer from the TE GPT layer spec, on the GPU, seeded."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
    return build_module(spec.submodules.mlp, config=config).cuda()


def fp8_context(config):
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config)


def forward_backward(layer, hidden, grad_output: Optional[torch.Tensor] = None):
    """One forward and backward; returns (output, input grad)."""
    hidden = hidden.detach().requires_grad_(True)
    with fp8_context(layer.config):
        output, _ = layer(hidden)
    output.backward(grad_output if grad_output is not None else torch.ones_like(output))
    return output.detach(), hidden.grad


def expert_gemm_flops(shape: MoEShape, tokens: int, glu: bool = True) -> float:
    """FLOPs of the expert GEMMs for one forward+backward (backward = 2x forward)."""
    fc1_out = shape.moe_ffn * (2 if glu else 1)
    forward = 2 * tokens * shape.topk * shape.hidden * (fc1_out + shape.moe_ffn)
    return 3.0 * forward
