"""plan_for: one plan per config, made once (validation makes it; construction reads it),
made again after a field changed, every decision with its reason."""

import copy
import logging

import pytest
import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.experts.backend import TEBackend
from megatron.moe_patches.experts.grouped_mm import GroupedMMBackend
from megatron.moe_patches.experts.padding import EXPERTS, NOBODY, TE_KERNEL_NEEDED, PaddingPlan

GLU = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, bf16=True,
           params_dtype=torch.bfloat16)


@pytest.fixture
def hopper_node(monkeypatch):
    """What the plan asks of the machine, answered as a Hopper node with Triton, and a TE
    without the fused permute+pad kernel; stand-ins for the fused permute kernels that
    megatron-core checks for at construction (nothing here calls them)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cap, "triton_available", lambda: True)
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: False)


@pytest.fixture
def counted(monkeypatch):
    """How often a plan is made from scratch."""
    made = []
    make = moe_plan.make_plan
    monkeypatch.setattr(moe_plan, "make_plan", lambda config, facts=None: made.append(config) or make(config, facts))
    return made


def exchange(name, **fields):
    """The plan's exchange choice with ``fields`` set; the rest as for a plain exchange."""
    plain = dict(reason=None, device_counts=False, skips_chunk_sort=False, pad_align=None, static_pad_rows=False,
                 contradictions=())
    return moe_plan.ExchangeChoice(name=name, **{**plain, **fields})


def test_an_exchange_choice_is_built_from_named_fields_only():
    with pytest.raises(TypeError):
        moe_plan.ExchangeChoice(moe_plan.ALLTOALL, None, False, False, None, False, ())
    assert exchange(moe_plan.ALLTOALL).quantized_rows is False


def built(**fields):
    """A config whose every field is set at construction (the moe_config fixture sets some late)."""
    from megatron.moe_patches.config import PatchedTransformerConfig

    return PatchedTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                                    moe_ffn_hidden_size=64, moe_grouped_gemm=True, **GLU, **fields)


def test_validation_makes_the_plan_and_every_reader_gets_that_one(counted):
    config = built(moe_device_tokens_per_expert=True)
    assert len(counted) == 1  # at construction, by the config's validation
    plan = moe_plan.plan_for(config)
    assert moe_plan.plan_for(config) is plan and len(counted) == 1  # the experts, the dispatcher, the graphs
    assert plan.backend is GroupedMMBackend


@pytest.mark.parametrize("change", [
    lambda c: setattr(c, "moe_device_tokens_per_expert", False),
    lambda c: setattr(c, "expert_tensor_parallel_size", 2),
    lambda c: c.recompute_modules.append("moe_act"),  # a list changed in place counts too
])
def test_a_config_changed_after_construction_gets_a_new_plan(counted, change):
    config = built(moe_device_tokens_per_expert=True, recompute_granularity="selective",
                   recompute_modules=["core_attn"])
    before = moe_plan.plan_for(config)
    assert before.backend is GroupedMMBackend and len(counted) == 1
    change(config)
    after = moe_plan.plan_for(config)
    assert after is not before and after.backend is TEBackend and len(counted) == 2
    assert moe_plan.plan_for(config) is after and len(counted) == 2


def test_a_changed_fact_of_the_machine_gets_a_new_plan(counted, hopper_node, monkeypatch):
    """The plan's cache key holds what its rules read of the machine (issue #47): Triton gone
    (a test's stand-in) turns the kernels into the PyTorch twins and refuses the FP8 experts."""
    config = built(moe_device_tokens_per_expert=True)
    before = moe_plan.plan_for(config)
    assert before.triton_kernels and len(counted) == 1
    monkeypatch.setattr(cap, "triton_available", lambda: False)
    after = moe_plan.plan_for(config)
    assert not after.triton_kernels and len(counted) == 2
    assert "kernels: the PyTorch twins (Triton is not importable)" in after.lines()
    assert moe_plan.plan_for(config) is after and len(counted) == 2


def test_a_te_op_that_appears_gets_a_new_plan(counted, hopper_node, monkeypatch):
    """The op-fuser rules ask TE for ops by name: which ones exist is in the key too."""
    config = built(moe_device_tokens_per_expert=True)
    before = moe_plan.plan_for(config)
    te_attr = cap.te_attr
    monkeypatch.setattr(cap, "te_attr", lambda path: object() if path == "ops.ScaledClampedQGeGLU" else te_attr(path))
    assert moe_plan.plan_for(config) is not before and len(counted) == 2


def test_a_copy_keeps_the_plan_until_it_differs(counted):
    config = built(moe_device_tokens_per_expert=True)
    same, other = copy.copy(config), copy.deepcopy(config)
    assert moe_plan.plan_for(same) is moe_plan.plan_for(config)
    assert moe_plan.plan_for(other) == moe_plan.plan_for(config) and len(counted) == 1
    same.fp8 = "e4m3"
    assert moe_plan.plan_for(same).backend is TEBackend and moe_plan.plan_for(config).backend is GroupedMMBackend


