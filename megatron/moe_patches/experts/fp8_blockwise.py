"""F10's blockwise recipe: the FP8 experts with TE's Float8BlockScaling semantics
(``--fp8-recipe blockwise``), sync-free, one grouped GEMM per FC.

Scales as TE's recipe sets them on Hopper: 1x128 for the activations and output gradients
(one per row and 128 features), 128x128 for the weights, powers of two, E4M3 throughout
(``kernels.fp8_scaling`` defines the arithmetic). Every scale covers its own block, so each
quantization is a single pass (``kernels.fp8_blockwise_quantize``): no amax pass, nothing
that waits for a whole tensor.

- fprop and dgrad: ``kernels.fp8_grouped_gemm.fp8_grouped_nt`` (Triton, device offsets, any
  rows per expert), which adds each 128-wide K block's product into the fp32 accumulator
  with its two scales; or, where DeepGEMM is installed and the dispatcher pads each expert's
  rows to 128 (the plan decides: ``FP8GroupedMMBackend.aligned_groups``), DeepGEMM's grouped
  GEMM (``kernels.deep_gemm_grouped``), the same recipe 1.6-2x faster. The backend picks
  one at construction (``grouped_nt_kernel``). With bf16 wgrad, each GEMM takes the FP8 rows
  written beside its bf16 input where that moved (``take_quantized_rows``: the dispatcher's
  permute for FC1's input and its unpermute's backward for FC2's output gradient, the
  weighted GLU for FC2's input and FC1's output gradient) instead of quantizing again.
  dgrad reads the weights' transposed copy; a 128x128 tile covers the same elements either
  way, so both copies are quantized from one read, once per optimizer step (the FC's
  ``FP8WeightCache``, refreshed as for tensorwise).
- wgrad: FP8 (``fp8_wgrad``, the default) as TE's recipe does it: the input and the output
  gradient quantized again along the tokens (1x128 per channel over 128 tokens of one
  expert, into token-major copies whose expert segments start at multiples of 128), then
  ``fp8_grouped_wgrad``. With ``--no-fp8-wgrad`` it is one bf16 ``torch._grouped_mm`` from
  the saved bf16 input.

Off CUDA the same arithmetic runs through the kernels' PyTorch twins (tests).
Needs hidden and expert FFN sizes that are multiples of 128 (whole 128x128 weight tiles).
"""

from typing import Optional

import torch

from megatron.moe_patches.experts.grouped_mm import MainGradTarget, bf16_wgrad, computed_wgrad
from megatron.moe_patches.kernels import deep_gemm_grouped
from megatron.moe_patches.kernels import fp8_grouped_gemm as gemms
from megatron.moe_patches.kernels.fp8_blockwise_quantize import (
    RowBlocks, WeightTiles, quantize_rows, quantize_rows_and_token_major, row_blocks, take_quantized_rows)


def triton_grouped_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, blocks: RowBlocks):
    """fprop/dgrad on the package's Triton kernel: any rows per expert."""
    if not a8_TK.is_cuda:
        return gemms.fp8_grouped_nt_reference(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, "blockwise")
    return gemms.fp8_grouped_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, "blockwise", tiles=blocks.tiles)


def deep_gemm_grouped_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, blocks: RowBlocks):
    """fprop/dgrad on DeepGEMM: each expert's rows start on a 128-row boundary."""
    if not a8_TK.is_cuda:  # the PyTorch twin, as for the Triton kernel
        return triton_grouped_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, blocks)
    return deep_gemm_grouped.grouped_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b)


def grouped_nt_kernel(aligned_groups: bool):
    """The fprop/dgrad GEMM for groups the dispatcher aligned to 128 rows (DeepGEMM's), or not."""
    return deep_gemm_grouped_nt if aligned_groups else triton_grouped_nt


