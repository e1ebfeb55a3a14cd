"""F7 on CPU with real tensors and megatron-core's own ShardedTensors: a grouped parameter
maps to its per-expert checkpoint entries, plain and nested (SwiGLU) factories;
incomplete or ambiguous sets and flattened shards are refused."""

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from megatron.moe_patches.checkpoint.optimizer_state import (
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


# --- model param -> plain state dict tensor (reload_model_params / load-main-params-from-ckpt) ---

from megatron.moe_patches.checkpoint.optimizer_state import (  # noqa: E402
    GroupedParamDistributedOptimizer,
    state_dict_param_map,
)

FC1 = "decoder.layers.0.mlp.experts.linear_fc1."


class Experts(torch.nn.Module):
    """Expert FC1 in one layout, plus a dense weight and a norm; named as Megatron's DDP wrapper."""

    def __init__(self, grouped, experts=E):
        super().__init__()
        if grouped:
            self.named = {FC1 + "weight": torch.nn.Parameter(torch.zeros(experts, OUT, IN))}
        else:
            self.named = {f"{FC1}weight{i}": torch.nn.Parameter(torch.zeros(OUT, IN)) for i in range(experts)}
        self.named["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.nn.Parameter(torch.zeros(OUT, IN))
        self.named["decoder.final_layernorm.weight"] = torch.nn.Parameter(torch.zeros(IN))

    def named_parameters(self):
        return [("module.module." + name, param) for name, param in self.named.items()]


def checkpoint(grouped, experts=E):
    weights = torch.randn(experts, OUT, IN, dtype=torch.float64)
    state = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(OUT, IN, dtype=torch.float64),
             "decoder.final_layernorm.weight": torch.randn(IN, dtype=torch.float64)}
    if grouped:
        state[FC1 + "weight"] = weights
    else:
        state.update({f"{FC1}weight{i}": weights[i] for i in range(experts)})
    return state, weights


@pytest.mark.parametrize("model_grouped", [True, False])
@pytest.mark.parametrize("checkpoint_grouped", [True, False])
def test_state_dict_map_across_layouts(model_grouped, checkpoint_grouped):
    model = Experts(model_grouped)
    state, weights = checkpoint(checkpoint_grouped)
    keys_before = sorted(state)
    found = state_dict_param_map(model.named_parameters(), state)
    assert len(found) == len(model.named)
    if model_grouped:
        assert torch.equal(found[model.named[FC1 + "weight"]], weights)
    else:
        for i in range(E):
            assert torch.equal(found[model.named[f"{FC1}weight{i}"]], weights[i])
    dense = model.named["decoder.final_layernorm.weight"]
    assert found[dense] is state["decoder.final_layernorm.weight"]  # exact names: the entry itself
    assert sorted(state) == keys_before  # the caller's dict is not rewritten


def test_stock_substring_map_fails_where_this_one_works():
    """megatron-core 0.16.1 matches `name in key`: a grouped weight matches weight0..E-1."""
    model = Experts(grouped=True)
    state, _ = checkpoint(grouped=False)
    fake_optimizer = type("Opt", (), {"model_chunks": [model]})()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    with pytest.raises(AssertionError, match="matches in state dict"):
        DistributedOptimizer._build_model_param_to_state_dict_param_map(fake_optimizer, {"model": state})
    found = GroupedParamDistributedOptimizer._build_model_param_to_state_dict_param_map(fake_optimizer,
                                                                                        {"model": state})
    assert len(found) == len(model.named)


def test_state_dict_map_refusals_name_the_parameter():
    state, _ = checkpoint(grouped=False)
    del state[f"{FC1}weight2"]
    with pytest.raises(KeyError, match=f"incomplete expert set for {FC1}weight.*weight2"):
        state_dict_param_map(Experts(grouped=True).named_parameters(), state)
    state, weights = checkpoint(grouped=False)
    state[FC1 + "weight"] = weights  # both layouts
    with pytest.raises(KeyError, match="ambiguous"):
        state_dict_param_map(Experts(grouped=False).named_parameters(), state)
    state, _ = checkpoint(grouped=True, experts=E + 1)  # another expert count
    with pytest.raises(KeyError, match="leading dim"):
        state_dict_param_map(Experts(grouped=False).named_parameters(), state)
    state, _ = checkpoint(grouped=True)
    del state["decoder.final_layernorm.weight"]
    with pytest.raises(KeyError, match="decoder.final_layernorm.weight: no entry"):
        state_dict_param_map(Experts(grouped=True).named_parameters(), state)
    state, _ = checkpoint(grouped=True)
    state["decoder.final_layernorm.weight"] = torch.zeros(IN + 1)
    with pytest.raises(ValueError, match=r"final_layernorm.weight: shape \(3,\), state dict entry \(4,\)"):
        state_dict_param_map(Experts(grouped=True).named_parameters(), state)


def test_a_row_is_matched_by_storage_offset_shape_and_strides_exactly():
    from megatron.moe_patches.checkpoint.optimizer_state import _row_index

    param = torch.nn.Parameter(torch.randn(E, OUT, IN))
    data = param.detach()
    assert [_row_index(param, data[i]) for i in range(E)] == list(range(E))
    shifted = data.view(-1)[1:1 + OUT * IN].view(OUT, IN)  # same storage, shape and strides, between rows
    assert _row_index(param, shifted) is None
    assert _row_index(param, data[1].t()) is None  # other strides
    assert _row_index(param, data[1, :OUT - 1]) is None  # another shape
    assert _row_index(param, data[1].clone()) is None  # another storage
    beyond = torch.randn(E + 1, OUT, IN)
    assert _row_index(beyond[:E], beyond[E]) is None  # the storage's next row is not the param's
    assert _row_index(param, None) is None
