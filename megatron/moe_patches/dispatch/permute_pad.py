"""F1: permute straight into the padded, expert-grouped layout; unpermute out of it.

When quantized expert compute needs aligned per-expert token counts and
``routed_expert_padding.padding_plan`` gives the padding to the dispatcher
(``padded_by == "permute"``), the allgather and alltoall dispatchers
(``dispatchers.py``) call TE's ``moe_permute_and_pad_with_probs`` instead of permute +
``Fp8Padding``, keep its ``pad_offsets`` and hand them to
``moe_unpermute(..., pad_offsets=...)`` at combine time. The experts then skip their own
padding (F3). Upstream: NVIDIA/Megatron-LM#2763 (kernel: TransformerEngine#1921).

EP > 1 (alltoall): every rank pads each of its (expert) chunks before the all-to-all,
so each (source rank, local expert) block arrives as a multiple of the alignment and the
receiver's chunk sort keeps the expert groups aligned. The price is up to ``align - 1``
zero rows per (rank, expert) on the wire; the alternative, padding after the receiver's
chunk sort, would need a separate padding pass, which is what this patch removes. See
patches/F1-fused-permute-pad.md. A pure PyTorch statement of the semantics (the GPU
tests' oracle) is ``testing.reference``.

Where the fused path cannot run (no TE kernel, router padding, capacity dropping,
expert TP > 1, non-TE experts, the flex dispatcher) the stock path runs unchanged:
permute, then the experts pad.
"""

import torch


def align_up(counts: torch.Tensor, align: int) -> torch.Tensor:
    """Each count rounded up to a multiple of ``align``."""
    return (counts + align - 1) // align * align


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
