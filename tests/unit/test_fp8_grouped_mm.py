"""F10 on CPU: per-expert FP8 scales and rounding against a float64 reference, the weight
cache's refresh rules, and where the FP8 backend runs (the table)."""

import math

import pytest
import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.experts.padding import NOBODY
from megatron.moe_patches.experts.grouped_mm import GroupedGemmLinear

from expert_shells import ShellGroupedLinear, experts_shell
from expert_configs import fp8_config

E4M3_MAX = 448.0


def e4m3_round_f64(v: float) -> float:
    """Nearest E4M3 value (ties to even), saturating at 448: written from the format
    (3 mantissa bits, exponent bias 7, subnormals below 2**-6)."""
    if v == 0:
        return 0.0
    exponent = max(math.floor(math.log2(abs(v))), -6)
    ulp = 2.0 ** (exponent - 3)
    return max(-E4M3_MAX, min(E4M3_MAX, round(v / ulp) * ulp))  # round(): half to even


def per_expert_amax_by_loop(x_RC, expert_R, num_experts):
    """float64 max |x| over each expert's rows, row by row (0 where an expert has none)."""
    amax = [0.0] * num_experts
    for row, e in zip(x_RC.double(), expert_R.tolist()):
        amax[e] = max(amax[e], row.abs().max().item())
    return torch.tensor(amax, dtype=torch.float64)


def reference_quantize(x_RC, expert_R, num_experts):
    """(dequantized rows, scale_inv per expert) in float64, one scale per expert."""
    x = x_RC.double()
    amax = per_expert_amax_by_loop(x_RC, expert_R, num_experts).tolist()
    scale = [E4M3_MAX / a if a > 0 else 1.0 for a in amax]
    deq = torch.tensor([[e4m3_round_f64(v * scale[e]) / scale[e] for v in row.tolist()]
                        for row, e in zip(x, expert_R.tolist())], dtype=torch.float64)
    return deq, torch.tensor([1 / s for s in scale], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_expert_quantization_matches_the_float64_reference(dtype):
    torch.manual_seed(0)
    expert_R = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3], dtype=torch.int32)  # expert 1 has no row
    x_RC = (torch.randn(8, 24) * torch.tensor([1e-3, 1e-3, 1e-3, 50, 50, 1, 1, 1])[:, None]).to(dtype)
    x_RC[6] = 0  # a zero row inside a non-zero expert
    q_RC, scale_inv_R, scale_inv_E, _ = fp8.quantize_per_expert(x_RC, expert_R, 4)
    deq_ref, scale_inv_ref_E = reference_quantize(x_RC, expert_R, 4)
    assert q_RC.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale_inv_E.double(), scale_inv_ref_E, rtol=2.0**-23, atol=0)  # fp32 scales
    assert scale_inv_E[1] == 1.0  # an expert with no rows keeps scale 1
    assert torch.equal(scale_inv_R, scale_inv_E[expert_R.long()])
    deq = q_RC.double() * scale_inv_R.double()[:, None]
    torch.testing.assert_close(deq, deq_ref, rtol=1e-6, atol=0)
    # Each expert's largest magnitude lands on E4M3's largest value.
    for e in (0, 2, 3):
        assert q_RC[expert_R == e].float().abs().max() == E4M3_MAX


