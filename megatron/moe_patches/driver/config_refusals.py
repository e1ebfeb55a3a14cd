"""The config's refusals as the driver words them: a TransformerConfig error turned into one
message naming the flags behind the fields (the config itself is judged in ``preflight``)."""

import re
from typing import List

from megatron.moe_patches.driver.parser import dest_flags
from megatron.moe_patches.driver.recipes import FIELD_ALIASES

# --- the full TransformerConfig, before start-up ---------------------------------------

PATCH_ERROR_PREFIX = "Invalid MoE patch configuration"

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
