"""FP8 scale arithmetic of the tensorwise and blockwise recipes, in plain PyTorch (CPU or GPU).

This module holds the numerics that an FP8 grouped GEMM path must reproduce: how an amax
becomes a scale, which elements share a scale, and how a value is rounded into E4M3. It is
the reference the fused GPU kernels are checked against, not a fast path.

Recipes, with Transformer Engine's semantics (TE 2.20: ``Float8CurrentScaling``,
``Float8BlockScaling``, and its ``compute_scale_from_amax``):

- tensorwise: one scale for the whole tensor (TE's current scaling). Defaults as TE's
  recipe: scales are not forced to powers of two (TE's env switch
  ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1`` maps to ``power_2_scale=True``), epsilon 0.
- blockwise 1x128: one scale per 128 consecutive elements along the last dimension, the
  contraction dimension K of a GEMM operand (activations and output gradients).
- blockwise 128x128: one scale per 128x128 tile of the last two dimensions (weights).
  Blockwise defaults as TE's recipe: scales are powers of two (``power_2_scale=True``;
  TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` maps to ``power_2_scale=False``), epsilon 0.

Scale from amax (the same rule for every recipe), all in float32:

1. amax below ``epsilon`` is raised to ``epsilon``;
2. amax of 0, +inf or NaN gives scale 1 (nothing to fit, or nothing sensible to fit);
3. otherwise scale = 448 / amax, rounded to nearest;
4. a scale that overflows float32 (amax below about 1.3e-36) becomes ``value_for_inf``:
   float32's largest value for tensorwise, the largest value of the input's dtype for
   blockwise (as TE's kernels do);
5. with ``power_2_scale`` the scale's mantissa bits are cleared: it is rounded down to a
   power of two, so amax * scale never exceeds 448;
6. scale_inv = 1 / scale, rounded to nearest (what the GEMM multiplies back).

Quantization: q = E4M3(x * scale), the product rounded to float32, then to the nearest E4M3
value (ties to even, subnormals kept), saturating at +-448.

NaN and inf policy (TE's kernels reduce with fmaxf, which skips NaN): a NaN element does not
take part in its block's amax and stays NaN in the FP8 data (and so in the dequantized
values); a block of NaNs only has scale 1. An infinite element makes its block's amax inf,
hence scale 1, and saturates to +-448.

Partial tiles (a tiled dimension that is not a multiple of 128): refused by default
(``partial="refuse"`` raises ValueError), since the blockwise GEMMs read whole 128-element
K blocks. ``partial="pad"`` quantizes as if the tensor were zero-padded to the next multiple
of 128 (zeros do not change an amax): the last block's scale covers the elements present,
which is what TE's quantization kernels do; the data keeps its shape and the scale grid has
ceil(dim / 128) entries along that dimension.

Names carry their shapes: ``x_TK`` (rows, contraction), ``w_ENK`` (experts, output features,
contraction), ``scale_inv_TKt`` (one per row and per K block), ``scale_inv_ENtKt`` (one per
expert and 128x128 tile). Leading dimensions are free: ``x_TK`` may be [..., K] and
``w_ENK`` [..., N, K].
"""

from typing import Tuple

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128
FP32_MAX = torch.finfo(torch.float32).max

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXPONENT_BITS = -(1 << 23)  # 0xFF800000 as a signed int32: sign and exponent of a float32
_PARTIAL = ("refuse", "pad")


def scale_from_amax(
    amax: torch.Tensor,
    *,
    power_2_scale: bool,
    epsilon: float = 0.0,
    fp8_max: float = E4M3_MAX,
    value_for_inf: float = FP32_MAX,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) in float32, elementwise over ``amax``, by the rule in the module
    docstring."""
    amax = amax.to(torch.float32)
    if epsilon > 0:
        amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    unscaled = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    ones = torch.ones_like(amax)
    scale = torch.full_like(amax, fp8_max) / torch.where(unscaled, ones, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(unscaled, ones, scale)
    if power_2_scale:
        scale = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return scale, torch.reciprocal(scale)


def _check_input(x: torch.Tensor, name: str):
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: FP8 quantization takes float32, bfloat16 or float16, not {x.dtype}")


def _tiles(size: int, partial: str, what: str) -> int:
    """Blocks of 128 along a dimension of ``size`` elements, by the partial-tile policy."""
    if partial not in _PARTIAL:
        raise ValueError(f"partial must be one of {_PARTIAL}, not {partial!r}")
    if size % BLOCK and partial == "refuse":
        raise ValueError(
            f"{what} = {size} is not a multiple of {BLOCK}: blockwise FP8 needs whole {BLOCK}-element "
            f"blocks (pad the tensor, or pass partial='pad' to scale the last block over what it holds)"
        )
    return -(-size // BLOCK)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN read as 0: an amax over it skips NaNs as fmaxf does."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def _to_e4m3(x_scaled: torch.Tensor) -> torch.Tensor:
    """float32 values to E4M3: saturate at +-448 (NaN stays NaN), then round to nearest even."""
    return x_scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


# --- tensorwise ------------------------------------------------------------------------------


def quantize_tensorwise(
    x: torch.Tensor, *, power_2_scale: bool = False, epsilon: float = 0.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8, scale_inv): ``x`` in E4M3 with one scale for the whole tensor; scale_inv is a
    0-dim float32 tensor."""
    _check_input(x, "x")
    if x.numel():
        amax = _magnitude(x).amax().float()
    else:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale, scale_inv = scale_from_amax(amax, power_2_scale=power_2_scale, epsilon=epsilon)
    return _to_e4m3(x.float() * scale), scale_inv