def test_wgrad_columns_start_each_expert_at_a_multiple_of_16_with_zero_pad_columns():
    counts = [0, 5, 16, 17, 0, 1]  # empty experts, exact multiples, one row past one
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = sum(counts)
    columns = fp8.PaddedColumns(offsets_E, rows)
    assert columns.offsets_E.tolist() == [0, 16, 32, 64, 64, 80]  # written out: ceil16 of each count
    assert columns.width == 144  # 39 rows + 6 * 16, up to a multiple of 16 (the GEMM's row stride)
    expert_R = torch.repeat_interleave(torch.arange(6, dtype=torch.int32), torch.tensor(counts))
    q_RC = (torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) % 200 + 1).to(torch.float8_e4m3fn)
    qt_CP = columns.transposed(q_RC, expert_R)
    starts = [0, 0, 16, 32, 64, 64]
    for e, count in enumerate(counts):  # an expert's rows, in order, from its padded start
        first = sum(counts[:e])
        for i in range(count):
            assert torch.equal(qt_CP[:, starts[e] + i].view(torch.uint8), q_RC[first + i].view(torch.uint8))
    used = {starts[e] + i for e, count in enumerate(counts) for i in range(count)}
    pads = [c for c in range(80) if c not in used]  # inside the padded segments, not rows
    assert len(pads) == 80 - rows
    assert not qt_CP[:, pads].view(torch.uint8).any()


def test_scales_from_amax():
    scale, scale_inv = fp8.scales_from_amax(torch.tensor([0.0, 448.0, 2.0, 1e-30]))
    assert scale.tolist()[:3] == [1.0, 1.0, 224.0]
    assert torch.isfinite(scale).all() and torch.equal(scale_inv, torch.reciprocal(scale))


class GroupedGemmShell(GroupedGemmLinear, ShellGroupedLinear):
    """FC1's and FC2's class under the FP8 backend (``linear_step`` over TE's), per expert."""


def expert_linear(experts=3, out_features=4, in_features=8):
    """A TE grouped linear's per-expert weights (float32 here), past its first micro-batch."""
    linear = GroupedGemmShell(experts, out_features, in_features, dtype=torch.float32)
    linear.is_first_microbatch = False
    return linear


def test_weight_cache_refreshes_only_when_the_weights_may_have_changed(quantizations):
    linear = expert_linear()
    params = list(linear.parameters())
    cache = fp8.FP8WeightCache()
    w = torch.stack([p.detach() for p in params])
    cache.get(linear, w)
    first = cache.weights.w8_EOI
    cache.get(linear, w)
    assert quantizations[cache] == 1 and cache.weights.w8_EOI is first  # same weights: no requantization
    # dgrad layout: the same FP8 values, transposed
    assert torch.equal(cache.weights.w8_EIO.float(), cache.weights.w8_EOI.transpose(1, 2).float())
    with torch.no_grad():
        params[1].mul_(2)  # written in place (a checkpoint load): its version moves
    cache.get(linear, torch.stack([p.detach() for p in params]))
    assert quantizations[cache] == 2
    linear.is_first_microbatch = True  # megatron-core's schedule: a new step's first micro-batch
    cache.get(linear, w)
    assert quantizations[cache] == 3 and linear.is_first_microbatch is False


def test_a_refresh_writes_the_same_tensors_with_the_new_weights_values(quantizations):
    """F11's graphs captured GEMMs that read the cached copies: a refresh must land there."""
    linear = expert_linear()
    params = list(linear.parameters())
    cache = fp8.FP8WeightCache()
    cache.get(linear, torch.stack([p.detach() for p in params]))
    held = (cache.weights.w8_EOI, cache.weights.w8_EIO, cache.weights.scale_inv_E)
    pointers = [t.data_ptr() for t in held]
    with torch.no_grad():
        params[2].mul_(-3)
    w_EOI = torch.stack([p.detach() for p in params])
    assert cache.stale(linear)
    cache.get(linear, w_EOI)
    assert not cache.stale(linear) and quantizations[cache] == 2
    assert all(a is b for a, b in zip(held, (cache.weights.w8_EOI, cache.weights.w8_EIO, cache.weights.scale_inv_E)))
    assert [t.data_ptr() for t in held] == pointers
    rows = w_EOI.reshape(-1, w_EOI.shape[-1])
    expert_R = torch.arange(3).repeat_interleave(w_EOI.shape[1])
    deq_ref, scale_inv_ref = reference_quantize(rows, expert_R, 3)
    deq = cache.weights.w8_EOI.double() * cache.weights.scale_inv_E.double()[:, None, None]
    torch.testing.assert_close(cache.weights.scale_inv_E.double(), scale_inv_ref, rtol=2.0**-23, atol=0)
    torch.testing.assert_close(deq.reshape(rows.shape), deq_ref, rtol=1e-6, atol=0)
    assert torch.equal(cache.weights.w8_EIO.float(), cache.weights.w8_EOI.transpose(1, 2).float())


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(cap, "triton_available", lambda: True)


