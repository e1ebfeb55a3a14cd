"""Rows grouped by expert in a static padded layout, written in bf16 and as their 1x128 FP8
copy in one pass (F10's blockwise experts on DeepGEMM, F1's static padded permute).

``gather_quantized`` reads each token's row once, quantizes it once (a row's 1x128 scales
depend on the row alone, so its top-k copies share them) and stores the bf16 row, its E4M3
copy and its scales at each of the token's destination rows; a second small kernel writes
the rows no token lands on (each group's padding and the tail past the last group): zeros,
scale 1 (what quantizing a zero row gives), prob 0. Compared with TE's permute into a
zero-filled buffer followed by ``quantize_rows`` over every row, nothing is written twice
and the permuted rows are not read again.

Destinations follow TE's ``row_id_map`` ([T, 2E+1]: the first n entries of a token's row
are its destination rows before padding, the next E its experts, the last n) plus the
per-expert ``pad_offsets``, as TE's permute kernel reads them; a token whose prob is 0 gets
zero rows, as TE writes them. The result equals TE's permute followed by ``quantize_rows``
bit for bit (tests/gpu/test_fused_permute_pad.py). CUDA only; graph-safe (static sizes,
everything read on the device).
"""

import functools
from typing import NamedTuple, Optional

import torch

from megatron.moe_patches.kernels.fp8_blockwise_quantize import empty_rows, jit_helpers
from megatron.moe_patches.kernels.fp8_grouped_gemm import SCALE_BLOCK


class GatheredRows(NamedTuple):
    x_RH: torch.Tensor  # bf16 [rows, H]
    x8_RH: torch.Tensor  # E4M3 [rows, H]
    scale_inv_RHt: torch.Tensor  # float32 [rows, H/128], as quantize_rows writes them
    probs_R: Optional[torch.Tensor]  # [rows], where probs were given


