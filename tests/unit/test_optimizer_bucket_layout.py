"""F7's layout rule for the distributed optimizer's bucket states (dp_reshardable, Megatron-LM's
default): they load into the expert parameter layout they were saved in, or are refused by
name; per-parameter (fully_reshardable) states load across layouts. The patched optimizer
records its layout on save and checks it on load, in whichever loop loads it."""

import types

import pytest
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.moe_patches.checkpoint.optimizer_state import (
    LAYOUT_KEY,
    GroupedParamDistributedOptimizer,
    bucket_layout_refusal,
    param_layout,
)

STOCK = {"moe_single_grouped_weight": False, "moe_single_grouped_bias": False, "moe_mlp_glu_interleave_size": None}
GROUPED = {**STOCK, "moe_single_grouped_weight": True}
INTERLEAVED = {**STOCK, "moe_mlp_glu_interleave_size": 32}
GROUPED_BIAS = {**STOCK, "moe_single_grouped_bias": True}


@pytest.mark.parametrize("saved, now", [(STOCK, GROUPED), (GROUPED, STOCK), (STOCK, INTERLEAVED), (INTERLEAVED, STOCK),
                                        (STOCK, GROUPED_BIAS), (GROUPED_BIAS, GROUPED)])
@pytest.mark.parametrize("sharding", ["dp_reshardable", "dp_zero_gather_scatter"])
def test_bucket_states_across_layouts_are_refused_by_flag(saved, now, sharding):
    refusal = bucket_layout_refusal(sharding, saved, now)
    changed = next(n for n in STOCK if saved[n] != now[n])
    assert f"--{changed.replace('_', '-')} {saved[changed]} (checkpoint) vs {now[changed]} (now)" in refusal
    assert "--dist-ckpt-optim-fully-reshardable" in refusal and sharding in refusal


@pytest.mark.parametrize("layout", [STOCK, GROUPED, INTERLEAVED, GROUPED_BIAS])
def test_bucket_states_load_into_their_own_layout(layout):
    assert bucket_layout_refusal("dp_reshardable", dict(layout), dict(layout)) is None


@pytest.mark.parametrize("saved, now", [(STOCK, GROUPED), (GROUPED, INTERLEAVED)])
def test_per_parameter_states_load_across_layouts(saved, now):
    assert bucket_layout_refusal("fully_reshardable", saved, now) is None


def test_a_checkpoint_without_a_record_is_the_stock_layout_or_refused():
    assert bucket_layout_refusal("dp_reshardable", None, dict(STOCK)) is None  # stock megatron-core's
    refusal = bucket_layout_refusal("dp_reshardable", None, dict(GROUPED))
    assert "record no expert parameter layout" in refusal and "--moe-single-grouped-weight True" in refusal


def test_a_record_from_a_version_with_fewer_fields_counts_the_missing_ones_as_stock():
    assert bucket_layout_refusal("dp_reshardable", {"moe_single_grouped_weight": False}, dict(STOCK)) is None


def optimizer_with(config_layout):
    """The patched optimizer's own methods on an instance built without megatron-core's __init__."""
    optimizer = object.__new__(GroupedParamDistributedOptimizer)
    optimizer.model_chunks = [types.SimpleNamespace(config=types.SimpleNamespace(**config_layout))]
    return optimizer


def test_the_optimizer_refuses_at_load_what_megatron_core_would_scramble(monkeypatch):
    loaded = []
    monkeypatch.setattr(DistributedOptimizer, "load_state_dict", lambda self, state: loaded.append(state))
    saved = {"param_state_sharding_type": "dp_reshardable", "param_state": "buffers", LAYOUT_KEY: dict(STOCK)}
    with pytest.raises(ValueError, match="--moe-single-grouped-weight False \\(checkpoint\\) vs True"):
        optimizer_with(GROUPED).load_state_dict(dict(saved))
    assert loaded == []
    optimizer_with(STOCK).load_state_dict(dict(saved))
    assert loaded == [{"param_state_sharding_type": "dp_reshardable", "param_state": "buffers"}]  # record not passed on


def test_the_optimizer_records_its_layout_beside_the_states(monkeypatch):
    monkeypatch.setattr(DistributedOptimizer, "sharded_state_dict",
                        lambda self, model_sd, is_loading, sharding_type, metadata: {"param_state": "sharded"})
    optimizer = optimizer_with(INTERLEAVED)
    optimizer.buffers = []
    state = optimizer.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    assert state == {"param_state": "sharded", LAYOUT_KEY: INTERLEAVED}
    assert param_layout(types.SimpleNamespace()) == STOCK  # a config without the fields: stock
