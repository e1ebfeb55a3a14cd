"""The dispatchers' permute step: tokens grouped by expert, plain or padded to an alignment (F1).

A dispatcher holds one step, chosen at construction (``dispatchers.alltoall_permute_step``,
``dispatchers.allgather_permute_step``):

- ``TokenRows``: none at all, for F12's exchange, which sends tokens and lays out the
  experts' rows on their owners.
- ``PlainPermute``: megatron-core's permute and unpermute, called as its dispatchers call
  them (the alltoall dispatcher's routing map padded by the router where
  ``moe_router_padding_for_quantization`` asks for it); the experts pad if anyone does.
- ``DeviceCountPermute``: the allgather dispatcher's local permutation when every expert is
  local (F8, one rank, no TP, dropless): sized tokens x top-k without the GPU, the probs
  carried by TE's fused permute, the experts' counts left on the device.
- ``PaddedPermute``: F1. When quantized expert compute needs aligned per-expert token
  counts and ``padding_plan`` gives the padding to the dispatcher (``padded_by ==
  "permute"``), TE's ``moe_permute_and_pad_with_probs`` permutes straight into per-expert
  groups padded to the alignment, and ``moe_unpermute(..., pad_offsets=...)`` drops the
  padding rows at combine time. The experts then skip their own padding (F3). Upstream:
  NVIDIA/Megatron-LM#2763 (kernel: TransformerEngine#1921).
- ``StaticPaddedPermute``: the same kernels at one rank with the counts kept on the device,
  for experts whose GEMMs need each expert's rows to start on an ``align``-row boundary
  (F10's blockwise experts on DeepGEMM): the row count is static (tokens x top-k + experts
  x (align - 1); the rows past the last group belong to no expert and are zero) and the pad
  offsets are computed on the device, so nothing waits for the GPU and CUDA graphs can hold
  it (F11).

EP > 1 (alltoall): every rank pads each of its (expert) chunks before the all-to-all,
so each (source rank, local expert) block arrives as a multiple of the alignment and the
receiver's chunk sort keeps the expert groups aligned (``PaddedPermute.align_splits``
rounds every split size the stock metadata holds). The price is up to ``align - 1`` zero
rows per (rank, expert) on the wire; the alternative, padding after the receiver's chunk
sort, would need a separate padding pass, which is what this patch removes. See
patches/F1-fused-permute-pad.md. A pure PyTorch statement of the semantics (the GPU
tests' oracle) is ``testing.reference``.

Where the fused path cannot run (no TE kernel, router padding, capacity dropping,
expert TP > 1, non-TE experts, the flex dispatcher) the plain step runs: megatron-core's
permute, then the experts pad.

Per-step state (row maps, pad offsets) stays on the dispatcher, under megatron-core's
names: the steps hold options only.
"""

from typing import NamedTuple, Optional

import torch
from megatron.core.config import is_experimental_enabled
from megatron.core.fusions.fused_pad_routing_map import fused_pad_routing_map
from megatron.core.transformer.moe.moe_utils import (
    get_align_size_for_quantization,
    pad_routing_map,
    permute,
    unpermute,
)

from megatron.moe_patches.kernels.fp8_blockwise_quantize import attach_quantized_rows
from megatron.moe_patches.kernels.permute_quantize import gather_quantized


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


def permute_into_rows(tokens, probs, routing_map, rows: int, pad_offsets):
    """TE's permute kernel into ``rows`` rows with device-side ``pad_offsets`` (no host sync;
    autograd as TE registers it for the op)."""
    _te_permutation()  # importing it registers the op
    return torch.ops.te_moe.permute_mask_map_fwd(tokens, routing_map, rows, probs, pad_offsets)


def unpermute_and_unpad(tokens, row_id_map, pad_offsets, restore_shape):
    """TE's fused unpermute that drops the padding rows (no prob merging: experts applied them)."""
    return _te_permutation().moe_unpermute(
        tokens, row_id_map, restore_shape=restore_shape, pad_offsets=pad_offsets
    )


class Permuted(NamedTuple):
    """One permutation's results. ``routing_map``: the map the unpermute reads (the
    allgather dispatcher's local columns); ``tokens_per_expert``: the experts' counts where
    the step makes them (the allgather dispatcher), else None."""

    x_RH: torch.Tensor
    probs_R: torch.Tensor
    row_id_map: torch.Tensor
    pad_offsets: Optional[torch.Tensor]
    tokens_per_expert: Optional[torch.Tensor]
    routing_map: torch.Tensor


