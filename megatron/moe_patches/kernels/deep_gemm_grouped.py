"""F10's blockwise fprop and dgrad on DeepGEMM, where it is installed (optional).

DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` with ``use_psum_layout=True`` computes
y_PN = a_PK . b_ENK[e]^T for each expert's rows with the recipe's scales (1x128 for A,
128x128 for B, float32 on Hopper), reading the experts' cumulative row ends on the device:
no host list, so CUDA graphs can hold it. It expects expert e's rows to start at
ends_E[e-1] rounded up to 128: the dispatcher pads every group to 128 rows
(``dispatch.permute_pad.StaticPaddedPermute``), so the ends are already on those
boundaries. The padding rows are zero and give zero rows.

On an H100 it runs the Qwen3-, DeepSeek- and Mixtral-like expert GEMMs at 1.6-2.1x the TFLOP/s
of bf16 ``torch._grouped_mm`` (benchmarks/README.md, "FP8 grouped GEMMs from a kernel
library"); the Triton kernel of ``fp8_grouped_gemm`` runs the same recipe at 0.4-1.3x.
"""

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
    return y_PN
