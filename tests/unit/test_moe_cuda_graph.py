"""F11 on CPU: which configs may graph their dropless MoE layers (cuda_graph_scope=moe), the
refusals by name, and the allgather dispatcher's device counts (wiring, with a stand-in
permute). Capture and replay are proven on the GPU (tests/gpu/test_moe_cuda_graph.py)."""

import types

import pytest
import torch
from megatron.core.transformer.enums import CudaGraphScope
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.dispatch import dispatchers, permute_pad
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.plan import exchange as plan_exchange
from megatron.moe_patches.plan import scope_names

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


def graph_blocker(c):
    return moe_plan.plan_for(c).graph_blocker


def allgather_keeps_counts_on_device(c, ep, expert_tp):
    c.expert_model_parallel_size, c.expert_tensor_parallel_size = ep, expert_tp  # set late: the plan alone decides
    return moe_plan.plan_for(c).exchange.device_counts


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
    (dict(moe_router_force_load_balancing=True), "--moe-router-force-load-balancing"),
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
    without = config(cuda_graph_impl="none", expert_model_parallel_size=2)
    assert "add --moe-symmetric-exchange" in graph_blocker(without)
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker",
                        lambda c, backend, padding: "no CUDA device" if c.expert_model_parallel_size == 2 else "?")
    exchange = dict(cuda_graph_impl="none", expert_model_parallel_size=2, moe_symmetric_exchange=True)
    assert graph_blocker(config(**exchange)) == ("--expert-model-parallel-size 2: the symmetric exchange cannot "
                                                 "run here (no CUDA device)")
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", lambda c, backend, padding: None)
    assert graph_blocker(config(**exchange)) is None
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


def test_a_replay_lets_the_backend_refresh_its_weight_copies_first(monkeypatch):
    """Wiring: the host work a graph leaves (FP8 weight copies after an optimizer step) runs
    before the forward graph replays, on the same stream (the replay reads its result), and
    the call's inputs (hidden states, keyword tensors of a whole layer) are copied in first."""
    from megatron.moe_patches.graphs.layer_graphs import _Captured, _Replay

    calls = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: calls.append("replay")))
    backend = types.SimpleNamespace(refresh_weight_caches=lambda: calls.append("refresh"))
    layer = torch.nn.Module()
    layer.config = types.SimpleNamespace(fp8=None)
    layer.experts = torch.nn.Module()
    layer.experts.backend = backend
    captured = _Captured(layer, torch.zeros(2, 3), {"rotary_pos_emb": torch.zeros(4)})
    captured.static_out = torch.ones(2, 3)
    out = _Replay.apply(captured, torch.full((2, 3), 5.0), {"rotary_pos_emb": torch.arange(4.0)},
                        torch.zeros(1, requires_grad=True))
    assert calls == ["refresh", "replay"] and torch.equal(captured.static_x, torch.full((2, 3), 5.0))
    assert torch.equal(captured.static_kwargs["rotary_pos_emb"], torch.arange(4.0))
    assert torch.equal(out, torch.ones(2, 3))


