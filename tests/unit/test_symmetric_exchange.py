"""F12 on the CPU: the routing tables of the symmetric exchange against a row-by-row
reference, the config rules, and the fallback to NCCL. The kernels and the EP=2 numerics
run on the GPU (tests/gpu/test_symmetric_exchange.py)."""

import bisect
import dataclasses
import logging
import types

import pytest
import torch

from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.dispatch.symmetric_exchange import ExchangePlan, owner_rows_bound
from megatron.moe_patches.plan import exchange_config_errors


def _random_counts(ep, local, seed, empty_rank=None):
    generator = torch.Generator().manual_seed(seed)
    counts_SE = torch.randint(0, 5, (ep, ep * local), generator=generator)
    counts_SE[:, 0] = 0  # an expert nobody sends to
    if empty_rank is not None:  # a rank whose experts receive nothing
        counts_SE[:, empty_rank * local:(empty_rank + 1) * local] = 0
    return counts_SE


def _send(chunks, rows):
    """Row-by-row: where each of the sender's first ``rows`` rows goes, as the push kernel
    must place it, in the sender's row order; rows in no chunk are not sent."""
    ends = chunks.ends_C.tolist()
    placed = {}
    for c, end in enumerate(ends):
        start = ends[c - 1] if c else 0
        for i in range(end - start):
            row = int(chunks.src_C[c]) + i
            assert row not in placed, "a row sent twice"
            placed[row] = (int(chunks.peer_C[c]), int(chunks.dest_C[c]) + i)
    return [placed[row] for row in sorted(placed) if row < rows]


def _peer_order(chunks):
    """The peers in the order the sender's chunks reach them (each peer once)."""
    sizes = torch.diff(chunks.ends_C, prepend=chunks.ends_C.new_zeros(1)).tolist()
    order = []
    for peer, size in zip(chunks.peer_C.tolist(), sizes):
        if size and peer not in order:
            order.append(peer)
    return order


@pytest.mark.parametrize("ep,local,empty_rank", [(2, 3, None), (2, 1, 1), (3, 2, 0), (4, 5, 2)])
def test_rows_land_grouped_by_local_expert_and_come_back(ep, local, empty_rank):
    counts_SE = _random_counts(ep, local, seed=ep * 10 + local, empty_rank=empty_rank)
    plans = [ExchangePlan(counts_SE, rank, int(counts_SE[rank].sum()), 10**6) for rank in range(ep)]
    # Sender s's rows, sorted by global expert, labelled (s, g, i).
    sent = {s: [(s, g, i) for g in range(ep * local) for i in range(int(counts_SE[s, g]))] for s in range(ep)}
    received = {p: {} for p in range(ep)}
    for s in range(ep):
        for label, (peer, dest) in zip(sent[s], _send(plans[s].to_owners, len(sent[s]))):
            assert dest not in received[peer], "two rows stored at one place"
            received[peer][dest] = label
    for p in range(ep):
        # Expert-major: local expert e, then source s, then the sender's order.
        expected = [(s, p * local + e, i) for e in range(local) for s in range(ep)
                    for i in range(int(counts_SE[s, p * local + e]))]
        assert [received[p][row] for row in range(len(received[p]))] == expected
        assert plans[p].tokens_per_local_expert.tolist() == [
            int(counts_SE[:, p * local + e].sum()) for e in range(local)]
    # Combine: each owner row returns to the row its sender sent it from.
    returned = {s: {} for s in range(ep)}
    for p in range(ep):
        rows = [received[p][row] for row in range(len(received[p]))]
        for label, (peer, dest) in zip(rows, _send(plans[p].to_sources, len(rows))):
            assert peer == label[0]
            returned[peer][dest] = label
    for s in range(ep):
        assert [returned[s][row] for row in range(len(sent[s]))] == sent[s]
    # The kernel walks the tables as flat int64 arrays.
    for plan in plans:
        for table in (*plan.to_owners, *plan.to_sources):
            assert table.is_contiguous() and table.dtype == torch.int64


