import logging

import pytest
import torch

from megatron.core.transformer.moe import token_dispatcher
from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import fields
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.dispatch.dispatchers import PatchedAlltoAllTokenDispatcher, alltoall_permute_step
from megatron.moe_patches.dispatch.exchanges import NcclAllToAll
from megatron.moe_patches.dispatch.permute_pad import align_up
from megatron.moe_patches.testing.reference import reference_permute_and_pad, reference_unpermute_and_unpad


def fused_padding_alignment(config):
    """The alignment our dispatchers pad to, or None where they run the stock path (said as
    the dispatchers' construction says it)."""
    plan = moe_plan.plan_for(config)
    plan.log_choices()
    assert plan.exchange.pad_align == (plan.padding.align if plan.padding.dispatcher_pads else None)
    return plan.exchange.pad_align


def test_align_up():
    assert align_up(torch.tensor([0, 1, 15, 16, 17]), 16).tolist() == [0, 16, 16, 16, 32]


def hand_case():
    # 4 tokens (row t holds the value t+1 everywhere), 3 experts:
    # t0 -> e0, e2;  t1 -> e0;  t2 -> e1;  t3 -> e0, e1
    tokens = (torch.arange(4, dtype=torch.float32) + 1).unsqueeze(1).repeat(1, 2)
    routing = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 1, 0], [1, 1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.6, 0.0, 0.4], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.7, 0.0]])
    return tokens, routing, probs


def test_reference_permute_and_pad_by_hand():
    tokens, routing, probs = hand_case()
    permuted, permuted_probs, dest, pad_offsets, padded = reference_permute_and_pad(tokens, probs, routing, 4)
    # e0: t0 t1 t3 pad | e1: t2 t3 pad pad | e2: t0 pad pad pad
    assert permuted[:, 0].tolist() == [1, 2, 4, 0, 3, 4, 0, 0, 1, 0, 0, 0]
    assert permuted_probs.tolist() == pytest.approx([0.6, 1.0, 0.3, 0, 1.0, 0.7, 0, 0, 0.4, 0, 0, 0])
    assert padded.tolist() == [4, 4, 4]
    assert pad_offsets.tolist() == [0, 1, 3]  # padding rows before each expert's group
    assert dest.tolist() == [[0, -1, 8], [1, -1, -1], [-1, 4, -1], [2, 5, -1]]


def test_reference_zero_token_expert_and_nothing_to_pad():
    tokens, routing, probs = hand_case()
    routing = torch.cat([routing, torch.zeros(4, 1, dtype=torch.bool)], dim=1)  # e3: no tokens
    probs = torch.cat([probs, torch.zeros(4, 1)], dim=1)
    _, _, _, pad_offsets, padded = reference_permute_and_pad(tokens, probs, routing, 4)
    assert padded.tolist() == [4, 4, 4, 0]
    assert pad_offsets.tolist() == [0, 1, 3, 6]
    # align 1: nothing to pad, the plain grouped permutation
    permuted, _, _, pad_offsets, padded = reference_permute_and_pad(tokens, probs, routing, 1)
    assert padded.tolist() == [3, 2, 1, 0] and pad_offsets.tolist() == [0, 0, 0, 0]
    assert permuted[:, 0].tolist() == [1, 2, 4, 3, 4, 1]


def test_reference_round_trip():
    torch.manual_seed(0)
    num_tokens, num_experts, topk, hidden = 37, 8, 2, 5
    tokens = torch.randn(num_tokens, hidden, dtype=torch.float64)
    scores = torch.rand(num_tokens, num_experts, dtype=torch.float64)
    top = scores.topk(topk, dim=1).indices
    routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(routing, scores, torch.zeros_like(scores))
    permuted, permuted_probs, dest, _, padded = reference_permute_and_pad(tokens, probs, routing, 16)
    assert all(c % 16 == 0 for c in padded.tolist()) and padded.sum() == permuted.shape[0]
    assert int((permuted_probs != 0).sum()) == num_tokens * topk
    restored = reference_unpermute_and_unpad(permuted, dest)
    torch.testing.assert_close(restored, tokens * topk)
    merged = reference_unpermute_and_unpad(permuted, dest, probs)
    torch.testing.assert_close(merged, tokens * probs.sum(dim=1, keepdim=True))


@pytest.fixture
def te_kernel(monkeypatch):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: True)


DECISIONS = [
    (dict(), None),  # bf16: nothing needs alignment
    (dict(fp8="e4m3", fp8_recipe="tensorwise"), 16),
    (dict(fp8="e4m3", fp8_recipe="delayed", moe_token_dispatcher_type="allgather"), 16),
    (dict(fp8="e4m3", fp8_recipe="mxfp8"), 32),
    (dict(fp8="e4m3", moe_permute_fusion=False), None),
    (dict(fp8="e4m3", moe_router_padding_for_quantization=True), None),
    (dict(fp8="e4m3", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), None),
    (dict(fp8="e4m3", expert_tensor_parallel_size=2, add_bias_linear=False), None),
    (dict(fp8="e4m3", moe_grouped_gemm=False), None),
    (dict(fp8="e4m3", moe_token_dispatcher_type="flex"), None),
]


@pytest.mark.parametrize("overrides, expected", DECISIONS, ids=[str(d) for d, _ in DECISIONS])
def test_fused_padding_decision(moe_config, te_kernel, overrides, expected):
    assert fused_padding_alignment(moe_config(**overrides)) == expected