class PlainPermute:
    """megatron-core's permute and unpermute, no padding rows of their own (the router's
    padded map and capacity padding are megatron-core's options, kept as it runs them)."""

    pads = False

    def __init__(self, fused: bool, drop_and_pad: bool = False, router_align: Optional[int] = None):
        self.fused = fused
        self.drop_and_pad = drop_and_pad
        self.router_align = router_align  # the alltoall dispatcher's router padding, or None

    @classmethod
    def for_alltoall(cls, config) -> "PlainPermute":
        router_pads = config.moe_router_padding_for_quantization
        return cls(
            fused=config.moe_permute_fusion,
            drop_and_pad=config.moe_pad_expert_input_to_capacity,
            router_align=get_align_size_for_quantization(config) if router_pads else None,
        )

    def route(self, routing_map_TE: torch.Tensor) -> torch.Tensor:
        """The routing map the permutation follows (the alltoall dispatcher, before its metadata)."""
        if self.router_align is None:
            return routing_map_TE
        if is_experimental_enabled() and self.fused:
            return fused_pad_routing_map(routing_map_TE, self.router_align)
        return pad_routing_map(routing_map_TE, self.router_align)

    def align_splits(self, dispatcher, routing_map_TE, tokens_per_local_expert):
        """The alltoall dispatcher's split sizes as its exchange made them."""
        return tokens_per_local_expert

    def permute(self, x_TH, probs_TE, routing_map_TE, num_out_tokens) -> Permuted:
        """The alltoall dispatcher's permutation: rows and probs grouped by expert."""
        x_RH, probs_R, row_id_map = permute(
            x_TH, routing_map_TE, probs=probs_TE, num_out_tokens=num_out_tokens,
            fused=self.fused, drop_and_pad=self.drop_and_pad,
        )
        return Permuted(x_RH, probs_R, row_id_map, None, None, routing_map_TE)

    def permute_local(self, x_TH, probs_TE, routing_map_TE, local: slice) -> Permuted:
        """The allgather dispatcher's: the gathered rows of this rank's experts, sized by a
        host copy of their counts, the probs selected after."""
        local_map_TE = routing_map_TE[:, local].contiguous()
        local_probs_TE = probs_TE[:, local].contiguous()
        tokens_per_expert = local_map_TE.sum(dim=0).long().cpu()
        x_RH, _, row_id_map = permute(
            x_TH, local_map_TE, num_out_tokens=tokens_per_expert.sum(), fused=self.fused
        )
        probs_R = local_probs_TE.T.contiguous().masked_select(local_map_TE.T.contiguous())
        return Permuted(x_RH, probs_R, row_id_map, None, tokens_per_expert, local_map_TE)

    def unpermute(self, y_RH, row_id_map, pad_offsets, restore_shape, routing_map_TE):
        return unpermute(
            y_RH, row_id_map, restore_shape=restore_shape, routing_map=routing_map_TE,
            fused=self.fused, drop_and_pad=self.drop_and_pad,
        )


class TokenRows:
    """F12's exchange moves tokens, not rows: each owner lays out its experts' rows and the
    combine returns one row per token, so the dispatcher neither permutes nor unpermutes."""

    pads = False

    def route(self, routing_map_TE: torch.Tensor) -> torch.Tensor:
        return routing_map_TE

    def align_splits(self, dispatcher, routing_map_TE, tokens_per_local_expert):
        return tokens_per_local_expert

    def permute(self, x_TH, probs_TE, routing_map_TE, num_out_tokens) -> Permuted:
        return Permuted(x_TH, probs_TE, None, None, None, routing_map_TE)

    def unpermute(self, y_TH, row_id_map, pad_offsets, restore_shape, routing_map_TE):
        return y_TH.view(restore_shape)


class DeviceCountPermute(PlainPermute):
    """The allgather dispatcher with every expert local (one rank): the permuted row count is
    tokens x top-k, known without the GPU, so the counts stay on the device and TE's fused
    permute carries the probs (the plain one sizes by a host copy and selects the probs with
    masked_select, a sync)."""

    def __init__(self, topk: int):
        super().__init__(fused=True)
        self.topk = topk

    def permute_local(self, x_TH, probs_TE, routing_map_TE, local: slice) -> Permuted:
        # One rank: ``local`` is every expert.
        tokens_per_expert_E = routing_map_TE.sum(dim=0).long()
        permuted = self.permute(x_TH, probs_TE, routing_map_TE, routing_map_TE.shape[0] * self.topk)
        return permuted._replace(tokens_per_expert=tokens_per_expert_E)


def static_padded_rows(num_tokens: int, topk: int, num_experts: int, align: int) -> int:
    """Rows of ``StaticPaddedPermute``'s output: enough for any routing of ``num_tokens``
    tokens to ``topk`` of ``num_experts`` experts with each group padded to ``align``."""
    return num_tokens * topk + num_experts * (align - 1)


