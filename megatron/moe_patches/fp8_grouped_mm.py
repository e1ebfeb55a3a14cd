"""F10: FP8 grouped-GEMM experts for Hopper, sync-free.

With ``moe_device_tokens_per_expert`` and ``--fp8-format e4m3|hybrid --fp8-recipe
tensorwise``, the experts run ``FP8GroupedMMBackend``: the grouped_mm backend's MLP
(``device_splits.grouped_mm_mlp``) with FC1 and FC2 as ``torch._scaled_grouped_mm`` over
all local experts, device offsets, no host sync.

Scaling, as TE's current (tensorwise) scaling does it per GEMM: one scale per expert per
operand, from that expert's amax (``scale = 448 / amax``; 1 where the amax is 0). The
GEMM takes the dequantization scales row-wise (activations: the row's expert's scale;
weights: the expert's scale per output column), so no rescaling pass is needed.

- Activations and output gradients are quantized in two Triton passes (per-expert amax
  by atomic max, then quantize + scale per row); E4M3 for both, also under ``hybrid``:
  sm90's ``_scaled_grouped_mm`` takes E4M3 operands only, and per-expert scales keep the
  gradients' range.
- Weights are quantized once per optimizer step, in both layouts the GEMMs read (forward:
  [E, out, in]; dgrad: [E, in, out], written by the same tiled pass), and cached; the cache refreshes when an optimizer
  has stepped since (a global torch optimizer step hook) or a parameter was written in
  place (its version counter), e.g. by a checkpoint load.
- fprop and dgrad run FP8 with fast accumulation; wgrad runs in bf16 (``torch._grouped_mm``
  over the saved bf16 inputs): FP8 wgrad would need column-wise copies of both operands.
- Parameters stay bf16 (the distributed optimizer sees bf16 params and fp32 main params,
  as with the grouped_mm backend); the FP8 copies are a per-step cache, not parameters.

Other recipes (delayed, MXFP8, blockwise) and ``--fp8-param-gather`` keep the TE backend,
with one log line naming why.
"""

import math
from typing import Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.device_splits import GroupedMMBackend, RowGroups

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn

# --- the weights' FP8 cache: valid until an optimizer steps or a weight is written -----------

_optimizer_steps = 0
_step_hook = None


def _count_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


def count_optimizer_steps():
    """Register (once per process) the global optimizer step hook the weight caches key on.

    Megatron's optimizers step a torch optimizer inside (its ``step`` fires the hook) and
    then copy main params into the model params through ``.data``, which the parameters'
    version counters do not see: the step count does.
    """
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)


def invalidate_weight_caches():
    """Make every FP8 weight cache refresh on its next use (what an optimizer step does)."""
    global _optimizer_steps
    _optimizer_steps += 1


class FP8WeightCache:
    """One FC's weights in FP8, in the forward and the dgrad layout, with their scales."""

    def __init__(self):
        self._key = None
        self.w8_EOI = self.w8_EIO = self.scale_inv_E = None
        self.refreshes = 0  # how often the weights were quantized (tests read it)

    def get(self, w_EOI: torch.Tensor, sources) -> "FP8WeightCache":
        """Quantize ``w_EOI`` unless the cached copy still matches ``sources`` (the
        parameters ``w_EOI`` was assembled from)."""
        key = (_optimizer_steps, tuple((p.data_ptr(), p._version) for p in sources))
        if key != self._key:
            self.w8_EOI, self.w8_EIO, self.scale_inv_E = quantize_weights(w_EOI.detach())
            self._key = key
            self.refreshes += 1
        return self


# --- per-expert quantization ------------------------------------------------------------------


def scales_from_amax(amax_E: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) per expert: x * scale fills E4M3's range; 1 where nothing was seen."""
    scale_E = torch.where(amax_E > 0, E4M3_MAX / amax_E, torch.ones_like(amax_E))
    return scale_E, torch.reciprocal(scale_E)


def _expert_amax_torch(x_RC, expert_R, num_experts):
    row_amax_R = x_RC.abs().amax(dim=1).float() if x_RC.shape[1] else x_RC.new_zeros(x_RC.shape[0], dtype=torch.float32)
    amax_E = torch.zeros(num_experts, dtype=torch.float32, device=x_RC.device)
    return amax_E.scatter_reduce_(0, expert_R.long(), row_amax_R, "amax")


