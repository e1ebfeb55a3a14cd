"""fp8_scaling on CPU, against a float64 reference written here from the definitions:

- E4M3 (the ``fn`` variant): 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
  infinities, one NaN pattern per sign; normals (1 + m/8) * 2**(e - 7) for e in 1..15 (the
  all-ones code of e = 15 is NaN, so the largest value is 448), subnormals m/8 * 2**-6.
  Rounding to nearest, ties to even; values beyond 448 saturate (as CUDA's
  __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...) does in TE's kernels).
- Scales: the rule TE's compute_scale_from_amax applies (the module's docstring lists it);
  float32 arithmetic is modelled in float64 followed by a rounding to float32 (exact for
  products of two float32 values; correctly rounded for a quotient, since float64 carries
  more than twice float32's precision).

No expected value below is computed by the code under test.
"""

import math
import struct

import pytest
import torch

from megatron.moe_patches.kernels import fp8_scaling as fs

FMAX = 448.0
FLT_MAX = (2 - 2**-23) * 2**127
BF16_MAX = (2 - 2**-7) * 2**127


# --- the reference ---------------------------------------------------------------------------


def f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (ties to even), overflowing to +-inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    if abs(v) >= (2 - 2**-24) * 2**127:  # at or past the midpoint above float32's largest
        return math.copysign(math.inf, v)
    return struct.unpack("f", struct.pack("f", v))[0]


def e4m3_nearest(v: float) -> float:
    """The E4M3 value nearest ``v`` (ties to even), saturating at +-448; NaN stays NaN."""
    if math.isnan(v):
        return v
    a = abs(v)
    if a == 0:
        return v
    if a >= FMAX:
        return math.copysign(FMAX, v)
    _, e = math.frexp(a)  # a = m * 2**e with 0.5 <= m < 1: floor(log2(a)) = e - 1
    exponent = max(e - 1, -6)  # below 2**-6 the spacing stays that of the subnormals
    spacing = 2.0 ** (exponent - 3)
    return math.copysign(round(a / spacing) * spacing, v)  # round(): half to even


def e4m3_grid():
    """Every finite non-negative E4M3 value, decoded from its bit pattern."""
    values = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return values


def ref_scale(amax: float, power_2: bool, epsilon: float = 0.0, value_for_inf: float = FLT_MAX):
    """(scale, scale_inv) as python floats (epsilon is a float32 parameter, as in TE)."""
    epsilon = f32(epsilon)
    if amax < epsilon:
        amax = epsilon
    if amax == 0 or math.isinf(amax) or math.isnan(amax):
        scale = 1.0
    else:
        scale = f32(FMAX / amax)
        if math.isinf(scale):
            scale = value_for_inf
        if power_2:
            scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return scale, f32(1.0 / scale)


def ref_block(values, power_2, epsilon=0.0, value_for_inf=FLT_MAX):
    """One block sharing a scale: (fp8 values, scale_inv, dequantized values)."""
    amax = max((abs(v) for v in values if not math.isnan(v)), default=0.0)
    scale, scale_inv = ref_scale(amax, power_2, epsilon, value_for_inf)
    q = [e4m3_nearest(f32(v * scale)) for v in values]
    return q, scale_inv, [f32(v * scale_inv) for v in q]


def ref_1x128(x_TK: torch.Tensor, power_2: bool, value_for_inf: float):
    rows = x_TK.double().reshape(-1, x_TK.shape[-1]).tolist()
    k = x_TK.shape[-1]
    q, s, d = [], [], []
    for row in rows:
        q_row, s_row, d_row = [], [], []
        for start in range(0, k, 128):
            qb, sb, db = ref_block(row[start:start + 128], power_2, value_for_inf=value_for_inf)
            q_row += qb
            s_row.append(sb)
            d_row += db
        q.append(q_row)
        s.append(s_row)
        d.append(d_row)
    lead = x_TK.shape[:-1]
    as_tensor = lambda rows, width: torch.tensor(rows, dtype=torch.float64).reshape(*lead, width)
    return as_tensor(q, k), as_tensor(s, len(s[0]) if s else 0), as_tensor(d, k)


