"""One plan per config: what the MoE layer runs, and why not something else.

``plan_for(config)`` answers, once per config, every "can this run here" question of the
patch set: the expert backend (and why each preferred one cannot run), who pads the routed
tokens for quantized experts and to what alignment (F1/F3), the expert-parallel exchange
and the dispatcher's options (F8, F12), whether single grouped parameters can be held (F5),
whether the MoE layer can be captured as a CUDA graph (F11) and whether the TE backend hands
TE's GroupedLinear the device token counts (F8). Config validation, the experts' and the
dispatchers' construction and the graph capture read it; nothing else decides. Each refusal
keeps its reason, and what falls back from what the config asked for is logged once
(``MoEPlan.log_choices``, called where the layer is built).

Backends declare what they support as class attributes (``experts/backend.py``,
``ExpertBackend``); ``backend_blocker`` combines those declarations with the config, so a
rule common to several backends (expert TP, precision, activation, ...) is written once,
here. What a backend needs of this process (libraries, kernels, GPU) is its one
``unavailable`` class method. ``BACKENDS`` lists the optional backends, most preferred
first; megatron-core's own TE path (``FALLBACK``) runs what none of them can.

Process facts (CUDA, the GPU's capability, Triton, Transformer Engine's kernels) are read
here; the parallel sizes come from the config (``expert_model_parallel_size``,
``expert_tensor_parallel_size``), which the dispatchers check against their process groups.

The plan is cached on the config with a fingerprint of its field values: a config changed
after construction gets a new plan at its next ``plan_for``.
"""

import dataclasses
import enum
import importlib.util
import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple, Type

import torch
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.backend import BF16, FP4, FP8, ExpertBackend, TEBackend
from megatron.moe_patches.experts.fp8_grouped_mm import FP8GroupedMMBackend
from megatron.moe_patches.experts.grouped_mm import GroupedMMBackend
from megatron.moe_patches.experts.op_fuser import OpFuserBackend
from megatron.moe_patches.experts.padding import (
    EXPERTS,
    HYBRIDEP,
    NOBODY,
    PERMUTE,
    ROUTER,
    TE_KERNEL_NEEDED,
    PaddingPlan,
)
from megatron.moe_patches.fields import flag_name, glu_activation, log_once, patch_option, uses_legacy_grouped_gemm

logger = logging.getLogger(__name__)

# --- expert backends ------------------------------------------------------------------------

# The optional backends, most preferred first: the first that can run a config runs its
# experts. Registering a backend is one line here (or ``register_backend`` at run time).
BACKENDS: Tuple[Type[ExpertBackend], ...] = (OpFuserBackend, FP8GroupedMMBackend, GroupedMMBackend)
FALLBACK: Type[ExpertBackend] = TEBackend  # megatron-core's own path: runs anything


def register_backend(backend: Type[ExpertBackend]) -> Type[ExpertBackend]:
    """Add ``backend`` behind the registered optional backends (ahead of the TE fallback).
    Returns it (usable as a class decorator). Plans made before are remade on next use."""
    global BACKENDS
    if backend not in BACKENDS:
        BACKENDS = BACKENDS + (backend,)
    return backend


