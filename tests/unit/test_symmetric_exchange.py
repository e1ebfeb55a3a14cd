"""F12 on the CPU: the owners' row layout against a token-by-token reference, the config
rules, the fallback to NCCL, and the exchange's protocol with ranks in threads (torch
stand-ins for the store kernel). The kernels and the EP=2/EP=4 numerics run on the GPU
(tests/gpu/test_symmetric_exchange.py)."""

import dataclasses
import logging
import types

import pytest
import torch

from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.dispatch.symmetric_exchange import OwnerRows, TokenRoutes, owner_rows_bound
from megatron.moe_patches.plan import exchange_config_errors
from megatron.moe_patches.plan import exchange as plan_exchange


def _random_routing(ep, local, tokens, topk, seed, allowed=None):
    """[ep ranks] of [tokens, experts] routing maps (top-k distinct experts among ``allowed``)
    and probs."""
    generator = torch.Generator().manual_seed(seed)
    experts = ep * local
    allowed = torch.tensor(allowed if allowed is not None else range(experts))
    maps, probs = [], []
    for _ in range(ep):
        routing = torch.zeros(tokens, experts, dtype=torch.bool)
        for t in range(tokens):
            routing[t, allowed[torch.randperm(len(allowed), generator=generator)[:topk]]] = True
        maps.append(routing)
        probs.append(torch.rand(tokens, experts, generator=generator) * routing)
    return maps, probs


def _metadata_at(owner, routes, probs):
    """What ``owner`` receives: slot s * tokens + t = source s's metadata row for it."""
    tokens = routes[0].tokens
    return torch.cat([r.metadata(p)[owner * tokens:(owner + 1) * tokens] for r, p in zip(routes, probs)])


@pytest.mark.parametrize("ep,local,tokens,topk,allowed", [
    (2, 3, 5, 2, None), (2, 1, 4, 2, None), (3, 2, 6, 3, None), (4, 5, 7, 4, None),
    (4, 2, 6, 2, [0, 1, 2, 3]),  # ranks 2 and 3 receive nothing
    (8, 2, 5, 4, None),
    (2, 4, 5, 3, [1, 2, 3, 5, 6]),  # experts nobody picks
])
def test_owners_lay_tokens_out_expert_major_as_megatron_core_sorts_them(ep, local, tokens, topk, allowed):
    """Owner p's expert rows: local expert e, then source rank s, then token order (the order
    megatron-core's permute and chunk sort give), each row a copy of its token."""
    maps, probs = _random_routing(ep, local, tokens, topk, seed=ep * 10 + local, allowed=allowed)
    routes = [TokenRoutes(m, ep, topk) for m in maps]
    for p in range(ep):
        owner = routes[p].receive_metadata(_metadata_at(p, routes, probs))
        expected = [(s, t, e) for e in range(local) for s in range(ep) for t in range(tokens)
                    if maps[s][t, p * local + e]]
        bound = routes[p].rows_bound
        assert bound == owner_rows_bound(ep, tokens, topk, local)
        assert owner.slot_B1.flatten().tolist() == [s * tokens + t for s, t, _ in expected] + [-1] * (bound - len(expected))
        assert owner.probs_B.tolist() == pytest.approx(
            [float(probs[s][t, p * local + e]) for s, t, e in expected] + [0.0] * (bound - len(expected)))
        assert owner.tokens_per_local_expert.tolist() == [sum(1 for x in expected if x[2] == e) for e in range(local)]
        for row, (s, t, e) in enumerate(expected):  # every slot knows its rows, by local expert
            assert int(owner.rows_SL[s * tokens + t, e]) == row
            assert row in owner.rows_SK[s * tokens + t].tolist()
        for slot in range(ep * tokens):
            rows = [r for r in owner.rows_SK[slot].tolist() if r >= 0]
            assert rows == sorted(rows) == sorted(r for r in owner.rows_SL[slot].tolist() if r >= 0)
            assert owner.rows_SK[slot].tolist()[len(rows):] == [-1] * (owner.rows_SK.shape[1] - len(rows))


