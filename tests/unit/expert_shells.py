"""CPU stand-ins of the experts module for backend tests: FC1 and FC2 with what the backends
read of TE's GroupedLinear (``weight{i}`` / ``bias{i}``, ``num_gemms``, ``use_bias``, and
megatron-core's ``is_first_microbatch``), built from the classes the backend's
``expert_submodules`` returns, as megatron-core's TEGroupedMLP builds them."""

import contextlib

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule

from megatron.moe_patches.experts.padding import NOBODY, PaddingPlan
from megatron.moe_patches.plan import plan_for


class ShellGroupedLinear(torch.nn.Module):
    """TE's GroupedLinear as far as the backends and F5 read it: ``weight{i}`` / ``bias{i}``
    announced through ``register_parameter`` with their init_fn (and RNG tracker), then
    initialised by ``reset_parameters`` in that order, each under a fork of the tracker's
    ``rng_tracker_name`` state, as TE's constructor does. The values: each expert's weight
    ``randn * in**-0.5`` and bias ``randn``, drawn from ``generator`` in turn; or, given
    ``init_method`` (megatron-core's, as TE gets it), the weights from it and zero biases."""

    def __init__(self, num_gemms, out_features, in_features, bias=False, generator=None, dtype=torch.bfloat16,
                 init_method=None, get_rng_state_tracker=None, rng_tracker_name=None):
        super().__init__()
        self.num_gemms, self.use_bias, self.is_first_microbatch = num_gemms, bias, True
        self.param_init_meta, self.rng_tracker_name = {}, rng_tracker_name
        scale = in_features**-0.5
        weight_init, bias_init = init_method, torch.nn.init.zeros_
        if init_method is None:
            weight_init = lambda w: w.copy_(torch.randn(w.shape, generator=generator) * scale)  # noqa: E731
            bias_init = lambda b: b.copy_(torch.randn(b.shape, generator=generator))  # noqa: E731

        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype)),
                                    init_fn=weight_init, get_rng_state_tracker=get_rng_state_tracker)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(out_features, dtype=dtype)),
                                        init_fn=bias_init, get_rng_state_tracker=get_rng_state_tracker)
        self.reset_parameters()

    def register_parameter(self, name, param, **init_meta):
        super().register_parameter(name, param)
        self.param_init_meta[name] = init_meta

    def reset_parameters(self, defer_init=False):
        if defer_init:
            return
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                init_meta = self.param_init_meta[name]
                tracker = init_meta.get("get_rng_state_tracker")
                with tracker().fork(self.rng_tracker_name) if tracker else contextlib.nullcontext():
                    init_meta["init_fn"](param)


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
