"""F2 wiring with stand-in HybridEP buffers: deep_ep cannot be installed on these machines,
so these tests check which arguments reach the buffer, not HybridEP itself."""

import types
import warnings

import pytest

from megatron.moe_patches.hybridep_blocks import ensure_hybridep_buffer, hybridep_block_kwargs

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