def _layer_with_te_linears(fp8):
    """A whole layer's stand-in: an attention linear and the FP8 experts' own linear, both with
    megatron-core's TE-layer attribute (False: quantize at a step's first micro-batch only)."""
    layer = torch.nn.Module()
    layer.config = types.SimpleNamespace(fp8=fp8)
    layer.linear_qkv = torch.nn.Linear(2, 2)
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.backend = types.SimpleNamespace(refresh_weight_caches=lambda: None)
    layer.mlp.experts.linear_fc1 = torch.nn.Linear(2, 2)
    layer.norm = torch.nn.LayerNorm(2)  # no such attribute: not a TE linear
    for linear in (layer.linear_qkv, layer.mlp.experts.linear_fc1):
        linear.disable_parameter_transpose_cache = False
    return layer


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_a_captured_fp8_layer_quantizes_te_weights_in_every_replay_and_uninstall_restores(monkeypatch, fp8):
    """Under FP8 the TE linears of a captured layer quantize their weights at every call (inside
    the graph: no stale step's copy replayed), the experts keep their own refreshed cache, and
    uninstall gives the linears their caching back; without FP8 nothing changes."""
    from megatron.moe_patches.graphs.layer_graphs import LayerGraphs, _Captured

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace())
    layer = _layer_with_te_linears(fp8)
    captured = _Captured(layer, torch.zeros(2, 3), {})
    assert layer.linear_qkv.disable_parameter_transpose_cache is bool(fp8)
    assert layer.mlp.experts.linear_fc1.disable_parameter_transpose_cache is False
    assert captured.te_fp8_linears == ([layer.linear_qkv] if fp8 else [])
    graphs = LayerGraphs.__new__(LayerGraphs)  # the capture itself needs CUDA
    graphs.layers, graphs.captured = [layer], [captured]
    graphs.uninstall()
    assert layer.linear_qkv.disable_parameter_transpose_cache is False


def test_scope_names():
    assert scope_names("moe,attn") == ["moe", "attn"]
    assert scope_names([CudaGraphScope.moe, "attn"]) == ["moe", "attn"]
    assert scope_names(CudaGraphScope.moe_router) == ["moe_router"]
    assert scope_names(None) == []


@pytest.mark.parametrize("impl, scope, experts, expected", [
    ("local", "moe", 8, "MOE_LAYER"),
    ("transformer_engine", None, 8, "WHOLE_LAYER"),
    ("local", "attn,moe", 8, "WHOLE_LAYER"),
    ("local", "moe,mlp", 8, "MOE_LAYER"),  # refused by name by the config's rules
    ("local", "full_iteration", 8, "FULL_ITERATION"),
    ("local", "full_iteration", None, "FULL_ITERATION"),
    ("transformer_engine", "full_iteration", 8, "NONE"),  # megatron-core's whole-iteration graph is local
    ("local", "attn", 8, "NONE"),
    ("local", None, None, "NONE"),  # dense layers: megatron-core's own graphs
    ("none", "moe", 8, "NONE"),
])
def test_graph_scope_reads_configs_and_loop_args_alike(impl, scope, experts, expected):
    """The one definition of the scope: a loop's args name the experts num_experts."""
    import argparse

    from megatron.moe_patches.graph_scopes import GraphScope, graph_scope

    names = scope.split(",") if scope else []
    args = argparse.Namespace(cuda_graph_impl=impl, cuda_graph_scope=names, num_experts=experts,
                              moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)
    assert graph_scope(args) is GraphScope[expected]
    if experts is not None and scope != "moe,mlp" and (impl, scope) != ("transformer_engine", "full_iteration"):
        c = config(cuda_graph_impl=impl, cuda_graph_scope=scope or [], attention_dropout=0.0, hidden_dropout=0.0)
        assert moe_plan.plan_for(c).graph_scope is GraphScope[expected]