def _grouped_wgrad(dy, x, out_dtype, accumulate_into=None):
    """dW_EOI from the token-major FP8 copies of the output gradient and the input; on CUDA
    added into ``accumulate_into`` (fp32 [E, O, I]) in place where given (and returned)."""
    if not dy.data_CP.is_cuda:  # the twin returns a new sum: the caller adds it
        return gemms.fp8_grouped_wgrad_reference(dy.data_CP, x.data_CP, x.padded_ends_E, dy.scale_inv_CPt,
                                                 x.scale_inv_CPt, "blockwise", out_dtype=out_dtype)
    return gemms.fp8_grouped_wgrad(dy.data_CP, x.data_CP, x.padded_ends_E, dy.scale_inv_CPt, x.scale_inv_CPt,
                                   "blockwise", out_dtype=out_dtype, accumulate_into=accumulate_into)


class _BlockwiseGroupedLinear(torch.autograd.Function):
    """y_TO = x_TI @ w_EOI[expert(row)]^T, blockwise FP8 for fprop and dgrad, and for wgrad
    unless ``fp8_wgrad`` is off (then bf16); ``target``: the weights' main_grad under
    gradient_accumulation_fusion (F13), which the wgrad then adds into."""

    @staticmethod
    def forward(ctx, x_TI, w_EOI, ends_E, blocks: RowBlocks, weights: WeightTiles, fp8_wgrad: bool, grouped_nt,
                target: Optional[MainGradTarget]):
        fp8_wgrad = fp8_wgrad and w_EOI.requires_grad
        # wgrad's input: the token-major FP8 copy (only FP8 is kept), or the bf16 rows
        ctx.x_saved = None
        if fp8_wgrad:
            x8_TI, sx_TIt, ctx.x_saved = quantize_rows_and_token_major(x_TI, ends_E, blocks)
        else:
            x8_TI, sx_TIt = take_quantized_rows(x_TI) or quantize_rows(x_TI)
        y_TO = grouped_nt(x8_TI, weights.w8_ENK, ends_E, sx_TIt, weights.scale_inv_ENtKt, blocks).to(x_TI.dtype)
        ctx.save_for_backward(ends_E, None if fp8_wgrad else x_TI)
        ctx.blocks, ctx.weights, ctx.fp8_wgrad, ctx.w_EOI = blocks, weights, fp8_wgrad, w_EOI
        ctx.grouped_nt, ctx.target = grouped_nt, target
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO):
        ends_E, x_TI = ctx.saved_tensors
        weights = ctx.weights
        dy_TO = dy_TO.contiguous()
        dx_TI = dw_EOI = dy_tokens = None
        if ctx.fp8_wgrad:
            dy8_TO, sdy_TOt, dy_tokens = quantize_rows_and_token_major(dy_TO, ends_E, ctx.blocks)
        elif ctx.needs_input_grad[0]:
            dy8_TO, sdy_TOt = take_quantized_rows(dy_TO) or quantize_rows(dy_TO)
        if ctx.needs_input_grad[0]:
            dx_TI = ctx.grouped_nt(dy8_TO, weights.w8_EKN, ends_E, sdy_TOt, weights.scale_inv_EKtNt,
                                   ctx.blocks).to(dy_TO.dtype)
        if ctx.fp8_wgrad:
            dw_EOI = computed_wgrad(lambda dtype, into: _grouped_wgrad(dy_tokens, ctx.x_saved, dtype, into),
                                    ctx.w_EOI, ctx.target)
        elif ctx.needs_input_grad[1]:
            dw_EOI = bf16_wgrad(x_TI, dy_TO, ends_E, ctx.w_EOI, ctx.target)
        ctx.x_saved = ctx.w_EOI = None
        return dx_TI, dw_EOI, None, None, None, None, None, None


def blockwise_linear(groups, fp8_wgrad: bool, grouped_nt=triton_grouped_nt):
    """(x_TI, w_EOI, weights) -> y_TO over ``groups``' rows; ``weights`` is the FC's cached
    ``WeightTiles``; fprop and dgrad run ``grouped_nt`` (``grouped_nt_kernel``). The row tiles
    and token-major ends are derived once per forward; ``target``: as ``_BlockwiseGroupedLinear``'s."""
    blocks = groups.derived("blockwise_row_blocks", lambda g: row_blocks(g.offsets_E, g.num_rows))
    return lambda x_TI, w_EOI, weights, target=None: _BlockwiseGroupedLinear.apply(
        x_TI, w_EOI, groups.offsets_E, blocks, weights, fp8_wgrad, grouped_nt, target)