NAMES = {"swiglu": "SwiGLU", "quick_geglu": "quick-GEGLU", "tensorwise": "tensorwise (current)",
         torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SINGLE_GROUPED = ("moe_single_grouped_weight", "moe_single_grouped_bias")


def _named(items) -> str:
    return " and ".join(NAMES.get(item, str(item)) for item in items)


def precision_of(config) -> str:
    """BF16 (no FP8/FP4 recipe), FP8 or FP4."""
    return FP4 if config.fp4 else FP8 if config.fp8 else BF16


def expert_tp_size(config) -> int:
    return config.expert_tensor_parallel_size or 1


def ep_size(config) -> int:
    return config.expert_model_parallel_size or 1


def _owner_ahead(backend, config) -> Optional[str]:
    """A backend ahead of ``backend`` that the config asks for by another field (in a precision
    it computes) owns the experts, whether or not it can run them."""
    ahead = BACKENDS[:BACKENDS.index(backend)] if backend in BACKENDS else ()
    for other in ahead:
        field = other.requested_by
        if (field and field != backend.requested_by and patch_option(config, field)
                and precision_of(config) in other.precisions):
            return f"the {other.name} backend owns the experts' compute ({flag_name(field)})"
    return None


def _precision_refusal(backend, config) -> Optional[str]:
    precision = precision_of(config)
    if precision not in backend.precisions:
        note = f" ({backend.precision_note})" if backend.precision_note else ""
        return f"it computes {_named(backend.precisions)} only{note}"
    if precision == FP8 and backend.fp8_recipes and config.fp8_recipe not in backend.fp8_recipes:
        return f"--fp8-recipe {config.fp8_recipe}: it implements {_named(backend.fp8_recipes)} scaling only"
    if config.fp8_param and not backend.fp8_params:
        return "--fp8-param-gather keeps FP8 parameters, which TE owns"
    return None


def _layer_refusal(backend, config) -> Optional[str]:
    """The rules about the experts' math and memory that several backends share."""
    if backend.params_dtypes and config.params_dtype not in backend.params_dtypes:
        return f"it needs {_named(backend.params_dtypes)} parameters (params_dtype={config.params_dtype})"
    if backend.activations and glu_activation(config) not in backend.activations:
        return f"it supports {_named(backend.activations)} activations only"
    if config.use_te_activation_func and not backend.te_activation_func:
        return "--use-te-activation-func: it computes megatron-core's own activation"
    if config.add_bias_linear and not backend.biases:
        return "expert biases (--disable-bias-linear drops them)"
    if expert_tp_size(config) > 1 and not backend.expert_tp:
        return "expert tensor parallelism > 1"
    if config.moe_apply_probs_on_input and not backend.probs_on_input:
        return "--moe-apply-probs-on-input"
    if config.delay_wgrad_compute and not backend.delayed_wgrad:  # TE's delayed step would find nothing
        return "--delay-wgrad-compute: it computes the experts' weight gradients in its own backward"
    if (config.cpu_offloading or config.fine_grained_activation_offloading) and not backend.activation_offloading:
        return "activation offloading of the experts (--cpu-offloading / --fine-grained-activation-offloading)"
    recomputed = config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or [])
    if recomputed and not backend.activation_recompute:
        return "recompute of the experts' activation (moe_act)"
    if any(patch_option(config, f) for f in SINGLE_GROUPED) and not backend.holds_single_grouped_params:
        return ("single grouped parameters (--moe-single-grouped-weight / --moe-single-grouped-bias): "
                f"{backend.single_grouped_missing}")
    return None


def backend_blocker(backend: Type[ExpertBackend], config) -> Optional[str]:
    """Why ``backend`` cannot run ``config`` here, or None when it can: its declarations and
    its ``unavailable`` probe against the config. The fallback runs anything."""
    if backend is FALLBACK:
        return None
    field = backend.requested_by
    if field and not patch_option(config, field):
        return f"{field} is off"
    return (_owner_ahead(backend, config) or _precision_refusal(backend, config)
            or backend.unavailable(config) or _layer_refusal(backend, config))


def _fallback_said(backend, config) -> bool:
    """A fallback from a backend the config asked for is worth a line, unless another backend
    the same field asks for serves this precision (grouped_mm is not asked for FP8)."""
    field, precision = backend.requested_by, precision_of(config)
    if not field or not patch_option(config, field):
        return False
    return not any(other is not backend and other.requested_by == field and precision in other.precisions
                   for other in BACKENDS)


# --- padding (F1, F3) ------------------------------------------------------------------------


def fused_permute_pad_blocker(config) -> Optional[str]:
    """Why our dispatchers cannot permute+pad in one pass for ``config`` (F1), or None."""
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        return f"the {config.moe_token_dispatcher_type} dispatcher pads by its own means"
    if not config.moe_permute_fusion:
        return "it needs --moe-permute-fusion"
    if config.moe_pad_expert_input_to_capacity:
        return "--moe-pad-expert-input-to-capacity pads to capacity instead"
    if not (config.moe_grouped_gemm and config.transformer_impl == "transformer_engine"
            and not uses_legacy_grouped_gemm(config)):
        return "it needs TE grouped experts (--moe-grouped-gemm, transformer_impl=transformer_engine)"
    if expert_tp_size(config) > 1:
        return "expert tensor parallelism > 1 is not supported by it"
    return None


