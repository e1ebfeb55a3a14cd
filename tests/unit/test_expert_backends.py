import logging
import types

import pytest
import torch

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.moe_patches.experts import grouped_mm as f8
from megatron.moe_patches.experts import backend as eb
from megatron.moe_patches.experts.fp8_grouped_mm import FP8GroupedMMBackend
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.plan import backends as plan_backends
from megatron.moe_patches.dispatch.dispatchers import PatchedAlltoAllTokenDispatcher
from megatron.moe_patches.dispatch.exchanges import NcclAllToAll, NcclAllToAllDeviceCounts
from megatron.moe_patches.kernels.weighted_glu import glu_spec

import expert_shells as shells
from expert_configs import cfg

def bf16_mlp(x, counts, probs, w1, w2, config, b1=None, b2=None):
    """The grouped_mm backend's bf16 MLP over rows grouped by ``counts``."""
    groups = f8.RowGroups(counts, x.shape[0], x.device)
    gemm = f8.bf16_grouped_gemm(groups)
    fc1, fc2 = (lambda x_TI: (gemm(None, x_TI, w1), b1)), (lambda x_TI: (gemm(None, x_TI, w2), b2))
    return f8.grouped_mm_mlp(x, groups, probs, fc1, fc2, glu_spec(config), glu_triton=False)


SELECTION = [
    (dict(), "grouped_mm", None),
    (dict(activation_func=quick_gelu), "grouped_mm", None),
    (dict(moe_device_tokens_per_expert=False), "te", "moe_device_tokens_per_expert is off"),
    (dict(fp8="e4m3"), "te", "bf16 only"),
    (dict(params_dtype=torch.float32, bf16=False), "te", "bf16 parameters"),
    (dict(add_bias_linear=True), "grouped_mm", None),
    (dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu), "te", "SwiGLU and quick-GEGLU"),
    (dict(activation_func=torch.nn.functional.gelu), "te", "SwiGLU and quick-GEGLU"),
    (dict(expert_tensor_parallel_size=2), "te", "expert tensor parallelism"),
    (dict(use_transformer_engine_op_fuser=True), "te", "op_fuser backend owns"),  # no TE here: the op fuser cannot run either
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), "te", "--moe-apply-probs-on-input"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "te", "recompute"),
]


@pytest.mark.parametrize("overrides, backend, reason", SELECTION)
def test_backend_table_and_selection_agree(overrides, backend, reason):
    config = cfg(**overrides)
    assert moe_plan.plan_for(config).backend.name == backend
    support = dict(moe_plan.plan_for(config).backend_support)
    assert support["te"] is None  # megatron-core's own path runs anything
    if reason is None:
        assert support["grouped_mm"] is None
    else:
        assert reason in support["grouped_mm"]


def test_delayed_wgrad_runs_the_te_backend():
    # TE's GroupedLinear defers the weight gradients to backward_dw; grouped_mm computes them at once.
    config = cfg()
    config.delay_wgrad_compute = True  # set late: megatron-core asks for the EP overlap with it
    assert moe_plan.plan_for(config).backend.name == "te"
    assert "--delay-wgrad-compute" in dict(moe_plan.plan_for(config).backend_support)["grouped_mm"]


def test_selection_prefers_the_op_fuser_when_it_can_run(monkeypatch):
    from megatron.moe_patches.experts.op_fuser import OpFuserBackend

    monkeypatch.setattr(OpFuserBackend, "unavailable", classmethod(lambda cls, config: None))
    assert moe_plan.plan_for(cfg(use_transformer_engine_op_fuser=True)).backend.name == "op_fuser"


def test_single_grouped_refusal_names_every_backend_reason():
    assert moe_plan.plan_for(cfg(moe_single_grouped_weight=True)).single_grouped_refusal is None  # grouped_mm holds it
    with pytest.raises(ValueError) as refused:
        cfg(moe_single_grouped_weight=True, moe_device_tokens_per_expert=False)
    message = str(refused.value)
    assert "moe_single_grouped_weight" in message and "grouped_mm: moe_device_tokens_per_expert is off" in message


def test_host_copy_happens_in_one_place(host_copies):
    class DeviceCounts:  # stands in for a CUDA tensor on a CPU machine
        is_cuda = True
        copied = 0

        def cpu(self):
            self.copied += 1
            return torch.tensor([1, 2])

    host = torch.tensor([3, 4])
    assert eb.host_tokens_per_expert(host) is host and host_copies == []
    counts = DeviceCounts()
    assert eb.host_tokens_per_expert(counts).tolist() == [1, 2]
    assert counts.copied == 1 and host_copies == [counts]

