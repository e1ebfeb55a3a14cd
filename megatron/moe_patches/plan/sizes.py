"""The config's precision and parallel sizes, read one way by every rule of the plan.

The precision (BF16, FP8, FP4) is what a backend must compute; the sizes come from the
config (``expert_model_parallel_size``, ``expert_tensor_parallel_size``), unset meaning 1.
The dispatchers check their process groups against these sizes
(``MoEPlan.check_parallel_sizes``), so the plan never asks the process groups itself.
"""

from megatron.moe_patches.experts.backend import BF16, FP4, FP8


def precision_of(config) -> str:
    """BF16 (no FP8/FP4 recipe), FP8 or FP4."""
    return FP4 if config.fp4 else FP8 if config.fp8 else BF16


def expert_tp_size(config) -> int:
    return config.expert_tensor_parallel_size or 1


def ep_size(config) -> int:
    return config.expert_model_parallel_size or 1
