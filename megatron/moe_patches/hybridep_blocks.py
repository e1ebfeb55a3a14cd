"""F2: HybridEP's permute/unpermute thread-block counts from the config.

Patches: ``_HybridEPManager`` (megatron.core.transformer.moe.token_dispatcher, the
flex dispatcher's HybridEP backend) is replaced by a subclass that creates the
shared HybridEP buffer itself before the first dispatch, passing
``moe_hybridep_num_blocks_permute`` / ``moe_hybridep_num_blocks_unpermute`` when the
installed deep_ep's ``HybridEPBuffer`` accepts them. megatron-core 0.16.1 creates
that buffer lazily inside ``fused_a2a`` with no way to pass them. ``None`` leaves the
choice to HybridEP; a deep_ep without the parameters gets one warning and the stock
call. Upstream: NVIDIA/Megatron-LM#4073 (dev), #4089 (main).
"""

import logging
import warnings

from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.fields import patch_option

logger = logging.getLogger(__name__)

BLOCK_FIELDS = {
    "moe_hybridep_num_blocks_permute": "num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute": "num_blocks_unpermute",
}


def hybridep_block_kwargs(config, buffer_class) -> dict:
    """The block-count keyword arguments for ``buffer_class(...)``: the ones set in the
    config, or none (with a warning) when the buffer does not take them."""
    wanted = {
        kwarg: patch_option(config, field)
        for field, kwarg in BLOCK_FIELDS.items()
        if patch_option(config, field) is not None
    }
    if not wanted:
        return {}
    if not all(cap.accepts_parameter(buffer_class.__init__, kwarg) for kwarg in wanted):
        warnings.warn(
            "moe_hybridep_num_blocks_permute/_unpermute are set but the installed deep_ep's "
            "HybridEPBuffer does not take num_blocks_permute/num_blocks_unpermute; HybridEP "
            "chooses the block counts. Upgrade deep_ep to use them.",
            UserWarning,
            stacklevel=2,
        )
        return {}
    return wanted


def ensure_hybridep_buffer(a2a, config, group, hidden_states, num_local_experts) -> None:
    """Create ``a2a``'s shared HybridEP buffer (as fused_a2a would) with the block counts.

    ``a2a`` is the ``fused_a2a`` module (a parameter so tests can pass a stand-in).
    Does nothing once the buffer exists.
    """
    if a2a._hybrid_ep_buffer is not None:
        return
    max_tokens, hidden_dim = hidden_states.shape[-2:]
    a2a._hybrid_ep_buffer = a2a.HybridEPBuffer(
        group=group,
        hidden_dim=hidden_dim,
        max_num_of_tokens_per_rank=max_tokens,
        num_local_experts=num_local_experts,
        use_fp8=False,  # HybridEP does not dispatch in FP8
        num_sms_dispatch_api=config.moe_hybridep_num_sms,
        num_sms_combine_api=config.moe_hybridep_num_sms,
        **hybridep_block_kwargs(config, a2a.HybridEPBuffer),
    )


class HybridEPBlocksManager(_HybridEPManager):
    """HybridEP backend whose buffer carries the configured permute/unpermute block counts."""

    def dispatch(self, hidden_states, *args, **kwargs):
        ensure_hybridep_buffer(fused_a2a, self.config, self.group, hidden_states, self.num_local_experts)
        return super().dispatch(hidden_states, *args, **kwargs)


def replacements():
    return [(_HybridEPManager, HybridEPBlocksManager)]