def static_padded_layout(counts_E: torch.Tensor, align: int):
    """(padded_E, pad_offsets_E) for ``counts_E`` routed rows per expert: each count rounded
    up to ``align``; pad_offsets_E[e] is how far expert e's rows move down (the padding of
    the experts before it). Device ops on E elements, no sync."""
    padded_E = align_up(counts_E.long(), align)
    pads_E = padded_E - counts_E
    return padded_E, torch.cumsum(pads_E, 0) - pads_E


class PaddedPermute:
    """F1: rows grouped by expert, each group padded to a multiple of ``align`` in the same
    pass; the unpermute drops the padding rows."""

    pads = True

    def __init__(self, align: int):
        self.align = align

    def route(self, routing_map_TE: torch.Tensor) -> torch.Tensor:
        return routing_map_TE  # the router never pads here (padding_plan)

    def align_splits(self, dispatcher, routing_map_TE, tokens_per_local_expert):
        """The alltoall dispatcher's split sizes (all-to-all splits, the receiver's chunk sort,
        the experts' counts) for padded chunks: each is the stock value with every (rank,
        expert) count rounded up, so they are derived from the stock metadata, not recomputed."""
        d, align = dispatcher, self.align
        local_counts = routing_map_TE.sum(dim=0).long()
        # [source rank, local expert] token counts as the stock preprocess derived them.
        if d.ep_size == 1:
            per_source = local_counts.view(1, -1)
        elif d.num_local_experts > 1:
            per_source = d.num_global_tokens_per_local_expert
        else:
            per_source = d.output_splits.view(-1, 1)
        padded = align_up(per_source, align)
        if d.ep_size > 1:
            d.input_splits = align_up(local_counts, align).view(d.ep_size, -1).sum(dim=1)
            d.output_splits = padded.sum(dim=1)
            d.output_splits_tp = padded.sum().view(1)
        if d.num_local_experts > 1:
            d.num_global_tokens_per_local_expert = padded
        return padded.sum(dim=0)

    def permute(self, x_TH, probs_TE, routing_map_TE, num_out_tokens=None) -> Permuted:
        """``num_out_tokens`` unused: the kernel sizes the padded groups itself."""
        x_RH, probs_R, row_id_map, pad_offsets, padded_E = permute_and_pad(x_TH, probs_TE, routing_map_TE, self.align)
        return Permuted(x_RH, probs_R, row_id_map, pad_offsets, padded_E, routing_map_TE)

    def permute_local(self, x_TH, probs_TE, routing_map_TE, local: slice) -> Permuted:
        local_map_TE = routing_map_TE[:, local].contiguous()
        permuted = self.permute(x_TH, probs_TE[:, local].contiguous(), local_map_TE)
        # The experts take host counts, as with the stock dispatcher.
        return permuted._replace(tokens_per_expert=permuted.tokens_per_expert.cpu())

    def unpermute(self, y_RH, row_id_map, pad_offsets, restore_shape, routing_map_TE):
        return unpermute_and_unpad(y_RH, row_id_map, pad_offsets, restore_shape)


class StaticPaddedPermute(PaddedPermute):
    """One rank, device counts: rows grouped by expert, each group starting on an ``align``-row
    boundary, in a buffer of static size (``static_padded_rows``); the padding rows, the rows
    past the last group and their probs are zero, and the experts get the padded counts.
    The routing is ``PaddedPermute``'s.

    With ``quantized_rows`` (blockwise FP8 experts whose first GEMM reads 1x128 FP8 rows) the
    permute also writes FC1's FP8 input, and the unpermute's backward FC2's FP8 output
    gradient, in the pass that writes the bf16 rows (``kernels.permute_quantize``): attached
    to those rows, the experts take them instead of quantizing again. Otherwise TE's kernels."""

    def __init__(self, align: int, topk: int, quantized_rows: bool = False):
        super().__init__(align)
        self.topk = topk
        self.quantized_rows = quantized_rows

    def align_splits(self, dispatcher, routing_map_TE, tokens_per_local_expert):
        """One source rank: the experts' counts are the padded groups' sizes."""
        return static_padded_layout(tokens_per_local_expert, self.align)[0]

    def permute(self, x_TH, probs_TE, routing_map_TE, num_out_tokens=None) -> Permuted:
        """``num_out_tokens`` unused: the row count is static."""
        tokens, experts = routing_map_TE.shape
        rows = static_padded_rows(tokens, self.topk, experts, self.align)
        counts_E = routing_map_TE.sum(dim=0)
        padded_E, pad_offsets_E = static_padded_layout(counts_E, self.align)
        if self.quantized_rows:
            x_RH, probs_R, row_id_map, x8_RH, scale_inv_RHt = _PermuteQuantizing.apply(
                x_TH, probs_TE, routing_map_TE, rows, self.align, counts_E, pad_offsets_E)
            attach_quantized_rows(x_RH, x8_RH, scale_inv_RHt)
        else:
            x_RH, row_id_map, probs_R = permute_into_rows(x_TH, probs_TE, routing_map_TE, rows, pad_offsets_E)
        return Permuted(x_RH, probs_R, row_id_map, pad_offsets_E, padded_E, routing_map_TE)

    def permute_local(self, x_TH, probs_TE, routing_map_TE, local: slice) -> Permuted:
        return self.permute(x_TH, probs_TE, routing_map_TE)  # one rank: ``local`` is every expert

    def unpermute(self, y_RH, row_id_map, pad_offsets, restore_shape, routing_map_TE):
        if not self.quantized_rows:
            return super().unpermute(y_RH, row_id_map, pad_offsets, restore_shape, routing_map_TE)
        return _UnpermuteQuantizingGrad.apply(y_RH, row_id_map, pad_offsets, routing_map_TE.sum(dim=0), self.align)


