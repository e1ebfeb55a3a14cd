"""F2 wiring with stand-in HybridEP buffers: deep_ep cannot be installed on these machines,
so these tests check what the plan decides from the buffer class and which arguments reach
the buffer, not HybridEP itself."""

import logging
import types

import pytest

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.dispatch.hybridep_blocks import (FusedPermuteBuffer, ensure_hybridep_buffer,
                                                           hybridep_block_kwargs)
from megatron.moe_patches.plan.exchange import (HYBRIDEP_BLOCKS_NOT_TAKEN, HYBRIDEP_FUSION_NOT_TAKEN,
                                                hybridep_choices)


class NewBuffer:
    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8,
                 num_sms_dispatch_api=None, num_sms_combine_api=None,
                 num_blocks_permute=None, num_blocks_unpermute=None):
        self.kwargs = dict(locals())
        del self.kwargs["self"]


class OldBuffer:
    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8,
                 num_sms_dispatch_api=None, num_sms_combine_api=None):
        self.kwargs = dict(locals())
        del self.kwargs["self"]


class FusingBuffer(NewBuffer):
    """deep_ep whose HybridEP can fuse permute/unpermute into dispatch/combine."""

    calls = []

    def dispatch_with_permute(self, hidden, routing_map, fuse_permute_dispatch=False, **kwargs):
        self.calls.append(("dispatch", fuse_permute_dispatch, kwargs))
        return hidden

    def combine_with_unpermute(self, hidden, handle=None, fuse_unpermute_combine=False, **kwargs):
        self.calls.append(("combine", fuse_unpermute_combine, kwargs))
        return hidden

    def update_template_config(self, **kwargs):  # any other method passes through untouched
        return "untouched"


class NonFusingBuffer(NewBuffer):
    def dispatch_with_permute(self, hidden, routing_map, **kwargs):
        return hidden

    def combine_with_unpermute(self, hidden, handle=None, **kwargs):
        return hidden


def config(permute=None, unpermute=None, fuse=False, dispatcher="flex"):
    return types.SimpleNamespace(
        moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend="hybridep",
        moe_hybridep_num_blocks_permute=permute, moe_hybridep_num_blocks_unpermute=unpermute,
        moe_permute_fusion_into_hybridep=fuse, moe_hybridep_num_sms=16,
    )


def choice(blocks=False, fuse=False):
    """The plan's exchange choice, as far as the buffer reads it."""
    return types.SimpleNamespace(hybridep_block_counts=blocks, hybridep_permute_fusion=fuse)


class Hidden:
    shape = (4096, 2048)


@pytest.mark.parametrize("buffer_class, takes", [
    (NewBuffer, (True, False)), (OldBuffer, (False, False)), (FusingBuffer, (True, True)),
    (NonFusingBuffer, (True, False)), (None, (False, False)),  # None: no deep_ep
])
def test_the_options_are_read_off_the_buffer_class(buffer_class, takes):
    assert tuple(cap.hybridep_options(buffer_class)) == takes


@pytest.fixture
def installed(monkeypatch):
    """Make ``buffer_class`` the installed deep_ep's HybridEPBuffer, as the plan reads it."""
    read = cap.hybridep_options

    def install(buffer_class):
        monkeypatch.setattr(cap, "hybridep_options", lambda: read(buffer_class))

    return install


@pytest.mark.parametrize("asked, buffer_class, decided, refusal", [
    (config(64), NewBuffer, (True, False), None),
    (config(64, 32, fuse=True), FusingBuffer, (True, True), None),
    (config(), NewBuffer, (False, False), None),  # nothing asked
    (config(64), OldBuffer, (False, False), HYBRIDEP_BLOCKS_NOT_TAKEN),
    (config(fuse=True), NonFusingBuffer, (False, False), HYBRIDEP_FUSION_NOT_TAKEN),
    (config(64, dispatcher="alltoall"), NewBuffer, (False, False), None),  # not HybridEP: not its options
])
def test_the_plan_passes_what_is_asked_and_taken_and_says_what_is_not(installed, asked, buffer_class, decided,
                                                                      refusal):
    installed(buffer_class)
    notes = []
    assert hybridep_choices(asked, notes) == decided
    assert notes == ([] if refusal is None else [(logging.WARNING, refusal)])


def test_block_kwargs_only_for_set_fields():
    assert hybridep_block_kwargs(config()) == {}
    assert hybridep_block_kwargs(config(64)) == {"num_blocks_permute": 64}
    assert hybridep_block_kwargs(config(64, 32)) == {"num_blocks_permute": 64, "num_blocks_unpermute": 32}


def test_buffer_created_once_with_blocks():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=NewBuffer)
    group = object()
    ensure_hybridep_buffer(a2a, config(96, None), choice(blocks=True), group, Hidden(), num_local_experts=8)
    buffer = a2a._hybrid_ep_buffer
    assert buffer.kwargs == dict(
        group=group, hidden_dim=2048, max_num_of_tokens_per_rank=4096, num_local_experts=8,
        use_fp8=False, num_sms_dispatch_api=16, num_sms_combine_api=16,
        num_blocks_permute=96, num_blocks_unpermute=None,
    )
    ensure_hybridep_buffer(a2a, config(1, 1), choice(blocks=True), group, Hidden(), num_local_experts=8)
    assert a2a._hybrid_ep_buffer is buffer  # an existing buffer is kept


def test_block_counts_the_plan_did_not_pass_stay_out():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=OldBuffer)
    ensure_hybridep_buffer(a2a, config(96, 48), choice(blocks=False), None, Hidden(), num_local_experts=2)
    assert "num_blocks_permute" not in a2a._hybrid_ep_buffer.kwargs


def test_permute_fusion_reaches_every_dispatch_and_combine_call():
    FusingBuffer.calls = []
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, config(fuse=True), choice(fuse=True), None, Hidden(), num_local_experts=4)
    buffer = a2a._hybrid_ep_buffer
    # megatron-core's autograd functions call these on the module-level buffer, forward and backward
    buffer.dispatch_with_permute("x", "map", num_permuted_tokens=7)
    buffer.combine_with_unpermute("y", handle="h")
    assert FusingBuffer.calls == [("dispatch", True, {"num_permuted_tokens": 7}), ("combine", True, {})]
    assert buffer.update_template_config() == "untouched" and buffer.kwargs["num_local_experts"] == 4
    ensure_hybridep_buffer(a2a, config(fuse=True), choice(fuse=True), None, Hidden(), num_local_experts=4)
    assert a2a._hybrid_ep_buffer is buffer  # wrapped once


def test_permute_fusion_the_plan_did_not_choose_leaves_the_stock_calls():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, config(fuse=True), choice(fuse=False), None, Hidden(), num_local_experts=4)
    assert type(a2a._hybrid_ep_buffer) is FusingBuffer


def test_an_existing_buffer_is_wrapped_when_fusion_is_chosen():
    existing = FusingBuffer(None, 1, 1, 1, False)
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=existing, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, config(fuse=True), choice(fuse=True), None, Hidden(), num_local_experts=4)
    assert isinstance(a2a._hybrid_ep_buffer, FusedPermuteBuffer) and a2a._hybrid_ep_buffer.buffer is existing
