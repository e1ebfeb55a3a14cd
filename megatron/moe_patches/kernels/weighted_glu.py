"""The prob-weighted gated activation of the sync-free experts, one Triton pass each way.

The grouped experts (``experts.grouped_mm.grouped_mm_mlp``) compute ``a = act(h1) * (h2 + offset)
* prob`` between FC1 and FC2, with ``act(x) = x * sigmoid(alpha * x)``: SwiGLU (alpha 1) or
quick-GEGLU (alpha 1.702, optional offset and clamp). megatron-core's fused versions of
these (``weighted_bias_swiglu_impl``, ``weighted_bias_quick_geglu_impl``) run as three
compiled kernels; the backward one, which writes the two input-gradient halves through a
concatenation, ran 3.7x off the memory floor on an H100 (2.47 ms for 262,144 rows of the
Qwen3-like shape, the floor being 0.67 ms). Here the forward is one pass (read h, write a)
and the backward one pass (read h and the output gradient, write both halves of the input
gradient and each row's prob gradient), all arithmetic in fp32, each output rounded once.

Each row's prob gradient is summed inside one program (no atomics): the result does not
depend on scheduling, so CUDA-graph replay and deterministic mode see the same bits.

With an ``ExpertAmax`` (F10's tensorwise FP8 experts), the forward also takes each expert's
amax of the activation it writes, and the backward that of the input gradient it writes:
the FP8 GEMMs that read them next need no amax pass of their own (the max is exact, so the
scales are bitwise those of a separate pass).

With ``quantized_rows`` (F10's blockwise experts with bf16 wgrad), the forward also writes
the activation's 1x128 FP8 copy (FC2's input) and the backward the input gradient's (FC1's
dgrad input), quantized from the bf16 values they store, as ``quantize_rows`` would: both
are attached to the bf16 tensors (``attach_quantized_rows``) for the GEMM that reads them.

``rows_used`` (a 1-element device tensor): rows from it on are outside every expert group
(F12's received tensors have a static bound, the grouped GEMMs leave those rows unwritten);
both passes treat their inputs as zero there, so they come out zero, gradients included.
Off CUDA or without Triton, megatron-core's own functions compute it.
"""

import functools
from typing import NamedTuple, Optional

import torch

from megatron.moe_patches.fields import glu_activation
from megatron.moe_patches.kernels.expert_amax import expert_amax_reference, triton_expert_max
from megatron.moe_patches.kernels.fp8_blockwise_quantize import attach_quantized_rows, empty_rows, jit_helpers

QUICK_GELU_ALPHA = 1.702  # quick_gelu(x) = x * sigmoid(1.702 x), as megatron-core defines it


class GLUSpec(NamedTuple):
    """act(x1) * (x2 + linear_offset), act(x) = x * sigmoid(alpha x); clamp: x1 <= clamp and
    |x2| <= clamp first (quick-GEGLU's ``activation_func_clamp_value``), None for none."""

    name: str
    alpha: float
    linear_offset: float
    clamp: Optional[float]


def glu_spec(config) -> GLUSpec:
    """The gated activation ``config`` asks the experts for (SwiGLU or quick-GEGLU)."""
    name = glu_activation(config)
    if name == "swiglu":
        return GLUSpec(name, 1.0, 0.0, None)
    if name == "quick_geglu":
        clamp = config.activation_func_clamp_value
        return GLUSpec(name, QUICK_GELU_ALPHA, float(config.glu_linear_offset), None if clamp is None else float(clamp))
    raise ValueError(f"no prob-weighted gated activation for activation_func={config.activation_func}")


class ExpertAmax(NamedTuple):
    """Per-expert amaxes the weighted GLU takes of what it writes (rows grouped by expert)."""

    expert_T: torch.Tensor  # int32 [rows]: each row's expert
    output_E: torch.Tensor  # float32 [E]: of the activation, written by the forward
    input_grad_E: torch.Tensor  # float32 [E]: of the input gradient, written by the backward

    @classmethod
    def zeros(cls, expert_T: torch.Tensor, num_experts: int) -> "ExpertAmax":
        def zeros_E():
            return torch.zeros(num_experts, dtype=torch.float32, device=expert_T.device)

        return cls(expert_T.to(torch.int32), zeros_E(), zeros_E())


