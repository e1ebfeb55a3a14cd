"""The toy expert backend of patches/README.md ("Adding an expert backend"): the experts as
a loop of per-expert torch matmuls, bf16 SwiGLU without biases. It shows what a backend
declares and implements; it is slow and only registered by its test (test_toy_backend.py)."""

import torch

from megatron.moe_patches.experts.backend import BF16, ExpertBackend, host_tokens_per_expert


class LoopLinear:
    """FC1's and FC2's forward under this backend (mixed into the spec's TE grouped linear):
    one matmul per expert over that expert's rows, with TE's per-expert weights."""

    def forward(self, x_TI, counts):
        return torch.cat([x_RI @ getattr(self, f"weight{e}").t() for e, x_RI in enumerate(x_TI.split(counts))])


class LoopBackend(ExpertBackend):
    """FC1 -> SwiGLU x router prob -> FC2, one expert at a time."""

    # What it supports; the plan refuses it, with the reason, where the config needs more.
    name = "loop"
    precisions = (BF16,)
    params_dtypes = (torch.bfloat16,)
    activations = ("swiglu",)
    biases = False
    expert_tp = False
    probs_on_input = False
    delayed_wgrad = False  # autograd computes the weight gradients in the backward
    activation_offloading = False
    activation_recompute = False
    linear_step = LoopLinear  # the FCs are called as modules: torch runs their forward pre-hooks

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        counts = host_tokens_per_expert(tokens_per_expert_E).tolist()
        gate_TF, up_TF = experts.linear_fc1(x_TH, counts).chunk(2, dim=-1)
        a_TF = torch.nn.functional.silu(gate_TF) * up_TF * probs_T.unsqueeze(-1).to(up_TF.dtype)
        return experts.linear_fc2(a_TF, counts), None
