"""Which expert backend runs a config's experts, and why each one preferred to it cannot.

Backends declare what they support as class attributes (``experts/backend.py``,
``ExpertBackend``); ``backend_blocker`` combines those declarations with the config, so a
rule common to several backends (expert TP, precision, activation, ...) is written once,
here, and a backend never tests the config or another backend itself. What a backend needs
of this process (libraries, kernels, GPU) is its one ``unavailable`` class method.

``BACKENDS`` lists the optional backends, most preferred first: the first that can run a
config runs its experts; megatron-core's own TE path (``FALLBACK``) runs what none of them
can. Every refusal keeps its reason, which the plan reports (``MoEPlan.backend_support``).

Also decided here, from the chosen backend: why single grouped parameters cannot be held
(F5), whether the experts add their weight gradients into main_grad in the GEMM (F13), and
whether the TE backend hands TE's GroupedLinear the device token counts (F8).
"""

import logging
from typing import Optional, Tuple, Type

import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.backend import FP8, ExpertBackend, TEBackend
from megatron.moe_patches.experts.fp8_grouped_mm import FP8GroupedMMBackend
from megatron.moe_patches.experts.grouped_mm import GroupedMMBackend
from megatron.moe_patches.experts.op_fuser import OpFuserBackend
from megatron.moe_patches.fields import flag_name, glu_activation, patch_option
from megatron.moe_patches.plan.sizes import expert_tp_size, precision_of

# The optional backends, most preferred first: the first that can run a config runs its
# experts. Registering a backend is one line here (or ``register_backend`` at run time).
# Read it as ``backends.BACKENDS`` from other modules: ``register_backend`` rebinds it.
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


def fallback_said(backend, config) -> bool:
    """A fallback from a backend the config asked for is worth a line, unless another backend
    the same field asks for serves this precision (grouped_mm is not asked for FP8)."""
    field, precision = backend.requested_by, precision_of(config)
    if not field or not patch_option(config, field):
        return False
    return not any(other is not backend and other.requested_by == field and precision in other.precisions
                   for other in BACKENDS)


def single_grouped_refusal(config, backend, support) -> Optional[str]:
    """Why the chosen ``backend`` cannot hold the single grouped parameters the config asks
    for (F5), naming what keeps each backend that can from running (``support``), or None."""
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


def wgrad_into_main_grad(config, backend, notes) -> bool:
    """Whether the experts add their weight gradients into main_grad in the GEMM (F13)."""
    if not getattr(config, "gradient_accumulation_fusion", False):
        return False
    if not backend.wgrad_into_main_grad:
        notes.append((logging.INFO, f"gradient_accumulation_fusion: the {backend.name} experts write their weight "
                                    "gradients in the parameters' dtype and DDP adds them to main_grad (not fused)"))
    return backend.wgrad_into_main_grad


def te_device_splits(config, backend) -> bool:
    """Whether the TE backend's FCs take the device counts: the config asks for them and TE's
    module GroupedLinear takes ``m_splits_tensor`` (ROCm's TE)."""
    return (issubclass(backend, TEBackend) and bool(patch_option(config, "moe_device_tokens_per_expert"))
            and cap.te_grouped_linear_device_splits())