def weighted_glu(h_TF2: torch.Tensor, probs_T: torch.Tensor, spec: GLUSpec,
                 rows_used: Optional[torch.Tensor] = None, amax: Optional[ExpertAmax] = None,
                 quantized_rows: bool = False, *, triton: bool) -> torch.Tensor:
    """[rows, 2F] FC1 output and [rows] router probs -> [rows, F] weighted activation; with
    ``amax``, its per-expert amaxes are written too (the input gradient's in the backward);
    with ``quantized_rows`` its 1x128 FP8 copy (the input gradient's in the backward), where
    the Triton kernels run. ``triton``: whether they may (the plan's ``triton_kernels``, which the
    expert backends read at construction); off CUDA the PyTorch path runs anyway."""
    if h_TF2.is_cuda and triton:
        return _WeightedGLU.apply(h_TF2, probs_T, spec, rows_used, amax, quantized_rows)
    if rows_used is not None:
        inside_T = torch.arange(h_TF2.shape[0], device=h_TF2.device) < rows_used
        h_TF2 = torch.where(inside_T[:, None], h_TF2, 0)
        probs_T = torch.where(inside_T, probs_T, 0)
    if amax is None:
        return megatron_weighted_glu(h_TF2, probs_T, spec)
    num_experts = amax.output_E.numel()
    a_TF = megatron_weighted_glu(_GradAmax.apply(h_TF2, amax), probs_T, spec)
    amax.output_E.copy_(expert_amax_reference(a_TF.detach(), amax.expert_T, num_experts))
    return a_TF


class _GradAmax(torch.autograd.Function):
    """Identity whose backward writes the gradient's per-expert amax (the PyTorch path)."""

    @staticmethod
    def forward(ctx, h_TF2, amax: ExpertAmax):
        ctx.amax = amax
        return h_TF2.view_as(h_TF2)

    @staticmethod
    def backward(ctx, dh_TF2):
        amax = ctx.amax
        amax.input_grad_E.copy_(expert_amax_reference(dh_TF2, amax.expert_T, amax.input_grad_E.numel()))
        return dh_TF2, None


def megatron_weighted_glu(h_TF2: torch.Tensor, probs_T: torch.Tensor, spec: GLUSpec) -> torch.Tensor:
    """megatron-core's fused functions for the same activation (CPU, and the GPU tests' peer)."""
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    if spec.name == "swiglu":
        return weighted_bias_swiglu_impl(h_TF2, None, probs_T.unsqueeze(-1))
    return weighted_bias_quick_geglu_impl(h_TF2, None, probs_T.unsqueeze(-1), False, spec.linear_offset, spec.clamp)


