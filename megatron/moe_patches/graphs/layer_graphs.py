"""F11: the dropless MoE layer's forward and backward as CUDA graphs (EP = 1, or EP > 1
through F12's symmetric exchange), alone (``--cuda-graph-scope moe``) or with the attention
around it, each transformer layer whole in one graph (no scope, or ``attn moe``).

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

Why the patch set captures the layer itself (``LayerGraphs``) instead of handing it
to megatron-core's local graph manager or ``torch.cuda.make_graphed_callables``: both
capture the backward with the model parameters as ``torch.autograd.grad`` inputs (the
latter measured on this layer). torch (>= 2.10) then accumulates each parameter's
gradient on the stream its ``AccumulateGrad`` node was created on; Megatron's DDP creates
those nodes at construction, on the default stream, so the capture fails with "operation
would make the legacy stream depend on a capturing blocking stream". This capture takes
the gradients of fresh aliases of the parameters (same storage, created on the capture
stream) and hands them to the real parameters outside the graph, where DDP's hooks see
them as usual.

Every training loop reaches the one capture (``capture_layers``) through megatron-core's
own graph entry points, which ``apply()`` installs (the registry lists the bindings):

- ``--cuda-graph-impl transformer_engine``: the loop builds megatron-core's
  ``TECudaGraphHelper`` and calls its ``create_cudagraphs()`` after
  ``--cuda-graph-warmup-steps`` steps (Megatron-LM's ``train()`` does). The patched helper
  captures the MoE layers there when the config graphs dropless MoE; any other config gets
  the stock helper's behaviour.
- ``--cuda-graph-impl local``: each transformer layer asks ``create_mcore_cudagraph_manager``
  for a graph manager at construction. For a layer whose MLP is an MoE layer under a
  dropless ``moe`` scope the patched method attaches ``DroplessMoEGraphManager``, which runs the
  layer eagerly and notes its MoE layer; megatron-core's ``create_cudagraphs()``, which the
  schedules call after every forward-backward, then captures the noted layers once
  ``--cuda-graph-warmup-steps`` training steps (at least one) have run.

The whole layer is captured the same way: its keyword tensors (rotary embeddings, attention
mask) are static inputs beside the hidden states, copied in before each replay; a call with
other keyword shapes, packed-sequence parameters or an inference context runs eagerly. Its
samples are the layers' own last training calls (noted by the local manager, or by a forward
pre-hook of the TE helper until the capture), so their shapes are the loop's.

Rules of use (what a training loop with PP = 1 does): every call has the sample's shape;
each layer's forward and backward alternate as captured (forward of all layers, then
their backwards in reverse order, per micro-batch); the output and input gradient are
the graph's static buffers, valid until that layer's next replay. Under ``no_grad`` or
with another shape the layer runs eagerly. FP8: the experts' graphs read the weights' cached
FP8 copies; before a replay the backend refreshes them in place when an optimizer has stepped
(outside the graph: once per step, not per micro-batch). A whole layer's TE linears (the
attention's) quantize their weights inside the graph at every replay (current and blockwise
scaling compute their scales on the device; the plan refuses recipes that keep host state).
"""

import contextlib
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.transformer import cuda_graphs as mcore_graphs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.moe_patches.plan import GraphScope, graph_scope, plan_for

# The stock objects, kept before apply() binds megatron-core's names to this module's.
_STOCK_TE_HELPER = mcore_graphs.TECudaGraphHelper
_STOCK_CREATE_CUDAGRAPHS = mcore_graphs.create_cudagraphs


# --- the capture --------------------------------------------------------------------------