@pytest.mark.parametrize("ep,rank", [(2, 0), (2, 1), (4, 3)])
def test_counts_go_to_every_peer_at_the_senders_row(ep, rank):
    from megatron.moe_patches.dispatch.symmetric_exchange import SymmetricExchange

    group = types.SimpleNamespace(rank=lambda: rank, size=lambda: ep, group_name="ep")
    route = SymmetricExchange(group, topk=2)._count_chunks(torch.device("cpu"))
    # copy p of this rank's counts row -> peer p, row `rank` of its [ep, experts] buffer
    assert _send(route, ep) == [(p, rank) for p in range(ep)]


def test_rows_past_the_last_chunk_stay_home():
    counts_SE = torch.tensor([[1, 2], [0, 1]])
    plan = ExchangePlan(counts_SE, 0, 3, 10)
    assert len(_send(plan.to_owners, 10)) == 3  # the kernel sends only the chunks' rows


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_senders_start_on_different_owners(ep):
    """Rows go peer by peer from the next rank on, this rank's own last: at any point of the
    stores each owner takes one sender's rows, both ways (rows sorted by owner would send
    every sender's first rows to owner 0)."""
    counts_SE = torch.randint(1, 4, (ep, ep * 3), generator=torch.Generator().manual_seed(ep))
    plans = [ExchangePlan(counts_SE, rank, int(counts_SE[rank].sum()), 10**6) for rank in range(ep)]
    for rank, plan in enumerate(plans):
        for chunks in (plan.to_owners, plan.to_sources):
            assert _peer_order(chunks) == [(rank + k) % ep for k in range(1, ep + 1)]


def test_owner_bound_covers_every_token_choosing_this_rank():
    assert owner_rows_bound(ep=2, tokens=8, topk=8, local_experts=64) == 2 * 8 * 8
    assert owner_rows_bound(ep=2, tokens=8, topk=8, local_experts=4) == 2 * 8 * 4  # <= 4 distinct experts here


def _config(**overrides):
    from megatron.moe_patches.testing.layer_harness import SHAPES, moe_config_kwargs

    kwargs = moe_config_kwargs(SHAPES["qwen3-30b-a3b"], moe_device_tokens_per_expert=True,
                               moe_symmetric_exchange=True)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("overrides,names", [
    ({}, []),
    ({"moe_token_dispatcher_type": "allgather"}, ["moe_token_dispatcher_type='alltoall'"]),
    ({"moe_device_tokens_per_expert": False}, ["--moe-device-tokens-per-expert"]),
    ({"moe_expert_capacity_factor": 1.0}, ["moe_expert_capacity_factor"]),
    ({"moe_permute_fusion": False}, ["--moe-permute-fusion"]),
    ({"overlap_moe_expert_parallel_comm": True}, ["--overlap-moe-expert-parallel-comm"]),
    ({"expert_tensor_parallel_size": 2}, ["expert_tensor_parallel_size=1"]),
    ({"moe_router_padding_for_quantization": True}, ["unset moe_router_padding_for_quantization"]),
    ({"moe_pad_expert_input_to_capacity": True}, ["moe_pad_expert_input_to_capacity"]),
    ({"expert_tensor_parallel_size": 2, "moe_router_padding_for_quantization": True},
     ["expert_tensor_parallel_size=1", "unset moe_router_padding_for_quantization"]),  # every contradiction listed
    ({"moe_symmetric_exchange": False, "moe_token_dispatcher_type": "allgather"}, []),  # the flag off: no rule
])
def test_config_rules_name_the_flag_and_the_fix(overrides, names):
    defaults = dict(expert_tensor_parallel_size=1, moe_expert_capacity_factor=None,
                    moe_pad_expert_input_to_capacity=False, moe_router_padding_for_quantization=False,
                    overlap_moe_expert_parallel_comm=False)
    config = types.SimpleNamespace(**{**defaults, **_config(), **overrides})
    errors = exchange_config_errors(config)
    assert len(errors) == len(names)
    for error, name in zip(errors, names):
        assert "--moe-symmetric-exchange" in error and name in error


