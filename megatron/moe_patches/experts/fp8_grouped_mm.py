"""F10: FP8 grouped-GEMM experts for Hopper, sync-free.

With ``moe_device_tokens_per_expert`` and ``--fp8-format e4m3|hybrid --fp8-recipe
tensorwise|blockwise``, the experts run ``FP8GroupedMMBackend``: the grouped_mm backend's MLP
(``experts.grouped_mm.grouped_mm_mlp``) with FC1 and FC2 as one FP8 grouped GEMM each over
all local experts, device offsets, no host sync. The recipe is chosen when the backend is
built (``RECIPES``: the weights' quantization and the grouped linear); blockwise lives in
``experts.fp8_blockwise``, this module's text describes tensorwise, whose GEMMs are
``torch._scaled_grouped_mm``.

Scaling, as TE's current (tensorwise) scaling does it per GEMM: one scale per expert per
operand, from that expert's amax (``scale = 448 / amax``; 1 where the amax is 0 or not finite,
float32's largest value where it overflows: ``scales_from_amax``). The
GEMM takes the dequantization scales row-wise (activations: the row's expert's scale;
weights: the expert's scale per output column), so no rescaling pass is needed.

- Activations and output gradients are quantized in two Triton passes (per-expert amax
  by atomic max, then quantize + scale per row), in one where the amax is already known:
  the weighted GLU gathers it as it writes FC2's input and FC1's output gradient
  (``kernels.weighted_glu.ExpertAmax``; the amax pass remains for FC1's input and FC2's
  output gradient, which the dispatcher writes). E4M3 for both, also under ``hybrid``:
  sm90's ``_scaled_grouped_mm`` takes E4M3 operands only, and per-expert scales keep the
  gradients' range.
- Weights are quantized once per optimizer step, in both layouts the GEMMs read (forward:
  [E, out, in]; dgrad: [E, in, out], written by the same tiled pass), and cached. The cache
  refreshes where megatron-core's TE layers refresh theirs: at a step's first micro-batch
  (the FC module's ``is_first_microbatch``, which megatron-core's schedules set; a loop of
  its own calls ``model.set_is_first_microbatch()`` after each optimizer step, as for TE's
  FP8 layers), or when a parameter was written in place (its version counter, e.g. a
  checkpoint load). A refresh writes into the same tensors, so F11's graphs keep reading the
  current copies: they refresh before a replay, outside the graph (``refresh_weight_caches``).
- fprop and dgrad run FP8 with fast accumulation. wgrad runs FP8 too (``fp8_wgrad``, the
  default; ``--no-fp8-wgrad`` computes it in bf16 from the saved bf16 input, which measured
  faster on the fine-grained shapes: benchmarks/README.md), as TE's recipe does,
  accumulating in full precision (its K is the expert's token count): the quantization
  passes of the input and of the output gradient also write transposed copies whose expert
  segments start at multiples of 16 columns (the GEMM's K offsets must be 16-byte aligned;
  the few pad columns are zero), and one 2D x 2D ``torch._scaled_grouped_mm`` gives the
  [E, out, in] gradient. Only the FP8 copies of the input are kept for the backward.
- Parameters stay bf16 (the distributed optimizer sees bf16 params and fp32 main params,
  as with the grouped_mm backend); the FP8 copies are a per-step cache, not parameters.
  Under gradient_accumulation_fusion (F13) the weight gradients go into DDP's fp32 main_grad
  (``grouped_mm.bf16_wgrad`` / ``computed_wgrad``), as the bf16 experts' do.

Other recipes (delayed, MXFP8) and ``--fp8-param-gather`` keep the TE backend, with one log
line naming why.
"""

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts import fp8_blockwise
from megatron.moe_patches.experts.backend import FP8
from megatron.moe_patches.experts.grouped_mm import (
    GroupedMMBackend, MainGradTarget, RowGroups, bf16_wgrad, computed_wgrad, grouped_param, weight_params)
from megatron.moe_patches.kernels import deep_gemm_grouped
from megatron.moe_patches.kernels.expert_amax import expert_amax_reference, triton_expert_max
from megatron.moe_patches.kernels.fp8_blockwise_quantize import quantize_weight_tiles, written_into
from megatron.moe_patches.kernels.weighted_glu import ExpertAmax

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn

