"""The TE expert backend hands the device-resident counts to TE's GroupedLinear as
``m_splits_tensor`` where TE takes it (ROCm's TE), on CPU with stand-in classes: a TE
GroupedLinear and megatron-core's wrapper around it, built from the classes the backend puts
in the experts' submodules (``expert_submodules``, as PatchedTEGroupedMLP does before the stock
constructor) and run by megatron-core's own TEGroupedMLP.forward."""

import logging

import pytest
import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts import backend as eb
from megatron.moe_patches import fields
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.plan import plan_for

EXPERTS, HIDDEN, FFN = 3, 8, 4


def grouped_linear_class(takes_device_splits: bool):
    """A stand-in for TE's module GroupedLinear: per-expert GEMMs over the rows ``m_splits``
    gives; ``calls`` records what each forward received."""

    class GroupedLinear(torch.nn.Module):
        def __init__(self, num_gemms, in_features, out_features):
            super().__init__()
            self.num_gemms = num_gemms
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features)))
            self.calls = []

        def _gemms(self, inp, m_splits):
            rows = torch.split(inp, list(m_splits))
            return torch.cat([r @ getattr(self, f"weight{i}").T for i, r in enumerate(rows)])

    if takes_device_splits:

        def forward(self, inp, m_splits, is_first_microbatch=None, m_splits_tensor=None):
            self.calls.append({"m_splits": m_splits, "m_splits_tensor": m_splits_tensor})
            return self._gemms(inp, m_splits)

    else:

        def forward(self, inp, m_splits, is_first_microbatch=None):
            self.calls.append({"m_splits": m_splits})
            return self._gemms(inp, m_splits)

    GroupedLinear.forward = forward
    return GroupedLinear


def megatron_wrapper(te_class):
    """megatron-core's TEGroupedLinear in miniature: forward(x, m_splits) calls TE's
    forward through super() with is_first_microbatch only, and returns (out, bias)."""

    class TEGroupedLinear(te_class):
        def forward(self, x, m_splits):
            return super().forward(x, m_splits, is_first_microbatch=None), None

    return TEGroupedLinear


class OnDevice(torch.Tensor):
    """Counts that host_tokens_per_expert treats as GPU-resident (each copy is counted)."""

    @property
    def is_cuda(self):
        return True


@pytest.fixture
def te_with(monkeypatch):
    """``te_with(takes_device_splits)``: the probe and the backend see a stand-in TE
    GroupedLinear; returns megatron-core's wrapper class around it."""

    def install(takes_device_splits):
        te_class = grouped_linear_class(takes_device_splits)
        real_te_attr = cap.te_attr
        monkeypatch.setattr(cap, "te_attr", lambda path: te_class if path == "GroupedLinear" else real_te_attr(path))
        monkeypatch.setattr(cap, "te_version", lambda: "stand-in")
        monkeypatch.setattr(fields, "_said", set())
        return megatron_wrapper(te_class)

    return install


def experts_module(linear_class, **config_overrides):
    """What megatron-core's TEGroupedMLP.forward reads of its module, on CPU, with FC1 and FC2
    built from the submodules the TE backend chose (what the stock constructor builds)."""
    config = PatchedTransformerConfig(**{
        **dict(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
            moe_ffn_hidden_size=FFN, moe_grouped_gemm=True, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_activation_fusion=False,
            moe_device_tokens_per_expert=True,
        ),
        **config_overrides,
    })
    experts = torch.nn.Module()
    experts.config, experts.num_local_experts = config, EXPERTS
    submodules = eb.TEBackend.expert_submodules(
        config, MLPSubmodules(linear_fc1=linear_class, linear_fc2=linear_class), plan_for(config))
    experts.linear_fc1 = submodules.linear_fc1(EXPERTS, HIDDEN, 2 * FFN)
    experts.linear_fc2 = submodules.linear_fc2(EXPERTS, FFN, HIDDEN)
    experts.activation_func = config.activation_func
    experts.offload_expert_fc1 = experts.offload_moe_act = experts.activation_recompute = False
    experts._apply_bias = TEGroupedMLP._apply_bias
    return experts


def run(backend, experts, counts):
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), HIDDEN)
    probs = torch.rand(int(counts.sum()))
    out, _ = backend.forward(experts, x, counts, probs)
    return out


def test_te_backend_hands_the_device_counts_to_both_grouped_linears(te_with, host_copies):
    experts = experts_module(te_with(takes_device_splits=True))
    state = {k: v.clone() for k, v in experts.state_dict().items()}
    backend = eb.TEBackend(experts)
    assert backend.passes_device_splits  # decided once, here
    assert experts.state_dict().keys() == state.keys()  # the same modules, parameters, state dict

    counts = torch.tensor([2, 0, 3], dtype=torch.int32).as_subclass(OnDevice)
    out = run(backend, experts, counts)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        (call,) = linear.calls
        assert call["m_splits_tensor"] is counts  # already int32: the very tensor, no copy
        assert list(call["m_splits"]) == [2, 0, 3]  # TE still reads the real list on the host
    assert len(host_copies) == 1  # the one host copy per layer, no more

    # The same forward without device splits gives the same output.
    plain = eb.TEBackend.__new__(eb.TEBackend)
    plain.passes_device_splits = False
    torch.testing.assert_close(run(plain, experts, torch.tensor([2, 0, 3])), out, rtol=0, atol=0)


