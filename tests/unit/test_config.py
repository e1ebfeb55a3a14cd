import dataclasses

import pytest
import torch

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.moe_patches.config import PatchedMLATransformerConfig, PatchedTransformerConfig
from megatron.moe_patches.fields import DEVICE_SPLITS_ENV_ALIAS, PATCH_FIELD_NAMES, patch_option
from megatron.moe_patches.registry import get

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
MOE = dict(
    BASE,
    num_moe_experts=8,
    moe_ffn_hidden_size=96,
    moe_grouped_gemm=True,
    gated_linear_unit=True,
    add_bias_linear=False,
)


def build(**overrides):
    return PatchedTransformerConfig(**{**MOE, **overrides})


def test_fields_are_dataclass_fields_and_registered():
    names = {f.name for f in dataclasses.fields(PatchedTransformerConfig)}
    assert set(PATCH_FIELD_NAMES) <= names
    assert set(PATCH_FIELD_NAMES) <= {f.name for f in dataclasses.fields(PatchedMLATransformerConfig)}
    assert set(get("C0").fields) == set(PATCH_FIELD_NAMES)
    # The stock class is untouched by merely importing the package.
    assert not set(PATCH_FIELD_NAMES) & {f.name for f in dataclasses.fields(TransformerConfig)}


def test_defaults_leave_stock_behaviour():
    config = build()
    assert config.use_transformer_engine_op_fuser is False
    assert config.moe_mlp_glu_interleave_size is None
    assert config.moe_device_tokens_per_expert is False
    stock = TransformerConfig(**MOE)
    # partial() init methods compare by identity; compare them by their repr instead.
    shared = [f.name for f in dataclasses.fields(TransformerConfig)]
    assert [repr(getattr(config, n)) for n in shared] == [repr(getattr(stock, n)) for n in shared]


def test_valid_combination_constructs():
    config = build(use_transformer_engine_op_fuser=True, moe_mlp_glu_interleave_size=32, add_bias_linear=True)
    assert config.use_transformer_engine_op_fuser and config.moe_mlp_glu_interleave_size == 32
    # Single grouped weights with the backend that holds them (grouped_mm: bf16, no bias).
    config = build(moe_single_grouped_weight=True, moe_device_tokens_per_expert=True,
                   activation_func=torch.nn.functional.silu, bf16=True, params_dtype=torch.bfloat16)
    assert config.moe_single_grouped_weight


def test_single_grouped_weight_refused_where_no_backend_can_hold_it():
    # The op fuser's grouped-tensor path is not driven; the grouped_mm backend computes in bf16.
    for overrides in (dict(use_transformer_engine_op_fuser=True),
                      dict(moe_device_tokens_per_expert=True, fp16=True, params_dtype=torch.float16)):
        with pytest.raises(ValueError, match="needs an expert backend that holds grouped parameters"):
            build(**{"moe_single_grouped_weight": True, "activation_func": torch.nn.functional.silu,
                     "bf16": not overrides.get("fp16"), "params_dtype": torch.bfloat16, **overrides})


INVALID = [
    (dict(moe_single_grouped_weight=True, moe_grouped_gemm=False, use_transformer_engine_op_fuser=True),
     "moe_single_grouped_weight=True needs TE grouped experts"),
    (dict(moe_single_grouped_weight=True), "needs an expert backend that holds grouped parameters"),
    (dict(moe_single_grouped_weight=True, use_transformer_engine_op_fuser=True, transformer_impl="local"),
     "moe_single_grouped_weight=True needs TE grouped experts"),
    (dict(moe_single_grouped_bias=True, use_transformer_engine_op_fuser=True, add_bias_linear=False),
     "moe_single_grouped_bias=True needs expert biases"),
    (dict(moe_single_grouped_bias=True, moe_grouped_gemm=False, add_bias_linear=True,
          use_transformer_engine_op_fuser=True),
     "moe_single_grouped_bias=True needs TE grouped experts"),
    (dict(moe_mlp_glu_interleave_size=0), "must be a positive integer"),
    (dict(moe_mlp_glu_interleave_size=-8), "must be a positive integer"),
    (dict(moe_mlp_glu_interleave_size=True), "must be a positive integer"),
    (dict(moe_mlp_glu_interleave_size=64), "must divide the per-partition MoE FFN size 96"),
    (dict(moe_mlp_glu_interleave_size=32, gated_linear_unit=False), "gated (GLU) MoE experts only"),
    (dict(use_transformer_engine_op_fuser=True, expert_tensor_parallel_size=2),
     "does not support expert tensor parallelism"),
    (dict(use_transformer_engine_op_fuser=True, transformer_impl="local"),
     "needs transformer_impl='transformer_engine'"),
    (dict(moe_hybridep_num_blocks_permute=0), "moe_hybridep_num_blocks_permute=0 must be a positive"),
    (dict(moe_hybridep_num_blocks_unpermute=-1), "moe_hybridep_num_blocks_unpermute=-1 must be a positive"),
    (dict(moe_hybridep_num_blocks_permute=8), "only applies to the HybridEP dispatcher"),
    (dict(moe_device_tokens_per_expert=True, moe_grouped_gemm=False), "grouped experts only"),
]