def test_drop_and_pad_is_megatron_cores_own_graph():
    import argparse

    from megatron.moe_patches.graph_scopes import GraphScope, graph_scope

    args = argparse.Namespace(cuda_graph_impl="local", cuda_graph_scope=["moe"], num_experts=8,
                              moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert graph_scope(args) is GraphScope.NONE


@pytest.mark.parametrize("traits, named", [
    (dict(host_nan_check=True), "--no-check-for-nan-in-loss-and-grad"),
    (dict(batch_rampup=True), "--rampup-batch-size"),
    (dict(timing_level=2), "--timing-log-level 0"),
    (dict(spiky_loss_check=True), "drop --check-for-spiky-loss"),
    (dict(), None),
])
def test_both_loops_judge_their_traits_by_one_rule(traits, named, monkeypatch):
    """Each loop's adapter reads its own traits from its args; the preflight judges them by one rule."""
    import argparse

    from megatron.moe_patches import megatron_lm
    from megatron.moe_patches.driver.arguments import driver_traits
    from megatron.moe_patches.graph_scopes import LoopTraits, full_iteration_loop_refusal

    said = full_iteration_loop_refusal(LoopTraits(**traits))
    assert (said is None) if named is None else (named in said)
    driver = argparse.Namespace(check_for_nan_in_loss_and_grad=traits.get("host_nan_check", False),
                                rampup_batch_size=[2, 2, 40] if traits.get("batch_rampup") else None)
    megatron = argparse.Namespace(timing_log_level=traits.get("timing_level", 0),
                                  check_for_spiky_loss=traits.get("spiky_loss_check", False))
    monkeypatch.setattr(megatron_lm, "_config_class_and_kwargs", lambda args: None)  # the traits alone
    loops = {"driver": (driver_traits(driver), {"host_nan_check", "batch_rampup"}),
             "megatron_lm": (megatron_lm.megatron_lm_request(megatron).loop, {"timing_level", "spiky_loss_check"})}
    for loop, its_traits in loops.values():
        assert whole_iteration_refusals(loop) == ((said,) if set(traits) & its_traits else ())


def whole_iteration_refusals(loop):
    """The preflight's refusals of a whole-iteration graph in a loop of these traits."""
    from megatron.moe_patches.preflight import PreflightRequest, judge

    whole_iteration = dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
    return judge(PreflightRequest(config_class=None, config_kwargs=whole_iteration, loop=loop)).refusals


@pytest.mark.parametrize("overrides, ep, tp, expected", [
    (dict(), 1, 1, True),
    (dict(), 2, 1, False),  # other ranks' tokens: the local row count depends on routing
    (dict(), 1, 2, False),
    (dict(moe_device_tokens_per_expert=False), 1, 1, False),
    (dict(moe_permute_fusion=False), 1, 1, False),
])
def test_allgather_keeps_counts_on_device_where_rows_are_known(overrides, ep, tp, expected):
    c = config(cuda_graph_impl="none", moe_token_dispatcher_type="allgather", **overrides)
    assert allgather_keeps_counts_on_device(c, ep, tp) is expected


def test_allgather_device_counts_wiring(monkeypatch):
    """The permutation is sized tokens x top-k and carries the probs; the counts are the
    routing map's column sums, not a host copy."""
    calls = {}

    def fake_permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        calls.update(num_out_tokens=num_out_tokens, fused=fused, probs=probs, drop_and_pad=drop_and_pad)
        return tokens.repeat(2, 1), probs.T[routing_map.T], torch.zeros(1)

    monkeypatch.setattr(permute_pad, "permute", fake_permute)
    c = config(moe_token_dispatcher_type="allgather")
    dispatcher = object.__new__(dispatchers.PatchedAllGatherTokenDispatcher)
    dispatcher.permute_step = dispatchers.allgather_permute_step(c, moe_plan.plan_for(c).exchange)
    dispatcher.local_experts = slice(0, 8)
    routing = torch.zeros(5, 8, dtype=torch.bool)
    for token, experts in enumerate([(0, 3), (3, 7), (0, 1), (1, 3), (6, 7)]):
        routing[token, list(experts)] = True
    probs = torch.rand(5, 8) * routing
    dispatcher.routing_map = routing
    _, counts, permuted_probs = dispatcher.dispatch_postprocess(torch.randn(5, 64), probs)
    assert calls["num_out_tokens"] == 10 and calls["fused"] and calls["probs"] is probs
    assert not calls["drop_and_pad"]
    assert counts.tolist() == [2, 2, 0, 3, 0, 0, 1, 2] and counts.dtype == torch.long
    assert torch.equal(permuted_probs, probs.T[routing.T])
    assert dispatcher.routing_map is None and dispatcher.local_map is routing


# --- pretrain_gpt.py ------------------------------------------------------------------------

TINY = ["--yaml-cfg", "tiny-moe-stock", "--train-iters", "5", "--lr-decay-iters", "100"]


def test_driver_accepts_moe_graphs_on_the_sync_free_path(parsed, one_rank):
    args = parsed([*TINY, "--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "moe",
                   "--cuda-graph-warmup-steps", "2"])
    assert (args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_warmup_steps) == ("local", ["moe"], 2)


@pytest.mark.parametrize("scope", [[], ["attn", "moe"], ["full_iteration", "--no-check-for-nan-in-loss-and-grad"]])
def test_driver_accepts_whole_layer_and_whole_iteration_graphs(parsed, one_rank, scope):
    args = parsed([*TINY, "--moe-device-tokens-per-expert", "--cuda-graph-impl", "local",
                   *(["--cuda-graph-scope", *scope] if scope else [])])
    assert [s for s in args.cuda_graph_scope] == [s for s in scope if not s.startswith("--")]


def test_driver_reads_the_old_full_scope_as_the_whole_layer(parsed, one_rank, capsys):
    args = parsed([*TINY, "--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full"])
    assert args.cuda_graph_scope == [] and "warning: --cuda-graph-scope full is deprecated" in capsys.readouterr().err


def test_driver_refuses_a_ramp_up_under_the_whole_iteration_graph():
    """(The rule asked directly: the tiny recipe counts its run in iterations.)"""
    import argparse

    from megatron.moe_patches.driver.arguments import driver_traits

    args = argparse.Namespace(check_for_nan_in_loss_and_grad=False, rampup_batch_size=[2, 2, 40])
    assert "fixed number of micro-batches" in whole_iteration_refusals(driver_traits(args))[0]
    args.rampup_batch_size = None
    assert whole_iteration_refusals(driver_traits(args)) == ()


@pytest.mark.parametrize("extra, expected", [
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full", "moe"],
     "full (the whole layer, megatron-core's old spelling) stands alone"),
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe"], "set --moe-device-tokens-per-expert"),
    (["--cuda-graph-impl", "local"], "set --moe-device-tokens-per-expert"),  # the whole layer holds the MoE layer
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"],
     "captures moe (each MoE layer), each transformer layer whole"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope",
      "full_iteration", "--no-check-for-nan-in-loss-and-grad"], "full_iteration needs --cuda-graph-impl local"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
     "needs --no-check-for-nan-in-loss-and-grad"),
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
     "full_iteration replays every micro-batch"),
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
    from megatron.moe_patches.graphs import layer_graphs as moe_cuda_graph

    replays = []
    monkeypatch.setattr(moe_cuda_graph._Replay, "apply",
                        staticmethod(lambda captured, x, kw, *params: replays.append(len(params)) or "replayed"))
    layer = _EagerLayer()
    x = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    captured = types.SimpleNamespace(params=[layer.weight], replays=0, signature=moe_cuda_graph.call_signature(x, {}))
    layer.forward = moe_cuda_graph._graphed_forward(layer, captured)

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
    from megatron.moe_patches.graphs.layer_graphs import LayerGraphs

    layer = _EagerLayer()
    layer.config = config(cuda_graph_impl="none", moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="cannot capture this MoE layer: the flex dispatcher"):
        LayerGraphs([layer], torch.zeros(8, 2, 4))


