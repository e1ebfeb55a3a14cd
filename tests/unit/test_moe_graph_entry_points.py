"""F11 in any training loop, on CPU: apply() puts the patch set's MoE capture behind
megatron-core's graph entry points (the TE graph helper; the layers' graph-manager factory and
create_cudagraphs() for the local impl), and each entry point reaches it when, and only when,
the config graphs dropless MoE layers. The capture itself is stood in for here (wiring only);
graphs are proven on the GPU (tests/gpu/test_megatron_lm_client.py, test_moe_cuda_graph.py)."""

import types

import pytest
import torch
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron.moe_patches import apply, revert
from megatron.moe_patches.graphs import layer_graphs as moe_cuda_graph
from megatron.moe_patches.config import PatchedTransformerConfig

BASE = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    ffn_hidden_size=64, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
    moe_permute_fusion=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_device_tokens_per_expert=True,
    cuda_graph_impl="transformer_engine", cuda_graph_scope="moe", cuda_graph_warmup_steps=2,
    attention_dropout=0.0, hidden_dropout=0.0,
)


@pytest.fixture(autouse=True)
def fused_permute_kernels(monkeypatch):
    """megatron-core checks at config construction that TE's fused permute kernels exist."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)


@pytest.fixture
def captures(monkeypatch):
    """capture_layers stood in for: what each call was asked to capture."""
    calls = []

    def capture(layers, shape, dtype, config, when, kwargs=None):
        calls.append(types.SimpleNamespace(layers=list(layers), shape=shape, dtype=dtype, when=when,
                                           kwargs=kwargs))
        return types.SimpleNamespace(replays=0, uninstall=lambda: None)

    monkeypatch.setattr(moe_cuda_graph, "capture_layers", capture)
    monkeypatch.setattr(moe_cuda_graph, "_local_captures", moe_cuda_graph._LocalCaptures())
    return calls


def config(**overrides):
    return PatchedTransformerConfig(**{**BASE, **overrides})


class _MoE(MoELayer):
    """An MoE layer as far as isinstance goes (megatron-core's needs CUDA to be built)."""

    def __init__(self, config):
        torch.nn.Module.__init__(self)
        self.config = config
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states * 2, None


def model_with_moe_layers(config, count=2):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_MoE(config) for _ in range(count)])
    return model


# --- apply() installs the entry points, revert() takes them back ------------------------------


def test_apply_installs_the_capture_behind_every_graph_entry_point():
    from megatron.core.pipeline_parallel import schedules

    stock_factories = {cls: cls.__dict__["create_mcore_cudagraph_manager"] for cls in (TransformerLayer, MoETransformerLayer)}
    stock_helper, stock_create = cuda_graphs.TECudaGraphHelper, schedules.create_cudagraphs
    apply()
    try:
        assert cuda_graphs.TECudaGraphHelper is moe_cuda_graph.DroplessMoEGraphHelper
        # the schedules imported create_cudagraphs by name: that name is the one they call
        assert schedules.create_cudagraphs is moe_cuda_graph.create_cudagraphs
        for cls, stock in stock_factories.items():
            assert cls.__dict__["create_mcore_cudagraph_manager"] is not stock
        apply()  # twice is once: revert below must still find the stock objects
    finally:
        revert()
    assert cuda_graphs.TECudaGraphHelper is stock_helper and schedules.create_cudagraphs is stock_create
    for cls, stock in stock_factories.items():
        assert cls.__dict__["create_mcore_cudagraph_manager"] is stock


# --- --cuda-graph-impl transformer_engine: the TE graph helper ----------------------------------


