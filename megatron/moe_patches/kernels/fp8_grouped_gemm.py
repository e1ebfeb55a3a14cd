"""FP8 grouped GEMMs for MoE experts on Hopper: persistent Triton kernels over expert
segments given on the device, and the pure-PyTorch twins that define their results.

Two kernels cover the three GEMMs of one expert FC (y_TO = x_TI . w_EOI[e]^T per expert):

- ``fp8_grouped_nt``: y_TN = a_TK . b_ENK[e]^T over the rows of each expert. Fprop passes
  ``x8_TI`` and ``w8_EOI``; dgrad passes ``dy8_TO`` and the transposed weights ``w8_EIO``.
- ``fp8_grouped_wgrad``: dW_ENK[e] = a_NP[:, seg e] . b_KP[:, seg e]^T, the contraction over
  each expert's tokens. Both operands are token-major copies ([features, P]: ``dy8_OP`` and
  ``x8_IP``) whose expert segments start at multiples of 128 columns and are zero-padded to
  a multiple of 128 (``token_major_layout`` / ``to_token_major``); P is a static bound, so
  nothing depends on the routing but the device tensors.

Names carry shapes: T rows (routed tokens, grouped by expert), K the contraction, N the
output features, E experts, P padded token columns; ``Kt`` / ``Nt`` / ``Pt`` count 128-blocks.
``ends_E`` holds each expert's cumulative row end (int32, on the device: torch._grouped_mm's
``offs``); expert e owns rows [ends_E[e-1], ends_E[e]). Rows from ends_E[-1] to T belong to
no expert: the kernel writes zeros there.

Recipes (the scale semantics, identical in kernel and twin; scales are float32 scale_inv,
the factor that turns an FP8 value back into the real one):

- ``tensorwise``: A per expert [E] (or per row [T] with ``a_per_row=True``), B per expert
  [E]; applied once to the fp32 accumulator in the epilogue. wgrad: per expert for both.
- ``blockwise`` (TE's Float8BlockScaling layout): A 1x128 [T, Kt] (one per row per 128 K),
  B 128x128 [E, Nt, Kt]; per 128-wide K block the kernel computes the partial product into a
  fresh fp32 accumulator and adds ``partial * sa[:, None] * sb[None, :]`` (with block_n = 128
  one weight tile spans the output tile: ``partial * (sa * sb)[:, None]``, measured 1.2–1.4x
  faster on an H100). F10's blockwise experts (``experts/fp8_blockwise.py``) run these. wgrad: 1x128 along
  the tokens for both operands, [N, Pt] and [K, Pt].

Graph safety: no host sync anywhere in the kernel path (no ``.item()``, ``.tolist()``,
``nonzero``); the tile tables are built with torch ops on the device into buffers of static
size; the grid is the SM count; each configuration is fixed per shape (no autotuning, which
would time kernels at call time). Each output tile is computed by one program in a fixed
order, so results are bitwise reproducible. The twins read ``ends_E`` on the host and are not
graph-safe; they are references, not a fast path.

Accumulation: ``fast_accum=True`` (tensorwise only) chains Hopper's FP8 tensor-core
accumulation over the whole K (fast; it keeps about 14 mantissa bits, DeepSeek-V3 report
3.3.2); otherwise each 128-wide K block is summed by the tensor cores alone and the blocks
are added in fp32 (what blockwise always does, and TE requires for every FP8 GEMM).
"""

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from megatron.moe_patches.kernels import gemm_tile

FP8_DTYPE = torch.float8_e4m3fn
SCALE_BLOCK = 128  # blockwise scales cover 128 elements (1x128) or 128x128 tiles
TOKEN_ALIGN = 128  # wgrad: each expert's token segment starts at a multiple of this
RECIPES = ("tensorwise", "blockwise")


# --- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration: the output tile (block_m x block_n), the contraction step
    block_k, software-pipeline stages and warps."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.stages}w{self.warps}"