# --- the eligibility table, one rule at a time ------------------------------------------------
# Each row changes one field of a config that may be graphed and must get that row's refusal
# (and only a rule's own change may: the complements below must stay graphable). The fields are
# set after construction, so megatron-core's own checks of them (TE's kernels, FP8's recipe,
# parallel sizes) do not decide what graph_blocker is asked.


@pytest.fixture
def graphable(monkeypatch):
    """A config graph_blocker accepts; ``graphable(**fields)`` is a copy with ``fields`` set."""
    import copy

    from megatron.moe_patches import capabilities

    monkeypatch.setattr(capabilities, "triton_available", lambda: True)  # the FP8 rows' backend
    base = config(cuda_graph_impl="none")
    assert graph_blocker(base) is None

    def make(**fields):
        c = copy.copy(base)
        for name, value in fields.items():
            setattr(c, name, value)
        return c

    return make


FP8 = dict(fp8="e4m3", fp8_recipe="tensorwise")

RECOMPUTE = "recompute of the MoE layer (--recompute-granularity / --recompute-modules)"
GRAPH_TABLE = [  # the refusal, word for word: another row's reason must not pass for it
    ("no MoE", dict(num_moe_experts=None), "it has no MoE layer (num_moe_experts is not set)"),
    ("host counts", dict(moe_device_tokens_per_expert=False),
     "the MoE layer copies token counts to the host: set --moe-device-tokens-per-expert"),
    ("EP 2 over NCCL", dict(expert_model_parallel_size=2),
     "--expert-model-parallel-size 2: NCCL's all-to-all takes host split sizes; add --moe-symmetric-exchange (F12) "
     "or use EP 1"),
    ("TP 2", dict(tensor_model_parallel_size=2), "tensor parallelism > 1 (the dispatchers gather with host split sizes)"),
    ("expert TP 2", dict(expert_tensor_parallel_size=2),
     "tensor parallelism > 1 (the dispatchers gather with host split sizes)"),
    ("PP 2", dict(pipeline_model_parallel_size=2),
     "pipeline parallelism: micro-batches in flight would share the graph's static buffers"),
    ("flex dispatcher", dict(moe_token_dispatcher_type="flex"), "the flex dispatcher (graph-safe: alltoall, allgather)"),
    ("unfused permute", dict(moe_permute_fusion=False),
     "the unfused permute selects tokens with a host sync: set --moe-permute-fusion"),
    ("token dropping", dict(moe_expert_capacity_factor=1.0),
     "token dropping (--moe-expert-capacity-factor); megatron-core's own graphs cover drop-and-pad"),
    ("router padding", dict(moe_router_padding_for_quantization=True),
     "--moe-router-padding-for-quantization sizes the routing map on the host"),
    ("input jitter", dict(moe_input_jitter_eps=0.01), "--moe-input-jitter-eps draws random numbers inside the layer"),
    ("forced load balancing", dict(moe_router_force_load_balancing=True),
     "--moe-router-force-load-balancing draws random numbers inside the layer (random router logits)"),
    ("shared-expert overlap", dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True),
     "--moe-shared-expert-overlap runs the shared experts on a side stream"),
    ("FP8 shared experts", dict(moe_shared_expert_intermediate_size=64, **FP8),
     "shared experts under FP8 keep Transformer Engine's FP8 state, which this capture does not manage"),
    ("full recompute", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), RECOMPUTE),
    ("recompute moe", dict(recompute_granularity="selective", recompute_modules=["moe"]), RECOMPUTE),
    ("recompute moe_act", dict(recompute_granularity="selective", recompute_modules=["moe_act"]), RECOMPUTE),
    ("recompute shared experts", dict(recompute_granularity="selective", recompute_modules=["shared_experts"]),
     RECOMPUTE),
    ("CPU offloading", dict(cpu_offloading=True), "activation offloading"),
    ("fine-grained offloading", dict(fine_grained_activation_offloading=True), "activation offloading"),
    ("TE experts", dict(moe_apply_probs_on_input=True),
     "the te expert backend takes host token counts (fp8_grouped_mm: it computes FP8 only (bf16 runs the grouped_mm "
     "backend); grouped_mm: --moe-apply-probs-on-input)"),
]


