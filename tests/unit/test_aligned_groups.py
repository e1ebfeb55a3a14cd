"""F10 blockwise on DeepGEMM, CPU side: the static padded layout the dispatcher permutes into
(against a loop written from its definition), the plan's decision and its lines, the
dispatcher's step wiring, the backend's kernel choice, and the DeepGEMM probe."""

import logging
import sys
import types

import pytest
import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import fields
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.plan import padding as plan_padding
from megatron.moe_patches.dispatch import permute_pad
from megatron.moe_patches.dispatch.permute_pad import StaticPaddedPermute, static_padded_layout, static_padded_rows
from megatron.moe_patches.experts import fp8_blockwise
from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.experts.padding import NOBODY, PERMUTE, PaddingPlan
from megatron.moe_patches.kernels import fp8_blockwise_quantize as bq

from expert_shells import experts_shell
from expert_configs import fp8_config

ALIGN = 128
DEEP_GEMM_KERNELS = "DeepGEMM's blockwise FP8 grouped GEMMs for fprop and dgrad"  # what the plan names them


def layout_by_loop(counts, align):
    """Expert e's group: its count rounded up to ``align``; its rows move down by the padding
    of the groups before it."""
    padded, offsets, moved = [], [], 0
    for count in counts:
        padded.append(-(-count // align) * align)
        offsets.append(moved)
        moved += padded[-1] - count
    return padded, offsets


@pytest.mark.parametrize("counts", [[0, 300, 1, 0, 83, 128], [1] * 8, [129] * 4, [0, 0, 0, 5]])
@pytest.mark.parametrize("topk", [1, 8])
def test_the_static_layout_pads_every_group_to_128_rows_within_the_static_count(counts, topk):
    tokens = -(-sum(counts) // topk)  # enough tokens for these routed rows
    counts[-1] += tokens * topk - sum(counts)  # every token routed to topk experts
    rows = static_padded_rows(tokens, topk, len(counts), ALIGN)
    assert rows == tokens * topk + len(counts) * (ALIGN - 1)
    padded_E, offsets_E = static_padded_layout(torch.tensor(counts), ALIGN)
    want_padded, want_offsets = layout_by_loop(counts, ALIGN)
    assert padded_E.tolist() == want_padded and offsets_E.tolist() == want_offsets
    assert sum(want_padded) <= rows  # the rest is the unused tail


def test_the_worst_routing_fills_the_static_rows():
    # every expert one row past a boundary: the most padding any routing needs
    experts, topk = 8, 2
    counts = [ALIGN + 1] * experts
    rows = static_padded_rows(sum(counts) // topk, topk, experts, ALIGN)
    padded_E, _ = static_padded_layout(torch.tensor(counts), ALIGN)
    assert padded_E.tolist() == [2 * ALIGN] * experts and int(padded_E.sum()) == rows


def blockwise_config(**overrides):
    config = fp8_config(fp8_recipe="blockwise", hidden_size=128, moe_ffn_hidden_size=256,
                        moe_token_dispatcher_type=overrides.pop("moe_token_dispatcher_type", "alltoall"), **overrides)
    config.moe_permute_fusion = True  # set late: megatron-core's check imports TE's kernels
    return config


@pytest.fixture
def machine(monkeypatch):
    """Triton, TE's permute kernel and DeepGEMM present; tests take DeepGEMM away."""
    monkeypatch.setattr(cap, "triton_available", lambda: True)
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: True)
    monkeypatch.setattr(cap, "deep_gemm_grouped_fp8", lambda: True)
    monkeypatch.setattr(fields, "_said", set())
    return monkeypatch


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_with_deep_gemm_the_dispatcher_pads_blockwise_groups_into_static_rows(machine, dispatcher, caplog):
    plan = moe_plan.plan_for(blockwise_config(moe_token_dispatcher_type=dispatcher))
    assert plan.backend is fp8.FP8GroupedMMBackend
    assert plan.padding == PaddingPlan(ALIGN, PERMUTE, static_rows=True, aligned_kernels=DEEP_GEMM_KERNELS)
    assert (plan.exchange.pad_align, plan.exchange.static_pad_rows, plan.exchange.device_counts) == (ALIGN, True, True)
    assert plan.graph_blocker is None
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        plan.log_choices()
    assert any("run DeepGEMM's blockwise FP8 grouped GEMMs" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overrides, why", [
    (dict(expert_model_parallel_size=2), "expert parallelism > 1"),
    (dict(moe_expert_capacity_factor=1.0), "dropless"),
    (dict(moe_token_dispatcher_type="flex"), "the flex dispatcher"),
])
def test_where_the_dispatcher_cannot_pad_statically_the_triton_kernels_run_and_say_why(machine, overrides, why):
    config = blockwise_config(**overrides)
    reason = moe_plan.static_padding_blocker(config)
    assert reason is not None and why in reason
    padding = plan_padding.choose_padding(config, fp8.FP8GroupedMMBackend, notes := [])
    assert padding == PaddingPlan(None, NOBODY)
    assert len(notes) == 1 and "keep their other kernels, not DeepGEMM's" in notes[0][1] and why in notes[0][1]


def test_the_static_padding_needs_the_device_counts_and_the_fused_permute(machine):
    config = blockwise_config()
    config.moe_permute_fusion = False
    assert "--moe-permute-fusion" in moe_plan.static_padding_blocker(config)
    config = blockwise_config()
    config.moe_device_tokens_per_expert = False
    assert "--moe-device-tokens-per-expert" in moe_plan.static_padding_blocker(config)
    machine.setattr(cap, "te_fused_permute_pad", lambda: False)
    assert "moe_permute_and_pad_with_probs" in moe_plan.static_padding_blocker(blockwise_config())


@pytest.mark.parametrize("recipe, deep_gemm", [("blockwise", False), ("tensorwise", True)])
def test_nobody_pads_without_deep_gemm_or_for_tensorwise(machine, recipe, deep_gemm):
    machine.setattr(cap, "deep_gemm_grouped_fp8", lambda: deep_gemm)
    plan = moe_plan.plan_for(blockwise_config() if recipe == "blockwise"
                             else fp8_config(moe_token_dispatcher_type="alltoall"))
    assert plan.backend is fp8.FP8GroupedMMBackend
    assert plan.padding == PaddingPlan(None, NOBODY) and not plan.exchange.static_pad_rows
    assert not any("DeepGEMM" in line for _, line in plan.notes)


@pytest.mark.parametrize("static_rows, kernel", [(True, fp8_blockwise.deep_gemm_grouped_nt),
                                                 (False, fp8_blockwise.triton_grouped_nt)])
def test_the_backend_picks_the_fprop_dgrad_gemm_from_the_padding_at_construction(static_rows, kernel):
    padding = PaddingPlan(ALIGN, PERMUTE, static_rows=True) if static_rows else PaddingPlan(None, NOBODY)
    config = blockwise_config()
    owner = experts_shell(fp8.FP8GroupedMMBackend, config, 2, (256, 128), (128, 128), padding_plan=padding)
    assert fp8.FP8GroupedMMBackend(owner)._kernels == (kernel,)
    config.fp8_recipe = "tensorwise"
    assert fp8.FP8GroupedMMBackend(owner)._kernels == ()  # torch._scaled_grouped_mm takes any groups


def test_the_static_step_permutes_into_the_static_rows_with_device_offsets(monkeypatch):
    calls = {}

    def fake_permute(tokens, probs, routing_map, rows, pad_offsets):
        calls.update(rows=rows, pad_offsets=pad_offsets)
        return tokens.new_zeros(rows, tokens.shape[1]), "row-map", probs.new_zeros(rows)

    monkeypatch.setattr(permute_pad, "permute_into_rows", fake_permute)
    monkeypatch.setattr(permute_pad, "unpermute_and_unpad",
                        lambda y, row_map, offsets, shape: calls.update(unpermute=(row_map, offsets, shape)))
    routing = torch.zeros(6, 4, dtype=torch.bool)
    for token, experts in enumerate([(0, 1), (1, 2), (0, 2), (0, 3), (1, 3), (0, 1)]):
        routing[token, list(experts)] = True
    step = StaticPaddedPermute(ALIGN, topk=2)
    permuted = step.permute(torch.ones(6, 3), torch.rand(6, 4), routing)
    rows = 6 * 2 + 4 * (ALIGN - 1)
    assert calls["rows"] == rows and permuted.x_RH.shape == (rows, 3)
    assert permuted.tokens_per_expert.tolist() == [ALIGN] * 4  # the rows past them: no expert's
    # counts 4, 4, 2, 2: each group moves down by the padding before it
    assert calls["pad_offsets"].tolist() == [0, ALIGN - 4, 2 * ALIGN - 8, 3 * ALIGN - 10]
    assert permuted.pad_offsets is calls["pad_offsets"]
    assert step.align_splits(None, routing, routing.sum(0)).tolist() == permuted.tokens_per_expert.tolist()
    assert step.permute_local(torch.ones(6, 3), torch.rand(6, 4), routing, slice(0, 4)).tokens_per_expert.tolist() \
        == permuted.tokens_per_expert.tolist()
    step.unpermute("y", "row-map", permuted.pad_offsets, (6, 3), routing)
    assert calls["unpermute"] == ("row-map", permuted.pad_offsets, (6, 3))


def _gemm(doc):
    gemm = types.SimpleNamespace(__doc__=doc)
    return types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=gemm)


def _wheel_wrapper(a, b, d, grouped_layout, recipe=None, use_psum_layout=False):
    """How PyPI's sgl-deep-gemm exposes the GEMM: a Python function without a docstring."""


def _old_wrapper(a, b, d, m_indices):
    pass


@pytest.mark.parametrize("module, found", [
    (_gemm("m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, ..., use_psum_layout: bool = False)"), True),
    (types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=_wheel_wrapper), True),
    (types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=_old_wrapper), False),
    (_gemm("m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)"), False),  # no device-side ends
    (types.SimpleNamespace(), False),
    (None, False),  # not installed
])
def test_the_deep_gemm_probe_wants_device_side_ends(monkeypatch, module, found):
    monkeypatch.setitem(sys.modules, "deep_gemm", module)  # None: the import fails
    cap.deep_gemm_grouped_fp8.cache_clear()
    try:
        assert cap.deep_gemm_grouped_fp8() is found
    finally:
        cap.deep_gemm_grouped_fp8.cache_clear()


