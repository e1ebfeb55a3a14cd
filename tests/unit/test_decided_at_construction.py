"""Capability decisions are made once, when the experts and the HybridEP manager are built:
their forward and dispatch read stored choices and ask ``capabilities`` nothing (issue #47).
On CPU, with every probe of ``capabilities`` replaced by a counter."""

import logging
import types

import pytest
import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import fields
from megatron.moe_patches.dispatch import hybridep_blocks
from megatron.moe_patches.plan import exchange as plan_exchange
from megatron.moe_patches.grouped_experts import PatchedTEGroupedMLP

from expert_configs import cfg
from expert_shells import ShellGroupedLinear
from test_hybridep_blocks import FusingBuffer, NewBuffer, NonFusingBuffer, choice
from test_te_device_splits import OnDevice, grouped_linear_class, megatron_wrapper

E, HIDDEN, FFN = 3, 16, 8  # rows of 16 bytes and more: torch._grouped_mm needs them
PROBES = ("triton_available", "te_grouped_linear_device_splits", "accepts_parameter", "te_attr", "te_version",
          "te_fused_permute_pad", "te_op_fuser_grouped_mlp", "te_fused_grouped_mlp_kernel",
          "te_ops_grouped_linear_has", "deep_gemm_grouped_fp8", "hybridep_options")


