"""F10's blockwise recipe on the GPU: the Triton quantizers bitwise against fp8_scaling's
PyTorch ones, the grouped linear against float64 per-expert references, and the experts
against stock TE experts under TE's Float8BlockScaling on identical weights and inputs.

Tolerance against stock TE blockwise: both sides quantize every GEMM operand with the same
1x128 / 128x128 power-of-two scales (fprop, dgrad, and wgrad along the tokens), so the output
differs by accumulation order only: allowed u = 2**-4 (E4M3's unit roundoff) of its largest
magnitude, as for tensorwise; the gradients add TE's gradient rounding (E4M3 under e4m3, E5M2
under hybrid, where this path keeps E4M3): u + that format's roundoff. Against float64
references from the same quantized operands: each result is one fp32 accumulation rounded to
bf16 once, 2**-8 relative, plus the tensor cores' 14-bit products inside each 128-K block
(2**-11 of the largest magnitude).
"""

import pytest
import torch

from gpu_checks import check_fp8_experts_against_stock, small_moe_kwargs
from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.kernels import fp8_scaling as fs

pytest.importorskip("triton")
if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the blockwise FP8 experts run on sm90", allow_module_level=True)

from megatron.moe_patches.experts import fp8_blockwise  # noqa: E402
from megatron.moe_patches.experts.grouped_mm import RowGroups  # noqa: E402
from megatron.moe_patches.kernels import fp8_blockwise_quantize as bq  # noqa: E402
from megatron.moe_patches.kernels import fp8_grouped_gemm as gemms  # noqa: E402


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def special_values(x):
    """Blocks that exercise the edge rules: all zero, one NaN, one inf, values whose 448 / amax
    overflows float32 (scale = the dtype's largest value), and large ones."""
    x = x.clone()
    x[0, :128] = 0
    x[1, 5] = float("nan")
    x[2, 130] = float("inf")
    x[3, :128] = 2e-38 if x.dtype == torch.float32 else 1e-37  # normal numbers: 448 / amax is inf
    x[4, 128:256] *= 1e4
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1000, 256), (4097, 1536), (65, 2048), (300, 1408)])  # 1408: an odd count of blocks
def test_row_quantizer_equals_the_pytorch_one(rows, cols, dtype):
    x = special_values(torch.randn(rows, cols, dtype=dtype, device="cuda"))
    q, s = bq.quantize_rows(x)
    q_ref, s_ref = fs.quantize_1x128(x.cpu())
    assert torch.equal(bits(q).cpu(), bits(q_ref)) and torch.equal(s.cpu(), s_ref)
    assert s.is_contiguous()  # row-major: a row's K blocks share a cache line in the GEMM


@pytest.mark.parametrize("experts, n, k", [(8, 384, 256), (3, 1536, 2048)])
def test_weight_tiles_in_both_layouts_equal_the_pytorch_ones(experts, n, k):
    w = (torch.randn(experts, n, k, device="cuda") * 0.02).to(torch.bfloat16)
    w[0, :128, :128] = 0
    got = bq.quantize_weight_tiles(w)
    w8, s = fs.quantize_128x128(w.cpu())
    want = (w8, s, *fs.transpose_128x128(w8, s))
    assert all(torch.equal(bits(a).cpu(), bits(b)) for a, b in zip(got, want))
    again = bq.quantize_weight_tiles(w * 3, got)
    assert all(a is b for a, b in zip(again, got))