def dequantize_tensorwise(x8: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (x8.float() * scale_inv).to(dtype)


# --- blockwise 1x128 (activations, output gradients) -----------------------------------------


def quantize_1x128(
    x_TK: torch.Tensor, *, power_2_scale: bool = True, epsilon: float = 0.0, partial: str = "refuse"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8_TK, scale_inv_TKt): one scale per 128 consecutive elements of the last dimension.

    For a GEMM's K-major operand the last dimension is K. For wgrad (K = tokens) pass the
    transposed operand, e.g. ``x_TK.t()`` for [K, T] data with scales along T."""
    _check_input(x_TK, "x_TK")
    *lead, k = x_TK.shape
    kt = _tiles(k, partial, "the last dimension (K)")
    padded = F.pad(x_TK, (0, kt * BLOCK - k)) if kt * BLOCK != k else x_TK
    tiles = padded.reshape(*lead, kt, BLOCK)
    amax_TKt = _magnitude(tiles).amax(dim=-1).float()
    scale_TKt, scale_inv_TKt = scale_from_amax(
        amax_TKt, power_2_scale=power_2_scale, epsilon=epsilon, value_for_inf=torch.finfo(x_TK.dtype).max
    )
    x8 = _to_e4m3(tiles.float() * scale_TKt[..., None]).reshape(*lead, kt * BLOCK)
    return x8[..., :k].contiguous(), scale_inv_TKt


def dequantize_1x128(x8_TK: torch.Tensor, scale_inv_TKt: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    k = x8_TK.shape[-1]
    per_element = scale_inv_TKt.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (x8_TK.float() * per_element).to(dtype)


# --- blockwise 128x128 (weights) -------------------------------------------------------------


def quantize_128x128(
    w_ENK: torch.Tensor, *, power_2_scale: bool = True, epsilon: float = 0.0, partial: str = "refuse"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w8_ENK, scale_inv_ENtKt): one scale per 128x128 tile of the last two dimensions."""
    _check_input(w_ENK, "w_ENK")
    if w_ENK.dim() < 2:
        raise ValueError(f"w_ENK needs at least 2 dimensions, got shape {tuple(w_ENK.shape)}")
    *lead, n, k = w_ENK.shape
    nt = _tiles(n, partial, "the second-to-last dimension (N)")
    kt = _tiles(k, partial, "the last dimension (K)")
    padded = w_ENK
    if (nt * BLOCK, kt * BLOCK) != (n, k):
        padded = F.pad(w_ENK, (0, kt * BLOCK - k, 0, nt * BLOCK - n))
    tiles = padded.reshape(*lead, nt, BLOCK, kt, BLOCK)
    amax_ENtKt = _magnitude(tiles).amax(dim=(-3, -1)).float()
    scale_ENtKt, scale_inv_ENtKt = scale_from_amax(
        amax_ENtKt, power_2_scale=power_2_scale, epsilon=epsilon, value_for_inf=torch.finfo(w_ENK.dtype).max
    )
    w8 = _to_e4m3(tiles.float() * scale_ENtKt[..., :, None, :, None]).reshape(*lead, nt * BLOCK, kt * BLOCK)
    return w8[..., :n, :k].contiguous(), scale_inv_ENtKt


def dequantize_128x128(w8_ENK: torch.Tensor, scale_inv_ENtKt: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    n, k = w8_ENK.shape[-2:]
    per_element = scale_inv_ENtKt.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return (w8_ENK.float() * per_element[..., :n, :k]).to(dtype)


def transpose_128x128(w8_ENK: torch.Tensor, scale_inv_ENtKt: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w8_EKN, scale_inv_EKtNt): the same quantized weights laid out for the other GEMM
    (dgrad reads W^T). A 128x128 tile covers the same elements either way, so this moves
    data and scales and quantizes nothing again; it equals quantizing the transpose."""
    return w8_ENK.transpose(-2, -1).contiguous(), scale_inv_ENtKt.transpose(-2, -1).contiguous()