@pytest.fixture
def probes(monkeypatch):
    """Counts every call of a capability probe (by name); Triton counts as absent, so the
    weighted GLU takes megatron-core's path on these CPU tensors whatever is installed."""
    calls = {}

    def counted(name, answer):
        def probe(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return answer(*args, **kwargs)

        return probe

    for name in PROBES:
        monkeypatch.setattr(cap, name, counted(name, getattr(cap, name)))
    monkeypatch.setattr(cap, "triton_available", counted("triton_available", lambda: False))
    monkeypatch.setattr(fields, "_said", set())
    return calls


def stock_init(fc_args):
    """A stand-in for megatron-core's TEGroupedMLP constructor (no TE here): it builds FC1 and
    FC2 from the submodules it is handed, with what TEGroupedMLP.forward reads besides."""

    def init(self, num_local_experts, config, submodules, pg_collection=None):
        torch.nn.Module.__init__(self)
        self.config, self.num_local_experts = config, num_local_experts
        self.linear_fc1 = submodules.linear_fc1(num_local_experts, *fc_args(config, 2 * FFN, HIDDEN))
        self.linear_fc2 = submodules.linear_fc2(num_local_experts, *fc_args(config, HIDDEN, FFN))
        self.activation_func = config.activation_func
        self.offload_expert_fc1 = self.offload_moe_act = self.activation_recompute = False

    return init


def shell_args(config, out_features, in_features):
    generator = torch.Generator().manual_seed(out_features)
    return out_features, in_features, config.add_bias_linear, generator


def te_args(config, out_features, in_features):  # TE's GroupedLinear: (num_gemms, in, out)
    return in_features, out_features


def forward(experts, counts, dtype):
    """One forward and backward of the experts on ``counts`` rows per expert. The tokens claim
    to be on the GPU (``OnDevice``), so a path that asks only there asks here too."""
    torch.manual_seed(0)
    rows = int(sum(counts))
    x = torch.randn(rows, HIDDEN, dtype=dtype).as_subclass(OnDevice).requires_grad_()
    out, _ = experts(x, torch.tensor(counts), torch.rand(rows, dtype=dtype))
    out.float().sum().backward()


GROUPED_MM = [
    dict(),
    dict(activation_func=quick_gelu),
    dict(add_bias_linear=True),
    dict(moe_single_grouped_weight=True, moe_single_grouped_bias=True, add_bias_linear=True),
]


@pytest.mark.parametrize("overrides", GROUPED_MM)
def test_grouped_mm_experts_ask_nothing_after_construction(probes, monkeypatch, overrides):
    monkeypatch.setattr(TEGroupedMLP, "__init__", stock_init(shell_args))
    config = cfg(**overrides)
    submodules = MLPSubmodules(linear_fc1=ShellGroupedLinear, linear_fc2=ShellGroupedLinear)
    layers = [PatchedTEGroupedMLP(E, config, submodules) for _ in range(2)]
    assert all(layer.backend.name == "grouped_mm" for layer in layers)
    probes.clear()
    for layer in layers:
        for counts in ([2, 0, 3], [1, 1, 1]):
            forward(layer, counts, torch.bfloat16)
    assert probes == {}


@pytest.fixture
def te_takes_device_splits(monkeypatch):
    """TE's module GroupedLinear (a stand-in) takes m_splits_tensor; returns megatron-core's
    wrapper around it, the FCs' class in the experts' spec."""
    te_class = grouped_linear_class(takes_device_splits=True)
    real_te_attr = cap.te_attr
    monkeypatch.setattr(cap, "te_attr", lambda path: te_class if path == "GroupedLinear" else real_te_attr(path))
    monkeypatch.setattr(cap, "te_version", lambda: "stand-in")
    return megatron_wrapper(te_class)


@pytest.mark.parametrize("device_tokens", [True, False])
def test_te_experts_read_the_plan_and_ask_nothing_after_construction(te_takes_device_splits, probes, monkeypatch,
                                                                     device_tokens):
    monkeypatch.setattr(TEGroupedMLP, "__init__", stock_init(te_args))
    config = cfg(params_dtype=torch.float32, bf16=False, moe_device_tokens_per_expert=device_tokens)
    linear_class = te_takes_device_splits
    submodules = MLPSubmodules(linear_fc1=linear_class, linear_fc2=linear_class)
    layers = [PatchedTEGroupedMLP(E, config, submodules) for _ in range(2)]
    assert all(layer.backend.name == "te" for layer in layers)
    assert [layer.backend.passes_device_splits for layer in layers] == [device_tokens] * 2
    # the plan reads TE with the machine's other facts at construction; the layers' spec and
    # backends read its answer
    assert probes.get("te_grouped_linear_device_splits", 0) > 0
    probes.clear()
    for layer in layers:
        forward(layer, [2, 0, 3], torch.float32)
        assert (layer.linear_fc1.calls[-1].get("m_splits_tensor") is not None) == device_tokens
    assert probes == {}


class Hidden:
    shape = (16, HIDDEN)


def hybridep_config(fuse, permute_blocks=None):
    return types.SimpleNamespace(
        moe_permute_fusion=True, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
        moe_hybridep_num_sms=16, moe_hybridep_num_blocks_permute=permute_blocks,
        moe_hybridep_num_blocks_unpermute=None, moe_permute_fusion_into_hybridep=fuse,
    )


@pytest.mark.parametrize("buffer_class, fuse, blocks", [
    (NewBuffer, False, 64),  # block counts only
    (FusingBuffer, True, None),  # deep_ep fuses permute into dispatch
    (NonFusingBuffer, True, None),  # asked, but deep_ep cannot: stock calls
])
def test_hybridep_dispatch_asks_nothing_after_the_manager_is_built(probes, monkeypatch, buffer_class, fuse,
                                                                   blocks):
    a2a = types.SimpleNamespace(_hybrid_ep_buffer=None, HybridEPBuffer=buffer_class)
    monkeypatch.setattr(hybridep_blocks, "fused_a2a", a2a)
    counted_probe = cap.hybridep_options  # the fixture's counter, reading the stand-in class
    monkeypatch.setattr(cap, "hybridep_options", lambda: counted_probe(buffer_class))
    monkeypatch.setattr(token_dispatcher, "hybrid_ep_dispatch", object())  # deep_ep "installed"
    monkeypatch.setattr(token_dispatcher._HybridEPManager, "dispatch", lambda self, hidden, *a, **k: hidden)

    said = []

    def plan_of(config):  # the plan's exchange, from its rule (these stand-in configs build no whole plan)
        notes = []
        exchange = choice(*plan_exchange.hybridep_choices(config, notes))
        return types.SimpleNamespace(exchange=exchange, log_choices=lambda: said.extend(notes))

    monkeypatch.setattr(hybridep_blocks, "plan_for", plan_of)
    decided = []
    real_patch_option = hybridep_blocks.patch_option
    monkeypatch.setattr(hybridep_blocks, "patch_option", lambda *a: decided.append(a[1:]) or real_patch_option(*a))
    managers = [hybridep_blocks.HybridEPBlocksManager(None, 2, 4, hybridep_config(fuse, blocks)) for _ in range(2)]
    # the plan's notes (an older deep_ep's refusal) are said when the managers are built
    assert said == ([(logging.WARNING, plan_exchange.HYBRIDEP_FUSION_NOT_TAKEN)] * 2
                    if buffer_class is NonFusingBuffer else [])
    assert probes["hybridep_options"] == 2  # once per manager, at construction
    probes.clear()
    decided.clear()
    for manager in managers:  # each layer's first dispatch prepares the shared buffer from the plan
        manager.dispatch(Hidden())
    prepared = a2a._hybrid_ep_buffer
    assert probes == {}
    decided.clear()
    for _ in range(3):
        for manager in managers:
            manager.dispatch(Hidden())
    assert a2a._hybrid_ep_buffer is prepared
    assert isinstance(prepared, hybridep_blocks.FusedPermuteBuffer) == (buffer_class is FusingBuffer)
    assert ("num_blocks_permute" in prepared.kwargs and prepared.kwargs["num_blocks_permute"] == blocks) or not blocks
    assert probes == {} and decided == []
