"""The FP8 grouped GEMM kernels (kernels/fp8_grouped_gemm.py) against their PyTorch twins on
an H100-class GPU (sm90, Triton with in-kernel TMA descriptors): fprop, dgrad and wgrad, both
recipes, on a Qwen3-like shape and small odd ones (experts without rows, rows not a multiple
of the tile, E = 1, rows past the last expert); CUDA-graph capture and replay (bitwise the
eager result, after the routing changed); wgrad accumulating into an fp32 main_grad.

Tolerance. Kernel and twin read the same FP8 values and float32 scales, so they differ by
(1) the order of accumulation and (2) the output rounding, nothing else:
- rounding: each side rounds its float32 value once; two values within the accumulation
  term of each other round to bf16 values at most 1 ulp apart, ulp(m) = 2**(floor(log2 m) - 7)
  for the output's largest magnitude m;
- accumulation, split (blockwise; tensorwise with fast_accum=False): inside one 128-wide K
  block the tensor cores chain 4 FP8 wgmma steps of K = 32, each keeping about 14 bits
  (DeepSeek-V3 report, 3.3.2: relative 2**-13 per step), the blocks are added in float32
  (2**-24 per add): at most 4 * 2**-13 = 2**-11 of m, far below a bf16 ulp;
- accumulation, fast (tensorwise fast_accum=True): K / 32 chained steps of 2**-13 each,
  truncation-biased, so they add up: (K / 32) * 2**-13 of m.
Allowed: bf16 output, split: 2 ulp(m); bf16, fast: 1 ulp(m) + (K / 32) * 2**-13 * m;
float32 output (wgrad), split: 2**-8 * S, where S is, element by element, the sum of the
absolute products (the twin on |A|, |B|): wgrad sums thousands of tokens whose partial sums
can be far larger than the result, so the error is bounded relative to S, not m; and a
K = 32 FP8 MMA step aligns its 32 products to the largest one before keeping ~14 bits, so one
step may lose up to 32 * 2**-13 = 2**-8 of its largest product (measured on an H100:
errors of 2**-11 to 2**-9.5 of m, above the 2**-11 first assumed). Rows no expert owns, and experts with no rows, are exact (zeros). No timing
is asserted anywhere.
"""

import pytest
import torch

from megatron.moe_patches.kernels import fp8_scaling as fs

triton = pytest.importorskip("triton")
if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("the FP8 grouped GEMM kernels need sm90 (TMA, FP8 tensor cores)", allow_module_level=True)

from megatron.moe_patches.kernels import fp8_grouped_gemm as g  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16_TERM = 2  # ulps


def ulp_bf16(m: float) -> float:
    return 2.0 ** (torch.tensor(m).log2().floor().item() - 7)


def check(got, want, K, *, fast=False, what="", abs_sum=None):
    """got vs want by the module docstring's rule (``abs_sum``: S for float32 outputs)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    m = want.float().abs().max().item()
    assert m > 0, what
    if want.dtype == torch.bfloat16:
        allowed = (1 if fast else BF16_TERM) * ulp_bf16(m) + ((K / 32) * 2.0**-13 * m if fast else 0.0)
    else:
        allowed = 2.0**-8 * (abs_sum.float() if abs_sum is not None else m) + ((K / 32) * 2.0**-13 * m if fast else 0.0)
    err = (got.float() - want.float()).abs()
    excess = (err - allowed).max().item()
    assert excess <= 0, f"{what}: max abs error {err.max().item()} exceeds the allowed error (m = {m})"


def magnitude(t8):
    """|t8| of E4M3 data (the sign bit cleared: exact)."""
    return (t8.view(torch.uint8) & 0x7F).view(FP8)


def routing_counts(rows, experts, seed, idle=()):
    """Uneven, seeded counts summing to ``rows``; the experts in ``idle`` get none."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.3
    for e in idle:
        weights[e] = 0
    counts = torch.multinomial(weights / weights.sum(), rows, replacement=True, generator=gen).bincount(
        minlength=experts)
    return counts.tolist()


