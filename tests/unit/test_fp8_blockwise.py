"""F10's blockwise recipe on CPU: the grouped linear's forward and backward against float64
per-expert references built from the 1x128 / 128x128 quantizers (whose arithmetic
test_fp8_scaling checks against the format), the token-major copy's layout, the weight cache
and where the recipe runs. The Triton kernels are checked bitwise against these on the GPU."""

import pytest
import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.experts import fp8_blockwise
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.experts.grouped_mm import RowGroups
from megatron.moe_patches.kernels import fp8_blockwise_quantize as bq
from megatron.moe_patches.kernels import fp8_scaling as fs

from expert_configs import fp8_config

COUNTS = [130, 0, 170, 16]  # an idle expert, segments that are not multiples of 128
TAIL = 8  # rows past the last expert (F12's static bound): outside every group


def deq_rows(x_TK):
    return fs.dequantize_1x128(*fs.quantize_1x128(x_TK)).double()


def deq_tiles(w_NK):
    return fs.dequantize_128x128(*fs.quantize_128x128(w_NK)).double()


def deq_along_tokens(x_TC):
    """An expert's rows quantized column-wise, 128 tokens per block from its first row."""
    x8_CT, s = fs.quantize_1x128(x_TC.t(), partial="pad")
    return fs.dequantize_1x128(x8_CT, s).double().t()