def _padding(config, backend, notes) -> PaddingPlan:
    """Who pads the routed tokens for quantized experts, and to what alignment. FP8/FP4: the
    recipe's GEMM alignment unless the backend needs another (1: any row count, nobody pads);
    bf16 pads nowhere."""
    if not (config.fp8 or config.fp4):
        return PaddingPlan(None, NOBODY)
    align = backend.required_alignment(config) or get_align_size_for_quantization(config)
    if align == 1:
        return _aligned_groups(config, backend, notes)
    if config.moe_router_padding_for_quantization:
        return PaddingPlan(align, ROUTER)
    if config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep":
        return PaddingPlan(align, HYBRIDEP)
    reason = fused_permute_pad_blocker(config)
    if reason is not None:
        notes.append((logging.INFO, f"F1 fused permute+pad off: {reason}; experts pad themselves."))
        return PaddingPlan(align, EXPERTS, reason)
    if not cap.te_fused_permute_pad():
        notes.append((logging.WARNING, f"F1 fused permute+pad needs {TE_KERNEL_NEEDED}; installed TE: "
                                       f"{cap.te_version()}. Falling back to permute + explicit padding."))
        return PaddingPlan(align, EXPERTS, f"it needs {TE_KERNEL_NEEDED}")
    return PaddingPlan(align, PERMUTE)


def static_padding_blocker(config) -> Optional[str]:
    """Why our dispatchers cannot pad each expert's rows into a static row count with the
    counts on the device (graph-safe: ``StaticPaddedPermute``) for ``config``, or None."""
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        return f"the {config.moe_token_dispatcher_type} dispatcher"
    if ep_size(config) > 1 or expert_tp_size(config) > 1:
        return "expert parallelism > 1 (the padded row count is static at one rank only)"
    if not patch_option(config, "moe_device_tokens_per_expert"):
        return "it needs --moe-device-tokens-per-expert"
    if not config.moe_permute_fusion:
        return "it needs --moe-permute-fusion"
    if config.moe_expert_capacity_factor is not None or config.moe_router_padding_for_quantization:
        return "it needs dropless routing without router padding"
    if not cap.te_fused_permute_pad():
        return f"it needs {TE_KERNEL_NEEDED}"
    return None


def _aligned_groups(config, backend, notes) -> PaddingPlan:
    """A backend that takes any rows may run faster kernels on groups aligned by the
    dispatcher (``aligned_groups``): they are padded where that stays graph-safe."""
    align, kernels = backend.aligned_groups(config)
    if align is None:
        return PaddingPlan(None, NOBODY)
    reason = static_padding_blocker(config)
    if reason is not None:
        notes.append((logging.INFO, f"the {backend.name} experts keep their other kernels, not {kernels}: "
                                    f"those need each expert's rows padded to {align} by the dispatcher, and "
                                    f"{reason}."))
        return PaddingPlan(None, NOBODY)
    quantized_rows = backend.quantized_rows(config)
    writes = " and writes their FP8 copy in the same pass" if quantized_rows else ""
    notes.append((logging.INFO, f"the {backend.name} experts run {kernels}; the dispatcher pads each expert's "
                                f"rows to {align}{writes}."))
    return PaddingPlan(align, PERMUTE, static_rows=True, quantized_rows=quantized_rows)


# --- the exchange and the dispatcher's options (F8, F12) -------------------------------------

ALLTOALL, SYMMETRIC_MEMORY, ALLGATHER, FLEX = "alltoall", "symmetric_memory", "allgather", "flex"

EP1_NOTHING_TO_EXCHANGE = (
    "moe_symmetric_exchange (--moe-symmetric-exchange) has nothing to exchange at "
    "expert_model_parallel_size=1: every expert is local and the alltoall dispatcher already keeps "
    "the token counts on the GPU (--moe-device-tokens-per-expert); the symmetric exchange runs at EP > 1 only."
)


@dataclass(frozen=True, kw_only=True)  # eight fields: each named where it is built
class ExchangeChoice:
    name: str  # ALLTOALL (NCCL's all-to-all) | SYMMETRIC_MEMORY | ALLGATHER | FLEX
    reason: Optional[str]  # why not SYMMETRIC_MEMORY where moe_symmetric_exchange asks for it
    device_counts: bool  # the dispatcher hands the experts device-resident token counts (F8)
    skips_chunk_sort: bool  # alltoall: received rows are already grouped by local expert
    pad_align: Optional[int]  # the dispatcher permutes into this alignment (F1), else None
    static_pad_rows: bool  # and into a static row count, counts on the device (one rank)
    contradictions: Tuple[str, ...]  # what in the config contradicts moe_symmetric_exchange
    quantized_rows: bool = False  # static_pad_rows: the permute writes the rows' FP8 copy too