@pytest.mark.parametrize("fields, reason", [row[1:] for row in GRAPH_TABLE], ids=[row[0] for row in GRAPH_TABLE])
def test_each_rule_of_the_graph_table_refuses_by_itself(graphable, fields, reason):
    assert graph_blocker(graphable(**fields)) == reason


GRAPHABLE_NEIGHBOURS = [
    # what a rule must not catch: the same field on the side that is safe
    ("shared experts in bf16", dict(moe_shared_expert_intermediate_size=64)),
    ("FP8 without shared experts", FP8),
    ("selective recompute of other modules", dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    ("allgather dispatcher", dict(moe_token_dispatcher_type="allgather")),
    ("EP 1, TP 1, PP 1 spelled out", dict(expert_model_parallel_size=1, tensor_model_parallel_size=1,
                                           pipeline_model_parallel_size=1, expert_tensor_parallel_size=1)),
    ("FP8 experts (fp8_grouped_mm)", dict(**FP8)),
]


def test_the_exchange_needs_no_fused_permute_for_graphs(graphable, monkeypatch):
    """F12 sends tokens unpermuted, so at EP 2 through it the unfused permute is no reason to
    refuse the graphs; over NCCL it still is."""
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", lambda c, backend, padding: None)  # a GPU node
    exchange = dict(expert_model_parallel_size=2, moe_symmetric_exchange=True, moe_permute_fusion=False)
    assert graph_blocker(graphable(**exchange)) is None
    assert "--moe-permute-fusion" in graph_blocker(graphable(moe_permute_fusion=False))


@pytest.mark.parametrize("fields", [row[1] for row in GRAPHABLE_NEIGHBOURS], ids=[row[0] for row in GRAPHABLE_NEIGHBOURS])
def test_the_graph_tables_neighbours_stay_graphable(graphable, fields):
    assert graph_blocker(graphable(**fields)) is None


def test_ep2_rows_of_the_graph_table_ask_the_exchange_with_the_ep_size(graphable, monkeypatch):
    asked = []

    def answer(reason):
        return lambda c, backend, padding: asked.append(c.expert_model_parallel_size) or reason

    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", answer("Triton is not installed"))
    ep4 = dict(expert_model_parallel_size=4, moe_symmetric_exchange=True)
    assert graph_blocker(graphable(**ep4)) == ("--expert-model-parallel-size 4: the symmetric exchange cannot run "
                                               "here (Triton is not installed)")
    monkeypatch.setattr(plan_exchange, "symmetric_exchange_blocker", answer(None))
    assert graph_blocker(graphable(**ep4)) is None
    # EP 2 with a runnable exchange still meets the rest of the table
    assert "tensor parallelism > 1" in graph_blocker(graphable(expert_model_parallel_size=2, moe_symmetric_exchange=True,
                                                               tensor_model_parallel_size=2))
    assert asked == [4, 4, 2]
    assert graph_blocker(graphable(moe_symmetric_exchange=True)) is None and asked == [4, 4, 2]  # EP 1: not asked


@pytest.mark.parametrize("fields, graphs", [
    (dict(), True),
    (dict(cuda_graph_impl="transformer_engine"), True),
    (dict(cuda_graph_impl="none"), False),
    (dict(cuda_graph_scope=["attn"]), False),
    (dict(cuda_graph_scope=[CudaGraphScope.moe_router]), False),
    (dict(cuda_graph_scope=["attn", "moe"]), True),
    (dict(num_moe_experts=None), False),
    (dict(moe_expert_capacity_factor=1.0), True),  # dropping without padding: dropless capture, refused by the table
    (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), False),  # megatron-core's own
    (dict(moe_pad_expert_input_to_capacity=True), True),
])
def test_which_configs_ask_for_dropless_moe_graphs(fields, graphs):
    import copy

    from megatron.moe_patches.plan import graph_scope

    c = copy.copy(config())
    for name, value in fields.items():
        setattr(c, name, value)
    assert graph_scope(c).by_layer is graphs