CONFIGS = {
    c.name: c
    for c in (
        GemmConfig(128, 256, 128, 3, 8),  # the prototype's best (H100, fast accumulation)
        GemmConfig(256, 128, 128, 3, 8),  # the prototype's pick for K = 14336 (Mixtral FC2)
        GemmConfig(128, 128, 128, 4, 8),  # two fp32 accumulators (split accumulation) fit without spills
        GemmConfig(128, 128, 128, 3, 4),
        GemmConfig(128, 128, 64, 5, 4),  # tensorwise fast accumulation only (blockwise needs block_k 128)
    )
}


def pick_config(gemm: str, recipe: str, K: int, N: int, fast_accum: bool = False) -> GemmConfig:
    """The fixed configuration for a shape, by a small rule (no timing at call time).

    ``gemm`` is "nt" (fprop/dgrad: K the contraction, N the output width) or "wgrad"
    (N and K the weight's dimensions). One fp32 accumulator of 128x256 per 8 warps takes
    128 registers a thread: fine alone (tensorwise, fast accumulation), not twice (split
    accumulation keeps the block's partial product beside it), so split accumulation gets
    128x128 tiles. Long contractions (K >= 8192) prefer 256x128: the prototype measured it
    best for Mixtral's FC2 (K 14336)."""
    if gemm not in ("nt", "wgrad"):
        raise ValueError(f"gemm must be 'nt' or 'wgrad', not {gemm!r}")
    _check_recipe(recipe)
    if gemm == "wgrad" or recipe == "blockwise" or not fast_accum:
        return CONFIGS["m128n128k128s4w8"]
    if N <= 128:
        return CONFIGS["m128n128k128s4w8"]
    if K >= 8192:
        return CONFIGS["m256n128k128s3w8"]
    return CONFIGS["m128n256k128s3w8"]


def _resolve_config(config, gemm, recipe, K, N, fast_accum) -> GemmConfig:
    if config is None:
        config = pick_config(gemm, recipe, K, N, fast_accum)
    elif isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"unknown config {config!r}; known: {sorted(CONFIGS)}")
        config = CONFIGS[config]
    elif not isinstance(config, GemmConfig):
        raise TypeError(f"config must be None, a name from CONFIGS or a GemmConfig, not {type(config).__name__}")
    if recipe == "blockwise" and config.block_k != SCALE_BLOCK:
        raise ValueError(f"blockwise needs block_k == {SCALE_BLOCK} (one scale per K block), config {config.name}")
    if gemm == "wgrad" and TOKEN_ALIGN % config.block_k:
        raise ValueError(f"wgrad needs block_k to divide the token alignment {TOKEN_ALIGN}, config {config.name}")
    return config


# --- validation --------------------------------------------------------------------------------


def _check_recipe(recipe):
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, not {recipe!r}")


def _check_fp8(t, name, dims):
    if t.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be {FP8_DTYPE} (E4M3), not {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel reads it through TMA descriptors)")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA descriptors need it)")


def _check_tma_row(size, what):
    # TMA: every row stride a multiple of 16 bytes; FP8 rows are `size` bytes long.
    if size % 16:
        raise ValueError(f"{what} = {size} must be a multiple of 16 (TMA needs 16-byte aligned FP8 row strides)")


def _check_scale(s, name, shape, contiguous=True):
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(s.shape)}")
    if contiguous and not s.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_ends(ends_E, E, name="ends_E"):
    if ends_E.dtype != torch.int32 or ends_E.dim() != 1 or ends_E.numel() != E:
        raise ValueError(f"{name} must be a 1-D int32 tensor of {E} cumulative ends, got "
                         f"{ends_E.dtype} shape {tuple(ends_E.shape)}")
    if E < 1:
        raise ValueError("at least one expert is needed")


def _check_devices(*tensors):
    device = tensors[0].device
    if any(t.device != device for t in tensors if t is not None):
        raise ValueError("all tensors must be on one device")
    if device.type != "cuda" and not _interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (the *_reference twins run anywhere)")


