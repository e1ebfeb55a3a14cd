"""F4: the TE grouped experts as one ``transformer_engine.pytorch.ops`` pipeline.

Patches: the TE grouped experts (F8's ``BackendTEGroupedMLP``) are replaced by
``OpFuserTEGroupedMLP``. With ``use_transformer_engine_op_fuser`` it runs

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
  path with one log line naming the reason (``op_fuser_blocker``).

Upstream: NVIDIA/Megatron-LM#3890, #4095, #4219, #4311 (combined in #4636).
"""

import logging
from typing import Optional

import torch

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches import expert_backends as backends
from megatron.moe_patches.config import patch_option
from megatron.moe_patches.device_splits import BackendTEGroupedMLP
from megatron.moe_patches.glu_interleave import concatenated_factory, interleave_parameters
from megatron.moe_patches.routed_expert_padding import quantization_alignment

logger = logging.getLogger(__name__)

# te.pytorch.ops class computing each GLU activation with a per-row scale.
SCALED_GLU_OPS = {"swiglu": "ScaledSwiGLU", "quick_geglu": "ScaledClampedQGeGLU"}


def op_fuser_blocker(config) -> Optional[str]:
    """Why the op-fuser pipeline cannot run ``config`` exactly, or None when it can."""
    activation = backends._glu_activation(config)
    offloaded = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
    if not cap.te_op_fuser_grouped_mlp():
        return f"Transformer Engine {cap.te_version()} has no te.pytorch.ops GroupedLinear/ScaledSwiGLU"
    if activation is None or config.use_te_activation_func:
        return "the experts' activation is not SwiGLU or quick-GEGLU (megatron-core's own)"
    if cap._te_attr(f"ops.{SCALED_GLU_OPS[activation]}") is None:
        return f"Transformer Engine {cap.te_version()} has no te.pytorch.ops.{SCALED_GLU_OPS[activation]}"
    if config.add_bias_linear and not cap.te_ops_grouped_linear_has("scale_bias"):
        return f"Transformer Engine {cap.te_version()}'s ops.GroupedLinear cannot scale the FC2 bias by probs"
    interleave = patch_option(config, "moe_mlp_glu_interleave_size")
    if interleave and interleave % 32:
        return f"moe_mlp_glu_interleave_size={interleave}: TE's scaled GLU kernels need a multiple of 32"
    if (config.expert_tensor_parallel_size or 1) > 1:
        return "expert tensor parallelism > 1"
    if config.moe_apply_probs_on_input:
        return "--moe-apply-probs-on-input"
    if offloaded & {"expert_fc1", "moe_act"} or config.cpu_offloading:
        return "activation offloading of the experts"
    if config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or []):
        return "recompute of the experts' activation (moe_act)"
    if config.fp4:
        return "FP4 recipes"
    if config.fp8_param:
        return "FP8 parameters (--fp8-param-gather)"
    return None


_logged = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def _single_grouped_requirement() -> str:
    return (
        "moe_single_grouped_weight/moe_single_grouped_bias with the op fuser need TE's grouped-tensor "
        "GroupedLinear path (Hopper: cuBLASLt >= 13.4; Blackwell: >= 13.3), which this version does "
        "not drive yet; hold single grouped weights with the grouped_mm backend instead "
        "(--moe-device-tokens-per-expert without --use-transformer-engine-op-fuser)."
    )