@pytest.mark.parametrize("overrides, message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_combination_raises_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match="Invalid MoE patch configuration") as err:
        build(**overrides)
    assert message in str(err.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ValueError) as err:
        build(moe_mlp_glu_interleave_size=0, moe_hybridep_num_blocks_permute=0)
    assert "moe_mlp_glu_interleave_size" in str(err.value)
    assert "moe_hybridep_num_blocks_permute" in str(err.value)


def test_interleave_checks_per_partition_size():
    # 96 / ETP 2 = 48 per partition: 32 divides 96 but not 48.
    with pytest.raises(ValueError, match="per-partition MoE FFN size 48"):
        build(moe_mlp_glu_interleave_size=32, expert_tensor_parallel_size=2)
    assert build(moe_mlp_glu_interleave_size=16, expert_tensor_parallel_size=2)


def test_hybridep_blocks_accepted_with_hybridep_dispatcher():
    config = build(
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        moe_hybridep_num_blocks_permute=16,
        moe_hybridep_num_blocks_unpermute=24,
    )
    assert (config.moe_hybridep_num_blocks_permute, config.moe_hybridep_num_blocks_unpermute) == (16, 24)


def test_env_alias_switches_device_splits(monkeypatch):
    monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, "1")
    assert build().moe_device_tokens_per_expert is True
    monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, "0")
    assert build().moe_device_tokens_per_expert is False


def test_env_alias_applies_only_to_grouped_experts(monkeypatch):
    # Dense layers and SequentialMLP experts ignore the process-wide switch; the explicit
    # field still refuses them.
    monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, "1")
    assert PatchedTransformerConfig(**BASE).moe_device_tokens_per_expert is False
    assert build(moe_grouped_gemm=False).moe_device_tokens_per_expert is False
    assert build().moe_device_tokens_per_expert is True
    with pytest.raises(ValueError, match="moe_device_tokens_per_expert=True applies to grouped experts"):
        PatchedTransformerConfig(**BASE, moe_device_tokens_per_expert=True)


@pytest.mark.parametrize("name, value", [
    ("moe_single_grouped_weight", 1),
    ("use_transformer_engine_op_fuser", "false"),
    ("moe_device_tokens_per_expert", None),
])
def test_boolean_fields_take_booleans(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r} must be True or False"):
        build(**{name: value})


@pytest.mark.parametrize("value", [True, 0, -3, 2.0])
def test_hybridep_block_counts_are_positive_integers(value):
    with pytest.raises(ValueError, match="moe_hybridep_num_blocks_permute=.* must be a positive integer"):
        build(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
              moe_hybridep_num_blocks_permute=value)


def test_mla_subclass_validates_once_and_stays_mla():
    config = PatchedMLATransformerConfig(**MOE, moe_mlp_glu_interleave_size=32)
    assert isinstance(config, MLATransformerConfig) and isinstance(config, PatchedTransformerConfig)
    assert config.multi_latent_attention
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):
        PatchedMLATransformerConfig(**MOE, moe_mlp_glu_interleave_size=7)


def test_patched_instances_pass_isinstance_against_stock_names():
    assert isinstance(PatchedTransformerConfig(**BASE), TransformerConfig)
    assert not isinstance(PatchedTransformerConfig(**BASE), MLATransformerConfig)
    assert isinstance(PatchedMLATransformerConfig(**BASE), MLATransformerConfig)
    assert not isinstance(TransformerConfig(**BASE), PatchedTransformerConfig)  # no metaclass pretends


def test_patch_option_defaults_for_stock_config():
    assert patch_option(TransformerConfig(**BASE), "moe_mlp_glu_interleave_size") is None
    assert patch_option(build(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size") == 32
    with pytest.raises(KeyError):
        patch_option(build(), "not_a_field")


def test_permute_fusion_into_hybridep_needs_the_hybridep_dispatcher():
    with pytest.raises(ValueError, match="moe_permute_fusion_into_hybridep=True only applies to the HybridEP"):
        build(moe_permute_fusion_into_hybridep=True)
    config = build(moe_permute_fusion_into_hybridep=True, moe_token_dispatcher_type="flex",
                   moe_flex_dispatcher_backend="hybridep")
    assert config.moe_permute_fusion_into_hybridep


def test_single_grouped_weight_needs_the_te_experts_not_the_legacy_ones():
    with pytest.raises(ValueError, match="needs TE grouped experts.*moe_use_legacy_grouped_gemm=False"):
        build(moe_single_grouped_weight=True, moe_use_legacy_grouped_gemm=True, use_transformer_engine_op_fuser=True)


@pytest.mark.parametrize("name", ["moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
                                  "moe_permute_fusion_into_hybridep"])
def test_hybridep_options_need_the_hybridep_backend_of_the_flex_dispatcher(name):
    value = True if name == "moe_permute_fusion_into_hybridep" else 8
    with pytest.raises(ValueError, match="HybridEP dispatcher"):
        build(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", **{name: value})
    assert getattr(build(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", **{name: value}),
                   name) == value
