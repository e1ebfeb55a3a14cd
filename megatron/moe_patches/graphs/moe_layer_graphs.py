"""F11: the dropless MoE layer's forward and backward as CUDA graphs (EP = 1, or EP > 1
through F12's symmetric exchange).

With ``moe_device_tokens_per_expert`` the layer never waits for the GPU at EP = 1: the
router's counts stay on the device (F8), the alltoall/allgather dispatchers size every
buffer from tokens x top-k (``dispatchers.py``), and the ``grouped_mm`` / ``fp8_grouped_mm``
experts take device offsets. At EP > 1 F12's exchange keeps that true: its received tensors
have a static bound, its counts are all-gathered on the device, and its symmetric buffers
are allocated in the warm-up runs, before the capture. Such a layer can be captured; the
config's plan says why not where it cannot (``plan.plan_for(config).graph_blocker``, which
validation and capture both read).

megatron-core 0.16.1 refuses ``cuda_graph_scope=moe`` for dropless MoE; the patched
config accepts it when the plan's ``graph_blocker`` is None and refuses it by name otherwise.

Why the patch set captures the layer itself (``MoELayerGraphs``) instead of handing it
to megatron-core's local graph manager or ``torch.cuda.make_graphed_callables``: both
capture the backward with the model parameters as ``torch.autograd.grad`` inputs (the
latter measured on this layer). torch (>= 2.10) then accumulates each parameter's
gradient on the stream its ``AccumulateGrad`` node was created on; Megatron's DDP creates
those nodes at construction, on the default stream, so the capture fails with "operation
would make the legacy stream depend on a capturing blocking stream". This capture takes
the gradients of fresh aliases of the parameters (same storage, created on the capture
stream) and hands them to the real parameters outside the graph, where DDP's hooks see
them as usual.

Every training loop reaches the one capture (``capture_moe_layers``) through megatron-core's
own graph entry points, which ``apply()`` installs (the registry lists the bindings):

- ``--cuda-graph-impl transformer_engine``: the loop builds megatron-core's
  ``TECudaGraphHelper`` and calls its ``create_cudagraphs()`` after
  ``--cuda-graph-warmup-steps`` steps (Megatron-LM's ``train()`` does). The patched helper
  captures the MoE layers there when the config graphs dropless MoE; any other config gets
  the stock helper's behaviour.
- ``--cuda-graph-impl local``: each transformer layer asks ``create_mcore_cudagraph_manager``
  for a graph manager at construction. For a layer whose MLP is an MoE layer under a
  dropless ``moe`` scope the patched method attaches ``MoEScopeGraphManager``, which runs the
  layer eagerly and notes its MoE layer; megatron-core's ``create_cudagraphs()``, which the
  schedules call after every forward-backward, then captures the noted layers once
  ``--cuda-graph-warmup-steps`` training steps (at least one) have run.

Rules of use (what a training loop with PP = 1 does): every call has the sample's shape;
each layer's forward and backward alternate as captured (forward of all layers, then
their backwards in reverse order, per micro-batch); the output and input gradient are
the graph's static buffers, valid until that layer's next replay. Under ``no_grad`` or
with another shape the layer runs eagerly. FP8: the graphs read the weights' cached FP8
copies; before a replay the backend refreshes them in place when an optimizer has stepped
(outside the graph: once per step, not per micro-batch).
"""

import contextlib
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.transformer import cuda_graphs as mcore_graphs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron.moe_patches.plan import graphs_dropless_moe, plan_for, scope_names

# The stock objects, kept before apply() binds megatron-core's names to this module's.
_STOCK_TE_HELPER = mcore_graphs.TECudaGraphHelper
_STOCK_CREATE_CUDAGRAPHS = mcore_graphs.create_cudagraphs


# --- the capture --------------------------------------------------------------------------


