"""F11: the dropless MoE layer's forward and backward as CUDA graphs (EP = 1, or EP > 1
through F12's symmetric exchange).

With ``moe_device_tokens_per_expert`` the layer never waits for the GPU at EP = 1: the
router's counts stay on the device (F8), the alltoall/allgather dispatchers size every
buffer from tokens x top-k (``dispatchers.py``), and the ``grouped_mm`` / ``fp8_grouped_mm``
experts take device offsets. At EP > 1 F12's exchange keeps that true: its received tensors
have a static bound, its counts are all-gathered on the device, and its symmetric buffers
are allocated in the warm-up runs, before the capture. Such a layer can be captured;
``graph_blocker`` says why not where it cannot (the one table validation and capture both read).

megatron-core 0.16.1 refuses ``cuda_graph_scope=moe`` for dropless MoE; the patched
config accepts it when ``graph_blocker`` is silent and refuses it by name otherwise.

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

Rules of use (what a training loop with PP = 1 does): every call has the sample's shape;
each layer's forward and backward alternate as captured (forward of all layers, then
their backwards in reverse order, per micro-batch); the output and input gradient are
the graph's static buffers, valid until that layer's next replay. Under ``no_grad`` or
with another shape the layer runs eagerly. FP8: the graphs read the weights' cached FP8
copies; before a replay the backend refreshes them in place when an optimizer has stepped
(outside the graph: once per step, not per micro-batch).
"""

import contextlib
from typing import Callable, List, Optional, Sequence

import torch

from megatron.moe_patches.expert_table import backend_support, select_backend
from megatron.moe_patches.fields import patch_option
from megatron.moe_patches.symmetric_exchange import exchange_blocker

GRAPH_SAFE_BACKENDS = ("grouped_mm", "fp8_grouped_mm")


def graph_blocker(config) -> Optional[str]:
    """Why this config's MoE layer cannot be captured as one CUDA graph, or None."""
    if config.num_moe_experts is None:
        return "it has no MoE layer (num_moe_experts is not set)"
    if not patch_option(config, "moe_device_tokens_per_expert"):
        return "the MoE layer copies token counts to the host: set --moe-device-tokens-per-expert"
    if config.expert_model_parallel_size > 1:
        ep = f"--expert-model-parallel-size {config.expert_model_parallel_size}"
        if not patch_option(config, "moe_symmetric_exchange"):
            return (f"{ep}: NCCL's all-to-all takes host split sizes; add --moe-symmetric-exchange (F12) "
                    "or use EP 1")
        reason = exchange_blocker(config, config.expert_model_parallel_size)
        if reason is not None:
            return f"{ep}: the symmetric exchange cannot run here ({reason})"
    if config.tensor_model_parallel_size > 1 or (config.expert_tensor_parallel_size or 1) > 1:
        return "tensor parallelism > 1 (the dispatchers gather with host split sizes)"
    if config.pipeline_model_parallel_size > 1:
        return ("pipeline parallelism: micro-batches in flight would share the graph's static "
                "buffers")
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        return f"the {config.moe_token_dispatcher_type} dispatcher (graph-safe: alltoall, allgather)"
    if not config.moe_permute_fusion:
        return "the unfused permute selects tokens with a host sync: set --moe-permute-fusion"
    if config.moe_expert_capacity_factor is not None:
        return ("token dropping (--moe-expert-capacity-factor); megatron-core's own graphs cover "
                "drop-and-pad")
    if config.moe_router_padding_for_quantization:
        return "--moe-router-padding-for-quantization sizes the routing map on the host"
    if config.moe_input_jitter_eps:
        return "--moe-input-jitter-eps draws random numbers inside the layer"
    if config.moe_shared_expert_overlap:
        return "--moe-shared-expert-overlap runs the shared experts on a side stream"
    if config.fp8 and config.moe_shared_expert_intermediate_size:
        return "shared experts under FP8 keep Transformer Engine's FP8 state, which this capture does not manage"
    recomputed = set(config.recompute_modules or []) & {"moe", "moe_act", "shared_experts"}
    if config.recompute_granularity == "full" or (config.recompute_granularity == "selective" and recomputed):
        return "recompute of the MoE layer (--recompute-granularity / --recompute-modules)"
    if config.cpu_offloading or config.fine_grained_activation_offloading:
        return "activation offloading"
    backend = select_backend(config)
    if backend.name not in GRAPH_SAFE_BACKENDS:
        why = "; ".join(f"{name}: {reason}" for name, reason in backend_support(config).items()
                        if name in GRAPH_SAFE_BACKENDS and reason)
        return f"the {backend.name} expert backend takes host token counts ({why})"
    return None


def scope_names(scope) -> List[str]:
    """megatron-core's cuda_graph_scope (a string, a CudaGraphScope, or a list of either)
    as a list of scope names."""
    if scope is None:
        return []
    items = scope.split(",") if isinstance(scope, str) else scope if isinstance(scope, (list, tuple)) else [scope]
    return [getattr(item, "name", item) for item in items]


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
            reason = graph_blocker(layer.config)
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
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in self.captured:
                c.aliases = [p.detach().requires_grad_(True) for p in c.params]
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
                with torch.cuda.graph(c.bwd_graph, **capture):
                    c.static_grad_x, c.static_grad_params = c.run_backward(c.static_out)
        torch.cuda.current_stream().wait_stream(stream)
        for layer, saved in zip(self.layers, buffers):
            for name, buffer in layer.named_buffers():
                buffer.copy_(saved[name])
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
        return _Replay.apply(captured, hidden_states, *captured.params), None

    return forward


def moe_layers(model) -> List[torch.nn.Module]:
    """The MoE layers of ``model`` (a module or a list of model chunks), in forward order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
