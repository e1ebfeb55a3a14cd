"""F4: the TE grouped experts as one ``transformer_engine.pytorch.ops`` pipeline.

With ``use_transformer_engine_op_fuser`` the experts (``grouped_experts.PatchedTEGroupedMLP``)
run this module's ``OpFuserBackend``:

    GroupedLinear (FC1) -> ScaledSwiGLU | ScaledClampedQGeGLU (x router probs) -> GroupedLinear (FC2)

as one ``te.ops.Sequential`` built lazily at the first forward from meta-device ops
that are handed the module's own parameters (no copies; state-dict keys unchanged).
TE fuses the pipeline into its grouped-MLP kernel where the GPU has one (SM100) and
runs its basic ops elsewhere (Hopper): upstream megatron-core refuses Hopper instead.

- FC2 bias is scaled by the router probs inside FC2 (TE ``scale_bias``).
- ``moe_mlp_glu_interleave_size``: FC1 rows live block-interleaved in memory;
  checkpoints keep the concatenated layout (``glu_interleave``).
- ``delay_wgrad_compute``: the ops hold the weight-gradient GEMMs; ``backward_dw()``
  runs FC2's then FC1's and then fires the hooks Megatron DDP registered on the
  original ``linear_fc1``/``linear_fc2`` modules, so each gradient is reduced once
  (the ops' own hook lists stay empty: registering on both reduces twice, #4311).
- Anything the pipeline cannot do exactly falls back, at construction, to the unfused
  path with one log line naming the reason (the plan reads ``OpFuserBackend``'s
  declarations and ``unavailable``).
- Under FP8 where TE fuses the whole MLP into one kernel (SM100), groups are aligned to
  256 rows (``required_alignment``); on Hopper the recipe's own alignment.

Upstream: NVIDIA/Megatron-LM#3890, #4095, #4219, #4311 (combined in #4636).
"""

import logging
from typing import Optional

import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.backend import BF16, FP8, ExpertBackend, host_tokens_per_expert, run_forward_pre_hooks
from megatron.moe_patches.fields import glu_activation, patch_option
from megatron.moe_patches.experts.glu_interleave import concatenated_factory, interleave_parameters

# te.pytorch.ops class computing each GLU activation with a per-row scale.
SCALED_GLU_OPS = {"swiglu": "ScaledSwiGLU", "quick_geglu": "ScaledClampedQGeGLU"}

# TE's fused grouped-MLP kernel (SM100) takes quantized groups of 256 rows.
FUSED_KERNEL_ALIGNMENT = 256


