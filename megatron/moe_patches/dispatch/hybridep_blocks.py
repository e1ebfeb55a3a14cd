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

Whether each is passed is the plan's (``ExchangeChoice.hybridep_block_counts`` /
``hybridep_permute_fusion``: asked for and taken by the installed deep_ep; else the stock
call and the plan's warning), read, and the plan's notes logged once, when the manager is
built; a dispatch only checks that the shared buffer is the one it prepared.
Upstream: NVIDIA/Megatron-LM#4073 (dev), #4089 (main).
"""

from megatron.core.transformer.moe import fused_a2a
from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

from megatron.moe_patches.fields import patch_option
from megatron.moe_patches.plan import plan_for
from megatron.moe_patches.plan.exchange import HYBRIDEP_BLOCK_FIELDS


def hybridep_block_kwargs(config) -> dict:
    """The block counts set in the config, as the buffer's constructor arguments."""
    return {kwarg: patch_option(config, field) for field, kwarg in HYBRIDEP_BLOCK_FIELDS.items()
            if patch_option(config, field) is not None}


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


def ensure_hybridep_buffer(a2a, config, exchange, group, hidden_states, num_local_experts) -> None:
    """Create ``a2a``'s shared HybridEP buffer (as fused_a2a would), with the block counts and
    wrapped for permute fusion where the plan's ``exchange`` (an ``ExchangeChoice``) says so.

    ``a2a`` is the ``fused_a2a`` module (a parameter so tests can pass a stand-in).
    An existing buffer is kept (only wrapped, once, for the fusion).
    """
    if a2a._hybrid_ep_buffer is None:
        max_tokens, hidden_dim = hidden_states.shape[-2:]
        a2a._hybrid_ep_buffer = a2a.HybridEPBuffer(
            group=group,
            hidden_dim=hidden_dim,
            max_num_of_tokens_per_rank=max_tokens,
            num_local_experts=num_local_experts,
            use_fp8=False,  # HybridEP does not dispatch in FP8
            num_sms_dispatch_api=config.moe_hybridep_num_sms,
            num_sms_combine_api=config.moe_hybridep_num_sms,
            **(hybridep_block_kwargs(config) if exchange.hybridep_block_counts else {}),
        )
    if exchange.hybridep_permute_fusion and not isinstance(a2a._hybrid_ep_buffer, FusedPermuteBuffer):
        a2a._hybrid_ep_buffer = FusedPermuteBuffer(a2a._hybrid_ep_buffer)


class HybridEPBlocksManager(_HybridEPManager):
    """HybridEP backend whose buffer carries the configured permute/unpermute block counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plan = plan_for(self.config)
        plan.log_choices()  # an older deep_ep's refusals among them (once per process)
        self._exchange = plan.exchange  # what the buffer is built with, decided once
        self._prepared_buffer = None  # the shared buffer as this manager last prepared it

    def dispatch(self, hidden_states, *args, **kwargs):
        # The buffer is created at the first dispatch (it needs the tokens' shape) and shared by
        # every layer: each manager prepares a buffer once, later dispatches only compare.
        buffer = fused_a2a._hybrid_ep_buffer
        if buffer is None or buffer is not self._prepared_buffer:
            ensure_hybridep_buffer(fused_a2a, self.config, self._exchange, self.group, hidden_states,
                                   self.num_local_experts)
            self._prepared_buffer = fused_a2a._hybrid_ep_buffer
        return super().dispatch(hidden_states, *args, **kwargs)
