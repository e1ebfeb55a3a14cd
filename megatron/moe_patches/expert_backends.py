"""The experts' compute seam: what a backend is, and the TE backend.

The one patched experts class (``experts.PatchedTEGroupedMLP``) holds one backend object,
chosen once at construction from the config (``expert_table.select_backend``). A backend
owns the experts' forward, ``backward_dw`` and its checkpoint hook, and says, as class
methods, whether it can run a config (``blocker``), which quantization alignment it needs
(``required_alignment``) and whether it can hold single grouped parameters.

Backends: ``te`` (here: megatron-core's own TE GroupedLinear path), ``grouped_mm``
(``device_splits``, F8) and ``op_fuser`` (``op_fuser_grouped_mlp``, F4).

Tensor names carry their shape: ``x_TH`` is [tokens, hidden], ``w_EOI`` is
[experts, out, in], ``tokens_per_expert_E`` is [experts].
"""

import logging
from typing import Optional

import torch

from megatron.moe_patches.fields import log_once, patch_option

logger = logging.getLogger(__name__)

_host_copies = 0  # how many times host_tokens_per_expert copied (tests read it)


def host_tokens_per_expert(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """The one place the experts take the per-expert counts to the host."""
    global _host_copies
    if tokens_per_expert_E.is_cuda:
        _host_copies += 1
        return tokens_per_expert_E.cpu()
    return tokens_per_expert_E


def glu_activation(config) -> Optional[str]:
    """"swiglu" or "quick_geglu" for the gated activations the fused backends compute, else None."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if not config.gated_linear_unit:
        return None
    if config.activation_func is torch.nn.functional.silu:
        return "swiglu"
    if config.activation_func is quick_gelu:
        return "quick_geglu"
    return None


class ExpertBackend:
    """The experts' compute. Subclasses override what differs from megatron-core's TE path.

    ``experts`` is the patched TEGroupedMLP that owns this backend; the stock methods it
    inherits from megatron-core are reached through ``self.stock``.
    """

    name = "?"
    holds_single_grouped_params = False

    @classmethod
    def blocker(cls, config) -> Optional[str]:
        """Why this backend cannot run ``config``, or None when it can."""
        return None

    @classmethod
    def required_alignment(cls, config) -> Optional[int]:
        """Rows per expert this backend needs under FP8/FP4 when it differs from the
        recipe's own GEMM alignment, else None."""
        return None

    def __init__(self, experts):
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        self.experts = experts
        self.stock = TEGroupedMLP  # the unpatched methods, called with ``experts``

    def forward(self, x_TH, tokens_per_expert_E, probs_T):
        return self.stock.forward(self.experts, x_TH, host_tokens_per_expert(tokens_per_expert_E), probs_T)

    def backward_dw(self):
        return self.stock.backward_dw(self.experts)

    def sharded_state_dict(self, sharded: dict) -> dict:
        """Adjust the stock sharded state dict (layouts held differently in memory)."""
        return sharded


class TEBackend(ExpertBackend):
    """megatron-core's TE path: TE GroupedLinear per expert, counts copied to the host once."""

    name = "te"

    def __init__(self, experts):
        super().__init__(experts)
        from megatron.moe_patches import capabilities as cap

        if patch_option(experts.config, "moe_device_tokens_per_expert") and not cap.te_grouped_linear_device_splits():
            log_once(
                logger,
                logging.INFO,
                f"moe_device_tokens_per_expert: TE {cap.te_version()}'s GroupedLinear takes no "
                "m_splits_tensor; the TE expert backend copies tokens_per_expert to the host once per layer.",
            )