def exchange_config_errors(config) -> list:
    """What in ``config`` contradicts ``moe_symmetric_exchange`` (static: checked at config
    validation, before any GPU work)."""
    if not patch_option(config, "moe_symmetric_exchange"):
        return []
    flag = "moe_symmetric_exchange=True (--moe-symmetric-exchange)"
    errors = []
    if config.moe_token_dispatcher_type != "alltoall":
        errors.append(f"{flag} replaces the alltoall dispatcher's exchange: set "
                      f"moe_token_dispatcher_type='alltoall', not {config.moe_token_dispatcher_type!r}.")
    if not patch_option(config, "moe_device_tokens_per_expert"):
        errors.append(f"{flag} hands the experts device token counts: also set "
                      "moe_device_tokens_per_expert=True (--moe-device-tokens-per-expert).")
    if expert_tp_size(config) > 1:
        errors.append(f"{flag} needs expert_tensor_parallel_size=1 (it does not split tokens over TP ranks).")
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        errors.append(f"{flag} is for dropless MoE: unset moe_expert_capacity_factor and "
                      "moe_pad_expert_input_to_capacity.")
    if config.moe_router_padding_for_quantization:
        errors.append(f"{flag} needs tokens x top-k rows per rank: unset moe_router_padding_for_quantization.")
    if config.overlap_moe_expert_parallel_comm:
        errors.append(f"{flag} runs one exchange at a time through shared buffers: unset "
                      "overlap_moe_expert_parallel_comm (--overlap-moe-expert-parallel-comm).")
    return errors