def test_patched_config_refuses_a_contradiction_before_any_gpu_work(moe_config):
    with pytest.raises(ValueError, match="moe_symmetric_exchange.*alltoall"):
        moe_config(moe_token_dispatcher_type="allgather", moe_device_tokens_per_expert=True,
                   moe_symmetric_exchange=True)
    with pytest.raises(ValueError, match="moe_symmetric_exchange=True applies to MoE layers only"):
        moe_config(num_moe_experts=None, moe_ffn_hidden_size=None, moe_grouped_gemm=False,
                   moe_symmetric_exchange=True)


def test_without_the_gpu_the_exchange_stays_nccl_and_says_why(moe_config, caplog):
    config = moe_config(moe_device_tokens_per_expert=True)
    config.moe_symmetric_exchange, config.expert_model_parallel_size = True, 2
    with caplog.at_level(logging.WARNING, logger=moe_plan.__name__):
        plan = moe_plan.plan_for(config)
        plan.log_choices()
    assert plan.exchange.name == moe_plan.ALLTOALL
    if not torch.cuda.is_available():
        assert plan.exchange.reason == "no CUDA device"
        assert "no CUDA device" in caplog.text and "NCCL" in caplog.text
    config.moe_symmetric_exchange = False
    assert moe_plan.plan_for(config).exchange == dataclasses.replace(plan.exchange, reason=None, contradictions=())


class _FakeExchange:
    """Records what the dispatcher hands the exchange (wiring only; the kernels are GPU-tested)."""

    def __init__(self):
        self.calls = []

    def plan(self, counts_E, tokens):
        self.calls.append(("plan", counts_E.tolist(), tokens))
        return types.SimpleNamespace(tokens_per_local_expert=torch.tensor([5, 7]))

    def dispatch(self, plan, x, probs):
        self.calls.append(("dispatch", plan, x.shape[0]))
        return x * 2, probs

    def combine(self, plan, y):
        self.calls.append(("combine", plan, y.shape[0]))
        return y + 1


def test_dispatcher_routes_through_the_exchange_and_never_asks_the_host(moe_config):
    from megatron.moe_patches.dispatch.dispatchers import PatchedAlltoAllTokenDispatcher, alltoall_permute_step
    from megatron.moe_patches.dispatch.exchanges import SymmetricMemoryAllToAll

    config = moe_config(moe_device_tokens_per_expert=True, moe_router_topk=2)
    dispatcher = object.__new__(PatchedAlltoAllTokenDispatcher)  # no __init__: it needs CUDA streams
    fake = _FakeExchange()
    dispatcher.config, dispatcher.exchange = config, SymmetricMemoryAllToAll(fake)
    dispatcher.shared_experts = None
    dispatcher.permute_step = alltoall_permute_step(config, moe_plan.plan_for(config).exchange)
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    routing_map[torch.arange(6), torch.arange(6) % 8] = True
    routing_map[torch.arange(6), 7] = True

    tokens_per_expert = dispatcher.preprocess(routing_map)
    assert tokens_per_expert.tolist() == [5, 7] and dispatcher.num_out_tokens == 12
    assert fake.calls[0] == ("plan", routing_map.sum(0).tolist(), 6)
    # No split size is copied to the host at any sync point.
    for point in ("before_permutation_1", "before_ep_alltoall", "before_permutation_2", "before_finish"):
        assert dispatcher._maybe_dtoh_and_synchronize(point, tokens_per_expert) is tokens_per_expert

    plan = dispatcher.exchange_plan
    x, probs = torch.ones(12, 4), torch.full((12,), 0.5)
    received, received_probs = dispatcher.token_dispatch(x, probs)
    assert torch.equal(received, x * 2) and fake.calls[1] == ("dispatch", plan, 12)
    dispatcher.tokens_per_expert = tokens_per_expert
    out, counts, out_probs = dispatcher.dispatch_postprocess(received, received_probs)
    assert out is received and counts is tokens_per_expert and out_probs is received_probs  # no chunk sort
    assert dispatcher.combine_preprocess(out) is out
    assert torch.equal(dispatcher.token_combine(out), out + 1)
    assert fake.calls[2] == ("combine", plan, 12)