@pytest.mark.parametrize("cp", [1, 2])
def test_te_helper_captures_the_moe_layers_with_the_micro_batch_shape(captures, cp):
    """Each context-parallel rank holds seq_length / CP tokens of the sequence: a graph made for
    the whole sequence would never replay (issue 57)."""
    c = config(context_parallel_size=1)
    c.context_parallel_size = cp  # set late: megatron-core's own CP checks need a process group
    model = model_with_moe_layers(c)
    helper = moe_cuda_graph.DroplessMoEGraphHelper(model=[model], config=c, seq_length=256, micro_batch_size=2,
                                                optimizers=[])
    assert isinstance(helper, moe_cuda_graph.DroplessMoEGraphHelper) and not helper.graphs_created()
    helper.create_cudagraphs()
    assert helper.graphs_created() and len(captures) == 1
    assert captures[0].layers == list(model.layers) and captures[0].shape == (256 // cp, 2, 64)
    assert captures[0].dtype == torch.bfloat16 and "after 2 eager steps" in captures[0].when
    helper.delete_cuda_graphs()
    assert not helper.graphs_created()


@pytest.mark.parametrize("overrides", [dict(cuda_graph_scope="attn"), dict(
    moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True, moe_device_tokens_per_expert=False)])
def test_te_helper_is_the_stock_one_where_no_dropless_moe_layer_is_graphed(overrides, captures, monkeypatch):
    made = []

    class StockHelper:
        def __init__(self, *args):
            made.append(args)

    monkeypatch.setattr(moe_cuda_graph, "_STOCK_TE_HELPER", StockHelper)
    c = config(**overrides)
    helper = moe_cuda_graph.DroplessMoEGraphHelper([torch.nn.Module()], c, 256, 2, [])
    assert isinstance(helper, StockHelper) and made[0][1] is c and not captures


# --- --cuda-graph-impl local: the layers' managers and create_cudagraphs() ----------------------


def layer_with_mlp(mlp_spec, config, factory_class=TransformerLayer):
    layer = types.SimpleNamespace(submodules_config=types.SimpleNamespace(mlp=mlp_spec), config=config)
    stock = factory_class.__dict__["create_mcore_cudagraph_manager"]
    moe_cuda_graph.manager_factory(factory_class, stock)(layer, config)
    return layer


@pytest.mark.parametrize("factory_class", [TransformerLayer, MoETransformerLayer])
def test_a_dropless_moe_layer_gets_the_patch_sets_manager(factory_class):
    c = config(cuda_graph_impl="local")
    layer = layer_with_mlp(ModuleSpec(module=MoELayer), c, factory_class)
    assert isinstance(layer.cudagraph_manager, moe_cuda_graph.DroplessMoEGraphManager)


def test_a_dense_layer_under_the_moe_scope_gets_what_megatron_core_gives_it():
    layer = layer_with_mlp(ModuleSpec(module=MLP), config(cuda_graph_impl="local"))
    assert not hasattr(layer, "cudagraph_manager")  # megatron-core graphs no dense MLP for scope moe


def test_local_graphs_capture_after_the_warmup_training_steps_only(captures):
    c = config(cuda_graph_impl="local", cuda_graph_warmup_steps=2)
    model = model_with_moe_layers(c)
    manager = moe_cuda_graph.DroplessMoEGraphManager()
    hosts = [types.SimpleNamespace(mlp=moe, training=True) for moe in model.layers]

    def step(training=True):
        with torch.set_grad_enabled(training):
            for host in hosts:
                host.training = training
                calls = []
                host.forward = lambda *a, **k: calls.append(a) or "out"
                # megatron-core calls the manager with the layer and its call's args and kwargs
                out = manager(_Callable(host), (torch.zeros(16, 2, 64, dtype=torch.bfloat16),), {})
                assert out == "out"
        moe_cuda_graph.create_cudagraphs()

    step()
    step(training=False)  # an evaluation pass is not a warm-up step
    assert not captures
    step()
    assert len(captures) == 1 and captures[0].layers == list(model.layers)
    assert captures[0].shape == (16, 2, 64) and "after 2 eager steps" in captures[0].when
    step()
    assert len(captures) == 1  # once


class _Callable(torch.nn.Module):
    """A stand-in transformer layer whose forward is its host's (Module.__call__ runs it)."""

    def __init__(self, host):
        super().__init__()
        self.host = host
        self.training = host.training

    @property
    def mlp(self):
        return self.host.mlp

    def forward(self, *args, **kwargs):
        return self.host.forward(*args, **kwargs)


def test_create_cudagraphs_runs_megatron_cores_own_first(monkeypatch, captures):
    order = []
    monkeypatch.setattr(moe_cuda_graph, "_STOCK_CREATE_CUDAGRAPHS", lambda: order.append("stock") or "stats")
    monkeypatch.setattr(moe_cuda_graph._LocalCaptures, "end_of_step", lambda self: order.append("moe"))
    assert moe_cuda_graph.create_cudagraphs() == "stats" and order == ["stock", "moe"]


# --- the config rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("scope", [["moe", "mlp"], ["moe", "moe_preprocess"], ["attn", "moe", "mlp"]])
def test_other_scopes_beside_moe_are_refused_by_name(scope):
    with pytest.raises(ValueError, match="each MoE layer .--cuda-graph-scope moe. or each transformer layer whole"):
        config(cuda_graph_scope=scope)


@pytest.mark.parametrize("scope", [[], ["attn", "moe"], "attn,moe"])
def test_the_whole_layer_scopes_are_accepted_and_planned(scope):
    from megatron.moe_patches.plan import GraphScope, plan_for

    c = config(cuda_graph_scope=scope)
    assert plan_for(c).graph_scope is GraphScope.WHOLE_LAYER and plan_for(c).graph_unit == "transformer layer"
    assert plan_for(c).graph_blocker is None


@pytest.mark.parametrize("recipe, named", [
    ("blockwise", None), ("tensorwise", None),  # scales computed on the device: graph-safe
    ("delayed", "--fp8-recipe delayed"), ("mxfp8", "--fp8-recipe mxfp8"),
])
def test_fp8_in_the_whole_layer_takes_the_device_scaled_recipes(recipe, named):
    """(An FP8 config needs Transformer Engine to be built: the rule is asked directly.)"""
    from megatron.moe_patches.plan.graphs import _whole_layer_blocker

    fp8 = types.SimpleNamespace(fp8="e4m3", fp8_recipe=recipe, recompute_granularity=None, context_parallel_size=1,
                                cuda_graph_impl="local", cuda_graph_warmup_steps=1, attention_dropout=0.0,
                                hidden_dropout=0.0)
    reason = _whole_layer_blocker(fp8)
    assert reason is None if named is None else named in reason
    assert "FP4" in _whole_layer_blocker(types.SimpleNamespace(**{**vars(fp8), "fp8": None, "fp4": "e2m1"}))
    assert _whole_layer_blocker(types.SimpleNamespace(**{**vars(fp8), "fp8": None})) is None


@pytest.mark.parametrize("overrides, named", [
    (dict(attention_dropout=0.1), "dropout inside the captured layer"),
    (dict(hidden_dropout=0.1), "dropout inside the captured layer"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), "recompute inside the captured"),
    (dict(cuda_graph_warmup_steps=0), "--cuda-graph-warmup-steps 0"),
])
def test_what_the_whole_layer_cannot_capture_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        config(cuda_graph_scope=[], **overrides)
    config(cuda_graph_scope="moe", **overrides)  # the MoE layer alone can be captured


