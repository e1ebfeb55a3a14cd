"""Expert compute backends behind one seam, chosen once at construction.

``select_expert_backend(config)`` returns the backend the TE grouped experts use and,
when it is not the sync-free one the config asked for, why. Backends:

- ``te``: megatron-core's own TEGroupedMLP path (TE GroupedLinear, one GEMM launch per
  expert). It needs the token counts on the host: ``host_tokens_per_expert`` is the one
  place that copies them.
- ``grouped_mm``: FC1 and FC2 as one ``torch._grouped_mm`` each over all local experts,
  with device offsets (no host sync), and megatron-core's fused router-prob-weighted
  SwiGLU / quick-GEGLU between them. bf16 only. It reads the experts' existing
  ``linear_fc{1,2}.weight{i}`` parameters, so state dicts stay those of stock TE experts.

Tensor names carry their shape: ``x_TH`` is [tokens, hidden], ``w_EOI`` is
[experts, out, in], ``tokens_per_expert_E`` is [experts].
"""

import logging
from typing import List, Optional, Tuple

import torch

from megatron.moe_patches.config import patch_option

logger = logging.getLogger(__name__)

TE = "te"
GROUPED_MM = "grouped_mm"

_host_copies = 0  # how many times host_tokens_per_expert copied (tests read it)


def host_tokens_per_expert(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """The one place the TE backend takes the per-expert counts to the host."""
    global _host_copies
    if tokens_per_expert_E.is_cuda:
        _host_copies += 1
        return tokens_per_expert_E.cpu()
    return tokens_per_expert_E


def _glu_activation(config) -> Optional[str]:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if not config.gated_linear_unit:
        return None
    if config.activation_func is torch.nn.functional.silu:
        return "swiglu"
    if config.activation_func is quick_gelu:
        return "quick_geglu"
    return None


def _grouped_mm_blocker(config) -> Optional[str]:
    """Why the grouped_mm backend cannot run this config, or None if it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if config.fp8 or config.fp4:
        return "it computes in bf16 only (FP8/FP4 use the TE backend)"
    if config.params_dtype is not torch.bfloat16:
        return f"it needs bf16 parameters (params_dtype={config.params_dtype})"
    if _glu_activation(config) is None:
        return "it supports SwiGLU and quick-GEGLU experts only"
    if config.add_bias_linear:
        return "it has no expert biases yet (--disable-bias-linear)"
    if (config.expert_tensor_parallel_size or 1) > 1:
        return "expert tensor parallelism > 1"
    if config.moe_apply_probs_on_input:
        return "--moe-apply-probs-on-input"
    if patch_option(config, "use_transformer_engine_op_fuser"):
        return "the op fuser owns the experts' compute"
    if config.fine_grained_activation_offloading or (
        config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or [])
    ):
        return "activation offloading/recompute of the experts"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        return "it needs a Hopper (sm90) or newer GPU"
    return None


_logged = set()


def select_expert_backend(config) -> Tuple[str, Optional[str]]:
    """(backend, reason the sync-free backend was not taken or None)."""
    if not patch_option(config, "moe_device_tokens_per_expert"):
        return TE, None
    reason = _grouped_mm_blocker(config)
    if reason is None:
        return GROUPED_MM, None
    message = f"moe_device_tokens_per_expert: TE expert backend (one host copy per layer) because {reason}"
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
    return TE, reason


# --- grouped weights without copies ------------------------------------------------------


def gather_into_one_block(weights: List[torch.nn.Parameter]) -> torch.Tensor:
    """Move per-expert parameters into one contiguous [E, out, in] block, in place.

    The Parameter objects stay (state dicts, optimizers, hooks see the same ones); only
    their storage becomes slices of the returned block, so the grouped GEMM can read
    all experts without stacking them each step.
    """
    block_EOI = torch.empty((len(weights), *weights[0].shape), dtype=weights[0].dtype, device=weights[0].device)
    for i, weight in enumerate(weights):
        block_EOI[i].copy_(weight.detach())
        weight.data = block_EOI[i]
    return block_EOI


def _still_in_block(block_EOI: torch.Tensor, weights) -> bool:
    # DDP or a checkpoint load may have moved a parameter's storage since.
    return all(w.data_ptr() == block_EOI[i].data_ptr() and w.stride() == block_EOI[i].stride()
               for i, w in enumerate(weights))


class _BlockView(torch.autograd.Function):
    """The [E, out, in] block as one tensor whose gradient goes to the per-expert params."""

    @staticmethod
    def forward(ctx, block_EOI, *weights):
        return block_EOI.view(block_EOI.shape)

    @staticmethod
    def backward(ctx, grad_EOI):
        return (None, *grad_EOI.unbind(0))


def grouped_weight(block_EOI: Optional[torch.Tensor], weights) -> torch.Tensor:
    """All experts' weights as one differentiable [E, out, in] tensor: a view of the block
    while the parameters still live in it, otherwise a stacked copy."""
    if block_EOI is not None and _still_in_block(block_EOI, weights):
        return _BlockView.apply(block_EOI, *weights)
    return torch.stack(list(weights))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's
    backward rejects stride-0 gradients such as the one ``output.sum()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_mlp(x_TH, tokens_per_expert_E, probs_T, w1_EOI, w2_EOI, config) -> torch.Tensor:
    """FC1 -> prob-weighted GLU -> FC2 over all local experts with device offsets."""
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    # Counts from a dispatcher that keeps them on the host (allgather) go up once.
    offsets_E = torch.cumsum(tokens_per_expert_E.to(x_TH.device, non_blocking=True), dim=0, dtype=torch.int32)
    h_TF2 = torch._grouped_mm(x_TH, w1_EOI.transpose(1, 2), offs=offsets_E)
    weights_T1 = probs_T.unsqueeze(-1)
    if _glu_activation(config) == "swiglu":
        a_TF = weighted_bias_swiglu_impl(h_TF2, None, weights_T1)
    else:
        a_TF = weighted_bias_quick_geglu_impl(
            h_TF2, None, weights_T1, False, config.glu_linear_offset, config.activation_func_clamp_value
        )
    out_TH = torch._grouped_mm(a_TF.to(x_TH.dtype), w2_EOI.transpose(1, 2), offs=offsets_E)
    return _ContiguousGrad.apply(out_TH)
