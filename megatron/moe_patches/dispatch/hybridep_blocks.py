"""F2: HybridEP's permute/unpermute fused into dispatch/combine, and their thread blocks.

Patches: ``_HybridEPManager`` (megatron.core.transformer.moe.token_dispatcher, the
flex dispatcher's HybridEP backend) is replaced by a subclass that creates the
shared HybridEP buffer itself before the first dispatch (megatron-core 0.16.1 creates
it lazily inside ``fused_a2a`` with no way to configure it):

- ``moe_hybridep_num_blocks_permute`` / ``moe_hybridep_num_blocks_unpermute`` go to the
  buffer's constructor (CUDA thread blocks of the permute; ``None`` lets HybridEP choose);
- ``moe_permute_fusion_into_hybridep`` makes every ``dispatch_with_permute`` /
  ``combine_with_unpermute`` call (forward and backward, made by megatron-core's own
  autograd functions) ask for the fused kernels (``fuse_permute_dispatch`` /
  ``fuse_unpermute_combine``), through a thin wrapper around the buffer.

Each is passed only when the installed deep_ep accepts it (probed on the callable, once per
buffer and manager: later dispatches only check that the buffer is the one prepared);
otherwise one warning and the stock call. Upstream: NVIDIA/Megatron-LM#4073 (dev),
#4089 (main).
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


class FusedPermuteBuffer:
    """A HybridEP buffer whose dispatch/combine also permute/unpermute, in one kernel each."""

    def __init__(self, buffer):
        self.buffer = buffer

    def __getattr__(self, name):  # everything else is the buffer's own
        return getattr(self.buffer, name)

    def dispatch_with_permute(self, *args, **kwargs):
        return self.buffer.dispatch_with_permute(*args, fuse_permute_dispatch=True, **kwargs)

    def combine_with_unpermute(self, *args, **kwargs):
        return self.buffer.combine_with_unpermute(*args, fuse_unpermute_combine=True, **kwargs)


def fuses_permute(buffer) -> bool:
    """Whether ``buffer``'s dispatch/combine take the permute-fusion switches."""
    return cap.accepts_parameter(getattr(buffer, "dispatch_with_permute", None), "fuse_permute_dispatch") and (
        cap.accepts_parameter(getattr(buffer, "combine_with_unpermute", None), "fuse_unpermute_combine")
    )


def with_permute_fusion(config, buffer):
    """``buffer``, wrapped to fuse permute/unpermute when the config asks and deep_ep can."""
    if not patch_option(config, "moe_permute_fusion_into_hybridep") or isinstance(buffer, FusedPermuteBuffer):
        return buffer
    if not fuses_permute(buffer):
        warnings.warn(
            "moe_permute_fusion_into_hybridep is set but the installed deep_ep's HybridEP "
            "dispatch_with_permute/combine_with_unpermute take no fuse_permute_dispatch/"
            "fuse_unpermute_combine; permute and unpermute run unfused. Upgrade deep_ep to fuse them.",
            UserWarning,
            stacklevel=2,
        )
        return buffer
    return FusedPermuteBuffer(buffer)


def ensure_hybridep_buffer(a2a, config, group, hidden_states, num_local_experts) -> None:
    """Create ``a2a``'s shared HybridEP buffer (as fused_a2a would) with the block counts,
    wrapped for permute fusion when asked.

    ``a2a`` is the ``fused_a2a`` module (a parameter so tests can pass a stand-in).
    An existing buffer is kept (only wrapped, once, when the fusion is asked for).
    """
    if a2a._hybrid_ep_buffer is not None:
        a2a._hybrid_ep_buffer = with_permute_fusion(config, a2a._hybrid_ep_buffer)
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
    a2a._hybrid_ep_buffer = with_permute_fusion(config, a2a._hybrid_ep_buffer)


class HybridEPBlocksManager(_HybridEPManager):
    """HybridEP backend whose buffer carries the configured permute/unpermute block counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prepared_buffer = None  # the shared buffer as this manager last prepared it

    def dispatch(self, hidden_states, *args, **kwargs):
        # The buffer is created at the first dispatch (it needs the tokens' shape) and shared by
        # every layer: each manager prepares a buffer once, later dispatches only compare.
        buffer = fused_a2a._hybrid_ep_buffer
        if buffer is None or buffer is not self._prepared_buffer:
            ensure_hybridep_buffer(fused_a2a, self.config, self.group, hidden_states, self.num_local_experts)
            self._prepared_buffer = fused_a2a._hybrid_ep_buffer
        return super().dispatch(hidden_states, *args, **kwargs)