def make_weights(num, out, inp, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(out, inp, generator=generator)) for _ in range(num)]


def test_per_expert_weights_keep_their_storage_and_are_stacked_each_forward():
    """The backend never re-points a parameter's storage: each forward stacks the per-expert
    weights (the values they hold now) into one [E, out, in] tensor, gradients go back to each."""
    owner = experts_shell(cfg())
    fc1 = owner.linear_fc1
    storage = [(p.data_ptr(), p.stride()) for p in fc1.parameters()]
    backend = f8.GroupedMMBackend(owner)
    assert [(p.data_ptr(), p.stride()) for p in fc1.parameters()] == storage
    with torch.no_grad():
        fc1.weight2.mul_(2)  # an optimizer's in-place update: the next forward reads it
    w_EOI = f8.grouped_param(fc1)
    assert torch.equal(w_EOI, torch.stack([p.detach() for p in fc1.parameters()]))
    upstream = torch.randn(w_EOI.shape, dtype=w_EOI.dtype)
    (w_EOI * upstream).sum().backward()
    for i, w in enumerate(fc1.parameters()):
        assert torch.equal(w.grad, upstream[i])


@pytest.mark.parametrize("grouped_weight", [False, True])
def test_per_expert_weights_warn_once_that_each_forward_copies_them(caplog, monkeypatch, grouped_weight):
    from megatron.moe_patches import fields

    monkeypatch.setattr(fields, "_said", set())
    with caplog.at_level(logging.WARNING, logger=f8.__name__):
        for _ in range(2):  # two layers, one line
            f8.GroupedMMBackend(experts_shell(cfg(moe_single_grouped_weight=grouped_weight)))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if grouped_weight:
        assert warned == []  # one [E, out, in] parameter per FC: no copy, nothing to say
    else:
        assert len(warned) == 1 and "every forward" in warned[0] and "--moe-single-grouped-weight" in warned[0]


def test_no_parameter_storage_is_re_pointed_anywhere_in_the_package():
    """``param.data = ...`` swaps a parameter's storage behind DDP's and the optimizers' backs."""
    import pathlib
    import re

    import megatron.moe_patches as package

    root = pathlib.Path(package.__file__).parent
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\.data\s*=(?!=)", line)]
    assert found == []


def test_grouped_mm_mlp_matches_per_expert_loop():
    torch.manual_seed(0)
    counts = torch.tensor([3, 5, 1, 7])
    tokens, hidden, ffn = int(counts.sum()), 16, 8
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    probs = torch.rand(tokens)
    w1 = torch.randn(4, 2 * ffn, hidden, dtype=torch.bfloat16) / 4
    w2 = torch.randn(4, hidden, ffn, dtype=torch.bfloat16) / 4
    out = bf16_mlp(x, counts, probs, w1, w2, cfg()).float()
    expected, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = x[start:start + c].float() @ w1[e].float().T
        gate, lin = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * lin * probs[start:start + c, None]
        expected.append(a @ w2[e].float().T)
        start += c
    torch.testing.assert_close(out, torch.cat(expected), rtol=3e-2, atol=3e-2)  # bf16 GEMMs


def test_dispatcher_drops_only_the_host_count_sync():
    dispatcher = object.__new__(PatchedAlltoAllTokenDispatcher)
    dispatcher.exchange = NcclAllToAllDeviceCounts()
    dispatcher.cuda_sync_point_priority = {
        "before_permutation_1": 0, "before_ep_alltoall": 1, "before_permutation_2": 2,
        "before_finish": 3, "no_sync": 4,
    }
    dispatcher.cuda_sync_point = "no_sync"
    dispatcher._maybe_update_cuda_sync_point("before_finish")
    assert dispatcher.cuda_sync_point == "no_sync"  # EP=1: nothing else needs the host
    dispatcher._maybe_update_cuda_sync_point("before_ep_alltoall")
    assert dispatcher.cuda_sync_point == "before_ep_alltoall"  # EP>1: split sizes do
    dispatcher.exchange = NcclAllToAll()
    dispatcher.cuda_sync_point = "no_sync"
    dispatcher._maybe_update_cuda_sync_point("before_finish")
    assert dispatcher.cuda_sync_point == "before_finish"