def ref_128x128(w_ENK: torch.Tensor, power_2: bool, value_for_inf: float):
    w = w_ENK.double()
    *lead, n, k = w.shape
    w = w.reshape(-1, n, k)
    q = torch.empty_like(w)
    d = torch.empty_like(w)
    s = torch.empty((w.shape[0], -(-n // 128), -(-k // 128)), dtype=torch.float64)
    for e in range(w.shape[0]):
        for i, r0 in enumerate(range(0, n, 128)):
            for j, c0 in enumerate(range(0, k, 128)):
                tile = w[e, r0:r0 + 128, c0:c0 + 128]
                qb, sb, db = ref_block(tile.reshape(-1).tolist(), power_2, value_for_inf=value_for_inf)
                q[e, r0:r0 + 128, c0:c0 + 128] = torch.tensor(qb, dtype=torch.float64).reshape(tile.shape)
                d[e, r0:r0 + 128, c0:c0 + 128] = torch.tensor(db, dtype=torch.float64).reshape(tile.shape)
                s[e, i, j] = sb
    return q.reshape(*lead, n, k), s.reshape(*lead, *s.shape[1:]), d.reshape(*lead, n, k)


def assert_exact(actual: torch.Tensor, expected: torch.Tensor):
    """Same shape and the same values (NaN where NaN); -0 and +0 count as equal."""
    assert tuple(actual.shape) == tuple(expected.shape)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=0, equal_nan=True)


# --- inputs ----------------------------------------------------------------------------------


def tiled_input(shape, dtype, seed):
    """Random values whose magnitude changes from one 128-wide K block to the next (1e-30 to
    1e4), so each block gets a different scale; then blocks with special contents."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = shape[-1]
    blocks = -(-k // 128)
    exponents = torch.randint(-30, 5, shape[:-1] + (blocks,), generator=g).double()
    x = x * torch.pow(10.0, exponents).repeat_interleave(128, dim=-1)[..., :k]
    return x.to(dtype)


def with_special_blocks(x_TK: torch.Tensor) -> torch.Tensor:
    """Row 0: a zero block, a block whose amax is exactly 448 with values at +-448, a block
    just above 448; row 1: a block whose amax is too small for a float32 scale (the
    value_for_inf branch) and a block of E4M3-subnormal-sized values next to 448."""
    x = x_TK.clone()
    x[0, 0:128] = 0
    x[0, 128:256] = torch.linspace(-FMAX, FMAX, 128, dtype=torch.float64).to(x.dtype)
    x[0, 256:384] = x[0, 256:384].sign() * 449.0
    x[1, 0:128] = torch.linspace(-1e-37, 1e-37, 128, dtype=torch.float64).to(x.dtype)
    sub = torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**-9, -(2.0**-8), 5 * 2.0**-11, 0.0029296875, FMAX],
                       dtype=torch.float64)
    x[1, 128:128 + len(sub)] = sub.to(x.dtype)
    x[1, 128 + len(sub):256] = 0
    return x


# --- E4M3 rounding ---------------------------------------------------------------------------


def test_grid_values_and_midpoints_round_as_the_format_says():
    """With amax 448 the scale is exactly 1: every E4M3 value comes back as itself, every
    midpoint between neighbours goes to the even one, and nothing lands off the grid."""
    grid = e4m3_grid()
    assert len(grid) == 127 and grid[-1] == FMAX and grid[1] == 2.0**-9
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    values = grid + [-v for v in grid] + midpoints + [-v for v in midpoints]
    x = torch.tensor(values, dtype=torch.float32)
    x8, scale_inv = fs.quantize_tensorwise(x)
    assert x8.dtype == torch.float8_e4m3fn and scale_inv.item() == 1.0
    assert_exact(x8, torch.tensor([e4m3_nearest(v) for v in values]))
    # ties to even: the code of the result has an even mantissa
    for mid in midpoints:
        code = grid.index(e4m3_nearest(mid))
        assert code % 2 == 0, (mid, e4m3_nearest(mid))
    assert set(x8.float().abs().tolist()) <= set(grid)


# --- scales ----------------------------------------------------------------------------------

AMAXES = [0.0, 1e-45, 1e-37, 1.3e-36, 2.0**-20, 0.3, 1.0, 3.0, 447.0, 448.0, 449.0, 1000.0, 3e38,
          math.inf, math.nan]


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("value_for_inf", [FLT_MAX, BF16_MAX])
def test_scale_from_amax_follows_te_rule(power_2, value_for_inf):
    amax = torch.tensor(AMAXES, dtype=torch.float32)
    scale, scale_inv = fs.scale_from_amax(amax, power_2_scale=power_2, value_for_inf=value_for_inf)
    expected = [ref_scale(a, power_2, value_for_inf=value_for_inf) for a in amax.double().tolist()]
    assert scale.dtype == scale_inv.dtype == torch.float32
    assert_exact(scale, torch.tensor([s for s, _ in expected]))
    assert_exact(scale_inv, torch.tensor([s for _, s in expected]))
    if power_2:
        mantissa, _ = torch.frexp(scale)
        assert (mantissa == 0.5).all()
        finite = torch.isfinite(amax) & (amax > 0)
        assert (amax[finite] * scale[finite] <= FMAX).all()


def test_epsilon_floors_the_amax():
    amax = torch.tensor([0.0, 1e-6, 0.5, 2.0])
    scale, scale_inv = fs.scale_from_amax(amax, power_2_scale=False, epsilon=1e-3)
    expected = [ref_scale(a, False, epsilon=1e-3) for a in amax.double().tolist()]
    assert_exact(scale, torch.tensor([s for s, _ in expected]))
    assert_exact(scale_inv, torch.tensor([s for _, s in expected]))
    assert scale[0].item() == scale[1].item() == f32(FMAX / f32(1e-3))


# --- tensorwise ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_2", [False, True])
def test_tensorwise_matches_reference(dtype, power_2):
    x = (torch.randn(7, 45, generator=torch.Generator().manual_seed(3)) * 37.0).to(dtype)
    x8, scale_inv = fs.quantize_tensorwise(x, power_2_scale=power_2)
    q, s, d = ref_block(x.double().reshape(-1).tolist(), power_2)
    assert x8.dtype == torch.float8_e4m3fn and scale_inv.shape == ()
    assert_exact(x8, torch.tensor(q).reshape(7, 45))
    assert scale_inv.item() == s
    assert_exact(fs.dequantize_tensorwise(x8, scale_inv), torch.tensor(d).reshape(7, 45))


def test_tensorwise_zeros_and_empty_get_scale_one():
    x8, scale_inv = fs.quantize_tensorwise(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert scale_inv.item() == 1.0 and (x8.float() == 0).all()
    assert (fs.dequantize_tensorwise(x8, scale_inv) == 0).all()
    x8, scale_inv = fs.quantize_tensorwise(torch.zeros(0, 8))
    assert x8.shape == (0, 8) and scale_inv.item() == 1.0


def test_tensorwise_tiny_amax_uses_float32_max():
    """Tensorwise takes float32's largest value for a scale that overflows (TE's current
    scaling), whatever the input dtype."""
    x = torch.tensor([1e-37, -5e-38, 0.0], dtype=torch.bfloat16)
    x8, scale_inv = fs.quantize_tensorwise(x)
    q, s, d = ref_block(x.double().tolist(), False, value_for_inf=FLT_MAX)
    assert scale_inv.item() == s == f32(1 / FLT_MAX)
    assert_exact(x8, torch.tensor(q))


# --- blockwise 1x128 -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_2", [True, False])
def test_1x128_matches_reference(dtype, power_2):
    x_TK = with_special_blocks(tiled_input((5, 384), dtype, seed=1))
    x8, scale_inv = fs.quantize_1x128(x_TK, power_2_scale=power_2)
    q, s, d = ref_1x128(x_TK, power_2, value_for_inf=torch.finfo(dtype).max)
    assert x8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (5, 3)
    assert_exact(x8, q)
    assert_exact(scale_inv, s)
    assert_exact(fs.dequantize_1x128(x8, scale_inv), d)
    # the special blocks, spelled out
    assert scale_inv[0, 0].item() == 1.0 and (x8[0, :128].float() == 0).all()  # zero block
    assert scale_inv[0, 1].item() == 1.0 and x8[0, 128].item() == -FMAX and x8[0, 255].item() == FMAX
    assert (x8[0, 256:384].float().abs() <= FMAX).all()
    assert scale_inv[1, 0].item() == f32(1 / (2.0**127 if power_2 else torch.finfo(dtype).max))


def test_1x128_leading_dims_and_wgrad_layout():
    """Any leading dims; for wgrad the caller quantizes the transposed view (scales along
    tokens), which gives what quantizing a contiguous copy gives."""
    x = tiled_input((2, 3, 256), torch.bfloat16, seed=2)
    x8, scale_inv = fs.quantize_1x128(x)
    assert x8.shape == (2, 3, 256) and scale_inv.shape == (2, 3, 2)
    q, s, _ = ref_1x128(x, True, value_for_inf=torch.finfo(torch.bfloat16).max)
    assert_exact(x8, q)
    assert_exact(scale_inv, s)
    x_TI = tiled_input((256, 128), torch.bfloat16, seed=5)
    from_view = fs.quantize_1x128(x_TI.t())
    from_copy = fs.quantize_1x128(x_TI.t().contiguous())
    assert from_view[1].shape == (128, 2)
    assert torch.equal(from_view[0].view(torch.uint8), from_copy[0].view(torch.uint8))
    assert torch.equal(from_view[1], from_copy[1])


def test_1x128_partial_blocks_are_refused_or_padded():
    x = tiled_input((3, 200), torch.float32, seed=4)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fs.quantize_1x128(x)
    x8, scale_inv = fs.quantize_1x128(x, partial="pad")
    assert x8.shape == (3, 200) and scale_inv.shape == (3, 2)
    q, s, d = ref_1x128(x, True, value_for_inf=FLT_MAX)  # its last block holds 72 values
    assert_exact(x8, q)
    assert_exact(scale_inv, s)
    assert_exact(fs.dequantize_1x128(x8, scale_inv), d)


# --- NaN and inf -----------------------------------------------------------------------------


def test_nan_skips_the_amax_and_stays_nan_inf_gives_scale_one():
    x = torch.full((3, 256), 0.25)
    x[0, 5] = math.nan  # block (0, 0): amax 0.25 from the others
    x[1, 0:128] = math.nan  # block (1, 0): nothing but NaN
    x[2, 130] = math.inf  # block (2, 1): amax inf
    x[2, 131] = -math.inf
    x8, scale_inv = fs.quantize_1x128(x, power_2_scale=False)
    q, s, d = ref_1x128(x, False, value_for_inf=FLT_MAX)
    assert_exact(x8, q)
    assert_exact(scale_inv, s)
    assert_exact(fs.dequantize_1x128(x8, scale_inv), d)
    assert scale_inv[0, 0].item() == f32(1 / f32(FMAX / 0.25)) and math.isnan(x8[0, 5].float().item())
    assert scale_inv[1, 0].item() == 1.0 and torch.isnan(x8[1, :128].float()).all()
    assert scale_inv[2, 1].item() == 1.0
    assert x8[2, 130].float().item() == FMAX and x8[2, 131].float().item() == -FMAX
    assert x8[2, 132].float().item() == 0.25  # scale 1 leaves the finite values as they are
    w = torch.full((128, 128), 2.0)
    w[3, 4] = math.nan
    w8, w_scale_inv = fs.quantize_128x128(w)
    assert w_scale_inv.item() == 1 / 128 and math.isnan(w8[3, 4].float().item())
    t8, t_scale_inv = fs.quantize_tensorwise(w)
    assert t_scale_inv.item() == f32(1 / 224.0) and math.isnan(t8[3, 4].float().item())


# --- blockwise 128x128 -----------------------------------------------------------------------


def weight_input(shape, dtype, seed):
    """Random weights with a different magnitude in each 128x128 tile, one zero tile."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    exponents = torch.randint(-25, 4, (*lead, -(-n // 128), -(-k // 128)), generator=g).double()
    per_tile = torch.pow(10.0, exponents).repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    w = w * per_tile[..., :n, :k]
    w.reshape(-1, n, k)[0, :128, :128] = 0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_2", [True, False])
def test_128x128_matches_reference(dtype, power_2):
    w_ENK = weight_input((2, 256, 384), dtype, seed=7)
    w_ENK[1, 128, 200] = FMAX  # a tile whose amax is exactly 448
    w_ENK[1, 129, 201] = -FMAX
    w_ENK[0, 128:256, 0:128] *= 1e-37 / w_ENK[0, 128:256, 0:128].abs().max()  # amax too small
    w8, scale_inv = fs.quantize_128x128(w_ENK, power_2_scale=power_2)
    q, s, d = ref_128x128(w_ENK, power_2, value_for_inf=torch.finfo(dtype).max)
    assert w8.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 2, 3)
    assert_exact(w8, q)
    assert_exact(scale_inv, s)
    assert_exact(fs.dequantize_128x128(w8, scale_inv), d)
    assert scale_inv[0, 0, 0].item() == 1.0 and (w8[0, :128, :128].float() == 0).all()
    assert scale_inv[0, 1, 0].item() == f32(1 / (2.0**127 if power_2 else torch.finfo(dtype).max))