def _blocks(size: int) -> int:
    return -(-size // SCALE_BLOCK)


# --- device tile tables ------------------------------------------------------------------------


class RowTiles(NamedTuple):
    """The row tiles of a grouped NT GEMM, on the device, in buffers of static size
    ``capacity = ceil(T / block_m) + E + 1``.

    Tile i covers rows [row_start[i], min(row_start[i] + block_m, row_end[i])) of expert
    ``expert[i]``; expert == E marks the tail (rows past ends_E[-1], written as zeros).
    ``count`` ([1]) is the number of tiles in use; entries from ``count`` on hold expert -1."""

    expert: torch.Tensor  # int32 [capacity]
    row_start: torch.Tensor  # int32 [capacity]
    row_end: torch.Tensor  # int32 [capacity]
    count: torch.Tensor  # int32 [1]
    block_m: int  # rows per tile

    def check(self, num_experts: int, num_rows: int, block_m: int):
        """ValueError unless these are the tiles of ``num_rows`` rows of ``num_experts`` experts
        in ``block_m``-row tiles (what a kernel reading them needs)."""
        capacity = -(-num_rows // block_m) + num_experts + 1
        if self.block_m != block_m or self.expert.numel() != capacity:
            raise ValueError(f"row tiles of {self.block_m} rows and capacity {self.expert.numel()} do not fit "
                             f"{num_rows} rows of {num_experts} experts in tiles of {block_m} (capacity {capacity})")


def row_tiles(ends_E: torch.Tensor, num_rows: int, block_m: int) -> RowTiles:
    """Row tiles of every expert segment (and the tail up to ``num_rows``), with torch ops
    on ``ends_E``'s device: no host sync, static sizes."""
    E = ends_E.numel()
    device = ends_E.device
    ends_G = torch.cat([ends_E.to(torch.int64), torch.full((1,), num_rows, dtype=torch.int64, device=device)])
    starts_G = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends_G[:-1]])
    tiles_G = torch.div(ends_G - starts_G + block_m - 1, block_m, rounding_mode="floor").clamp_min(0)
    tile_ends_G = torch.cumsum(tiles_G, 0)
    capacity = -(-num_rows // block_m) + E + 1
    index = torch.arange(capacity, device=device)
    group = torch.searchsorted(tile_ends_G, index, right=True)  # G + 1 = E + 1 past the last tile
    in_use = group <= E
    g = group.clamp(max=E)
    first_tile = tile_ends_G[g] - tiles_G[g]
    row_start = starts_G[g] + (index - first_tile) * block_m
    minus_one = torch.full_like(group, -1)
    zero = torch.zeros_like(group)
    return RowTiles(
        expert=torch.where(in_use, g, minus_one).to(torch.int32),
        row_start=torch.where(in_use, row_start, zero).to(torch.int32),
        row_end=torch.where(in_use, ends_G[g], zero).to(torch.int32),
        count=tile_ends_G[-1:].to(torch.int32),
        block_m=block_m,
    )


class TokenMajorLayout(NamedTuple):
    """Where the rows of a grouped [T, C] tensor land in its token-major copy [C, P]:
    expert e's rows fill columns from ``padded_ends_E[e-1]`` (a multiple of ``TOKEN_ALIGN``)
    on, the rest of its segment up to ``padded_ends_E[e]`` is zero. ``width`` P is static:
    T + E * (TOKEN_ALIGN - 1) rounded up, plus one spare block that takes the tail rows."""

    padded_ends_E: torch.Tensor  # int32 [E]
    column_T: torch.Tensor  # int64 [T]: the column row t lands in
    valid_T: torch.Tensor  # bool [T]: row t belongs to an expert (not the tail)
    width: int


def token_major_ends(ends_E: torch.Tensor, num_rows: int):
    """(padded_ends_E int32 [E], width P) of the token-major layout for ``ends_E``: each
    expert's token count rounded up to TOKEN_ALIGN, cumulated; P = T + E * (TOKEN_ALIGN - 1)
    rounded up, plus one spare block (device ops on E elements, static width)."""
    E = ends_E.numel()
    ends = ends_E.to(torch.int64)
    counts_E = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_E = torch.div(counts_E + TOKEN_ALIGN - 1, TOKEN_ALIGN, rounding_mode="floor") * TOKEN_ALIGN
    width = (-(-(num_rows + E * (TOKEN_ALIGN - 1)) // TOKEN_ALIGN) + 1) * TOKEN_ALIGN
    return torch.cumsum(padded_E, 0).to(torch.int32), width


def token_major_layout(ends_E: torch.Tensor, num_rows: int) -> TokenMajorLayout:
    """The token-major layout for ``ends_E`` (device ops only, static sizes)."""
    E = ends_E.numel()
    device = ends_E.device
    ends = ends_E.to(torch.int64)
    counts_E = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends_E, width = token_major_ends(ends_E, num_rows)
    padded_ends = padded_ends_E.to(torch.int64)
    rows = torch.arange(num_rows, device=device)
    expert_T = torch.searchsorted(ends, rows, right=True)
    valid_T = expert_T < E
    e = expert_T.clamp(max=E - 1)
    first_column_E = padded_ends - torch.diff(padded_ends, prepend=padded_ends.new_zeros(1))
    column = rows - (ends[e] - counts_E[e]) + first_column_E[e]
    column_T = torch.where(valid_T, column, torch.full_like(column, width - 1))
    return TokenMajorLayout(padded_ends_E, column_T, valid_T, width)


def to_token_major(x_TC: torch.Tensor, layout: TokenMajorLayout) -> torch.Tensor:
    """[C, P] copy of ``x_TC`` in ``layout``; zeros everywhere but the expert rows (the tail
    rows are zeroed, then dropped into the spare last column). Any dtype, FP8 included.
    Device ops only; a reference helper, not a fused fast path."""
    raw = x_TC.view(torch.uint8) if x_TC.dtype == FP8_DTYPE else x_TC
    raw = torch.where(layout.valid_T[:, None], raw, torch.zeros((), dtype=raw.dtype, device=raw.device))
    out = torch.zeros((x_TC.shape[1], layout.width), dtype=raw.dtype, device=x_TC.device)
    out[:, layout.column_T] = raw.t()
    return out.view(FP8_DTYPE) if x_TC.dtype == FP8_DTYPE else out


# --- Triton ------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _program_count(device_index: int) -> int:
    if _interpreting():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _set_allocator(device):
    # In-kernel TMA descriptors need a little global scratch per program, taken at launch
    # from the allocator Triton holds in a context variable (per thread: autograd's backward
    # thread needs its own), so it is set on every call.
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two kernels, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    tile = gemm_tile.parts()
    bounds, dot_step, add_into = tile.bounds, tile.dot_step, tile.add_into

    @triton.jit
    def grouped_nt_kernel(a_ptr, b_ptr, y_ptr, sa_ptr, sb_ptr,
                          tile_expert_ptr, tile_start_ptr, tile_end_ptr, tile_count_ptr,
                          T, N, K, E, sa_stride_t, sa_stride_k, Nt, Kt,
                          BLOCKWISE: tl.constexpr, A_PER_ROW: tl.constexpr, FAST_ACCUM: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr):
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
        n_tiles = tl.cdiv(N, BN)
        work = tl.load(tile_count_ptr) * n_tiles
        # Consecutive work items share a row tile (its A block stays in L2 for the N tiles).
        for w in range(tl.program_id(0), work, PROGRAMS):
            mt = w // n_tiles
            n0 = (w - mt * n_tiles) * BN
            e = tl.load(tile_expert_ptr + mt)
            m0 = tl.load(tile_start_ptr + mt)
            row_end = tl.load(tile_end_ptr + mt)
            expert_rows = e < E  # the tail tile (e == E) computes nothing and writes zeros
            rows, cols, row_in, col_in = bounds(m0, n0, row_end, N, BM, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            k_stop = tl.where(expert_rows, K, 0)
            for k in range(0, k_stop, BK):
                a = a_desc.load([m0, k])
                b = b_desc.load([e * N + n0, k])
                scale_rows, scale_cols = 1.0, 1.0
                if BLOCKWISE:
                    kb = k // BK
                    sa = tl.load(sa_ptr + rows.to(tl.int64) * sa_stride_t + kb * sa_stride_k, mask=row_in, other=0.0)
                    if BN == BK:  # one 128x128 weight tile: one scale for the whole output tile
                        scale_rows = (sa * tl.load(sb_ptr + (e * Nt + n0 // BK) * Kt + kb))[:, None]
                    else:
                        scale_rows = sa[:, None]
                        scale_cols = tl.load(sb_ptr + (e * Nt + cols // BK) * Kt + kb, mask=col_in, other=0.0)[None, :]
                acc = dot_step(acc, a, b, scale_rows, scale_cols, BLOCKWISE, FAST_ACCUM)
            if not BLOCKWISE:
                if A_PER_ROW:
                    sa = tl.load(sa_ptr + rows, mask=row_in & expert_rows, other=0.0)
                    acc = acc * sa[:, None]
                else:
                    acc = acc * tl.load(sa_ptr + e, mask=expert_rows, other=0.0)
                acc = acc * tl.load(sb_ptr + e, mask=expert_rows, other=0.0)
            at = rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(y_ptr + at, acc.to(tl.bfloat16), mask=row_in[:, None] & col_in[None, :])

    @triton.jit
    def grouped_wgrad_kernel(a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, padded_ends_ptr,
                             N, K, P, E, sa_stride_n, sa_stride_p, sb_stride_k, sb_stride_p,
                             BLOCKWISE: tl.constexpr, FAST_ACCUM: tl.constexpr, ACCUMULATE: tl.constexpr,
                             OUT_BF16: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr):
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, P], strides=[P, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, P], strides=[P, 1], block_shape=[BN, BK])
        m_tiles = tl.cdiv(N, BM)
        n_tiles = tl.cdiv(K, BN)
        per_expert = m_tiles * n_tiles
        for w in range(tl.program_id(0), E * per_expert, PROGRAMS):
            e = w // per_expert
            r = w - e * per_expert
            mt = r // n_tiles
            m0 = mt * BM
            n0 = (r - mt * n_tiles) * BN
            p_start = tl.load(padded_ends_ptr + e - 1, mask=e > 0, other=0)
            p_end = tl.load(padded_ends_ptr + e)
            rows, cols, row_in, col_in = bounds(m0, n0, N, K, BM, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for p in range(p_start, p_end, BK):
                a = a_desc.load([m0, p])
                b = b_desc.load([n0, p])
                scale_rows, scale_cols = 1.0, 1.0
                if BLOCKWISE:
                    pb = p // BK
                    scale_rows = tl.load(sa_ptr + rows * sa_stride_n + pb * sa_stride_p, mask=row_in, other=0.0)[:, None]
                    scale_cols = tl.load(sb_ptr + cols * sb_stride_k + pb * sb_stride_p, mask=col_in, other=0.0)[None, :]
                acc = dot_step(acc, a, b, scale_rows, scale_cols, BLOCKWISE, FAST_ACCUM)
            if not BLOCKWISE:
                acc = acc * (tl.load(sa_ptr + e) * tl.load(sb_ptr + e))
            at = e.to(tl.int64) * N * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
            inside = row_in[:, None] & col_in[None, :]
            if ACCUMULATE:
                add_into(out_ptr, at, inside, acc)
            elif OUT_BF16:
                tl.store(out_ptr + at, acc.to(tl.bfloat16), mask=inside)
            else:
                tl.store(out_ptr + at, acc, mask=inside)

    return grouped_nt_kernel, grouped_wgrad_kernel


# --- public kernels ----------------------------------------------------------------------------


def _check_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, recipe, a_per_row):
    _check_recipe(recipe)
    _check_fp8(a8_TK, "a8_TK", 2)
    _check_fp8(b8_ENK, "b8_ENK", 3)
    T, K = a8_TK.shape
    E, N, Kb = b8_ENK.shape
    if Kb != K:
        raise ValueError(f"a8_TK's K ({K}) and b8_ENK's K ({Kb}) differ")
    _check_ends(ends_E, E)
    _check_tma_row(K, "K")
    if recipe == "blockwise":
        if K % SCALE_BLOCK:
            raise ValueError(f"blockwise needs K % {SCALE_BLOCK} == 0 (whole 1x128 / 128x128 scale blocks), K = {K}")
        if a_per_row:
            raise ValueError("a_per_row is a tensorwise option (blockwise A scales are per row and K block)")
        _check_scale(scale_inv_a, "scale_inv_a (1x128, [T, K/128])", (T, K // SCALE_BLOCK), contiguous=False)
        _check_scale(scale_inv_b, "scale_inv_b (128x128, [E, ceil(N/128), K/128])", (E, _blocks(N), K // SCALE_BLOCK))
    else:
        _check_scale(scale_inv_a, "scale_inv_a (per row)" if a_per_row else "scale_inv_a (per expert)",
                     (T,) if a_per_row else (E,))
        _check_scale(scale_inv_b, "scale_inv_b (per expert)", (E,))
    return T, K, E, N


def fp8_grouped_nt(a8_TK: torch.Tensor, b8_ENK: torch.Tensor, ends_E: torch.Tensor,
                   scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor, recipe: str = "tensorwise", *,
                   a_per_row: bool = False, fast_accum: bool = True,
                   config: Union[None, str, GemmConfig] = None, tiles: Optional[RowTiles] = None) -> torch.Tensor:
    """y_TN (bf16) with y[t] = a_TK[t] . b_ENK[e]^T for the expert e owning row t; zero rows
    past ends_E[-1]. Fprop: (x8_TI, w8_EOI); dgrad: (dy8_TO, w8_EIO).

    Layouts: a8_TK [T, K] and b8_ENK [E, N, K], E4M3, contiguous, K-major; K % 16 == 0 (TMA
    16-byte row strides), and K % 128 == 0 for blockwise. ends_E: int32 [E], cumulative row
    ends on the device, nondecreasing, at most T (not checked: that would need a host sync).
    Scales (float32 scale_inv): tensorwise scale_inv_a [E] (or [T] with a_per_row),
    scale_inv_b [E]; blockwise scale_inv_a [T, K/128] (any strides: an MN-major copy, e.g.
    ``s.t().contiguous().t()``, gives coalesced reads), scale_inv_b [E, ceil(N/128), K/128]
    contiguous. ``fast_accum`` matters for tensorwise only (see the module docstring);
    ``config``: None (``pick_config``), a name from ``CONFIGS``, or a GemmConfig. ``tiles``:
    ``row_tiles(ends_E, T, block_m)`` of the configuration's block_m, where the caller
    derives them once for several GEMMs over the same rows (else built here)."""
    T, K, E, N = _check_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, recipe, a_per_row)
    blockwise = recipe == "blockwise"
    cfg = _resolve_config(config, "nt", recipe, K, N, fast_accum)
    _check_devices(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b)
    y_TN = torch.empty((T, N), dtype=torch.bfloat16, device=a8_TK.device)
    if T == 0 or N == 0:
        return y_TN
    if tiles is None:
        tiles = row_tiles(ends_E, T, cfg.block_m)
    tiles.check(E, T, cfg.block_m)
    grouped_nt_kernel, _ = _kernels()
    _set_allocator(a8_TK.device)
    programs = _program_count(a8_TK.device.index or 0)
    sa_stride_t, sa_stride_k = scale_inv_a.stride() if blockwise else (0, 0)
    grouped_nt_kernel[(programs,)](
        a8_TK, b8_ENK, y_TN, scale_inv_a, scale_inv_b, tiles.expert, tiles.row_start, tiles.row_end, tiles.count,
        T, N, K, E, sa_stride_t, sa_stride_k, _blocks(N), K // SCALE_BLOCK if blockwise else 0,
        BLOCKWISE=blockwise, A_PER_ROW=a_per_row, FAST_ACCUM=fast_accum and not blockwise,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, PROGRAMS=programs,
        num_stages=cfg.stages, num_warps=cfg.warps)
    return y_TN


def _check_wgrad(a8_NP, b8_KP, padded_ends_E, scale_inv_a, scale_inv_b, recipe, out_dtype, accumulate_into):
    _check_recipe(recipe)
    _check_fp8(a8_NP, "a8_NP", 2)
    _check_fp8(b8_KP, "b8_KP", 2)
    N, P = a8_NP.shape
    K, Pb = b8_KP.shape
    if Pb != P:
        raise ValueError(f"a8_NP's P ({P}) and b8_KP's P ({Pb}) differ")
    if P % TOKEN_ALIGN:
        raise ValueError(f"P = {P} must be a multiple of {TOKEN_ALIGN} (token_major_layout's width is)")
    if padded_ends_E.dtype != torch.int32 or padded_ends_E.dim() != 1 or padded_ends_E.numel() < 1:
        raise ValueError("padded_ends_E must be a 1-D int32 tensor with one padded cumulative end per expert")
    E = padded_ends_E.numel()
    if recipe == "blockwise":
        _check_scale(scale_inv_a, "scale_inv_a (1x128 along tokens, [N, P/128])", (N, P // SCALE_BLOCK), False)
        _check_scale(scale_inv_b, "scale_inv_b (1x128 along tokens, [K, P/128])", (K, P // SCALE_BLOCK), False)
    else:
        _check_scale(scale_inv_a, "scale_inv_a (per expert)", (E,))
        _check_scale(scale_inv_b, "scale_inv_b (per expert)", (E,))
    if accumulate_into is not None:
        if accumulate_into.dtype != torch.float32 or tuple(accumulate_into.shape) != (E, N, K) \
                or not accumulate_into.is_contiguous():
            raise ValueError(f"accumulate_into must be a contiguous float32 [E, N, K] = {(E, N, K)} tensor")
    elif out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32 or torch.bfloat16, not {out_dtype}")
    return N, K, P, E


def fp8_grouped_wgrad(a8_NP: torch.Tensor, b8_KP: torch.Tensor, padded_ends_E: torch.Tensor,
                      scale_inv_a: torch.Tensor, scale_inv_b: torch.Tensor, recipe: str = "tensorwise", *,
                      out_dtype: torch.dtype = torch.float32, accumulate_into: Optional[torch.Tensor] = None,
                      fast_accum: bool = False, config: Union[None, str, GemmConfig] = None) -> torch.Tensor:
    """dW_ENK[e] = a_NP[:, seg e] . b_KP[:, seg e]^T, seg e = [padded_ends_E[e-1], padded_ends_E[e]).
    wgrad of y_TO = x_TI . w_EOI^T: a = dy8_OP, b = x8_IP (N = O, K = I).

    Layouts: a8_NP [N, P], b8_KP [K, P], E4M3, contiguous, token-major: each expert's
    segment starts at a multiple of 128 columns and its pad columns are zero (what
    ``to_token_major`` writes); P % 128 == 0. padded_ends_E: int32 [E] on the device
    (``token_major_layout(...).padded_ends_E``). Scales (float32 scale_inv): tensorwise
    [E] each; blockwise 1x128 along the tokens, scale_inv_a [N, P/128] and scale_inv_b
    [K, P/128] (any strides). Output [E, N, K] in ``out_dtype`` (float32 or bfloat16), or,
    with ``accumulate_into`` (float32 [E, N, K], e.g. Megatron's main_grad), that tensor
    updated in place to accumulate_into + dW and returned. An expert without tokens gets
    zeros (or accumulate_into unchanged). ``fast_accum`` (tensorwise only) defaults to False:
    an expert's contraction runs over thousands of tokens."""
    N, K, P, E = _check_wgrad(a8_NP, b8_KP, padded_ends_E, scale_inv_a, scale_inv_b, recipe, out_dtype,
                              accumulate_into)
    blockwise = recipe == "blockwise"
    cfg = _resolve_config(config, "wgrad", recipe, K, N, fast_accum)
    _check_devices(a8_NP, b8_KP, padded_ends_E, scale_inv_a, scale_inv_b, accumulate_into)
    if accumulate_into is not None:
        out_ENK = accumulate_into
    else:
        out_ENK = torch.empty((E, N, K), dtype=out_dtype, device=a8_NP.device)
    if N == 0 or K == 0:
        return out_ENK
    _, grouped_wgrad_kernel = _kernels()
    _set_allocator(a8_NP.device)
    programs = _program_count(a8_NP.device.index or 0)
    sa_strides = scale_inv_a.stride() if blockwise else (0, 0)
    sb_strides = scale_inv_b.stride() if blockwise else (0, 0)
    grouped_wgrad_kernel[(programs,)](
        a8_NP, b8_KP, out_ENK, scale_inv_a, scale_inv_b, padded_ends_E, N, K, P, E, *sa_strides, *sb_strides,
        BLOCKWISE=blockwise, FAST_ACCUM=fast_accum and not blockwise, ACCUMULATE=accumulate_into is not None,
        OUT_BF16=out_ENK.dtype == torch.bfloat16,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, PROGRAMS=programs,
        num_stages=cfg.stages, num_warps=cfg.warps)
    return out_ENK


# --- the PyTorch twins -------------------------------------------------------------------------


def _expand_blocks(s, sizes):
    """Each entry of ``s`` repeated over its 128-block along every dimension, cut to ``sizes``."""
    for dim, size in enumerate(sizes):
        s = s.repeat_interleave(SCALE_BLOCK, dim=dim).narrow(dim, 0, size)
    return s


def _matmul_fp32(a, b_t):
    """a @ b_t in IEEE float32 (TF32 off for the call, whatever the process chose)."""
    if a.device.type != "cuda":
        return a @ b_t
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a @ b_t
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def fp8_grouped_nt_reference(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, recipe="tensorwise", *,
                             a_per_row=False, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The twin of ``fp8_grouped_nt`` (same arguments and scale semantics): each operand
    dequantized to float32, one float32 matmul per expert, rounded to ``out_dtype`` once.
    Reads ``ends_E`` on the host (not graph-safe); runs on CPU or GPU."""
    T, K, E, N = _check_nt(a8_TK, b8_ENK, ends_E, scale_inv_a, scale_inv_b, recipe, a_per_row)
    y = torch.zeros((T, N), dtype=torch.float32, device=a8_TK.device)
    bounds = [0] + [int(v) for v in ends_E.cpu()]
    if any(hi < lo for lo, hi in zip(bounds, bounds[1:])) or bounds[-1] > T:
        raise ValueError(f"ends_E must be nondecreasing and at most T = {T}")
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        a = a8_TK[lo:hi].float()
        b = b8_ENK[e].float()
        if recipe == "blockwise":
            a = a * scale_inv_a[lo:hi].repeat_interleave(SCALE_BLOCK, dim=1)[:, :K]  # 1x128: rows not blocked
            b = b * _expand_blocks(scale_inv_b[e], (N, K))
        else:
            a = a * (scale_inv_a[lo:hi, None] if a_per_row else scale_inv_a[e])
            b = b * scale_inv_b[e]
        y[lo:hi] = _matmul_fp32(a, b.t())
    return y.to(out_dtype)


def fp8_grouped_wgrad_reference(a8_NP, b8_KP, padded_ends_E, scale_inv_a, scale_inv_b, recipe="tensorwise", *,
                                out_dtype=torch.float32, accumulate_into=None) -> torch.Tensor:
    """The twin of ``fp8_grouped_wgrad``: per expert, its token columns of both operands
    dequantized to float32 and multiplied in float32; plus ``accumulate_into`` (returned as
    a new tensor, the argument is left alone). Reads ``padded_ends_E`` on the host."""
    N, K, P, E = _check_wgrad(a8_NP, b8_KP, padded_ends_E, scale_inv_a, scale_inv_b, recipe, out_dtype,
                              accumulate_into)
    bounds = [0] + [int(v) for v in padded_ends_E.cpu()]
    if any(hi < lo or hi % TOKEN_ALIGN for lo, hi in zip(bounds, bounds[1:])) or bounds[-1] > P:
        raise ValueError(f"padded_ends_E must be nondecreasing multiples of {TOKEN_ALIGN}, at most P = {P}")
    out = torch.zeros((E, N, K), dtype=torch.float32, device=a8_NP.device)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        a = a8_NP[:, lo:hi].float()
        b = b8_KP[:, lo:hi].float()
        if recipe == "blockwise":
            blocks = slice(lo // SCALE_BLOCK, -(-hi // SCALE_BLOCK))
            a = a * scale_inv_a[:, blocks].repeat_interleave(SCALE_BLOCK, dim=1)[:, : hi - lo]
            b = b * scale_inv_b[:, blocks].repeat_interleave(SCALE_BLOCK, dim=1)[:, : hi - lo]
        else:
            a = a * scale_inv_a[e]
            b = b * scale_inv_b[e]
        out[e] = _matmul_fp32(a, b.t())
    if accumulate_into is not None:
        return accumulate_into + out
    return out.to(out_dtype)