def test_pretrain_names_the_exchange_the_moe_layers_run(monkeypatch):
    from megatron.moe_patches.graphs import moe_layer_graphs as moe_cuda_graph
    from megatron.moe_patches.dispatch.exchanges import NcclAllToAll, SymmetricMemoryAllToAll
    from megatron.moe_patches.driver.training import describe_moe_layers

    def layer(exchange, ep_size):
        dispatcher = types.SimpleNamespace(exchange=exchange, ep_size=ep_size)
        return types.SimpleNamespace(experts=types.SimpleNamespace(backend=types.SimpleNamespace(name="grouped_mm")),
                                     token_dispatcher=dispatcher)

    for layers, expected in (
        ([layer(SymmetricMemoryAllToAll(object()), 2)] * 2,
         "2 MoE layers | experts: grouped_mm | EP 2 exchange: symmetric memory"),
        ([layer(NcclAllToAll(), 2)], "EP 2 exchange: SimpleNamespace's own"),
        ([layer(None, 2)], "EP 2 exchange: SimpleNamespace's own"),  # a stock dispatcher
        ([layer(None, 1)], "EP 1 exchange: none (EP 1)"),
        ([], ""),
    ):
        monkeypatch.setattr(moe_cuda_graph, "moe_layers", lambda gpt, layers=layers: layers)
        assert expected in describe_moe_layers(None) if expected else describe_moe_layers(None) == ""


def test_every_layer_of_a_group_shares_one_buffer_per_direction_and_shape(monkeypatch):
    """One buffer set per EP group, not per MoE layer (a 48-layer model would hold 48)."""
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    allocated = []

    def allocate(group_name, shape, dtype, device):
        allocated.append((group_name, shape, dtype))
        return sx._Peers(torch.empty(shape, dtype=dtype), None, None)

    monkeypatch.setattr(sx, "_BUFFERS", {})
    monkeypatch.setattr(sx, "_allocate", allocate)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ep = types.SimpleNamespace(group_name="ep")
    layers = [sx.SymmetricExchange(ep, topk=2) for _ in range(3)]
    x = torch.empty(10, 4, dtype=torch.bfloat16)
    first = [layer._peers("owners", 40, x) for layer in layers]
    assert all(p is first[0] for p in first) and allocated == [("ep", (40, 4), torch.bfloat16)]
    layers[0]._peers("sources", 10, x)  # the other direction
    layers[1]._peers("owners", 40, torch.empty(10))  # the probs
    sx.SymmetricExchange(types.SimpleNamespace(group_name="other"), topk=2)._peers("owners", 40, x)
    assert len(allocated) == 4


def test_a_new_buffer_is_zeroed_before_the_peers_can_map_it(monkeypatch):
    """torch zeroes a symmetric block (its barrier signal pad included) with a memset the host
    does not wait for; the device must be drained before the rendezvous exposes the block,
    or a peer's first signal can be overwritten and its barrier never ends."""
    import sys

    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    calls = []
    fake = types.ModuleType("torch.distributed._symmetric_memory")
    fake.empty = lambda shape, dtype, device: calls.append("empty") or torch.zeros(shape, dtype=dtype)
    fake.enable_symm_mem_for_group = lambda name: calls.append("register")
    fake.rendezvous = lambda tensor, name: calls.append("rendezvous") or types.SimpleNamespace(buffer_ptrs=[1, 2])
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    peers = sx._allocate("ep", (4, 2), torch.bfloat16, torch.device("cpu"))
    assert calls.index("empty") < calls.index("synchronize") < calls.index("rendezvous"), calls
    assert peers.bases.tolist() == [1, 2]


def _zero_from(b, used):  # the tail-zeroing kernels' math, out of place
    inside = (torch.arange(b.shape[0]) < used).view(-1, *[1] * (b.dim() - 1))
    return torch.where(inside, b, torch.zeros((), dtype=b.dtype))


