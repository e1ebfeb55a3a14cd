"""F1: permute straight into the padded, expert-grouped layout; unpermute out of it.

Patches: megatron-core's ``MoEAllGatherTokenDispatcher`` and
``MoEAlltoAllTokenDispatcher`` (megatron.core.transformer.moe.token_dispatcher) are
replaced by subclasses that, when quantized expert compute needs aligned per-expert
token counts, call TE's ``moe_permute_and_pad_with_probs`` instead of permute +
``Fp8Padding``, keep its ``pad_offsets`` and hand them to
``moe_unpermute(..., pad_offsets=...)`` at combine time. The experts then skip their
own padding (F3). Upstream: NVIDIA/Megatron-LM#2763 (kernel: TransformerEngine#1921).

EP > 1 (alltoall): every rank pads each of its (expert) chunks before the
all-to-all, so each (source rank, local expert) block arrives as a multiple of the
alignment and the receiver's chunk sort keeps the expert groups aligned. The price
is up to ``align - 1`` zero rows per (rank, expert) on the wire; the alternative,
padding after the receiver's chunk sort, would need a separate padding pass, which
is what this patch removes. See patches/F1-fused-permute-pad.md.

Where the fused path cannot run (no TE kernel, router padding, capacity dropping,
expert TP > 1, non-TE experts, the flex dispatcher) the stock path runs unchanged:
permute, then the experts pad.
"""

import logging
from typing import Optional, Tuple

import torch
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron.moe_patches import capabilities as cap

logger = logging.getLogger(__name__)
_logged = set()

TE_KERNEL_NEEDED = (
    "Transformer Engine with moe_permute_and_pad_with_probs and moe_unpermute(pad_offsets=) "
    "(TE >= 2.14; the device kit's TE 2.20.2 has them)"
)


def _log_once(level, message):
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def align_up(counts: torch.Tensor, align: int) -> torch.Tensor:
    """Each count rounded up to a multiple of ``align``."""
    return (counts + align - 1) // align * align


def fused_padding_alignment(config) -> Optional[int]:
    """The alignment F1's dispatchers pad to, or None where the stock path must run.

    Only config and TE capability decide, so the dispatcher (which pads) and the
    experts (which then must not) always agree.
    """
    from megatron.moe_patches.routed_expert_padding import quantization_alignment

    align = quantization_alignment(config)
    if align is None:
        return None
    reason = None
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        reason = f"the {config.moe_token_dispatcher_type} dispatcher pads by its own means"
    elif not config.moe_permute_fusion:
        reason = "it needs --moe-permute-fusion"
    elif config.moe_router_padding_for_quantization:
        reason = "the router already pads (--moe-router-padding-for-quantization)"
    elif config.moe_pad_expert_input_to_capacity:
        reason = "--moe-pad-expert-input-to-capacity pads to capacity instead"
    elif not (
        config.moe_grouped_gemm
        and config.transformer_impl == "transformer_engine"
        and not config.moe_use_legacy_grouped_gemm
    ):
        reason = "it needs TE grouped experts (--moe-grouped-gemm, transformer_impl=transformer_engine)"
    elif (config.expert_tensor_parallel_size or 1) > 1:
        reason = "expert tensor parallelism > 1 is not supported by it"
    if reason is not None:
        _log_once(logging.INFO, f"F1 fused permute+pad off: {reason}; experts pad themselves.")
        return None
    if not cap.te_fused_permute_pad():
        _log_once(
            logging.WARNING,
            f"F1 fused permute+pad needs {TE_KERNEL_NEEDED}; installed TE: {cap.te_version()}. "
            "Falling back to permute + explicit padding.",
        )
        return None
    return align


def _te_permutation():
    import transformer_engine.pytorch.permutation as te_permutation

    return te_permutation


def permute_and_pad(tokens, probs, routing_map, align: int):
    """TE's fused permute+pad: (tokens, probs, row_id_map, pad_offsets or None, padded counts)."""
    counts = routing_map.sum(dim=0)
    return _te_permutation().moe_permute_and_pad_with_probs(tokens, probs, routing_map, counts, align)