@pytest.mark.parametrize("overrides, reason", [
    (dict(tensor_model_parallel_size=2), "tensor parallelism > 1"),
    (dict(expert_tensor_parallel_size=2), "tensor parallelism > 1"),
    (dict(moe_expert_capacity_factor=1.0), "token dropping"),
    (dict(cpu_offloading=True, cpu_offloading_num_layers=0), "activation offloading"),
], ids=["TP 2", "expert TP 2", "token dropping", "CPU offloading"])
def test_the_patched_config_refuses_table_rows_at_construction(overrides, reason):
    with pytest.raises(ValueError) as exc:
        config(**overrides)
    assert "cuda_graph_scope=moe for dropless MoE" in str(exc.value) and reason in str(exc.value), str(exc.value)


@pytest.mark.parametrize("late", [
    dict(moe_expert_capacity_factor=1.0),  # dropping: the row count is the capacity's
    dict(moe_router_padding_for_quantization=True, fp8="e4m3"),  # the router pads the map on the host
    dict(fp8="e4m3", fp8_recipe="delayed"),  # F1 pads in the permute: padded counts
], ids=["token dropping", "router padding", "F1 padding"])
def test_allgather_keeps_host_counts_where_the_row_count_is_not_tokens_times_topk(late, monkeypatch):
    from megatron.moe_patches import capabilities

    monkeypatch.setattr(capabilities, "te_fused_permute_pad", lambda: True)
    c = config(cuda_graph_impl="none", moe_token_dispatcher_type="allgather")
    assert allgather_keeps_counts_on_device(c, 1, 1)
    for name, value in late.items():
        setattr(c, name, value)
    assert not allgather_keeps_counts_on_device(c, 1, 1)