def test_every_decision_with_its_reason(moe_config, hopper_node):
    """FP8 delayed scaling, EP 2 over the symmetric exchange, graphs: what runs, and why not more."""
    config = moe_config(**GLU, moe_device_tokens_per_expert=True, expert_model_parallel_size=2,
                        fp8="e4m3", fp8_recipe="delayed")
    config.moe_symmetric_exchange = True  # set late: the plan alone decides
    te_backend = ("the experts run the te backend, which needs host split sizes (fp8_grouped_mm or grouped_mm "
                  "needed)")
    fp8_refusal = "--fp8-recipe delayed: it implements tensorwise (current) and blockwise scaling only"
    expected = moe_plan.MoEPlan(
        backend=TEBackend,
        backend_support=(
            ("op_fuser", "use_transformer_engine_op_fuser is off"),
            ("fp8_grouped_mm", fp8_refusal),
            ("grouped_mm", "it computes bf16 only (FP8 tensorwise and blockwise run the fp8_grouped_mm backend)"),
            ("te", None),
        ),
        padding=PaddingPlan(16, EXPERTS, f"it needs {TE_KERNEL_NEEDED}"),
        exchange=moe_plan.ExchangeChoice(name=moe_plan.ALLTOALL, reason=te_backend, device_counts=True,
                                         skips_chunk_sort=False, pad_align=None, static_pad_rows=False,
                                         contradictions=()),
        single_grouped_refusal=None,
        graph_blocker=f"--expert-model-parallel-size 2: the symmetric exchange cannot run here ({te_backend})",
        ep_size=2,
        expert_tp_size=1,
        notes=(
            (logging.INFO, f"moe_device_tokens_per_expert: not the fp8_grouped_mm expert backend because of {fp8_refusal}"),
            (logging.WARNING, f"F1 fused permute+pad needs {TE_KERNEL_NEEDED}; installed TE: {cap.te_version()}. "
                              "Falling back to permute + explicit padding."),
            (logging.WARNING, f"moe_symmetric_exchange: the expert-parallel exchange stays NCCL's all-to-all because "
                              f"{te_backend}"),
        ),
    )
    plan = moe_plan.plan_for(config)
    assert plan == expected
    assert plan.backend_refusals == expected.backend_support[:3]


def test_the_granted_sync_free_path(moe_config, hopper_node):
    config = moe_config(**GLU, moe_device_tokens_per_expert=True, moe_single_grouped_weight=True)
    config.moe_symmetric_exchange = True  # EP 1: accepted, nothing to exchange
    plan = moe_plan.plan_for(config)
    assert plan.backend is GroupedMMBackend
    assert plan.backend_refusals == (("op_fuser", "use_transformer_engine_op_fuser is off"),
                                     ("fp8_grouped_mm", "it computes FP8 only (bf16 runs the grouped_mm backend)"))
    assert plan.padding == PaddingPlan(None, NOBODY)
    assert plan.exchange == exchange(moe_plan.ALLTOALL, reason="expert parallelism is 1 (nothing to exchange)",
                                     device_counts=True, skips_chunk_sort=True)
    assert plan.single_grouped_refusal is None and plan.graph_blocker is None
    assert plan.notes == ((logging.WARNING, moe_plan.EP1_NOTHING_TO_EXCHANGE),)


def test_single_grouped_params_refused_by_the_plan_name_every_backend(moe_config):
    config = moe_config(**GLU, moe_device_tokens_per_expert=True)
    config.moe_single_grouped_weight, config.params_dtype = True, torch.float32  # set late: the plan decides
    refusal = moe_plan.plan_for(config).single_grouped_refusal
    assert refusal.startswith("moe_single_grouped_weight=True needs an expert backend that holds grouped parameters")
    assert "grouped_mm: it needs bf16 parameters (params_dtype=torch.float32)" in refusal
    assert "op_fuser: use_transformer_engine_op_fuser is off" in refusal
    assert "--moe-device-tokens-per-expert" not in refusal  # given already: no fix to suggest it
    assert "drop the flag" in refusal
    config.moe_device_tokens_per_expert = False
    assert "Use --moe-device-tokens-per-expert" in moe_plan.plan_for(config).single_grouped_refusal


def test_the_dispatchers_options_per_exchange(moe_config):
    allgather = moe_config(**GLU, moe_device_tokens_per_expert=True, moe_token_dispatcher_type="allgather")
    assert moe_plan.plan_for(allgather).exchange == exchange(moe_plan.ALLGATHER, device_counts=True)
    flex = moe_config(**GLU, moe_token_dispatcher_type="flex")
    assert moe_plan.plan_for(flex).exchange == exchange(moe_plan.FLEX)
    nccl = moe_config(**GLU, moe_device_tokens_per_expert=True, expert_model_parallel_size=2)
    assert moe_plan.plan_for(nccl).exchange == exchange(moe_plan.ALLTOALL, device_counts=True)


def test_plan_checks_the_process_groups_against_the_config(moe_config):
    plan = moe_plan.plan_for(moe_config(**GLU, expert_model_parallel_size=2))
    plan.check_parallel_sizes(2, 1)
    with pytest.raises(ValueError, match="EP 1 and expert TP 1, but the config says expert_model_parallel_size=2"):
        plan.check_parallel_sizes(1, 1)
