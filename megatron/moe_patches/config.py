"""Config fields of the patch set (series entry C0).

Patches: megatron-core's ``TransformerConfig`` / ``MLATransformerConfig`` gain the
fields of ``fields.MoEPatchFields`` through subclasses (never by editing the stock
dataclasses). ``apply()`` binds the config classes' public names (megatron-core's
``transformer_config`` module and ``megatron.core.transformer``; Megatron-LM's argument
modules where imported: the registry lists them) to those subclasses, so that code that
constructs the config by name (Megatron-LM's ``core_transformer_config_from_args``, user
scripts) builds and validates them too. Modules that imported the names before keep the stock
classes, which the subclasses pass every ``isinstance`` test of.

Why subclasses: builders filter constructor kwargs on ``dataclasses.fields``;
attributes that are not dataclass fields are silently dropped, and a wrapped
``__init__`` is bypassed by every dataclass subclass. Field names follow
upstream's spelling so recipes stay portable.
"""

import logging
from typing import List
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.moe_patches.fields import (
    DEVICE_SPLITS_ENV_ALIAS,
    LEGACY_GROUPED_GEMM,
    PATCH_FIELDS,
    MoEPatchFields,
    env_switch,
    log_once,
    uses_legacy_grouped_gemm,
)
from megatron.moe_patches.graph_scopes import CAPTURED_SCOPES, GraphScope, graph_scope, scope_names
from megatron.moe_patches.plan import expert_tp_size, plan_for

logger = logging.getLogger(__name__)

BOOL_FIELDS = tuple(f.name for f in PATCH_FIELDS if f.type in (bool, "bool"))


def validate_moe_patch_config(config) -> None:
    """Raise one ValueError listing every invalid combination of the patch fields.

    Runs at config construction, so a bad recipe fails before any GPU work. What the MoE
    layers can run here is the config's plan (``plan.plan_for``); this reads it.
    """
    errors = _bool_field_errors(config)
    if errors:  # the checks below read these fields as booleans
        raise ValueError("Invalid MoE patch configuration:\n  - " + "\n  - ".join(errors))
    plan = plan_for(config) if config.num_moe_experts is not None else None
    for rules in (_grouped_weight_errors, _interleave_errors, _op_fuser_errors, _hybridep_errors, _exchange_errors,
                  _graph_scope_errors):
        errors += rules(config, plan)
    if errors:
        raise ValueError("Invalid MoE patch configuration:\n  - " + "\n  - ".join(errors))


def _bool_field_errors(config) -> List[str]:
    errors = []
    for name in BOOL_FIELDS:  # 1 or "false" would read as True/False by accident
        value = getattr(config, name)
        if not isinstance(value, bool):
            errors.append(f"{name}={value!r} must be True or False.")
    return errors


# Each rule below: the messages of one group of fields, given the config and its plan (None
# without MoE layers).


def _grouped_weight_errors(config, plan) -> List[str]:
    errors = []
    te_grouped_experts = (
        plan is not None
        and config.moe_grouped_gemm
        and config.transformer_impl == "transformer_engine"
        and not uses_legacy_grouped_gemm(config)
    )
    grouped = [n for n in ("moe_single_grouped_weight", "moe_single_grouped_bias") if getattr(config, n)]
    if grouped and not te_grouped_experts:
        legacy = " and moe_use_legacy_grouped_gemm=False" if hasattr(config, LEGACY_GROUPED_GEMM) else ""
        errors.append(
            f"{'/'.join(grouped)}=True needs TE grouped experts: set num_moe_experts, "
            "moe_grouped_gemm=True (--moe-grouped-gemm), "
            f"transformer_impl='transformer_engine'{legacy}."
        )
    elif grouped and plan.single_grouped_refusal is not None:
        errors.append(plan.single_grouped_refusal)
    if config.moe_single_grouped_bias and not config.add_bias_linear:
        errors.append(
            "moe_single_grouped_bias=True needs expert biases: set add_bias_linear=True "
            "(drop --disable-bias-linear) or unset moe_single_grouped_bias."
        )
    return errors


def _interleave_errors(config, plan) -> List[str]:
    interleave = config.moe_mlp_glu_interleave_size
    if interleave is None:
        return []
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave <= 0:
        return [f"moe_mlp_glu_interleave_size={interleave!r} must be a positive integer or None."]
    if plan is None or not config.gated_linear_unit:
        return ["moe_mlp_glu_interleave_size applies to gated (GLU) MoE experts only: set "
                "num_moe_experts and gated_linear_unit=True (--swiglu), or unset it."]
    etp = expert_tp_size(config)
    ffn_per_partition = config.moe_ffn_hidden_size // etp
    if ffn_per_partition % interleave:
        return [f"moe_mlp_glu_interleave_size={interleave} must divide the per-partition MoE "
                f"FFN size {ffn_per_partition} (moe_ffn_hidden_size={config.moe_ffn_hidden_size}"
                f" / expert_tensor_parallel_size={etp}); choose a divisor of it."]
    return []


def _op_fuser_errors(config, plan) -> List[str]:
    if not config.use_transformer_engine_op_fuser:
        return []
    errors = []
    if config.transformer_impl != "transformer_engine":
        errors.append("use_transformer_engine_op_fuser=True needs transformer_impl='transformer_engine'.")
    if plan is not None and expert_tp_size(config) > 1:
        errors.append(
            "use_transformer_engine_op_fuser=True does not support expert tensor parallelism: "
            f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}; set "
            "--expert-tensor-parallel-size 1 or drop --use-transformer-engine-op-fuser."
        )
    return errors