class _Captured:
    """One layer's graphs and static buffers: an MoE layer, or a transformer layer whole (its
    keyword tensors, e.g. the rotary embeddings and the attention mask, are static inputs too)."""

    def __init__(self, layer, sample_TBH: torch.Tensor, sample_kwargs: Dict[str, torch.Tensor]):
        self.layer = layer
        self.names = [n for n, p in layer.named_parameters() if p.requires_grad]
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.static_x = sample_TBH.detach().clone().requires_grad_(True)
        self.static_kwargs = {name: t.detach().clone() for name, t in sample_kwargs.items()}
        self.signature = call_signature(sample_TBH, sample_kwargs)
        self.aliases = None  # made on the capture stream (see the module doc)
        self.fwd_graph = torch.cuda.CUDAGraph()
        self.bwd_graph = torch.cuda.CUDAGraph()
        self.static_out = self.static_grad_out = None
        self.static_grad_x = None
        self.static_grad_params = ()
        # Parameters whose weight gradient the captured backward adds into main_grad (F13, or TE's
        # own fusion): each replay tells DDP's hook again, which the Python code of the capture did.
        self.into_main_grad = ()
        self.grads_taken_by_ddp = [hasattr(p, "main_grad") for p in self.params]
        self.replays = 0  # forward replays since the capture
        # Work the graphs leave to the host before each replay: the FP8 backend's weight
        # copies (quantized once per optimizer step, outside the graph).
        self.refreshes = [m.backend.refresh_weight_caches for m in layer.modules()
                          if hasattr(getattr(m, "backend", None), "refresh_weight_caches")]
        # FP8 in Transformer Engine's own linears (the attention's, a whole layer's): quantized in
        # the graph at every replay, from the weights it reads (see _quantize_te_weights_each_call).
        self.te_fp8_linears = _quantize_te_weights_each_call(layer) if layer.config.fp8 else []

    def before_replay(self, x_TBH, kwargs):
        for refresh in self.refreshes:
            refresh()
        self.static_x.copy_(x_TBH)
        for name, tensor in kwargs.items():
            self.static_kwargs[name].copy_(tensor)

    def run_forward(self):
        aliases = dict(zip(self.names, self.aliases))
        out, second = torch.func.functional_call(self.layer, aliases, (self.static_x,), self.static_kwargs,
                                                 strict=False)
        if second is not None:  # MoELayer's MLP bias (it asserts None), a transformer layer's context
            raise ValueError(f"{type(self.layer).__name__} returned a second output (cross-attention context or "
                             "an MLP bias), which its CUDA graph does not hand back")
        return out

    def run_backward(self, out):
        grads = torch.autograd.grad(out, (self.static_x, *self.aliases), self.static_grad_out, allow_unused=True)
        return grads[0], grads[1:]

    def make_aliases(self):
        self.aliases = [p.detach().requires_grad_(True) for p in self.params]
        for param, alias in zip(self.params, self.aliases):
            # What a module that fuses wgrad accumulation reads off its weight (TE's linears and
            # megatron-core's ask hasattr(weight, "grad_added_to_main_grad") before they hand back
            # a placeholder gradient and set it; without it they return none, and DDP's hook,
            # which counts each gradient for its buckets, would never fire for that parameter).
            for name in ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad"):
                if hasattr(param, name):
                    setattr(alias, name, getattr(param, name))

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


def _quantize_te_weights_each_call(layer) -> List[torch.nn.Module]:
    """megatron-core's TE linears quantize their FP8 weights at a step's first micro-batch only
    (``is_first_microbatch``, a host flag) and reuse the copy after: a graph captured on a later
    micro-batch would replay that step's copy for ever. Their ``disable_parameter_transpose_cache``
    makes them quantize at every call, so the graph quantizes the current weights at each replay
    (the same values within a step: graphed equals eager). The FP8 experts are left out: their
    backend refreshes its copies before a replay. Returns the linears switched, for ``uninstall``."""
    experts = {id(m) for owner in layer.modules()
               if hasattr(getattr(owner, "backend", None), "refresh_weight_caches") for m in owner.modules()}
    switched = [m for m in layer.modules()
                if id(m) not in experts and getattr(m, "disable_parameter_transpose_cache", None) is False]
    for linear in switched:
        linear.disable_parameter_transpose_cache = True
    return switched


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, captured, x_TBH, kwargs, *params):
        captured.before_replay(x_TBH, kwargs)
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
        # A parameter under Megatron's DDP (it has main_grad) takes the graph's buffer: DDP's hook adds
        # it into main_grad and drops it before the next replay. Any other keeps a copy as its .grad,
        # which the next replay would overwrite.
        grad_params = tuple(None if g is None else g.detach() if owned else g.clone()
                            for g, owned in zip(captured.static_grad_params, captured.grads_taken_by_ddp))
        return (None, captured.static_grad_x.detach(), None, *grad_params)


