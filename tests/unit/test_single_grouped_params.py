"""F5 on CPU: one grouped parameter per expert FC, with stock per-expert checkpoint keys."""

import pytest
import torch

from megatron.moe_patches.checkpoint.grouped_keys import GroupedKeyError, is_grouped, load_pre_hook
from megatron.moe_patches.experts.grouped_params import make_grouped

E = 3


class ExpertLinear(torch.nn.Module):
    """The parameter layout of TE's GroupedLinear (weight{i}, bias{i}, num_gemms)."""

    def __init__(self, seed=0):
        super().__init__()
        self.num_gemms = E
        g = torch.Generator().manual_seed(seed)
        for i in range(E):
            weight = torch.nn.Parameter(torch.randn(4, 2, generator=g))
            weight.allreduce = False  # an expert parameter's Megatron flag
            self.register_parameter(f"weight{i}", weight)
            self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.randn(4, generator=g)))


def test_make_grouped_keeps_values_flags_and_stock_keys():
    module = ExpertLinear()
    stock = {k: v.clone() for k, v in module.state_dict().items()}
    make_grouped(module, E)
    assert is_grouped(module) and module.weight.shape == (E, 4, 2) and module.bias.shape == (E, 4)
    assert module.weight.allreduce is False
    assert [n for n, _ in module.named_parameters()] == ["weight", "bias"]
    saved = module.state_dict()
    assert set(saved) == set(stock) and all(torch.equal(saved[k], stock[k]) for k in stock)


def test_checkpoints_load_across_layouts():
    grouped = ExpertLinear(seed=1)
    make_grouped(grouped, E)
    source = ExpertLinear(seed=2)
    grouped.load_state_dict(source.state_dict())  # indexed checkpoint -> grouped module
    assert torch.equal(grouped.weight[2], source.weight2)
    back = ExpertLinear(seed=3)
    back._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    back.load_state_dict({"weight": grouped.weight.detach().clone() + 1, "bias": grouped.bias.detach().clone()})
    assert torch.equal(back.weight0, source.weight0 + 1)  # grouped checkpoint -> indexed module


def test_broken_checkpoint_loads_nothing():
    module = ExpertLinear(seed=1)
    make_grouped(module, E)
    before = module.weight.detach().clone()
    broken = ExpertLinear(seed=2).state_dict()
    del broken["weight1"]
    with pytest.raises(GroupedKeyError, match="missing"):
        module.load_state_dict(broken)
    assert torch.equal(module.weight, before)


def test_weight_grouped_bias_indexed_loads_either_layout():
    module = ExpertLinear(seed=1)
    make_grouped(module, E, names=("weight",))
    assert is_grouped(module, "weight") and not is_grouped(module, "bias")
    assert sorted(dict(module.named_parameters())) == ["bias0", "bias1", "bias2", "weight"]
    source = ExpertLinear(seed=2)
    module.load_state_dict(source.state_dict())  # indexed checkpoint: weights stacked, biases kept
    assert torch.equal(module.weight[1], source.weight1) and torch.equal(module.bias2, source.bias2)
    stacked = {n: torch.stack([source.get_parameter(f"{n}{i}").detach() for i in range(E)]) for n in ("weight", "bias")}
    grouped_ckpt = {"weight": stacked["weight"], "bias": stacked["bias"] + 1}
    module.load_state_dict(grouped_ckpt)  # grouped checkpoint: biases split back
    assert torch.equal(module.bias0, source.bias0 + 1)
    assert set(module.state_dict()) == set(source.state_dict())  # stock keys either way


def test_the_key_converting_class_has_a_name_of_its_own():
    """F6's subclass of a TE grouped linear says what it is in reprs and tracebacks, and loads
    through the key conversion hook."""
    from megatron.moe_patches.checkpoint import grouped_keys

    class GroupedLinearStandIn(torch.nn.Module):
        pass

    converting = grouped_keys.with_key_conversion(None, GroupedLinearStandIn)
    assert converting.__name__ == converting.__qualname__ == "GroupedLinearStandInWithKeyConversion"
    assert converting.__module__ == grouped_keys.__name__ and issubclass(converting, GroupedLinearStandIn)
    module = converting()
    assert repr(module).startswith("GroupedLinearStandInWithKeyConversion(")
    assert len(module._load_state_dict_pre_hooks) == 1
    assert grouped_keys.with_key_conversion(None, None) is None  # no TE: nothing to convert
