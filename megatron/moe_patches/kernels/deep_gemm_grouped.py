"""F10's blockwise fprop and dgrad on DeepGEMM, where it is installed (optional).

DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` with ``use_psum_layout=True`` computes
y_PN = a_PK . b_ENK[e]^T for each expert's rows with the recipe's scales (1x128 for A,
128x128 for B, float32 on Hopper), reading the experts' cumulative row ends on the device:
no host list, so CUDA graphs can hold it. It expects expert e's rows to start at
ends_E[e-1] rounded up to 128: the dispatcher pads every group to 128 rows
(``dispatch.permute_pad.StaticPaddedPermute``), so the ends are already on those
boundaries. The padding rows are zero and give zero rows. DeepGEMM computes nothing past the
last group (the static row count's unused tail): ``grouped_nt`` writes zeros there, as the
Triton kernel does, so no stale memory reaches the GLU.

On an H100 it runs the Qwen3-, DeepSeek- and Mixtral-like expert GEMMs at 1.6-2.1x the TFLOP/s
of bf16 ``torch._grouped_mm`` (benchmarks/README.md, "FP8 grouped GEMMs from a kernel
library"); the Triton kernel of ``fp8_grouped_gemm`` runs the same recipe at 0.4-1.3x.
"""

import functools
import importlib

import torch

GROUP_ALIGN = 128  # rows each expert's group must start on


def grouped_nt(a8_PK: torch.Tensor, b8_ENK: torch.Tensor, ends_E: torch.Tensor,
               scale_inv_PKt: torch.Tensor, scale_inv_ENtKt: torch.Tensor) -> torch.Tensor:
    """y_PN (bf16): rows of expert e times b8_ENK[e]^T, each group starting on a multiple of
    128 rows. ``scale_inv_PKt``: the 1x128 scales [P, K/128] (any layout: DeepGEMM's copy is
    column-major, made here); ``scale_inv_ENtKt``: the 128x128 ones [E, N/128, K/128];
    ``ends_E``: int32 cumulative ends on the device."""
    deep_gemm = importlib.import_module("deep_gemm")
    rows, out_features = a8_PK.shape[0], b8_ENK.shape[1]
    y_PN = torch.empty((rows, out_features), dtype=torch.bfloat16, device=a8_PK.device)
    if rows == 0:
        return y_PN
    scale_inv_column_major = deep_gemm.get_mn_major_tma_aligned_tensor(scale_inv_PKt)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (a8_PK, scale_inv_column_major), (b8_ENK, scale_inv_ENtKt), y_PN, ends_E, use_psum_layout=True)
    zero_rows_past_last_group(y_PN, ends_E)
    return y_PN


TAIL_ROWS, TAIL_COLUMNS = 32, 256  # one program's tile


def zero_rows_past_last_group(y_PN: torch.Tensor, ends_E: torch.Tensor) -> None:
    """Zeros in y_PN's rows from ends_E[-1] on, read on the device (no sync): every program
    takes 32 rows and stores only those past the end, so the groups' rows cost no traffic."""
    rows, columns = y_PN.shape
    grid = (-(-rows // TAIL_ROWS),)
    _tail_kernel()[grid](y_PN, ends_E, ends_E.numel() - 1, rows, columns, BR=TAIL_ROWS, BC=TAIL_COLUMNS)


@functools.cache
def _tail_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def zero_tail(y_ptr, ends_ptr, last, rows, columns, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        past = (r >= tl.load(ends_ptr + last)) & (r < rows)
        zeros = tl.zeros((BR, BC), dtype=y_ptr.dtype.element_ty)
        for start in range(0, columns, BC):
            c = start + tl.arange(0, BC)
            tl.store(y_ptr + r.to(tl.int64)[:, None] * columns + c[None, :], zeros,
                     mask=past[:, None] & (c[None, :] < columns))

    return zero_tail