# --- the weights' FP8 cache: valid until the next step's first micro-batch or a weight write ---


class TensorwiseWeights(NamedTuple):
    """One FC's weights in E4M3 with one scale per expert, in the fprop and the dgrad layout."""

    w8_EOI: torch.Tensor
    w8_EIO: torch.Tensor
    scale_inv_E: torch.Tensor


class FP8WeightCache:
    """One FC's weights in FP8 as its recipe's GEMMs read them (``weights``: the result of
    ``quantize(w_EOI, into)``, e.g. ``TensorwiseWeights``).

    Refreshed as megatron-core's TE linear layers refresh theirs: at the first micro-batch of a
    step (megatron-core's schedules set the FC module's ``is_first_microbatch`` through
    ``MegatronModule.set_is_first_microbatch``: the optimizer has stepped since) and when a
    weight was written in place through the parameter (its version counter, e.g. a checkpoint
    load); at every forward under megatron-core's disable_parameter_transpose_cache config
    field. Megatron's optimizers write the parameters where no version counter sees it (the
    Float16 optimizer through ``.data``, the distributed optimizer into DDP's buffer), so the
    counter alone would keep the first step's copies. A refresh writes into the same tensors: a CUDA graph that captured GEMMs
    reading them (F11) reads the current copies after each refresh, which runs outside it."""

    def __init__(self, quantize=None):
        self._quantize = quantize or quantize_weights
        self._key = None
        self.weights = None

    @staticmethod
    def _key_of(linear):
        return tuple((p.data_ptr(), p._version) for p in weight_params(linear))

    def stale(self, linear) -> bool:
        """Whether ``linear``'s weights may have changed since the last quantization."""
        return (linear.is_first_microbatch or getattr(linear, "disable_parameter_transpose_cache", False)
                or self._key_of(linear) != self._key)

    def get(self, linear, w_EOI: torch.Tensor) -> "FP8WeightCache":
        """Quantize ``w_EOI`` (``linear``'s weights as one tensor) unless the copies are current;
        the step's first micro-batch is then taken."""
        if self.stale(linear):
            self.weights = self._quantize(w_EOI.detach(), self.weights)
            self._key = self._key_of(linear)
        linear.is_first_microbatch = False
        return self


# --- per-expert quantization ------------------------------------------------------------------


