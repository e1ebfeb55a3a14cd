"""The one table that answers "can expert backend X run this config here, and if not, why".

Config validation, the experts' construction and the padding plan all read it, so they
never disagree. ``BACKENDS`` lists the backends in order of preference: the first whose
``blocker`` says nothing runs the experts; ``te`` (megatron-core's own path) runs anything
the others cannot.
"""

import logging
from typing import Dict, Optional, Tuple, Type

from megatron.moe_patches.experts.grouped_mm import GroupedMMBackend
from megatron.moe_patches.experts.backend import ExpertBackend, TEBackend
from megatron.moe_patches.fields import log_once, patch_option
from megatron.moe_patches.experts.fp8_grouped_mm import FP8GroupedMMBackend
from megatron.moe_patches.experts.op_fuser import OpFuserBackend

logger = logging.getLogger(__name__)

BACKENDS: Tuple[Type[ExpertBackend], ...] = (OpFuserBackend, FP8GroupedMMBackend, GroupedMMBackend, TEBackend)

# The field that asks for each optional backend, and the precision it serves: a fallback
# from a backend the config asked for is worth a log line.
_REQUESTED_BY = {
    OpFuserBackend: ("use_transformer_engine_op_fuser", None),
    FP8GroupedMMBackend: ("moe_device_tokens_per_expert", True),
    GroupedMMBackend: ("moe_device_tokens_per_expert", False),
}


def backend_support(config) -> Dict[str, Optional[str]]:
    """Backend name -> None if it can run ``config``, else the reason it cannot."""
    return {backend.name: backend.blocker(config) for backend in BACKENDS}


def select_backend(config) -> Type[ExpertBackend]:
    """The backend the experts run for ``config``; each fallback from a requested backend
    is logged once with its reason."""
    for backend in BACKENDS:
        reason = backend.blocker(config)
        if reason is None:
            return backend
        field, fp8 = _REQUESTED_BY.get(backend, (None, None))
        if field is not None and patch_option(config, field) and fp8 in (None, bool(config.fp8)):
            level = logging.WARNING if backend is OpFuserBackend else logging.INFO
            log_once(logger, level, f"{field}: not the {backend.name} expert backend because of {reason}")
    return TEBackend


def single_grouped_refusal(config) -> Optional[str]:
    """Why ``moe_single_grouped_weight`` / ``_bias`` cannot be honoured for ``config``, or None.

    The one place that refuses it: config validation and the experts' construction call it.
    """
    asked = [f for f in ("moe_single_grouped_weight", "moe_single_grouped_bias") if patch_option(config, f)]
    if not asked or select_backend(config).holds_single_grouped_params:
        return None
    reasons = "; ".join(f"{name}: {why}" for name, why in backend_support(config).items() if why)
    return (
        f"{'/'.join(asked)}=True needs an expert backend that holds grouped parameters, and none "
        f"can run this config ({reasons}). Use --moe-device-tokens-per-expert (the grouped_mm "
        "backend: bf16, SwiGLU/quick-GEGLU, no bias, ETP 1, Hopper) or drop the flag."
    )
