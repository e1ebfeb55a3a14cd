"""One plan per config: what the MoE layer runs, and why not something else.

``plan_for(config)`` answers, once per config, every "can this run here" question of the
patch set, each in a module of its own that reads alone:

- ``plan/backends.py``: the expert backend (and why each preferred one cannot run), whether
  single grouped parameters can be held (F5), whether the experts add their weight
  gradients into main_grad (F13) and whether the TE backend hands TE's GroupedLinear the
  device token counts (F8); ``register_backend`` adds a backend;
- ``plan/padding.py``: who pads the routed tokens for quantized experts and to what
  alignment (F1/F3);
- ``plan/exchange.py``: the expert-parallel exchange and the dispatcher's options (F8, F12);
- ``plan/graphs.py``: whether the MoE layer can be captured as a CUDA graph (F11);
- ``plan/sizes.py``: the config's precision and parallel sizes, as all of them read them.

This module combines them into the plan (``MoEPlan``, ``make_plan``) and caches it. Config
validation, the experts' and the dispatchers' construction and the graph capture read it;
nothing else decides. Each refusal keeps its reason, and what falls back from what the config
asked for is logged once (``MoEPlan.log_choices``, called where the layer is built).

Process facts (CUDA, the GPU's capability, Triton, Transformer Engine's kernels, DeepGEMM,
deep_ep's HybridEP) are asked of ``capabilities`` by the rules, and ``capabilities.MachineFacts``
collects them as the cache key; the parallel sizes come from the config (``expert_model_parallel_size``,
``expert_tensor_parallel_size``), which the dispatchers check against their process groups.

The plan is cached on the config with a fingerprint of its field values and the machine
facts: a config changed after construction, a backend registered since or a fact changed
(a test's stand-in) gets a new plan at its next ``plan_for``.
"""

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Type

import torch

import megatron.moe_patches.plan.backends as backends
from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.backend import ExpertBackend
from megatron.moe_patches.experts.padding import PaddingPlan
from megatron.moe_patches.fields import log_once
from megatron.moe_patches.graph_scopes import GraphScope, graph_scope, scope_names
from megatron.moe_patches.plan.backends import (
    FALLBACK,
    backend_blocker,
    fallback_said,
    register_backend,
    single_grouped_refusal,
    te_device_splits,
    wgrad_into_main_grad,
)
from megatron.moe_patches.plan.exchange import (
    ALLGATHER,
    ALLTOALL,
    EP1_NOTHING_TO_EXCHANGE,
    FLEX,
    SYMMETRIC_MEMORY,
    ExchangeChoice,
    choose_exchange,
    exchange_config_errors,
)
from megatron.moe_patches.plan.graphs import full_iteration_blocker, graph_blocker
from megatron.moe_patches.plan.padding import choose_padding, fused_permute_pad_blocker, static_padding_blocker
from megatron.moe_patches.plan.sizes import ep_size, expert_tp_size, precision_of

__all__ = [
    "MoEPlan", "BackendSupport", "Note", "make_plan", "plan_for", "fingerprint",
    "FALLBACK", "register_backend", "backend_blocker",
    "fused_permute_pad_blocker", "static_padding_blocker",
    "ALLTOALL", "SYMMETRIC_MEMORY", "ALLGATHER", "FLEX", "EP1_NOTHING_TO_EXCHANGE", "ExchangeChoice",
    "exchange_config_errors",
    "GraphScope", "graph_scope", "scope_names",
    "precision_of", "expert_tp_size", "ep_size",
]

logger = logging.getLogger(__name__)


class BackendSupport(NamedTuple):
    name: str  # an expert backend's name
    refusal: Optional[str]  # why it cannot run this config here, or None


class Note(NamedTuple):
    level: int  # logging level
    line: str  # a fallback from what the config asked for