def scales_from_amax(amax_E: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) per expert: x * scale fills E4M3's range. As TE's current scaling:
    1 where the amax is 0, inf or NaN (nothing sensible to fit), and float32's largest value
    where 448 / amax overflows (amax below about 1.3e-36, e.g. an expert's tiny gradients): an
    infinite scale would turn the expert's zeros into NaN (0 x inf) and its values into 0."""
    fits = (amax_E > 0) & torch.isfinite(amax_E)
    scale_E = torch.where(fits, E4M3_MAX / amax_E, torch.ones_like(amax_E))
    scale_E = scale_E.clamp(max=torch.finfo(torch.float32).max)
    return scale_E, torch.reciprocal(scale_E)


def _quantize_torch(x_RC, expert_R, scale_E):
    scale_R = scale_E[expert_R.long()]
    return (x_RC.float() * scale_R[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_per_expert(x_RC: torch.Tensor, expert_R: torch.Tensor, num_experts: int,
                        columns: Optional["PaddedColumns"] = None, amax_E: Optional[torch.Tensor] = None):
    """E4M3 copy of ``x_RC`` with one scale per expert (rows grouped by ``expert_R``).

    Returns (q_RC, scale_inv_R, scale_inv_E, qt_CP): the row-wise dequantization scales the
    GEMM takes, the per-expert ones, and with ``columns`` the same values transposed, each
    expert's rows at its padded columns (else None). Triton on CUDA (two passes, one where
    ``amax_E``, the experts' amaxes of ``x_RC``, was gathered by the kernel that wrote it),
    PyTorch elsewhere; both compute x * scale in fp32 and round to nearest even once.
    """
    x_RC = x_RC.contiguous()
    if amax_E is None and x_RC.is_cuda:
        amax_E = _expert_amax_triton(x_RC, expert_R, num_experts)
    elif amax_E is None:
        amax_E = expert_amax_reference(x_RC, expert_R, num_experts)
    scale_E, scale_inv_E = scales_from_amax(amax_E)
    if x_RC.is_cuda:
        q_RC, qt_CP = _quantize_triton(x_RC, expert_R, scale_E, columns)
    else:
        q_RC = _quantize_torch(x_RC, expert_R, scale_E)
        qt_CP = None if columns is None else columns.transposed(q_RC, expert_R)
    return q_RC, scale_inv_E[expert_R.long()], scale_inv_E, qt_CP


class PaddedColumns:
    """Where grouped rows land in a transposed FP8 copy for wgrad (K = rows): each expert's
    segment starts at a multiple of ALIGN columns, its pad columns are zero. Static width
    (rows + experts * ALIGN, rounded up to ALIGN): no size depends on the routing, so CUDA
    graphs can hold it."""

    ALIGN = 16

    def __init__(self, offsets_E: torch.Tensor, num_rows: int):
        experts = offsets_E.numel()
        counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
        padded_E = (counts_E + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        self.offsets_E = torch.cumsum(padded_E, 0, dtype=torch.int32)  # the wgrad GEMM's K offsets
        starts_E = self.offsets_E - padded_E
        self.shift_E = (starts_E - (offsets_E - counts_E)).to(torch.int32)  # row r of e -> column r + shift
        # >= every padded end, with a spare column; a multiple of ALIGN (the GEMM's row stride)
        self.width = (num_rows + experts * self.ALIGN + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        # The columns between an expert's last row and its padded end, ALIGN - 1 at most per
        # expert; the slots an expert does not need point at the spare last column.
        pad_EA = starts_E[:, None] + counts_E[:, None] + torch.arange(self.ALIGN - 1, device=offsets_E.device)
        self.pad_columns = torch.where(pad_EA < self.offsets_E[:, None], pad_EA, self.width - 1).reshape(-1)

    def empty(self, channels: int, device) -> torch.Tensor:
        """A [channels, width] FP8 buffer whose pad columns are already zero."""
        qt_CP = torch.empty((channels, self.width), dtype=FP8_DTYPE, device=device)
        qt_CP.view(torch.uint8).index_fill_(1, self.pad_columns.long(), 0)
        return qt_CP

    def transposed(self, q_RC: torch.Tensor, expert_R: torch.Tensor) -> torch.Tensor:
        """The PyTorch way (CPU): q_RC's rows as the columns they land in."""
        qt_CP = self.empty(q_RC.shape[1], q_RC.device)
        rows = torch.arange(q_RC.shape[0], device=q_RC.device)
        qt_CP.view(torch.uint8)[:, rows + self.shift_E[expert_R.long()]] = q_RC.view(torch.uint8).t()
        return qt_CP


def quantize_weights(w_EOI: torch.Tensor, into: Optional[TensorwiseWeights] = None) -> TensorwiseWeights:
    """The weights in E4M3, one scale per expert, in the forward layout and the dgrad layout
    (transposed per expert), written in one pass; into the tensors ``into`` (an earlier result
    of the same shapes) when given."""
    experts, out_features, in_features = w_EOI.shape
    w_EOI = w_EOI.contiguous()
    if not w_EOI.is_cuda:
        rows = w_EOI.view(experts * out_features, in_features)
        expert_R = torch.arange(experts, dtype=torch.int32).repeat_interleave(out_features)
        q_R, _, scale_inv_E, _ = quantize_per_expert(rows, expert_R, experts)
        w8_EOI = q_R.view(experts, out_features, in_features)
        return written_into(into, TensorwiseWeights(w8_EOI, w8_EOI.transpose(1, 2).contiguous(), scale_inv_E))
    # One reduction per expert (exact: the max of |w| needs no rounding), then one tiled pass.
    amax_E = torch.linalg.vector_norm(w_EOI, float("inf"), dim=(1, 2)).float()
    scale_E, scale_inv_E = scales_from_amax(amax_E)
    if into is None:
        w8_EOI = torch.empty(w_EOI.shape, dtype=FP8_DTYPE, device=w_EOI.device)
        w8_EIO = torch.empty((experts, in_features, out_features), dtype=FP8_DTYPE, device=w_EOI.device)
    else:
        w8_EOI, w8_EIO, scale_inv_E = into[0], into[1], into[2].copy_(scale_inv_E)
    if w_EOI.numel():
        *_, quantize_both_layouts_kernel = _triton_kernels()
        tile = 128  # measured on H100: 128 reaches the bandwidth floor where 64 is 1.2x off
        grid = (experts, triton_cdiv(out_features, tile), triton_cdiv(in_features, tile))
        quantize_both_layouts_kernel[grid](
            w_EOI, scale_E, w8_EOI, w8_EIO, out_features, in_features, FP8_MAX=E4M3_MAX, TILE=tile, num_warps=4
        )
    return TensorwiseWeights(w8_EOI, w8_EIO, scale_inv_E)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _triton_kernels():
    """The quantization kernels, compiled on first use (Triton is a GPU-side import)."""
    import triton
    import triton.language as tl

    expert_max = triton_expert_max()

    @triton.jit
    def expert_amax_kernel(x_ptr, expert_ptr, amax_ptr, rows, cols, BR: tl.constexpr, BC: tl.constexpr):
        # BR rows per program (one row per program left the H100 at 62 % of its bandwidth)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        row_in = r < rows
        peak = tl.zeros([BR], dtype=tl.float32)
        for start in range(0, cols, BC):
            c = start + tl.arange(0, BC)
            v = tl.load(x_ptr + r.to(tl.int64)[:, None] * cols + c[None, :],
                        mask=row_in[:, None] & (c[None, :] < cols), other=0.0)
            peak = tl.maximum(peak, tl.max(tl.abs(v.to(tl.float32)), axis=1))
        expert_max(amax_ptr, tl.load(expert_ptr + r, mask=row_in, other=-1), peak, row_in)

    @triton.jit
    def quantize_kernel(x_ptr, expert_ptr, scale_ptr, shift_ptr, q_ptr, qt_ptr, rows, cols, width,
                        FP8_MAX: tl.constexpr, TRANSPOSED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # A [BR, BC] tile: each row scaled by its expert's scale; with TRANSPOSED also stored as
        # columns of qt (row r of expert e at column r + shift[e]) from the same read.
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        row_in = r < rows
        inside = row_in[:, None] & (c[None, :] < cols)
        expert = tl.load(expert_ptr + r, mask=row_in, other=0)
        scale = tl.load(scale_ptr + expert, mask=row_in, other=1.0)
        at = r[:, None].to(tl.int64) * cols + c[None, :]
        v = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32) * scale[:, None]
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
        tl.store(q_ptr + at, v, mask=inside)
        if TRANSPOSED:
            column = r + tl.load(shift_ptr + expert, mask=row_in, other=0)
            tl.store(qt_ptr + c[None, :].to(tl.int64) * width + column[:, None], v, mask=inside)

    @triton.jit
    def quantize_both_layouts_kernel(w_ptr, scale_ptr, q_ptr, qt_ptr, rows, cols, FP8_MAX: tl.constexpr,
                                     TILE: tl.constexpr):
        # One [TILE, TILE] tile of one expert's [rows, cols] matrix, stored as is and transposed:
        # the transposed copy costs no extra read of the weights.
        expert = tl.program_id(0)
        r = tl.program_id(1) * TILE + tl.arange(0, TILE)
        c = tl.program_id(2) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        base = expert.to(tl.int64) * rows * cols
        v = tl.load(w_ptr + base + r[:, None] * cols + c[None, :], mask=inside, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(v * tl.load(scale_ptr + expert), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
        tl.store(q_ptr + base + r[:, None] * cols + c[None, :], v, mask=inside)
        tl.store(qt_ptr + base + c[None, :] * rows + r[:, None], v, mask=inside)

    return expert_amax_kernel, quantize_kernel, quantize_both_layouts_kernel


def _expert_amax_triton(x_RC, expert_R, num_experts):
    amax_E = torch.zeros(num_experts, dtype=torch.float32, device=x_RC.device)
    rows, cols = x_RC.shape
    if rows and cols:
        expert_amax_kernel, *_ = _triton_kernels()
        amax_rows = 32  # with one atomic per block: 2.9 TB/s on an H100 (16 rows, one atomic per row: 2.1)
        expert_amax_kernel[(triton_cdiv(rows, amax_rows),)](
            x_RC, expert_R, amax_E, rows, cols, BR=amax_rows, BC=512, num_warps=4)
    return amax_E


def _quantize_triton(x_RC, expert_R, scale_E, columns: Optional[PaddedColumns]):
    rows, cols = x_RC.shape
    q_RC = torch.empty(x_RC.shape, dtype=FP8_DTYPE, device=x_RC.device)
    qt_CP = None if columns is None else columns.empty(cols, x_RC.device)
    if rows and cols:
        _, quantize_kernel, _ = _triton_kernels()
        # Square tiles where columns are stored too (both stores then use the tile; 128x128 at
        # 8 warps measured 1.2-1.3x faster than 64x64 at 4 on an H100), else wide rows:
        # 512-byte row segments per load.
        br, bc, warps = (128, 128, 8) if qt_CP is not None else (16, 256, 4)
        # Without columns the TRANSPOSED branch is compiled out: any tensor stands in for its pointers.
        shift_E, width = (columns.shift_E, columns.width) if columns is not None else (expert_R, 0)
        quantize_kernel[(triton_cdiv(rows, br), triton_cdiv(cols, bc))](
            x_RC, expert_R, scale_E, shift_E, q_RC, q_RC if qt_CP is None else qt_CP, rows, cols, width,
            FP8_MAX=E4M3_MAX, TRANSPOSED=qt_CP is not None, BR=br, BC=bc, num_warps=warps)
    return q_RC, qt_CP


# --- one FC as an FP8 grouped GEMM ------------------------------------------------------------


def _expand(scale_inv_E, columns):
    return scale_inv_E[:, None].expand(-1, columns).contiguous()


class _FP8GroupedLinear(torch.autograd.Function):
    """y_TO = x_TI @ w_EOI[expert(row)]^T with fprop and dgrad in FP8; wgrad in FP8 where
    ``columns`` (the transposed copies' layout) is given, else in bf16."""

    @staticmethod
    def forward(ctx, x_TI, w_EOI, offsets_E, expert_T, weights: TensorwiseWeights, columns: Optional[PaddedColumns],
                x_amax_E: Optional[torch.Tensor], dy_amax_E: Optional[torch.Tensor], target: Optional[MainGradTarget]):
        experts, out_features, in_features = w_EOI.shape
        fp8_wgrad = columns is not None and w_EOI.requires_grad
        x8_TI, x_scale_inv_T, x_scale_inv_E, x8_IP = quantize_per_expert(
            x_TI, expert_T, experts, columns if fp8_wgrad else None, x_amax_E)
        y_TO = torch._scaled_grouped_mm(
            x8_TI, weights.w8_EOI.transpose(1, 2), x_scale_inv_T, _expand(weights.scale_inv_E, out_features),
            offs=offsets_E, out_dtype=x_TI.dtype, use_fast_accum=True,
        )
        # wgrad's input: the FP8 transposed copy, or the bf16 rows
        ctx.save_for_backward(x8_IP if fp8_wgrad else x_TI, x_scale_inv_E, offsets_E, expert_T)
        ctx.weights, ctx.columns, ctx.fp8_wgrad, ctx.w_EOI, ctx.target = weights, columns, fp8_wgrad, w_EOI, target
        ctx.dy_amax_E = dy_amax_E  # written by the kernel that computes dy (the GLU's backward), before this backward
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO):
        x_saved, x_scale_inv_E, offsets_E, expert_T = ctx.saved_tensors
        weights, columns = ctx.weights, ctx.columns
        experts, in_features, out_features = weights.w8_EIO.shape
        fp8_wgrad = ctx.fp8_wgrad
        dy_TO = dy_TO.contiguous()
        if ctx.needs_input_grad[0] or fp8_wgrad:  # else only the bf16 wgrad reads dy
            dy8_TO, dy_scale_inv_T, dy_scale_inv_E, dy8_OP = quantize_per_expert(
                dy_TO, expert_T, experts, columns if fp8_wgrad else None, ctx.dy_amax_E)
        dx_TI = dw_EOI = None
        if ctx.needs_input_grad[0]:
            dx_TI = torch._scaled_grouped_mm(
                dy8_TO, weights.w8_EIO.transpose(1, 2), dy_scale_inv_T, _expand(weights.scale_inv_E, in_features),
                offs=offsets_E, out_dtype=dy_TO.dtype, use_fast_accum=True,
            )
        w_EOI, ctx.w_EOI = ctx.w_EOI, None
        if fp8_wgrad:
            # K = the expert's tokens, up to thousands: accumulate in full precision, as TE does.
            # torch's FP8 grouped GEMM writes bf16 only: under F13 its result is added to main_grad.
            dw_EOI = computed_wgrad(lambda dtype, into: torch._scaled_grouped_mm(
                dy8_OP, x_saved.t(), _expand(dy_scale_inv_E, out_features).view(-1),
                _expand(x_scale_inv_E, in_features).view(-1), offs=columns.offsets_E, out_dtype=w_EOI.dtype,
                use_fast_accum=False,
            ), w_EOI, ctx.target)
        elif ctx.needs_input_grad[1]:
            dw_EOI = bf16_wgrad(x_saved, dy_TO, offsets_E, w_EOI, ctx.target)
        return dx_TI, dw_EOI, None, None, None, None, None, None, None


def tensorwise_linear(groups: RowGroups, fp8_wgrad: bool):
    """(x_TI, w_EOI, weights, x_amax_E=None, dy_amax_E=None) -> y_TO over ``groups``' rows;
    ``weights`` is the FC's cached ``TensorwiseWeights``; the amaxes, where given, are the
    experts' amaxes of the input and of the output gradient, gathered by the kernels that
    wrote them (``ExpertAmax``)."""
    columns = None
    if fp8_wgrad:
        columns = groups.derived("fp8_wgrad_columns", lambda g: PaddedColumns(g.offsets_E, g.num_rows))
    return lambda x_TI, w_EOI, weights, x_amax_E=None, dy_amax_E=None, target=None: _FP8GroupedLinear.apply(
        x_TI, w_EOI, groups.offsets_E, groups.expert_T, weights, columns, x_amax_E, dy_amax_E, target)


class FP8Recipe(NamedTuple):
    """What one FP8 recipe of the fast path computes with: how an FC's weights are quantized
    once per step (``quantize(w_EOI, into)``), its grouped linear (``linear(groups,
    fp8_wgrad[, grouped_nt])`` -> (x_TI, w_EOI, weights) -> y_TO), whether that linear scales
    per expert from amaxes the weighted GLU gathers (``glu_amax``: the linear then takes
    ``x_amax_E`` and ``dy_amax_E``), and, for a linear that takes its fprop/dgrad GEMM, the
    GEMM for groups the dispatcher aligned or not (``grouped_nt(aligned_groups)``)."""

    quantize: Callable
    linear: Callable
    glu_amax: bool
    grouped_nt: Optional[Callable] = None


RECIPES = {
    "tensorwise": FP8Recipe(quantize_weights, tensorwise_linear, glu_amax=True),
    # 1x128 scales need no amax beforehand: each block is scaled where it is quantized
    "blockwise": FP8Recipe(quantize_weight_tiles, fp8_blockwise.blockwise_linear, glu_amax=False,
                           grouped_nt=fp8_blockwise.grouped_nt_kernel),
}
DEEP_GEMM_KERNELS = "DeepGEMM's blockwise FP8 grouped GEMMs for fprop and dgrad"
BLOCKWISE_SIZES = ("hidden_size", "moe_ffn_hidden_size")  # each FC's in and out features


class FP8GroupedMMBackend(GroupedMMBackend):
    """Sync-free FP8 experts, one grouped GEMM per FC on Hopper: tensorwise through
    torch._scaled_grouped_mm, blockwise through the Triton kernels (``fp8_blockwise``), its
    fprop and dgrad on DeepGEMM where installed (the dispatcher then pads each expert's rows
    to 128: ``aligned_groups``)."""

    name = "fp8_grouped_mm"
    precisions = (FP8,)
    precision_note = "bf16 runs the grouped_mm backend"
    fp8_recipes = tuple(RECIPES)
    alignment = 1  # the FP8 grouped GEMMs take any rows per expert: nobody pads

    @classmethod
    def reads_rows_past_groups(cls, config) -> bool:
        return True  # the quantization passes and their amaxes run over every row

    @classmethod
    def unavailable(cls, config) -> Optional[str]:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
            return "its FP8 grouped GEMMs run on Hopper (sm90) only"
        if not cap.triton_available():
            return "it needs Triton"
        if config.fp8_recipe == "blockwise":
            for field in BLOCKWISE_SIZES:
                size = getattr(config, field)
                if size is not None and size % 128:
                    return (f"--fp8-recipe blockwise needs --{field.replace('_', '-')} ({size}) to be a multiple "
                            f"of 128 (whole 128x128 weight tiles)")
        return super().unavailable(config)

    @classmethod
    def aligned_groups(cls, config):
        """Blockwise runs fprop and dgrad on DeepGEMM where it is installed: it needs each
        expert's rows to start on a 128-row boundary."""
        recipe = RECIPES.get(config.fp8_recipe)
        if recipe is None or recipe.grouped_nt is None or not cap.deep_gemm_grouped_fp8():
            return None, None
        return deep_gemm_grouped.GROUP_ALIGN, DEEP_GEMM_KERNELS

    @classmethod
    def quantized_rows(cls, config) -> bool:
        """Blockwise with bf16 wgrad reads FC1's input and FC2's output gradient as 1x128 rows
        only (FP8 wgrad quantizes them along the tokens too, in its own pass)."""
        return config.fp8_recipe == "blockwise" and not config.fp8_wgrad

    def __init__(self, experts):
        super().__init__(experts)
        recipe = experts.config.fp8_recipe
        if recipe not in RECIPES:
            raise ValueError(f"the {self.name} backend implements --fp8-recipe {' or '.join(RECIPES)}, not {recipe}")
        self._recipe = RECIPES[recipe]
        self._caches = {linear: FP8WeightCache(self._recipe.quantize)
                        for linear in (experts.linear_fc1, experts.linear_fc2)}
        self._fp8_wgrad = experts.config.fp8_wgrad  # --no-fp8-wgrad: weight gradients in bf16
        # blockwise with bf16 wgrad: the GLU writes FC2's FP8 input and FC1's FP8 output gradient
        self.glu_quantized_rows = self.quantized_rows(experts.config)
        # the fprop/dgrad GEMM, for the groups the plan had the dispatcher align or not
        grouped_nt = self._recipe.grouped_nt
        self._kernels = () if grouped_nt is None else (grouped_nt(experts.padding_plan.static_rows),)

    def refresh_weight_caches(self):
        """Quantize the weights of each FC whose cache is stale (a step's first micro-batch);
        a no-op otherwise. F11 calls it before replaying a graph, outside it."""
        for linear, cache in self._caches.items():
            if cache.stale(linear):
                with torch.no_grad():
                    cache.get(linear, grouped_param(linear))

    def glu_amax(self, groups: RowGroups) -> Optional[ExpertAmax]:
        """Where this forward's weighted GLU writes the amaxes FC2's input and FC1's output
        gradient are scaled by (tensorwise); None for blockwise."""
        if not self._recipe.glu_amax:
            return None
        return groups.derived("glu_amax", lambda g: ExpertAmax.zeros(g.expert_T, g.offsets_E.numel()))

    def gemm(self, groups: RowGroups):
        linear_step = self._recipe.linear(groups, self._fp8_wgrad, *self._kernels)
        amax = self.glu_amax(groups)
        fc1, fc2 = self._caches
        # FC2 reads the GLU's output; FC1's output gradient is the GLU's input gradient
        gathered = {} if amax is None else {fc1: {"dy_amax_E": amax.input_grad_E}, fc2: {"x_amax_E": amax.output_E}}

        targets = self.main_grad_targets or {}  # F13: the weight gradients go into main_grad

        def fp8_gemm(linear, x_TI, w_EOI):
            return linear_step(x_TI, w_EOI, self._caches[linear].get(linear, w_EOI).weights,
                               target=targets.get(linear), **gathered.get(linear, {}))

        return fp8_gemm