class _Captured:
    """One layer's graphs and static buffers."""

    def __init__(self, layer, sample_TBH: torch.Tensor):
        self.layer = layer
        self.names = [n for n, p in layer.named_parameters() if p.requires_grad]
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.static_x = sample_TBH.detach().clone().requires_grad_(True)
        self.aliases = None  # made on the capture stream (see the module doc)
        self.fwd_graph = torch.cuda.CUDAGraph()
        self.bwd_graph = torch.cuda.CUDAGraph()
        self.static_out = self.static_grad_out = None
        self.static_grad_x = None
        self.static_grad_params = ()
        # Parameters whose weight gradient the captured backward adds into main_grad (F13, or TE's
        # own fusion): each replay tells DDP's hook again, which the Python code of the capture did.
        self.into_main_grad = ()
        self.replays = 0  # forward replays since the capture
        # Work the graphs leave to the host before each replay: the FP8 backend's weight
        # copies (quantized once per optimizer step, outside the graph).
        backend = getattr(layer.experts, "backend", None)
        self.before_replay = getattr(backend, "refresh_weight_caches", None) or (lambda: None)

    def run_forward(self):
        aliases = dict(zip(self.names, self.aliases))
        out, _ = torch.func.functional_call(self.layer, aliases, (self.static_x,), strict=False)
        return out  # MoELayer returns no MLP bias (it asserts so)

    def run_backward(self, out):
        grads = torch.autograd.grad(out, (self.static_x, *self.aliases), self.static_grad_out, allow_unused=True)
        return grads[0], grads[1:]

    def make_aliases(self):
        self.aliases = [p.detach().requires_grad_(True) for p in self.params]
        for param, alias in zip(self.params, self.aliases):
            if hasattr(param, "main_grad"):  # a module that fuses wgrad accumulation reads it off the alias
                alias.main_grad = param.main_grad

    def capture_backward(self, **capture):
        """Capture the backward and note which parameters it adds into main_grad."""
        for tensor in (*self.params, *self.aliases):
            if hasattr(tensor, "grad_added_to_main_grad"):
                tensor.grad_added_to_main_grad = False
        with torch.cuda.graph(self.bwd_graph, **capture):
            self.static_grad_x, self.static_grad_params = self.run_backward(self.static_out)
        self.into_main_grad = tuple(p for p, a in zip(self.params, self.aliases)
                                    if getattr(p, "grad_added_to_main_grad", False)
                                    or getattr(a, "grad_added_to_main_grad", False))


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, captured, x_TBH, *params):
        captured.before_replay()
        captured.static_x.copy_(x_TBH)
        captured.fwd_graph.replay()
        ctx.captured = captured
        return captured.static_out.detach()

    @staticmethod
    def backward(ctx, grad_out_TBH):
        captured = ctx.captured
        captured.static_grad_out.copy_(grad_out_TBH)
        captured.bwd_graph.replay()
        for param in captured.into_main_grad:
            param.grad_added_to_main_grad = True
        grad_params = tuple(None if g is None else g.detach() for g in captured.static_grad_params)
        return (None, captured.static_grad_x.detach(), *grad_params)


class MoELayerGraphs:
    """MoE layers captured forward and backward for one input shape, sharing one memory pool.

    ``install()`` makes each layer's ``forward`` replay its graphs (an instance attribute;
    ``uninstall()`` deletes it again). Capture order is the training order: every layer's
    forward, then the backwards in reverse.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], sample_TBH: torch.Tensor,
                 context: Optional[Callable[[], contextlib.AbstractContextManager]] = None, warmup: int = 3):
        for layer in layers:
            reason = plan_for(layer.config).graph_blocker
            if reason is not None:
                raise ValueError(f"cuda_graph_scope=moe cannot capture this MoE layer: {reason}.")
        self.layers = list(layers)
        self.shape = tuple(sample_TBH.shape)
        self.dtype = sample_TBH.dtype
        context = context or contextlib.nullcontext
        self.captured = [_Captured(layer, sample_TBH) for layer in self.layers]
        # Warm-up and capture run the layers: their buffers (e.g. the router's token counts
        # for expert-bias balancing) must not keep what those runs added.
        buffers = [{n: b.clone() for n, b in layer.named_buffers()} for layer in self.layers]
        # Nor the main grads: the warm-up backwards add into them where wgrad accumulation is fused.
        main_grads = [(g, g.clone()) for g in {id(p.main_grad): p.main_grad for c in self.captured
                                                for p in c.params if hasattr(p, "main_grad")}.values()]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in self.captured:
                c.make_aliases()
                c.static_grad_out = torch.empty(self.shape, dtype=self.dtype, device=sample_TBH.device)
            # Warm-up on the capture stream: lazy initialisations and autotuning happen here,
            # and the FP8 weight copies are made (the capture finds them current).
            for _ in range(warmup):
                for c in self.captured:
                    c.static_grad_out.normal_()
                    with context():
                        out = c.run_forward()
                    c.run_backward(out)
            # thread_local: other threads (NCCL's watchdog, with data parallelism) may query
            # their events while this one captures.
            capture = dict(pool=pool, stream=stream, capture_error_mode="thread_local")
            for c in self.captured:
                c.static_grad_out.zero_()
                with torch.cuda.graph(c.fwd_graph, **capture), context():
                    c.static_out = c.run_forward()
            for c in reversed(self.captured):
                c.capture_backward(**capture)
        torch.cuda.current_stream().wait_stream(stream)
        for layer, saved in zip(self.layers, buffers):
            for name, buffer in layer.named_buffers():
                buffer.copy_(saved[name])
        for main_grad, saved in main_grads:
            main_grad.copy_(saved)
        for c in self.captured:
            c.aliases = None  # the graphs hold what they need; the aliases' autograd state can go

    def install(self):
        for layer, captured in zip(self.layers, self.captured):
            layer.forward = _graphed_forward(layer, captured, self.shape, self.dtype)
        return self

    @property
    def replays(self) -> int:
        """Forward replays of all layers since the capture (0 after a step: every call ran eagerly)."""
        return sum(c.replays for c in self.captured)

    def uninstall(self):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)


def _graphed_forward(layer, captured: _Captured, shape, dtype):
    eager = type(layer).forward.__get__(layer)

    def forward(hidden_states, *args, **kwargs):
        # intermediate_tensors / padding_mask given: a partial or masked pass, not the captured one
        extra = any(a is not None for a in (*args, *kwargs.values()))
        if (extra or not torch.is_grad_enabled() or not layer.training
                or tuple(hidden_states.shape) != shape or hidden_states.dtype != dtype):
            return eager(hidden_states, *args, **kwargs)
        captured.replays += 1
        _run_submodule_pre_hooks(layer)
        return _Replay.apply(captured, hidden_states, *captured.params), None

    return forward


def _run_submodule_pre_hooks(layer):
    """A replay skips the layer's submodules' calls, so their forward pre-hooks are run here:
    Megatron's DDP waits there for the parameters' all-gather (--overlap-param-gather) and
    turns them on and off as the loop goes, so they are looked up at every replay."""
    for module in layer.modules():
        if module is layer:
            continue  # its own hooks ran in its __call__
        for key, hook in list(module._forward_pre_hooks.items()):  # torch keeps them here only
            if key in module._forward_pre_hooks_with_kwargs:
                hook(module, (), {})
            else:
                hook(module, ())


def moe_layers(model) -> List[torch.nn.Module]:
    """The MoE layers of ``model`` (a module or a list of model chunks), in forward order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


