"""Per-expert amax, gathered where a kernel already holds the values: a Triton helper that
raises ``amax_E[expert]`` to a block of rows' peaks.

F10's tensorwise FP8 scales each expert's rows by ``448 / amax_E[e]`` (TE's current scaling,
per expert). A kernel that writes such rows (the weighted GLU, both ways) calls
``expert_max`` on the bf16 values it stores, so the quantization that follows needs no pass
of its own to find the amax; the amax pass (``experts.fp8_grouped_mm``) calls it too.

Rows are grouped by expert, so a block of rows nearly always belongs to one expert: then one
atomic takes the block's peak (one atomic per row measured 1.4x slower on an H100, 262,144
rows, 128 experts: thousands of atomics on each address). The max is exact and taken in any
order, so the result does not depend on scheduling.
"""

import functools

import torch


def expert_amax_reference(x_RC: torch.Tensor, expert_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """float32 [num_experts]: the max |x| over each expert's rows (0 for an expert without
    rows), in PyTorch: what the kernels gather, and the CPU path."""
    if x_RC.shape[1]:
        row_amax_R = x_RC.abs().amax(dim=1).float()
    else:
        row_amax_R = x_RC.new_zeros(x_RC.shape[0], dtype=torch.float32)
    amax_E = torch.zeros(num_experts, dtype=torch.float32, device=x_RC.device)
    return amax_E.scatter_reduce_(0, expert_R.long(), row_amax_R, "amax")


@functools.cache
def triton_expert_max():
    """The ``@triton.jit`` helper ``expert_max(amax_ptr, expert, peak, row_in)``: for each row
    i with ``row_in[i]``, amax[expert[i]] = max(amax[expert[i]], peak[i]). ``peak`` holds
    float32 magnitudes (>= 0), ``expert`` int32 (any value where ``row_in`` is false).
    Compiled on first use (Triton is a GPU-side import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expert_max(amax_ptr, expert, peak, row_in):
        lowest = tl.min(tl.where(row_in, expert, 2147483647))
        highest = tl.max(tl.where(row_in, expert, -1))
        if lowest == highest:
            tl.atomic_max(amax_ptr + lowest, tl.max(tl.where(row_in, peak, 0.0)))
        elif lowest <= highest:  # some rows are in: one atomic each
            tl.atomic_max(amax_ptr + expert, peak, mask=row_in)

    return expert_max
