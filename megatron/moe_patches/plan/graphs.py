"""Whether a config's MoE layer can be captured as one CUDA graph, and why not (F11).

megatron-core 0.16.1 graphs only drop-and-pad MoE layers; F11 graphs dropless ones
(``graphs/moe_layer_graphs.py``) where the config asks for it (``graphs_dropless_moe``). A
graph replays fixed shapes and addresses without the host, so the layer must keep its token
counts on the device, exchange tokens without host split sizes (EP 1, or the symmetric
exchange of ``plan/exchange.py``), run one rank of tensor and pipeline parallelism, route
without dropping or random numbers, and run experts that take device counts
(``plan/backends.py``). ``graph_blocker`` names the first of those the config breaks.
"""

from typing import List, Optional

from megatron.moe_patches.fields import patch_option
from megatron.moe_patches.plan.exchange import ALLGATHER, ALLTOALL, SYMMETRIC_MEMORY, ExchangeChoice
from megatron.moe_patches.plan.sizes import ep_size, expert_tp_size


def graphs_dropless_moe(config) -> bool:
    """Whether the config asks for CUDA graphs of dropless MoE layers (megatron-core 0.16.1
    graphs only drop-and-pad MoE layers; F11 graphs dropless ones)."""
    return (
        config.cuda_graph_impl in ("local", "transformer_engine")
        and "moe" in scope_names(config.cuda_graph_scope)
        and config.num_moe_experts is not None
        and not (config.moe_expert_capacity_factor is not None and config.moe_pad_expert_input_to_capacity)
    )


def scope_names(scope) -> List[str]:
    """megatron-core's cuda_graph_scope (a string, a CudaGraphScope, or a list of either)
    as a list of scope names."""
    if scope is None:
        return []
    items = scope.split(",") if isinstance(scope, str) else scope if isinstance(scope, (list, tuple)) else [scope]
    return [getattr(item, "name", item) for item in items]


def graph_blocker(config, backend, blockers, exchange: ExchangeChoice) -> Optional[str]:
    """Why this config's MoE layer cannot be captured as one CUDA graph, or None. ``blockers``:
    each backend with why it cannot run the config (named where the chosen one takes host
    counts)."""
    if config.num_moe_experts is None:
        return "it has no MoE layer (num_moe_experts is not set)"
    if not patch_option(config, "moe_device_tokens_per_expert"):
        return "the MoE layer copies token counts to the host: set --moe-device-tokens-per-expert"
    if ep_size(config) > 1:
        ep = f"--expert-model-parallel-size {ep_size(config)}"
        if not patch_option(config, "moe_symmetric_exchange"):
            return (f"{ep}: NCCL's all-to-all takes host split sizes; add --moe-symmetric-exchange (F12) "
                    "or use EP 1")
        if exchange.reason is not None:
            return f"{ep}: the symmetric exchange cannot run here ({exchange.reason})"
    if config.tensor_model_parallel_size > 1 or expert_tp_size(config) > 1:
        return "tensor parallelism > 1 (the dispatchers gather with host split sizes)"
    if config.pipeline_model_parallel_size > 1:
        return "pipeline parallelism: micro-batches in flight would share the graph's static buffers"
    if config.moe_token_dispatcher_type not in (ALLTOALL, ALLGATHER):
        return f"the {config.moe_token_dispatcher_type} dispatcher (graph-safe: alltoall, allgather)"
    if not config.moe_permute_fusion and exchange.name != SYMMETRIC_MEMORY:  # F12 sends tokens unpermuted
        return "the unfused permute selects tokens with a host sync: set --moe-permute-fusion"
    if config.moe_expert_capacity_factor is not None:
        return "token dropping (--moe-expert-capacity-factor); megatron-core's own graphs cover drop-and-pad"
    if config.moe_router_padding_for_quantization:
        return "--moe-router-padding-for-quantization sizes the routing map on the host"
    if config.moe_input_jitter_eps:
        return "--moe-input-jitter-eps draws random numbers inside the layer"
    if config.moe_shared_expert_overlap:
        return "--moe-shared-expert-overlap runs the shared experts on a side stream"
    if config.fp8 and config.moe_shared_expert_intermediate_size:
        return "shared experts under FP8 keep Transformer Engine's FP8 state, which this capture does not manage"
    recomputed = set(config.recompute_modules or []) & {"moe", "moe_act", "shared_experts"}
    if config.recompute_granularity == "full" or (config.recompute_granularity == "selective" and recomputed):
        return "recompute of the MoE layer (--recompute-granularity / --recompute-modules)"
    if config.cpu_offloading or config.fine_grained_activation_offloading:
        return "activation offloading"
    if not backend.takes_device_counts:
        why = "; ".join(f"{b.name}: {reason}" for b, reason in blockers if b.takes_device_counts and reason)
        return f"the {backend.name} expert backend takes host token counts ({why})"
    return None