def test_aliases_carry_what_fused_wgrad_modules_read_off_their_weights(monkeypatch):
    """TE's and megatron-core's linears hand back a placeholder gradient and set
    grad_added_to_main_grad only where the weight has that attribute; the aliases the capture
    differentiates must have it (and main_grad, zero_out_wgrad) as the parameters do, or those
    parameters get no gradient and DDP's overlapped reduction never counts them."""
    from megatron.moe_patches.graphs.layer_graphs import _Captured

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace())
    layer = torch.nn.Linear(4, 4)
    layer.config = types.SimpleNamespace(fp8=None)
    layer.weight.main_grad = torch.zeros(4, 4)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = True
    captured = _Captured(layer, torch.zeros(2, 4), {})
    captured.make_aliases()
    alias = dict(zip(captured.names, captured.aliases))["weight"]
    assert alias.main_grad is layer.weight.main_grad and alias.grad_added_to_main_grad is False
    assert alias.zero_out_wgrad is True
    assert not hasattr(dict(zip(captured.names, captured.aliases))["bias"], "grad_added_to_main_grad")
    assert captured.grads_taken_by_ddp == [True, False]  # weight, bias


def test_a_parameter_outside_ddp_keeps_its_own_gradient_across_replays(monkeypatch):
    """Each backward replay writes the graph's gradient buffers again: a parameter without
    Megatron DDP's main_grad must get a copy, or its accumulated .grad is overwritten (two
    micro-batches with gradients 1 and 5 summed to 10 instead of 6)."""
    from megatron.moe_patches.graphs.layer_graphs import _Replay

    weight = torch.nn.Parameter(torch.zeros(3))
    static_grad = torch.zeros(3)
    values = iter([1.0, 5.0])
    captured = types.SimpleNamespace(
        before_replay=lambda x, kw: None, fwd_graph=types.SimpleNamespace(replay=lambda: None),
        bwd_graph=types.SimpleNamespace(replay=lambda: static_grad.fill_(next(values))),
        static_out=torch.ones(2, 3), static_grad_out=torch.zeros(2, 3), static_grad_x=torch.zeros(2, 3),
        static_grad_params=(static_grad,), grads_taken_by_ddp=[False], into_main_grad=())
    for _ in range(2):
        x = torch.zeros(2, 3, requires_grad=True)
        _Replay.apply(captured, x, {}, weight).sum().backward()
    assert torch.equal(weight.grad, torch.full((3,), 6.0))


