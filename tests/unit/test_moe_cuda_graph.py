"""F11 on CPU: which configs may graph their dropless MoE layers (cuda_graph_scope=moe), the
refusals by name, and the allgather dispatcher's device counts (wiring, with a stand-in
permute). Capture and replay are proven on the GPU (tests/gpu/test_moe_cuda_graph.py)."""

import types

import pytest
import torch
from megatron.core.transformer.enums import CudaGraphScope
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.moe_patches import dispatchers
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.moe_cuda_graph import graph_blocker, scope_names

BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    ffn_hidden_size=64, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
    moe_permute_fusion=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
    moe_device_tokens_per_expert=True, cuda_graph_impl="local", cuda_graph_scope="moe",
)


@pytest.fixture(autouse=True)
def fused_permute_kernels(monkeypatch):
    """megatron-core checks at construction that TE's fused permute kernels exist; there is no
    TE on a CPU machine, so stand-ins answer that check (nothing here calls them)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)


def config(**overrides):
    return PatchedTransformerConfig(**{**BASE, **overrides})


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_sync_free_dropless_moe_may_be_graphed(impl, dispatcher):
    c = config(cuda_graph_impl=impl, moe_token_dispatcher_type=dispatcher)
    assert graph_blocker(c) is None
    assert c.cuda_graph_impl == impl and c.cuda_graph_scope == [CudaGraphScope.moe]


def test_stock_megatron_core_refuses_the_same_config():
    stock = {k: v for k, v in BASE.items() if k != "moe_device_tokens_per_expert"}
    with pytest.raises(AssertionError, match="drop-padding"):
        TransformerConfig(**stock)


REFUSALS = [
    (dict(moe_device_tokens_per_expert=False), "set --moe-device-tokens-per-expert"),
    (dict(expert_model_parallel_size=2), "--expert-model-parallel-size 2"),
    (dict(moe_token_dispatcher_type="flex"), "the flex dispatcher"),
    (dict(moe_permute_fusion=False), "set --moe-permute-fusion"),
    (dict(moe_input_jitter_eps=0.01), "--moe-input-jitter-eps"),
    (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True), "--moe-shared-expert-overlap"),
    (dict(activation_func=torch.nn.functional.gelu, gated_linear_unit=False),
     "the te expert backend takes host token counts"),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), "recompute of the MoE layer"),
]


@pytest.mark.parametrize("overrides, reason", REFUSALS, ids=[r for _, r in REFUSALS])
def test_refused_by_name(overrides, reason):
    with pytest.raises(ValueError) as exc:
        config(**overrides)
    message = str(exc.value)
    assert "cuda_graph_scope=moe for dropless MoE" in message and reason in message, message
    assert "drop moe from --cuda-graph-scope" in message


def test_ep2_graphs_need_the_symmetric_exchange_and_its_runtime(monkeypatch):
    import megatron.moe_patches.moe_cuda_graph as moe_cuda_graph

    without = config(cuda_graph_impl="none", expert_model_parallel_size=2)
    assert "add --moe-symmetric-exchange" in graph_blocker(without)
    monkeypatch.setattr(moe_cuda_graph, "exchange_blocker", lambda c, ep: "no CUDA device" if ep == 2 else "?")
    exchange = config(cuda_graph_impl="none", expert_model_parallel_size=2, moe_symmetric_exchange=True)
    assert graph_blocker(exchange) == ("--expert-model-parallel-size 2: the symmetric exchange cannot run "
                                       "here (no CUDA device)")
    monkeypatch.setattr(moe_cuda_graph, "exchange_blocker", lambda c, ep: None)
    assert graph_blocker(exchange) is None
    graphed = config(expert_model_parallel_size=2, moe_symmetric_exchange=True)
    assert graphed.cuda_graph_scope == [CudaGraphScope.moe]


def test_other_scopes_and_drop_and_pad_stay_megatron_cores():
    # moe_router: megatron-core's own partial capture, accepted for dropless MoE as before
    c = config(cuda_graph_scope="moe_router", moe_device_tokens_per_expert=False)
    assert CudaGraphScope.moe_router in c.cuda_graph_scope
    # no graphs asked: the graph rule is not consulted
    config(cuda_graph_impl="none", moe_device_tokens_per_expert=False)
    # megatron-core's own checks still run for the scopes it owns
    with pytest.raises(AssertionError, match="both moe and moe_router"):
        config(cuda_graph_scope="moe_router,moe", moe_device_tokens_per_expert=False,
               moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def test_a_replay_lets_the_backend_refresh_its_weight_copies_first():
    """Wiring: the host work a graph leaves (FP8 weight copies after an optimizer step) runs
    before the forward graph replays, on the same stream (the replay reads its result)."""
    from megatron.moe_patches.moe_cuda_graph import _Replay

    calls = []
    captured = types.SimpleNamespace(
        before_replay=lambda: calls.append("refresh"),
        fwd_graph=types.SimpleNamespace(replay=lambda: calls.append("replay")),
        static_x=torch.zeros(2, 3), static_out=torch.ones(2, 3))
    out = _Replay.apply(captured, torch.full((2, 3), 5.0), torch.zeros(1, requires_grad=True))
    assert calls == ["refresh", "replay"] and torch.equal(captured.static_x, torch.full((2, 3), 5.0))
    assert torch.equal(out, torch.ones(2, 3))


def test_scope_names():
    assert scope_names("moe,attn") == ["moe", "attn"]
    assert scope_names([CudaGraphScope.moe, "attn"]) == ["moe", "attn"]
    assert scope_names(CudaGraphScope.moe_router) == ["moe_router"]
    assert scope_names(None) == []


@pytest.mark.parametrize("overrides, ep, tp, expected", [
    (dict(), 1, 1, True),
    (dict(), 2, 1, False),  # other ranks' tokens: the local row count depends on routing
    (dict(), 1, 2, False),
    (dict(moe_device_tokens_per_expert=False), 1, 1, False),
    (dict(moe_permute_fusion=False), 1, 1, False),
])
def test_allgather_keeps_counts_on_device_where_rows_are_known(overrides, ep, tp, expected):
    c = config(cuda_graph_impl="none", **overrides)
    assert dispatchers.allgather_keeps_counts_on_device(c, ep, tp) is expected


def test_allgather_device_counts_wiring(monkeypatch):
    """The permutation is sized tokens x top-k and carries the probs; the counts are the
    routing map's column sums, not a host copy."""
    calls = {}

    def fake_permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False):
        calls.update(num_out_tokens=num_out_tokens, fused=fused, probs=probs)
        return tokens.repeat(2, 1), probs.T[routing_map.T], torch.zeros(1)

    monkeypatch.setattr(dispatchers, "permute", fake_permute)
    dispatcher = object.__new__(dispatchers.PatchedAllGatherTokenDispatcher)
    dispatcher.config = config(moe_token_dispatcher_type="allgather")
    routing = torch.zeros(5, 8, dtype=torch.bool)
    for token, experts in enumerate([(0, 3), (3, 7), (0, 1), (1, 3), (6, 7)]):
        routing[token, list(experts)] = True
    probs = torch.rand(5, 8) * routing
    dispatcher.routing_map = routing
    _, counts, permuted_probs = dispatcher._permute_with_device_counts(torch.randn(5, 64), probs)
    assert calls["num_out_tokens"] == 10 and calls["fused"] and calls["probs"] is probs
    assert counts.tolist() == [2, 2, 0, 3, 0, 0, 1, 2] and counts.dtype == torch.long
    assert torch.equal(permuted_probs, probs.T[routing.T])
    assert dispatcher.routing_map is None and dispatcher.local_map is routing