class OpFuserBackend(ExpertBackend):
    """The experts as one te.ops pipeline: GroupedLinear -> scaled GLU -> GroupedLinear."""

    name = "op_fuser"
    requested_by = "use_transformer_engine_op_fuser"
    fallback_log_level = logging.WARNING  # asked for by name: its absence is worth a warning
    precisions = (BF16, FP8)
    precision_note = "FP4 recipes run the te backend"
    fp8_params = False
    activations = ("swiglu", "quick_geglu")
    te_activation_func = False  # it computes megatron-core's own GLU (TE's scaled GLU ops)
    expert_tp = False
    probs_on_input = False
    activation_offloading = False
    activation_recompute = False
    holds_single_grouped_params = False
    single_grouped_missing = ("they need TE's grouped-tensor GroupedLinear path (Hopper: cuBLASLt >= 13.4; "
                              "Blackwell: >= 13.3), which this version does not drive yet")

    @classmethod
    def unavailable(cls, config) -> Optional[str]:
        if not cap.te_op_fuser_grouped_mlp():
            return f"Transformer Engine {cap.te_version()} has no te.pytorch.ops GroupedLinear/ScaledSwiGLU"
        scaled_glu = SCALED_GLU_OPS.get(glu_activation(config))
        if scaled_glu is not None and cap.te_attr(f"ops.{scaled_glu}") is None:
            return f"Transformer Engine {cap.te_version()} has no te.pytorch.ops.{scaled_glu}"
        if config.add_bias_linear and not cap.te_ops_grouped_linear_has("scale_bias"):
            return f"Transformer Engine {cap.te_version()}'s ops.GroupedLinear cannot scale the FC2 bias by probs"
        interleave = patch_option(config, "moe_mlp_glu_interleave_size")
        if interleave and interleave % 32:
            return f"moe_mlp_glu_interleave_size={interleave}: TE's scaled GLU kernels need a multiple of 32"
        return None

    @classmethod
    def required_alignment(cls, config) -> Optional[int]:
        return FUSED_KERNEL_ALIGNMENT if cap.te_fused_grouped_mlp_kernel() else None

    def __init__(self, experts):
        self._ops = None  # (fc1, activation, fc2) once built; kept out of the module tree
        self.glu_interleave_size = patch_option(experts.config, "moe_mlp_glu_interleave_size")
        if self.glu_interleave_size:
            interleave_parameters(experts.linear_fc1, self.glu_interleave_size)

    # --- the pipeline ---------------------------------------------------------------------

    def _activation_op(self, config):
        import transformer_engine.pytorch as te

        if glu_activation(config) == "swiglu":
            return te.ops.ScaledSwiGLU(glu_interleave_size=self.glu_interleave_size)
        clamp = config.activation_func_clamp_value
        return te.ops.ScaledClampedQGeGLU(
            glu_interleave_size=self.glu_interleave_size,
            limit=float("inf") if clamp is None else float(clamp),
            alpha=1.702,  # quick_gelu(x) = x * sigmoid(1.702 x)
            glu_linear_offset=float(config.glu_linear_offset),
        )

    def _grouped_linear_op(self, experts, linear, scale_bias: bool):
        """A meta-device ops.GroupedLinear holding ``linear``'s own parameters."""
        import transformer_engine.pytorch as te

        out_features, in_features = linear.weight0.shape
        bias = experts.config.add_bias_linear
        options = dict(scale_bias=True) if scale_bias and bias else {}
        op = te.ops.GroupedLinear(
            experts.num_local_experts,
            in_features,
            out_features,
            bias=bias,
            device="meta",
            dtype=linear.weight0.dtype,
            accumulate_into_main_grad=bool(getattr(linear, "fuse_wgrad_accumulation", False)),
            delay_wgrad_compute=bool(experts.config.delay_wgrad_compute),
            **options,
        )
        for i in range(experts.num_local_experts):
            op.register_parameter(f"weight{i}", getattr(linear, f"weight{i}"))
            op.register_parameter(f"bias{i}", getattr(linear, f"bias{i}", None) if bias else None)
        return op

    def _pipeline(self, experts):
        import transformer_engine.pytorch as te

        if self._ops is None:
            self._ops = (
                self._grouped_linear_op(experts, experts.linear_fc1, scale_bias=False),
                self._activation_op(experts.config),
                self._grouped_linear_op(experts, experts.linear_fc2, scale_bias=True),
            )
            self._sequential = te.ops.Sequential(*self._ops)
        return self._sequential

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        pipeline = self._pipeline(experts)
        counts_E = tokens_per_expert_E
        pads = experts.padding_plan.experts_pad
        if pads:
            actual = host_tokens_per_expert(counts_E).tolist()
            x_TH, padded = experts.quantization_padding(x_TH, actual)
            probs_T = experts.quantization_padding(probs_T.unsqueeze(-1), actual)[0].squeeze(-1)
            counts_E = torch.tensor(padded, dtype=torch.int64)
        run_forward_pre_hooks((experts.linear_fc1, experts.linear_fc2), x_TH)
        extra = (counts_E, probs_T, counts_E) + ((probs_T,) if experts.config.add_bias_linear else ())
        out_TH = pipeline(x_TH, *extra)
        if pads:
            out_TH = experts.quantization_unpadding(out_TH, actual)
        return out_TH, None

    def sharded_state_dict(self, experts, sharded: dict) -> dict:
        if not self.glu_interleave_size:
            return sharded
        fc1_params = {id(p) for p in experts.linear_fc1.parameters()}
        for key, entry in sharded.items():
            if id(getattr(entry, "data", None)) in fc1_params:
                sharded[key] = concatenated_factory(entry, self.glu_interleave_size)
        return sharded

    def backward_dw(self, experts):
        if self._ops is None:
            return super().backward_dw(experts)
        if not experts.config.delay_wgrad_compute:
            return
        fc1_op, _, fc2_op = self._ops
        for op, linear in ((fc2_op, experts.linear_fc2), (fc1_op, experts.linear_fc1)):
            op.backward_dw()
            linear._trigger_wgrad_accumulation_and_reduce_hooks()