# --- the FP8 rows the dispatcher writes as it permutes (blockwise with bf16 wgrad) -----------


@pytest.mark.parametrize("fp8_wgrad, quantized", [(False, True), (True, False)])
def test_with_bf16_wgrad_the_static_permute_writes_the_fp8_rows_too(machine, fp8_wgrad, quantized, caplog):
    """FP8 wgrad quantizes the rows along the tokens as well, in its own pass: only with bf16
    wgrad do the experts read nothing of the rows but their 1x128 copy."""
    config = blockwise_config()
    config.fp8_wgrad = fp8_wgrad
    plan = moe_plan.plan_for(config)
    assert plan.padding == PaddingPlan(ALIGN, PERMUTE, static_rows=True, quantized_rows=quantized,
                                       aligned_kernels=DEEP_GEMM_KERNELS)
    assert plan.exchange.quantized_rows == quantized
    step = permute_pad_step(config, plan)
    assert isinstance(step, StaticPaddedPermute) and step.quantized_rows == quantized
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        plan.log_choices()
    said = any("writes their FP8 copy in the same pass" in r.getMessage() for r in caplog.records)
    assert said == quantized


def test_without_deep_gemm_nothing_is_quantized_by_the_permute(machine):
    machine.setattr(cap, "deep_gemm_grouped_fp8", lambda: False)
    config = blockwise_config()
    config.fp8_wgrad = False
    plan = moe_plan.plan_for(config)
    assert not plan.padding.quantized_rows and not plan.exchange.quantized_rows


