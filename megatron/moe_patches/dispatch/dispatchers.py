"""One patched class per stock token dispatcher, its options fixed at construction.

- ``PatchedAllGatherTokenDispatcher``: ``pad_align`` (F1: permute+pad in one pass when
  the plan's padding gives the dispatcher the padding, else None and the stock path) and
  ``device_splits`` (F8 with one rank and no TP: every expert is local, so the permuted
  row count is tokens x top-k, known without the GPU, and the counts stay on the device).
- ``PatchedAlltoAllTokenDispatcher``: ``pad_align`` (F1), ``device_splits`` (F8:
  ``tokens_per_expert`` stays on the GPU; with one source rank and no TP the chunk sort
  by local expert is the identity and is skipped, ``skips_chunk_sort``) and ``exchange``
  (F12: the symmetric-memory exchange in place of NCCL's all-to-all, or None; it lands
  tokens grouped by local expert, so there is no chunk sort either).
- The flex dispatcher's patched part is its HybridEP manager (F2, ``hybridep_blocks``);
  F1 and F8 do not apply to it (HybridEP pads and counts on device itself).

The options are read from the config's plan (``plan.plan_for``) once, in ``__init__``;
the methods below only follow them.
"""

import torch
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron.moe_patches.dispatch.permute_pad import align_up, permute_and_pad, unpermute_and_unpad
from megatron.moe_patches.dispatch.symmetric_exchange import SymmetricExchange
from megatron.moe_patches.plan import SYMMETRIC_MEMORY, plan_for


def _exchange_plan(dispatcher):
    """The config's plan for this dispatcher, made for the sizes its process groups have."""
    plan = plan_for(dispatcher.config)
    plan.check_parallel_sizes(dispatcher.ep_size, dispatcher.tp_size)
    plan.log_choices()
    return plan.exchange


class PatchedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """AllGather dispatcher whose local permutation pads for quantized experts (F1) or keeps
    the experts' token counts on the device (F8)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        exchange = _exchange_plan(self)
        self.pad_align = exchange.pad_align
        self.pad_offsets = None
        # The stock method sizes the permutation by a host copy of the counts and selects
        # the probs with masked_select (a sync); with all experts local and dropless routing
        # the size is tokens x top-k, and TE's fused permute carries the probs.
        self.device_splits = exchange.device_counts

    def dispatch_postprocess(self, hidden_states, probs):
        if self.device_splits:
            return self._permute_with_device_counts(hidden_states, probs)
        if self.pad_align is None:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.local_map = self.routing_map[:, local].contiguous()
        (
            permuted_tokens,
            self.local_probs,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            padded_tokens_per_expert,
        ) = permute_and_pad(hidden_states, probs[:, local].contiguous(), self.local_map, self.pad_align)
        self.routing_map = None
        # The experts take host counts, as with the stock dispatcher.
        return permuted_tokens, padded_tokens_per_expert.cpu(), self.local_probs

    def _permute_with_device_counts(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map  # one rank: every expert is local
        tokens_per_expert_E = self.local_map.sum(dim=0).long()
        (
            permuted_tokens,
            self.local_probs,
            self.reversed_local_input_permutation_mapping,
        ) = permute(
            hidden_states,
            self.local_map,
            probs=probs,
            num_out_tokens=self.local_map.shape[0] * self.config.moe_router_topk,
            fused=True,
        )
        self.routing_map = None
        return permuted_tokens, tokens_per_expert_E, self.local_probs

    def combine_preprocess(self, hidden_states):
        if self.pad_align is None:
            return super().combine_preprocess(hidden_states)
        return unpermute_and_unpad(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            self.hidden_shape_before_permute,
        )


class PatchedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """AlltoAll dispatcher: permutes into per-expert aligned chunks (F1) and hands the
    experts device-resident token counts (F8).

    F1: all split sizes (all-to-all splits, the receiver's chunk sort, the experts'
    counts) are the padded ones; each is the stock value with every (rank, expert) count
    rounded up, so they are derived from the stock metadata, not recomputed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        exchange = _exchange_plan(self)
        self.pad_align = exchange.pad_align
        self.pad_offsets = None
        self.device_splits = exchange.device_counts
        self.exchange = None
        if exchange.name == SYMMETRIC_MEMORY:
            self.exchange = SymmetricExchange(self.ep_group, self.config.moe_router_topk)
        self.exchange_plan = None
        # One source rank, no TP: sorting chunks by local expert keeps them in place, yet
        # the stock path still copies all permuted tokens through the sort (both ways).
        # The symmetric exchange lands tokens sorted by local expert already.
        self.skips_chunk_sort = exchange.skips_chunk_sort

    # --- F8: counts stay on the device --------------------------------------------------

    def _maybe_update_cuda_sync_point(self, point: str):
        # "before_finish" exists only to read tokens_per_expert on the host.
        if self.device_splits and point == "before_finish":
            return
        super()._maybe_update_cuda_sync_point(point)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.exchange is not None:  # no split size goes to the host
            return tokens_per_expert
        if not self.device_splits:
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        super()._maybe_dtoh_and_synchronize(point, None)  # split sizes still go to the host
        return tokens_per_expert

    # --- F12: the symmetric-memory exchange ---------------------------------------------

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if self.exchange is None:
            return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        return self.exchange.dispatch(self.exchange_plan, permutated_local_input_tokens, permuted_probs)

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        if self.exchange is None:
            return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)
        return self.exchange.combine(self.exchange_plan, hidden_states)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self.skips_chunk_sort:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self.skips_chunk_sort:
            return super().combine_preprocess(hidden_states)
        return hidden_states

    # --- F1: permute+pad in one pass ----------------------------------------------------

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            # Dropless (plan.exchange_config_errors): tokens x top-k rows, known on the host.
            self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
            self.exchange_plan = self.exchange.plan(routing_map.sum(dim=0), routing_map.size(0))
            return self.exchange_plan.tokens_per_local_expert
        tokens_per_local_expert = super().preprocess(routing_map)
        if self.pad_align is None:
            return tokens_per_local_expert
        align = self.pad_align
        local_counts = routing_map.sum(dim=0).long()
        # [source rank, local expert] token counts as the stock preprocess derived them.
        if self.ep_size == 1:
            per_source = local_counts.view(1, -1)
        elif self.num_local_experts > 1:
            per_source = self.num_global_tokens_per_local_expert
        else:
            per_source = self.output_splits.view(-1, 1)
        padded = align_up(per_source, align)
        if self.ep_size > 1:
            self.input_splits = align_up(local_counts, align).view(self.ep_size, -1).sum(dim=1)
            self.output_splits = padded.sum(dim=1)
            self.output_splits_tp = padded.sum().view(1)
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = padded
        return padded.sum(dim=0)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if self.pad_align is None:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # The stock method with permute replaced by permute+pad; router padding and
        # capacity dropping never reach here (the plan's padding excludes them).
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert
        )
        self.hidden_shape_before_permute = hidden_states.shape
        (
            permuted_tokens,
            permuted_probs,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            _,
        ) = permute_and_pad(hidden_states, probs, routing_map, self.pad_align)
        return permuted_tokens, permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        if self.pad_align is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        output = unpermute_and_unpad(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            self.hidden_shape_before_permute,
        ).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


def replacements():
    return [
        (MoEAllGatherTokenDispatcher, PatchedAllGatherTokenDispatcher),
        (MoEAlltoAllTokenDispatcher, PatchedAlltoAllTokenDispatcher),
    ]
