"""F5 on CPU: one grouped parameter per expert FC, made at construction (``GroupedAtBirth``), with
the values stock per-expert experts get and stock per-expert checkpoint keys.

The FCs are ``ShellGroupedLinear`` (TE's GroupedLinear construction seam: per-expert parameters
announced through ``register_parameter``, initialised by ``reset_parameters`` under an RNG
tracker) under megatron-core's wrapper in miniature (it flags every parameter afterwards)."""

import contextlib
import re

import pytest
import torch
from megatron.core.utils import init_method_normal

from megatron.moe_patches.checkpoint import grouped_keys
from megatron.moe_patches.checkpoint.grouped_keys import GroupedKeyError, load_pre_hook
from megatron.moe_patches.experts.grouped_params import grouped_at_birth

from expert_shells import ShellGroupedLinear

E, OUT, IN = 3, 4, 16
LAYOUTS = [frozenset({"weight"}), frozenset({"bias"}), frozenset({"weight", "bias"})]


class CpuRngTracker:
    """megatron-core's CUDA RNG tracker on the CPU generator: named states, each fork continues
    its own stream and leaves the default one as it was."""

    def __init__(self, seed):
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states, self.forks = {"expert-parallel-rng": torch.get_rng_state()}, []
        torch.set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks.append(name)
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class MegatronLike(ShellGroupedLinear):
    """megatron-core's TEGroupedLinear in miniature: TE's constructor, then every parameter flagged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.parameters():
            param.allreduce = False


def build(grouped=frozenset(), seed=0, tracker=None, **kwargs):
    """FC ``MegatronLike`` holding ``grouped`` as one parameter each (nothing: stock, per expert);
    with ``tracker``, megatron-core's normal init under its expert tracker, as TE gets them."""
    cls = type("Grouped", (grouped_at_birth(grouped), MegatronLike), {}) if grouped else MegatronLike
    if tracker is not None:
        kwargs.update(init_method=init_method_normal(0.02), get_rng_state_tracker=lambda: tracker,
                      rng_tracker_name="expert-parallel-rng")
    return cls(E, OUT, IN, bias=True, generator=torch.Generator().manual_seed(seed), dtype=torch.float32, **kwargs)


def stacked(stock, name):
    """Today's grouped value: the per-expert parameters stock builds, stacked."""
    return torch.stack([stock.get_parameter(f"{name}{i}").detach() for i in range(E)])


@pytest.mark.parametrize("grouped", LAYOUTS, ids=lambda g: "+".join(sorted(g)))
@pytest.mark.parametrize("with_tracker", [False, True], ids=["generator", "rng-tracker"])
def test_born_grouped_holds_bitwise_the_values_and_flags_stock_experts_get(grouped, with_tracker):
    trackers = (CpuRngTracker(1234), CpuRngTracker(1234)) if with_tracker else (None, None)
    before = torch.get_rng_state()
    stock, born = build(seed=5, tracker=trackers[0]), build(grouped, seed=5, tracker=trackers[1])
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is the tracker's business
    for name in ("weight", "bias"):
        if name in grouped:
            param = born.get_parameter(name)
            assert param.shape == (E, OUT, IN)[: 3 if name == "weight" else 2]
            assert torch.equal(param.detach(), stacked(stock, name)), name  # bitwise, every expert
            assert vars(param) == vars(stock.get_parameter(f"{name}0")) == {"allreduce": False}
        else:
            for i in range(E):
                assert torch.equal(born.get_parameter(f"{name}{i}"), stock.get_parameter(f"{name}{i}"))
    if with_tracker:  # one fork of the expert tracker per announced parameter, as TE's reset
        assert trackers[1].forks == trackers[0].forks == ["expert-parallel-rng"] * 2 * E
        assert stacked(stock, "weight").std() > 0.01 and not stacked(stock, "bias").any()