@pytest.mark.parametrize("counts", [[0, 37, 16, 0, 300, 1, 0, 83], [512] * 4, [129, 127, 256]])
def test_row_and_token_major_quantizer_equals_the_pytorch_one(counts):
    T = sum(counts) + 5  # rows past the last expert: in the row copy, not the token-major one
    x = special_values(torch.randn(T, 256, device="cuda").to(torch.bfloat16))
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    q, s, got = bq.quantize_rows_and_token_major(x, ends)
    q_ref, s_ref, want = bq.quantize_rows_and_token_major(x.cpu(), ends.cpu())
    assert torch.equal(bits(q).cpu(), bits(q_ref)) and torch.equal(s.cpu(), s_ref)
    assert s.is_contiguous()
    assert torch.equal(got.padded_ends_E.cpu(), want.padded_ends_E)
    end = int(want.padded_ends_E[-1])  # columns past it are never read
    assert torch.equal(bits(got.data_CP[:, :end]).cpu(), bits(want.data_CP[:, :end]))
    assert torch.equal(got.scale_inv_CPt[:, :end // 128].cpu(), want.scale_inv_CPt[:, :end // 128])


def deq(pair):
    return fs.dequantize_1x128(*pair).double()


@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("counts", [[0, 37, 16, 0, 300, 1, 0, 83], [640] * 4])
def test_grouped_linear_equals_float64_references(counts, fp8_wgrad):
    E, I, O = len(counts), 512, 384
    T = sum(counts) + 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, I, device="cuda", generator=gen).to(torch.bfloat16)
    x[sum(counts):] = 0
    w = (torch.randn(E, O, I, device="cuda", generator=gen) / I**0.5).to(torch.bfloat16)
    dy = torch.randn(T, O, device="cuda", generator=gen).to(torch.bfloat16)
    groups = RowGroups(torch.tensor(counts, device="cuda"), T, "cuda")
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_blockwise.blockwise_linear(groups, fp8_wgrad)(xr, wr, bq.quantize_weight_tiles(w))
    y.backward(dy)
    x_q, dy_q = deq(fs.quantize_1x128(x.cpu())), deq(fs.quantize_1x128(dy.cpu()))
    start = 0
    for e, n in enumerate(counts):
        seg = slice(start, start + n)
        start += n
        w8, s = fs.quantize_128x128(w[e].cpu())
        w_q = fs.dequantize_128x128(w8, s).double()
        want = {"y": x_q[seg] @ w_q.t(), "dx": dy_q[seg] @ w_q}
        if fp8_wgrad:
            along = lambda t: deq(fs.quantize_1x128(t.cpu().t(), partial="pad")).t()  # noqa: E731
            want["dw"] = along(dy[seg]).t() @ along(x[seg])
        else:
            want["dw"] = dy[seg].cpu().double().t() @ x[seg].cpu().double()
        got = {"y": y[seg], "dx": xr.grad[seg], "dw": wr.grad[e]}
        for name, value in want.items():
            m = value.abs().max().item() if value.numel() else 0.0
            err = (got[name].cpu().double() - value).abs()
            allowed = 2.0**-8 * value.abs() + 2.0**-11 * m + 1e-30
            assert (err <= allowed).all(), (e, name, err.max().item(), m)
    assert not y[sum(counts):].any() and not xr.grad[sum(counts):].any()


CASES = [  # activation, experts, topk, tokens, dispatcher, fp8 format, expert biases, FP8 wgrad
    pytest.param("swiglu", 128, 8, 300, "alltoall", "e4m3", False, True, marks=pytest.mark.quick),  # idle experts
    ("swiglu", 64, 2, 1000, "alltoall", "hybrid", False, True),
    ("quick_geglu", 64, 1, 500, "allgather", "e4m3", False, True),
    ("swiglu", 64, 8, 1000, "alltoall", "e4m3", True, True),
    ("swiglu", 128, 8, 300, "alltoall", "e4m3", False, False),  # --no-fp8-wgrad
    ("quick_geglu", 64, 1, 500, "allgather", "e4m3", False, False),
    ("swiglu", 64, 8, 1000, "alltoall", "hybrid", True, False),
]


def kernels_in_use(kernels, monkeypatch):
    """``triton``: DeepGEMM counts as absent; ``deepgemm``: the test needs it installed."""
    if kernels == "deepgemm" and not cap.deep_gemm_grouped_fp8():
        pytest.skip("DeepGEMM is not installed")
    if kernels == "triton":
        monkeypatch.setattr(cap, "deep_gemm_grouped_fp8", lambda: False)


@pytest.mark.parametrize("kernels", ["triton", "deepgemm"])
@pytest.mark.parametrize("activation, experts, topk, tokens, dispatcher, fp8_format, bias, fp8_wgrad", CASES)
def test_blockwise_backend_matches_stock_te_blockwise(single_gpu, monkeypatch, activation, experts, topk, tokens,
                                                      dispatcher, fp8_format, bias, fp8_wgrad, kernels):
    kernels_in_use(kernels, monkeypatch)
    taken = []  # whether each take_quantized_rows found a copy the dispatcher wrote
    take = fp8_blockwise.take_quantized_rows
    monkeypatch.setattr(fp8_blockwise, "take_quantized_rows", lambda x: taken.append(take(x)) or taken[-1])
    kwargs = {**small_moe_kwargs(experts, topk, activation, "fp8-blockwise", moe_token_dispatcher_type=dispatcher,
                                 fp8=fp8_format, moe_ffn_hidden_size=256, ffn_hidden_size=256),
              "add_bias_linear": bias, "fp8_wgrad": fp8_wgrad}
    layer = check_fp8_experts_against_stock(kwargs, tokens, [activation, experts, topk, tokens, dispatcher, fp8_format,
                                                             bias, fp8_wgrad, kernels])
    assert layer.experts.backend._recipe.quantize is bq.quantize_weight_tiles
    # DeepGEMM: the dispatcher pads each expert's rows to 128 into a static row count and,
    # with bf16 wgrad, writes FC1's FP8 input and FC2's FP8 output gradient as it moves them;
    # with bf16 wgrad the GLU writes FC2's FP8 input and FC1's FP8 output gradient (any kernels)
    aligned = kernels == "deepgemm"
    assert layer.experts.padding_plan.static_rows == aligned
    assert layer.experts.backend._kernels == (fp8_blockwise.grouped_nt_kernel(aligned),)
    fused = aligned and not fp8_wgrad
    assert layer.experts.padding_plan.quantized_rows == fused
    assert getattr(layer.token_dispatcher.permute_step, "quantized_rows", False) == fused
    assert layer.experts.backend.glu_quantized_rows == (not fp8_wgrad)
    # per forward+backward: FC1's forward, FC2's forward, FC2's dgrad, FC1's dgrad
    found = [rows is not None for rows in taken]
    if fp8_wgrad:  # the token-major quantization runs instead
        assert found == []
    else:  # FC1's forward and FC2's dgrad read the dispatcher's rows, FC2's forward and FC1's
        # dgrad the GLU's; a bias add (in fp32) hands the GEMM's backward another tensor
        want = [fused, True, fused and not bias, not bias]
        assert found and found == want * (len(found) // 4)


@pytest.mark.parametrize("counts", [[0, 300, 1, 0, 83, 128], [1024] * 4])
def test_deep_gemm_grouped_nt_equals_the_float64_reference_on_128_row_groups(counts):
    """DeepGEMM's fprop on groups padded to 128 rows (zero padding rows) and a tail of rows
    past the last group (nonzero: they must come out zero) against the PyTorch twin of the
    recipe: one fp32 accumulation per 128-K block rounded to bf16 once (2**-8 relative,
    2**-11 of the largest magnitude for the 14-bit products)."""
    if not cap.deep_gemm_grouped_fp8():
        pytest.skip("DeepGEMM is not installed")
    from megatron.moe_patches.kernels import deep_gemm_grouped

    E, K, N = len(counts), 512, 384
    padded = [-(-c // 128) * 128 for c in counts]
    ends_E = torch.tensor(padded, device="cuda").cumsum(0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(padded) + 77, K, device="cuda", generator=gen).to(torch.bfloat16)
    start = 0
    for c, p in zip(counts, padded):
        x[start + c:start + p] = 0
        start += p
    w = (torch.randn(E, N, K, device="cuda", generator=gen) / K**0.5).to(torch.bfloat16)
    a8, sa = bq.quantize_rows(x)
    wt = bq.quantize_weight_tiles(w)
    got = deep_gemm_grouped.grouped_nt(a8, wt.w8_ENK, ends_E, sa, wt.scale_inv_ENtKt).double()
    want = gemms.fp8_grouped_nt_reference(a8, wt.w8_ENK, ends_E, sa, wt.scale_inv_ENtKt, "blockwise",
                                          out_dtype=torch.float64)
    m = want.abs().max().item()
    err = (got - want).abs()
    assert (err <= 2.0**-8 * want.abs() + 2.0**-11 * m).all(), err.max().item()
    assert not got[x.abs().sum(1) == 0].any() and not got[sum(padded):].any()  # padding rows, tail
