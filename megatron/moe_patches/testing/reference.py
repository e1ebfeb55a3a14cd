"""Pure PyTorch references of the patch set's kernels: the semantics in plain code, the
CPU tests' subject and the GPU tests' oracle. Slow on purpose; never on a training path."""

from typing import Optional, Tuple

import torch

from megatron.moe_patches.dispatch.permute_pad import align_up


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