FP8_SELECTION = [
    (dict(), "fp8_grouped_mm", None),
    (dict(fp8="hybrid"), "fp8_grouped_mm", None),
    (dict(fp8_recipe="delayed"), "te", "--fp8-recipe delayed"),
    (dict(fp8_recipe="mxfp8"), "te", "tensorwise"),
    (dict(fp8_param=True), "te", "--fp8-param-gather"),
    (dict(moe_device_tokens_per_expert=False), "te", "moe_device_tokens_per_expert is off"),
    (dict(expert_tensor_parallel_size=2), "te", "expert tensor parallelism"),
    (dict(fp8=None), "grouped_mm", "FP8 only"),
]


@pytest.mark.parametrize("overrides, backend, reason", FP8_SELECTION)
def test_fp8_backend_in_the_table(with_triton, overrides, backend, reason):
    config = fp8_config(**overrides)
    assert moe_plan.plan_for(config).backend.name == backend
    why = dict(moe_plan.plan_for(config).backend_support)["fp8_grouped_mm"]
    assert why is None if reason is None else reason in why


def test_fp8_backend_needs_triton(monkeypatch):
    monkeypatch.setattr(cap, "triton_available", lambda: False)
    assert dict(moe_plan.plan_for(fp8_config()).backend_support)["fp8_grouped_mm"] == "it needs Triton"


def test_fp8_backend_takes_unpadded_rows(with_triton):
    # Any row count per expert: nobody pads, even where F1 could (alltoall + permute fusion).
    config = fp8_config(moe_token_dispatcher_type="alltoall")
    config.moe_permute_fusion = True  # set late: megatron-core's check imports TE's kernels
    assert moe_plan.plan_for(config).padding.padded_by == NOBODY
    assert moe_plan.plan_for(fp8_config(fp8_recipe="delayed")).padding.align == 16  # the TE backend still pads


def test_scales_stay_finite_where_448_over_the_amax_overflows():
    """An expert whose values are all below ~1.3e-36 (bf16 holds them: tiny gradients): 448 / amax
    overflows float32. An infinite scale made its zeros NaN (0 x inf) and dequantized every value
    to 0; as TE's current scaling, the scale is float32's largest value instead. An amax of inf or
    NaN fits nothing: scale 1."""
    f32_max = torch.finfo(torch.float32).max
    scale, scale_inv = fp8.scales_from_amax(torch.tensor([1e-38, 1e-37, float("inf"), float("nan"), 1e-35]))
    assert scale.tolist()[:4] == [f32_max, f32_max, 1.0, 1.0]
    assert scale[4] == torch.tensor(448.0) / torch.tensor(1e-35)  # representable: as computed
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()

    x_RC = torch.tensor([[1e-38, 0.0, -5e-39], [2.0, 1.0, 0.0]], dtype=torch.bfloat16)
    expert_R = torch.tensor([0, 1], dtype=torch.int32)
    q_RC, scale_inv_R, _, _ = fp8.quantize_per_expert(x_RC, expert_R, 2)
    deq = q_RC.float() * scale_inv_R[:, None]
    assert not torch.isnan(q_RC.float()).any()
    assert deq[0, 1] == 0  # zeros stay zero
    torch.testing.assert_close(deq, x_RC.float(), rtol=2.0**-3, atol=0)  # E4M3's rounding, no value lost


@pytest.mark.parametrize("capability, reason", [((9, 0), None), ((10, 0), "Hopper (sm90) only"),
                                                 ((8, 0), "Hopper (sm90) only")])