class LayerGraphs:
    """Layers (MoE layers, or transformer layers whole) captured forward and backward for one
    call signature, sharing one memory pool.

    ``install()`` makes each layer's ``forward`` replay its graphs (an instance attribute;
    ``uninstall()`` deletes it again). Capture order is the training order: every layer's
    forward, then the backwards in reverse.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], sample_TBH: torch.Tensor,
                 context: Optional[Callable[[], contextlib.AbstractContextManager]] = None, warmup: int = 3,
                 sample_kwargs: Optional[Dict[str, torch.Tensor]] = None):
        for layer in layers:
            plan = plan_for(layer.config)
            if plan.graph_blocker is not None:
                raise ValueError(f"CUDA graphs cannot capture this {plan.graph_unit}: {plan.graph_blocker}.")
        self.layers = list(layers)
        context = context or contextlib.nullcontext
        self.captured = [_Captured(layer, sample_TBH, sample_kwargs or {}) for layer in self.layers]
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
                c.static_grad_out = torch.empty_like(sample_TBH)
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
            layer.forward = _graphed_forward(layer, captured)
        return self

    @property
    def replays(self) -> int:
        """Forward replays of all layers since the capture (0 after a step: every call ran eagerly)."""
        return sum(c.replays for c in self.captured)

    def uninstall(self):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        for captured in self.captured:
            for linear in captured.te_fp8_linears:
                linear.disable_parameter_transpose_cache = False


def call_signature(hidden_TBH: torch.Tensor, tensor_kwargs: Dict[str, torch.Tensor]) -> Tuple:
    """What a captured graph was made for: the input's and each keyword tensor's shape and dtype."""
    return _signature(tuple(hidden_TBH.shape), hidden_TBH.dtype, tensor_kwargs)


def _signature(shape, dtype, tensor_kwargs: Dict[str, torch.Tensor]) -> Tuple:
    return (shape, dtype, tuple(sorted((name, tuple(t.shape), t.dtype) for name, t in tensor_kwargs.items())))


def graphable_kwargs(args: Sequence, kwargs: Dict) -> Optional[Dict[str, torch.Tensor]]:
    """A layer call's keyword tensors (the graph's static inputs besides the hidden states),
    or None where the call cannot replay a graph: extra positional values, a keyword tensor
    that needs a gradient (e.g. a learned attention bias), or a keyword value that is neither
    a tensor nor None (packed-sequence parameters, an inference context)."""
    if any(a is not None for a in args):
        return None
    tensors = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and not value.requires_grad:  # (a static input gets no gradient)
            tensors[name] = value
        elif value is not None:
            return None
    return tensors


def _graphed_forward(layer, captured: _Captured):
    eager = type(layer).forward.__get__(layer)

    def forward(hidden_states, *args, **kwargs):
        tensors = None if not (torch.is_grad_enabled() and layer.training) else graphable_kwargs(args, kwargs)
        if tensors is None or call_signature(hidden_states, tensors) != captured.signature:
            return eager(hidden_states, *args, **kwargs)  # a partial, masked or evaluation pass
        captured.replays += 1
        _run_submodule_pre_hooks(layer)
        return _Replay.apply(captured, hidden_states, tensors, *captured.params), None

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
    return _modules_of(model, MoELayer)


def transformer_layers(model) -> List[torch.nn.Module]:
    """The transformer layers of ``model`` (a module or a list of model chunks), in forward order."""
    return _modules_of(model, TransformerLayer)


def _modules_of(model, kind) -> List[torch.nn.Module]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, kind)]


# --- the capture in any training loop ------------------------------------------------------

_captures: List[LayerGraphs] = []  # installed by capture_layers, oldest first


def active_captures() -> List[LayerGraphs]:
    """The layer graphs (F11) installed in this process (what a loop can ask about replays)."""
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


def capture_layers(layers, shape: Tuple[int, ...], dtype: torch.dtype, config, when: str,
                   kwargs: Optional[Dict[str, torch.Tensor]] = None) -> LayerGraphs:
    """The one capture every loop reaches: ``layers`` (in forward order; MoE layers, or
    transformer layers whole) for micro-batches of ``shape`` and calls with the keyword tensors
    ``kwargs`` has (their values are copied in), installed so that their next training calls
    replay; one line says so."""
    from megatron.core.fp8_utils import get_fp8_context

    tick = time.time()
    device = torch.cuda.current_device()
    # The sample and the warm-up's output gradients are random: the training's own random
    # stream (dropout elsewhere in the model) must go on as if there had been no capture.
    with torch.random.fork_rng(devices=[device]), _router_logs_kept():
        sample_TBH = torch.randn(shape, dtype=dtype, device=device)
        graphs = LayerGraphs(layers, sample_TBH, context=lambda: get_fp8_context(config),
                                sample_kwargs=kwargs).install()
    _captures.append(graphs)
    whole = graph_scope(config) is GraphScope.WHOLE_LAYER
    what = "transformer layers (attention and MoE)" if whole else "MoE layers"
    _print_rank0(f"moe_patches: captured {len(layers)} {what} as CUDA graphs (forward and backward, "
                 f"input {list(shape)}) {when}, in {time.time() - tick:.1f} s")
    return graphs


def release(graphs: LayerGraphs) -> None:
    """Undo ``capture_layers``: the layers run eagerly again and the graphs can be freed."""
    graphs.uninstall()
    if graphs in _captures:
        _captures.remove(graphs)


def _steps(count: int) -> str:
    return f"{count} eager step{'s' if count != 1 else ''}"


class DroplessMoEGraphHelper:
    """megatron-core's ``TECudaGraphHelper`` as ``apply()`` installs it.

    Loops build it with ``--cuda-graph-impl transformer_engine`` and call
    ``create_cudagraphs()`` after the warm-up steps. A config that graphs dropless MoE layers
    gets this helper, which captures them with ``capture_layers``: the MoE layers for the
    micro-batch's shape, or the transformer layers whole with the keyword tensors (rotary
    embeddings, attention mask) of their last training call, noted by a forward pre-hook until
    the capture. Any other config gets the stock helper itself (decided here, once).
    """

    def __new__(cls, model, config, seq_length, micro_batch_size, optimizers=()):
        if not graph_scope(config).by_layer:
            return _STOCK_TE_HELPER(model, config, seq_length, micro_batch_size, list(optimizers))
        return super().__new__(cls)

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=()):
        self.config = config
        self.calls = _Calls()
        if graph_scope(config) is GraphScope.WHOLE_LAYER:
            self.layers = transformer_layers(model)
            self.hooks = [layer.register_forward_pre_hook(self.calls.hook, with_kwargs=True) for layer in self.layers]
        else:
            self.layers = moe_layers(model)
            self.hooks = []
            # Tokens per micro-batch as the MoE layer sees them (TP > 1 is refused by the plan's graph_blocker).
            shape = (seq_length // config.context_parallel_size, micro_batch_size, config.hidden_size)
            for layer in self.layers:
                self.calls.seen[layer] = (shape, config.params_dtype, {})
        self.graphs: List[LayerGraphs] = []

    def graphs_created(self) -> bool:
        return bool(self.graphs)

    def create_cudagraphs(self) -> None:
        for hook in self.hooks:
            hook.remove()
        when = f"after {_steps(self.config.cuda_graph_warmup_steps)} (--cuda-graph-impl transformer_engine)"
        self.graphs = self.calls.capture(self.layers, self.config, when)

    def cuda_graph_set_manual_hooks(self) -> None:
        """Nothing to set: a replay runs the skipped submodules' forward pre-hooks itself."""

    def delete_cuda_graphs(self) -> None:
        for graphs in self.graphs:
            release(graphs)
        self.graphs = []