def case(I=256, O=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(COUNTS) + TAIL
    x = torch.randn(T, I, generator=gen).to(torch.bfloat16)
    x[sum(COUNTS):] = 0  # the bound's rows hold zeros, as F12's exchange leaves them
    w = (torch.randn(len(COUNTS), O, I, generator=gen) / I ** 0.5).to(torch.bfloat16)
    dy = torch.randn(T, O, generator=gen).to(torch.bfloat16)
    groups = RowGroups(torch.tensor(COUNTS), T, "cpu")
    return x, w, dy, groups


def segments():
    start = 0
    for e, n in enumerate(COUNTS):
        yield e, slice(start, start + n)
        start += n


def run(x, w, dy, groups, fp8_wgrad):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    weights = bq.quantize_weight_tiles(w.detach())
    y = fp8_blockwise.blockwise_linear(groups, fp8_wgrad)(x, w, weights)
    y.backward(dy)
    return y, x.grad, w.grad


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_blockwise_linear_matches_float64_references(fp8_wgrad):
    x, w, dy, groups = case()
    y, dx, dw = run(x, w, dy, groups, fp8_wgrad)
    rows = sum(COUNTS)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert not y[rows:].any() and not dx[rows:].any()  # rows outside every group stay zero
    x_q, dy_q = deq_rows(x), deq_rows(dy)
    for e, seg in segments():
        # fprop: 1x128 input, 128x128 weight; dgrad: 1x128 output gradient, the weight's tiles transposed
        want_y = x_q[seg] @ deq_tiles(w[e]).t()
        want_dx = dy_q[seg] @ deq_tiles(w[e].t().contiguous()).t()
        if fp8_wgrad:  # both operands quantized along the expert's tokens
            want_dw = deq_along_tokens(dy[seg]).t() @ deq_along_tokens(x[seg])
        else:
            want_dw = dy[seg].double().t() @ x[seg].double()
        # each result rounds to bf16 once (relative 2**-8) after an fp32 accumulation
        for got, want in ((y[seg], want_y), (dx[seg], want_dx), (dw[e], want_dw)):
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(got.double(), want, rtol=2.0**-8, atol=1e-5 * scale + 1e-30)
    assert not dw[1].any()  # the idle expert's weight gets no gradient


def test_fp8_wgrad_is_not_the_bf16_wgrad():
    """The flag changes what runs: FP8 wgrad quantizes both operands (errors of order 2**-4
    relative per element), bf16 wgrad does not."""
    x, w, dy, groups = case(seed=1)
    _, _, dw_fp8 = run(x, w, dy, groups, True)
    _, _, dw_bf16 = run(x, w, dy, groups, False)
    assert not torch.equal(dw_fp8, dw_bf16)
    torch.testing.assert_close(dw_fp8.float(), dw_bf16.float(), rtol=0.1, atol=0.1 * dw_bf16.abs().max().item())


def test_token_major_copy_puts_each_expert_at_128_aligned_columns():
    x, _, _, groups = case()
    x8, s, copy = bq.quantize_rows_and_token_major(x, groups.offsets_E)
    x8_rows, s_rows = fs.quantize_1x128(x)  # the row copy: every row, the tail's too
    assert torch.equal(x8.view(torch.uint8), x8_rows.view(torch.uint8)) and torch.equal(s, s_rows)
    padded = [0] + copy.padded_ends_E.tolist()
    assert padded == [0, 256, 256, 512, 640]  # 130 -> 256, 0, 170 -> 256, 16 -> 128
    for e, seg in segments():
        lo, hi = padded[e], padded[e + 1]
        n = seg.stop - seg.start
        got = fs.dequantize_1x128(copy.data_CP[:, lo:hi], copy.scale_inv_CPt[:, lo // 128:hi // 128]).double()
        torch.testing.assert_close(got[:, :n], deq_along_tokens(x[seg]).t(), rtol=0, atol=0)
        assert not got[:, n:].any()  # the segment's pad columns are zero


def test_blocked_sizes_must_be_multiples_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        bq.quantize_rows(torch.zeros(4, 192))
    with pytest.raises(ValueError, match="output features N = 64"):
        bq.quantize_weight_tiles(torch.zeros(2, 64, 128))


def test_weight_tiles_requantize_into_the_same_tensors():
    w = torch.randn(2, 128, 256).to(torch.bfloat16)
    first = bq.quantize_weight_tiles(w)
    again = bq.quantize_weight_tiles(w * 2, first)
    assert all(a is b for a, b in zip(first, again))  # a captured graph keeps reading them
    w8, s = fs.quantize_128x128(w * 2)
    assert torch.equal(again.w8_ENK.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(again.scale_inv_ENtKt, s)
    assert torch.equal(again.w8_EKN.view(torch.uint8), w8.transpose(1, 2).contiguous().view(torch.uint8))
    assert torch.equal(again.scale_inv_EKtNt, s.transpose(1, 2))


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(cap, "triton_available", lambda: True)


@pytest.mark.parametrize("overrides, backend, reason", [
    (dict(hidden_size=128, moe_ffn_hidden_size=256), "fp8_grouped_mm", None),
    (dict(), "te", "--fp8-recipe blockwise needs --hidden-size (64) to be a multiple of 128"),
    (dict(hidden_size=128, moe_ffn_hidden_size=192), "te", "--moe-ffn-hidden-size (192)"),
])
def test_blockwise_in_the_table(with_triton, overrides, backend, reason):
    config = fp8_config(fp8_recipe="blockwise", **overrides)
    plan = moe_plan.plan_for(config)
    assert plan.backend.name == backend
    why = dict(plan.backend_support)["fp8_grouped_mm"]
    assert why is None if reason is None else reason in why


def test_the_backend_takes_its_recipe_at_construction():
    assert fp8.RECIPES["blockwise"].quantize is bq.quantize_weight_tiles
    assert fp8.RECIPES["blockwise"].linear is fp8_blockwise.blockwise_linear
    assert fp8.RECIPES["tensorwise"].quantize is fp8.quantize_weights
    assert set(fp8.FP8GroupedMMBackend.fp8_recipes) == {"tensorwise", "blockwise"}


def test_the_backend_refuses_a_recipe_it_does_not_implement():
    from expert_shells import experts_shell

    config = fp8_config(fp8_recipe="mxfp8")
    with pytest.raises(ValueError, match="implements --fp8-recipe tensorwise or blockwise, not mxfp8"):
        fp8.FP8GroupedMMBackend(experts_shell(fp8.FP8GroupedMMBackend, config, 2, (4, 2), (4, 2)))


def test_one_forward_derives_its_row_blocks_once_for_both_fcs():
    """The 128-row tiles and token-major ends are a dozen device ops: each FC's quantizations
    and GEMMs of one forward read the same ones."""
    from megatron.moe_patches.experts import fp8_blockwise

    _, _, _, groups = case()
    fp8_blockwise.blockwise_linear(groups, True)
    blocks = groups._derived["blockwise_row_blocks"]
    fp8_blockwise.blockwise_linear(groups, False)
    assert groups._derived["blockwise_row_blocks"] is blocks
    assert blocks.padded_ends_E.tolist() == [256, 256, 512, 640] and blocks.tiles.block_m == 128


class _Target:
    """Stand-in for DDP's parameters: the [E, O, I] weight as one grouped parameter or per expert,
    each with an fp32 main_grad holding earlier micro-batches' sum."""

    def __init__(self, w, grouped: bool):
        from megatron.moe_patches.experts.grouped_mm import MainGradTarget

        params = [w.clone()] if grouped else [w[e].clone() for e in range(w.shape[0])]
        for p in params:
            p.main_grad = torch.linspace(-1, 1, p.numel()).view(p.shape).float()
            p.grad_added_to_main_grad = False
        self.start = [p.main_grad.clone() for p in params]
        self.params = params
        self.target = MainGradTarget(params, grouped=grouped, triton=False)

    def added_EOI(self):
        return torch.stack([g for p, s in zip(self.params, self.start)
                            for g in (p.main_grad - s).reshape(-1, *p.shape[-2:]).unbind(0)])


@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
def test_under_gradient_accumulation_fusion_the_wgrad_goes_into_main_grad(fp8_wgrad, grouped):
    """F13 with the FP8 experts: the weight gradient is added into main_grad (in fp32, from the
    same FP8 or bf16 operands) and autograd gets a placeholder that DDP's hook skips."""
    x, w, dy, groups = case(seed=2)
    _, dx_unfused, dw_unfused = run(x, w, dy, groups, fp8_wgrad)
    sink = _Target(w, grouped)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_blockwise.blockwise_linear(groups, fp8_wgrad)(xg, wg, bq.quantize_weight_tiles(w), target=sink.target)
    y.backward(dy)
    assert torch.equal(xg.grad, dx_unfused)  # the data gradient does not change
    assert all(p.grad_added_to_main_grad for p in sink.params)
    assert wg.grad is not None and wg.grad.shape == w.shape  # the placeholder
    # the unfused gradient rounded to bf16 once; the fused one stayed fp32
    torch.testing.assert_close(sink.added_EOI(), dw_unfused.float(), rtol=2.0**-7, atol=1e-3)