def _te_row_id_map(routing_map_TE):
    import transformer_engine.pytorch.triton.permutation as te_triton_permutation

    tokens, experts = routing_map_TE.shape
    return te_triton_permutation.make_row_id_map(routing_map_TE, tokens, experts)


class _PermuteQuantizing(torch.autograd.Function):
    """``StaticPaddedPermute.permute`` writing the FP8 rows too (``gather_quantized``); the
    backward is TE's permute backward (the gradients' rows summed back per token)."""

    @staticmethod
    def forward(ctx, x_TH, probs_TE, routing_map_TE, rows, align, counts_E, pad_offsets_E):
        row_id_map = _te_row_id_map(routing_map_TE)
        gathered = gather_quantized(x_TH, row_id_map, pad_offsets_E, counts_E, rows, align, probs_TE)
        ctx.save_for_backward(row_id_map, pad_offsets_E)
        ctx.sizes = (*routing_map_TE.shape, x_TH.shape[1])
        ctx.rows_shape, ctx.rows_dtype = gathered.x_RH.shape, x_TH.dtype
        ctx.mark_non_differentiable(row_id_map, gathered.x8_RH, gathered.scale_inv_RHt)
        ctx.set_materialize_grads(False)  # else autograd fills a zero gradient of the FP8 rows
        return gathered.x_RH, gathered.probs_R, row_id_map, gathered.x8_RH, gathered.scale_inv_RHt

    @staticmethod
    def backward(ctx, dx_RH, dprobs_R, *unused):
        row_id_map, pad_offsets_E = ctx.saved_tensors
        if dx_RH is None:  # the rows took no part in the loss
            dx_RH = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=row_id_map.device)
        dprobs_R = dprobs_R.contiguous() if dprobs_R is not None and ctx.needs_input_grad[1] else None
        dx_TH, dprobs_TE = torch.ops.te_moe.permute_mask_map_bwd(
            dx_RH.contiguous(), dprobs_R, row_id_map, pad_offsets_E, *ctx.sizes)
        return dx_TH, (dprobs_TE if dprobs_R is not None else None), None, None, None, None, None


class _UnpermuteQuantizingGrad(torch.autograd.Function):
    """``StaticPaddedPermute.unpermute`` (TE's unpermute: each token's rows summed, the
    padding dropped) whose backward writes the gradient's rows with their FP8 copy
    (``gather_quantized``), attached for FC2's dgrad."""

    @staticmethod
    def forward(ctx, y_RH, row_id_map, pad_offsets_E, counts_E, align):
        tokens, experts, hidden = row_id_map.shape[0], pad_offsets_E.numel(), y_RH.shape[1]
        ctx.save_for_backward(row_id_map, pad_offsets_E, counts_E)
        ctx.rows, ctx.align = y_RH.shape[0], align
        return torch.ops.te_moe.unpermute_mask_map_fwd(
            y_RH.contiguous(), row_id_map, None, tokens, experts, hidden, pad_offsets_E)

    @staticmethod
    def backward(ctx, dout_TH):
        row_id_map, pad_offsets_E, counts_E = ctx.saved_tensors
        gathered = gather_quantized(dout_TH, row_id_map, pad_offsets_E, counts_E, ctx.rows, ctx.align)
        attach_quantized_rows(gathered.x_RH, gathered.x8_RH, gathered.scale_inv_RHt)
        return gathered.x_RH, None, None, None, None