def symmetric_exchange_blocker(config, backend, padding: PaddingPlan) -> Optional[str]:
    """Why this process cannot run the symmetric exchange for ``config`` (EP > 1) with these
    experts (the rest of the rules after ``exchange_config_errors``), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not cap.triton_available():
        return "Triton is not installed"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return f"torch {torch.__version__} has no symmetric memory"
    if padding.dispatcher_pads:
        return "the dispatcher pads each expert's rows for quantization (F1), which this exchange does not"
    if not backend.takes_device_counts:
        takers = " or ".join(b.name for b in BACKENDS if b.takes_device_counts)
        return f"the experts run the {backend.name} backend, which needs host split sizes ({takers} needed)"
    return None


def _exchange(config, backend, padding: PaddingPlan, notes) -> ExchangeChoice:
    dispatcher = config.moe_token_dispatcher_type
    device_tokens = bool(patch_option(config, "moe_device_tokens_per_expert"))
    one_rank = ep_size(config) == 1 and expert_tp_size(config) == 1
    pad_align = padding.align if padding.dispatcher_pads else None
    reason, name = None, dispatcher
    if patch_option(config, "moe_symmetric_exchange") and ep_size(config) == 1:
        # Accepted (one recipe serves EP 1 and 2; a checkpoint may restore it into an EP 1
        # run) and said to exchange nothing; the machine is not asked.
        reason = "expert parallelism is 1 (nothing to exchange)"
        if dispatcher == ALLTOALL:
            notes.append((logging.WARNING, EP1_NOTHING_TO_EXCHANGE))
    elif patch_option(config, "moe_symmetric_exchange"):
        reason = symmetric_exchange_blocker(config, backend, padding)
        if dispatcher == ALLTOALL and reason is not None:
            notes.append((logging.WARNING, "moe_symmetric_exchange: the expert-parallel exchange stays "
                                           f"NCCL's all-to-all because {reason}"))
        elif dispatcher == ALLTOALL:
            name = SYMMETRIC_MEMORY
            notes.append((logging.INFO, f"moe_symmetric_exchange: EP={ep_size(config)} tokens go through "
                                        "symmetric memory"))
    if dispatcher == ALLGATHER:
        # Counts stay on the device only where the permuted row count is tokens x top-k.
        device_counts = (device_tokens and (pad_align is None or padding.static_rows) and one_rank
                         and config.moe_permute_fusion and config.moe_expert_capacity_factor is None
                         and not config.moe_router_padding_for_quantization)
    else:
        device_counts = device_tokens and dispatcher == ALLTOALL
    # One source rank, no TP: sorting chunks by local expert keeps them in place; the
    # symmetric exchange lands rows sorted by local expert already.
    skips_chunk_sort = dispatcher == ALLTOALL and ((device_tokens and one_rank) or name == SYMMETRIC_MEMORY)
    return ExchangeChoice(
        name=name,
        reason=reason,
        device_counts=bool(device_counts),
        skips_chunk_sort=skips_chunk_sort,
        pad_align=pad_align,
        static_pad_rows=padding.static_rows,
        contradictions=tuple(exchange_config_errors(config)),
        quantized_rows=padding.quantized_rows,
    )


# --- CUDA graphs of the MoE layer (F11) ------------------------------------------------------


def graphs_dropless_moe(config) -> bool:
    """Whether the config asks for CUDA graphs of dropless MoE layers (megatron-core 0.16.1
    graphs only drop-and-pad MoE layers; F11 graphs dropless ones)."""
    return (
        config.cuda_graph_impl in ("local", "transformer_engine")
        and "moe" in scope_names(config.cuda_graph_scope)
        and config.num_moe_experts is not None
        and not (config.moe_expert_capacity_factor is not None and config.moe_pad_expert_input_to_capacity)
    )


def scope_names(scope) -> List[str]:
    """megatron-core's cuda_graph_scope (a string, a CudaGraphScope, or a list of either)
    as a list of scope names."""
    if scope is None:
        return []
    items = scope.split(",") if isinstance(scope, str) else scope if isinstance(scope, (list, tuple)) else [scope]
    return [getattr(item, "name", item) for item in items]



def _graph_blocker(config, backend, blockers, exchange: ExchangeChoice) -> Optional[str]:
    """Why this config's MoE layer cannot be captured as one CUDA graph, or None."""
    if config.num_moe_experts is None:
        return "it has no MoE layer (num_moe_experts is not set)"
    if not patch_option(config, "moe_device_tokens_per_expert"):
        return "the MoE layer copies token counts to the host: set --moe-device-tokens-per-expert"
    if ep_size(config) > 1:
        ep = f"--expert-model-parallel-size {ep_size(config)}"
        if not patch_option(config, "moe_symmetric_exchange"):
            return (f"{ep}: NCCL's all-to-all takes host split sizes; add --moe-symmetric-exchange (F12) "
                    "or use EP 1")
        if exchange.reason is not None:
            return f"{ep}: the symmetric exchange cannot run here ({exchange.reason})"
    if config.tensor_model_parallel_size > 1 or expert_tp_size(config) > 1:
        return "tensor parallelism > 1 (the dispatchers gather with host split sizes)"
    if config.pipeline_model_parallel_size > 1:
        return "pipeline parallelism: micro-batches in flight would share the graph's static buffers"
    if config.moe_token_dispatcher_type not in (ALLTOALL, ALLGATHER):
        return f"the {config.moe_token_dispatcher_type} dispatcher (graph-safe: alltoall, allgather)"
    if not config.moe_permute_fusion and exchange.name != SYMMETRIC_MEMORY:  # F12 sends tokens unpermuted
        return "the unfused permute selects tokens with a host sync: set --moe-permute-fusion"
    if config.moe_expert_capacity_factor is not None:
        return "token dropping (--moe-expert-capacity-factor); megatron-core's own graphs cover drop-and-pad"
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
    if not backend.takes_device_counts:
        why = "; ".join(f"{b.name}: {reason}" for b, reason in blockers if b.takes_device_counts and reason)
        return f"the {backend.name} expert backend takes host token counts ({why})"
    return None


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEPlan:
    """What a config's MoE layers run here, each refusal with its reason."""

    backend: Type[ExpertBackend]  # the experts' compute
    backend_support: Tuple[Tuple[str, Optional[str]], ...]  # every backend, preferred first: why not, or None
    padding: PaddingPlan  # who pads the routed tokens, to what alignment
    exchange: ExchangeChoice  # the expert-parallel exchange and the dispatcher's options
    single_grouped_refusal: Optional[str]  # why moe_single_grouped_weight/_bias cannot be held, or None
    graph_blocker: Optional[str]  # why the MoE layer cannot be one CUDA graph, or None
    ep_size: int  # the parallel sizes the plan was made for (the config's)
    expert_tp_size: int
    notes: Tuple[Tuple[int, str], ...]  # (level, line): fallbacks from what the config asked for
    # gradient_accumulation_fusion: the experts add their weight gradients into main_grad in the GEMM
    wgrad_into_main_grad: bool = False
    # the TE backend hands TE's GroupedLinear the device counts too (m_splits_tensor, F8)
    te_device_splits: bool = False

    @property
    def backend_refusals(self) -> Tuple[Tuple[str, str], ...]:
        """(name, reason) of each backend preferred to the chosen one."""
        names = [name for name, _ in self.backend_support]
        return self.backend_support[:names.index(self.backend.name)]

    def log_choices(self) -> None:
        """Say, once per process, each fallback from what the config asked for."""
        for level, line in self.notes:
            log_once(logger, level, line)

    def check_parallel_sizes(self, ep: int, expert_tp: int) -> None:
        """The plan's sizes are the config's; a dispatcher's process groups must match them."""
        if (ep, expert_tp) != (self.ep_size, self.expert_tp_size):
            raise ValueError(
                f"The MoE process groups have EP {ep} and expert TP {expert_tp}, but the config says "
                f"expert_model_parallel_size={self.ep_size} and expert_tensor_parallel_size="
                f"{self.expert_tp_size}: build the config with the sizes the groups have.")