def test_te_backend_calls_megatron_cores_own_methods_while_applied(reverted):
    # The TE backend runs the stock TEGroupedMLP methods; reaching the patched class instead
    # would recurse into the backend forever.
    import importlib

    from megatron.core.extensions import transformer_engine_spec_provider as spec_provider
    from megatron.core.transformer.moe import experts as mcore_experts
    from megatron.moe_patches import apply

    stock = mcore_experts.TEGroupedMLP
    apply(["F3"])
    assert spec_provider.TEGroupedMLP is not stock and mcore_experts.TEGroupedMLP is stock
    assert eb.TEBackend.stock is stock
    assert importlib.reload(eb).TEBackend.stock is stock  # even when imported while applied


def experts_shell(config, backend_class=f8.GroupedMMBackend):
    """What a backend's constructor reads of the experts module, on CPU: 3 experts."""
    return shells.experts_shell(backend_class, config, 3, (4, 2), (4, 2), bias=config.add_bias_linear)


def test_a_dropped_layer_is_freed_without_the_garbage_collector():
    # Backends keep no reference to their experts: no cycle keeps a dropped layer's memory.
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        config = cfg()
        config.fp8_recipe = "tensorwise"  # a recipe the FP8 backend implements; the others ignore it
        for backend_class in (*plan_backends.BACKENDS, moe_plan.FALLBACK):
            owner = experts_shell(config, backend_class)
            owner.backend = backend_class(owner)
            alive = weakref.ref(owner)
            del owner
            assert alive() is None, backend_class.name
    finally:
        gc.enable()


def test_expert_of_row_from_offsets():
    offsets = torch.tensor([3, 3, 5, 9], dtype=torch.int32)  # expert 1 has no row
    assert f8.expert_of_row(offsets, 11).tolist() == [0, 0, 0, 2, 2, 3, 3, 3, 3, 3, 3]  # 9, 10: unused rows


def test_grouped_mm_mlp_with_biases_matches_per_expert_loop():
    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 5, 2])
    tokens, hidden, ffn = int(counts.sum()), 16, 8
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens)
    w1 = (torch.randn(4, 2 * ffn, hidden) / 4).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(4, hidden, ffn) / 4).to(torch.bfloat16).requires_grad_()
    b1 = torch.randn(4, 2 * ffn).to(torch.bfloat16).requires_grad_()
    b2 = torch.randn(4, hidden).to(torch.bfloat16).requires_grad_()
    out = bf16_mlp(x, counts, probs, w1, w2, cfg(add_bias_linear=True), b1, b2)
    grad = torch.randn_like(out)
    out.backward(grad)
    # float64 reference: per expert, FC1 + b1, SwiGLU x prob, FC2 + b2 x prob
    X, W1, W2, B1, B2 = (t.detach().double().requires_grad_() for t in (x, w1, w2, b1, b2))
    pieces, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = X[start:start + c] @ W1[e].T + B1[e]
        gate, lin = h.chunk(2, dim=-1)
        p = probs[start:start + c, None].double()
        pieces.append((torch.nn.functional.silu(gate) * lin * p) @ W2[e].T + B2[e] * p)
        start += c
    expected = torch.cat(pieces)
    expected.backward(grad.double())
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)  # bf16 GEMMs
    for ours, ref in ((x, X), (w1, W1), (w2, W2), (b1, B1), (b2, B2)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=5e-2, atol=5e-2)
    assert torch.count_nonzero(b1.grad[1]) == 0 and torch.count_nonzero(b2.grad[1]) == 0  # expert 1: no rows


@pytest.mark.parametrize("grouped_bias", [False, True])
def test_grouped_mm_backend_holds_biases_in_the_asked_layout(grouped_bias):
    owner = experts_shell(cfg(add_bias_linear=True, moe_single_grouped_bias=grouped_bias))
    stock = experts_shell(cfg(add_bias_linear=True))  # the same seed, per expert
    biases = [stock.linear_fc2.get_parameter(f"bias{i}").detach() for i in range(3)]
    f8.GroupedMMBackend(owner)
    fc2 = owner.linear_fc2
    assert ("bias" in dict(fc2.named_parameters())) is grouped_bias  # weights stay per expert
    assert "weight0" in dict(fc2.named_parameters())
    assert torch.equal(f8.grouped_param(fc2, "bias"), torch.stack(biases))
    if grouped_bias:  # the grouped parameter itself: no copy per step
        assert f8.grouped_param(fc2, "bias") is fc2.bias