def test_fallback_without_te_kernel_warns_once(moe_config, monkeypatch, caplog):
    monkeypatch.setattr(cap, "te_fused_permute_pad", lambda: False)
    monkeypatch.setattr(fields, "_said", set())
    with caplog.at_level(logging.WARNING, logger=moe_plan.__name__):
        assert fused_padding_alignment(moe_config(fp8="e4m3")) is None
        assert fused_padding_alignment(moe_config(fp8="e4m3")) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TE >= 2.14" in warnings[0].getMessage()


def bare_alltoall(config, ep_size, num_local_experts, ep_rank=0):
    """The dispatcher without __init__ (that needs CUDA streams): the attributes preprocess reads."""
    dispatcher = object.__new__(PatchedAlltoAllTokenDispatcher)
    dispatcher.config = config
    fused_padding_alignment(config)  # the plan's lines, said once
    dispatcher.permute_step = alltoall_permute_step(config, moe_plan.plan_for(config).exchange)
    dispatcher.exchange = NcclAllToAll()
    dispatcher.drop_and_pad = False
    dispatcher.ep_size, dispatcher.tp_size, dispatcher.tp_rank = ep_size, 1, 0
    dispatcher.num_experts = config.num_moe_experts
    dispatcher.num_local_experts = num_local_experts
    dispatcher.local_expert_indices = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
    dispatcher.tp_ep_group = None
    dispatcher.cuda_sync_point_priority = {
        "before_permutation_1": 0, "before_ep_alltoall": 1, "before_permutation_2": 2,
        "before_finish": 3, "no_sync": 4,
    }
    dispatcher.cuda_dtoh_point, dispatcher.cuda_sync_point = "before_permutation_1", "no_sync"
    return dispatcher


def routing_for(counts):
    """A routing map whose per-expert column sums are ``counts``."""
    num_tokens = max(counts)
    routing = torch.zeros(num_tokens, len(counts), dtype=torch.bool)
    for e, c in enumerate(counts):
        routing[:c, e] = True
    return routing


def test_alltoall_padded_metadata_ep1(moe_config, te_kernel):
    config = moe_config(fp8="e4m3")
    dispatcher = bare_alltoall(config, ep_size=1, num_local_experts=8)
    counts = [5, 0, 16, 17, 1, 32, 3, 2]
    tokens_per_expert = dispatcher.preprocess(routing_for(counts))
    assert tokens_per_expert.tolist() == [16, 0, 16, 32, 16, 32, 16, 16]
    assert dispatcher.num_global_tokens_per_local_expert.tolist() == [[16, 0, 16, 32, 16, 32, 16, 16]]


def test_alltoall_padded_metadata_ep2(moe_config, te_kernel, monkeypatch):
    """EP=2, rank 0 owns experts 0-3: each (source rank, expert) chunk is padded on its own."""
    config = moe_config(fp8="e4m3")
    mine = [5, 0, 16, 17, 1, 2, 3, 40]
    other_rank = torch.tensor([1, 1, 0, 20, 7, 7, 7, 7])

    def fake_allgather(tensor, group=None, **kwargs):  # rank order: [rank 0, rank 1]
        return torch.cat([tensor, other_rank])

    monkeypatch.setattr(token_dispatcher, "gather_from_sequence_parallel_region", fake_allgather)
    dispatcher = bare_alltoall(config, ep_size=2, num_local_experts=4)
    tokens_per_expert = dispatcher.preprocess(routing_for(mine))
    # sent: my chunks for rank 0's experts [16,0,16,32] and rank 1's [16,16,16,48]
    assert dispatcher.input_splits.tolist() == [64, 96]
    # received for my experts 0-3: from rank 0 [16,0,16,32], from rank 1 [16,16,0,32]
    assert dispatcher.num_global_tokens_per_local_expert.tolist() == [[16, 0, 16, 32], [16, 16, 0, 32]]
    assert dispatcher.output_splits.tolist() == [64, 64]
    assert tokens_per_expert.tolist() == [32, 16, 16, 64]


def test_alltoall_unpadded_when_inactive(moe_config, te_kernel):
    dispatcher = bare_alltoall(moe_config(), ep_size=1, num_local_experts=8)  # bf16
    assert not dispatcher.permute_step.pads
    assert dispatcher.preprocess(routing_for([5, 0, 3, 1, 1, 1, 1, 1])).tolist() == [5, 0, 3, 1, 1, 1, 1, 1]


def test_alltoall_padded_metadata_ep2_one_local_expert(moe_config, te_kernel, monkeypatch):
    """EP=2 with one expert per rank: the split sizes come from output_splits, not the
    per-expert matrix (megatron-core keeps none with one local expert)."""
    config = moe_config(fp8="e4m3", num_moe_experts=2)
    mine, other_rank = [5, 17], torch.tensor([20, 3])

    def fake_allgather(tensor, group=None, **kwargs):
        return torch.cat([tensor, other_rank])

    monkeypatch.setattr(token_dispatcher, "gather_from_sequence_parallel_region", fake_allgather)
    dispatcher = bare_alltoall(config, ep_size=2, num_local_experts=1)
    tokens_per_expert = dispatcher.preprocess(routing_for(mine))
    assert dispatcher.input_splits.tolist() == [16, 32]  # my 5 for expert 0, my 17 for expert 1
    assert dispatcher.output_splits.tolist() == [16, 32]  # expert 0 gets 5 from me, 20 from rank 1
    assert dispatcher.output_splits_tp.tolist() == [48]
    assert tokens_per_expert.tolist() == [48]
