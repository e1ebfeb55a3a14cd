"""The PyTorch twins of the FP8 grouped GEMM kernels (kernels/fp8_grouped_gemm.py) on CPU:
against an independent float64 loop per expert that dequantizes with fp8_scaling's
functions; the device tile tables and the token-major layout against Python loops; and the
refusals of shapes the kernels cannot take (raised before anything needs a GPU or Triton).

Tolerance: both sides read the same FP8 values and scales; the twin multiplies in float32,
the reference in float64, so they differ by float32 accumulation (|error| <= K * 2**-24 *
sum_k |a_k b_k|, bounded here with K * 2**-23) plus the twin's one rounding to its output
dtype (half an ulp: 2**-8 relative for bf16, 2**-24 for float32)."""

import pytest
import torch

from megatron.moe_patches.kernels import fp8_scaling as fs
from megatron.moe_patches.kernels import fp8_grouped_gemm as g

FP8 = torch.float8_e4m3fn


def random_fp8(*shape, gen):
    return (torch.randn(*shape, generator=gen) * 40).to(FP8)


def ends_of(counts):
    return torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)


def power_of_two_scales(*shape, gen):
    return torch.exp2(torch.randint(-8, 3, shape, generator=gen).float())


def assert_within(out, ref64, magnitude64, contraction, out_rounding):
    """|out - ref| <= out_rounding * |ref| + contraction * 2**-23 * sum|a b| (+ a denormal floor)."""
    bound = out_rounding * ref64.abs() + contraction * 2.0**-23 * magnitude64 + 1e-30
    excess = (out.double() - ref64).abs() - bound
    assert excess.max() <= 0, f"error over the bound by {excess.max().item()}"


# --- fprop / dgrad twin ----------------------------------------------------------------------


def nt_float64(a8_TK, b8_ENK, counts, a_scale, b_scale, recipe, a_per_row=False, magnitude=False):
    """sum_k a b (or sum_k |a b| with magnitude) per row, in float64, dequantized by fp8_scaling."""
    T, K = a8_TK.shape
    E, N, _ = b8_ENK.shape
    out = torch.zeros(T, N, dtype=torch.float64)
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if recipe == "blockwise":
            a = fs.dequantize_1x128(a8_TK[rows], a_scale[rows])
            b = fs.dequantize_128x128(b8_ENK[e], b_scale[e])
        else:
            a = fs.dequantize_tensorwise(a8_TK[rows], a_scale[rows, None] if a_per_row else a_scale[e])
            b = fs.dequantize_tensorwise(b8_ENK[e], b_scale[e])
        a, b = a.double(), b.double()
        if magnitude:
            a, b = a.abs(), b.abs()
        for t in range(count):  # one row at a time: no shared matmul code with the twin
            out[rows.start + t] = (b * a[t]).sum(dim=1)
    return out


NT_CASES = [  # counts per expert (the tail after them), K, N
    ([5, 0, 17, 1], 256, 48),  # an empty expert, odd counts
    ([33], 128, 136),  # E = 1, N not a multiple of 128
    ([0, 0, 9], 384, 16),  # leading empty experts
]