def gather_quantized(x_TH: torch.Tensor, row_id_map: torch.Tensor, pad_offsets_E: torch.Tensor,
                     counts_E: torch.Tensor, rows: int, align: int,
                     probs_TE: Optional[torch.Tensor] = None) -> GatheredRows:
    """``x_TH``'s rows at their padded destinations (``row_id_map`` + ``pad_offsets_E``) in
    ``rows`` rows, with their 1x128 E4M3 copy; ``counts_E``: the experts' routed rows (device),
    each group padded to ``align``; ``probs_TE``: permuted alongside where given."""
    T, H = x_TH.shape
    E = pad_offsets_E.numel()
    x_TH = x_TH.contiguous()
    device = x_TH.device
    out = GatheredRows(
        torch.empty((rows, H), dtype=x_TH.dtype, device=device), *empty_rows(rows, H, device, "the hidden size"),
        None if probs_TE is None else torch.empty(rows, dtype=probs_TE.dtype, device=device))
    if rows == 0:
        return out
    gather_kernel, unwritten_kernel = _kernels()
    blocks = H // SCALE_BLOCK
    kb = min(16, 1 << (blocks - 1).bit_length())  # up to 2048 columns per program
    probs = probs_TE if probs_TE is not None else pad_offsets_E  # compiled out without probs
    probs_out = out.probs_R if probs_TE is not None else pad_offsets_E
    if T:
        gather_kernel[(T, -(-blocks // kb))](
            x_TH, row_id_map, pad_offsets_E, probs, out.x_RH, out.x8_RH, out.scale_inv_RHt, probs_out,
            H, row_id_map.stride(0), 0 if probs_TE is None else probs_TE.stride(0), E,
            VALUE_FOR_INF=torch.finfo(x_TH.dtype).max, WITH_PROBS=probs_TE is not None, KB=kb,
            BLOCK=SCALE_BLOCK, num_warps=4)
    # every group's padding (under ``align`` rows), then the tail in ``align``-row programs
    padded_ends_E = torch.cumsum((counts_E.long() + align - 1) // align * align, 0)
    tail_programs = -(-(E * (align - 1)) // align)
    unwritten_kernel[(E + tail_programs,)](
        out.x_RH, out.x8_RH, out.scale_inv_RHt, probs_out, counts_E, padded_ends_E, rows, H, E,
        WITH_PROBS=probs_TE is not None, BR=1 << (align - 1).bit_length(), BC=256, BLOCK=SCALE_BLOCK,
        num_warps=4)
    return out


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    scales, to_e4m3, magnitude = jit_helpers()

    @triton.jit
    def gather_kernel(x_ptr, map_ptr, pad_ptr, probs_ptr, out_ptr, q_ptr, s_ptr, probs_out_ptr, H, map_stride,
                      probs_stride, E, VALUE_FOR_INF: tl.constexpr, WITH_PROBS: tl.constexpr, KB: tl.constexpr,
                      BLOCK: tl.constexpr):
        # One token, KB blocks of 128 columns: read and quantized once, stored at each destination.
        t = tl.program_id(0).to(tl.int64)
        blocks = H // BLOCK
        kb = tl.program_id(1) * KB + tl.arange(0, KB)
        inside = (kb < blocks)[:, None]
        column = kb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        v = tl.load(x_ptr + t * H + column, mask=inside, other=0.0)
        vf = v.to(tl.float32)
        scale, scale_inv = scales(tl.max(magnitude(vf), axis=1), VALUE_FOR_INF)
        q = to_e4m3(vf * scale[:, None])
        routed = tl.load(map_ptr + t * map_stride + 2 * E)
        for i in range(routed):
            expert = tl.load(map_ptr + t * map_stride + E + i)
            dest = (tl.load(map_ptr + t * map_stride + i) + tl.load(pad_ptr + expert)).to(tl.int64)
            row_v, row_q, row_s = v, q, scale_inv
            if WITH_PROBS:
                prob = tl.load(probs_ptr + t * probs_stride + expert)
                if tl.program_id(1) == 0:
                    tl.store(probs_out_ptr + dest, prob)
                if prob == 0.0:  # TE's permute writes a zero row: what quantizing it gives
                    row_v = tl.zeros_like(v)
                    row_q = tl.zeros_like(vf).to(tl.float8e4nv)
                    row_s = tl.full(scale_inv.shape, 1.0, tl.float32)
            tl.store(out_ptr + dest * H + column, row_v, mask=inside)
            tl.store(q_ptr + dest * H + column, row_q, mask=inside)
            tl.store(s_ptr + dest * blocks + kb, row_s, mask=kb < blocks)

    @triton.jit
    def unwritten_kernel(out_ptr, q_ptr, s_ptr, probs_out_ptr, counts_ptr, padded_ends_ptr, rows, H, E,
                         WITH_PROBS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
        # Program e < E: expert e's padding rows; the others: BR rows each of the tail.
        pid = tl.program_id(0)
        e = tl.minimum(pid, E - 1)
        group_start = tl.load(padded_ends_ptr + e - 1, mask=e > 0, other=0)
        past_groups = tl.load(padded_ends_ptr + E - 1)
        first = tl.where(pid < E, group_start + tl.load(counts_ptr + e), past_groups + (pid - E) * BR)
        group_end = tl.where(pid < E, tl.load(padded_ends_ptr + e), rows)
        r = (first + tl.arange(0, BR)).to(tl.int64)
        live = r < tl.minimum(group_end, first + BR)
        for start in range(0, H, BC):
            c = start + tl.arange(0, BC)
            at = r[:, None] * H + c[None, :]
            mask = live[:, None] & (c[None, :] < H)
            tl.store(out_ptr + at, tl.zeros((BR, BC), dtype=out_ptr.dtype.element_ty), mask=mask)
            tl.store(q_ptr + at, tl.zeros((BR, BC), dtype=tl.float32).to(tl.float8e4nv), mask=mask)
        blocks = H // BLOCK
        for start in range(0, blocks, BC):
            b = start + tl.arange(0, BC)
            tl.store(s_ptr + r[:, None] * blocks + b[None, :], tl.full((BR, BC), 1.0, tl.float32),
                     mask=live[:, None] & (b[None, :] < blocks))
        if WITH_PROBS:
            tl.store(probs_out_ptr + r, tl.zeros((BR,), dtype=probs_out_ptr.dtype.element_ty), mask=live)

    return gather_kernel, unwritten_kernel
