"""The dispatchers as strategies (CPU): which exchange and permute step a config gets, that
the dispatchers hand every phase to them, and that the one pipeline of the alltoall and
allgather dispatchers with megatron-core's exchange and plain permute gives megatron-core's
own results (unfused permute on CPU: every tensor and every piece of metadata equal)."""

import types

import pytest
import torch
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron.moe_patches.dispatch import dispatchers, exchanges, permute_pad
from megatron.moe_patches.dispatch.exchanges import (
    AllGather,
    NcclAllToAll,
    NcclAllToAllDeviceCounts,
    NcclAllToAllOneSource,
    SymmetricMemoryAllToAll,
)
from megatron.moe_patches.dispatch.permute_pad import (
    DeviceCountPermute, PaddedPermute, PlainPermute, StaticPaddedPermute)
from megatron.moe_patches.plan import ALLGATHER, ALLTOALL, SYMMETRIC_MEMORY, ExchangeChoice


def a_choice(name=ALLTOALL, device_counts=False, skips_chunk_sort=False, pad_align=None, static_pad_rows=False):
    return ExchangeChoice(name=name, reason=None, device_counts=device_counts, skips_chunk_sort=skips_chunk_sort,
                          pad_align=pad_align, static_pad_rows=static_pad_rows, contradictions=())


def given_choice(monkeypatch, name=ALLTOALL, **options):
    """The dispatchers build from this exchange choice instead of the config's plan."""
    choice = a_choice(name, **options)
    monkeypatch.setattr(dispatchers, "_exchange_plan", lambda dispatcher: choice)


@pytest.fixture
def fused_permute_kernels(monkeypatch):
    """megatron-core checks at config construction that TE's fused permute kernels exist."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)


def stubbed_stock_init(monkeypatch, ep_size=1, tp_size=1):
    """megatron-core's __init__s need CUDA streams: stand-ins setting what ours read."""

    def stock_init(self, *args, **kwargs):
        self.config, self.ep_group, self.ep_size, self.tp_size = kwargs["config"], "ep-group", ep_size, tp_size
        self.local_expert_indices = [0, 1, 2, 3]

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "__init__", stock_init)
    monkeypatch.setattr(MoEAllGatherTokenDispatcher, "__init__", stock_init)


# --- which exchange and which permute step ------------------------------------------------


@pytest.mark.parametrize("symmetric, device_counts, ep, tp, expected", [
    (True, True, 2, 1, SymmetricMemoryAllToAll),
    (False, False, 2, 1, NcclAllToAll),
    (False, False, 1, 1, NcclAllToAll),  # without F8 the stock path, identity chunk sort included
    (False, True, 2, 1, NcclAllToAllDeviceCounts),
    (False, True, 1, 2, NcclAllToAllDeviceCounts),  # TP ranks are sources too
    (False, True, 1, 1, NcclAllToAllOneSource),
])
def test_the_alltoall_dispatcher_gets_one_exchange(moe_config, monkeypatch, symmetric, device_counts, ep, tp,
                                                   expected):
    stubbed_stock_init(monkeypatch, ep, tp)
    exchange = object()
    monkeypatch.setattr(exchanges, "SymmetricExchange", lambda group, topk, zero_tail: exchange)
    one_source = device_counts and ep == 1 and tp == 1
    given_choice(monkeypatch, SYMMETRIC_MEMORY if symmetric else ALLTOALL, device_counts=device_counts,
                 skips_chunk_sort=one_source or symmetric)
    config = moe_config(moe_device_tokens_per_expert=device_counts)
    dispatcher = dispatchers.PatchedAlltoAllTokenDispatcher(config=config)
    assert type(dispatcher.exchange) is expected
    if symmetric:
        assert dispatcher.exchange.symmetric is exchange


def test_exchanges_declare_what_they_do():
    # the NCCL ones need host split sizes; only the symmetric exchange lands rows grouped at EP > 1
    table = {cls: (cls.split_sizes_to_host, cls.counts_to_host, cls.lands_grouped_by_local_expert,
                   cls.carries_padded_chunks)
             for cls in (NcclAllToAll, NcclAllToAllDeviceCounts, NcclAllToAllOneSource, SymmetricMemoryAllToAll)}
    assert table == {
        NcclAllToAll: (True, True, False, True),
        NcclAllToAllDeviceCounts: (True, False, False, True),
        NcclAllToAllOneSource: (True, False, True, True),
        SymmetricMemoryAllToAll: (False, False, True, False),
    }