@pytest.mark.parametrize("counts, K, N", NT_CASES)
@pytest.mark.parametrize("recipe, a_per_row", [("tensorwise", False), ("tensorwise", True), ("blockwise", False)])
def test_nt_twin_matches_a_float64_loop(counts, K, N, recipe, a_per_row):
    gen = torch.Generator().manual_seed(K + N + len(counts))
    E, tail = len(counts), 3
    T = sum(counts) + tail
    a8 = random_fp8(T, K, gen=gen)
    b8 = random_fp8(E, N, K, gen=gen)
    if recipe == "blockwise":
        sa = power_of_two_scales(T, K // 128, gen=gen)
        sb = power_of_two_scales(E, -(-N // 128), K // 128, gen=gen)
    else:
        sa = power_of_two_scales(T if a_per_row else E, gen=gen)
        sb = power_of_two_scales(E, gen=gen)
    ends = ends_of(counts)
    y = g.fp8_grouped_nt_reference(a8, b8, ends, sa, sb, recipe, a_per_row=a_per_row)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    ref = nt_float64(a8, b8, counts, sa, sb, recipe, a_per_row)
    mag = nt_float64(a8, b8, counts, sa, sb, recipe, a_per_row, magnitude=True)
    assert ref.abs().max() > 0
    assert_within(y, ref, mag, K, 2.0**-8)
    assert (y[sum(counts):] == 0).all()  # the tail rows
    y32 = g.fp8_grouped_nt_reference(a8, b8, ends, sa, sb, recipe, a_per_row=a_per_row, out_dtype=torch.float32)
    assert_within(y32, ref, mag, K, 2.0**-24)


def test_nt_twin_blockwise_uses_each_block_scale():
    """Scaling one 128x128 weight tile changes exactly the outputs that tile feeds."""
    gen = torch.Generator().manual_seed(1)
    a8, b8 = random_fp8(6, 256, gen=gen), random_fp8(2, 256, 256, gen=gen)
    sa, sb = torch.ones(6, 2), torch.ones(2, 2, 2)
    ends = ends_of([2, 4])
    y0 = g.fp8_grouped_nt_reference(a8, b8, ends, sa, sb, "blockwise", out_dtype=torch.float32)
    sb[1, 0, 1] = 2.0  # expert 1, output features 0..127, K 128..255
    y1 = g.fp8_grouped_nt_reference(a8, b8, ends, sa, sb, "blockwise", out_dtype=torch.float32)
    changed = (y0 != y1)
    assert not changed[:2].any() and not changed[2:, 128:].any() and changed[2:, :128].all()


# --- wgrad twin ------------------------------------------------------------------------------


def wgrad_float64(a_TN, b_TK, counts, recipe, a8_NP, b8_KP, sa, sb, layout, magnitude=False):
    """Per expert, sum over its tokens of dy[t, n] x[t, k], float64, from the token-major FP8
    operands dequantized by fp8_scaling (tensorwise: per expert; blockwise: 1x128 along P)."""
    E, N, K = len(counts), a8_NP.shape[0], b8_KP.shape[0]
    if recipe == "blockwise":
        a = fs.dequantize_1x128(a8_NP, sa).double()
        b = fs.dequantize_1x128(b8_KP, sb).double()
    out = torch.zeros(E, N, K, dtype=torch.float64)
    row = 0
    for e, count in enumerate(counts):
        for _ in range(count):
            col = int(layout.column_T[row])
            row += 1
            if recipe == "blockwise":
                av, bv = a[:, col], b[:, col]
            else:
                av = fs.dequantize_tensorwise(a8_NP[:, col], sa[e]).double()
                bv = fs.dequantize_tensorwise(b8_KP[:, col], sb[e]).double()
            if magnitude:
                av, bv = av.abs(), bv.abs()
            out[e] += av[:, None] * bv[None, :]
    return out


@pytest.mark.parametrize("counts, N, K", [([5, 0, 130, 1], 48, 32), ([300], 16, 136), ([0, 0, 7], 64, 16)])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_wgrad_twin_matches_a_float64_loop(counts, N, K, recipe):
    gen = torch.Generator().manual_seed(N * K + len(counts))
    E, tail = len(counts), 2
    T = sum(counts) + tail
    layout = g.token_major_layout(ends_of(counts), T)
    dy, x = torch.randn(T, N, generator=gen), torch.randn(T, K, generator=gen)
    if recipe == "blockwise":
        a8, sa = fs.quantize_1x128(g.to_token_major(dy, layout))
        b8, sb = fs.quantize_1x128(g.to_token_major(x, layout))
    else:
        a8, b8 = g.to_token_major(dy.to(FP8), layout), g.to_token_major(x.to(FP8), layout)
        sa, sb = power_of_two_scales(E, gen=gen), power_of_two_scales(E, gen=gen)
    ref = wgrad_float64(dy, x, counts, recipe, a8, b8, sa, sb, layout)
    mag = wgrad_float64(dy, x, counts, recipe, a8, b8, sa, sb, layout, magnitude=True)
    contraction = max(counts)
    dw = g.fp8_grouped_wgrad_reference(a8, b8, layout.padded_ends_E, sa, sb, recipe)
    assert dw.dtype == torch.float32 and dw.shape == (E, N, K)
    assert ref.abs().max() > 0
    assert_within(dw, ref, mag, contraction, 2.0**-24)
    dw16 = g.fp8_grouped_wgrad_reference(a8, b8, layout.padded_ends_E, sa, sb, recipe, out_dtype=torch.bfloat16)
    assert_within(dw16, ref, mag, contraction, 2.0**-8)
    main = torch.randn(E, N, K, generator=gen) * ref.abs().max().float()
    summed = g.fp8_grouped_wgrad_reference(a8, b8, layout.padded_ends_E, sa, sb, recipe, accumulate_into=main)
    assert_within(summed, ref + main.double(), mag, contraction + 1, 2.0**-24)
    for e, count in enumerate(counts):
        if count == 0:
            assert (dw[e] == 0).all()


# --- tile tables and layout ------------------------------------------------------------------


def row_tiles_loop(counts, T, block_m):
    """(expert, row_start, row_end) of every tile, the tail as expert E."""
    tiles, start = [], 0
    for e, count in enumerate(list(counts) + [T - sum(counts)]):
        for r in range(start, start + count, block_m):
            tiles.append((e, r, start + count))
        start += count
    return tiles


@pytest.mark.parametrize("counts, T, block_m", [
    ([5, 0, 17, 1], 30, 4), ([0, 0, 0], 0, 128), ([0, 0, 0], 7, 128), ([256, 1, 127], 384, 128),
    ([128], 128, 128), ([3, 300, 0, 44], 400, 64),
])
def test_row_tiles_match_a_python_loop(counts, T, block_m):
    tiles = g.row_tiles(ends_of(counts), T, block_m)
    expected = row_tiles_loop(counts, T, block_m)
    capacity = -(-T // block_m) + len(counts) + 1
    assert all(t.dtype == torch.int32 for t in tiles[:4]) and tiles.expert.shape == (capacity,)
    assert tiles.block_m == block_m
    count = int(tiles.count[0])
    assert count == len(expected)
    got = list(zip(tiles.expert[:count].tolist(), tiles.row_start[:count].tolist(), tiles.row_end[:count].tolist()))
    assert got == expected
    assert (tiles.expert[count:] == -1).all()
    tiles.check(len(counts), T, block_m)  # the tiles of these rows: accepted


def test_a_kernel_refuses_row_tiles_of_other_rows_or_another_tile_height():
    tiles = g.row_tiles(ends_of([5, 0, 17, 1]), 30, 4)
    with pytest.raises(ValueError, match="tiles of 8"):
        tiles.check(4, 30, 8)
    with pytest.raises(ValueError, match="40 rows"):
        tiles.check(4, 40, 4)


def test_token_major_layout_matches_a_python_loop():
    counts, T = [5, 0, 130, 1, 0], 140
    layout = g.token_major_layout(ends_of(counts), T)
    columns, padded_ends, start = [], [], 0
    for count in counts:
        columns += range(start, start + count)
        start += -(-count // 128) * 128
        padded_ends.append(start)
    assert layout.padded_ends_E.tolist() == padded_ends and layout.padded_ends_E.dtype == torch.int32
    assert layout.width % 128 == 0 and layout.width >= padded_ends[-1] + 128
    assert layout.width == (-(-(T + 5 * 127) // 128) + 1) * 128  # static: T and E only
    assert layout.column_T[: len(columns)].tolist() == columns
    assert layout.valid_T.tolist() == [True] * len(columns) + [False] * (T - len(columns))
    x = torch.arange(1, T * 3 + 1, dtype=torch.float32).reshape(T, 3)
    x_CP = g.to_token_major(x, layout)
    expected = torch.zeros(3, layout.width)
    expected[:, columns] = x[: len(columns)].t()
    assert torch.equal(x_CP, expected)
    x8_CP = g.to_token_major(x.to(FP8), layout)
    assert x8_CP.dtype == FP8 and torch.equal(x8_CP.float(), expected.to(FP8).float())


# --- configurations and refusals -------------------------------------------------------------


def test_pick_config_rule():
    cfg = g.pick_config("nt", "tensorwise", K=2048, N=1536, fast_accum=True)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages, cfg.warps) == (128, 256, 128, 3, 8)
    assert g.pick_config("nt", "tensorwise", K=14336, N=4096, fast_accum=True).name == "m256n128k128s3w8"
    assert g.pick_config("nt", "blockwise", K=2048, N=1536).name == "m128n128k128s4w8"
    assert g.pick_config("wgrad", "tensorwise", K=2048, N=768).block_k == 128
    assert all(name == cfg.name for name, cfg in g.CONFIGS.items())


def nt_args(T=8, K=128, N=16, E=2, recipe="tensorwise"):
    a8, b8 = torch.zeros(T, K).to(FP8), torch.zeros(E, N, K).to(FP8)
    ends = ends_of([4, 4]) if E == 2 else ends_of([8] + [0] * (E - 1))
    if recipe == "blockwise":
        return a8, b8, ends, torch.ones(T, K // 128), torch.ones(E, -(-N // 128), K // 128), recipe
    return a8, b8, ends, torch.ones(E), torch.ones(E), recipe


@pytest.mark.parametrize("fn", [g.fp8_grouped_nt, g.fp8_grouped_nt_reference])
@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0][:, :72].contiguous(), *a[1:]), "K"),  # K mismatch
    (lambda a: (a[0][:, :120], a[1][:, :, :120], *a[2:]), "contiguous"),
    (lambda a: (a[0][:, :120].contiguous(), a[1][:, :, :120].contiguous(), *a[2:]), "multiple of 16"),
    (lambda a: (a[0].float(), *a[1:]), "float8_e4m3fn"),
    (lambda a: (*a[:2], a[2].long(), *a[3:]), "int32"),
    (lambda a: (*a[:3], torch.ones(3), *a[4:]), "per expert"),
    (lambda a: (*a[:3], a[3].double(), *a[4:]), "float32"),
    (lambda a: (*a[:5], "mxfp8"), "recipe"),
])
def test_nt_refusals(fn, change, message):
    with pytest.raises(ValueError, match=message):
        fn(*change(nt_args()))


@pytest.mark.parametrize("fn", [g.fp8_grouped_nt, g.fp8_grouped_nt_reference])
def test_nt_blockwise_refusals(fn):
    a8, b8, ends, sa, sb, recipe = nt_args(K=144, recipe="tensorwise")
    with pytest.raises(ValueError, match="K % 128"):
        fn(a8, b8, ends, torch.ones(8, 1), torch.ones(2, 1, 1), "blockwise")
    args = nt_args(recipe="blockwise")
    with pytest.raises(ValueError, match=r"\[T, K/128\]"):
        fn(*args[:3], torch.ones(8, 2), *args[4:])
    with pytest.raises(ValueError, match="128x128"):
        fn(*args[:4], torch.ones(2, 2, 1), args[5])


def test_misaligned_start_is_refused():
    a8, b8, ends, sa, sb, recipe = nt_args(T=9)
    with pytest.raises(ValueError, match="16-byte aligned"):
        g.fp8_grouped_nt_reference(a8.view(-1)[8:8 + 8 * 128].view(8, 128), b8, ends, sa, sb, recipe)


def test_kernel_refusals_before_any_gpu_work():
    args = nt_args(recipe="blockwise")
    with pytest.raises(ValueError, match="block_k == 128"):
        g.fp8_grouped_nt(*args, config="m128n128k64s5w4")
    with pytest.raises(ValueError, match="unknown config"):
        g.fp8_grouped_nt(*args, config="m1n1k1s1w1")
    with pytest.raises(ValueError, match="at least one expert"):
        g.fp8_grouped_nt(torch.zeros(4, 128).to(FP8), torch.zeros(0, 16, 128).to(FP8),
                         torch.zeros(0, dtype=torch.int32), torch.ones(0), torch.ones(0))
    if not g._interpreting():
        with pytest.raises(ValueError, match="CUDA tensors"):
            g.fp8_grouped_nt(*nt_args())


def test_a_per_row_is_tensorwise_only():
    args = nt_args(recipe="blockwise")
    with pytest.raises(ValueError, match="a_per_row"):
        g.fp8_grouped_nt_reference(*args, a_per_row=True)
    a8, b8, ends, _, sb, recipe = nt_args()
    with pytest.raises(ValueError, match="per row"):
        g.fp8_grouped_nt_reference(a8, b8, ends, torch.ones(2), sb, recipe, a_per_row=True)


def test_twins_refuse_bad_ends():
    a8, b8, _, sa, sb, recipe = nt_args()
    with pytest.raises(ValueError, match="nondecreasing"):
        g.fp8_grouped_nt_reference(a8, b8, torch.tensor([5, 3], dtype=torch.int32), sa, sb, recipe)
    with pytest.raises(ValueError, match="at most T"):
        g.fp8_grouped_nt_reference(a8, b8, torch.tensor([5, 9], dtype=torch.int32), sa, sb, recipe)
    z = torch.zeros(16, 256).to(FP8)
    with pytest.raises(ValueError, match="multiples of 128"):
        g.fp8_grouped_wgrad_reference(z, z, torch.tensor([100, 256], dtype=torch.int32), torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("fn", [g.fp8_grouped_wgrad, g.fp8_grouped_wgrad_reference])
def test_wgrad_refusals(fn):
    a8, b8 = torch.zeros(16, 256).to(FP8), torch.zeros(32, 256).to(FP8)
    ends = torch.tensor([128, 256], dtype=torch.int32)
    ones = torch.ones(2)
    with pytest.raises(ValueError, match="multiple of 128"):
        fn(a8[:, :200].contiguous(), b8[:, :200].contiguous(), ends, ones, ones)
    with pytest.raises(ValueError, match="P"):
        fn(a8, b8[:, :128].contiguous(), ends, ones, ones)
    with pytest.raises(ValueError, match=r"\[N, P/128\]"):
        fn(a8, b8, ends, torch.ones(16, 1), torch.ones(32, 2), "blockwise")
    with pytest.raises(ValueError, match="accumulate_into"):
        fn(a8, b8, ends, ones, ones, accumulate_into=torch.zeros(2, 16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        fn(a8, b8, ends, ones, ones, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="padded_ends_E"):
        fn(a8, b8, ends.long(), ones, ones)
