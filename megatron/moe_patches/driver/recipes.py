"""YAML recipes for pretrain_gpt.py: a flat ``flag: value`` form and Megatron's nested form.

Flat: keys are flag names with or without dashes (``num-layers`` or ``num_layers``).
Nested (Megatron-LM's ``--yaml-cfg``): ``language_model:`` and ``model_parallel:``
sections hold config field names (``num_moe_experts``, ``tensor_model_parallel_size``,
...), training keys sit at the top level. Either way every key must name a flag the
parser knows: an unknown key is an error naming it, never silently dropped. Values
from the recipe become parser defaults, so command-line flags override them.

Recipes are read strictly, like the command line: an int flag takes an integer (not
2.7, not true, not a list), a float flag takes a number, an on/off flag takes true or
false, and no flag takes null (leave the line out to keep the default). A file that is
not UTF-8, not YAML, holds a tag that builds Python objects, sets a key twice or sets
nothing is refused. Every ``RecipeError`` names the file and, where it is known, the line.
"""

import argparse
from typing import Any, Dict, Optional, Tuple

import yaml

NESTED_SECTIONS = ("language_model", "model_parallel")


def _on_off(name):
    def negate(value):
        if not isinstance(value, bool):
            raise RecipeError(f"'{name}' is on/off: give true or false, not {_spelled(value)}")
        return not value

    return negate


# Megatron config-field spellings (nested recipes) -> (flag dest, value transform).
FIELD_ALIASES = {
    "num_moe_experts": ("num_experts", None),
    "gated_linear_unit": ("swiglu", None),
    "add_bias_linear": ("disable_bias_linear", _on_off("add_bias_linear")),
    "fp8": ("fp8_format", None),
}


class RecipeError(ValueError):
    """A recipe that cannot be used; ``line`` (1-based) where the message does not say it yet."""

    def __init__(self, message: str, line: Optional[int] = None):
        super().__init__(message)
        self.line = line


class Recipe(dict):
    """{flag dest: value} read from ``path``, remembering each key's line and spelling."""

    def __init__(self, values=(), path: Optional[str] = None, lines=None, written=None):
        super().__init__(values)
        self.path = path
        self.lines: Dict[str, int] = dict(lines or {})  # dest -> line in the file
        self.written: Dict[str, str] = dict(written or {})  # dest -> the key as the file spells it

    def where(self, dest: str, source: Optional[str] = None) -> str:
        source = source or self.path or "recipe"
        line = self.lines.get(dest)
        return f"{source}:{line}" if line else str(source)

    def key(self, dest: str) -> str:
        return self.written.get(dest, dest)