def ends_of(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()


def block_factors(rows, cols, rows_blocked):
    """Powers of two in [1/8, 8], one per 1x128 (or 128x128 with rows_blocked) block."""
    grid = torch.randint(-3, 4, (-(-rows // 128) if rows_blocked else rows, -(-cols // 128)), device="cuda")
    f = torch.exp2(grid.float()).repeat_interleave(128, dim=1)[:, :cols]
    return f.repeat_interleave(128, dim=0)[:rows] if rows_blocked else f


class Problem:
    """One expert FC y_TO = x_TI . w_EOI^T, its data quantized for one recipe, with both
    layouts of the weights and the token-major copies wgrad reads."""

    def __init__(self, counts, tail, I, O, recipe, seed):
        torch.manual_seed(seed)
        self.counts, self.recipe, self.I, self.O = counts, recipe, I, O
        E = len(counts)
        T = sum(counts) + tail
        self.ends = ends_of(counts)
        x = torch.randn(T, I, device="cuda") * (torch.rand(T, 1, device="cuda") + 0.1)
        dy = torch.randn(T, O, device="cuda") * (torch.rand(T, 1, device="cuda") + 0.1)
        w = torch.randn(E, O, I, device="cuda") / I**0.5
        if recipe == "blockwise":  # magnitudes that vary by 128-block, so the block scales differ
            x = x * block_factors(T, I, rows_blocked=False)
            dy = dy * block_factors(T, O, rows_blocked=False)
            w = w * block_factors(E * O, I, rows_blocked=True).view(E, O, I)
        self.layout = g.token_major_layout(self.ends, T)
        if recipe == "blockwise":
            self.x8, self.sx = fs.quantize_1x128(x)
            self.dy8, self.sdy = fs.quantize_1x128(dy)
            self.w8_EOI, self.sw_EOI = fs.quantize_128x128(w)
            self.w8_EIO, self.sw_EIO = fs.transpose_128x128(self.w8_EOI, self.sw_EOI)
            self.x8_IP, self.sx_IP = fs.quantize_1x128(g.to_token_major(x, self.layout))
            self.dy8_OP, self.sdy_OP = fs.quantize_1x128(g.to_token_major(dy, self.layout))
        else:  # random per-expert (and per-row) scales: what matters is that both sides apply them alike
            self.x8, self.dy8 = (x * 30).to(FP8), (dy * 30).to(FP8)
            self.w8_EOI = (w * 200).to(FP8)
            self.w8_EIO = self.w8_EOI.transpose(1, 2).contiguous()
            self.sx = torch.rand(E, device="cuda") / 30 + 1e-3
            self.sx_T = torch.rand(T, device="cuda") / 30 + 1e-3
            self.sdy = torch.rand(E, device="cuda") / 30 + 1e-3
            self.sw_EOI = self.sw_EIO = torch.rand(E, device="cuda") / 200 + 1e-4
            self.x8_IP, self.dy8_OP = g.to_token_major(self.x8, self.layout), g.to_token_major(self.dy8, self.layout)
            self.sx_IP, self.sdy_OP = self.sx, self.sdy

    def fprop(self, fn, **kw):
        return fn(self.x8, self.w8_EOI, self.ends, self.sx, self.sw_EOI, self.recipe, **kw)

    def dgrad(self, fn, **kw):
        return fn(self.dy8, self.w8_EIO, self.ends, self.sdy, self.sw_EIO, self.recipe, **kw)

    def wgrad(self, fn, **kw):
        return fn(self.dy8_OP, self.x8_IP, self.layout.padded_ends_E, self.sdy_OP, self.sx_IP, self.recipe, **kw)

    def wgrad_abs_sum(self):
        """S of wgrad: the twin on the operands' magnitudes (scales are positive)."""
        return g.fp8_grouped_wgrad_reference(magnitude(self.dy8_OP), magnitude(self.x8_IP), self.layout.padded_ends_E,
                                             self.sdy_OP, self.sx_IP, self.recipe)


QWEN3 = dict(counts=routing_counts(4096 * 8, 128, seed=1, idle=(5, 77)), tail=0, I=2048, O=768)
SHAPES = {  # name: counts per expert, rows past the last expert, in features, out features
    "qwen3-fc1": dict(QWEN3, O=1536),
    "qwen3-fc2": dict(QWEN3, I=768, O=2048),
    "odd": dict(counts=[0, 77, 300, 1, 0, 129], tail=13, I=256, O=384),
    "one-expert": dict(counts=[200], tail=0, I=384, O=128),
    "narrow": dict(counts=[3, 0, 40], tail=5, I=128, O=80),  # tensorwise only: O is no multiple of 128
}


def skip_unfit(shape, recipe):
    if recipe == "blockwise" and SHAPES[shape]["O"] % 128:
        pytest.skip("blockwise needs whole 128-blocks along every contraction (dgrad's is O)")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fprop_and_dgrad_match_the_twin(shape, recipe):
    skip_unfit(shape, recipe)
    p = Problem(**SHAPES[shape], recipe=recipe, seed=len(shape))
    T = p.x8.shape[0]
    owned = sum(p.counts)
    for name, run, K in (("fprop", p.fprop, p.I), ("dgrad", p.dgrad, p.O)):
        want = run(g.fp8_grouped_nt_reference)
        fast_modes = (False, True) if recipe == "tensorwise" else (False,)
        for fast in fast_modes:
            got = run(g.fp8_grouped_nt, fast_accum=fast)
            check(got, want, K, fast=fast, what=f"{shape} {recipe} {name} fast_accum={fast}")
            assert (got[owned:] == 0).all() and got.shape[0] == T
    if recipe == "tensorwise":  # per-row A scales (as F10 expands them)
        want = g.fp8_grouped_nt_reference(p.x8, p.w8_EOI, p.ends, p.sx_T, p.sw_EOI, a_per_row=True)
        got = g.fp8_grouped_nt(p.x8, p.w8_EOI, p.ends, p.sx_T, p.sw_EOI, a_per_row=True, fast_accum=False)
        check(got, want, p.I, what=f"{shape} per-row scales")
    else:  # MN-major A scales (strides, not a copy in the kernel)
        got = g.fp8_grouped_nt(p.x8, p.w8_EOI, p.ends, p.sx.t().contiguous().t(), p.sw_EOI, "blockwise")
        assert torch.equal(got, p.fprop(g.fp8_grouped_nt))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_wgrad_matches_the_twin(shape, recipe):
    skip_unfit(shape, recipe)
    p = Problem(**SHAPES[shape], recipe=recipe, seed=len(shape) + 1)
    K = max(p.counts)
    want = p.wgrad(g.fp8_grouped_wgrad_reference)
    got = p.wgrad(g.fp8_grouped_wgrad)
    check(got, want, K, what=f"{shape} {recipe} wgrad fp32", abs_sum=p.wgrad_abs_sum())
    check(p.wgrad(g.fp8_grouped_wgrad, out_dtype=torch.bfloat16),
          p.wgrad(g.fp8_grouped_wgrad_reference, out_dtype=torch.bfloat16), K, what=f"{shape} {recipe} wgrad bf16")
    for e, count in enumerate(p.counts):
        if count == 0:
            assert (got[e] == 0).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_wgrad_accumulates_into_main_grad(recipe):
    p = Problem(**SHAPES["odd"], recipe=recipe, seed=3)
    E = len(p.counts)
    main_grad = torch.randn(E, p.O, p.I, device="cuda")
    before = main_grad.clone()
    want = p.wgrad(g.fp8_grouped_wgrad_reference, accumulate_into=before)
    got = p.wgrad(g.fp8_grouped_wgrad, accumulate_into=main_grad)
    assert got.data_ptr() == main_grad.data_ptr()  # in place
    check(got, want, max(p.counts), what=f"{recipe} accumulate_into", abs_sum=p.wgrad_abs_sum() + before.abs())
    for e, count in enumerate(p.counts):
        if count == 0:
            assert torch.equal(got[e], before[e])  # + exactly zero
    alone = p.wgrad(g.fp8_grouped_wgrad)
    assert (got - before - alone).abs().max() <= 2.0**-22 * got.abs().max()  # one fp32 add


@pytest.mark.parametrize("config", list(g.CONFIGS))
def test_every_config_matches_the_twin(config):
    for recipe in ("tensorwise", "blockwise"):
        if recipe == "blockwise" and g.CONFIGS[config].block_k != 128:
            continue
        p = Problem(**SHAPES["odd"], recipe=recipe, seed=5)
        check(p.fprop(g.fp8_grouped_nt, config=config, fast_accum=False), p.fprop(g.fp8_grouped_nt_reference),
              p.I, what=f"{config} {recipe} fprop")
        check(p.wgrad(g.fp8_grouped_wgrad, config=config), p.wgrad(g.fp8_grouped_wgrad_reference),
              max(p.counts), what=f"{config} {recipe} wgrad", abs_sum=p.wgrad_abs_sum())


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_cuda_graph_replay_is_bitwise_the_eager_result(recipe):
    """Capture fprop, dgrad and wgrad (accumulating) once, then change the routing and the
    data in the static inputs: replay equals eager on the new inputs, bit for bit."""
    shape = dict(SHAPES["odd"])
    first = Problem(**shape, recipe=recipe, seed=7)
    second = Problem(**dict(shape, counts=[120, 0, 3, 250, 134, 0]), recipe=recipe, seed=8)
    names = ("x8", "sx", "w8_EOI", "sw_EOI", "dy8", "sdy", "w8_EIO", "sw_EIO", "ends", "dy8_OP", "sdy_OP",
             "x8_IP", "sx_IP")
    static = Problem(**shape, recipe=recipe, seed=7)
    main_grad = torch.zeros(len(first.counts), first.O, first.I, device="cuda")

    def step(p, grad):
        return p.fprop(g.fp8_grouped_nt), p.dgrad(g.fp8_grouped_nt), p.wgrad(g.fp8_grouped_wgrad, accumulate_into=grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static, main_grad)  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(static, main_grad)
    for source in (first, second):
        for name in names:
            getattr(static, name).copy_(getattr(source, name))
        static.layout.padded_ends_E.copy_(source.layout.padded_ends_E)
        main_grad.fill_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        eager_grad = torch.full_like(main_grad, 0.5)
        eager = step(source, eager_grad)
        for got, want in zip(outputs, eager):
            assert torch.equal(got, want)
        assert torch.equal(main_grad, eager_grad)
