"""Whether a config's MoE layer can be captured as one CUDA graph, and why not (F11).

megatron-core 0.16.1 graphs only drop-and-pad MoE layers; F11 graphs dropless ones
(``graphs/layer_graphs.py``) where the config asks for it (``graph_scopes.py``'s ``graph_scope``): each
MoE layer (``--cuda-graph-scope moe``) or each transformer layer whole, attention and MoE in
one graph (no scope, or ``attn moe``). A graph replays fixed shapes
and addresses without the host, so the layer must keep its token counts on the device,
exchange tokens without host split sizes (EP 1, or the symmetric exchange of
``plan/exchange.py``), run one rank of tensor and pipeline parallelism, route without
dropping or random numbers (input jitter, forced load balancing), and run experts that take
device counts (``plan/backends.py``).
``graph_blocker`` names the first of those the config breaks. ``full_iteration`` (megatron-core's
capture of every micro-batch's forward and backward as one graph) runs the MoE layers inside
that graph and needs the same of them (``full_iteration_blocker``); what each training loop
runs inside the captured step is ``graph_scopes.py``'s rule.
"""

from typing import Optional

from megatron.moe_patches.fields import patch_option
from megatron.moe_patches.graph_scopes import GraphScope
from megatron.moe_patches.plan.exchange import ALLGATHER, ALLTOALL, SYMMETRIC_MEMORY, ExchangeChoice
from megatron.moe_patches.plan.sizes import ep_size, expert_tp_size

# FP8 recipes whose scales the kernels compute on the device from the tensor at hand (TE's
# current scaling, blockwise): a whole layer under them replays without TE's host state.
GRAPHED_FP8_RECIPES = ("tensorwise", "blockwise")


def graph_blocker(config, backend, blockers, exchange: ExchangeChoice, scope: GraphScope) -> Optional[str]:
    """Why this config's MoE layer cannot be captured as one CUDA graph, or None. ``blockers``:
    each backend with why it cannot run the config (named where the chosen one takes host
    counts); ``scope``: the config's ``graph_scope``."""
    reason = _host_sync_blocker(config, backend, blockers, exchange)
    if reason is not None:
        return reason
    if config.pipeline_model_parallel_size > 1:
        return "pipeline parallelism: micro-batches in flight would share the graph's static buffers"
    if config.moe_input_jitter_eps:
        return "--moe-input-jitter-eps draws random numbers inside the layer"
    if config.moe_router_force_load_balancing:
        return "--moe-router-force-load-balancing draws random numbers inside the layer (random router logits)"
    if config.moe_shared_expert_overlap:
        return "--moe-shared-expert-overlap runs the shared experts on a side stream"
    if config.fp8 and config.moe_shared_expert_intermediate_size:
        return "shared experts under FP8 keep Transformer Engine's FP8 state, which this capture does not manage"
    recomputed = set(config.recompute_modules or []) & {"moe", "moe_act", "shared_experts"}
    if config.recompute_granularity == "full" or (config.recompute_granularity == "selective" and recomputed):
        return "recompute of the MoE layer (--recompute-granularity / --recompute-modules)"
    if config.cpu_offloading or config.fine_grained_activation_offloading:
        return "activation offloading"
    reason = _host_counts_blocker(backend, blockers)
    if reason is not None:
        return reason
    if scope is GraphScope.WHOLE_LAYER:
        return _whole_layer_blocker(config)
    return None


def _host_sync_blocker(config, backend, blockers, exchange: ExchangeChoice) -> Optional[str]:
    """Where this config's MoE layer waits for the GPU outside its experts (what no graph can
    hold), or None."""
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
    if config.moe_token_dispatcher_type not in (ALLTOALL, ALLGATHER):
        return f"the {config.moe_token_dispatcher_type} dispatcher (graph-safe: alltoall, allgather)"
    if not config.moe_permute_fusion and exchange.name != SYMMETRIC_MEMORY:  # F12 sends tokens unpermuted
        return "the unfused permute selects tokens with a host sync: set --moe-permute-fusion"
    if config.moe_expert_capacity_factor is not None:
        return "token dropping (--moe-expert-capacity-factor); megatron-core's own graphs cover drop-and-pad"
    if config.moe_router_padding_for_quantization:
        return "--moe-router-padding-for-quantization sizes the routing map on the host"
    return None


def _host_counts_blocker(backend, blockers) -> Optional[str]:
    """Why the chosen experts wait for the host's token counts, or None."""
    if not backend.takes_device_counts:
        why = "; ".join(f"{b.name}: {reason}" for b, reason in blockers if b.takes_device_counts and reason)
        return f"the {backend.name} expert backend takes host token counts ({why})"
    return None


def _whole_layer_blocker(config) -> Optional[str]:
    """What the attention around the MoE layer adds when the whole layer is one graph."""
    if getattr(config, "fp4", None):
        return "FP4 in the attention's Transformer Engine layers (not verified inside the captured layer)"
    if config.fp8 and config.fp8_recipe not in GRAPHED_FP8_RECIPES:
        return (f"--fp8-recipe {config.fp8_recipe}: its scales live in Transformer Engine's host-updated state, "
                f"which a replayed layer would not update; use --fp8-recipe {' or '.join(GRAPHED_FP8_RECIPES)}, "
                "or --cuda-graph-scope moe")
    if config.attention_dropout or config.hidden_dropout:
        return ("dropout inside the captured layer (--attention-dropout, --hidden-dropout): that its random "
                "numbers are new at every replay is not verified yet; set both to 0, or use --cuda-graph-scope moe")
    if config.recompute_granularity is not None:
        return "recompute inside the captured layer (--recompute-granularity): use --cuda-graph-scope moe"
    if config.context_parallel_size > 1:
        return "context parallelism (its attention exchanges with peers per chunk)"
    if config.cuda_graph_impl == "transformer_engine" and config.cuda_graph_warmup_steps < 1:
        return ("--cuda-graph-warmup-steps 0: the whole layer's inputs (rotary embeddings, attention mask) are "
                "known once a step has run; use at least 1")
    return None


def full_iteration_blocker(config, backend, blockers, exchange: ExchangeChoice, scope: GraphScope) -> Optional[str]:
    """Why megatron-core's ``full_iteration`` graph cannot hold this config's MoE layers, or
    None (also where it is not asked for). The graph replays whole iterations, so only what
    waits for the host matters, not what a per-layer capture needs (pipeline stages, side
    streams and recompute are all inside the one graph)."""
    if config.num_moe_experts is None or scope is not GraphScope.FULL_ITERATION:
        return None
    reason = _host_sync_blocker(config, backend, blockers, exchange) or _host_counts_blocker(backend, blockers)
    if reason is not None:
        return reason
    # The FP8 experts' and TE's weight copies refresh at a step's first micro-batch, which the
    # graph holds: the capture quantizes there and each replay does again. (Delayed scaling,
    # whose amax history the host updates, runs the te experts: refused above for host counts.)
    if config.cuda_graph_warmup_steps < 1:
        return ("--cuda-graph-warmup-steps 0: the first iteration would be captured before anything ran "
                "(the exchange's buffers, the kernels' first launches); use at least 1")
    return None