def test_no_per_expert_weight_is_ever_registered(monkeypatch):
    registered = []
    real = torch.nn.Module.register_parameter
    monkeypatch.setattr(torch.nn.Module, "register_parameter",
                        lambda self, name, param: registered.append(name) or real(self, name, param))
    module = build(frozenset({"weight", "bias"}))
    assert registered == ["weight", "bias"]
    assert [n for n, _ in module.named_parameters()] == ["weight", "bias"]
    assert module.grouped_names == {"weight", "bias"} and type(module).__mro__[1].__name__ == "GroupedWeightAndBias"


@pytest.mark.parametrize("announced, resets, message", [
    (E, False, r"Seam: its constructor never called reset_parameters \(the seam"),
    (E - 1, True, r"Seam: its constructor announced 2 of 3 weight\{i\} through register_parameter \(the seam"),
])
def test_a_linear_that_leaves_the_construction_seam_is_refused(announced, resets, message):
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_gemms = E
            for i in range(announced):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(OUT, IN)),
                                        init_fn=torch.nn.init.ones_)
            if resets:
                self.reset_parameters()

    with pytest.raises(RuntimeError, match=message):
        type("Seam", (grouped_at_birth(frozenset({"weight"})), Linear), {})()


def test_checkpoints_keep_stock_keys_and_load_across_layouts():
    grouped = build(frozenset({"weight", "bias"}), seed=1)
    stock = build(seed=1)
    saved = grouped.state_dict()
    assert set(saved) == set(stock.state_dict())  # stock keys ...
    assert all(torch.equal(saved[k], v) for k, v in stock.state_dict().items())  # ... and values
    source = build(seed=2)
    grouped.load_state_dict(source.state_dict())  # indexed checkpoint -> grouped module
    assert torch.equal(grouped.weight[2], source.weight2) and torch.equal(grouped.bias[1], source.bias1)
    back = build(seed=3)
    back._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    back.grouped_names = frozenset()  # what F6's key-converting TE classes declare
    back.load_state_dict({"weight": grouped.weight.detach() + 1, "bias": grouped.bias.detach().clone()})
    assert torch.equal(back.weight0, source.weight0 + 1)  # grouped checkpoint -> indexed module


def test_broken_checkpoint_loads_nothing():
    module = build(frozenset({"weight", "bias"}), seed=1)
    before = module.weight.detach().clone()
    broken = build(seed=2).state_dict()
    del broken["weight1"]
    with pytest.raises(GroupedKeyError, match="missing"):
        module.load_state_dict(broken)
    assert torch.equal(module.weight, before)


def test_weight_grouped_bias_indexed_loads_either_layout():
    module = build(frozenset({"weight"}), seed=1)
    assert sorted(dict(module.named_parameters())) == ["bias0", "bias1", "bias2", "weight"]
    source = build(seed=2)
    module.load_state_dict(source.state_dict())  # indexed checkpoint: weights stacked, biases kept
    assert torch.equal(module.weight[1], source.weight1) and torch.equal(module.bias2, source.bias2)
    grouped_ckpt = {"weight": stacked(source, "weight"), "bias": stacked(source, "bias") + 1}
    module.load_state_dict(grouped_ckpt)  # grouped checkpoint: biases split back
    assert torch.equal(module.bias0, source.bias0 + 1)
    assert set(module.state_dict()) == set(source.state_dict())  # stock keys either way
    assert not any(re.fullmatch(r"weight\d+", n) for n, _ in module.named_parameters())


def test_the_key_converting_class_has_a_name_of_its_own():
    """F6's subclass of a TE grouped linear says what it is in reprs and tracebacks, declares the
    per-expert layout, and loads through the key conversion hook."""

    class GroupedLinearStandIn(torch.nn.Module):
        pass

    converting = grouped_keys.with_key_conversion(None, GroupedLinearStandIn)
    assert converting.__name__ == converting.__qualname__ == "GroupedLinearStandInWithKeyConversion"
    assert converting.__module__ == grouped_keys.__name__ and issubclass(converting, GroupedLinearStandIn)
    assert converting.grouped_names == frozenset()
    module = converting()
    assert repr(module).startswith("GroupedLinearStandInWithKeyConversion(")
    assert len(module._load_state_dict_pre_hooks) == 1
    assert grouped_keys.with_key_conversion(None, None) is None  # no TE: nothing to convert