class _Calls:
    """The training calls of the layers to capture: each layer's input shape and dtype and the
    keyword tensors of its last call (what its graph is made for)."""

    def __init__(self):
        self.seen: Dict[torch.nn.Module, Tuple[Tuple[int, ...], torch.dtype, Dict[str, torch.Tensor]]] = {}

    def note(self, layer, hidden_TBH, kwargs) -> None:
        tensors = graphable_kwargs((), {k: v for k, v in kwargs.items() if k != "hidden_states"})
        if tensors is not None:
            self.seen[layer] = (tuple(hidden_TBH.shape), hidden_TBH.dtype,
                                {name: t.detach() for name, t in tensors.items()})

    def hook(self, layer, args, kwargs):
        if layer.training and torch.is_grad_enabled():
            self.note(layer, args[0] if args else kwargs["hidden_states"], kwargs)

    def capture(self, layers, config, when: str) -> List[LayerGraphs]:
        """Capture ``layers`` that had a graphable call, those with the same call together."""
        groups: Dict[Tuple, Tuple[list, Tuple]] = {}
        for layer in layers:
            if layer in self.seen:
                shape, dtype, kwargs = self.seen.pop(layer)
                groups.setdefault(_signature(shape, dtype, kwargs), ([], (shape, dtype, kwargs)))[0].append(layer)
        return [capture_layers(group, shape, dtype, config, when, kwargs)
                for group, (shape, dtype, kwargs) in groups.values()]