class _WeightedGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TF2, probs_T, spec: GLUSpec, rows_used, amax: Optional[ExpertAmax], quantized_rows: bool):
        h_TF2 = h_TF2.contiguous()
        probs_T = probs_T.contiguous()
        rows, features = h_TF2.shape[0], h_TF2.shape[1] // 2
        a_TF = torch.empty((rows, features), dtype=h_TF2.dtype, device=h_TF2.device)
        a8 = _FP8Rows.empty(a_TF) if quantized_rows else None
        if rows and features:
            forward_kernel, _ = _triton_kernels()
            block_rows, block_features = _blocks(features)
            grid = (-(-rows // block_rows), -(-features // block_features))
            forward_kernel[grid](h_TF2, probs_T, a_TF, *_row_limits(rows, rows_used), features, *_constants(spec),
                                 *_amax_arguments(amax, "output_E"), *_FP8Rows.arguments(a8, a_TF),
                                 BLOCK_R=block_rows, BLOCK_F=block_features, num_warps=4)
        if a8 is not None:
            attach_quantized_rows(a_TF, *a8)
        ctx.save_for_backward(h_TF2, probs_T)
        ctx.spec, ctx.rows_used, ctx.amax, ctx.quantized_rows = spec, rows_used, amax, quantized_rows
        return a_TF

    @staticmethod
    def backward(ctx, da_TF):
        h_TF2, probs_T = ctx.saved_tensors
        da_TF = da_TF.contiguous()
        rows, features = da_TF.shape
        dh_TF2 = torch.empty_like(h_TF2)
        dprobs_T = torch.empty_like(probs_T)
        dh8 = _FP8Rows.empty(dh_TF2) if ctx.quantized_rows else None
        if rows and features:
            _, backward_kernel = _triton_kernels()
            block_rows, block_features = _blocks(features)
            backward_kernel[(-(-rows // block_rows),)](
                da_TF, h_TF2, probs_T, dh_TF2, dprobs_T, *_row_limits(rows, ctx.rows_used), features,
                *_constants(ctx.spec), *_amax_arguments(ctx.amax, "input_grad_E"), *_FP8Rows.arguments(dh8, dh_TF2),
                BLOCK_R=block_rows, BLOCK_F=block_features, num_warps=4)
        elif rows:
            dprobs_T.zero_()
        if dh8 is not None:
            attach_quantized_rows(dh_TF2, *dh8)
        return dh_TF2, dprobs_T, None, None, None, None


class _FP8Rows(NamedTuple):
    """A 1x128 FP8 copy the kernels write beside a bf16 output (``quantize_rows``' layout)."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    @classmethod
    def empty(cls, like: torch.Tensor) -> "_FP8Rows":
        return cls(*empty_rows(*like.shape, like.device, "the features"))

    @staticmethod
    def arguments(rows: Optional["_FP8Rows"], like: torch.Tensor):
        """The kernels' (q_ptr, s_ptr, VALUE_FOR_INF, QUANT) arguments; without a copy the
        branch is compiled out and ``like`` stands in for the pointers."""
        if rows is None:
            return like, like, 0.0, False
        return rows.data, rows.scale_inv, torch.finfo(like.dtype).max, True


def _amax_arguments(amax: Optional[ExpertAmax], field: str):
    """The kernels' (expert_ptr, amax_ptr, AMAX) arguments; without ``amax`` the branch is
    compiled out and any tensor stands in for the pointers."""
    if amax is None:
        return None, None, False
    return amax.expert_T, getattr(amax, field), True


def _row_limits(rows: int, rows_used: Optional[torch.Tensor]):
    """The kernels' (rows, rows_used or None, HAS_USED) arguments."""
    return rows, rows_used, rows_used is not None


def _constants(spec: GLUSpec):
    clamp = spec.clamp
    return spec.alpha, spec.linear_offset, 0.0 if clamp is None else clamp, clamp is not None


def _blocks(features: int):
    """(rows, features) per program: 2,048 elements, 16 per thread of 4 warps."""
    block_features = min(256, max(16, 1 << (features - 1).bit_length()))
    return 2048 // block_features, block_features


@functools.cache
def _triton_store_quantized():
    """The rows' 1x128 E4M3 store both kernels end with (a Triton device function)."""
    import triton
    import triton.language as tl

    scales, to_e4m3, magnitude = jit_helpers()

    @triton.jit
    def store_quantized(q_ptr, s_ptr, v, r, rows, first_column, end_column, columns, VALUE_FOR_INF: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        # v [BLOCK_R, BLOCK_F] (bf16, the stored values) at columns first_column + [0, BLOCK_F)
        # (those before end_column) of rows r of a [rows, columns] tensor: its 1x128 E4M3 copy
        # and scales, as quantize_rows writes them
        v3 = tl.reshape(v.to(tl.float32), (BLOCK_R, BLOCK_F // 128, 128))
        scale, scale_inv = scales(tl.max(magnitude(v3), axis=2), VALUE_FOR_INF)
        q = tl.reshape(to_e4m3(v3 * scale[:, :, None]), (BLOCK_R, BLOCK_F))
        f = first_column + tl.arange(0, BLOCK_F)
        row_in = r < rows
        tl.store(q_ptr + r[:, None].to(tl.int64) * columns + f[None, :], q,
                 mask=row_in[:, None] & (f[None, :] < end_column))
        kb = first_column // 128 + tl.arange(0, BLOCK_F // 128)
        tl.store(s_ptr + r[:, None].to(tl.int64) * (columns // 128) + kb[None, :], scale_inv,
                 mask=row_in[:, None] & (kb[None, :] < end_column // 128))

    return store_quantized


@functools.cache
def _triton_kernels():
    """The two kernels, compiled on first use (Triton is a GPU-side import)."""
    import triton
    import triton.language as tl

    expert_max = triton_expert_max()
    store_quantized = _triton_store_quantized()

    @triton.jit
    def forward_kernel(h_ptr, p_ptr, a_ptr, rows, used_ptr, HAS_USED: tl.constexpr, features, alpha, offset,
                       clamp, HAS_CLAMP: tl.constexpr, expert_ptr, amax_ptr, AMAX: tl.constexpr, q_ptr, s_ptr,
                       VALUE_FOR_INF: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        inside = (r[:, None] < rows) & (f[None, :] < features)
        if HAS_USED:  # rows past it read as zero
            used = r < tl.load(used_ptr)
        else:
            used = r < rows
        gate_at = r[:, None].to(tl.int64) * (2 * features) + f[None, :]
        x1 = tl.load(h_ptr + gate_at, mask=inside & used[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(h_ptr + gate_at + features, mask=inside & used[:, None], other=0.0).to(tl.float32)
        if HAS_CLAMP:
            x1 = tl.minimum(x1, clamp)
            x2 = tl.minimum(tl.maximum(x2, -clamp), clamp)
        p = tl.load(p_ptr + r, mask=used, other=0.0).to(tl.float32)
        a = (x1 * tl.sigmoid(alpha * x1) * (x2 + offset) * p[:, None]).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + r[:, None].to(tl.int64) * features + f[None, :], a, mask=inside)
        if QUANT:
            store_quantized(q_ptr, s_ptr, a, r, rows, tl.program_id(1) * BLOCK_F, features, features,
                            VALUE_FOR_INF, BLOCK_R, BLOCK_F)
        if AMAX:  # of the stored values; masked elements are zero
            row_in = r < rows
            expert = tl.load(expert_ptr + r, mask=row_in, other=-1)
            expert_max(amax_ptr, expert, tl.max(tl.abs(a.to(tl.float32)), axis=1), row_in)

    @triton.jit
    def backward_kernel(da_ptr, h_ptr, p_ptr, dh_ptr, dp_ptr, rows, used_ptr, HAS_USED: tl.constexpr, features,
                        alpha, offset, clamp, HAS_CLAMP: tl.constexpr, expert_ptr, amax_ptr, AMAX: tl.constexpr,
                        q_ptr, s_ptr, VALUE_FOR_INF: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_F: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        if HAS_USED:  # rows past it read as zero
            used = r < tl.load(used_ptr)
        else:
            used = r < rows
        p = tl.load(p_ptr + r, mask=used, other=0.0).to(tl.float32)
        dp = tl.zeros([BLOCK_R], dtype=tl.float32)
        peak = tl.zeros([BLOCK_R], dtype=tl.float32)  # of the stored input gradient (AMAX)
        for start in range(0, features, BLOCK_F):
            f = start + tl.arange(0, BLOCK_F)
            inside = (r[:, None] < rows) & (f[None, :] < features)
            gate_at = r[:, None].to(tl.int64) * (2 * features) + f[None, :]
            x1 = tl.load(h_ptr + gate_at, mask=inside & used[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(h_ptr + gate_at + features, mask=inside & used[:, None], other=0.0).to(tl.float32)
            da = tl.load(da_ptr + r[:, None].to(tl.int64) * features + f[None, :], mask=inside & used[:, None],
                         other=0.0)
            da = da.to(tl.float32)
            if HAS_CLAMP:  # the clamp passes the gradient where it left the value as it was
                pass_1 = x1 <= clamp
                pass_2 = (x2 >= -clamp) & (x2 <= clamp)
                x1 = tl.minimum(x1, clamp)
                x2 = tl.minimum(tl.maximum(x2, -clamp), clamp)
            s = tl.sigmoid(alpha * x1)
            act = x1 * s
            linear = x2 + offset
            dp += tl.sum(act * linear * da, axis=1)
            g = da * p[:, None]
            d1 = g * s * (1.0 + alpha * x1 * (1.0 - s)) * linear
            d2 = g * act
            if HAS_CLAMP:
                d1 = tl.where(pass_1, d1, 0.0)
                d2 = tl.where(pass_2, d2, 0.0)
            d1 = d1.to(dh_ptr.dtype.element_ty)
            d2 = d2.to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptr + gate_at, d1, mask=inside)
            tl.store(dh_ptr + gate_at + features, d2, mask=inside)
            if QUANT:  # both halves: their 128-column blocks start on block boundaries (F % 128 == 0)
                store_quantized(q_ptr, s_ptr, d1, r, rows, start, features, 2 * features,
                                VALUE_FOR_INF, BLOCK_R, BLOCK_F)
                store_quantized(q_ptr, s_ptr, d2, r, rows, features + start, 2 * features, 2 * features,
                                VALUE_FOR_INF, BLOCK_R, BLOCK_F)
            if AMAX:
                peak = tl.maximum(peak, tl.maximum(tl.max(tl.abs(d1.to(tl.float32)), axis=1),
                                                   tl.max(tl.abs(d2.to(tl.float32)), axis=1)))
        tl.store(dp_ptr + r, dp.to(dp_ptr.dtype.element_ty), mask=r < rows)
        if AMAX:
            row_in = r < rows
            expert_max(amax_ptr, tl.load(expert_ptr + r, mask=row_in, other=-1), peak, row_in)

    return forward_kernel, backward_kernel