def test_senders_address_each_owner_once_per_token():
    """Token t goes to rank p (slot p * tokens + t) iff it picked one of p's experts, and comes
    back from there; a token that picks two experts of one rank is sent once."""
    routing = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)  # 2 ranks x 2 experts
    routes = TokenRoutes(routing, ep=2, topk=2)
    assert routes.to_owners_X1.flatten().tolist() == [0, 1, -1, -1, 1, 2]
    assert routes.from_owners_TP.tolist() == [[0, -1], [1, 4], [-1, 5]]
    meta = routes.metadata(torch.tensor([[0.5, 0.25, 0, 0], [0, 0.75, 0.125, 0], [0, 0, 0, 1.0]]))
    assert meta[1].tolist() == [0, 0.75, 0, 1]  # token 1 for rank 0: probs of experts 0, 1, then picks
    assert meta[5].tolist() == [0, 1.0, 0, 1]  # token 2 for rank 1


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
    ({"moe_permute_fusion": False}, []),  # tokens go unpermuted: the fused permute is not needed
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

    def routes(self, routing_map):
        self.calls.append(("routes", routing_map.shape))
        return types.SimpleNamespace(owner=None)

    def dispatch(self, routes, x, probs):
        self.calls.append(("dispatch", routes, tuple(x.shape), tuple(probs.shape)))
        routes.owner = types.SimpleNamespace(tokens_per_local_expert=torch.tensor([5, 7]))
        return x * 2, probs[:, 0]

    def combine(self, routes, y):
        self.calls.append(("combine", routes, y.shape[0]))
        return y + 1


def test_dispatcher_sends_tokens_unpermuted_and_never_asks_the_host(moe_config):
    """Behind the exchange the dispatcher hands it the tokens and [tokens, experts] probs as
    they are (each owner lays out its experts' rows), takes the experts' counts from the
    dispatch, and returns the combine's one row per token without an unpermute."""
    from megatron.moe_patches.dispatch.dispatchers import PatchedAlltoAllTokenDispatcher, alltoall_permute_step
    from megatron.moe_patches.dispatch.exchanges import SymmetricMemoryAllToAll
    from megatron.moe_patches.dispatch.permute_pad import TokenRows

    config = moe_config(moe_device_tokens_per_expert=True, moe_router_topk=2)
    dispatcher = object.__new__(PatchedAlltoAllTokenDispatcher)  # no __init__: it needs CUDA streams
    fake = _FakeExchange()
    dispatcher.config, dispatcher.exchange = config, SymmetricMemoryAllToAll(fake)
    dispatcher.shared_experts = None
    dispatcher.permute_step = alltoall_permute_step(
        config, dataclasses.replace(moe_plan.plan_for(config).exchange, name=moe_plan.SYMMETRIC_MEMORY))
    assert isinstance(dispatcher.permute_step, TokenRows)
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    routing_map[torch.arange(6), torch.arange(6) % 8] = True
    routing_map[torch.arange(6), 7] = True
    x_TH, probs_TE = torch.randn(6, 4), torch.rand(6, 8)

    x_RH, probs_R = dispatcher.dispatch_preprocess(x_TH.view(6, 1, 4), routing_map, probs_TE)
    assert fake.calls[0] == ("routes", routing_map.shape) and dispatcher.num_out_tokens == 12
    assert torch.equal(x_RH, x_TH) and probs_R is probs_TE  # no permute
    # No split size is copied to the host at any sync point.
    for point in ("before_permutation_1", "before_ep_alltoall", "before_permutation_2", "before_finish"):
        assert dispatcher._maybe_dtoh_and_synchronize(point, None) is None

    routes = dispatcher.exchange.routes
    received, received_probs = dispatcher.token_dispatch(x_RH, probs_R)
    assert torch.equal(received, x_TH * 2) and fake.calls[1] == ("dispatch", routes, (6, 4), (6, 8))
    out, counts, out_probs = dispatcher.dispatch_postprocess(received, received_probs)
    assert out is received and counts.tolist() == [5, 7] and out_probs is received_probs  # no chunk sort
    assert dispatcher.combine_preprocess(out) is out
    combined = dispatcher.token_combine(out)
    assert torch.equal(combined, out + 1) and fake.calls[2] == ("combine", routes, 6)
    assert torch.equal(dispatcher.combine_postprocess(combined), (x_TH * 2 + 1).view(6, 1, 4))  # no unpermute


def test_pretrain_names_the_exchange_the_moe_layers_run(monkeypatch):
    from megatron.moe_patches.graphs import layer_graphs as moe_cuda_graph
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


