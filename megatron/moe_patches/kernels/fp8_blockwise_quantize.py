"""Blockwise FP8 quantization for the grouped expert GEMMs (TE's Float8BlockScaling layout),
one pass over the data each, no amax pass: every scale depends on its own block only.

- ``quantize_rows``: [T, K] activations or output gradients, one scale per row and 128
  columns (1x128), scales [T, K/128] row-major: the GEMM reads a row's scales one K block
  after another from one cache line (measured on an H100: 1.1-1.4x faster GEMMs than with
  the scales stored K-block-major).
- ``quantize_weight_tiles``: [E, N, K] weights, one scale per 128x128 tile, written in both
  layouts the GEMMs read (fprop [E, N, K], dgrad [E, K, N]) from one read; a 128x128 tile
  covers the same elements either way, so both copies hold the same values.
- ``quantize_rows_and_token_major``: the row copy of [T, C] rows grouped by expert and, from
  the same read, the token-major [C, P] copy the FP8 wgrad reads
  (``fp8_grouped_gemm.token_major_layout``: each expert's segment starts at a multiple of 128
  columns, zero-padded), one scale per channel and 128 tokens of one expert (1x128 along the
  tokens, as TE quantizes each expert's input column-wise).

The numerics are ``fp8_scaling``'s (power-of-two scales, epsilon 0, E4M3, NaN skipped by the
amax and kept): the Triton kernels and these functions' CPU paths (which call
``fp8_scaling``) give the same bits. Every dimension that is blocked must be a multiple of
128 (``fp8_scaling``'s ``partial="refuse"``). Graph-safe: no host sync, static sizes.
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch

from megatron.moe_patches.kernels import fp8_scaling as fs
from megatron.moe_patches.kernels.fp8_grouped_gemm import (
    FP8_DTYPE, SCALE_BLOCK, RowTiles, row_tiles, to_token_major, token_major_ends, token_major_layout)

ROW_TILE = 16  # rows per program of quantize_rows (measured on an H100: 2.9 TB/s, 64 x one block: 2.4)


class RowBlocks(NamedTuple):
    """What the blockwise kernels derive from one grouping of rows (``row_blocks``): built
    once per forward, read by each of its quantizations and GEMMs (building it is a dozen
    small device ops)."""

    tiles: RowTiles  # SCALE_BLOCK-row tiles of each expert's rows (and of the tail)
    padded_ends_E: torch.Tensor  # int32 [E]: the token-major copies' expert ends
    width: int  # P, the token-major copies' static width


def row_blocks(ends_E: torch.Tensor, num_rows: int) -> RowBlocks:
    """The ``RowBlocks`` of ``num_rows`` rows grouped by ``ends_E`` (device ops, static sizes)."""
    return RowBlocks(row_tiles(ends_E, num_rows, SCALE_BLOCK), *token_major_ends(ends_E, num_rows))


class TokenMajorFP8(NamedTuple):
    """A token-major FP8 copy for the wgrad GEMM and what it needs besides."""

    data_CP: torch.Tensor  # E4M3 [C, P]
    scale_inv_CPt: torch.Tensor  # float32 [C, P/128], [P/128, C] in memory: the wgrad GEMM reads it 1.7x faster so
    padded_ends_E: torch.Tensor  # int32 [E]


def _value_for_inf(dtype) -> float:
    return torch.finfo(dtype).max


def _check_blocks(size: int, what: str):
    if size % SCALE_BLOCK:
        raise ValueError(f"{what} = {size} is not a multiple of {SCALE_BLOCK}: blockwise FP8 needs whole "
                         f"{SCALE_BLOCK}-element blocks")


def empty_rows(rows: int, K: int, device, what: str = "the row length K") -> Tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (x8 [rows, K] E4M3, scale_inv [rows, K/128] float32): the layout every
    1x128 row copy is written in (``quantize_rows``, the permute's and the GLU's)."""
    _check_blocks(K, what)
    return (torch.empty((rows, K), dtype=FP8_DTYPE, device=device),
            torch.empty((rows, K // SCALE_BLOCK), dtype=torch.float32, device=device))


def quantize_rows(x_TK: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8_TK, scale_inv_TKt): 1x128 blocks along the last dimension."""
    T, K = x_TK.shape
    _check_blocks(K, "the row length K")
    if not x_TK.is_cuda:
        return fs.quantize_1x128(x_TK)
    x_TK = x_TK.contiguous()
    x8_TK, scale_inv_TKt = empty_rows(T, K, x_TK.device)
    if T:
        rows_kernel, _, _ = _kernels()
        rows_kernel[(-(-T // ROW_TILE),)](
            x_TK, x8_TK, scale_inv_TKt, T, K, VALUE_FOR_INF=_value_for_inf(x_TK.dtype),
            BR=ROW_TILE, KB=2, BLOCK=SCALE_BLOCK, num_warps=4)
    return x8_TK, scale_inv_TKt


ATTACHED_ROWS = "_blockwise_fp8_rows"  # the attribute a row copy travels under


class AttachedRows(NamedTuple):
    data_TK: torch.Tensor  # E4M3 [T, K]
    scale_inv_TKt: torch.Tensor  # float32 [T, K/128]
    version: int  # the bf16 rows' version counter when the copy was written


def attach_quantized_rows(x_TK: torch.Tensor, x8_TK: torch.Tensor, scale_inv_TKt: torch.Tensor) -> None:
    """Hand ``quantize_rows(x_TK)``'s result, written by the kernel that wrote x_TK (the
    dispatcher's permute), to the GEMM that reads x_TK next: it takes the copy instead of
    quantizing x_TK again (``take_quantized_rows``)."""
    setattr(x_TK, ATTACHED_ROWS, AttachedRows(x8_TK, scale_inv_TKt, x_TK._version))


def take_quantized_rows(x_TK: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(x8_TK, scale_inv_TKt) attached to x_TK or to the tensor x_TK views (autograd hands a
    Function's output on as a view), detached from it (taken once: the copy is not kept
    alive); None where nothing is attached, or where x_TK is not the same rows or was
    written since."""
    holder = x_TK if hasattr(x_TK, ATTACHED_ROWS) else x_TK._base
    attached = getattr(holder, ATTACHED_ROWS, None) if holder is not None else None
    if attached is None:
        return None
    delattr(holder, ATTACHED_ROWS)
    same_rows = (x_TK.data_ptr() == holder.data_ptr() and x_TK.shape == attached.data_TK.shape
                 and x_TK.is_contiguous() and x_TK._version == attached.version)
    return (attached.data_TK, attached.scale_inv_TKt) if same_rows else None


class WeightTiles(NamedTuple):
    """One FC's weights in E4M3 with 128x128 scales, in the fprop and the dgrad layout."""

    w8_ENK: torch.Tensor
    scale_inv_ENtKt: torch.Tensor
    w8_EKN: torch.Tensor
    scale_inv_EKtNt: torch.Tensor


def written_into(into, result):
    """``result`` (a tuple of tensors), copied into ``into``'s tensors when given: a weight
    cache's readers (a captured CUDA graph) keep their pointers across refreshes."""
    if into is None:
        return result
    for target, value in zip(into, result):
        target.copy_(value)
    return into


def quantize_weight_tiles(w_ENK: torch.Tensor, into: "WeightTiles" = None) -> WeightTiles:
    """Both layouts of ``w_ENK`` with one scale per 128x128 tile; written into ``into``'s
    tensors (an earlier result of the same shapes) when given, so readers keep their pointers."""
    E, N, K = w_ENK.shape
    _check_blocks(N, "the weight's output features N")
    _check_blocks(K, "the weight's input features K")
    if not w_ENK.is_cuda:
        w8_ENK, s_ENtKt = fs.quantize_128x128(w_ENK)
        return written_into(into, WeightTiles(w8_ENK, s_ENtKt, *fs.transpose_128x128(w8_ENK, s_ENtKt)))
    w_ENK = w_ENK.contiguous()
    if into is None:
        device = w_ENK.device
        into = WeightTiles(
            torch.empty((E, N, K), dtype=FP8_DTYPE, device=device),
            torch.empty((E, N // SCALE_BLOCK, K // SCALE_BLOCK), dtype=torch.float32, device=device),
            torch.empty((E, K, N), dtype=FP8_DTYPE, device=device),
            torch.empty((E, K // SCALE_BLOCK, N // SCALE_BLOCK), dtype=torch.float32, device=device))
    if w_ENK.numel():
        _, weight_tiles_kernel, _ = _kernels()
        weight_tiles_kernel[(E, N // SCALE_BLOCK, K // SCALE_BLOCK)](
            w_ENK, *into, N, K, VALUE_FOR_INF=_value_for_inf(w_ENK.dtype), BLOCK=SCALE_BLOCK, num_warps=8)
    return into


def quantize_rows_and_token_major(x_TC: torch.Tensor, ends_E: torch.Tensor, blocks: Optional[RowBlocks] = None):
    """(x8_TC, scale_inv_TCt, TokenMajorFP8) from one read of ``x_TC`` (rows grouped by
    ``ends_E``, int32 cumulative ends on the device): what ``quantize_rows`` gives, and the
    token-major E4M3 copy with 1x128 scales along each expert's tokens. Rows past ends_E[-1]
    are in the row copy only; columns past the last expert's padded end are not written (the
    wgrad GEMM never reads them). ``blocks``: ``row_blocks(ends_E, T)`` where the caller
    derives it once (else built here)."""
    T, C = x_TC.shape
    _check_blocks(C, "the channel count C")
    if not x_TC.is_cuda:
        layout = token_major_layout(ends_E, T)
        data_CP, scale_inv_CPt = fs.quantize_1x128(to_token_major(x_TC, layout))
        return (*fs.quantize_1x128(x_TC), TokenMajorFP8(data_CP, scale_inv_CPt, layout.padded_ends_E))
    x_TC = x_TC.contiguous()
    if blocks is None:
        blocks = row_blocks(ends_E, T)
    tiles, padded_ends_E, P = blocks
    tiles.check(ends_E.numel(), T, SCALE_BLOCK)
    device = x_TC.device
    x8_TC = torch.empty((T, C), dtype=FP8_DTYPE, device=device)
    scale_inv_TCt = torch.empty((T, C // SCALE_BLOCK), dtype=torch.float32, device=device)
    data_CP = torch.empty((C, P), dtype=FP8_DTYPE, device=device)
    scale_inv_PtC = torch.empty((P // SCALE_BLOCK, C), dtype=torch.float32, device=device)
    if T:
        _, _, both_kernel = _kernels()
        both_kernel[(tiles.expert.numel(), C // SCALE_BLOCK)](
            x_TC, x8_TC, scale_inv_TCt, data_CP, scale_inv_PtC, tiles.expert, tiles.row_start, tiles.row_end,
            ends_E, padded_ends_E, T, C, P, ends_E.numel(), VALUE_FOR_INF=_value_for_inf(x_TC.dtype),
            BLOCK=SCALE_BLOCK, num_warps=4)  # measured on H100: 1.4x faster than 8 warps
    return x8_TC, scale_inv_TCt, TokenMajorFP8(data_CP, scale_inv_PtC.t(), padded_ends_E)


@functools.lru_cache(maxsize=None)
def jit_helpers():
    """(scales, to_e4m3, magnitude): the recipe's arithmetic as Triton device functions, for
    every kernel that quantizes 1x128 blocks (here and ``permute_quantize``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scales(amax, VALUE_FOR_INF: tl.constexpr):
        # fp8_scaling.scale_from_amax with power-of-two scales and epsilon 0, in float32
        unscaled = (amax == 0) | (amax == float("inf")) | (amax != amax)
        scale = tl.fdiv(tl.full(amax.shape, 448.0, tl.float32), tl.where(unscaled, 1.0, amax), ieee_rounding=True)
        scale = tl.where(scale == float("inf"), VALUE_FOR_INF, scale)
        scale = tl.where(unscaled, 1.0, scale)
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # keep sign, exponent
        return scale, tl.fdiv(tl.full(amax.shape, 1.0, tl.float32), scale, ieee_rounding=True)

    @triton.jit
    def to_e4m3(v):
        # saturate at +-448, NaN stays NaN, then round to nearest even
        clamped = tl.minimum(tl.maximum(v, -448.0), 448.0)
        return tl.where(v != v, v, clamped).to(tl.float8e4nv)

    @triton.jit
    def magnitude(v):
        return tl.where(v != v, 0.0, tl.abs(v))  # NaN takes no part in an amax

    return scales, to_e4m3, magnitude


@functools.lru_cache(maxsize=None)
def _kernels():
    """The three kernels, compiled on first use (Triton is a GPU-side import)."""
    import triton
    import triton.language as tl

    scales, to_e4m3, magnitude = jit_helpers()

    @triton.jit
    def rows_kernel(x_ptr, q_ptr, s_ptr, T, K, VALUE_FOR_INF: tl.constexpr, BR: tl.constexpr, KB: tl.constexpr,
                    BLOCK: tl.constexpr):
        # BR whole rows, KB blocks of BLOCK at a time: each row's scales are written side by side
        # (one 128-column block per program stored them a cache line apart: 1.2x slower on an H100)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        row_in = r < T
        blocks = K // BLOCK
        for kb0 in range(0, blocks, KB):
            kb = kb0 + tl.arange(0, KB)
            inside = row_in[:, None] & (kb < blocks)[None, :]
            at = r.to(tl.int64)[:, None, None] * K + kb[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
            v = tl.load(x_ptr + at, mask=inside[:, :, None], other=0.0).to(tl.float32)
            scale, scale_inv = scales(tl.max(magnitude(v), axis=2), VALUE_FOR_INF)
            tl.store(q_ptr + at, to_e4m3(v * scale[:, :, None]), mask=inside[:, :, None])
            tl.store(s_ptr + r.to(tl.int64)[:, None] * blocks + kb[None, :], scale_inv, mask=inside)

    @triton.jit
    def weight_tiles_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, VALUE_FOR_INF: tl.constexpr, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        nb = tl.program_id(1)
        kb = tl.program_id(2)
        n = nb * BLOCK + tl.arange(0, BLOCK)
        k = kb * BLOCK + tl.arange(0, BLOCK)
        base = e.to(tl.int64) * N * K
        v = tl.load(w_ptr + base + n[:, None] * K + k[None, :]).to(tl.float32)
        scale, scale_inv = scales(tl.max(tl.max(magnitude(v), axis=1), axis=0), VALUE_FOR_INF)
        q = to_e4m3(v * scale)
        tl.store(q_ptr + base + n[:, None] * K + k[None, :], q)
        tl.store(qt_ptr + base + k[:, None] * N + n[None, :], tl.trans(q))
        Nt = N // BLOCK
        Kt = K // BLOCK
        tl.store(s_ptr + (e * Nt + nb) * Kt + kb, scale_inv)
        tl.store(st_ptr + (e * Kt + kb) * Nt + nb, scale_inv)

    @triton.jit
    def both_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, ends_ptr,
                    padded_ends_ptr, T, C, P, E, VALUE_FOR_INF: tl.constexpr, BLOCK: tl.constexpr):
        # Up to 128 rows of one expert (or of the tail past the last one) x 128 channels, read
        # once: quantized per row (1x128 along the channels) into the row copy, and per channel
        # (1x128 along the expert's tokens) into the token-major copy at the rows' columns.
        e = tl.load(tile_expert_ptr + tl.program_id(0))
        if e >= 0:
            row_start = tl.load(tile_start_ptr + tl.program_id(0))
            row_end = tl.load(tile_end_ptr + tl.program_id(0))
            cb = tl.program_id(1)
            t = row_start + tl.arange(0, BLOCK)
            c = cb * BLOCK + tl.arange(0, BLOCK)
            row_in = t < row_end
            at = t.to(tl.int64)[:, None] * C + c[None, :]
            v = tl.load(x_ptr + at, mask=row_in[:, None], other=0.0).to(tl.float32)
            mag = magnitude(v)
            scale, scale_inv = scales(tl.max(mag, axis=1), VALUE_FOR_INF)
            tl.store(q_ptr + at, to_e4m3(v * scale[:, None]), mask=row_in[:, None])
            tl.store(s_ptr + t.to(tl.int64) * (C // BLOCK) + cb, scale_inv, mask=row_in)
            if e < E:
                first_row = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
                first_column = tl.load(padded_ends_ptr + e - 1, mask=e > 0, other=0)
                column0 = first_column + (row_start - first_row)  # a multiple of 128
                scale, scale_inv = scales(tl.max(mag, axis=0), VALUE_FOR_INF)
                q_CT = tl.trans(to_e4m3(v * scale[None, :]))  # stored along the tokens: coalesced
                columns = column0 + tl.arange(0, BLOCK)
                tl.store(qt_ptr + c.to(tl.int64)[:, None] * P + columns[None, :], q_CT)
                tl.store(st_ptr + (column0 // BLOCK).to(tl.int64) * C + c, scale_inv)

    return rows_kernel, weight_tiles_kernel, both_kernel