def test_int64_counts_reach_te_as_int32_on_their_device(te_with):
    experts = experts_module(te_with(takes_device_splits=True))
    backend = eb.TEBackend(experts)
    counts = torch.tensor([1, 4, 0])
    run(backend, experts, counts)
    seen = [linear.calls[0]["m_splits_tensor"] for linear in (experts.linear_fc1, experts.linear_fc2)]
    assert seen[0] is seen[1]  # one conversion per layer, shared by FC1 and FC2
    assert seen[0].dtype == torch.int32 and seen[0].device == counts.device
    assert seen[0].tolist() == [1, 4, 0]


def test_counts_on_another_device_than_the_tokens_are_not_handed_to_te(te_with, monkeypatch):
    experts = experts_module(te_with(takes_device_splits=True))
    backend = eb.TEBackend(experts)
    counts = torch.tensor([1, 1, 1], device="meta")  # e.g. the allgather dispatcher's host counts
    monkeypatch.setattr(eb, "host_tokens_per_expert", lambda counts_E: torch.tensor([1, 1, 1]))
    backend.forward(experts, torch.randn(3, HIDDEN), counts, torch.rand(3))
    assert experts.linear_fc1.calls[0]["m_splits_tensor"] is None


def test_without_m_splits_tensor_the_host_copy_stays_and_one_warning_says_so(te_with, host_copies, caplog):
    linear_class = te_with(takes_device_splits=False)
    experts = experts_module(linear_class)
    with caplog.at_level(logging.INFO, logger=eb.__name__):
        backend = eb.TEBackend(experts)
        eb.TEBackend(experts_module(linear_class))  # a second layer: no second line
    assert not backend.passes_device_splits
    assert type(experts.linear_fc1) is linear_class  # left as it was
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "takes no device splits (m_splits_tensor)" in warnings[0]
    assert "copied to the host once per layer" in warnings[0]

    run(backend, experts, torch.tensor([2, 0, 3]).as_subclass(OnDevice))
    assert len(host_copies) == 1
    assert all("m_splits_tensor" not in linear.calls[0] for linear in (experts.linear_fc1, experts.linear_fc2))


def test_with_m_splits_tensor_one_warning_says_the_host_copy_stays(te_with, caplog):
    linear_class = te_with(takes_device_splits=True)
    with caplog.at_level(logging.INFO, logger=eb.__name__):
        eb.TEBackend(experts_module(linear_class))
        eb.TEBackend(experts_module(linear_class))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "takes m_splits_tensor" in warnings[0] and "copied to the host once per layer" in warnings[0]
    assert "does not pass yet" not in warnings[0]


def test_flag_off_changes_nothing(te_with, caplog):
    linear_class = te_with(takes_device_splits=True)
    experts = experts_module(linear_class, moe_device_tokens_per_expert=False)
    with caplog.at_level(logging.INFO, logger=eb.__name__):
        backend = eb.TEBackend(experts)
    assert not backend.passes_device_splits and type(experts.linear_fc1) is linear_class
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    run(backend, experts, torch.tensor([1, 2, 0]))
    assert experts.linear_fc1.calls[0]["m_splits_tensor"] is None