# --- the capture in any training loop ------------------------------------------------------

_captures: List[MoELayerGraphs] = []  # installed by capture_moe_layers, oldest first


def active_captures() -> List[MoELayerGraphs]:
    """The MoE layer graphs installed in this process (what a loop can ask about replays)."""
    return list(_captures)


def _print_rank0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


@contextlib.contextmanager
def _router_logs_kept():
    """The capture's warm-up runs log router losses as training steps do; the step around the
    capture must log only its own."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    saved = {name: entry["values"].clone() for name, entry in tracker.items()}
    try:
        yield
    finally:
        for name, entry in tracker.items():
            if name in saved:
                entry["values"].copy_(saved[name])
            else:
                entry["values"].zero_()


def capture_moe_layers(layers, shape: Tuple[int, ...], dtype: torch.dtype, config, when: str) -> MoELayerGraphs:
    """The one capture every loop reaches: ``layers`` (in forward order) for micro-batches of
    ``shape``, installed so that their next training calls replay; one line says so."""
    from megatron.core.fp8_utils import get_fp8_context

    tick = time.time()
    device = torch.cuda.current_device()
    # The sample and the warm-up's output gradients are random: the training's own random
    # stream (dropout elsewhere in the model) must go on as if there had been no capture.
    with torch.random.fork_rng(devices=[device]), _router_logs_kept():
        sample_TBH = torch.randn(shape, dtype=dtype, device=device)
        graphs = MoELayerGraphs(layers, sample_TBH, context=lambda: get_fp8_context(config)).install()
    _captures.append(graphs)
    _print_rank0(f"moe_patches: captured {len(layers)} MoE layers as CUDA graphs (forward and backward, "
                 f"input {list(shape)}) {when}, in {time.time() - tick:.1f} s")
    return graphs


def release(graphs: MoELayerGraphs) -> None:
    """Undo ``capture_moe_layers``: the layers run eagerly again and the graphs can be freed."""
    graphs.uninstall()
    if graphs in _captures:
        _captures.remove(graphs)


def _steps(count: int) -> str:
    return f"{count} eager step{'s' if count != 1 else ''}"


class MoEScopeGraphHelper:
    """megatron-core's ``TECudaGraphHelper`` as ``apply()`` installs it.

    Loops build it with ``--cuda-graph-impl transformer_engine`` and call
    ``create_cudagraphs()`` after the warm-up steps. A config that graphs dropless MoE layers
    gets this helper, which captures them with ``capture_moe_layers``; any other config gets
    the stock helper itself (decided here, once).
    """

    def __new__(cls, model, config, seq_length, micro_batch_size, optimizers=()):
        if not graphs_dropless_moe(config):
            return _STOCK_TE_HELPER(model, config, seq_length, micro_batch_size, list(optimizers))
        return super().__new__(cls)

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=()):
        self.config = config
        self.layers = moe_layers(model)
        # Tokens per micro-batch as the MoE layer sees them (TP > 1 is refused by the plan's graph_blocker).
        self.shape = (seq_length // config.context_parallel_size, micro_batch_size, config.hidden_size)
        self.graphs: Optional[MoELayerGraphs] = None

    def graphs_created(self) -> bool:
        return self.graphs is not None

    def create_cudagraphs(self) -> None:
        warmup = self.config.cuda_graph_warmup_steps
        self.graphs = capture_moe_layers(self.layers, self.shape, self.config.params_dtype, self.config,
                                         f"after {_steps(warmup)} (--cuda-graph-impl transformer_engine)")

    def cuda_graph_set_manual_hooks(self) -> None:
        """Nothing to set: a replay runs the skipped submodules' forward pre-hooks itself."""

    def delete_cuda_graphs(self) -> None:
        release(self.graphs)
        self.graphs = None


