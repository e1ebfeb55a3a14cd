"""Who pads the routed tokens for quantized experts, and to what alignment (F1, F3).

FP8/FP4 GEMMs need each expert's row count to be a multiple of the recipe's alignment (or
of the one the backend asks for); padding twice costs a copy of the activations and a host
round trip, so exactly one stage pads (``experts/padding.py`` names the stages and holds the
``PaddingPlan`` both the dispatchers and the experts read). In order: the router where it
already pads, HybridEP where it runs, our dispatchers in the permute itself where they and
Transformer Engine can (F1, ``fused_permute_pad_blocker``), else the experts themselves.
bf16 pads nowhere.

A backend that takes any row count (alignment 1) pads nowhere, unless its faster kernels
want groups aligned by the dispatcher: those are padded into a static row count with the
counts on the device where that stays graph-safe (``static_padding_blocker``). Each time a
stage the config could use is refused, the reason goes into the plan's notes.
"""

import logging
from typing import Optional

from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.padding import (
    EXPERTS,
    HYBRIDEP,
    NOBODY,
    PERMUTE,
    ROUTER,
    TE_KERNEL_NEEDED,
    PaddingPlan,
)
from megatron.moe_patches.fields import patch_option, uses_legacy_grouped_gemm
from megatron.moe_patches.plan.sizes import ep_size, expert_tp_size


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


def choose_padding(config, backend, notes) -> PaddingPlan:
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
    return PaddingPlan(align, PERMUTE, static_rows=True, quantized_rows=quantized_rows, aligned_kernels=kernels)