def _stand_in_kernels(monkeypatch, sx):
    """torch versions of the store kernel's two uses (the GPU tests hold the kernel to them):
    ``bases`` is the list of every rank's buffer here."""

    def push_slots(src, index_XK, bases, *, rank, ep, tokens):
        for slot, rows in enumerate(index_XK.tolist()):
            rows = [r for r in rows if r >= 0]
            if rows:
                peer, t = divmod(slot, tokens)
                bases[peer][rank * tokens + t] = src[rows].sum(dim=0)

    def sum_rows(src, index_TK, out, zero_empty=False):
        for t, rows in enumerate(index_TK.tolist()):
            rows = [r for r in rows if r >= 0]
            if rows:
                out[t] = src[rows].sum(dim=0)
            elif zero_empty:
                out[t] = 0

    monkeypatch.setattr(sx, "push_slots", push_slots)
    monkeypatch.setattr(sx, "sum_rows", sum_rows)


@pytest.mark.parametrize("zero_tail", [True, False], ids=["zero-tail", "unwritten-tail"])
@pytest.mark.parametrize("ep", [2, 3, 8])
def test_ranks_in_threads_two_layers_forward_and_backward_through_shared_buffers(monkeypatch, ep, zero_tail):
    """The host-side protocol with ranks in threads: metadata, tokens and gradients through
    the buffers every layer shares (a barrier per exchange, as torch's signal pads pair
    them), against the same math without any exchange. The buffers start as NaN (what an
    earlier exchange may have left): nothing stale reaches a result. The experts' tail rows
    are zero with ``zero_tail``; else never written (new tensors are filled with NaN here,
    and the results still hold)."""
    import threading

    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty fills NaN

    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    local, topk, tokens = 2, 3, 5
    experts = ep * local
    buffers, barriers, lock = {}, {}, threading.Lock()

    def peers_of(rank):
        def peers(direction, rows, like):
            key = (direction, rows, tuple(like.shape[1:]), like.dtype)
            with lock:
                if key not in buffers:
                    buffers[key] = [torch.full((rows, *like.shape[1:]), float("nan"), dtype=like.dtype)
                                    for _ in range(ep)]
                    barriers[key] = threading.Barrier(ep, timeout=20)
            handle = types.SimpleNamespace(barrier=lambda channel=0: barriers[key].wait())
            return sx._Peers(buffers[key][rank], buffers[key], handle)
        return peers

    _stand_in_kernels(monkeypatch, sx)
    maps, probs = _random_routing(ep, local, tokens, topk, seed=3 + ep)
    inputs = [torch.randn(tokens, 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
              for r in range(ep)]
    scale_E = torch.arange(experts, dtype=torch.float64) % local + 2  # expert e: rows times (e % local + 2)
    results, errors, tails = {}, [], []

    def run(rank):
        try:
            exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: rank, size=lambda: ep,
                                                                  group_name="ep"), topk=topk, zero_tail=zero_tail)
            exchange._peers = peers_of(rank)
            x_TH = inputs[rank].clone().requires_grad_()
            probs_TE = probs[rank].double().requires_grad_()
            h = x_TH
            for _ in range(2):  # two layers: the same buffers, one after the other
                routes = exchange.routes(maps[rank])
                x_BH, p_B = exchange.dispatch(routes, h, probs_TE)
                ends = torch.cumsum(routes.owner.tokens_per_local_expert, 0)
                used = int(ends[-1])
                tails.append(bool((x_BH[used:].eq(0).all() if zero_tail else x_BH[used:].isnan().all())
                                  and p_B[used:].eq(0).all()))
                local_B = torch.searchsorted(ends, torch.arange(x_BH.shape[0]), right=True).clamp(max=local - 1)
                y_BH = x_BH * (local_B + 2).to(x_BH.dtype)[:, None] * p_B[:, None]
                h = exchange.combine(routes, y_BH)
            (h * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
            results[rank] = (h.detach(), x_TH.grad, probs_TE.grad)
        except Exception as error:  # noqa: BLE001 - reported below, with the other ranks released
            errors.append(error)
            for barrier in barriers.values():
                barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    torch.use_deterministic_algorithms(deterministic)
    assert not errors, errors
    assert tails and all(tails)
    for rank in range(ep):
        x_TH = inputs[rank].clone().requires_grad_()
        probs_TE = probs[rank].double().requires_grad_()
        weights_T = (probs_TE * maps[rank] * scale_E).sum(dim=1, keepdim=True)  # one layer: x * sum_e p_e s_e
        expected = x_TH * weights_T * weights_T
        (expected * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
        out, dx, dp = results[rank]
        torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, x_TH.grad, rtol=1e-12, atol=1e-12)
        # The probs and their gradients travel as fp32 (the router's dtype): rounded once.
        torch.testing.assert_close(dp * maps[rank], probs_TE.grad * maps[rank], rtol=2**-23, atol=0)
        assert not dp[~maps[rank]].any()  # no gradient for experts a token did not pick


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


@pytest.mark.parametrize("fields, zero_tail", [
    ({}, False),  # grouped_mm: its GEMMs stop at the last offset, its GLU reads the tail as zero
    ({"add_bias_linear": True}, True),  # the biases' gradients sum every row
    ({"fp8": "e4m3", "fp8_recipe": "tensorwise"}, True),  # the quantization passes read every row
], ids=["bf16", "biases", "fp8"])
def test_the_owners_tail_is_zeroed_only_for_experts_that_read_it(hopper_node, fields, zero_tail):
    plan = moe_plan.plan_for(_exchange_config(**fields))
    assert plan.exchange.reason is None
    assert plan.exchange.zero_tail is zero_tail, plan.backend.name


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
        monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", lambda c, backend, padding: "Triton is not installed")
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
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker",
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


def test_the_dispatcher_skips_permute_and_chunk_sort_behind_the_exchange(hopper_node, monkeypatch):
    """The exchange sends tokens and lays rows out by local expert: at EP 2 the dispatcher
    neither permutes nor sorts chunks when (and because) it has an exchange; without one it
    permutes and sorts as megatron-core does."""
    from megatron.moe_patches.dispatch import dispatchers

    _stub_stock_alltoall(monkeypatch)
    asked = []
    exchange = object()
    from megatron.moe_patches.dispatch import exchanges

    monkeypatch.setattr(exchanges, "SymmetricExchange",
                        lambda group, topk, zero_tail: asked.append((group, topk, zero_tail)) or exchange)
    from megatron.moe_patches.dispatch.permute_pad import PlainPermute, TokenRows

    dispatcher = dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config())
    # grouped_mm experts without biases never read the rows past their groups: left unwritten
    assert dispatcher.exchange.symmetric is exchange and asked == [("ep-group", 8, False)]
    assert dispatcher.exchange.lands_grouped_by_local_expert and isinstance(dispatcher.permute_step, TokenRows)
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", lambda c, backend, padding: "no CUDA device")
    nccl = dispatchers.PatchedAlltoAllTokenDispatcher(config=_exchange_config())
    assert not nccl.exchange.lands_grouped_by_local_expert and isinstance(nccl.permute_step, PlainPermute)


