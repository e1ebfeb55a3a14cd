"""F3: the experts skip their own quantization padding when the tokens arrive padded.

Patches: ``TEGroupedMLP`` (megatron.core.transformer.moe.experts) is replaced by
``PaddingAwareTEGroupedMLP``, whose ``Fp8Padding``/``Fp8Unpadding`` become
pass-throughs when ``skip_routed_expert_padding(config)`` says an earlier stage
already aligned every expert's token count: the router
(``moe_router_padding_for_quantization``), HybridEP's on-device padding
(flex dispatcher, hybridep backend) or F1's fused permute+pad. Padding twice costs
a copy of the activations and a host round trip, and the host-side variant is not
CUDA-graph safe.

``quantization_alignment(config)`` is the one place that says how many rows each
expert's token count must be a multiple of. Upstream: NVIDIA/Megatron-LM#4071.
"""

from typing import Optional

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from megatron.moe_patches.config import patch_option

# TE's fused grouped-MLP kernel (SM100) takes quantized groups of 256 rows.
OP_FUSER_ALIGNMENT = 256


def quantization_alignment(config) -> Optional[int]:
    """Rows each expert's token count must be a multiple of, or None when nothing needs it.

    FP8/FP4: the recipe's GEMM alignment (16; 32 for MXFP8/FP4), or 256 with the op-fuser
    grouped MLP (F4) applied and switched on where TE fuses it into its grouped-MLP kernel
    (every recipe alignment divides 256). TE's basic ops (Hopper) need only the recipe's:
    256 there pads ~20 % more rows on fine-grained shapes for nothing. bf16 pads nowhere.
    """
    from megatron.moe_patches import capabilities as cap
    from megatron.moe_patches.installer import is_applied

    if not (config.fp8 or config.fp4):
        return None
    if (
        is_applied("F4")
        and patch_option(config, "use_transformer_engine_op_fuser")
        and cap.te_fused_grouped_mlp_kernel()
    ):
        return OP_FUSER_ALIGNMENT
    return get_align_size_for_quantization(config)


def dispatcher_pads_on_device(config) -> bool:
    """HybridEP (flex dispatcher, hybridep backend) pads each expert's tokens itself."""
    return config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep"


def skip_routed_expert_padding(config) -> bool:
    """Whether the routed experts must leave their input unpadded: an earlier stage aligned it."""
    from megatron.moe_patches.fused_permute_pad import fused_padding_alignment
    from megatron.moe_patches.installer import is_applied

    return bool(
        config.moe_router_padding_for_quantization
        or dispatcher_pads_on_device(config)
        or (is_applied("F1") and fused_padding_alignment(config) is not None)
    )


class _AlreadyPadded(torch.nn.Module):
    """Stands in for TE's Fp8Padding/Fp8Unpadding when the tokens arrive aligned."""

    def forward(self, tokens, tokens_per_expert):
        return tokens, tokens_per_expert


class _AlreadyUnpadded(torch.nn.Module):
    def forward(self, tokens, tokens_per_expert):
        return tokens


class PaddingAwareTEGroupedMLP(TEGroupedMLP):
    """TEGroupedMLP that pads only when no earlier stage did (F3)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self.skips_quantization_padding = hasattr(self, "quantization_padding") and (
            skip_routed_expert_padding(config)
        )
        if self.skips_quantization_padding:
            self.quantization_padding = _AlreadyPadded()
            self.quantization_unpadding = _AlreadyUnpadded()


def replacements():
    return [(TEGroupedMLP, PaddingAwareTEGroupedMLP)]