class OpFuserTEGroupedMLP(BackendTEGroupedMLP):
    """TE grouped experts that run as one te.ops pipeline when the op fuser is on."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self._ops = None  # (fc1, activation, fc2) once built; kept out of the module tree
        self.op_fuser_fallback = None
        self.glu_interleave_size = None
        if not patch_option(config, "use_transformer_engine_op_fuser"):
            return
        self.op_fuser_fallback = op_fuser_blocker(config)
        if self.op_fuser_fallback is not None:
            _log_once(f"use_transformer_engine_op_fuser: unfused TE experts because of {self.op_fuser_fallback}")
            return
        if patch_option(config, "moe_single_grouped_weight") or patch_option(config, "moe_single_grouped_bias"):
            raise ValueError(_single_grouped_requirement())
        if hasattr(self, "quantization_padding") and not self.skips_quantization_padding:
            from transformer_engine.pytorch import Fp8Padding, Fp8Unpadding

            align = quantization_alignment(config)  # 256 where TE fuses the MLP, else the recipe's
            self.quantization_padding = Fp8Padding(num_local_experts, align_size=align)
            self.quantization_unpadding = Fp8Unpadding(num_local_experts, align_size=align)
        self.glu_interleave_size = patch_option(config, "moe_mlp_glu_interleave_size")
        if self.glu_interleave_size:
            interleave_parameters(self.linear_fc1, self.glu_interleave_size)

    @property
    def uses_op_fuser(self) -> bool:
        return patch_option(self.config, "use_transformer_engine_op_fuser") and self.op_fuser_fallback is None

    # --- the pipeline ---------------------------------------------------------------------

    def _activation_op(self):
        import transformer_engine.pytorch as te

        activation = backends._glu_activation(self.config)
        if activation == "swiglu":
            return te.ops.ScaledSwiGLU(glu_interleave_size=self.glu_interleave_size)
        clamp = self.config.activation_func_clamp_value
        return te.ops.ScaledClampedQGeGLU(
            glu_interleave_size=self.glu_interleave_size,
            limit=float("inf") if clamp is None else float(clamp),
            alpha=1.702,  # quick_gelu(x) = x * sigmoid(1.702 x)
            glu_linear_offset=float(self.config.glu_linear_offset),
        )

    def _grouped_linear_op(self, linear, scale_bias: bool):
        """A meta-device ops.GroupedLinear holding ``linear``'s own parameters."""
        import transformer_engine.pytorch as te

        out_features, in_features = linear.weight0.shape
        bias = self.config.add_bias_linear
        options = dict(scale_bias=True) if scale_bias and bias else {}
        op = te.ops.GroupedLinear(
            self.num_local_experts,
            in_features,
            out_features,
            bias=bias,
            device="meta",
            dtype=linear.weight0.dtype,
            accumulate_into_main_grad=bool(getattr(linear, "fuse_wgrad_accumulation", False)),
            delay_wgrad_compute=bool(self.config.delay_wgrad_compute),
            **options,
        )
        for i in range(self.num_local_experts):
            op.register_parameter(f"weight{i}", getattr(linear, f"weight{i}"))
            op.register_parameter(f"bias{i}", getattr(linear, f"bias{i}", None) if bias else None)
        return op

    def _pipeline(self):
        import transformer_engine.pytorch as te

        if self._ops is None:
            self._ops = (
                self._grouped_linear_op(self.linear_fc1, scale_bias=False),
                self._activation_op(),
                self._grouped_linear_op(self.linear_fc2, scale_bias=True),
            )
            # A tuple, not an attribute module: the ops' parameters are linear_fc{1,2}'s.
            self._sequential = (te.ops.Sequential(*self._ops),)
        return self._sequential[0]

    def _run_forward_pre_hooks(self, hidden):
        # The pipeline bypasses linear_fc{1,2}.forward; DDP's param all-gather waits there.
        for linear in (self.linear_fc1, self.linear_fc2):
            for hook in linear._forward_pre_hooks.values():
                hook(linear, (hidden,))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self.uses_op_fuser:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        pipeline = self._pipeline()
        x_TH, probs_T, counts_E = permuted_local_hidden_states, permuted_probs, tokens_per_expert
        pads = (self.config.fp8 is not None) and not self.skips_quantization_padding
        if pads:
            actual = backends.host_tokens_per_expert(counts_E).tolist()
            x_TH, padded = self.quantization_padding(x_TH, actual)
            probs_T = self.quantization_padding(probs_T.unsqueeze(-1), actual)[0].squeeze(-1)
            counts_E = torch.tensor(padded, dtype=torch.int64)
        self._run_forward_pre_hooks(x_TH)
        extra = (counts_E, probs_T, counts_E) + ((probs_T,) if self.config.add_bias_linear else ())
        out_TH = pipeline(x_TH, *extra)
        if pads:
            out_TH = self.quantization_unpadding(out_TH, actual)
        return out_TH, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.glu_interleave_size:
            return sharded
        fc1_params = {id(p) for p in self.linear_fc1.parameters()}
        for key, entry in sharded.items():
            if id(getattr(entry, "data", None)) in fc1_params:
                sharded[key] = concatenated_factory(entry, self.glu_interleave_size)
        return sharded

    def backward_dw(self):
        if not self.uses_op_fuser or self._ops is None:
            return super().backward_dw()
        if not self.config.delay_wgrad_compute:
            return
        fc1_op, _, fc2_op = self._ops
        for op, linear in ((fc2_op, self.linear_fc2), (fc1_op, self.linear_fc1)):
            op.backward_dw()
            linear._trigger_wgrad_accumulation_and_reduce_hooks()


def replacements():
    return [(BackendTEGroupedMLP, OpFuserTEGroupedMLP)]