def _quantize_torch(x_RC, expert_R, scale_E):
    scale_R = scale_E[expert_R.long()]
    return (x_RC.float() * scale_R[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_per_expert(x_RC: torch.Tensor, expert_R: torch.Tensor, num_experts: int):
    """E4M3 copy of ``x_RC`` with one scale per expert (rows grouped by ``expert_R``).

    Returns (q_RC, scale_inv_R, scale_inv_E): the row-wise dequantization scales the
    GEMM takes, and the per-expert ones. Triton on CUDA (two passes), PyTorch elsewhere;
    both compute x * scale in fp32 and round to nearest even once.
    """
    x_RC = x_RC.contiguous()
    if x_RC.is_cuda:
        amax_E = _expert_amax_triton(x_RC, expert_R, num_experts)
    else:
        amax_E = _expert_amax_torch(x_RC, expert_R, num_experts)
    scale_E, scale_inv_E = scales_from_amax(amax_E)
    if x_RC.is_cuda:
        q_RC = _quantize_triton(x_RC, expert_R, scale_E)
    else:
        q_RC = _quantize_torch(x_RC, expert_R, scale_E)
    return q_RC, scale_inv_E[expert_R.long()], scale_inv_E


def quantize_weights(w_EOI: torch.Tensor):
    """(w8_EOI, w8_EIO, scale_inv_E): the weights in E4M3, one scale per expert, in the
    forward layout and the dgrad layout (transposed per expert), written in one pass."""
    experts, out_features, in_features = w_EOI.shape
    w_EOI = w_EOI.contiguous()
    if not w_EOI.is_cuda:
        rows = w_EOI.view(experts * out_features, in_features)
        expert_R = torch.arange(experts, dtype=torch.int32).repeat_interleave(out_features)
        q_R, _, scale_inv_E = quantize_per_expert(rows, expert_R, experts)
        w8_EOI = q_R.view(experts, out_features, in_features)
        return w8_EOI, w8_EOI.transpose(1, 2).contiguous(), scale_inv_E
    # One reduction per expert (exact: the max of |w| needs no rounding), then one tiled pass.
    amax_E = torch.linalg.vector_norm(w_EOI, float("inf"), dim=(1, 2)).float()
    scale_E, scale_inv_E = scales_from_amax(amax_E)
    w8_EOI = torch.empty(w_EOI.shape, dtype=FP8_DTYPE, device=w_EOI.device)
    w8_EIO = torch.empty((experts, in_features, out_features), dtype=FP8_DTYPE, device=w_EOI.device)
    if w_EOI.numel():
        *_, quantize_both_layouts_kernel = _triton_kernels()
        tile = 128  # measured on H100: 128 reaches the bandwidth floor where 64 is 1.2x off
        grid = (experts, triton_cdiv(out_features, tile), triton_cdiv(in_features, tile))
        quantize_both_layouts_kernel[grid](
            w_EOI, scale_E, w8_EOI, w8_EIO, out_features, in_features, FP8_MAX=E4M3_MAX, TILE=tile, num_warps=4
        )
    return w8_EOI, w8_EIO, scale_inv_E


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


_kernels = None


def _triton_kernels():
    """The quantization kernels, compiled on first use (Triton is a GPU-side import)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def expert_amax_kernel(x_ptr, expert_ptr, amax_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row.to(tl.int64) * cols + offs, mask=offs < cols, other=0.0)
            peak = tl.maximum(peak, tl.abs(v.to(tl.float32)))
        tl.atomic_max(amax_ptr + tl.load(expert_ptr + row), tl.max(peak, axis=0))

    @triton.jit
    def quantize_kernel(x_ptr, expert_ptr, scale_ptr, q_ptr, cols, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        scale = tl.load(scale_ptr + tl.load(expert_ptr + row))
        base = row.to(tl.int64) * cols
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + base + offs, mask=offs < cols, other=0.0).to(tl.float32) * scale
            v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + base + offs, v.to(tl.float8e4nv), mask=offs < cols)

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

    _kernels = (expert_amax_kernel, quantize_kernel, quantize_both_layouts_kernel)
    return _kernels


def _block(cols: int) -> int:
    return min(4096, max(128, 1 << math.ceil(math.log2(max(cols, 1)))))


def _expert_amax_triton(x_RC, expert_R, num_experts):
    amax_E = torch.zeros(num_experts, dtype=torch.float32, device=x_RC.device)
    rows, cols = x_RC.shape
    if rows and cols:
        expert_amax_kernel, *_ = _triton_kernels()
        expert_amax_kernel[(rows,)](x_RC, expert_R, amax_E, cols, BLOCK=_block(cols), num_warps=4)
    return amax_E


def _quantize_triton(x_RC, expert_R, scale_E):
    q_RC = torch.empty(x_RC.shape, dtype=FP8_DTYPE, device=x_RC.device)
    rows, cols = x_RC.shape
    if rows and cols:
        _, quantize_kernel, _ = _triton_kernels()
        quantize_kernel[(rows,)](x_RC, expert_R, scale_E, q_RC, cols, FP8_MAX=E4M3_MAX, BLOCK=_block(cols), num_warps=4)
    return q_RC


# --- one FC as an FP8 grouped GEMM ------------------------------------------------------------


def _expand(scale_inv_E, columns):
    return scale_inv_E[:, None].expand(-1, columns).contiguous()


class _FP8GroupedLinear(torch.autograd.Function):
    """y_TO = x_TI @ w_EOI[expert(row)]^T in FP8 (fprop, dgrad); wgrad in bf16."""

    @staticmethod
    def forward(ctx, x_TI, w_EOI, offsets_E, expert_T, cache: FP8WeightCache):
        experts, out_features, in_features = w_EOI.shape
        x8_TI, x_scale_inv_T, _ = quantize_per_expert(x_TI, expert_T, experts)
        y_TO = torch._scaled_grouped_mm(
            x8_TI, cache.w8_EOI.transpose(1, 2), x_scale_inv_T, _expand(cache.scale_inv_E, out_features),
            offs=offsets_E, out_dtype=x_TI.dtype, use_fast_accum=True,
        )
        ctx.save_for_backward(x_TI, offsets_E, expert_T)
        ctx.cache, ctx.in_features = cache, in_features
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO):
        x_TI, offsets_E, expert_T = ctx.saved_tensors
        cache = ctx.cache
        dy_TO = dy_TO.contiguous()
        dx_TI = None
        if ctx.needs_input_grad[0]:
            experts = cache.w8_EIO.shape[0]
            dy8_TO, dy_scale_inv_T, _ = quantize_per_expert(dy_TO, expert_T, experts)
            dx_TI = torch._scaled_grouped_mm(
                dy8_TO, cache.w8_EIO.transpose(1, 2), dy_scale_inv_T, _expand(cache.scale_inv_E, ctx.in_features),
                offs=offsets_E, out_dtype=dy_TO.dtype, use_fast_accum=True,
            )
        dw_EOI = torch._grouped_mm(dy_TO.t(), x_TI, offs=offsets_E) if ctx.needs_input_grad[1] else None
        return dx_TI, dw_EOI, None, None, None


class FP8GroupedMMBackend(GroupedMMBackend):
    """Sync-free FP8 experts: one torch._scaled_grouped_mm per FC (tensorwise recipe, sm90)."""

    name = "fp8_grouped_mm"

    @classmethod
    def precision_blocker(cls, config) -> Optional[str]:
        if not config.fp8:
            return "it computes FP8 only (bf16 runs the grouped_mm backend)"
        if config.fp8_recipe != "tensorwise":
            return f"--fp8-recipe {config.fp8_recipe}: it implements tensorwise (current) scaling only"
        if config.fp8_param:
            return "--fp8-param-gather keeps FP8 parameters, which TE owns"
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
            return "torch's FP8 grouped GEMM runs on Hopper (sm90) only"
        if not cap.triton_available():
            return "it needs Triton"
        return None

    @classmethod
    def required_alignment(cls, config) -> Optional[int]:
        return 1  # the FP8 grouped GEMM takes any rows per expert: nobody pads

    def __init__(self, experts):
        super().__init__(experts)
        count_optimizer_steps()
        self._caches = {experts.linear_fc1: FP8WeightCache(), experts.linear_fc2: FP8WeightCache()}

    def linear(self, linear, w_EOI, groups: RowGroups):
        cache = self._caches[linear].get(w_EOI, self._weight_sources(linear))
        return lambda x_TI: _FP8GroupedLinear.apply(x_TI, w_EOI, groups.offsets_E, groups.expert_T, cache)
