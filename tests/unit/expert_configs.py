"""The patched config of the CPU expert tests: a small bf16 MoE on the sync-free path (8 experts,
hidden 64, SwiGLU), in bf16 (``cfg``) or FP8 (``fp8_config``, tensorwise unless told). A helper
module of its own name, so that tests under tests/unit and tests/gpu import it the same way
whichever folder pytest collects first."""

import torch

from megatron.moe_patches.config import PatchedTransformerConfig

BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_device_tokens_per_expert=True,
)


def _config(overrides, late_defaults):
    late = {k: overrides.pop(k) for k in ("fp8", "fp8_recipe", "fp8_param") if k in overrides}
    config = PatchedTransformerConfig(**{**BASE, **overrides})
    # set after construction: the config's validation would refuse FP8 without TE
    for name, value in {**late_defaults, **late}.items():
        setattr(config, name, value)
    return config


def cfg(**overrides):
    return _config(overrides, {})


def fp8_config(**overrides):
    return _config(overrides, {"fp8": "e4m3", "fp8_recipe": "tensorwise"})