def permute_pad_step(config, plan):
    from megatron.moe_patches.dispatch.dispatchers import alltoall_permute_step

    return alltoall_permute_step(config, plan.exchange)


def test_attached_rows_are_taken_once_through_views_and_only_while_unwritten():
    x = torch.randn(4, 256)
    x8, scales = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    bq.attach_quantized_rows(x, x8, scales)
    taken = bq.take_quantized_rows(x.view_as(x))  # autograd hands a Function's output on as a view
    assert taken is not None and taken[0] is x8 and taken[1] is scales
    assert bq.take_quantized_rows(x) is None  # taken once: the copy is not kept alive
    bq.attach_quantized_rows(x, x8, scales)
    x.mul_(2)  # written since: the copy is stale
    assert bq.take_quantized_rows(x) is None
    bq.attach_quantized_rows(x, x8, scales)
    assert bq.take_quantized_rows(x[:2]) is None  # other rows than the copy's
    assert bq.take_quantized_rows(torch.randn(4, 256)) is None  # nothing attached


def test_the_quantizing_static_step_routes_through_its_functions(monkeypatch):
    """Wiring only (the kernels are proven on the GPU): the permute attaches the FP8 rows its
    Function returns, the unpermute runs the Function whose backward writes them."""
    seen = {}

    class FakePermute:
        @staticmethod
        def apply(x, probs, routing, rows, align, counts, offsets):
            seen["permute"] = (rows, align, counts.tolist(), offsets.tolist())
            return (x.new_zeros(rows, x.shape[1]), probs.new_zeros(rows), "row-map",
                    torch.zeros(rows, x.shape[1], dtype=torch.float8_e4m3fn), torch.ones(rows, 1))

    class FakeUnpermute:
        @staticmethod
        def apply(y, row_map, offsets, counts, align):
            seen["unpermute"] = (row_map, counts.tolist(), align)
            return "restored"

    monkeypatch.setattr(permute_pad, "_PermuteQuantizing", FakePermute)
    monkeypatch.setattr(permute_pad, "_UnpermuteQuantizingGrad", FakeUnpermute)
    monkeypatch.setattr(permute_pad, "permute_into_rows", lambda *a: pytest.fail("TE's permute ran"))
    routing = torch.zeros(3, 2, dtype=torch.bool)
    routing[:, 0] = True
    routing[0, 1] = True
    step = StaticPaddedPermute(ALIGN, topk=1, quantized_rows=True)
    permuted = step.permute(torch.ones(3, 128), torch.rand(3, 2), routing)
    rows = 3 + 2 * (ALIGN - 1)
    assert seen["permute"] == (rows, ALIGN, [3, 1], [0, ALIGN - 3])
    taken = bq.take_quantized_rows(permuted.x_RH)
    assert taken is not None and taken[0].shape == (rows, 128)
    assert step.unpermute("y", "row-map", permuted.pad_offsets, (3, 128), routing) == "restored"
    assert seen["unpermute"] == ("row-map", [3, 1], ALIGN)