def _spelled(value) -> str:
    """A value as YAML spells it (null, true) for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _dest(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def flatten_recipe(raw: Dict[str, Any], lines: Optional[Dict[Tuple[Optional[str], str], int]] = None) -> Recipe:
    """One flat {dest: value} Recipe from a flat or nested recipe.

    ``lines`` ((section or None, key) -> line) lets errors and the result carry lines.
    """
    lines = lines or {}
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe must be a mapping of flag names to values, not {type(raw).__name__}")
    flat = Recipe()
    for key, value in raw.items():
        if not isinstance(key, str):
            raise RecipeError(f"key {_spelled(key)} is not a flag name", lines.get((None, str(key))))
        if key in NESTED_SECTIONS:
            if not isinstance(value, dict):
                raise RecipeError(f"recipe section '{key}' must be a mapping", lines.get((None, key)))
            items = [(key, name, item) for name, item in value.items()]
        else:
            items = [(None, key, value)]
        for section, name, item in items:
            line = lines.get((section, str(name)))
            if not isinstance(name, str):
                raise RecipeError(f"key {_spelled(name)} in section '{section}' is not a flag name", line)
            dest = _dest(name)
            if dest in FIELD_ALIASES:
                dest, transform = FIELD_ALIASES[dest]
                try:
                    item = transform(item) if transform else item
                except RecipeError as err:
                    raise RecipeError(str(err), line) from None
            if dest in flat:
                raise RecipeError(f"recipe sets '{dest}' twice (as '{flat.key(dest)}' and '{name}')", line)
            flat[dest] = item
            flat.written[dest] = name
            if line:
                flat.lines[dest] = line
    return flat


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as err:
        raise RecipeError(f"{path}: cannot read the recipe: {err.strerror or err}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise RecipeError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "save the recipe as UTF-8"
        ) from None


def _yaml_error(path: str, err: yaml.YAMLError) -> RecipeError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in problem:
        tag = problem.split("'")[1] if problem.count("'") >= 2 else problem
        tag = tag.replace("tag:yaml.org,2002:", "!!")
        return RecipeError(
            f"{where}: unsupported YAML tag {tag}: a recipe holds plain values (numbers, strings, "
            "true/false, lists); tags that build Python objects are refused"
        )
    column = f" (column {mark.column + 1})" if mark is not None else ""
    said = f"{context}, {problem}" if context else problem
    return RecipeError(f"{where}: invalid YAML: {said}{column}")


def _key_lines(path: str, node) -> Dict[Tuple[Optional[str], str], int]:
    """(section or None, key) -> 1-based line; a key given twice in one mapping is an error
    (YAML loaders keep the last one silently)."""
    lines: Dict[Tuple[Optional[str], str], int] = {}

    def walk(mapping, section):
        seen: Dict[str, int] = {}
        for key_node, value_node in mapping.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in seen:
                raise RecipeError(f"{path}:{line}: '{key}' is set twice (also on line {seen[key]}); keep one")
            seen[key] = line
            lines[(section, key)] = line
            if section is None and key in NESTED_SECTIONS and isinstance(value_node, yaml.MappingNode):
                walk(value_node, key)

    if isinstance(node, yaml.MappingNode):
        walk(node, None)
    return lines


def read_recipe(path: str) -> Recipe:
    """The Recipe in the file ``path`` (no built-in names here: see ``load_recipe``)."""
    text = _read_text(path)
    try:
        raw = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    if raw is None or raw == {}:
        raise RecipeError(f"{path}: the recipe is empty (it sets no flag); give 'flag: value' lines or drop --yaml-cfg")
    lines = _key_lines(path, node)
    try:
        recipe = flatten_recipe(raw, lines)
    except RecipeError as err:
        where = f"{path}:{err.line}" if err.line else path
        raise RecipeError(f"{where}: {err}") from None
    if not recipe:
        raise RecipeError(f"{path}: the recipe is empty (its sections set no flag); give 'flag: value' lines")
    recipe.path = path
    return recipe


def load_recipe(path: str) -> Recipe:
    # --- built-in recipes: a path, or the name of one shipped in the package ("tiny-moe") ---
    from megatron.moe_patches.driver.builtin_recipes import resolve

    path = resolve(path)  # UnknownRecipe (an OSError) names the built-in recipes
    # --- end built-in recipes ---
    return read_recipe(path)


_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _scalar(kind, value, fail):
    """``value`` as one command-line value of type ``kind``, refusing what the command
    line could not have given (a float or a bool for an int flag, and so on)."""
    if value is None or isinstance(value, (bool, list, dict)):
        raise fail(f"needs {_KINDS.get(kind, 'one value')}, not {_spelled(value)}")
    if kind in (int, float):  # an int flag takes integers only; a float flag any number
        if isinstance(value, (int, float) if kind is float else int):
            return kind(value)
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                raise fail(f"cannot read {value!r} as {kind.__name__}") from None
        raise fail(f"needs {'a number' if kind is float else 'an integer'}, not {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)
        raise fail(f"needs a string, not {value!r} (quote it)")
    try:
        return kind(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise fail(f"cannot read {value!r} as {getattr(kind, '__name__', 'its type')}") from None


def convert_value(action: argparse.Action, value, fail):
    """A recipe value for ``action``'s flag, checked as strictly as the command line."""
    if value is None:
        raise fail("takes no null: leave the line out to keep the default")
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise fail(f"is an on/off flag; give true or false, not {_spelled(value)}")
        return value
    kind = action.type or str
    if action.nargs in ("*", "+") or isinstance(action.nargs, int) and action.nargs > 1:
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise fail("needs at least one value")
        converted = [_scalar(kind, item, fail) for item in items]
    elif isinstance(value, (list, dict)):
        raise fail(f"takes one value, not {'a list' if isinstance(value, list) else 'a mapping'} ({value!r})")
    else:
        converted = _scalar(kind, value, fail)
    choices = action.choices
    if choices is not None:
        for item in converted if isinstance(converted, list) else [converted]:
            if item not in choices:
                raise fail(f"must be one of {list(choices)}, not {value!r}")
    return converted


def apply_recipe(parser: argparse.ArgumentParser, recipe: Dict[str, Any], source: str) -> None:
    """Make the recipe's values the parser's defaults, after checking every key and type."""
    actions = {action.dest: action for action in parser._actions}  # argparse has no public map
    if not isinstance(recipe, Recipe):
        recipe = Recipe(recipe)
    values = {}
    for dest, value in recipe.items():
        where, key = recipe.where(dest, source), recipe.key(dest)
        action = actions.get(dest)
        if action is None or dest in ("help", "yaml_cfg"):
            raise RecipeError(f"{where}: unknown key '{dest}' (no flag --{dest.replace('_', '-')})")
        flag = action.option_strings[0] if action.option_strings else dest

        def fail(message, where=where, key=key, flag=flag):
            return RecipeError(f"{where}: '{key}' ({flag}) {message}")

        values[dest] = convert_value(action, value, fail)
    recipe.update(values)
    parser.set_defaults(**values)