def _single_grouped_refusal(config, backend, support) -> Optional[str]:
    asked = [f for f in SINGLE_GROUPED if patch_option(config, f)]
    if not asked or backend.holds_single_grouped_params:
        return None
    reasons = "; ".join(f"{name}: {why}" for name, why in support if why)
    holders = [b for b in BACKENDS if b.holds_single_grouped_params]
    names = " or ".join(b.name for b in holders)
    # the flags that ask for those backends, where the config has not set them yet
    unset = sorted({flag_name(b.requested_by) for b in holders
                    if b.requested_by and not patch_option(config, b.requested_by)})
    if unset:
        fix = (f"Use {' or '.join(unset)} (the {names} backend: bf16 or FP8 tensorwise or blockwise, "
               "SwiGLU/quick-GEGLU, ETP 1, Hopper)")
    else:
        fix = f"Remove what keeps the {names} backend from running (its reason above)"
    return (
        f"{'/'.join(asked)}=True needs an expert backend that holds grouped parameters, and none "
        f"can run this config ({reasons}). {fix} or drop the flag."
    )


def _wgrad_into_main_grad(config, backend, notes) -> bool:
    """Whether the experts add their weight gradients into main_grad in the GEMM (F13)."""
    if not getattr(config, "gradient_accumulation_fusion", False):
        return False
    if not backend.wgrad_into_main_grad:
        notes.append((logging.INFO, f"gradient_accumulation_fusion: the {backend.name} experts write their weight "
                                    "gradients in the parameters' dtype and DDP adds them to main_grad (not fused)"))
    return backend.wgrad_into_main_grad


def _te_device_splits(config, backend) -> bool:
    """Whether the TE backend's FCs take the device counts: the config asks for them and TE's
    module GroupedLinear takes ``m_splits_tensor`` (ROCm's TE)."""
    return (issubclass(backend, TEBackend) and bool(patch_option(config, "moe_device_tokens_per_expert"))
            and cap.te_grouped_linear_device_splits())


def make_plan(config) -> MoEPlan:
    """The plan for ``config`` in this process, computed afresh (``plan_for`` caches it)."""
    notes = []
    blockers = [(backend, backend_blocker(backend, config)) for backend in BACKENDS]
    backend = next((b for b, reason in blockers if reason is None), FALLBACK)
    for refused, reason in blockers:
        if refused is backend:
            break
        if _fallback_said(refused, config):
            notes.append((refused.fallback_log_level,
                          f"{refused.requested_by}: not the {refused.name} expert backend because of {reason}"))
    blockers.append((FALLBACK, None))
    support = tuple((b.name, reason) for b, reason in blockers)
    padding = _padding(config, backend, notes)
    exchange = _exchange(config, backend, padding, notes)
    wgrad_into_main_grad = _wgrad_into_main_grad(config, backend, notes)
    return MoEPlan(
        backend=backend,
        backend_support=support,
        padding=padding,
        exchange=exchange,
        single_grouped_refusal=_single_grouped_refusal(config, backend, support),
        graph_blocker=_graph_blocker(config, backend, blockers, exchange),
        ep_size=ep_size(config),
        expert_tp_size=expert_tp_size(config),
        notes=tuple(notes),
        wgrad_into_main_grad=wgrad_into_main_grad,
        te_device_splits=_te_device_splits(config, backend),
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
    """The plan for ``config``: computed once, and again only after a field of it changed (or
    a backend was registered)."""
    key = (BACKENDS, fingerprint(config))
    cached = getattr(config, _CACHE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = make_plan(config)
    # configs are unhashable dataclasses: the plan rides on the object, outside its fields
    object.__setattr__(config, _CACHE, (key, plan))
    return plan