# --- pretrain_gpt.py ------------------------------------------------------------------------

TINY = ["--yaml-cfg", "tiny-moe", "--train-iters", "5", "--lr-decay-iters", "100"]


def test_driver_accepts_moe_graphs_on_the_sync_free_path(parsed, one_rank):
    args = parsed([*TINY, "--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "moe",
                   "--cuda-graph-warmup-steps", "2"])
    assert (args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_warmup_steps) == ("local", ["moe"], 2)


@pytest.mark.parametrize("extra, expected", [
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe"], "set --moe-device-tokens-per-expert"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"],
     "captures the moe scope only"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "transformer_engine"], "captures the moe scope only"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-scope", "moe"], "--cuda-graph-scope needs --cuda-graph-impl"),
])
def test_driver_refuses_graphs_it_cannot_run(refused, one_rank, extra, expected):
    assert expected in refused([*TINY, *extra])


# --- when a graphed layer replays (wiring; the replay itself is proven on the GPU) -------------


class _EagerLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        return ("eager", hidden_states.shape), None


def test_graphed_forward_replays_only_the_captured_call(monkeypatch):
    from megatron.moe_patches import moe_cuda_graph

    replays = []
    monkeypatch.setattr(moe_cuda_graph._Replay, "apply",
                        staticmethod(lambda captured, x, *params: replays.append(len(params)) or "replayed"))
    layer = _EagerLayer()
    captured = types.SimpleNamespace(params=[layer.weight], replays=0)
    layer.forward = moe_cuda_graph._graphed_forward(layer, captured, (8, 2, 4), torch.bfloat16)
    x = torch.zeros(8, 2, 4, dtype=torch.bfloat16)

    assert layer(x) == ("replayed", None) and replays == [1]
    assert layer(x, padding_mask=None, intermediate_tensors=None) == ("replayed", None)
    assert layer(x, padding_mask=torch.ones(2, 8, dtype=torch.bool))[0][0] == "eager"  # masked tokens
    assert layer(x, None, None) == ("replayed", None)
    assert layer(torch.zeros(4, 2, 4, dtype=torch.bfloat16))[0][0] == "eager"  # another shape
    assert layer(x.float())[0][0] == "eager"  # another dtype
    with torch.no_grad():
        assert layer(x)[0][0] == "eager"  # no backward to replay
    layer.eval()
    assert layer(x)[0][0] == "eager"
    assert len(replays) == 3 and captured.replays == 3  # what the driver checks after a step
    del layer.forward  # what uninstall() does: the class's forward again
    layer.train()
    assert layer(x)[0][0] == "eager"


def test_capture_refuses_a_layer_the_table_refuses_before_any_gpu_work():
    from megatron.moe_patches.moe_cuda_graph import MoELayerGraphs

    layer = _EagerLayer()
    layer.config = config(cuda_graph_impl="none", moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="cannot capture this MoE layer: the flex dispatcher"):
        MoELayerGraphs([layer], torch.zeros(8, 2, 4))