def test_fp8_backend_runs_on_hopper_only(with_triton, monkeypatch, capability, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    why = moe_plan.backend_blocker(fp8.FP8GroupedMMBackend, fp8_config())
    assert why is None if reason is None else reason in why


def test_fp8_backend_needs_torchs_scaled_grouped_mm(with_triton, monkeypatch):
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert dict(moe_plan.plan_for(fp8_config()).backend_support)["fp8_grouped_mm"] == (
        f"torch {torch.__version__} has no torch._scaled_grouped_mm")


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_fp8_wgrad_follows_the_config(fp8_wgrad):
    """--no-fp8-wgrad: the FCs get no transposed-copy layout (weight gradients in bf16)."""
    from megatron.moe_patches.experts.grouped_mm import RowGroups

    config = fp8_config(fp8_wgrad=fp8_wgrad)
    owner = experts_shell(fp8.FP8GroupedMMBackend, config, 2, (4, 8), (4, 8))
    backend = fp8.FP8GroupedMMBackend(owner)
    groups = RowGroups(torch.tensor([3, 1]), 4, "cpu")
    backend.gemm(groups)
    assert ("fp8_wgrad_columns" in groups._derived) is fp8_wgrad


def test_an_infinite_value_saturates_instead_of_becoming_nan():
    """As TE's kernels: an inf makes its expert's amax inf, hence scale 1, and is stored as
    +-448 (E4M3 has no inf: an unclamped cast would store NaN); the expert's other values keep
    scale 1, the other experts their own scales."""
    x_RC = torch.tensor([[float("inf"), 3.0, -float("inf")], [2.0, 1.0, 0.0]])
    q_RC, _, scale_inv_E, _ = fp8.quantize_per_expert(x_RC, torch.tensor([0, 1], dtype=torch.int32), 2)
    assert q_RC.float().tolist() == [[448.0, 3.0, -448.0], [448.0, 224.0, 0.0]]
    assert torch.equal(scale_inv_E, torch.reciprocal(torch.tensor([1.0, 448.0 / 2.0])))


def test_a_fallback_from_the_asked_backend_is_logged_once_and_only_for_its_precision(with_triton, monkeypatch, caplog):
    """FP8 tensorwise with --moe-device-tokens-per-expert asks for fp8_grouped_mm; another recipe
    falls back to TE with one line saying why, and no line about grouped_mm (bf16 only: it was
    never asked for FP8). A bf16 config's fallback names grouped_mm's reason instead."""
    import logging

    from megatron.moe_patches import fields

    monkeypatch.setattr(fields, "_said", set())
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        moe_plan.plan_for(fp8_config(fp8_recipe="delayed")).log_choices()
        moe_plan.plan_for(fp8_config(fp8_recipe="delayed")).log_choices()
    lines = [r.getMessage() for r in caplog.records if "expert backend" in r.getMessage()]  # not F1's line
    assert lines == ["moe_device_tokens_per_expert: not the fp8_grouped_mm expert backend because of "
                     "--fp8-recipe delayed: it implements tensorwise (current) and blockwise scaling only"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        moe_plan.plan_for(fp8_config(fp8=None, expert_tensor_parallel_size=2)).log_choices()
    assert [r.getMessage() for r in caplog.records if "expert backend" in r.getMessage()] == [
        "moe_device_tokens_per_expert: not the grouped_mm expert backend because of expert tensor parallelism > 1"]


# --- per-expert amaxes the weighted GLU gathers (tensorwise) ----------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "quick_geglu"])
def test_the_glu_gathers_each_experts_amax_of_its_output_and_of_its_input_gradient(activation):
    from megatron.moe_patches.kernels.weighted_glu import ExpertAmax, GLUSpec, weighted_glu

    spec = GLUSpec("swiglu", 1.0, 0.0, None) if activation == "swiglu" else GLUSpec("quick_geglu", 1.702, 1.0, 7.0)
    torch.manual_seed(1)
    expert_T = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3], dtype=torch.int32)  # expert 1: no row
    h = (torch.randn(9, 16) * torch.tensor([1, 1, 1, 40, 40, 0.01, 0.01, 0.01, 5.0])[:, None]).bfloat16()
    h.requires_grad_()
    probs = torch.rand(9)
    rows_used = torch.tensor([8], dtype=torch.int32)  # the last row is outside every group
    amax = ExpertAmax.zeros(expert_T, 4)
    a = weighted_glu(h, probs, spec, rows_used=rows_used, amax=amax, triton=False)
    assert not amax.input_grad_E.any()  # the backward has not run
    da = torch.randn(9, 8).bfloat16() * torch.tensor([1, 1, 1, 1, 1, 100, 100, 100, 1]).bfloat16()[:, None]
    a.backward(da)
    assert torch.equal(amax.output_E.double(), per_expert_amax_by_loop(a.detach(), expert_T, 4))
    assert torch.equal(amax.input_grad_E.double(), per_expert_amax_by_loop(h.grad, expert_T, 4))
    assert amax.output_E[1] == 0 and amax.input_grad_E[1] == 0 and (amax.output_E[[0, 2, 3]] > 0).all()
    assert not h.grad[8].any()  # rows past rows_used take no part (their values would be expert 3's largest)


