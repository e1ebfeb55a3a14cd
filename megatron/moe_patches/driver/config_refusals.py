"""The config built from the args, as its refusals read: a TransformerConfig error turned into
one message naming the flags behind the fields, the patch set's own refusal first, and the
fields whose megatron-core checks ask Transformer Engine."""

import dataclasses
import re
from typing import List, Optional

from megatron.moe_patches.driver.parser import dest_flags
from megatron.moe_patches.driver.recipes import FIELD_ALIASES

# --- the full TransformerConfig, before start-up ---------------------------------------

PATCH_ERROR_PREFIX = "Invalid MoE patch configuration"

# Fields whose stock TransformerConfig checks ask Transformer Engine itself rather than
# judge the flags: without TE they fail for every value. Where TE cannot be imported
# (a CPU machine), validate_config builds the config without them, then runs the patch
# set's checks (which need no TE) with them set, and leaves megatron-core's TE checks to
# setup() on the GPU machine, where TE is installed and they run in full.
TE_PROBED_FIELDS = {
    "moe_permute_fusion": "megatron-core imports TE's fused permute kernels to check it",
    "apply_rope_fusion": "megatron-core imports TE's fused RoPE kernels to check it",
    "fp8": "megatron-core checks TE's version for FP8 MoE training",
    "fp8_recipe": "read only together with fp8",
    "moe_router_padding_for_quantization": "megatron-core checks it against fp8 (check_args checks it instead)",
}
# The same where megatron-core has the patch set's fields natively (and the patch set does
# not install): its own checks of these ask TE's version.
NATIVE_TE_PROBED_FIELDS = {
    "moe_single_grouped_weight": "megatron-core checks TE's version for single grouped weights",
    "moe_single_grouped_bias": "megatron-core checks TE's version for single grouped biases",
}

# Config field -> the flag's dest, where they differ.
_CONFIG_FIELD_DESTS = {
    **{field: dest for field, (dest, _) in FIELD_ALIASES.items()},
    "activation_func": "swiglu",
    "params_dtype": "bf16",
    "pipeline_dtype": "bf16",
}


def flags_named_in(text: str) -> List[str]:
    """The flags behind the config field names a message mentions, in order."""
    flags = []
    for word in re.findall(r"[A-Za-z][A-Za-z0-9_]*", text):
        if "_" not in word and word not in _CONFIG_FIELD_DESTS:
            continue  # plain words ("load", "seed") are not field names here
        flag = dest_flags().get(_CONFIG_FIELD_DESTS.get(word, word))
        if flag and flag not in flags and flag not in text:
            flags.append(flag)
    return flags


def _with_flags(text: str) -> str:
    flags = flags_named_in(text)
    return f"{text} [{', '.join(flags)}]" if flags else text


def config_error_message(err: Exception) -> str:
    """A config construction error as pretrain_gpt.py reports it: the first line says the
    first problem and names its flags."""
    text = str(err).strip()
    if text.startswith(PATCH_ERROR_PREFIX):
        problems = [" ".join(p.split()) for p in re.split(r"\n\s*- ", text)[1:]] or [text]
        lines = [f"{PATCH_ERROR_PREFIX}: {_with_flags(problems[0])}"]
        lines += [f"  - {_with_flags(problem)}" for problem in problems[1:]]
        return "\n".join(lines)
    text = " ".join(text.split()) or f"{type(err).__name__} without a message"
    return f"megatron-core's TransformerConfig refuses these arguments: {_with_flags(text)}"


def patch_refusal(kwargs: dict) -> Optional[ValueError]:
    """The patch set's own refusal of these config kwargs, judged without megatron-core's
    checks (whose bare asserts would otherwise speak first), or None."""
    from megatron.moe_patches.config import PatchedTransformerConfig, validate_moe_patch_config

    config = object.__new__(PatchedTransformerConfig)  # the fields, none of the checks
    for field in dataclasses.fields(PatchedTransformerConfig):
        if field.name in kwargs:
            value = kwargs[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        setattr(config, field.name, value)
    if config.expert_tensor_parallel_size is None:  # megatron-core's defaults the checks read
        config.expert_tensor_parallel_size = config.tensor_model_parallel_size
    if config.num_moe_experts is not None and config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    try:
        validate_moe_patch_config(config)
    except ValueError as err:
        return err
    except Exception:  # a value the checks cannot read before megatron-core's normalisation
        return None
    return None
