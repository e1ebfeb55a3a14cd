"""Config fields of the patch set (series entry C0).

Patches: megatron-core's ``TransformerConfig`` / ``MLATransformerConfig`` gain the
fields below through subclasses (never by editing the stock dataclasses), and
``apply()`` rebinds the stock names to those subclasses so that stock entry
points (Megatron-LM's ``core_transformer_config_from_args``, user scripts)
construct and validate them too.

Why subclasses: builders filter constructor kwargs on ``dataclasses.fields``;
attributes that are not dataclass fields are silently dropped, and a wrapped
``__init__`` is bypassed by every dataclass subclass. Field names follow
upstream's spelling so recipes stay portable.
"""

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

logger = logging.getLogger(__name__)

# The seed (ROCm PR) switches device-resident splits on with this variable.
DEVICE_SPLITS_ENV_ALIAS = "NVTE_USE_GROUPED_GEMM_TRITON"


def _field(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class MoEPatchFields:
    """The fields this patch set adds; ``metadata["help"]`` is each flag's --help text."""

    use_transformer_engine_op_fuser: bool = _field(
        False,
        "Run the TE grouped experts as one transformer_engine.pytorch.ops pipeline "
        "(FC1 -> router-prob-weighted activation -> FC2).",
    )
    moe_mlp_glu_interleave_size: Optional[int] = _field(
        None,
        "Store FC1's GLU output rows as alternating gate/linear blocks of this many rows "
        "(must divide the per-partition MoE FFN size). Default: the concatenated layout.",
    )
    moe_single_grouped_weight: bool = _field(
        False, "Store each expert FC weight as one [num_experts, out, in] grouped parameter."
    )
    moe_single_grouped_bias: bool = _field(
        False, "Store each expert FC bias as one [num_experts, out] grouped parameter."
    )
    moe_hybridep_num_blocks_permute: Optional[int] = _field(
        None, "CUDA thread blocks for the permute fused into HybridEP dispatch (default: HybridEP chooses)."
    )
    moe_hybridep_num_blocks_unpermute: Optional[int] = _field(
        None,
        "CUDA thread blocks for the unpermute fused into HybridEP combine (default: HybridEP chooses).",
    )
    moe_device_tokens_per_expert: bool = _field(
        False,
        "Keep tokens_per_expert on the GPU from routing to the expert GEMMs (no host sync where "
        "the expert backend takes device splits). NVTE_USE_GROUPED_GEMM_TRITON=1 also sets it.",
    )


PATCH_FIELDS = tuple(dataclasses.fields(MoEPatchFields))
PATCH_FIELD_NAMES = tuple(f.name for f in PATCH_FIELDS)


def patch_option(config, name: str):
    """A patch field's value, or its default for a config built from a stock class."""
    if name not in PATCH_FIELD_NAMES:
        raise KeyError(f"{name!r} is not a field of MoEPatchFields")
    default = next(f.default for f in PATCH_FIELDS if f.name == name)
    return getattr(config, name, default)


def grouped_param_backends(config) -> tuple:
    """Expert backends switched on in ``config`` that can hold single grouped parameters."""
    from megatron.moe_patches.expert_backends import GROUPED_MM, select_expert_backend

    backends = ("te_op_fuser",) if config.use_transformer_engine_op_fuser else ()
    if select_expert_backend(config)[0] == GROUPED_MM:
        backends += (GROUPED_MM,)
    return backends


def validate_moe_patch_config(config) -> None:
    """Raise one ValueError listing every invalid combination of the patch fields.

    Runs at config construction, so a bad recipe fails before any GPU work.
    """
    errors = []
    is_moe = config.num_moe_experts is not None
    te_grouped_experts = (
        is_moe
        and config.moe_grouped_gemm
        and config.transformer_impl == "transformer_engine"
        and not config.moe_use_legacy_grouped_gemm
    )

    for name in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
        if not getattr(config, name):
            continue
        if not te_grouped_experts:
            errors.append(
                f"{name}=True needs TE grouped experts: set num_moe_experts, "
                "moe_grouped_gemm=True (--moe-grouped-gemm), "
                "transformer_impl='transformer_engine' and moe_use_legacy_grouped_gemm=False."
            )
        elif not grouped_param_backends(config):
            errors.append(
                f"{name}=True needs an expert backend that holds grouped parameters: "
                "--moe-device-tokens-per-expert (the grouped_mm backend: bf16, SwiGLU/quick-GEGLU, "
                "no bias, ETP 1) or --use-transformer-engine-op-fuser."
            )
    if config.moe_single_grouped_bias and not config.add_bias_linear:
        errors.append(
            "moe_single_grouped_bias=True needs expert biases: set add_bias_linear=True "
            "(drop --disable-bias-linear) or unset moe_single_grouped_bias."
        )

    interleave = config.moe_mlp_glu_interleave_size
    if interleave is not None:
        if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave <= 0:
            errors.append(
                f"moe_mlp_glu_interleave_size={interleave!r} must be a positive integer or None."
            )
        elif not is_moe or not config.gated_linear_unit:
            errors.append(
                "moe_mlp_glu_interleave_size applies to gated (GLU) MoE experts only: set "
                "num_moe_experts and gated_linear_unit=True (--swiglu), or unset it."
            )
        else:
            etp = config.expert_tensor_parallel_size or 1
            ffn_per_partition = config.moe_ffn_hidden_size // etp
            if ffn_per_partition % interleave:
                errors.append(
                    f"moe_mlp_glu_interleave_size={interleave} must divide the per-partition MoE "
                    f"FFN size {ffn_per_partition} (moe_ffn_hidden_size={config.moe_ffn_hidden_size}"
                    f" / expert_tensor_parallel_size={etp}); choose a divisor of it."
                )

    if config.use_transformer_engine_op_fuser:
        if config.transformer_impl != "transformer_engine":
            errors.append(
                "use_transformer_engine_op_fuser=True needs transformer_impl='transformer_engine'."
            )
        if is_moe and (config.expert_tensor_parallel_size or 1) > 1:
            errors.append(
                "use_transformer_engine_op_fuser=True does not support expert tensor parallelism: "
                f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}; set "
                "--expert-tensor-parallel-size 1 or drop --use-transformer-engine-op-fuser."
            )

    for name in ("moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute"):
        blocks = getattr(config, name)
        if blocks is None:
            continue
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks <= 0:
            errors.append(f"{name}={blocks!r} must be a positive integer, or None to let HybridEP choose.")
        elif not (
            config.moe_token_dispatcher_type == "flex"
            and config.moe_flex_dispatcher_backend == "hybridep"
        ):
            errors.append(
                f"{name} only applies to the HybridEP dispatcher: set "
                "moe_token_dispatcher_type='flex' and moe_flex_dispatcher_backend='hybridep', "
                f"or unset {name}."
            )

    if config.moe_device_tokens_per_expert and not (is_moe and config.moe_grouped_gemm):
        errors.append(
            "moe_device_tokens_per_expert=True (or NVTE_USE_GROUPED_GEMM_TRITON=1) applies to "
            "grouped experts only: set num_moe_experts and moe_grouped_gemm=True."
        )

    if errors:
        raise ValueError("Invalid MoE patch configuration:\n  - " + "\n  - ".join(errors))