def unpermute_and_unpad(tokens, row_id_map, pad_offsets, restore_shape):
    """TE's fused unpermute that drops the padding rows (no prob merging: experts applied them)."""
    return _te_permutation().moe_unpermute(
        tokens, row_id_map, restore_shape=restore_shape, pad_offsets=pad_offsets
    )


class PaddedPermuteAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """AllGather dispatcher whose local permutation pads for quantized experts (F1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_align = fused_padding_alignment(self.config)
        self.pad_offsets = None

    def dispatch_postprocess(self, hidden_states, probs):
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

    def combine_preprocess(self, hidden_states):
        if self.pad_align is None:
            return super().combine_preprocess(hidden_states)
        return unpermute_and_unpad(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            self.pad_offsets,
            self.hidden_shape_before_permute,
        )


class PaddedPermuteAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """AlltoAll dispatcher that permutes into per-expert aligned chunks (F1).

    All split sizes (all-to-all splits, the receiver's chunk sort, the experts'
    counts) are the padded ones; each is the stock value with every (rank, expert)
    count rounded up, so they are derived from the stock metadata, not recomputed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_align = fused_padding_alignment(self.config)
        self.pad_offsets = None

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
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
        # capacity dropping never reach here (fused_padding_alignment excludes them).
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
        (MoEAllGatherTokenDispatcher, PaddedPermuteAllGatherTokenDispatcher),
        (MoEAlltoAllTokenDispatcher, PaddedPermuteAlltoAllTokenDispatcher),
    ]


# --- Pure PyTorch reference (CPU and GPU): the semantics, and the GPU tests' oracle ------


def reference_permute_and_pad(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, align: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group tokens by expert, each group zero-padded to a multiple of ``align``.

    tokens_TH [T, H], probs_TE [T, E], routing_map_TE [T, E] bool. Within an expert,
    tokens keep their order. Returns (permuted_PH, permuted_probs_P, dest_row_TE,
    pad_offsets_E, padded_counts_E): ``dest_row_TE[t, e]`` is the row of token t's copy
    for expert e (-1 where not routed); ``pad_offsets_E[e]`` the padding rows placed
    before expert e's group (TE's convention).
    """
    num_tokens, num_experts = routing_map.shape
    counts_E = routing_map.sum(dim=0).long()
    padded_E = align_up(counts_E, align)
    starts_E = torch.cumsum(padded_E, 0) - padded_E
    pad_offsets_E = torch.cumsum(padded_E - counts_E, 0) - (padded_E - counts_E)
    permuted_PH = tokens.new_zeros(int(padded_E.sum()), tokens.shape[1])
    permuted_probs_P = probs.new_zeros(int(padded_E.sum()))
    dest_row_TE = torch.full((num_tokens, num_experts), -1, dtype=torch.long, device=tokens.device)
    for e in range(num_experts):
        token_idx = routing_map[:, e].nonzero().flatten()
        rows = starts_E[e] + torch.arange(token_idx.numel(), device=tokens.device)
        permuted_PH[rows] = tokens[token_idx]
        permuted_probs_P[rows] = probs[token_idx, e]
        dest_row_TE[token_idx, e] = rows
    return permuted_PH, permuted_probs_P, dest_row_TE, pad_offsets_E, padded_E


def reference_unpermute_and_unpad(
    permuted_PH: torch.Tensor, dest_row_TE: torch.Tensor, merging_probs_TE: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sum each token's expert copies back into its row (weighted by probs if given);
    padding rows are never read."""
    output_TH = permuted_PH.new_zeros(dest_row_TE.shape[0], permuted_PH.shape[1])
    for e in range(dest_row_TE.shape[1]):
        token_idx = (dest_row_TE[:, e] >= 0).nonzero().flatten()
        rows = permuted_PH[dest_row_TE[token_idx, e]]
        if merging_probs_TE is not None:
            rows = rows * merging_probs_TE[token_idx, e].unsqueeze(-1).to(rows.dtype)
        output_TH[token_idx] += rows
    return output_TH