class MoEScopeGraphManager:
    """The graph manager ``apply()`` gives a transformer layer whose MLP is a dropless MoE
    layer under ``--cuda-graph-impl local --cuda-graph-scope moe``.

    megatron-core hands every call of the layer to its manager. This one runs the layer
    eagerly and notes its MoE layer and input shape on training calls; the capture happens
    in ``create_cudagraphs`` at the end of a step, after which the MoE layer replays.
    """

    def __call__(self, layer, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "dynamic_inference_decode_only"}
        if layer.training and torch.is_grad_enabled():
            hidden_TBH = args[0] if args else kwargs["hidden_states"]
            _local_captures.note(layer.mlp, hidden_TBH)
        return torch.nn.Module.__call__(layer, *args, **kwargs)


class _LocalCaptures:
    """The MoE layers that ran training steps under ``MoEScopeGraphManager``, captured
    together after ``--cuda-graph-warmup-steps`` such steps (at least one: the shape of a
    micro-batch is known only once one has run)."""

    def __init__(self):
        self.pending: Dict[MoELayer, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self.captured = weakref.WeakSet()
        self.trained_since_last_step = False
        self.steps = 0

    def note(self, moe_layer, hidden_TBH) -> None:
        if moe_layer not in self.captured:
            self.pending.setdefault(moe_layer, (tuple(hidden_TBH.shape), hidden_TBH.dtype))
        self.trained_since_last_step = True

    def end_of_step(self) -> None:
        if not self.trained_since_last_step:
            return  # an evaluation pass, or no such layer
        self.trained_since_last_step = False
        self.steps += 1
        if not self.pending:
            return
        config = next(iter(self.pending)).config
        if self.steps < max(1, config.cuda_graph_warmup_steps):
            return
        groups: Dict[Tuple, List[MoELayer]] = {}
        for layer, key in self.pending.items():
            groups.setdefault(key, []).append(layer)
        self.pending = {}
        for (shape, dtype), layers in groups.items():
            self.captured.update(layers)
            capture_moe_layers(layers, shape, dtype, config,
                               f"after {_steps(self.steps)} (--cuda-graph-impl local)")


_local_captures = _LocalCaptures()


def create_cudagraphs():
    """megatron-core's ``create_cudagraphs()`` (the schedules call it after every
    forward-backward under ``--cuda-graph-impl local``), then the capture of the MoE layers
    that ``MoEScopeGraphManager`` noted."""
    result = _STOCK_CREATE_CUDAGRAPHS()
    _local_captures.end_of_step()
    return result


def _builds_moe_layer(spec) -> bool:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, MoELayer)


def manager_factory(layer_class, stock_factory):
    """``layer_class.create_mcore_cudagraph_manager`` for apply(): a dropless MoE layer under
    the moe scope gets MoEScopeGraphManager (the patch set's capture), anything else what
    ``stock_factory`` gives it."""

    def create_mcore_cudagraph_manager(self, config):
        if graphs_dropless_moe(config) and _builds_moe_layer(self.submodules_config.mlp):
            self.cudagraph_manager = MoEScopeGraphManager()
        else:
            stock_factory(self, config)

    create_mcore_cudagraph_manager.__doc__ = (
        f"{layer_class.__name__}'s graph manager factory; a dropless MoE layer under the moe "
        "scope gets MoEScopeGraphManager (the patch set's capture), anything else the stock one.")
    return create_mcore_cudagraph_manager
