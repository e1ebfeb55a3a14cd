"""F7 on CPU with real tensors and megatron-core's own ShardedTensors: a grouped parameter
maps to its per-expert checkpoint entries, plain and nested (SwiGLU) factories;
incomplete or ambiguous sets and flattened shards are refused."""

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from megatron.moe_patches.grouped_optimizer_state import (
    grouped_param_factories,
    param_id_to_sharded_param_map,
)

E, OUT, IN = 4, 6, 3
KEY = "decoder.layers.0.mlp.experts.experts.linear_fc2.weight"


def per_expert_entries(param, experts_offset=0, total=E, swiglu=False):
    """What TE grouped experts' sharded_state_dict holds for ``param``: one entry per expert
    row (the data a view of that row), all under one key with the expert as a global axis."""
    entries = {}
    for i, row in enumerate(param.detach().unbind(0)):
        entry = ShardedTensor.from_rank_offsets(KEY, row, (0, experts_offset + i, total), replica_id=(0, 0, 0),
                                                prepend_axis_num=1)
        if swiglu:
            entry = apply_swiglu_sharded_factory(entry, ((0, experts_offset + i, total),))
        entries[f"weight{i}"] = entry
    return entries


def test_grouped_param_gets_one_factory_building_the_stock_entries():
    param = torch.nn.Parameter(torch.randn(E, OUT, IN))
    entries = per_expert_entries(param, experts_offset=4, total=8)
    factories = grouped_param_factories({"experts": entries}, [param])
    (factory,) = factories.values()
    assert factory.data is param and factory.key == KEY
    # An optimizer state of the param's shape builds the same entries, with its data's rows.
    state = torch.randn(E, OUT, IN)
    built = factory.build_fn("optimizer.state.exp_avg." + KEY, state, (0, 0, 1), None)
    assert sorted(built) == list(range(E))
    for i in range(E):
        stock = entries[f"weight{i}"]
        assert built[i].key == "optimizer.state.exp_avg." + KEY
        assert built[i].global_offset == stock.global_offset and built[i].global_shape == stock.global_shape
        assert torch.equal(built[i].data, state[i]) and built[i].replica_id == (0, 0, 1)
    assert torch.equal(factory.merge_fn({i: built[i].data for i in built}), state)


def test_flattened_shards_are_refused_by_name():
    param = torch.nn.Parameter(torch.randn(E, OUT, IN))
    (factory,) = grouped_param_factories(per_expert_entries(param), [param]).values()
    with pytest.raises(ValueError, match="flattened optimizer shards"):
        factory.build_fn(KEY, param.detach().flatten()[:10], 0, slice(0, 10))


def test_nested_swiglu_factories_are_built_and_merged():
    param = torch.nn.Parameter(torch.randn(E, 2 * OUT, IN))
    (factory,) = grouped_param_factories(per_expert_entries(param, swiglu=True), [param]).values()
    built = factory.build_fn(KEY, param.detach(), 0, None)
    # Each row is the SwiGLU factory's own split (gate and linear halves).
    assert all(not hasattr(part, "build_fn") for row in built.values() for part in row)
    loaded = {i: [part.data for part in row] for i, row in built.items()}
    assert torch.equal(factory.merge_fn(loaded), param.detach())


def test_indexed_params_and_plain_params_need_no_factory():
    weights = [torch.nn.Parameter(torch.randn(OUT, IN)) for _ in range(E)]
    entries = {f"w{i}": ShardedTensor.from_rank_offsets(f"k{i}", w) for i, w in enumerate(weights)}
    assert grouped_param_factories(entries, weights) == {}


def test_incomplete_and_ambiguous_row_sets_are_refused():
    param = torch.nn.Parameter(torch.randn(E, OUT, IN))
    entries = per_expert_entries(param)
    del entries["weight2"]
    with pytest.raises(ValueError, match=r"no checkpoint entry for rows \[2\]"):
        grouped_param_factories(entries, [param])
    entries = per_expert_entries(param)
    entries["again"] = ShardedTensor.from_rank_offsets(KEY, param.detach()[1], (0, 1, E), prepend_axis_num=1)
    with pytest.raises(ValueError, match="several checkpoint entries"):
        grouped_param_factories(entries, [param])


def test_rows_of_a_copy_are_not_rows_of_the_param():
    param = torch.nn.Parameter(torch.randn(E, OUT, IN))
    copy = param.detach().clone()
    assert grouped_param_factories(per_expert_entries(copy), [param]) == {}


def test_other_optimizers_map_includes_the_grouped_param():
    grouped = torch.nn.Parameter(torch.randn(E, OUT, IN))
    plain = torch.nn.Parameter(torch.randn(OUT, IN))
    model = {"experts": per_expert_entries(grouped), "plain": ShardedTensor.from_rank_offsets("plain", plain)}
    mapping = param_id_to_sharded_param_map(model, iter([plain, grouped]))
    assert mapping[0].data is plain and mapping[1].data is grouped and mapping[1].key == KEY