@pytest.mark.parametrize("align, static", [(None, False), (16, False), (128, True)])
def test_the_alltoall_dispatcher_gets_one_permute_step(moe_config, monkeypatch, align, static):
    stubbed_stock_init(monkeypatch)
    given_choice(monkeypatch, pad_align=align, device_counts=static, static_pad_rows=static)
    config = moe_config(moe_pad_expert_input_to_capacity=False, moe_router_topk=2)
    step = dispatchers.PatchedAlltoAllTokenDispatcher(config=config).permute_step
    if align is None:
        assert type(step) is PlainPermute and not step.pads
        assert (step.fused, step.drop_and_pad, step.router_align) == (True, False, None)
    elif static:
        assert type(step) is StaticPaddedPermute and step.pads and (step.align, step.topk) == (128, 2)
    else:
        assert type(step) is PaddedPermute and step.pads and step.align == 16


def test_the_plain_alltoall_step_carries_the_stock_options(moe_config):
    config = moe_config(moe_permute_fusion=False, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    step = dispatchers.alltoall_permute_step(config, a_choice())
    assert (step.fused, step.drop_and_pad, step.router_align) == (False, True, None)
    config = moe_config(fp8="e4m3", fp8_recipe="mxfp8", moe_router_padding_for_quantization=True)
    assert dispatchers.alltoall_permute_step(config, a_choice()).router_align == 32  # megatron-core's alignment


@pytest.mark.parametrize("align, counts_on_device, static, expected", [
    (None, False, False, PlainPermute),
    (16, False, False, PaddedPermute),
    (None, True, False, DeviceCountPermute),
    (128, True, True, StaticPaddedPermute),
])
def test_the_allgather_dispatcher_gets_one_permute_step(moe_config, monkeypatch, align, counts_on_device, static,
                                                        expected):
    stubbed_stock_init(monkeypatch)
    given_choice(monkeypatch, ALLGATHER, device_counts=counts_on_device, pad_align=align, static_pad_rows=static)
    dispatcher = dispatchers.PatchedAllGatherTokenDispatcher(config=moe_config(moe_token_dispatcher_type="allgather"))
    assert type(dispatcher.permute_step) is expected and type(dispatcher.exchange) is AllGather
    assert dispatcher.local_experts == slice(0, 4)


# --- the dispatchers hand every phase over ------------------------------------------------


class Recorder:
    """Answers every call with a fresh token and records (name, args)."""

    def __init__(self, **returns):
        self.calls, self.returns = [], returns

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def record(*args):
            self.calls.append((name, args))
            return self.returns.get(name, (name, "result"))

        return record


def test_the_alltoall_dispatcher_delegates_each_phase_to_its_exchange():
    dispatcher = object.__new__(dispatchers.PatchedAlltoAllTokenDispatcher)
    dispatcher.exchange = exchange = Recorder()
    x, probs = torch.ones(3, 2), torch.ones(3)
    assert dispatcher.token_dispatch(x, probs) == ("dispatch", "result")
    assert dispatcher.dispatch_postprocess(x, probs) == ("dispatch_postprocess", "result")
    assert dispatcher.combine_preprocess(x) == ("combine_preprocess", "result")
    assert dispatcher.token_combine(x) == ("combine", "result")
    assert dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall", x) == ("dtoh_and_synchronize", "result")
    dispatcher._maybe_update_cuda_sync_point("before_finish")
    assert [(name, args[0]) for name, args in exchange.calls] == [
        ("dispatch", dispatcher), ("dispatch_postprocess", dispatcher), ("combine_preprocess", dispatcher),
        ("combine", dispatcher), ("dtoh_and_synchronize", dispatcher), ("update_sync_point", dispatcher),
    ]
    assert exchange.calls[3][1][2:] == (True, True)  # megatron-core's defaults passed on
    assert exchange.calls[4][1][1:] == ("before_ep_alltoall", x)


def test_the_alltoall_pipeline_runs_the_steps_in_megatron_cores_order():
    """route -> exchange metadata -> the step's split sizes -> the first host sync -> permute;
    the unpermute gets what the permute left."""
    order = []
    routed = torch.zeros(4, 8, dtype=torch.bool)
    routed[:, 0] = True
    permuted = permute_pad.Permuted(torch.zeros(4, 6), torch.zeros(4), "row map", "offsets", None, routed)

    class Step(Recorder):
        def route(self, routing_map):
            order.append("route")
            return routed

        def align_splits(self, d, routing_map, counts):
            order.append(("align_splits", routing_map is routed, counts))
            return "aligned"

        def permute(self, x_TH, probs, routing_map, num_out_tokens):
            order.append(("permute", tuple(x_TH.shape), routing_map is routed, num_out_tokens))
            return permuted

        def unpermute(self, y, row_id_map, pad_offsets, restore_shape, routing_map):
            order.append(("unpermute", row_id_map, pad_offsets, tuple(restore_shape), routing_map is routed))
            return torch.zeros(4, 6)

    class Exchange:
        def preprocess(self, d, routing_map):
            order.append(("preprocess", routing_map is routed))
            d.num_out_tokens = 4
            return "counts"

        def dtoh_and_synchronize(self, d, point, tokens_per_expert):
            order.append(("sync", point, tokens_per_expert))
            return tokens_per_expert

    dispatcher = object.__new__(dispatchers.PatchedAlltoAllTokenDispatcher)
    dispatcher.permute_step, dispatcher.exchange, dispatcher.shared_experts = Step(), Exchange(), None
    hidden = torch.randn(2, 2, 6)
    out, out_probs = dispatcher.dispatch_preprocess(hidden, torch.ones(4, 8, dtype=torch.bool), torch.rand(4, 8))
    assert out is permuted.x_RH and out_probs is permuted.probs_R
    assert order == [
        "route", ("preprocess", True), ("align_splits", True, "counts"), ("sync", "before_permutation_1", "aligned"),
        ("permute", (4, 6), True, 4),
    ]
    assert dispatcher.tokens_per_expert == "aligned" and dispatcher.routing_map is routed
    assert (dispatcher.reversed_local_input_permutation_mapping, dispatcher.pad_offsets) == ("row map", "offsets")
    assert dispatcher.combine_postprocess(torch.zeros(4, 6)).shape == hidden.shape
    assert order[-1] == ("unpermute", "row map", "offsets", (4, 6), True)


def test_the_allgather_dispatcher_delegates_the_gather_and_the_permutation():
    dispatcher = object.__new__(dispatchers.PatchedAllGatherTokenDispatcher)
    local_map = torch.ones(3, 2, dtype=torch.bool)
    counts = torch.tensor([3, 3])
    permuted = permute_pad.Permuted(torch.zeros(6, 4), torch.ones(6), "row map", "offsets", counts, local_map)
    dispatcher.exchange, dispatcher.permute_step = Recorder(), Recorder(permute_local=permuted, unpermute="restored")
    dispatcher.routing_map, dispatcher.local_experts = torch.ones(3, 8, dtype=torch.bool), slice(2, 4)
    x, probs = torch.ones(3, 4), torch.ones(3, 8)
    assert dispatcher.token_dispatch(x, probs) == ("dispatch", "result")
    assert dispatcher.token_combine(x) == ("combine", "result")
    routing_map = dispatcher.routing_map
    out, out_counts, out_probs = dispatcher.dispatch_postprocess(x, probs)
    assert (out, out_counts, out_probs) == (permuted.x_RH, counts, permuted.probs_R)
    assert dispatcher.permute_step.calls[0] == ("permute_local", (x, probs, routing_map, slice(2, 4)))
    assert dispatcher.routing_map is None and dispatcher.local_map is local_map
    assert dispatcher.combine_preprocess(out) == "restored"
    assert dispatcher.permute_step.calls[1] == ("unpermute", (out, "row map", "offsets", x.shape, local_map))
    assert [name for name, _ in dispatcher.exchange.calls] == ["dispatch", "combine"]


def test_the_nccl_exchanges_run_megatron_cores_methods(monkeypatch):
    """NCCL's exchange is megatron-core's own methods on the dispatcher; with device counts
    the counts stay out of the host copy, and one source rank skips the chunk sort."""
    ran = []
    for name in ("preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine",
                 "_maybe_update_cuda_sync_point", "_maybe_dtoh_and_synchronize"):
        monkeypatch.setattr(MoEAlltoAllTokenDispatcher, name,
                            lambda self, *args, name=name: ran.append((name, self, args)) or name)
    d = types.SimpleNamespace(shared_experts=None, tokens_per_expert="counts")
    nccl = NcclAllToAll()
    assert nccl.preprocess(d, "map") == "preprocess" and nccl.dispatch(d, "x", "p") == "token_dispatch"
    assert nccl.dispatch_postprocess(d, "x", "p") == "dispatch_postprocess"
    assert nccl.combine_preprocess(d, "y") == "combine_preprocess"
    assert nccl.combine(d, "y", False, True) == "token_combine"
    assert nccl.dtoh_and_synchronize(d, "before_finish", "counts") == "_maybe_dtoh_and_synchronize"
    nccl.update_sync_point(d, "before_finish")
    assert all(self is d for _, self, _ in ran) and ran[4][2] == ("y", False, True)
    assert ran[-2:] == [("_maybe_dtoh_and_synchronize", d, ("before_finish", "counts")),
                        ("_maybe_update_cuda_sync_point", d, ("before_finish",))]

    ran.clear()
    device = NcclAllToAllDeviceCounts()
    assert device.dtoh_and_synchronize(d, "before_ep_alltoall", "counts") == "counts"
    device.update_sync_point(d, "before_finish")  # exists only to read the counts on the host
    device.update_sync_point(d, "before_ep_alltoall")
    assert ran == [("_maybe_dtoh_and_synchronize", d, ("before_ep_alltoall", None)),
                   ("_maybe_update_cuda_sync_point", d, ("before_ep_alltoall",))]
    assert device.dispatch_postprocess(d, "x", "p") == "dispatch_postprocess"

    ran.clear()
    one_source = NcclAllToAllOneSource()
    x, p = torch.ones(2), torch.ones(2)
    assert one_source.dispatch_postprocess(d, x, p) == (x, "counts", p) and d.tokens_per_expert is None
    assert one_source.combine_preprocess(d, x) is x
    assert one_source.dispatch(d, x, p) == "token_dispatch"  # still NCCL's (a no-op at EP 1)
    assert [name for name, _, _ in ran] == ["token_dispatch"]


def test_rows_landing_grouped_feed_the_shared_experts_first():
    fed = []
    shared = types.SimpleNamespace(linear_fc1_forward_and_act=fed.append)
    d = types.SimpleNamespace(shared_experts=shared, tokens_per_expert="counts")
    x = torch.ones(2)
    for exchange in (NcclAllToAllOneSource(), SymmetricMemoryAllToAll(object())):
        d.tokens_per_expert = "counts"
        assert exchange.dispatch_postprocess(d, x, x)[1] == "counts"
    assert fed == [x, x]


# --- the one pipeline gives megatron-core's results ---------------------------------------


class _Group:
    def size(self):
        return 1

    def rank(self):
        return 0


def cpu_dispatcher(cls, config, monkeypatch):
    """A real dispatcher (stock or ours) on CPU, EP 1, no TP: its CUDA stream and host copies
    stood in for (every dispatcher here uses the same stand-ins)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None)
    group = _Group()
    pgs = types.SimpleNamespace(ep=group, expt_tp=group, tp_ep=group)
    return cls(config.num_moe_experts, list(range(config.num_moe_experts)), config=config, pg_collection=pgs)


@pytest.fixture
def cpu_host_copies(monkeypatch):
    """megatron-core's host copy and sync need CUDA: a CPU twin (the points recorded)."""
    points = []

    def dtoh(self, point, tokens_per_expert=None):
        points.append(point)
        return tokens_per_expert

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", dtoh)
    return points


def routing(tokens=13, experts=8, topk=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    return routing_map, torch.where(routing_map, scores, torch.zeros_like(scores))


def run_alltoall(dispatcher, hidden, routing_map, probs):
    # copies: megatron-core's router padding writes into the map it is given
    x, p = dispatcher.dispatch_preprocess(hidden.clone(), routing_map.clone(), probs.clone())
    x, p = dispatcher.token_dispatch(x, p)
    x, counts, p = dispatcher.dispatch_postprocess(x, p)
    y = dispatcher.combine_preprocess(x * 2)
    y = dispatcher.token_combine(y)
    return dict(x=x, counts=counts, probs=p, out=dispatcher.combine_postprocess(y),
                num_out_tokens=dispatcher.num_out_tokens, routing_map=dispatcher.routing_map,
                row_map=dispatcher.reversed_local_input_permutation_mapping)


ALLTOALL_CASES = {
    "dropless": dict(),
    "router padding": dict(moe_router_padding_for_quantization=True),
    "capacity, padded": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "capacity, dropping": dict(moe_expert_capacity_factor=0.5),
}


class SharedExperts:
    """Records megatron-core's calls into overlapped shared experts, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, *(tuple(a.shape) for a in args))) or torch.full((13, 1, 64), 0.5)


@pytest.mark.parametrize("case", [*ALLTOALL_CASES, "shared experts"])
def test_the_alltoall_pipeline_is_megatron_cores(moe_config, monkeypatch, cpu_host_copies, case):
    config = moe_config(moe_permute_fusion=False, moe_router_topk=2, **ALLTOALL_CASES.get(case, {}))
    hidden = torch.randn(13, 1, 64)
    routing_map, probs = routing()
    results = []
    for cls in (MoEAlltoAllTokenDispatcher, dispatchers.PatchedAlltoAllTokenDispatcher):
        dispatcher = cpu_dispatcher(cls, config, monkeypatch)
        if case == "shared experts":
            dispatcher.shared_experts = SharedExperts()
        results.append(run_alltoall(dispatcher, hidden, routing_map, probs))
        results[-1]["points"] = list(cpu_host_copies)
        results[-1]["shared"] = getattr(dispatcher.shared_experts, "calls", None)
        cpu_host_copies.clear()
    stock, ours = results
    assert stock.keys() == ours.keys()
    for name in stock:
        if torch.is_tensor(stock[name]):
            assert torch.equal(stock[name], ours[name]), name
        else:
            assert stock[name] == ours[name], name
    assert stock["points"] == ["before_permutation_1", "before_ep_alltoall", "before_permutation_2", "before_finish"]


def test_device_counts_at_one_rank_skip_only_the_identity_sort(moe_config, monkeypatch, cpu_host_copies):
    hidden = torch.randn(13, 1, 64)
    routing_map, probs = routing()
    stock_config = moe_config(moe_permute_fusion=False, moe_router_topk=2)
    stock = run_alltoall(cpu_dispatcher(MoEAlltoAllTokenDispatcher, stock_config, monkeypatch),
                         hidden, routing_map, probs)
    ours_config = moe_config(moe_permute_fusion=False, moe_router_topk=2, moe_device_tokens_per_expert=True)
    dispatcher = cpu_dispatcher(dispatchers.PatchedAlltoAllTokenDispatcher, ours_config, monkeypatch)
    sorted_chunks = []
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "dispatch_postprocess", lambda *a: sorted_chunks.append(a))
    ours = run_alltoall(dispatcher, hidden, routing_map, probs)
    assert type(dispatcher.exchange) is NcclAllToAllOneSource and not sorted_chunks
    for name in ("x", "probs", "out", "counts"):
        assert torch.equal(stock[name], ours[name]), name
    assert dispatcher.cuda_sync_point != "before_finish"  # the counts' own sync is gone


def test_the_allgather_pipeline_is_megatron_cores(moe_config, monkeypatch):
    config = moe_config(moe_token_dispatcher_type="allgather", moe_permute_fusion=False, moe_router_topk=2)
    hidden = torch.randn(13, 1, 64)
    routing_map, probs = routing()
    results = []
    for cls in (MoEAllGatherTokenDispatcher, dispatchers.PatchedAllGatherTokenDispatcher):
        d = cpu_dispatcher(cls, config, monkeypatch)
        x, p = d.token_dispatch(*d.dispatch_preprocess(hidden.clone(), routing_map.clone(), probs.clone()))
        x, counts, p = d.dispatch_postprocess(x, p)
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(x * 2)))
        results.append((x, counts, p, out, d.local_map))
    assert type(d.permute_step) is PlainPermute
    for stock, ours in zip(*results):
        assert torch.equal(stock, ours) and stock.device == ours.device


def test_the_padded_step_sizes_the_allgather_counts_on_the_host(monkeypatch):
    """F1 on the allgather dispatcher: this rank's columns, TE's kernel, host counts."""
    seen = {}

    def fake_kernel(x, probs, routing_map, align):
        seen.update(probs=probs, routing_map=routing_map, align=align)
        return x, probs.sum(1), "row map", "offsets", torch.tensor([16, 32])

    monkeypatch.setattr(permute_pad, "permute_and_pad", fake_kernel)
    routing_map, probs = routing(experts=4)
    out = PaddedPermute(16).permute_local(torch.ones(13, 2), probs, routing_map, slice(2, 4))
    assert torch.equal(seen["routing_map"], routing_map[:, 2:4]) and torch.equal(seen["probs"], probs[:, 2:4])
    assert seen["align"] == 16 and out.routing_map is seen["routing_map"]
    assert out.tokens_per_expert.tolist() == [16, 32] and out.pad_offsets == "offsets"
    # The alltoall dispatcher keeps the kernel's counts where they are (it has its own).
    assert PaddedPermute(16).permute(torch.ones(13, 2), probs, routing_map).routing_map is routing_map