def test_only_the_dispatched_rows_are_copied_out_of_their_buffer(monkeypatch):
    """The experts save the dispatched tokens for the backward: a copy (tail zeroed). The
    output gradients and the other direction hand out the buffer itself (read once, before
    this direction's next exchange), the owners' tail zeroed in place."""
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    handle = types.SimpleNamespace(barrier=lambda channel=0: None)
    buffers = {}

    def peers(direction, rows, like):  # ep = 1: this rank is every row's destination
        local = buffers.setdefault(direction, torch.full((rows, *like.shape[1:]), 7, dtype=like.dtype))
        return sx._Peers(local, local, handle)  # "bases": the buffer itself, for the stand-in push

    def push(x_RC, chunks, buffer):
        for row, (_, dest) in enumerate(_send(chunks, x_RC.shape[0])):
            buffer[dest] = x_RC[row]

    exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: 0, size=lambda: 1, group_name="ep"), topk=1)
    monkeypatch.setattr(exchange, "_peers", peers)
    monkeypatch.setattr(sx, "push_rows", push)
    monkeypatch.setattr(sx, "copy_rows_zero_tail", _zero_from)
    monkeypatch.setattr(sx, "zero_rows_from", lambda b, used: b.copy_(_zero_from(b, used)))
    plan = ExchangePlan(torch.tensor([[2, 1]]), 0, rows_sent=3, rows_bound=5)
    x = torch.arange(6.0).view(3, 2)
    (owners,) = exchange.send_to_owners(plan, x, keep=True)
    assert owners.data_ptr() != buffers["owners"].data_ptr() and torch.equal(owners[:3], x) and not owners[3:].any()
    (sources,) = exchange.send_to_sources(plan, owners)
    assert sources.data_ptr() == buffers["sources"].data_ptr() and torch.equal(sources, x)
    buffers["owners"].fill_(7)  # what an earlier exchange left
    (grads,) = exchange.send_to_owners(plan, x * 2, keep=False)
    assert grads.data_ptr() == buffers["owners"].data_ptr() and torch.equal(grads[:3], x * 2) and not grads[3:].any()