def test_routes_are_sized_from_tokens_and_topk():
    from megatron.moe_patches.dispatch import symmetric_exchange as sx

    exchange = sx.SymmetricExchange(types.SimpleNamespace(rank=lambda: 1, size=lambda: 2, group_name="ep"), topk=3)
    routes = exchange.routes(torch.zeros(4, 6, dtype=torch.bool))
    assert (routes.tokens, routes.local, routes.rows_bound) == (4, 3, owner_rows_bound(2, 4, 3, 3)) == (4, 3, 24)
    assert routes.to_owners_X1.shape == (8, 1) and routes.from_owners_TP.shape == (4, 2)


def test_an_owner_that_receives_more_rows_than_it_sends_keeps_them_all():
    """Rank 0 keeps 1 of its 4 tokens and receives all 4 of rank 1's: 5 expert rows before
    the tail (slot -1: nothing copied there)."""
    maps = [torch.tensor([[1, 0], [0, 1], [0, 1], [0, 1]], dtype=torch.bool),
            torch.tensor([[1, 0]] * 4, dtype=torch.bool)]
    routes = [TokenRoutes(m, ep=2, topk=1) for m in maps]
    owner = routes[0].receive_metadata(_metadata_at(0, routes, [m.float() for m in maps]))
    assert owner.tokens_per_local_expert.tolist() == [5]
    assert owner.slot_B1.flatten().tolist() == [0, 4, 5, 6, 7, -1, -1, -1]
    assert owner.probs_B.tolist() == [1.0] * 5 + [0.0] * 3


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
    monkeypatch.setenv("RANK", "0")  # rank 0 of the torchrun job
    args = parsed(["--yaml-cfg", "qwen3-30b-a3b-proxy", "--expert-model-parallel-size", "2",
                   "--moe-symmetric-exchange", "--train-iters", "10", "--lr-warmup-iters", "1", *graphs])
    assert args.moe_symmetric_exchange and args.moe_permute_fusion and args.expert_model_parallel_size == 2
