"""F13 on the GPU: weight gradients added into DDP's fp32 main_grad by the GEMM.

- The experts' grouped kernel and the dense drop-in for megatron-core's APEX functions
  against float64 sums of the same bf16 inputs.
- Megatron's DDP (overlap_grad_reduce, small buckets) over one MoE layer and a non-TE
  ColumnParallelLinear, several micro-batches: the fused main grads equal the unfused run's
  within the unfused run's bf16 rounding of each micro-batch's gradient, the parameters the
  fusion does not touch bitwise; the layer captured as CUDA graphs adds bitwise what the
  eager fused layer adds (and DDP's hook adds nothing on top)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MICRO_BATCHES = 3


def _float64_wgrad(x_TI, dy_TO, counts):
    pieces, start = [], 0
    for c in counts:
        pieces.append(dy_TO[start:start + c].double().t() @ x_TI[start:start + c].double())
        start += c
    return pieces


def test_grouped_kernel_adds_each_experts_gradient_into_scattered_main_grads():
    from megatron.moe_patches.kernels.main_grad_accumulation import MainGradTable, grouped_wgrad_into_main_grad

    torch.manual_seed(0)
    counts = [0, 1, 63, 64, 65, 300, 0, 7]  # empty experts, tile edges; 5 unused rows after the last
    E, O, I = len(counts), 200, 136  # neither a multiple of the 128 tiles
    rows = sum(counts) + 5
    x_TI = torch.randn(rows, I, device="cuda", dtype=torch.bfloat16)
    dy_TO = torch.randn(rows, O, device="cuda", dtype=torch.bfloat16)
    offsets_E = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    # per-expert targets inside one buffer, in shuffled order and with gaps (as DDP's buckets may lay them)
    buffer = torch.randn(E + 3, O * I, device="cuda")
    slots = torch.randperm(E + 3)[:E].tolist()
    main_grads = [buffer[s].view(O, I) for s in slots]
    before = [g.double().clone() for g in main_grads]
    untouched = [s for s in range(E + 3) if s not in slots]
    spare = buffer[untouched].clone()
    table = MainGradTable(triton=True)
    for _ in range(2):  # twice: the second call reuses the table
        grouped_wgrad_into_main_grad(x_TI, dy_TO, offsets_E, main_grads, table)
    for e, expected in enumerate(_float64_wgrad(x_TI, dy_TO, counts)):
        torch.testing.assert_close(main_grads[e].double(), before[e] + 2 * expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(buffer[untouched], spare)


def test_dense_drop_in_adds_into_main_grad():
    from megatron.moe_patches import apply, revert

    apply("F13")
    try:
        from megatron.core.tensor_parallel import layers

        torch.manual_seed(1)
        x = torch.randn(3, 100, 512, device="cuda", dtype=torch.bfloat16)  # [s, b, in], as the layers pass it
        dy = torch.randn(3, 100, 384, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.randn(384, 512, device="cuda")
        expected = main_grad.double() + dy.reshape(-1, 384).double().t() @ x.reshape(-1, 512).double()
        address = main_grad.data_ptr()
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main_grad)
        assert main_grad.data_ptr() == address
        torch.testing.assert_close(main_grad.double(), expected, rtol=1e-5, atol=1e-3)
        half = torch.zeros(384, 512, device="cuda", dtype=torch.bfloat16)
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x, dy, half)
        product = dy.reshape(-1, 384).double().t() @ x.reshape(-1, 512).double()
        torch.testing.assert_close(half.double(), product, rtol=2e-2, atol=2e-1)  # rounded to bf16 once
    finally:
        revert("F13")


class _LayerAndLinear(torch.nn.Module):
    """One MoE layer followed by a non-TE ColumnParallelLinear (megatron-core's own, the kind
    of layer that takes APEX's functions)."""

    def __init__(self, config):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear
        from megatron.moe_patches.testing.layer_harness import build_moe_layer

        super().__init__()
        self.moe = build_moe_layer(config)
        self.head = ColumnParallelLinear(config.hidden_size, 320, config=config, init_method=torch.nn.init.normal_,
                                         bias=False, gather_output=True).cuda()

    def forward(self, hidden):
        out, _ = self.moe(hidden)
        logits, _ = self.head(out)
        return logits


def _main_grads(fusion, grouped_weight, graphs=False, precision="bf16", **overrides):
    """Every parameter's main_grad after MICRO_BATCHES micro-batches and the grad sync
    (``precision``: the layer harness's, e.g. "fp8-blockwise-bf16-wgrad")."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.moe_patches import apply, revert
    from megatron.moe_patches.config import PatchedTransformerConfig
    from megatron.moe_patches.graphs.layer_graphs import LayerGraphs
    from megatron.moe_patches.testing.layer_harness import init_single_gpu

    from gpu_checks import small_moe_kwargs

    apply()
    try:
        init_single_gpu()
        kwargs = small_moe_kwargs(8, 2, precision=precision, moe_device_tokens_per_expert=True,
                                  moe_single_grouped_weight=grouped_weight, gradient_accumulation_fusion=fusion,
                                  **overrides)
        config = PatchedTransformerConfig(**kwargs)
        model = _LayerAndLinear(config)
        if precision != "bf16":
            assert type(model.moe.experts.backend).__name__ == "FP8GroupedMMBackend"
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=1 << 16), model)
        generator = torch.Generator(device="cuda").manual_seed(7)
        batches = [(torch.randn(256, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator),
                    torch.randn(256, 1, 320, device="cuda", dtype=torch.bfloat16, generator=generator))
                   for _ in range(MICRO_BATCHES)]
        captured = None
        if graphs:
            captured = LayerGraphs([model.moe], batches[0][0]).install()
        ddp.zero_grad_buffer()
        for hidden, grad in batches:
            ddp(hidden.requires_grad_(True)).backward(grad)
        ddp.finish_grad_sync()
        if captured is not None:
            assert captured.replays == MICRO_BATCHES
        return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    finally:
        revert()


@pytest.mark.parametrize("grouped_weight", [False, True], ids=["per-expert", "grouped"])
def test_ddp_main_grads_fused_equal_unfused(grouped_weight):
    from gpu_checks import compare

    unfused = _main_grads(False, grouped_weight)
    fused = _main_grads(True, grouped_weight)
    fused_weights = [n for n in fused if "linear_fc" in n or n.startswith("head.")]
    assert len(fused_weights) >= 3
    summary = compare(unfused, fused, fused_weights)
    print("fused vs unfused weights:", summary)
    # the unfused run rounds each micro-batch's weight gradient to bf16 before adding it
    assert summary["max_rel"] < 1e-2
    rest = compare(unfused, fused, [n for n in fused if n not in fused_weights])
    print("other parameters:", rest)
    assert rest["bitwise"], rest


@pytest.mark.parametrize("precision", ["fp8", "fp8-bf16-wgrad", "fp8-blockwise", "fp8-blockwise-bf16-wgrad"])
def test_fp8_experts_main_grads_fused_equal_unfused(precision):
    """F13 with the FP8 grouped-GEMM experts (F10): FP8 or bf16 weight gradients added into the
    grouped fp32 main_grad by the GEMM equal DDP's add of the returned gradient (which rounds
    each micro-batch's gradient to bf16 first); every other parameter is bitwise the same."""
    from gpu_checks import compare

    sizes = dict(moe_ffn_hidden_size=256) if "blockwise" in precision else {}  # whole 128x128 tiles
    unfused = _main_grads(False, True, precision=precision, **sizes)
    fused = _main_grads(True, True, precision=precision, **sizes)
    experts = [n for n in fused if "linear_fc" in n]
    summary = compare(unfused, fused, experts)
    print(f"{precision} fused vs unfused expert weights:", summary)
    assert len(experts) == 2 and summary["max_rel"] < 1e-2
    rest = compare(unfused, fused, [n for n in fused if n not in experts and not n.startswith("head.")])
    assert rest["bitwise"], rest


def test_graphed_layer_adds_into_main_grad_as_the_eager_layer_does():
    from gpu_checks import compare

    eager = _main_grads(True, True)
    graphed = _main_grads(True, True, graphs=True)
    summary = compare(eager, graphed)
    print("graphed vs eager, fused:", summary)
    assert summary["bitwise"], summary
