"""CPU stand-ins of the experts module for backend tests: FC1 and FC2 with what the backends
read of TE's GroupedLinear (``weight{i}`` / ``bias{i}``, ``num_gemms``, ``use_bias``, and
megatron-core's ``is_first_microbatch``), built from the classes the backend's
``expert_submodules`` returns, as megatron-core's TEGroupedMLP builds them."""

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule

from megatron.moe_patches.experts.padding import NOBODY, PaddingPlan
from megatron.moe_patches.plan import plan_for


class ShellGroupedLinear(torch.nn.Module):
    def __init__(self, num_gemms, out_features, in_features, bias=False, generator=None, dtype=torch.bfloat16):
        super().__init__()
        self.num_gemms, self.use_bias, self.is_first_microbatch = num_gemms, bias, True
        scale = in_features**-0.5
        for i in range(num_gemms):
            weight = torch.randn(out_features, in_features, generator=generator) * scale
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight.to(dtype)))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.randn(out_features, generator=generator).to(dtype)))


def experts_shell(backend_class, config, experts, fc1_shape, fc2_shape, bias=False, seed=0, dtype=torch.bfloat16,
                  padding_plan=PaddingPlan(None, NOBODY), wgrad_into_main_grad=False):
    """The experts module a backend is built for: a MegatronModule (its ``set_is_first_microbatch``
    is megatron-core's) holding FC1 [out, in] and FC2 [out, in] per expert, and the plan's
    padding (``padding_plan``: nobody pads unless given), F13's option (``wgrad_into_main_grad``)
    and the plan's kernels (Triton or the PyTorch twins)."""
    submodules = backend_class.expert_submodules(
        config, MLPSubmodules(linear_fc1=ShellGroupedLinear, linear_fc2=ShellGroupedLinear), plan_for(config))
    generator = torch.Generator().manual_seed(seed)
    owner = MegatronModule(config)
    owner.num_local_experts = experts
    owner.padding_plan = padding_plan
    owner.wgrad_into_main_grad = wgrad_into_main_grad
    owner.triton_kernels = plan_for(config).triton_kernels
    owner.linear_fc1 = submodules.linear_fc1(experts, *fc1_shape, bias=bias, generator=generator, dtype=dtype)
    owner.linear_fc2 = submodules.linear_fc2(experts, *fc2_shape, bias=bias, generator=generator, dtype=dtype)
    return owner
