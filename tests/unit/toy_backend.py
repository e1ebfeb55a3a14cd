"""The toy expert backend of patches/README.md ("Adding an expert backend"): the experts as
a loop of per-expert torch matmuls, bf16 SwiGLU without biases. It shows what a backend
declares and implements; it is slow and only registered by its test (test_toy_backend.py)."""

import torch

from megatron.moe_patches.experts.backend import BF16, ExpertBackend, host_tokens_per_expert, run_forward_pre_hooks


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

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        fc1, fc2 = experts.linear_fc1, experts.linear_fc2
        run_forward_pre_hooks((fc1, fc2), x_TH)  # their weights are read here, their forward never runs
        counts = host_tokens_per_expert(tokens_per_expert_E).tolist()
        out = []
        for e, (x_RH, probs_R) in enumerate(zip(x_TH.split(counts), probs_T.split(counts))):
            gate_RF, up_RF = (x_RH @ getattr(fc1, f"weight{e}").t()).chunk(2, dim=-1)
            a_RF = torch.nn.functional.silu(gate_RF) * up_RF * probs_R.unsqueeze(-1).to(up_RF.dtype)
            out.append(a_RF @ getattr(fc2, f"weight{e}").t())
        return torch.cat(out), None