def test_full_iteration_needs_a_graph_safe_moe_layer():
    with pytest.raises(ValueError, match="full_iteration .* copies token counts to the host"):
        config(cuda_graph_impl="local", cuda_graph_scope="full_iteration", moe_device_tokens_per_expert=False)
    with pytest.raises(ValueError, match="full_iteration .* --cuda-graph-warmup-steps 0"):
        config(cuda_graph_impl="local", cuda_graph_scope="full_iteration", cuda_graph_warmup_steps=0)
    config(cuda_graph_impl="local", cuda_graph_scope="full_iteration")  # the sync-free layer can be in it
    # what only a per-layer capture needs is no reason here: the whole iteration is one graph, whose
    # replays draw new random numbers from the generators megatron-core registers with it
    config(cuda_graph_impl="local", cuda_graph_scope="full_iteration", moe_input_jitter_eps=0.01)


# --- a replay runs the forward pre-hooks of the submodules it skips -------------------------------


def test_a_replay_runs_the_skipped_submodules_forward_pre_hooks(monkeypatch):
    monkeypatch.setattr(moe_cuda_graph._Replay, "apply", staticmethod(lambda captured, x, kw, *params: "replayed"))
    layer = _MoE(config())
    seen = []
    layer.proj.register_forward_pre_hook(lambda module, args: seen.append(("proj", args)))
    layer.register_forward_pre_hook(lambda module, args: seen.append(("layer", len(args))))
    x = torch.zeros(8, 2, 4)
    captured = types.SimpleNamespace(params=list(layer.parameters()), replays=0,
                                     signature=moe_cuda_graph.call_signature(x, {}))
    layer.forward = moe_cuda_graph._graphed_forward(layer, captured)
    assert layer(x) == ("replayed", None)
    assert seen == [("layer", 1), ("proj", ())]