def test_te_backend_warns_once_when_device_splits_were_asked_for(caplog, monkeypatch):
    import logging

    from megatron.moe_patches import fields

    monkeypatch.setattr(fields, "_said", set())
    # FCs not built from the device-splits spec (no TE here): the host copy stays
    owner = types.SimpleNamespace(config=cfg(fp8=None, params_dtype=torch.float32, bf16=False),
                                  linear_fc1=None, linear_fc2=None)
    with caplog.at_level(logging.INFO, logger=eb.__name__):
        eb.TEBackend(owner)
        eb.TEBackend(owner)
        eb.TEBackend(types.SimpleNamespace(config=cfg(moe_device_tokens_per_expert=False)))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "copied to the host once per layer" in warnings[0].getMessage()


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_padded_rows_change_nothing(bias):
    """Counts padded to an alignment (zero rows with prob 0, as F1 lays them out) give the
    same real rows, zero pad rows and zero grads from them; with biases too (the prob
    scales what a bias would put there)."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 1])
    padded = (counts + 3) // 4 * 4
    x = torch.randn(int(counts.sum()), 16, dtype=torch.bfloat16)
    probs = torch.rand(int(counts.sum()))
    w1 = (torch.randn(4, 16, 16) / 4).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(4, 16, 8) / 4).to(torch.bfloat16).requires_grad_()
    biases = [torch.randn(4, n).to(torch.bfloat16).requires_grad_() for n in (16, 16)] if bias else [None, None]
    starts = torch.cumsum(padded, 0) - padded
    rows = torch.cat([torch.arange(int(c)) + int(s) for c, s in zip(counts, starts)])
    x_pad = torch.zeros(int(padded.sum()), 16, dtype=torch.bfloat16).index_copy_(0, rows, x).requires_grad_()
    p_pad = torch.zeros(int(padded.sum())).index_copy_(0, rows, probs)
    x.requires_grad_()
    config = cfg(add_bias_linear=bias)
    out = bf16_mlp(x, counts, probs, w1, w2, config, *biases)
    out.sum().backward()
    params = [w1, w2] + [b for b in biases if b is not None]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    out_pad = bf16_mlp(x_pad, padded, p_pad, w1, w2, config, *biases)
    out_pad.sum().backward()
    pad_rows = torch.ones(int(padded.sum()), dtype=torch.bool).index_fill_(0, rows, False)
    torch.testing.assert_close(out_pad[rows], out, rtol=0, atol=0)
    assert not out_pad[pad_rows].any() and not x_pad.grad[pad_rows].any()
    torch.testing.assert_close(x_pad.grad[rows], x.grad, rtol=0, atol=0)
    for got, want in zip((p.grad for p in params), grads):  # zero rows add nothing (K order may move)
        assert (got.float() - want.float()).abs().max() <= 2.0**-7 * want.float().abs().max()


def test_fp8_backend_refreshes_stale_weight_copies_in_place_and_only_then(quantizations):
    """What F11 calls before each replay: a no-op until megatron-core's schedule marks a step's
    first micro-batch (after the optimizer stepped); then the FP8 copies of each FC are
    requantized into the tensors the captured GEMMs read."""
    from megatron.moe_patches.experts import fp8_grouped_mm as fp8

    owner = experts_shell(cfg(fp8="e4m3", fp8_recipe="tensorwise"), fp8.FP8GroupedMMBackend)  # megatron-core marks steps under FP8
    backend = fp8.FP8GroupedMMBackend(owner)
    caches = [backend._caches[owner.linear_fc1], backend._caches[owner.linear_fc2]]
    backend.refresh_weight_caches()
    held = [(c.weights.w8_EOI, c.weights.scale_inv_E) for c in caches]
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [1, 1]
    with torch.no_grad():
        owner.linear_fc2.weight1.data.mul_(4)  # what an optimizer step changes, unseen by the counters
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [1, 1]  # no new step marked: the copies stay
    owner.set_is_first_microbatch()  # megatron-core's schedule, at the next step's first micro-batch
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [2, 2]
    assert all(c.weights.w8_EOI is w and c.weights.scale_inv_E is s for c, (w, s) in zip(caches, held))
    w8_EOI, _, scale_inv_E = fp8.quantize_weights(f8.grouped_param(owner.linear_fc2).detach())
    assert torch.equal(caches[1].weights.w8_EOI.float(), w8_EOI.float()) and torch.equal(caches[1].weights.scale_inv_E, scale_inv_E)


@pytest.mark.parametrize("capability, reason", [((9, 0), None), ((10, 0), None), ((8, 0), "Hopper (sm90) or newer")])
def test_grouped_mm_backend_needs_hopper_or_newer(monkeypatch, capability, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    why = moe_plan.backend_blocker(f8.GroupedMMBackend, cfg())
    assert why is None if reason is None else reason in why


@pytest.mark.parametrize("late, reason", [
    (dict(fp4="nvfp4"), "bf16 only"),
    (dict(fine_grained_activation_offloading=True), "activation offloading"),
    (dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
])
def test_grouped_mm_backend_rows_set_after_construction(late, reason):
    """Rows whose fields megatron-core checks against TE or other flags at construction: set late,
    the backend table alone decides."""
    config = cfg()
    for name, value in late.items():
        setattr(config, name, value)
    assert reason in (moe_plan.backend_blocker(f8.GroupedMMBackend, config) or "")
    assert moe_plan.plan_for(config).backend.name == "te"


@pytest.mark.parametrize("grouped_weight", [False, True])
def test_grouped_mm_backend_calls_the_fcs_so_their_forward_pre_hooks_run_before_their_weights_are_read(
        grouped_weight):
    """Megatron's DDP waits for a parameter's all-gather (--overlap-param-gather) in the forward
    pre-hook of the module that holds it, and dispatches the next bucket's there. The backend
    calls FC1 and FC2 as modules, whose forward is its grouped GEMM, so torch runs every hook
    first. Here the hooks stand for the all-gather landing: they write new weights in place."""
    torch.manual_seed(0)
    config = cfg(moe_single_grouped_weight=grouped_weight)
    hidden, ffn = 16, 8
    owner = shells.experts_shell(f8.GroupedMMBackend, config, 3, (2 * ffn, hidden), (hidden, ffn))
    backend = f8.GroupedMMBackend(owner)
    fcs = (owner.linear_fc1, owner.linear_fc2)
    landed = {fc: [(torch.randn_like(p) / 4) for p in fc.parameters()] for fc in fcs}
    calls = []

    def all_gather_lands(module, args, kwargs=None):
        calls.append((module, args[0].shape, kwargs is not None))
        with torch.no_grad():
            for p, new in zip(module.parameters(), landed[module]):
                p.data.copy_(new)

    owner.linear_fc1.register_forward_pre_hook(all_gather_lands)
    owner.linear_fc1.register_forward_pre_hook(lambda module, args: calls.append("every hook"))
    owner.linear_fc2.register_forward_pre_hook(all_gather_lands, with_kwargs=True)
    counts = torch.tensor([3, 0, 2])
    x = torch.randn(5, hidden, dtype=torch.bfloat16)
    probs = torch.rand(5)
    out, _ = backend.forward(owner, x, counts, probs)
    assert calls == [(owner.linear_fc1, x.shape, False), "every hook", (owner.linear_fc2, (5, ffn), True)]
    w1, w2 = (f8.grouped_param(fc).detach() for fc in fcs)
    assert torch.equal(w1.reshape(-1), torch.cat([t.reshape(-1) for t in landed[owner.linear_fc1]]))
    torch.testing.assert_close(out, bf16_mlp(x, counts, probs, w1, w2, config), rtol=0, atol=0)


@pytest.mark.parametrize("backend_class, name", [(f8.GroupedMMBackend, "ShellGroupedLinearForGroupedMM"),
                                                 (FP8GroupedMMBackend, "ShellGroupedLinearForFP8GroupedMM")])
def test_fc_classes_a_backend_builds_have_names_of_their_own(backend_class, name):
    """Not the spec class's name: logs, module reprs and tracebacks say which class runs."""
    owner = shells.experts_shell(backend_class, cfg(), 3, (4, 2), (4, 2))
    fc_class = type(owner.linear_fc1)
    assert fc_class is type(owner.linear_fc2) and issubclass(fc_class, shells.ShellGroupedLinear)
    assert fc_class.__name__ == fc_class.__qualname__ == name and fc_class.__module__ == eb.__name__
    assert repr(owner.linear_fc1).startswith(f"{name}(")


def test_grouped_mm_backend_refuses_fcs_built_without_its_spec():
    owner = shells.experts_shell(eb.TEBackend, cfg(), 3, (4, 2), (4, 2))  # stock FC classes
    with pytest.raises(TypeError, match="expert_submodules"):
        f8.GroupedMMBackend(owner)