def _resolve_env_aliases(config) -> None:
    if not config.moe_device_tokens_per_expert and os.environ.get(DEVICE_SPLITS_ENV_ALIAS) == "1":
        logger.info("%s=1: setting moe_device_tokens_per_expert=True", DEVICE_SPLITS_ENV_ALIAS)
        config.moe_device_tokens_per_expert = True


class _AcceptsStockInstances(type):
    """Metaclass: once ``apply()`` rebinds ``TransformerConfig`` to the patched class,
    megatron-core's ``isinstance(config, TransformerConfig)`` checks must still accept
    configs built from the stock class (before apply, or by code holding the stock name)."""

    def __instancecheck__(cls, obj):
        return type.__instancecheck__(cls, obj) or isinstance(obj, cls.stock_class)

    def __subclasscheck__(cls, sub):
        return type.__subclasscheck__(cls, sub) or issubclass(sub, cls.stock_class)


@dataclass
class PatchedTransformerConfig(TransformerConfig, MoEPatchFields, metaclass=_AcceptsStockInstances):
    """megatron-core's TransformerConfig plus the MoE patch fields, validated at construction."""

    stock_class = TransformerConfig  # not annotated: a class attribute, not a field

    def __post_init__(self):
        super().__post_init__()
        _resolve_env_aliases(self)
        validate_moe_patch_config(self)


@dataclass
class PatchedMLATransformerConfig(MLATransformerConfig, PatchedTransformerConfig):
    """MLATransformerConfig plus the MoE patch fields.

    MRO: MLA -> PatchedTransformerConfig -> TransformerConfig, so MLA's ``__post_init__``
    reaches the patch validation through its ``super()`` call, exactly once.
    """

    stock_class = MLATransformerConfig


def replacements():
    """C0's (stock, patched) pairs for ``apply()``."""
    return [
        (TransformerConfig, PatchedTransformerConfig),
        (MLATransformerConfig, PatchedMLATransformerConfig),
    ]