def test_a_given_amax_sets_the_scales_instead_of_a_pass_over_the_rows():
    torch.manual_seed(2)
    expert_R = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    x_RC = torch.randn(5, 32).bfloat16()
    measured = fp8.quantize_per_expert(x_RC, expert_R, 2)
    given = fp8.quantize_per_expert(x_RC, expert_R, 2, amax_E=per_expert_amax_by_loop(x_RC, expert_R, 2).float())
    assert torch.equal(given[0].view(torch.uint8), measured[0].view(torch.uint8))
    assert torch.equal(given[2], measured[2])
    # a different amax is taken as given: twice the range halves the scale
    wider = fp8.quantize_per_expert(x_RC, expert_R, 2, amax_E=2 * per_expert_amax_by_loop(x_RC, expert_R, 2).float())
    assert torch.equal(wider[2], 2 * measured[2])


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fc2_is_scaled_by_the_glu_output_amax_and_fc1_by_its_input_gradient_amax(recipe):
    """The backend hands FC2 the amax the GLU gathers of its output (FC2's input) and FC1 the
    one of its input gradient (FC1's output gradient); blockwise scales per 1x128 block and
    takes none."""
    from megatron.moe_patches.experts.grouped_mm import RowGroups, grouped_param

    config = fp8_config(fp8_recipe=recipe)
    fc_shape = (128, 128) if recipe == "blockwise" else (4, 8)  # blockwise: whole 128x128 weight tiles
    owner = experts_shell(fp8.FP8GroupedMMBackend, config, 2, fc_shape, fc_shape)
    backend = fp8.FP8GroupedMMBackend(owner)
    calls = {}
    backend._recipe = backend._recipe._replace(
        linear=lambda groups, fp8_wgrad, *kernels: lambda x, w, weights, **amaxes: calls.setdefault(len(calls), amaxes))
    groups = RowGroups(torch.tensor([3, 1]), 4, "cpu")
    gemm = backend.gemm(groups)
    for linear in (owner.linear_fc1, owner.linear_fc2):
        gemm(linear, None, grouped_param(linear))
    amax = backend.glu_amax(groups)
    if recipe == "blockwise":
        assert amax is None and calls == {0: {"target": None}, 1: {"target": None}}
    else:
        assert amax is backend.glu_amax(groups)  # one per forward: the GLU writes what the FCs read
        assert calls[0].keys() == {"dy_amax_E", "target"} and calls[0]["dy_amax_E"] is amax.input_grad_E
        assert calls[1].keys() == {"x_amax_E", "target"} and calls[1]["x_amax_E"] is amax.output_E
        assert torch.equal(amax.expert_T, torch.tensor([0, 0, 0, 1], dtype=torch.int32))