class PadToFour(torch.nn.Module):
    """Fp8Padding in miniature: each expert's rows padded to a multiple of 4 (zero rows), the
    split list rebuilt."""

    def forward(self, x, splits):
        padded = [(n + 3) // 4 * 4 for n in splits]
        parts = [torch.cat([r, r.new_zeros(p - n, *r.shape[1:])]) for r, n, p in zip(torch.split(x, splits), splits, padded)]
        return torch.cat(parts), padded


class UnpadFromFour(torch.nn.Module):
    def forward(self, x, splits):
        padded = [(n + 3) // 4 * 4 for n in splits]
        return torch.cat([r[:n] for r, n in zip(torch.split(x, padded), splits)])


@pytest.mark.parametrize("counts, passed", [([2, 0, 3], False), ([4, 0, 8], True)])
def test_padded_splits_never_meet_unpadded_device_counts(te_with, counts, passed):
    """Under FP8 the stock forward pads the splits before FC1 and FC2: the device counts reach
    TE only where they equal the splits TE gets (already aligned), never the unpadded ones."""
    experts = experts_module(te_with(takes_device_splits=True))
    experts.config.fp8 = "e4m3"  # the stock forward pads, as with TE's Fp8Padding
    experts.quantization_padding, experts.quantization_unpadding = PadToFour(), UnpadFromFour()
    backend = eb.TEBackend(experts)
    run(backend, experts, torch.tensor(counts, dtype=torch.int32).as_subclass(OnDevice))
    for linear in (experts.linear_fc1, experts.linear_fc2):
        (call,) = linear.calls
        assert list(call["m_splits"]) == [(n + 3) // 4 * 4 for n in counts]
        given = call["m_splits_tensor"]
        assert (given is not None) == passed
        if passed:
            assert given.tolist() == list(call["m_splits"])


def test_handed_counts_serve_one_forward_only(te_with):
    """Counts handed for one forward are gone after it: a later forward that was handed none
    (e.g. the module called on its own) gets no stale counts."""
    experts = experts_module(te_with(takes_device_splits=True))
    fc1 = experts.linear_fc1
    fc1.hand_device_splits([1, 2, 0], torch.tensor([1, 2, 0], dtype=torch.int32))
    fc1(torch.randn(3, HIDDEN), [1, 2, 0])
    fc1(torch.randn(3, HIDDEN), [1, 2, 0])
    assert fc1.calls[0]["m_splits_tensor"] is not None and fc1.calls[1]["m_splits_tensor"] is None


def test_the_spec_chooses_the_classes_and_live_modules_keep_theirs(te_with):
    """The backend picks FC1's and FC2's classes in the experts' submodules (a class or a
    ModuleSpec), once per class; it never changes the class of a built module."""
    linear_class = te_with(takes_device_splits=True)
    config = experts_module(linear_class).config
    submodules = MLPSubmodules(linear_fc1=ModuleSpec(module=linear_class, params={"x": 1}), linear_fc2=linear_class)
    chosen = eb.TEBackend.expert_submodules(config, submodules, plan_for(config))
    assert chosen.linear_fc1.params == {"x": 1} and submodules.linear_fc1.module is linear_class  # a copy
    assert chosen.linear_fc1.module is chosen.linear_fc2  # one subclass per stock class
    assert issubclass(chosen.linear_fc2, linear_class)
    # a name of its own: logs and tracebacks tell it from megatron-core's class
    assert chosen.linear_fc2.__name__ == chosen.linear_fc2.__qualname__ == "TEGroupedLinearWithDeviceSplits"
    assert chosen.linear_fc2.__module__ == eb.__name__
    assert eb.TEBackend.expert_submodules(config, submodules, plan_for(config)).linear_fc2 is chosen.linear_fc2
    experts = experts_module(linear_class)
    built = type(experts.linear_fc1)
    eb.TEBackend(experts)  # a rebuilt backend
    assert type(experts.linear_fc1) is built

    flag_off = experts_module(linear_class, moe_device_tokens_per_expert=False).config
    assert eb.TEBackend.expert_submodules(flag_off, submodules, plan_for(flag_off)) is submodules
    other = MLPSubmodules(linear_fc1=torch.nn.Linear, linear_fc2=linear_class)  # not TE's GroupedLinear
    assert eb.TEBackend.expert_submodules(config, other, plan_for(config)) is other


def test_linears_built_without_the_chosen_classes_get_no_device_counts(te_with, caplog):
    """Experts whose FCs were not built from the backend's submodules (another spec) keep the
    host path, and the one warning says TE gets no device splits."""
    linear_class = te_with(takes_device_splits=True)
    experts = experts_module(linear_class)
    experts.linear_fc1 = linear_class(EXPERTS, HIDDEN, 2 * FFN)
    with caplog.at_level(logging.INFO, logger=eb.__name__):
        backend = eb.TEBackend(experts)
    assert not backend.passes_device_splits
    assert "takes no device splits" in caplog.records[-1].getMessage()
    run(backend, experts, torch.tensor([1, 2, 0]))
    assert experts.linear_fc2.calls[0]["m_splits_tensor"] is None


def test_patched_experts_build_their_fcs_from_the_backends_submodules(te_with, monkeypatch):
    """PatchedTEGroupedMLP hands megatron-core's constructor the submodules its backend chose:
    the stock constructor (here a stand-in that builds FC1 and FC2 from them) makes the
    subclasses, and the backend finds them."""
    from megatron.moe_patches.grouped_experts import PatchedTEGroupedMLP

    def stock_init(self, num_local_experts, config, submodules, pg_collection=None):
        torch.nn.Module.__init__(self)
        self.config, self.num_local_experts = config, num_local_experts
        self.linear_fc1 = submodules.linear_fc1(num_local_experts, HIDDEN, 2 * FFN)
        self.linear_fc2 = submodules.linear_fc2(num_local_experts, FFN, HIDDEN)

    linear_class = te_with(takes_device_splits=True)
    monkeypatch.setattr(TEGroupedMLP, "__init__", stock_init)
    config = experts_module(linear_class).config
    experts = PatchedTEGroupedMLP(EXPERTS, config, MLPSubmodules(linear_fc1=linear_class, linear_fc2=linear_class))
    assert experts.backend.name == "te" and experts.backend.passes_device_splits
    assert type(experts.linear_fc1) is eb._with_device_splits(linear_class, cap.te_attr("GroupedLinear"))
