"""One patched class per stock token dispatcher, built from two strategy objects chosen once,
in ``__init__``: an exchange (``exchanges``) and a permute step (``permute_pad``).

- ``PatchedAllGatherTokenDispatcher``: exchange ``AllGather`` (megatron-core's); permute
  step plain, padded (F1: permute+pad in one pass when the plan gives the dispatcher the
  padding; at one rank with device counts into a static row count) or device-counted (F8
  with one rank and no TP: every expert is local, so the permuted row count is tokens x
  top-k, known without the GPU, and the counts stay on the device).
- ``PatchedAlltoAllTokenDispatcher``: exchange NCCL's all-to-all (megatron-core's; with
  F8 the experts' counts stay on the device, and with one source rank and no TP the chunk
  sort by local expert, the identity, is skipped) or the symmetric-memory one (F12: no
  host split sizes, each token sent once per owner, rows laid out by local expert there);
  permute step plain, padded (F1), or none behind F12 (``TokenRows``).
- The flex dispatcher's patched part is its HybridEP manager (F2, ``hybridep_blocks``);
  F1 and F8 do not apply to it (HybridEP pads and counts on device itself).

Both are built from the config's plan (``plan.plan_for``), which decides them; the methods
below only hand each phase to the exchange or the permute step: no option is re-checked per
call.
"""

import torch
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron.moe_patches.dispatch.exchanges import AllGather, alltoall_exchange
from megatron.moe_patches.dispatch.permute_pad import (
    DeviceCountPermute, PaddedPermute, PlainPermute, StaticPaddedPermute, TokenRows)
from megatron.moe_patches.plan import SYMMETRIC_MEMORY, plan_for


def _exchange_plan(dispatcher):
    """The config's plan for this dispatcher, made for the sizes its process groups have."""
    plan = plan_for(dispatcher.config)
    plan.check_parallel_sizes(dispatcher.ep_size, dispatcher.tp_size)
    plan.log_choices()
    return plan.exchange


def _padded_step(config, choice):
    """F1's padded permute: into a static row count at one rank (``static_pad_rows``, writing
    the rows' FP8 copy too where ``quantized_rows``), else sized by the padded counts."""
    if choice.static_pad_rows:
        return StaticPaddedPermute(choice.pad_align, config.moe_router_topk, choice.quantized_rows)
    return PaddedPermute(choice.pad_align)


def alltoall_permute_step(config, choice):
    """None behind F12's exchange (it moves tokens), F1's padded permute where the dispatcher
    pads (the plan's ``pad_align``), else megatron-core's."""
    if choice.name == SYMMETRIC_MEMORY:
        return TokenRows()
    return PlainPermute.for_alltoall(config) if choice.pad_align is None else _padded_step(config, choice)


def allgather_permute_step(config, choice):
    """F1's padded permute, F8's device-counted one (the plan's ``device_counts``), else
    megatron-core's."""
    if choice.pad_align is not None:
        return _padded_step(config, choice)
    if choice.device_counts:
        return DeviceCountPermute(config.moe_router_topk)
    return PlainPermute(fused=config.moe_permute_fusion)


class PatchedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """AllGather dispatcher whose local permutation is its permute step's: padded for
    quantized experts (F1) or keeping the experts' token counts on the device (F8)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        choice = _exchange_plan(self)
        self.permute_step = allgather_permute_step(self.config, choice)
        self.pad_offsets = None
        self.exchange = AllGather()
        self.local_experts = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)

    def token_dispatch(self, hidden_states, probs):
        return self.exchange.dispatch(self, hidden_states, probs)

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        permuted = self.permute_step.permute_local(hidden_states, probs, self.routing_map, self.local_experts)
        self.local_map, self.local_probs = permuted.routing_map, permuted.probs_R
        self.reversed_local_input_permutation_mapping = permuted.row_id_map
        self.pad_offsets = permuted.pad_offsets
        self.routing_map = None
        return permuted.x_RH, permuted.tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        return self.permute_step.unpermute(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            self.hidden_shape_before_permute,
            self.local_map,
        )

    def token_combine(self, hidden_states):
        return self.exchange.combine(self, hidden_states)


class PatchedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """AlltoAll dispatcher: megatron-core's phases, in its order, each through the permute
    step (plain, or padded into per-expert aligned chunks: F1) and the exchange (NCCL's,
    F8's device counts, or symmetric memory: F12)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        choice = _exchange_plan(self)
        self.permute_step = alltoall_permute_step(self.config, choice)
        self.pad_offsets = None
        self.exchange = alltoall_exchange(choice, self.ep_group, self.config.moe_router_topk)

    # --- the pipeline (one for every configuration) -------------------------------------

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        assert probs.dim() == 2, "Expected 2D tensor for probs"
        assert routing_map.dim() == 2, "Expected 2D tensor for token2expert mask"
        assert routing_map.dtype == torch.bool, "Expected bool tensor for mask"
        x_TH = hidden_states.view(-1, self.hidden_shape[-1])
        self.routing_map = self.permute_step.route(routing_map)
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(x_TH.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = x_TH.shape
        permuted = self.permute_step.permute(x_TH, probs, self.routing_map, self.num_out_tokens)
        self.reversed_local_input_permutation_mapping = permuted.row_id_map
        self.pad_offsets = permuted.pad_offsets
        return permuted.x_RH, permuted.probs_R

    def combine_postprocess(self, permutated_local_input_tokens):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        output = self.permute_step.unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            self.hidden_shape_before_permute,
            self.routing_map,
        ).view(self.hidden_shape)
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        tokens_per_local_expert = self.exchange.preprocess(self, routing_map)
        return self.permute_step.align_splits(self, routing_map, tokens_per_local_expert)

    # --- the exchange's phases ----------------------------------------------------------

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        return self.exchange.dispatch(self, permutated_local_input_tokens, permuted_probs)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        return self.exchange.dispatch_postprocess(self, global_input_tokens, global_probs)

    def combine_preprocess(self, hidden_states):
        return self.exchange.combine_preprocess(self, hidden_states)

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        return self.exchange.combine(self, hidden_states, async_finish, allocate_on_comm_stream)

    def _maybe_update_cuda_sync_point(self, point: str):
        self.exchange.update_sync_point(self, point)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return self.exchange.dtoh_and_synchronize(self, point, tokens_per_expert)