@dataclass(frozen=True)
class MoEPlan:
    """What a config's MoE layers run here, each refusal with its reason."""

    backend: Type[ExpertBackend]  # the experts' compute
    backend_support: Tuple[BackendSupport, ...]  # every backend, preferred first
    padding: PaddingPlan  # who pads the routed tokens, to what alignment
    exchange: ExchangeChoice  # the expert-parallel exchange and the dispatcher's options
    single_grouped_refusal: Optional[str]  # why moe_single_grouped_weight/_bias cannot be held, or None
    graph_blocker: Optional[str]  # why the MoE layer cannot be one CUDA graph, or None
    ep_size: int  # the parallel sizes the plan was made for (the config's)
    expert_tp_size: int
    notes: Tuple[Note, ...]  # fallbacks from what the config asked for
    # gradient_accumulation_fusion: the experts add their weight gradients into main_grad in the GEMM
    wgrad_into_main_grad: bool = False
    # the TE backend hands TE's GroupedLinear the device counts too (m_splits_tensor, F8)
    te_device_splits: bool = False
    graph_scope: GraphScope = GraphScope.NONE  # what the CUDA graphs capture (plan/graphs.py decides)
    full_iteration_blocker: Optional[str] = None  # why that graph cannot hold the MoE layers
    # the patch set's kernels run in Triton (else their PyTorch twins: Triton is not importable)
    triton_kernels: bool = True

    @property
    def graph_unit(self) -> str:
        """What F11's graph holds: the transformer layer whole, or the MoE layer."""
        return "transformer layer" if self.graph_scope is GraphScope.WHOLE_LAYER else "MoE layer"

    @property
    def full_iteration(self) -> bool:
        """Whether the config asks for megatron-core's graph of the whole iteration."""
        return self.graph_scope is GraphScope.FULL_ITERATION

    @property
    def backend_refusals(self) -> Tuple[BackendSupport, ...]:
        """(name, reason) of each backend preferred to the chosen one."""
        names = [support.name for support in self.backend_support]
        return self.backend_support[:names.index(self.backend.name)]

    def lines(self) -> Tuple[str, ...]:
        """The plan as a reader wants it: each decision, then why the alternatives were not taken."""
        padding = self.padding
        exchange = self.exchange
        said = [
            f"expert backend: {self.backend.name}",
            *(f"  not {name}: {reason}" for name, reason in self.backend_refusals),
            "padding: none" if padding.align is None else
            f"padding: each expert's rows to a multiple of {padding.align}, by the {padding.padded_by}"
            + (f" ({padding.reason})" if padding.reason else "")
            + (", static row count" if padding.static_rows else ""),
            f"exchange: {exchange.name}" + (f" (not symmetric memory: {exchange.reason})" if exchange.reason else "")
            + f"; token counts on the {'device' if exchange.device_counts else 'host'}"
            + ("; rows arrive grouped by local expert" if exchange.skips_chunk_sort else ""),
            f"parallel sizes: EP {self.ep_size}, expert TP {self.expert_tp_size}",
            f"CUDA graph of the {self.graph_unit}: " + ("can be captured" if self.graph_blocker is None
                                                         else f"no: {self.graph_blocker}"),
            "single grouped parameters: " + ("can be held" if self.single_grouped_refusal is None
                                             else f"no: {self.single_grouped_refusal}"),
            f"weight gradients into main_grad in the GEMM: {'yes' if self.wgrad_into_main_grad else 'no'}",
        ]
        if self.backend.runs_package_kernels:
            said.append("kernels: Triton" if self.triton_kernels
                        else "kernels: the PyTorch twins (Triton is not importable)")
        if padding.aligned_kernels is not None:
            said.append(f"experts' GEMMs on aligned groups: {padding.aligned_kernels}")
        if self.full_iteration:
            said.append("CUDA graph of the whole iteration: " + ("can hold the MoE layers"
                                                                if self.full_iteration_blocker is None
                                                                else f"no: {self.full_iteration_blocker}"))
        if self.backend.name == "te":
            said.append("TE's GroupedLinear takes the device token counts: "
                        + ("yes" if self.te_device_splits else "no, megatron-core copies them to the host"))
        return tuple(said) + tuple(f"note: {note.line}" for note in self.notes)

    def log_choices(self) -> None:
        """Say, once per process, each fallback from what the config asked for."""
        for note in self.notes:
            log_once(logger, note.level, note.line)

    def check_parallel_sizes(self, ep: int, expert_tp: int) -> None:
        """The plan's sizes are the config's; a dispatcher's process groups must match them."""
        if (ep, expert_tp) != (self.ep_size, self.expert_tp_size):
            raise ValueError(
                f"The MoE process groups have EP {ep} and expert TP {expert_tp}, but the config says "
                f"expert_model_parallel_size={self.ep_size} and expert_tensor_parallel_size="
                f"{self.expert_tp_size}: build the config with the sizes the groups have.")


def make_plan(config, facts: Optional[cap.MachineFacts] = None) -> MoEPlan:
    """The plan for ``config`` in this process, computed afresh (``plan_for`` caches it);
    ``facts``: the machine facts read for it, where the caller has them."""
    facts = facts or cap.machine_facts()
    notes = []
    blockers = [(backend, backend_blocker(backend, config)) for backend in backends.BACKENDS]
    backend = next((b for b, reason in blockers if reason is None), FALLBACK)
    for refused, reason in blockers:
        if refused is backend:
            break
        if fallback_said(refused, config):
            notes.append((refused.fallback_log_level,
                          f"{refused.requested_by}: not the {refused.name} expert backend because of {reason}"))
    blockers.append((FALLBACK, None))
    support = tuple(BackendSupport(b.name, reason) for b, reason in blockers)
    padding = choose_padding(config, backend, notes)
    exchange = choose_exchange(config, backend, padding, notes)
    wgrad_fused = wgrad_into_main_grad(config, backend, notes)
    scope = graph_scope(config)
    return MoEPlan(
        backend=backend,
        backend_support=support,
        padding=padding,
        exchange=exchange,
        single_grouped_refusal=single_grouped_refusal(config, backend, support),
        graph_blocker=graph_blocker(config, backend, blockers, exchange, scope),
        ep_size=ep_size(config),
        expert_tp_size=expert_tp_size(config),
        notes=tuple(Note(*note) for note in notes),  # the rules' (level, line) pairs
        wgrad_into_main_grad=wgrad_fused,
        te_device_splits=te_device_splits(config, backend),
        graph_scope=scope,
        full_iteration_blocker=full_iteration_blocker(config, backend, blockers, exchange, scope),
        triton_kernels=facts.triton,
    )


class _Same:
    """A field value compared by identity (functions, modules, objects without a value)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value


def _frozen(value):
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, enum.Enum)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(map(repr, value))))
    return _Same(value)


def fingerprint(config) -> tuple:
    """The config's field values, as they are now (lists copied: an in-place change counts)."""
    names = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else sorted(vars(config))
    return tuple(_frozen(getattr(config, name, None)) for name in names if name != _CACHE)


_CACHE = "_moe_patches_plan"


def plan_for(config) -> MoEPlan:
    """The plan for ``config``: computed once, and again only after a field of it changed, a
    backend was registered or a fact of the machine its rules read changed."""
    facts = cap.machine_facts()
    key = (backends.BACKENDS, facts, fingerprint(config))
    cached = getattr(config, _CACHE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = make_plan(config, facts)
    # configs are unhashable dataclasses: the plan rides on the object, outside its fields
    object.__setattr__(config, _CACHE, (key, plan))
    return plan
