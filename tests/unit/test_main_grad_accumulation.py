"""F13 on the CPU: the drop-in for megatron-core's APEX functions, its binding and revert, the
plan's decision, and the grouped_mm backend adding its weight gradients into main_grad (the
PyTorch twin of the Triton kernel; the kernel itself is proven in tests/gpu)."""

import logging

import pytest
import torch

from megatron.moe_patches import apply, plan as moe_plan, revert
from megatron.moe_patches.experts import grouped_mm as f8
from megatron.moe_patches.kernels import main_grad_accumulation as mga

import expert_shells as shells
from expert_configs import cfg


def _float64_product(dy, x):
    return dy.reshape(-1, dy.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()


def test_wgrad_gemm_accum_fp32_adds_in_place_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=torch.bfloat16)
    dy = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    main_grad = torch.randn(8, 16)
    expected = main_grad.double() + _float64_product(dy, x)
    same = main_grad
    mga.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad is same and main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)


def test_wgrad_gemm_accum_fp16_adds_in_the_grads_dtype():
    torch.manual_seed(1)
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    dy = torch.randn(12, 8, dtype=torch.bfloat16)
    main_grad = torch.zeros(8, 16, dtype=torch.bfloat16)
    mga.wgrad_gemm_accum_fp16(x, dy, main_grad)
    assert main_grad.dtype == torch.bfloat16
    torch.testing.assert_close(main_grad.double(), _float64_product(dy, x), rtol=2e-2, atol=5e-2)


def test_apply_binds_the_apex_functions_where_megatron_core_looks_and_revert_removes_them():
    from megatron.core.tensor_parallel import layers

    assert not layers._grad_accum_fusion_available and not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    apply("F13")
    try:
        assert layers._grad_accum_fusion_available
        assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is mga.wgrad_gemm_accum_fp32
        assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16 is mga.wgrad_gemm_accum_fp16
        apply("F13")  # idempotent
    finally:
        revert("F13")
    assert layers._grad_accum_fusion_available is False
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    # not mistaken for APEX after a revert: the feature installs again
    from megatron.moe_patches.installer import installs

    assert installs("F13")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_the_plan_fuses_for_grouped_mm_and_for_the_fp8_experts(monkeypatch, recipe):
    from megatron.moe_patches import capabilities as cap

    assert moe_plan.plan_for(cfg(gradient_accumulation_fusion=True)).wgrad_into_main_grad
    assert not moe_plan.plan_for(cfg(gradient_accumulation_fusion=False)).wgrad_into_main_grad
    monkeypatch.setattr(cap, "triton_available", lambda: True)  # where the FP8 experts run
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: None, raising=False)
    fp8 = cfg(gradient_accumulation_fusion=True, fp8="e4m3", fp8_recipe=recipe, hidden_size=128,
              moe_ffn_hidden_size=128)
    plan = moe_plan.plan_for(fp8)
    assert plan.backend.name == "fp8_grouped_mm" and plan.wgrad_into_main_grad
    assert not any("gradient_accumulation_fusion" in line for _, line in plan.notes)


def _twin_experts(config, counts, main_grads, seed=3):
    """A grouped_mm backend over 3 CPU experts; ``main_grads``: give the weights fp32 main grads."""
    owner = shells.experts_shell(f8.GroupedMMBackend, config, 3, (16, 8), (8, 8), seed=seed,
                                 wgrad_into_main_grad=config.gradient_accumulation_fusion)
    backend = f8.GroupedMMBackend(owner)
    if main_grads:
        for fc in (owner.linear_fc1, owner.linear_fc2):
            for p in f8.weight_params(fc):
                p.main_grad = torch.linspace(-1, 1, p.numel()).view(p.shape)  # earlier micro-batches' sum
                p.grad_added_to_main_grad = False
    return owner, backend


def _micro_batches(owner, backend, counts, batches=2, seed=5):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    for _ in range(batches):
        x = torch.randn(rows, 8, dtype=torch.bfloat16, generator=generator)
        probs = torch.rand(rows, generator=generator)
        out, _ = backend.forward(owner, x, torch.tensor(counts), probs)
        out.backward(torch.randn(out.shape, dtype=out.dtype, generator=generator))


@pytest.mark.parametrize("grouped_weight", [False, True], ids=["per-expert", "grouped"])
def test_grouped_mm_backend_adds_weight_gradients_into_main_grad(grouped_weight):
    counts = [3, 0, 5]
    unfused_owner, unfused = _twin_experts(cfg(moe_single_grouped_weight=grouped_weight), counts, main_grads=False)
    fused_owner, fused = _twin_experts(cfg(moe_single_grouped_weight=grouped_weight, gradient_accumulation_fusion=True),
                                       counts, main_grads=True)
    assert fused.main_grad_targets is not None and unfused.main_grad_targets is None
    _micro_batches(unfused_owner, unfused, counts)
    _micro_batches(fused_owner, fused, counts)
    for fc in ("linear_fc1", "linear_fc2"):
        for p_unfused, p_fused in zip(f8.weight_params(getattr(unfused_owner, fc)),
                                      f8.weight_params(getattr(fused_owner, fc))):
            start = torch.linspace(-1, 1, p_fused.numel()).view(p_fused.shape)
            # the unfused gradient summed both micro-batches in bf16; the fused one in fp32
            torch.testing.assert_close(p_fused.main_grad - start, p_unfused.grad.float(), rtol=2e-2, atol=2e-2)
            assert p_fused.grad_added_to_main_grad
            assert p_fused.grad is not None  # the placeholder DDP's hook skips


def test_fused_backward_without_main_grad_names_the_flag():
    counts = [2, 2, 2]
    owner, backend = _twin_experts(cfg(gradient_accumulation_fusion=True), counts, main_grads=False)
    with pytest.raises(RuntimeError, match="--no-gradient-accumulation-fusion"):
        _micro_batches(owner, backend, counts, batches=1)


def test_the_main_grad_table_is_built_once_per_set_of_addresses():
    table = mga.MainGradTable(triton=False)
    grads = [torch.zeros(2, 2) for _ in range(3)]
    first = table.of(grads)
    assert table.of(grads) is first
    assert first.tolist() == [g.data_ptr() for g in grads]
    moved = [torch.zeros(2, 2) for _ in range(3)]
    assert table.of(moved).tolist() == [g.data_ptr() for g in moved]
