"""F8: tokens_per_expert stays on the GPU from routing to the expert GEMMs.

Patches (with ``moe_device_tokens_per_expert`` or ``NVTE_USE_GROUPED_GEMM_TRITON=1``):

- the alltoall dispatcher (F1's subclass) no longer copies ``tokens_per_expert`` to the
  host and drops the host sync that existed only for that copy: with EP = 1 the
  dispatcher never waits for the GPU; with EP > 1 it keeps the one sync the
  all-to-all's split sizes need (``before_ep_alltoall``);
- with ``moe_single_grouped_weight`` the grouped_mm backend holds each FC's experts as
  one [E, out, in] parameter (checkpoints keep the stock per-expert keys: F6's hooks);
- the TE grouped experts (F3's subclass) pick a backend at construction
  (``expert_backends.select_expert_backend``): the sync-free ``grouped_mm`` backend,
  or the TE backend with exactly one host copy (``host_tokens_per_expert``).

The allgather dispatcher keeps its host counts. Upstream: ROCm/Megatron-LM (seed 004,
"GPU m_splits"); TE's module GroupedLinear takes device splits there through
``m_splits_tensor``, which NVIDIA's TE (2.20.2) lacks: ``capabilities.
te_grouped_linear_device_splits`` reports it, and the TE backend then copies once.
"""

import logging

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import expert_backends as backends
from megatron.moe_patches.config import patch_option
from megatron.moe_patches.fused_permute_pad import PaddedPermuteAlltoAllTokenDispatcher
from megatron.moe_patches.grouped_checkpoint_keys import is_grouped, make_grouped
from megatron.moe_patches.installer import is_applied
from megatron.moe_patches.routed_expert_padding import PaddingAwareTEGroupedMLP

logger = logging.getLogger(__name__)


class DeviceSplitsAlltoAllTokenDispatcher(PaddedPermuteAlltoAllTokenDispatcher):
    """AlltoAll dispatcher that hands the experts device-resident token counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_splits = bool(patch_option(self.config, "moe_device_tokens_per_expert"))

    def _maybe_update_cuda_sync_point(self, point: str):
        # "before_finish" exists only to read tokens_per_expert on the host.
        if self.device_splits and point == "before_finish":
            return
        super()._maybe_update_cuda_sync_point(point)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.device_splits:
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        super()._maybe_dtoh_and_synchronize(point, None)  # split sizes still go to the host
        return tokens_per_expert


    def _identity_chunk_sort(self) -> bool:
        # One source rank, no TP: sorting chunks by local expert keeps them in place, yet
        # the stock path still copies all permuted tokens through the sort (both ways).
        return self.device_splits and self.ep_size == 1 and self.tp_size == 1

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self._identity_chunk_sort():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self._identity_chunk_sort():
            return super().combine_preprocess(hidden_states)
        return hidden_states


class BackendTEGroupedMLP(PaddingAwareTEGroupedMLP):
    """TE grouped experts whose compute backend is chosen once, at construction."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self.backend, _ = backends.select_expert_backend(config)
        self._fc1_block = self._fc2_block = None
        single_grouped = patch_option(config, "moe_single_grouped_weight")
        if single_grouped and self.backend != backends.GROUPED_MM and not is_applied("F4"):
            raise ValueError(
                "moe_single_grouped_weight needs an expert backend that holds grouped parameters: "
                "the grouped_mm backend (--moe-device-tokens-per-expert, bf16, SwiGLU/quick-GEGLU, no "
                "bias, ETP 1, Hopper); the op-fuser grouped MLP (F4) is not in this version yet."
            )
        op_fuser_fields = ("use_transformer_engine_op_fuser", "moe_mlp_glu_interleave_size")
        if any(patch_option(config, f) for f in op_fuser_fields) and not is_applied("F4"):
            logger.warning(
                "use_transformer_engine_op_fuser / moe_mlp_glu_interleave_size are set, but the "
                "op-fuser grouped MLP (F4) is not in this version yet: the experts run the %s path.",
                self.backend,
            )
        if self.backend == backends.GROUPED_MM and single_grouped:
            make_grouped(self.linear_fc1, self.num_local_experts)
            make_grouped(self.linear_fc2, self.num_local_experts)
        elif self.backend == backends.GROUPED_MM:
            self._fc1_block = backends.gather_into_one_block(self._weights(self.linear_fc1))
            self._fc2_block = backends.gather_into_one_block(self._weights(self.linear_fc2))
        elif patch_option(config, "moe_device_tokens_per_expert") and not cap.te_grouped_linear_device_splits():
            logger.info(
                "moe_device_tokens_per_expert: TE %s's GroupedLinear takes no m_splits_tensor; "
                "the TE expert backend copies tokens_per_expert to the host once per layer.",
                cap.te_version(),
            )

    def _weights(self, linear):
        return [getattr(linear, f"weight{i}") for i in range(self.num_local_experts)]

    def _grouped(self, linear, block):
        if is_grouped(linear):  # moe_single_grouped_weight: the parameter is the group
            return linear.weight
        return backends.grouped_weight(block, self._weights(linear))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.backend == backends.TE:
            return super().forward(
                permuted_local_hidden_states, backends.host_tokens_per_expert(tokens_per_expert), permuted_probs
            )
        output = backends.grouped_mm_mlp(
            permuted_local_hidden_states,
            tokens_per_expert,
            permuted_probs,
            self._grouped(self.linear_fc1, self._fc1_block),
            self._grouped(self.linear_fc2, self._fc2_block),
            self.config,
        )
        return output, None


def replacements():
    return [
        (PaddingAwareTEGroupedMLP, BackendTEGroupedMLP),
        (PaddedPermuteAlltoAllTokenDispatcher, DeviceSplitsAlltoAllTokenDispatcher),
    ]