def test_128x128_partial_tiles_are_refused_or_padded():
    w = weight_input((200, 130), torch.float32, seed=9)
    with pytest.raises(ValueError, match="N\\) = 200"):
        fs.quantize_128x128(w)
    with pytest.raises(ValueError, match="K\\) = 130"):
        fs.quantize_128x128(w[:128])
    w8, scale_inv = fs.quantize_128x128(w, partial="pad")
    assert w8.shape == (200, 130) and scale_inv.shape == (2, 2)
    q, s, d = ref_128x128(w, True, value_for_inf=FLT_MAX)
    assert_exact(w8, q)
    assert_exact(scale_inv, s)
    assert_exact(fs.dequantize_128x128(w8, scale_inv), d)


def test_128x128_transpose_equals_quantizing_the_transpose():
    """dgrad reads W^T: moving the FP8 data and the tile scales gives the same bits as
    quantizing the transposed weights, so the weights are quantized once per step."""
    w_ENK = weight_input((3, 256, 384), torch.bfloat16, seed=11)
    w8_EKN, scale_inv_EKtNt = fs.transpose_128x128(*fs.quantize_128x128(w_ENK))
    direct = fs.quantize_128x128(w_ENK.transpose(1, 2))
    assert w8_EKN.shape == (3, 384, 256) and scale_inv_EKtNt.shape == (3, 3, 2)
    assert torch.equal(w8_EKN.view(torch.uint8), direct[0].view(torch.uint8))
    assert torch.equal(scale_inv_EKtNt, direct[1])


# --- defaults and refusals -------------------------------------------------------------------


def test_defaults_follow_te_recipes():
    """Blockwise scales are powers of two by default (Float8BlockScaling); tensorwise ones
    are not (Float8CurrentScaling)."""
    x = torch.full((1, 128), 3.0)
    _, block_scale_inv = fs.quantize_1x128(x)
    _, tile_scale_inv = fs.quantize_128x128(torch.full((128, 128), 3.0))
    _, tensor_scale_inv = fs.quantize_tensorwise(x)
    assert block_scale_inv.item() == tile_scale_inv.item() == 2.0**-7  # 448/3 = 149.3 -> 128
    assert tensor_scale_inv.item() == f32(1 / f32(FMAX / 3.0))


def test_refuses_other_dtypes_and_unknown_partial_policy():
    with pytest.raises(TypeError, match="float64"):
        fs.quantize_1x128(torch.zeros(2, 128, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        fs.quantize_128x128(torch.zeros(128, 128, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        fs.quantize_tensorwise(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="partial"):
        fs.quantize_1x128(torch.zeros(2, 128), partial="crop")
    with pytest.raises(ValueError, match="w_ENK needs at least 2 dimensions"):
        fs.quantize_128x128(torch.zeros(128))
