"""YAML recipes for pretrain_gpt.py: a flat ``flag: value`` form and Megatron's nested form.

Flat: keys are flag names with or without dashes (``num-layers`` or ``num_layers``).
Nested (Megatron-LM's ``--yaml-cfg``): ``language_model:`` and ``model_parallel:``
sections hold config field names (``num_moe_experts``, ``tensor_model_parallel_size``,
...), training keys sit at the top level. Either way every key must name a flag the
parser knows: an unknown key is an error naming it, never silently dropped. Values
from the recipe become parser defaults, so command-line flags override them.
"""

import argparse
from typing import Any, Dict

import yaml

NESTED_SECTIONS = ("language_model", "model_parallel")

# Megatron config-field spellings (nested recipes) -> (flag dest, value transform).
FIELD_ALIASES = {
    "num_moe_experts": ("num_experts", None),
    "gated_linear_unit": ("swiglu", None),
    "add_bias_linear": ("disable_bias_linear", lambda v: not v),
    "fp8": ("fp8_format", None),
}


class RecipeError(ValueError):
    pass


def _dest(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def flatten_recipe(raw: Dict[str, Any]) -> Dict[str, Any]:
    """One flat {dest: value} dict from a flat or nested recipe."""
    if not isinstance(raw, dict):
        raise RecipeError("a recipe must be a mapping of flag names to values")
    flat: Dict[str, Any] = {}
    for key, value in raw.items():
        if key in NESTED_SECTIONS:
            if not isinstance(value, dict):
                raise RecipeError(f"recipe section '{key}' must be a mapping")
            items = value.items()
        else:
            items = [(key, value)]
        for name, item in items:
            dest = _dest(name)
            if dest in FIELD_ALIASES:
                dest, transform = FIELD_ALIASES[dest]
                item = transform(item) if transform else item
            if dest in flat:
                raise RecipeError(f"recipe sets '{dest}' twice")
            flat[dest] = item
    return flat


def load_recipe(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle) or {}
    try:
        return flatten_recipe(raw)
    except RecipeError as err:
        raise RecipeError(f"{path}: {err}") from None


def apply_recipe(parser: argparse.ArgumentParser, recipe: Dict[str, Any], source: str) -> None:
    """Make the recipe's values the parser's defaults, after checking every key and type."""
    actions = {action.dest: action for action in parser._actions}  # argparse has no public map
    for dest, value in recipe.items():
        action = actions.get(dest)
        if action is None or dest in ("help", "yaml_cfg"):
            raise RecipeError(f"{source}: unknown key '{dest}' (no flag --{dest.replace('_', '-')})")
        if action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise RecipeError(f"{source}: '{dest}' is an on/off flag; give true or false, not {value!r}")
        elif value is not None:
            convert = action.type or str
            try:
                value = [convert(v) for v in value] if isinstance(value, list) else convert(value)
            except (TypeError, ValueError):
                raise RecipeError(f"{source}: '{dest}': cannot read {value!r} as {convert.__name__}") from None
            choices = action.choices
            if choices is not None and value not in choices:
                raise RecipeError(f"{source}: '{dest}' must be one of {list(choices)}, not {value!r}")
        recipe[dest] = value
    parser.set_defaults(**recipe)