def _hybridep_errors(config, plan) -> List[str]:
    errors = []
    hybridep = config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep"
    if config.moe_permute_fusion_into_hybridep and not hybridep:
        errors.append(
            "moe_permute_fusion_into_hybridep=True only applies to the HybridEP dispatcher: set "
            "moe_token_dispatcher_type='flex' and moe_flex_dispatcher_backend='hybridep', or unset it."
        )
    for name in ("moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute"):
        blocks = getattr(config, name)
        if blocks is None:
            continue
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks <= 0:
            errors.append(f"{name}={blocks!r} must be a positive integer, or None to let HybridEP choose.")
        elif not hybridep:
            errors.append(
                f"{name} only applies to the HybridEP dispatcher: set "
                "moe_token_dispatcher_type='flex' and moe_flex_dispatcher_backend='hybridep', "
                f"or unset {name}."
            )
    return errors


def _exchange_errors(config, plan) -> List[str]:
    errors = []
    if config.moe_device_tokens_per_expert and not _has_grouped_experts(config):
        errors.append(
            "moe_device_tokens_per_expert=True applies to grouped experts only: set "
            "num_moe_experts and moe_grouped_gemm=True, or drop --moe-device-tokens-per-expert."
        )
    if config.moe_symmetric_exchange and plan is None:
        errors.append("moe_symmetric_exchange=True applies to MoE layers only: set num_moe_experts, "
                      "or drop --moe-symmetric-exchange.")
    elif plan is not None:
        errors.extend(plan.exchange.contradictions)
    return errors


def _graph_scope_errors(config, plan) -> List[str]:
    captured = plan.graph_scope if plan is not None else GraphScope.NONE
    if captured.by_layer:
        names = scope_names(config.cuda_graph_scope)
        scope = " ".join(names) or "(none: the whole layer)"
        if frozenset(names) not in CAPTURED_SCOPES:
            return [
                f"cuda_graph_scope={scope}: for dropless MoE the patch set captures each MoE layer "
                "(--cuda-graph-scope moe) or each transformer layer whole (no --cuda-graph-scope, or attn moe), "
                "and megatron-core's other scopes would capture the MoE layers again; use one of those."]
        if plan.graph_blocker is not None:
            return [
                f"cuda_graph_scope={scope} for dropless MoE needs the graph-safe MoE layer (F11) in a CUDA graph "
                f"of the {plan.graph_unit}, and this config cannot have it: {plan.graph_blocker}. Fix that, or "
                + ("drop moe from --cuda-graph-scope." if "moe" in names
                   else "give --cuda-graph-scope attn (megatron-core's graphs of the attention alone).")]
    elif captured is GraphScope.FULL_ITERATION and plan.full_iteration_blocker is not None:
        return [
            "cuda_graph_scope=full_iteration replays every micro-batch's forward and backward, MoE layers "
            f"included, as one CUDA graph, and this config's MoE layers cannot be in it: "
            f"{plan.full_iteration_blocker}."]
    return []


def _has_grouped_experts(config) -> bool:
    return config.num_moe_experts is not None and bool(config.moe_grouped_gemm)


def _resolve_env_aliases(config) -> None:
    """The seed's variable is a process-wide switch (TE reads it per GEMM): it turns
    moe_device_tokens_per_expert on where it can apply, grouped experts, and leaves dense
    layers and SequentialMLP experts alone, saying so once."""
    if not env_switch(DEVICE_SPLITS_ENV_ALIAS) or config.moe_device_tokens_per_expert:
        return
    if _has_grouped_experts(config):
        log_once(logger, logging.INFO, f"{DEVICE_SPLITS_ENV_ALIAS}=1: setting moe_device_tokens_per_expert=True")
        config.moe_device_tokens_per_expert = True
    else:
        log_once(
            logger,
            logging.INFO,
            f"{DEVICE_SPLITS_ENV_ALIAS}=1 ignored for a config without grouped experts "
            "(dense layers, SequentialMLP experts): moe_device_tokens_per_expert stays off.",
        )


@dataclass
class PatchedTransformerConfig(TransformerConfig, MoEPatchFields):
    """megatron-core's TransformerConfig plus the MoE patch fields, validated at construction."""

    # the patch set's own rules, which the preflight also runs on kwargs before megatron-core's checks
    patch_rules = staticmethod(validate_moe_patch_config)

    def __post_init__(self):
        # megatron-core asserts that moe-scope graphs are drop-and-pad only; the patch
        # validation below checks dropless ones instead (the plan's graph_blocker), so megatron-core's
        # graph checks run without the impl, which they are all conditioned on.
        impl = self.cuda_graph_impl
        bypass = graph_scope(self).by_layer and not (self.enable_cuda_graph or self.external_cuda_graph)
        if bypass:
            self.cuda_graph_impl = "none"
        try:
            super().__post_init__()
        finally:
            self.cuda_graph_impl = impl
        _resolve_env_aliases(self)
        validate_moe_patch_config(self)


@dataclass
class PatchedMLATransformerConfig(MLATransformerConfig, PatchedTransformerConfig):
    """MLATransformerConfig plus the MoE patch fields.

    MRO: MLA -> PatchedTransformerConfig -> TransformerConfig, so MLA's ``__post_init__``
    reaches the patch validation through its ``super()`` call, exactly once.
    """
