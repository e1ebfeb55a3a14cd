"""F3: pad each expert's tokens for quantized GEMMs exactly once, in the right place.

``padding_plan(config)`` is the one place that decides, from the config and what
Transformer Engine offers, how many rows each expert's token count must be a multiple
of and which stage pads:

- ``router``: megatron-core's router already pads (``moe_router_padding_for_quantization``);
- ``hybridep``: HybridEP (flex dispatcher, hybridep backend) pads on device;
- ``permute``: our dispatchers permute straight into the padded layout (F1, fused
  permute+pad), where TE has the kernel and the dispatcher is alltoall/allgather;
- ``experts``: the experts pad themselves (TE's Fp8Padding), as stock megatron-core does;
- ``nobody``: bf16 needs no alignment.

The dispatchers (``dispatchers.py``) and the experts (``experts.py``) both read the plan
at construction, so the stage that pads and the stage that must not always agree; the
experts skip their own padding (``skip_routed_expert_padding``) whenever an earlier stage
aligned the tokens. Padding twice costs a copy of the activations and a host round trip,
and the host-side variant is not CUDA-graph safe. Upstream: NVIDIA/Megatron-LM#4071.
"""

import logging
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.table import select_backend
from megatron.moe_patches.fields import log_once, uses_legacy_grouped_gemm

logger = logging.getLogger(__name__)

NOBODY, ROUTER, HYBRIDEP, PERMUTE, EXPERTS = "nobody", "router", "hybridep", "permute", "experts"

TE_KERNEL_NEEDED = (
    "Transformer Engine with moe_permute_and_pad_with_probs and moe_unpermute(pad_offsets=) (TE >= 2.14)"
)


@dataclass(frozen=True)
class PaddingPlan:
    align: Optional[int]  # rows each expert's token count must be a multiple of; None: no padding
    padded_by: str  # NOBODY | ROUTER | HYBRIDEP | PERMUTE | EXPERTS

    @property
    def dispatcher_pads(self) -> bool:
        """Our dispatchers permute into the padded layout (F1)."""
        return self.padded_by == PERMUTE

    @property
    def experts_pad(self) -> bool:
        return self.padded_by == EXPERTS


def quantization_alignment(config) -> Optional[int]:
    """Rows each expert's token count must be a multiple of, or None when nothing needs it.

    FP8/FP4: the recipe's GEMM alignment (16; 32 for MXFP8/FP4), unless the experts'
    backend needs another (the op fuser's 256 where TE fuses the MLP into one kernel;
    every recipe alignment divides it; the FP8 grouped GEMM's 1: any row count). bf16
    pads nowhere.
    """
    if not (config.fp8 or config.fp4):
        return None
    align = select_backend(config).required_alignment(config) or get_align_size_for_quantization(config)
    return None if align == 1 else align


def _fused_permute_pad_blocker(config) -> Optional[str]:
    """Why our dispatchers cannot permute+pad in one pass for ``config``, or None."""
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        return f"the {config.moe_token_dispatcher_type} dispatcher pads by its own means"
    if not config.moe_permute_fusion:
        return "it needs --moe-permute-fusion"
    if config.moe_pad_expert_input_to_capacity:
        return "--moe-pad-expert-input-to-capacity pads to capacity instead"
    if not (
        config.moe_grouped_gemm
        and config.transformer_impl == "transformer_engine"
        and not uses_legacy_grouped_gemm(config)
    ):
        return "it needs TE grouped experts (--moe-grouped-gemm, transformer_impl=transformer_engine)"
    if (config.expert_tensor_parallel_size or 1) > 1:
        return "expert tensor parallelism > 1 is not supported by it"
    return None


def padding_plan(config) -> PaddingPlan:
    """Who pads the routed tokens for quantized experts, and to what alignment."""
    align = quantization_alignment(config)
    if align is None:
        return PaddingPlan(None, NOBODY)
    if config.moe_router_padding_for_quantization:
        return PaddingPlan(align, ROUTER)
    if config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep":
        return PaddingPlan(align, HYBRIDEP)
    reason = _fused_permute_pad_blocker(config)
    if reason is not None:
        log_once(logger, logging.INFO, f"F1 fused permute+pad off: {reason}; experts pad themselves.")
        return PaddingPlan(align, EXPERTS)
    if not cap.te_fused_permute_pad():
        log_once(
            logger,
            logging.WARNING,
            f"F1 fused permute+pad needs {TE_KERNEL_NEEDED}; installed TE: {cap.te_version()}. "
            "Falling back to permute + explicit padding.",
        )
        return PaddingPlan(align, EXPERTS)
    return PaddingPlan(align, PERMUTE)


def skip_routed_expert_padding(config) -> bool:
    """Whether the routed experts must leave their input unpadded: an earlier stage aligned it."""
    plan = padding_plan(config)
    return plan.align is not None and not plan.experts_pad