def test_a_keyword_tensor_that_needs_a_gradient_runs_the_layer_eagerly():
    from megatron.moe_patches.graphs.layer_graphs import graphable_kwargs

    rope = torch.zeros(4)
    assert graphable_kwargs((), {"rotary_pos_emb": rope, "attention_mask": None}) == {"rotary_pos_emb": rope}
    assert graphable_kwargs((), {"attention_bias": torch.zeros(4, requires_grad=True)}) is None


# --- full_iteration: each of its rules by itself (issue 57: two could go unnoticed) ----------

FULL_ITERATION = dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])


def full_iteration_blocker(c):
    return moe_plan.plan_for(c).full_iteration_blocker


def test_full_iteration_holds_the_fp8_experts_but_not_host_updated_fp8_scales(graphable):
    """The FP8 grouped_mm experts quantize their weights at a step's first micro-batch, inside
    the captured iteration (every replay refreshes them); delayed scaling's amax history is the
    host's, which a replay would not update."""
    c = graphable(**FULL_ITERATION, **FP8)
    assert moe_plan.plan_for(c).backend.name == "fp8_grouped_mm"
    assert full_iteration_blocker(c) is None
    c = graphable(**FULL_ITERATION, **dict(FP8, fp8_recipe="delayed"))
    assert full_iteration_blocker(c).startswith("the te expert backend takes host token counts (")
    assert full_iteration_blocker(graphable(**FULL_ITERATION)) is None


def test_full_iteration_refuses_experts_that_take_host_token_counts(graphable):
    """The TE experts copy the token counts to the host: the capture would fail after start-up."""
    c = graphable(**FULL_ITERATION, moe_apply_probs_on_input=True)
    assert full_iteration_blocker(c).startswith("the te expert backend takes host token counts (")


# --- a backward replay tells Megatron's DDP what the graph added into main_grad ----------------


class StandInDDP:
    """Megatron DDP's gradient hook on CPU, in its rule: a parameter's .grad is added into its
    main_grad unless the backward already added it there (grad_added_to_main_grad set, so .grad
    is only the fused kernel's placeholder); then .grad is dropped."""

    def __init__(self, params):
        for param in params:
            param.main_grad = torch.zeros_like(param)
            param.grad_added_to_main_grad = False
            param.register_post_accumulate_grad_hook(self.hook)

    @staticmethod
    def hook(param):
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
        param.grad = None


class FusedBackwardGraph:
    """A captured backward whose replay adds ``fused`` (the weight's gradient) into its main_grad
    itself, as F13's or TE's fused accumulation does, leaving a placeholder as its gradient."""

    def __init__(self, weight, fused):
        self.weight, self.fused = weight, fused

    def replay(self):
        self.weight.main_grad.add_(self.fused)


def test_a_backward_replay_marks_fused_gradients_for_ddp():
    from megatron.moe_patches.graphs.layer_graphs import _Replay

    weight, bias = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    StandInDDP([weight, bias])
    placeholder = torch.full((3,), 1e30)  # TE's uninitialised placeholder: never to be added
    fused, bias_grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.25])
    captured = types.SimpleNamespace(
        before_replay=lambda x, kwargs: None, fwd_graph=types.SimpleNamespace(replay=lambda: None),
        bwd_graph=FusedBackwardGraph(weight, fused), static_out=torch.zeros(4), static_grad_out=torch.zeros(4),
        static_grad_x=torch.zeros(4), static_grad_params=(placeholder, bias_grad),
        into_main_grad=(weight,), grads_taken_by_ddp=[True, True])
    x = torch.zeros(4, requires_grad=True)
    for step in (1, 2):  # two steps, the flag reset between them as DDP's zero_grad_buffer resets it
        weight.grad_added_to_main_grad = bias.grad_added_to_main_grad = False
        _Replay.apply(captured, x, {}, weight, bias).sum().backward()
        assert weight.grad_added_to_main_grad is True
        assert torch.equal(weight.main_grad, step * fused)  # the placeholder never reached it
        assert torch.equal(bias.main_grad, step * bias_grad)  # a gradient the graph left to DDP
        assert weight.grad is None and bias.grad is None
