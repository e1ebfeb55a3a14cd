"""F2 wiring with stand-in HybridEP buffers: deep_ep cannot be installed on these machines,
so these tests check which arguments reach the buffer, not HybridEP itself."""

import types
import warnings

import pytest

from megatron.moe_patches.dispatch.hybridep_blocks import ensure_hybridep_buffer, hybridep_block_kwargs

BLOCKS = ("moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute")


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


def config(permute=None, unpermute=None):
    return types.SimpleNamespace(
        moe_hybridep_num_blocks_permute=permute,
        moe_hybridep_num_blocks_unpermute=unpermute,
        moe_hybridep_num_sms=16,
    )


class Hidden:
    shape = (4096, 2048)


def test_kwargs_only_for_set_fields():
    assert hybridep_block_kwargs(config(), NewBuffer) == {}
    assert hybridep_block_kwargs(config(64), NewBuffer) == {"num_blocks_permute": 64}
    assert hybridep_block_kwargs(config(64, 32), NewBuffer) == {
        "num_blocks_permute": 64, "num_blocks_unpermute": 32,
    }


def test_old_deep_ep_warns_and_passes_nothing():
    with pytest.warns(UserWarning, match="does not take num_blocks_permute"):
        assert hybridep_block_kwargs(config(64), OldBuffer) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hybridep_block_kwargs(config(), OldBuffer) == {}  # nothing set: no warning


def test_buffer_created_once_with_blocks():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=NewBuffer)
    group = object()
    ensure_hybridep_buffer(a2a, config(96, None), group, Hidden(), num_local_experts=8)
    buffer = a2a._hybrid_ep_buffer
    assert buffer.kwargs == dict(
        group=group, hidden_dim=2048, max_num_of_tokens_per_rank=4096, num_local_experts=8,
        use_fp8=False, num_sms_dispatch_api=16, num_sms_combine_api=16,
        num_blocks_permute=96, num_blocks_unpermute=None,
    )
    ensure_hybridep_buffer(a2a, config(1, 1), group, Hidden(), num_local_experts=8)
    assert a2a._hybrid_ep_buffer is buffer  # an existing buffer is kept


def test_buffer_with_old_deep_ep_gets_the_stock_arguments():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=OldBuffer)
    with pytest.warns(UserWarning):
        ensure_hybridep_buffer(a2a, config(96, 48), None, Hidden(), num_local_experts=2)
    assert "num_blocks_permute" not in a2a._hybrid_ep_buffer.kwargs


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


def fusion_config(on=True):
    cfg = config()
    cfg.moe_permute_fusion_into_hybridep = on
    return cfg


def test_permute_fusion_reaches_every_dispatch_and_combine_call():
    FusingBuffer.calls = []
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, fusion_config(), None, Hidden(), num_local_experts=4)
    buffer = a2a._hybrid_ep_buffer
    # megatron-core's autograd functions call these on the module-level buffer, forward and backward
    buffer.dispatch_with_permute("x", "map", num_permuted_tokens=7)
    buffer.combine_with_unpermute("y", handle="h")
    assert FusingBuffer.calls == [("dispatch", True, {"num_permuted_tokens": 7}), ("combine", True, {})]
    assert buffer.update_template_config() == "untouched" and buffer.kwargs["num_local_experts"] == 4
    ensure_hybridep_buffer(a2a, fusion_config(), None, Hidden(), num_local_experts=4)
    assert a2a._hybrid_ep_buffer is buffer  # wrapped once


def test_permute_fusion_off_leaves_the_stock_calls():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, fusion_config(on=False), None, Hidden(), num_local_experts=4)
    assert type(a2a._hybrid_ep_buffer) is FusingBuffer


def test_permute_fusion_without_deep_ep_support_warns_and_runs_unfused():
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=NonFusingBuffer)
    with pytest.warns(UserWarning, match="moe_permute_fusion_into_hybridep is set but"):
        ensure_hybridep_buffer(a2a, fusion_config(), None, Hidden(), num_local_experts=4)
    assert type(a2a._hybrid_ep_buffer) is NonFusingBuffer


def test_an_existing_buffer_is_wrapped_when_fusion_is_asked():
    existing = FusingBuffer(None, 1, 1, 1, False)
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=existing, HybridEPBuffer=FusingBuffer)
    ensure_hybridep_buffer(a2a, fusion_config(), None, Hidden(), num_local_experts=4)
    assert a2a._hybrid_ep_buffer.buffer is existing
