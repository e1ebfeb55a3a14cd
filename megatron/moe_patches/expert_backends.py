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
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron.moe_patches import capabilities as cap
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

    Every method takes ``experts``, the patched TEGroupedMLP that owns this backend (a
    backend keeps no reference to it: no reference cycle keeps a dropped layer alive).
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

    # megatron-core's own methods. apply() rebinds the name TEGroupedMLP to the patched
    # class everywhere but in this package; stock() also undoes it should this module
    # ever be imported while the patches are on.
    stock = cap.stock(TEGroupedMLP)

    def __init__(self, experts):
        """Prepare ``experts`` for this backend (parameter layouts); called once."""

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        return self.stock.forward(experts, x_TH, host_tokens_per_expert(tokens_per_expert_E), probs_T)

    def backward_dw(self, experts):
        return self.stock.backward_dw(experts)

    def sharded_state_dict(self, experts, sharded: dict) -> dict:
        """Adjust the stock sharded state dict (layouts held differently in memory)."""
        return sharded


class TEBackend(ExpertBackend):
    """megatron-core's TE path: TE GroupedLinear per expert, counts copied to the host once."""

    name = "te"

    def __init__(self, experts):
        # The flag asked for no host copy; this backend still makes one: worth a warning.
        if patch_option(experts.config, "moe_device_tokens_per_expert"):
            te_splits = (
                "takes m_splits_tensor, which this version does not pass yet"
                if cap.te_grouped_linear_device_splits()
                else "takes no device splits (m_splits_tensor)"
            )
            log_once(
                logger,
                logging.WARNING,
                f"moe_device_tokens_per_expert: these experts run the TE backend (the log says why "
                f"not grouped_mm), and Transformer Engine {cap.te_version()}'s GroupedLinear {te_splits}: "
                "tokens_per_expert is copied to the host once per layer.",
            )