class DroplessMoEGraphManager:
    """The graph manager ``apply()`` gives a transformer layer under ``--cuda-graph-impl local``
    whose graphs take in a dropless MoE layer: the MoE layer alone (scope ``moe``) or the
    whole layer (``whole_layer``: no scope, or ``attn moe``; dense layers of the model too).

    megatron-core hands every call of the layer to its manager. This one runs the layer
    eagerly and notes what to capture on training calls; the capture happens in
    ``create_cudagraphs`` at the end of a step, after which the noted layer replays.
    """

    def __init__(self, whole_layer: bool = False):
        self.whole_layer = whole_layer

    def __call__(self, layer, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "dynamic_inference_decode_only"}
        if layer.training and torch.is_grad_enabled():
            hidden_TBH = args[0] if args else kwargs["hidden_states"]
            if self.whole_layer:
                if len(args) <= 1:  # (megatron-core passes keywords; other positional values cannot replay)
                    _local_captures.note(layer, hidden_TBH, kwargs)
            else:
                _local_captures.note(layer.mlp, hidden_TBH, {})
        return torch.nn.Module.__call__(layer, *args, **kwargs)


class _LocalCaptures:
    """The layers that ran training steps under ``DroplessMoEGraphManager``, captured together
    after ``--cuda-graph-warmup-steps`` such steps (at least one: the shape of a micro-batch
    is known only once one has run)."""

    def __init__(self):
        self.calls = _Calls()
        self.captured = weakref.WeakSet()
        self.trained_since_last_step = False
        self.steps = 0
        self.config = None

    def note(self, layer, hidden_TBH, kwargs) -> None:
        if layer not in self.captured:
            self.calls.note(layer, hidden_TBH, kwargs)
            self.config = layer.config
        self.trained_since_last_step = True

    def end_of_step(self) -> None:
        if not self.trained_since_last_step:
            return  # an evaluation pass, or no such layer
        self.trained_since_last_step = False
        self.steps += 1
        if not self.calls.seen or self.steps < max(1, self.config.cuda_graph_warmup_steps):
            return
        layers = list(self.calls.seen)
        self.captured.update(layers)
        self.calls.capture(layers, self.config, f"after {_steps(self.steps)} (--cuda-graph-impl local)")


_local_captures = _LocalCaptures()


def create_cudagraphs():
    """megatron-core's ``create_cudagraphs()`` (the schedules call it after every
    forward-backward under ``--cuda-graph-impl local``), then the capture of the MoE layers
    that ``DroplessMoEGraphManager`` noted."""
    result = _STOCK_CREATE_CUDAGRAPHS()
    _local_captures.end_of_step()
    return result


def _builds_moe_layer(spec) -> bool:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, MoELayer)


def manager_factory(layer_class, stock_factory):
    """``layer_class.create_mcore_cudagraph_manager`` for apply(): a dropless MoE layer under
    the moe scope gets DroplessMoEGraphManager (the patch set's capture), anything else what
    ``stock_factory`` gives it."""

    def create_mcore_cudagraph_manager(self, config):
        scope = graph_scope(config)
        if scope is GraphScope.WHOLE_LAYER:
            self.cudagraph_manager = DroplessMoEGraphManager(whole_layer=True)
        elif scope is GraphScope.MOE_LAYER and _builds_moe_layer(self.submodules_config.mlp):
            self.cudagraph_manager = DroplessMoEGraphManager()
        else:
            stock_factory(self, config)

    create_mcore_cudagraph_manager.__doc__ = (
        f"{layer_class.__name__}'s graph manager factory; under graphs of dropless MoE layers (the moe "
        "scope: a layer with an MoE layer; the whole layer: every layer) the layer gets "
        "DroplessMoEGraphManager (the patch set's capture), anything else the stock one.")
    return create_mcore_cudagraph_manager
