"""F5: an expert FC's parameter layout (grouped or per expert) is fixed when it is built. Its
forward, F13's main-grad targets and the checkpoint hooks read that fact: across forwards,
backwards, saves and loads nobody asks the module's ``_parameters`` whether ``weight``,
``weight0``, ``bias``, ... exist (issue #59). Counted on CPU with a ``_parameters`` that
records every lookup of a parameter name it does not hold."""

import re

import pytest
import torch

from megatron.moe_patches.experts import grouped_mm as f8

from expert_configs import cfg
from expert_shells import experts_shell

PARAMETER_NAME = re.compile(r"(weight|bias)\d*")


class CountingParameters(dict):
    """A module's ``_parameters`` that counts lookups, and records those of absent parameter names
    (a layout probe: ``"weight0" in module._parameters``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.lookups, self.probes = 0, []

    def _seen(self, key):
        self.lookups += 1
        if isinstance(key, str) and PARAMETER_NAME.fullmatch(key) and not super().__contains__(key):
            self.probes.append(key)

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._seen(key)
        return super().get(key, default)


LAYOUTS = {
    "per-expert": dict(add_bias_linear=True),
    "grouped-weight": dict(moe_single_grouped_weight=True, add_bias_linear=True),
    "grouped-weight-and-bias": dict(moe_single_grouped_weight=True, moe_single_grouped_bias=True,
                                    add_bias_linear=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forwards_backwards_main_grads_and_checkpoints_never_probe_the_layout(layout):
    config = cfg(gradient_accumulation_fusion=True, **LAYOUTS[layout])
    owner = experts_shell(f8.GroupedMMBackend, config, 3, (16, 8), (8, 8), bias=True, wgrad_into_main_grad=True)
    backend = f8.GroupedMMBackend(owner)
    fcs = (owner.linear_fc1, owner.linear_fc2)
    for fc in fcs:  # DDP's fp32 main grads (F13 adds the weight gradients there)
        for p in f8.weight_params(fc):
            p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
        fc.__dict__["_parameters"] = CountingParameters(fc._parameters)
    generator = torch.Generator().manual_seed(0)
    per_step = []
    for counts in ([3, 0, 5], [1, 4, 2], [2, 2, 2]):
        before = sum(fc._parameters.lookups for fc in fcs)
        rows = sum(counts)
        x = torch.randn(rows, 8, dtype=torch.bfloat16, generator=generator, requires_grad=True)
        out, _ = backend.forward(owner, x, torch.tensor(counts), torch.rand(rows, generator=generator))
        out.float().sum().backward()
        per_step.append(sum(fc._parameters.lookups for fc in fcs) - before)
    assert all(p.main_grad.any() for fc in fcs for p in f8.weight_params(fc))  # F13 ran
    owner.load_state_dict(owner.state_dict())  # the checkpoint hooks, both ways
    assert [fc._parameters.probes for fc in fcs] == [[], []]
    assert len(set(per_step)) == 1, per_step  # the same reads every step: the parameters it computes with
