"""The one patched experts class: megatron-core's ``TEGroupedMLP`` with a compute backend
and a padding plan, both chosen once at construction.

Both are read from the config's plan (``plan.plan_for``), which decides them:

- ``self.padding_plan`` (F3): the experts pad their tokens themselves only when no earlier
  stage did, to the alignment the plan names; otherwise TE's Fp8Padding/Fp8Unpadding
  become pass-throughs.
- ``self.backend``: ``te`` (megatron-core's path), ``grouped_mm`` (F8, sync-free),
  ``fp8_grouped_mm`` (F10) or ``op_fuser`` (F4). It owns ``forward``, ``backward_dw``
  and the sharded-state-dict hook.
- ``self.wgrad_into_main_grad`` (F13): under gradient_accumulation_fusion the backend adds
  the weight gradients into DDP's main_grad in the GEMM.
- Single grouped parameters (F5) are refused here, by the plan's one rule, when the
  chosen backend cannot hold them.

Installed by F3 (``apply()`` binds the experts' layer spec to it: the registry says
where); F4, F5 and F8 are its backends and options and require F3.
"""

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from megatron.moe_patches.plan import plan_for


class _AlreadyPadded(torch.nn.Module):
    """Stands in for TE's Fp8Padding when the tokens arrive aligned."""

    def forward(self, tokens, tokens_per_expert):
        return tokens, tokens_per_expert


class _AlreadyUnpadded(torch.nn.Module):
    def forward(self, tokens, tokens_per_expert):
        return tokens


class PatchedTEGroupedMLP(TEGroupedMLP):
    """TE grouped experts whose compute backend and padding are fixed at construction."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        plan = plan_for(config)
        # The backend picks FC1's and FC2's classes (TE's device splits) before stock builds them.
        submodules = plan.backend.expert_submodules(config, submodules, plan)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if plan.single_grouped_refusal is not None:
            raise ValueError(plan.single_grouped_refusal)
        plan.log_choices()
        self.padding_plan = plan.padding
        if hasattr(self, "quantization_padding"):  # FP8/FP4: stock built TE's padding modules
            self._fit_quantization_padding(num_local_experts)
        self.wgrad_into_main_grad = plan.wgrad_into_main_grad  # F13, read by the backend
        self.triton_kernels = plan.triton_kernels  # the backend's kernels: Triton, or their PyTorch twins
        self.backend = plan.backend(self)

    def _fit_quantization_padding(self, num_local_experts):
        if not self.padding_plan.experts_pad:
            self.quantization_padding = _AlreadyPadded()
            self.quantization_unpadding = _AlreadyUnpadded()
        elif self.padding_plan.align != get_align_size_for_quantization(self.config):
            from transformer_engine.pytorch import Fp8Padding, Fp8Unpadding

            self.quantization_padding = Fp8Padding(num_local_experts, align_size=self.padding_plan.align)
            self.quantization_unpadding = Fp8Unpadding(num_local_experts, align_size=self.padding_plan.align)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        return self.backend.forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    def backward_dw(self):
        return self.backend.backward_dw(self)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.backend.sharded_state_dict(self, super().sharded_state_dict(prefix, sharded_offsets, metadata))