def test_two_ranks_two_layers_forward_and_backward_through_shared_buffers(monkeypatch):
    """The host-side protocol with 2 ranks in threads: counts, rows and gradients through the
    buffers every layer shares (a barrier per buffer, as torch's signal pads pair them), the
    returned rows handed out uncopied. Stores and copies are stand-ins for the kernels (their
    placement is the row-by-row reference above); results against the same math without
    any exchange."""
    import threading

    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    ep, local, topk, tokens = 2, 2, 2, 5
    experts = ep * local
    buffers, barriers, lock = {}, {}, threading.Lock()

    def peers_of(rank):
        def peers(direction, rows, like):
            key = (direction, rows, tuple(like.shape[1:]), like.dtype)
            with lock:
                if key not in buffers:
                    buffers[key] = [torch.full((rows, *like.shape[1:]), float("nan")).to(like.dtype)
                                    for _ in range(ep)]
                    barriers[key] = threading.Barrier(ep, timeout=20)
            handle = types.SimpleNamespace(barrier=lambda channel=0: barriers[key].wait())
            return sx._Peers(buffers[key][rank], buffers[key], handle)
        return peers

    def push(x_RC, chunks, peer_buffers):
        for row, (peer, dest) in enumerate(_send(chunks, x_RC.shape[0])):
            peer_buffers[peer][dest] = x_RC[row]

    monkeypatch.setattr(sx, "push_rows", push)
    monkeypatch.setattr(sx, "copy_rows_zero_tail", _zero_from)
    monkeypatch.setattr(sx, "zero_rows_from", lambda b, used: b.copy_(_zero_from(b, used)))
    generator = torch.Generator().manual_seed(3)
    inputs = []
    for rank in range(ep):  # each token picks top-k distinct experts; rows sorted by expert
        picks = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)])
        expert_R = picks.flatten().sort().values
        x_RH = torch.randn(tokens * topk, 3, generator=generator, dtype=torch.float64)
        probs_R = torch.rand(tokens * topk, generator=generator, dtype=torch.float64)
        inputs.append((expert_R, x_RH, probs_R))

    def scale_of(expert_R):  # the "experts": owner-side rows times (local expert index + 2)
        return (expert_R % local + 2).to(torch.float64)

    results, errors = {}, []

    def run(rank):
        try:
            exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: rank, size=lambda: ep,
                                                                  group_name="ep"), topk=topk)
            exchange._peers = peers_of(rank)
            expert_R, x0, p0 = inputs[rank]
            x_RH, probs_R = x0.clone().requires_grad_(), p0.clone().requires_grad_()
            counts_E = torch.bincount(expert_R, minlength=experts)
            h = x_RH
            for _ in range(2):  # two layers: the same buffers, one after the other
                plan = exchange.plan(counts_E, tokens)
                x_BH, p_B = exchange.dispatch(plan, h, probs_R)
                ends = torch.cumsum(plan.tokens_per_local_expert, 0)
                local_B = torch.searchsorted(ends, torch.arange(x_BH.shape[0]), right=True).clamp(max=local - 1)
                y_BH = x_BH * (local_B + 2).to(x_BH.dtype)[:, None] * p_B[:, None]
                h = exchange.combine(plan, y_BH) * 1.0  # the unpermute: reads the handed-out rows once
            (h * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
            results[rank] = (h.detach(), x_RH.grad, probs_R.grad)
        except Exception as error:  # noqa: BLE001 - reported below, with the other rank released
            errors.append(error)
            for barrier in barriers.values():
                barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for rank in range(ep):
        expert_R, x0, p0 = inputs[rank]
        x_RH, probs_R = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        s = scale_of(expert_R)[:, None]
        expected = x_RH * s * probs_R[:, None] * s * probs_R[:, None]
        (expected * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
        out, dx, dp = results[rank]
        torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(dx, x_RH.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(dp, probs_R.grad, rtol=0, atol=1e-12)


# --- which process can run the exchange (the plan's exchange), one rule at a time ---------------


@pytest.fixture
def fused_permute_kernels(monkeypatch):
    """megatron-core checks at config construction that TE's fused permute kernels exist; stand-ins
    answer that check on a machine without TE (nothing here calls them)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)


@pytest.fixture
def hopper_node(monkeypatch, fused_permute_kernels):
    """What the plan asks of the machine, answered as a Hopper node with Triton would."""
    from megatron.moe_patches import capabilities

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(capabilities, "triton_available", lambda: True)
    monkeypatch.setattr(capabilities, "te_fused_permute_pad", lambda: True)


def _exchange_config(**fields):
    """A config the exchange's config rules accept (bf16 grouped_mm experts), ``fields`` set after
    construction (megatron-core's own checks of FP8 need TE)."""
    from megatron.moe_patches.config import PatchedTransformerConfig

    config = PatchedTransformerConfig(**_config(expert_model_parallel_size=2))
    for name, value in fields.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("fields, reason", [
    ({}, None),
    ({"fp8": "e4m3", "fp8_recipe": "tensorwise"}, None),  # the FP8 experts take device counts too
    ({"expert_model_parallel_size": 1}, "expert parallelism is 1"),
    ({"moe_apply_probs_on_input": True}, "the experts run the te backend, which needs host split sizes"),
    ({"fp8": "e4m3", "fp8_recipe": "delayed"}, "the dispatcher pads each expert's rows for quantization (F1)"),
], ids=["bf16", "fp8 tensorwise", "EP 1", "TE experts", "F1 pads"])
def test_the_plans_exchange_table(hopper_node, fields, reason):
    exchange = moe_plan.plan_for(_exchange_config(**fields)).exchange
    assert exchange.reason is None if reason is None else reason in (exchange.reason or ""), exchange.reason
    assert (exchange.name == moe_plan.SYMMETRIC_MEMORY) == (reason is None)
    ep1 = fields.get("expert_model_parallel_size") == 1  # one source rank: nothing to sort either
    assert exchange.device_counts and exchange.skips_chunk_sort == (reason is None or ep1)


def test_the_exchange_rule_asks_the_machine(hopper_node, monkeypatch):
    import importlib.util

    from megatron.moe_patches import capabilities

    def reason():  # a fresh config each time: a plan is made once per config
        return moe_plan.plan_for(_exchange_config()).exchange.reason

    assert reason() is None
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch.distributed._symmetric_memory" else real_find_spec(name, *a))
    assert reason() == f"torch {torch.__version__} has no symmetric memory"
    monkeypatch.setattr(capabilities, "triton_available", lambda: False)
    assert reason() == "Triton is not installed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reason() == "no CUDA device"


def _stub_stock_alltoall(monkeypatch, ep_size=2, tp_size=1):
    """megatron-core's own __init__ needs CUDA streams: a stand-in that sets what ours reads."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def stock_init(self, *args, **kwargs):
        self.config, self.ep_group, self.ep_size, self.tp_size = kwargs["config"], "ep-group", ep_size, tp_size

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "__init__", stock_init)


def test_the_dispatcher_gets_the_exchange_only_where_it_can_run(hopper_node, monkeypatch, caplog):
    from megatron.moe_patches import fields
    from megatron.moe_patches.dispatch import dispatchers
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    _stub_stock_alltoall(monkeypatch)
    monkeypatch.setattr(fields, "_said", set())
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        exchange = dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config()).exchange.symmetric
        assert isinstance(exchange, sx.SymmetricExchange) and exchange.group == "ep-group" and exchange.topk == 8
        off = _exchange_config(moe_symmetric_exchange=False)
        assert not hasattr(dispatchers.PatchedAlltoAllTokenDispatcher(config=off).exchange, "symmetric")
        monkeypatch.setattr(moe_plan, "symmetric_exchange_blocker", lambda c, backend, padding: "Triton is not installed")
        assert not hasattr(dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config()).exchange, "symmetric")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["moe_symmetric_exchange: the expert-parallel exchange stays NCCL's all-to-all because "
                        "Triton is not installed"]
    assert "moe_symmetric_exchange: EP=2 tokens go through symmetric memory" in caplog.text


def test_a_dispatcher_whose_groups_differ_from_the_config_is_refused(hopper_node, monkeypatch):
    """The plan is made from the config's parallel sizes: groups of other sizes would follow
    options made for another layout (e.g. skip a chunk sort that EP 2 needs)."""
    from megatron.moe_patches.dispatch import dispatchers

    _stub_stock_alltoall(monkeypatch, ep_size=4)
    with pytest.raises(ValueError, match="EP 4 and expert TP 1, but the config says expert_model_parallel_size=2"):
        dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config())


def test_the_flag_at_ep1_is_said_to_exchange_nothing_and_its_rules_still_hold(monkeypatch, caplog,
                                                                              fused_permute_kernels):
    """EP 1 has nothing to exchange. The flag is accepted there (one recipe serves EP 1 and EP 2,
    and --use-checkpoint-args restores it from an EP 2 checkpoint into an EP 1 run) and says so;
    the config rules it brings hold at EP 1 too, so it never accepts what EP 2 would refuse."""
    from megatron.moe_patches import fields
    from megatron.moe_patches.config import PatchedTransformerConfig

    monkeypatch.setattr(fields, "_said", set())
    monkeypatch.setattr(moe_plan, "symmetric_exchange_blocker",
                        lambda c, backend, padding: pytest.fail("EP 1 asks no runtime question"))
    config = PatchedTransformerConfig(**_config())
    assert config.expert_model_parallel_size == 1
    with caplog.at_level(logging.INFO, logger=moe_plan.__name__):
        assert moe_plan.plan_for(config).exchange.name == moe_plan.ALLTOALL
        moe_plan.plan_for(config).log_choices()
        moe_plan.plan_for(config).log_choices()
    said = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in said] == [moe_plan.EP1_NOTHING_TO_EXCHANGE]  # once per process
    assert "--moe-symmetric-exchange" in said[0].getMessage() and "EP > 1" in said[0].getMessage()
    with pytest.raises(ValueError, match="moe_symmetric_exchange.*alltoall"):
        PatchedTransformerConfig(**_config(moe_token_dispatcher_type="allgather"))


def test_the_dispatcher_skips_the_chunk_sort_behind_the_exchange(hopper_node, monkeypatch):
    """The exchange lands rows grouped by local expert: at EP 2 the dispatcher skips the chunk
    sort when (and because) it has an exchange; without one it sorts as megatron-core does."""
    from megatron.moe_patches.dispatch import dispatchers

    _stub_stock_alltoall(monkeypatch)
    asked = []
    exchange = object()
    from megatron.moe_patches.dispatch import exchanges

    monkeypatch.setattr(exchanges, "SymmetricExchange", lambda group, topk: asked.append((group, topk)) or exchange)
    dispatcher = dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config())
    assert dispatcher.exchange.symmetric is exchange and asked == [("ep-group", 8)]
    assert dispatcher.exchange.lands_grouped_by_local_expert
    monkeypatch.setattr(moe_plan, "symmetric_exchange_blocker", lambda c, backend, padding: "no CUDA device")
    assert not dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config()).exchange.lands_grouped_by_local_expert


def test_a_plan_is_sized_from_tokens_times_topk(monkeypatch):
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: 1, size=lambda: 2, group_name="ep"), topk=3)
    counts_SE = torch.tensor([[1, 2, 0, 3], [2, 0, 2, 2]])
    monkeypatch.setattr(exchange, "gather_counts", lambda counts_E: counts_SE)
    plan = exchange.plan(counts_SE[1], tokens=2)
    assert plan.rows_sent == 6  # the sender's rows: tokens x top-k
    assert plan.rows_bound == sx.owner_rows_bound(2, 2, 3, 2) == 8
    assert plan.tokens_per_local_expert.tolist() == [0 + 2, 3 + 2]


def test_the_owners_tail_starts_after_the_rows_received_not_the_rows_sent(monkeypatch):
    """Rank 0 sends 3 rows and receives 5: the tail zeroing keeps all 5 received rows."""
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    counts_SE = torch.tensor([[1, 2], [4, 0]])  # rank 0 sends 3 rows, receives 1 + 4 = 5
    plan = ExchangePlan(counts_SE, 0, rows_sent=3, rows_bound=8)
    assert int(plan.to_owners.ends_C[-1]) == 3 and int(plan.to_sources.ends_C[-1]) == 5
    exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: 0, size=lambda: 2, group_name="ep"), topk=1)
    buffer = torch.full((8, 2), 7.0)
    monkeypatch.setattr(exchange, "_send", lambda chunks, rows, direction, tensors: [buffer.clone() for _ in tensors])
    monkeypatch.setattr(sx, "copy_rows_zero_tail", _zero_from)
    monkeypatch.setattr(sx, "zero_rows_from", lambda b, used: b.copy_(_zero_from(b, used)))
    for keep in (True, False):
        (owners,) = exchange.send_to_owners(plan, torch.ones(3, 2), keep=keep)
        assert owners[:5].eq(7).all() and not owners[5:].any(), (keep, owners)


@pytest.mark.parametrize("graphs", [[], ["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe"]],
                         ids=["eager", "graphed"])
def test_a_recipe_with_the_fused_permute_takes_the_exchange_at_ep2_without_te(parsed, monkeypatch, graphs):
    """On a machine without Transformer Engine (this one) megatron-core cannot check
    moe_permute_fusion; the exchange's rule that needs it must still read the recipe's value
    (the qwen3 proxy recipe sets it), not refuse with "set moe_permute_fusion=True"."""
    from megatron.moe_patches import capabilities

    if capabilities.te_version() is not None:
        pytest.skip("this checks the path without Transformer Engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(capabilities, "triton_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    args = parsed(["--yaml-cfg", "qwen3-30b-a3b-proxy", "--expert-model-parallel-size", "2",
                   "--moe-symmetric-exchange", "--train-iters", "10", "--lr-warmup-iters", "1", *graphs])
    assert args.moe_symmetric_exchange and args.moe_permute_fusion and args.expert_model_parallel_size == 2