def test_a_whole_layer_replays_only_calls_like_the_captured_one(monkeypatch):
    """The keyword tensors are part of what was captured: other shapes or dtypes, packed-sequence
    parameters or extra positional values run the layer eagerly."""
    replayed = []
    monkeypatch.setattr(moe_cuda_graph._Replay, "apply",
                        staticmethod(lambda captured, x, kw, *params: replayed.append(sorted(kw)) or "replayed"))
    layer = _MoE(config())
    x, rope = torch.zeros(8, 2, 4), torch.zeros(8, 1, 1, 2)
    captured = types.SimpleNamespace(params=list(layer.parameters()), replays=0,
                                     signature=moe_cuda_graph.call_signature(x, {"rotary_pos_emb": rope}))
    layer.forward = moe_cuda_graph._graphed_forward(layer, captured)
    assert layer(x, rotary_pos_emb=rope, attention_mask=None) == ("replayed", None)
    assert replayed == [["rotary_pos_emb"]]
    eager = (x * 2, None)
    for call in (dict(rotary_pos_emb=torch.zeros(4, 1, 1, 2)), dict(),
                 dict(rotary_pos_emb=rope.to(torch.float64)),  # its shape, another dtype (issue 57)
                 dict(rotary_pos_emb=rope, packed_seq_params=object()),
                 dict(rotary_pos_emb=rope, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))):
        out = layer(x, **call)
        assert out[1] is None and torch.equal(out[0], eager[0])
    assert len(replayed) == 1 and captured.replays == 1


class _Layer(TransformerLayer):
    """A transformer layer as far as isinstance goes, with megatron-core's forward keywords."""

    __call__ = torch.nn.Module.__call__  # (megatron-core's own looks for graphs it made)

    def __init__(self, config):
        torch.nn.Module.__init__(self)
        self.config = config
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, packed_seq_params=None):
        return hidden_states, None


def test_whole_layers_are_captured_with_their_last_training_calls_keywords(captures):
    """The TE helper notes each layer's training calls until its capture; the local manager
    notes them at every layer call: both capture with the keyword tensors the layers got."""
    c = config(cuda_graph_scope=[])
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Layer(c) for _ in range(2)])
    helper = moe_cuda_graph.DroplessMoEGraphHelper([model], c, 16, 2, [])
    x, rope = torch.zeros(16, 2, 64, dtype=torch.bfloat16), torch.randn(16, 1, 1, 8)
    with torch.no_grad():
        model.layers[0](hidden_states=x, rotary_pos_emb=torch.zeros(3))  # evaluation: not noted
    for layer in model.layers:
        layer(hidden_states=x, rotary_pos_emb=rope, attention_mask=None)
    helper.create_cudagraphs()
    assert len(captures) == 1 and captures[0].layers == list(model.layers)
    assert captures[0].shape == (16, 2, 64) and list(captures[0].kwargs) == ["rotary_pos_emb"]
    assert captures[0].kwargs["rotary_pos_emb"] is not None and torch.equal(captures[0].kwargs["rotary_pos_emb"], rope)
    assert not model.layers[0]._forward_pre_hooks  # the noting ends with the capture

    local = config(cuda_graph_impl="local", cuda_graph_scope=[], cuda_graph_warmup_steps=1)
    dense = layer_with_mlp(ModuleSpec(module=MLP), local)
    assert isinstance(dense.cudagraph_manager, moe_cuda_graph.DroplessMoEGraphManager)
    assert dense.cudagraph_manager.whole_layer  # every layer of the model, dense ones too
    layer = _Layer(local)
    dense.cudagraph_manager(layer, (), dict(hidden_states=x, rotary_pos_emb=rope, packed_seq_params=None))
    moe_cuda_graph.create_cudagraphs()
    assert len(captures) == 2 and captures[1].layers == [layer] and list(captures[1].kwargs) == ["rotary_pos_emb"]


def test_the_plan_says_whether_the_whole_iteration_graph_can_hold_the_moe_layers():
    from megatron.moe_patches.plan import plan_for

    lines = plan_for(config(cuda_graph_impl="local", cuda_graph_scope="full_iteration")).lines()
    assert "CUDA graph of the whole iteration: can hold the MoE layers" in lines
    assert not any("whole iteration" in line for line in plan_for(config()).lines())
