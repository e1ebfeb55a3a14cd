"""YAML recipes for pretrain_gpt.py: a flat ``flag: value`` form and Megatron-LM's nested form.

Flat: keys are flag names with or without dashes (``num-layers``, ``num_layers``,
``no-rope-fusion``) or the flags' dests. Nested, as Megatron-LM's ``--yaml-cfg`` files are
written: ``language_model:`` and ``model_parallel:`` sections hold TransformerConfig field
names (``num_moe_experts``, ``gated_linear_unit``, ``activation_func``, ...), the other
settings sit at the top level under their dests. Every key must name a flag the parser
knows (Megatron-LM's refused ones included: ``megatron_lm_flags``), or, in a section, a
TransformerConfig field left at megatron-core's default: an unknown key is an error naming
it, never silently dropped. Values become parser defaults, so command-line flags override
them.

Megatron-LM's reading of its YAML files, kept here: a null value means "not set" (the
line counts as absent); a plain (unquoted) value holding ``${NAME}`` has each such reference
replaced by the environment variable NAME, and an unset variable is an error; a key given
both at the top level and in a section, or in both sections, is refused (Megatron-LM's
reader stops on it too); and where a section and the top level set the same setting under
different names (``gated_linear_unit`` and ``swiglu``, ``num_moe_experts`` and
``num_experts``), the section's value wins, as Megatron-LM builds the model config from the
sections alone. In a section, ``activation_func`` decides the MLP's activation over
``gated_linear_unit``, as Megatron-LM's YAML reader does.

Recipes are read strictly, like the command line: an int flag takes an integer (not 2.7,
not true, not a list), a float flag takes a number, an on/off flag takes true or false. A
file that is not UTF-8, not YAML, holds a tag that builds Python objects, sets a key twice
in one mapping or sets nothing is refused. So is a file whose YAML aliases repeat more than
``ALIAS_EXPANSION_VALUES`` values or ``ALIAS_EXPANSION_CHARACTERS`` characters beyond what it
writes (an alias bomb: a few lines that expand to billions of values), or that nests values
more than ``NESTING_LIMIT`` levels deep: both are refused while the file is composed, before a
Python value is built. Every ``RecipeError`` names the file and, where it is known, the line;
a value it echoes is shortened (``_spelled``), never printed whole.
"""

import argparse
import dataclasses
import functools
import os
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import yaml

from megatron.moe_patches.fields import SHOWN_HEAD, SHOWN_LIMIT, shown

NESTED_SECTIONS = ("language_model", "model_parallel")


def _on_off(name):
    def negate(value):
        if not isinstance(value, bool):
            raise RecipeError(f"'{name}' is on/off: give true or false, not {_spelled(value)}")
        return not value

    return negate


def _activation(value):
    """Megatron-LM's YAML ``activation_func``: swiglu or gelu (this driver's two MLPs)."""
    if value not in ("swiglu", "gelu"):
        raise RecipeError(f"'activation_func' {_spelled(value)}: this driver builds gelu or swiglu MLPs only")
    return value == "swiglu"


# Megatron-LM's config-field and dest spellings that this driver keeps under another dest:
# spelling -> (dest, value transform).
FIELD_ALIASES = {
    "num_moe_experts": ("num_experts", None),
    "gated_linear_unit": ("swiglu", None),
    "activation_func": ("swiglu", _activation),
    "add_bias_linear": ("disable_bias_linear", _on_off("add_bias_linear")),
    "fp8": ("fp8_format", None),
}


class RecipeError(ValueError):
    """A recipe that cannot be used; ``line`` (1-based) where the message does not say it yet.

    ``problems``: each key's error where several keys are wrong (the message is theirs, one a
    line); a single problem is the error itself.
    """

    def __init__(self, message: str, line: Optional[int] = None, problems: Optional[List["RecipeError"]] = None):
        super().__init__(message)
        self.line = line
        self.problems: List[RecipeError] = list(problems) if problems else [self]

    @classmethod
    def of(cls, problems: List["RecipeError"]) -> "RecipeError":
        """One error for ``problems`` (not empty): the error itself where there is one."""
        if len(problems) == 1:
            return problems[0]
        return cls("\n".join(str(problem) for problem in problems), problems=problems)


class UnknownKey(RecipeError):
    """A key no flag takes: left out of the recipe, it changes no value the other checks read,
    so they run too and their problems are reported with it."""


def _collect(problems: List[RecipeError], collected: Optional[List[RecipeError]]) -> None:
    """Hand the per-key ``problems`` to the caller's ``collected`` list, or raise them as one
    RecipeError where the caller gave none."""
    if collected is not None:
        collected.extend(problems)
    elif problems:
        raise RecipeError.of(problems)


class Recipe(dict):
    """{flag dest: value} read from ``path``, remembering each key's line and spelling."""

    def __init__(self, values=(), path: Optional[str] = None, lines=None, written=None):
        super().__init__(values)
        self.path = path
        self.lines: Dict[str, int] = dict(lines or {})  # dest -> line in the file
        self.written: Dict[str, str] = dict(written or {})  # dest -> the key as the file spells it
        self.notes: list = []  # each key read and ignored (UNFLAGGED_KEYS): its RecipeError; read_recipe's: lines

    def where(self, dest: str, source: Optional[str] = None) -> str:
        source = source or self.path or "recipe"
        line = self.lines.get(dest)
        return f"{source}:{line}" if line else str(source)

    def key(self, dest: str) -> str:
        return self.written.get(dest, dest)


def _repr_pieces(value, room: int):
    """repr(value) in pieces, each at most about ``room`` characters: a list's items are
    written one by one and a long string or bytes value is cut, so a caller that stops after
    ``room`` characters never builds the whole repr of a large value."""
    if type(value) in (list, dict, set) and value:  # what YAML's safe tags build; an empty set is set()
        yield "[" if isinstance(value, list) else "{"
        for index, item in enumerate(value):
            if index:
                yield ", "
            yield from _repr_pieces(item, room)
            if isinstance(value, dict):
                yield ": "
                yield from _repr_pieces(value[item], room)
        yield "]" if isinstance(value, list) else "}"
    elif isinstance(value, (str, bytes)) and len(value) > room:
        yield repr(value[:room])[:-1]  # no closing quote: the value goes on
        yield "..."
    else:
        yield repr(value)


def _bounded_repr(value, limit: int = SHOWN_LIMIT) -> str:
    """repr(value) when it is at most ``limit`` characters; else at least ``limit + 1`` of its
    first characters (never many more), so a message can tell it was cut."""
    text = ""
    for piece in _repr_pieces(value, limit + 1):
        text += piece
        if len(text) > limit:
            break
    return text


def _spelled(value) -> str:
    """A value as YAML spells it (null, true) for messages, a long one shortened without
    building its whole repr (a list may repeat a long string many times)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(shown(value))
    text = _bounded_repr(value)
    return text if len(text) <= SHOWN_LIMIT else f"{text[:SHOWN_HEAD]}... (over {SHOWN_LIMIT} characters)"


def _dest(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


class Setting(NamedTuple):
    """One key of the recipe, resolved to the dest it sets."""

    section: Optional[str]  # None: the top level
    key: str  # as the file spells it
    dest: str
    value: Any
    line: Optional[int]

    def place(self) -> str:
        return "at the top level" if self.section is None else f"in '{self.section}'"


@functools.lru_cache(maxsize=None)
def _config_field_defaults() -> Dict[str, Any]:
    """megatron-core's TransformerConfig fields and their defaults: what a section's key
    that no flag sets may hold (Megatron-LM's YAML sections are config fields)."""
    from megatron.core.transformer import TransformerConfig

    defaults = {}
    for field in dataclasses.fields(TransformerConfig):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return defaults


def _switch(key: str, flag: str, const):
    """A flag-named on/off key (``no-rope-fusion: true``): true gives the flag, false leaves
    it out."""
    def given(value):
        if not isinstance(value, bool):
            raise RecipeError(f"'{key}' ({flag}) is an on/off flag; give true or false, not {_spelled(value)}")
        return const if value else None

    return given


def _resolve(parser: argparse.ArgumentParser, section: Optional[str], key: str) -> Tuple[str, Optional[Callable]]:
    """(dest, value transform) of a recipe key, or RecipeError for a key no flag or field takes."""
    name = _dest(key)
    if name in FIELD_ALIASES:
        return FIELD_ALIASES[name]
    if any(action.dest == name for action in parser._actions):  # Megatron-LM's YAML keys are dests
        return name, None
    option = parser._option_string_actions.get("--" + name.replace("_", "-"))  # argparse has no public lookup
    if option is not None and option.nargs == 0:
        return option.dest, _switch(key, option.option_strings[0], option.const)
    if option is not None:
        return option.dest, None
    if section is not None and name in _config_field_defaults():
        return name, None  # a config field no flag sets: _unflagged_field judges its value
    raise UnknownKey(f"unknown key '{shown(name)}' (no flag --{shown(name.replace('_', '-'))})")


def _unflagged_field(parser: argparse.ArgumentParser, setting: Setting) -> bool:
    """Whether ``setting`` is a config field no flag sets; refused unless it holds
    megatron-core's default, which is what this driver builds the config with, or is one
    whose every value changes nothing here (``megatron_lm_flags.NO_EFFECT_FIELDS``)."""
    if any(action.dest == setting.dest for action in parser._actions):
        return False
    from megatron.moe_patches.driver.megatron_lm_flags import NO_EFFECT_FIELDS

    default = _config_field_defaults()[setting.dest]
    if setting.value != default and setting.dest not in NO_EFFECT_FIELDS:
        raise RecipeError(f"'{setting.key}' {_spelled(setting.value)}: this driver builds the TransformerConfig "
                          f"with megatron-core's {setting.dest}={_bounded_repr(default)} (no flag sets it); "
                          "leave it out",
                          setting.line)
    return True


def _unflagged_key(key: str, value, line: Optional[int]) -> RecipeError:
    """A top-level key no flag defines (``megatron_lm_flags.UNFLAGGED_KEYS``): its note where
    the value asks for nothing; raises its refusal where it asks for something."""
    from megatron.moe_patches.driver.megatron_lm_flags import UNFLAGGED_KEYS

    accepted, why = UNFLAGGED_KEYS[_dest(key)]
    if value is not None and value != accepted:
        raise RecipeError(f"'{key}' {_spelled(value)}: {why}", line)
    return RecipeError(f"'{key}' {_spelled(value)}: changes nothing here: Megatron-LM 0.16.1 has no such flag "
                       "(its YAML reader keeps the key unread): drop it", line)


def _settings(raw: Dict[str, Any], parser, lines, problems: List[RecipeError],
              notes: List[RecipeError]) -> List[Setting]:
    """Every key of the recipe, sections' keys included, with its dest and transformed value;
    null values and on/off flags set to false are left out (not set). A key that cannot be
    used is left out too, its error added to ``problems``; a key read and ignored, its note
    to ``notes``."""
    from megatron.moe_patches.driver.megatron_lm_flags import UNFLAGGED_KEYS

    items = []
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(RecipeError(f"key {_spelled(key)} is not a flag name", lines.get((None, str(key)))))
        elif key in NESTED_SECTIONS:
            if not isinstance(value, dict):
                problems.append(RecipeError(f"recipe section '{key}' must be a mapping", lines.get((None, key))))
            else:
                items += [(key, name, item) for name, item in value.items()]
        else:
            items.append((None, key, value))
    settings = []
    for section, key, value in items:
        line = lines.get((section, str(key)))
        if not isinstance(key, str):
            problems.append(RecipeError(f"key {_spelled(key)} in section '{section}' is not a flag name", line))
            continue
        try:
            if section is None and _dest(key) in UNFLAGGED_KEYS:
                note = _unflagged_key(key, value, line)
                if value is not None:
                    notes.append(note)
                continue
            dest, transform = _resolve(parser, section, key)
            value = transform(value) if transform and value is not None else value
            setting = Setting(section, key, dest, value, line)
            if value is not None and not _unflagged_field(parser, setting):
                settings.append(setting)
        except RecipeError as err:
            problems.append(type(err)(str(err), err.line or line))
    return settings


def _one_of(first: Setting, second: Setting) -> Setting:
    """The setting that wins where two keys set the same dest (Megatron-LM's rules)."""
    if first.key == second.key:
        raise RecipeError(f"'{second.key}' is set both {first.place()} (line {first.line}) and {second.place()}; "
                          "Megatron-LM's YAML reader refuses that too: keep one", second.line)
    if first.section != second.section and None in (first.section, second.section):
        return first if second.section is None else second  # Megatron-LM's config comes from the sections
    if {first.key, second.key} == {"gated_linear_unit", "activation_func"}:
        return _glu_activation(first, second)
    raise RecipeError(f"recipe sets '{second.dest}' twice (as '{first.key}' and '{second.key}')", second.line)


def _glu_activation(first: Setting, second: Setting) -> Setting:
    """gated_linear_unit with activation_func in one section: Megatron-LM's YAML reader takes
    swiglu as gated whatever gated_linear_unit says; gated gelu is not built here."""
    activation, gated = (first, second) if first.key == "activation_func" else (second, first)
    if gated.value and not activation.value:
        raise RecipeError("'gated_linear_unit: true' with 'activation_func: gelu' is a gated GeLU, which this "
                          "driver does not build: use activation_func swiglu, or gated_linear_unit false", gated.line)
    return activation


def flatten_recipe(raw: Dict[str, Any], parser: argparse.ArgumentParser,
                   lines: Optional[Dict[Tuple[Optional[str], str], int]] = None,
                   problems: Optional[List[RecipeError]] = None) -> Recipe:
    """One flat {dest: value} Recipe from a flat or nested recipe, keys resolved by ``parser``.

    ``lines`` ((section or None, key) -> line) lets errors and the result carry lines. Every
    key is judged: the errors of all bad keys are raised together, or, where ``problems`` is
    given, added to it and the Recipe of the other keys returned.
    """
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe must be a mapping of flag names to values, not {type(raw).__name__}")
    found: List[RecipeError] = []
    notes: List[RecipeError] = []
    chosen: Dict[str, Setting] = {}
    for setting in _settings(raw, parser, lines or {}, found, notes):
        prior = chosen.get(setting.dest)
        try:
            chosen[setting.dest] = setting if prior is None else _one_of(prior, setting)
        except RecipeError as err:
            found.append(err)
    _collect(found, problems)
    flat = Recipe()
    flat.notes = notes
    for dest, setting in chosen.items():
        flat[dest] = setting.value
        flat.written[dest] = setting.key
        if setting.line:
            flat.lines[dest] = setting.line
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


# ``${NAME}`` in a plain scalar: Megatron-LM's YAML reader replaces it by the variable's value.
ENV_REFERENCE = re.compile(r"\$\{([^}]*)\}")


# What a recipe's YAML may hold. Aliases (``*name``) may repeat at most this many values, and
# this many characters of scalar text, beyond those the file writes itself: a few lines of
# aliases referring to aliases can otherwise stand for billions of values, which anything
# that walks or prints the result (a message's repr, a comparison) would never finish.
ALIAS_EXPANSION_VALUES = 10_000
ALIAS_EXPANSION_CHARACTERS = 1_000_000
# Values nested in values (a mapping is one level, a list in it a second), aliases followed:
# PyYAML composes and Python prints nested values recursively, so a deep file would end in
# a RecursionError. Megatron-LM's recipes nest three levels.
NESTING_LIMIT = 64


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus ``${NAME}`` expansion in plain (unquoted) scalars, and the
    limits above: nesting is counted as the file is composed, and the document's values with
    its aliases followed are counted once it is composed, before any Python value is built."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._written_values = 0
        self._written_characters = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)  # a node composed before: counted there
        if self._depth >= NESTING_LIMIT:
            raise RecipeError(_too_deep(), self.peek_event().start_mark.line + 1)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._written_values += 1
        if isinstance(node, yaml.ScalarNode):
            self._written_characters += len(node.value)
        return node

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node, self._written_values + ALIAS_EXPANSION_VALUES,
                         self._written_characters + ALIAS_EXPANSION_CHARACTERS)
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except RecipeError:
            raise
        except ValueError as err:  # a date out of range, an int over Python's 4300 digits, ...
            tag = shown(node.tag.replace("tag:yaml.org,2002:", "!!"))
            what = _spelled(node.value) if isinstance(node, yaml.ScalarNode) else "a value"
            raise RecipeError(f"cannot read {what} as {tag}: {shown(err)}", node.start_mark.line + 1) from None


def _too_deep() -> str:
    return f"values nested more than {NESTING_LIMIT} levels deep (YAML aliases followed); a recipe nests a few levels"


def _check_expansion(root, most_values: int, most_characters: int) -> None:
    """RecipeError where the document under ``root``, its aliases followed, holds more than
    ``most_values`` values or ``most_characters`` characters of scalar text, nests deeper
    than NESTING_LIMIT, or holds itself (an alias inside the value it names).

    Each node is measured once (an alias reuses the measure of the node it names), so this
    takes time in the size of the file, not of the expansion. The walk recurses only into
    nodes not measured yet, which nest as deep as the file is written (NESTING_LIMIT at most).
    """
    measured: Dict[int, Tuple[int, int, int]] = {}  # id(node) -> (values, characters, levels)
    open_nodes = set()

    def measure(node, level: int) -> Tuple[int, int, int]:
        known = measured.get(id(node))
        if known is not None:
            return known
        line = node.start_mark.line + 1
        if id(node) in open_nodes:
            raise RecipeError("a YAML alias refers to a value that holds it: it would expand without end", line)
        if isinstance(node, yaml.ScalarNode):
            measured[id(node)] = (1, len(node.value), 1)
            return measured[id(node)]
        children = node.value if isinstance(node, yaml.SequenceNode) else [part for pair in node.value for part in pair]
        open_nodes.add(id(node))
        values, characters, levels = 1, 0, 1
        for child in children:
            child_values, child_characters, child_levels = measure(child, level + 1)
            values, characters = values + child_values, characters + child_characters
            levels = max(levels, child_levels + 1)
            if values > most_values:
                raise RecipeError(f"YAML aliases expand to more than {ALIAS_EXPANSION_VALUES} values beyond those "
                                  "the file writes (an alias bomb?); write the values out", line)
            if characters > most_characters:
                raise RecipeError(f"YAML aliases expand to more than {ALIAS_EXPANSION_CHARACTERS} characters of text "
                                  "beyond those the file writes (an alias bomb?); write the values out", line)
            if level + levels - 1 > NESTING_LIMIT:
                raise RecipeError(_too_deep(), line)
        open_nodes.discard(id(node))
        measured[id(node)] = (values, characters, levels)
        return measured[id(node)]

    if root is not None:
        measure(root, 1)


def _expand_environment(loader: _RecipeLoader, node: yaml.ScalarNode) -> str:
    text = loader.construct_scalar(node)

    def variable(match):
        value = os.environ.get(match.group(1))
        if value is None:
            raise RecipeError(f"environment variable {shown(repr(match.group(1)))} is not set (the recipe reads "
                              f"{shown(match.group(0))})", node.start_mark.line + 1)
        return value

    return ENV_REFERENCE.sub(variable, text)


_RecipeLoader.add_implicit_resolver("!environment", re.compile(r".*\$\{[^}]*\}"), None)
_RecipeLoader.add_constructor("!environment", _expand_environment)


def _yaml_error(path: str, err: yaml.YAMLError) -> RecipeError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in problem:
        tag = problem.split("'")[1] if problem.count("'") >= 2 else problem
        tag = tag.replace("tag:yaml.org,2002:", "!!")
        return RecipeError(
            f"{where}: unsupported YAML tag {shown(tag)}: a recipe holds plain values (numbers, strings, "
            "true/false, lists); tags that build Python objects are refused"
        )
    column = f" (column {mark.column + 1})" if mark is not None else ""
    said = f"{context}, {problem}" if context else problem  # PyYAML's words may quote the file (an alias's name)
    return RecipeError(f"{where}: invalid YAML: {shown(said)}{column}")


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
                raise RecipeError(f"{path}:{line}: '{shown(key)}' is set twice (also on line {seen[key]}); keep one")
            seen[key] = line
            lines[(section, key)] = line
            if section is None and key in NESTED_SECTIONS and isinstance(value_node, yaml.MappingNode):
                walk(value_node, key)

    if isinstance(node, yaml.MappingNode):
        walk(node, None)
    return lines


def _in_file(path: str, err: RecipeError) -> RecipeError:
    return type(err)(f"{path}:{err.line}: {err}" if err.line else f"{path}: {err}")


def read_recipe(path: str, parser: argparse.ArgumentParser, problems: Optional[List[RecipeError]] = None) -> Recipe:
    """The Recipe in the file ``path``, its keys resolved by ``parser`` (no built-in names
    here: see ``load_recipe``). A file that cannot be read as a recipe is one RecipeError;
    bad keys are raised together, or, where ``problems`` is given, added to it (each naming
    the file and line) and the Recipe of the other keys returned."""
    text = _read_text(path)
    try:
        raw = yaml.load(text, Loader=_RecipeLoader)
        node = yaml.compose(text, Loader=_RecipeLoader)
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    except RecipeError as err:  # an unset environment variable
        raise _in_file(path, err) from None
    if raw is None or raw == {}:
        raise RecipeError(f"{path}: the recipe is empty (it sets no flag); give 'flag: value' lines or drop --yaml-cfg")
    lines = _key_lines(path, node)
    found: List[RecipeError] = []
    try:
        recipe = flatten_recipe(raw, parser, lines, found)
    except RecipeError as err:
        raise _in_file(path, err) from None
    _collect([_in_file(path, err) for err in found], problems)
    if not recipe and not found:
        raise RecipeError(f"{path}: the recipe sets no flag (empty sections, null values or flags set to false); "
                          "give 'flag: value' lines")
    recipe.path = path
    recipe.notes = [str(_in_file(path, note)) for note in recipe.notes]
    return recipe


def load_recipe(path: str, parser: argparse.ArgumentParser, problems: Optional[List[RecipeError]] = None) -> Recipe:
    # --- built-in recipes: a path, or the name of one shipped in the package ("tiny-moe") ---
    from megatron.moe_patches.driver.builtin_recipes import resolve

    path = resolve(path)  # UnknownRecipe (an OSError) names the built-in recipes
    # --- end built-in recipes ---
    return read_recipe(path, parser, problems)


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
                raise fail(f"cannot read {_spelled(value)} as {kind.__name__}") from None
        raise fail(f"needs {'a number' if kind is float else 'an integer'}, not {_spelled(value)}")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)
        raise fail(f"needs a string, not {_spelled(value)} (quote it)")
    try:
        return kind(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise fail(f"cannot read {_spelled(value)} as {getattr(kind, '__name__', 'its type')}") from None


# List flags whose empty list in a recipe means what no value on the command line means (the
# flag's default): no graph scope is each transformer layer whole, as megatron-core reads [].
EMPTY_LIST_MEANS = frozenset({"cuda_graph_scope"})


def convert_value(action: argparse.Action, value, fail):
    """A recipe value for ``action``'s flag, checked as strictly as the command line."""
    if action.nargs == 0:  # on/off flags
        if not isinstance(value, bool):
            raise fail(f"is an on/off flag; give true or false, not {_spelled(value)}")
        return value
    kind = action.type or str
    if action.nargs in ("*", "+") or isinstance(action.nargs, int) and action.nargs > 1:
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items and action.dest not in EMPTY_LIST_MEANS:
            raise fail("needs at least one value")
        if isinstance(action.nargs, int) and len(items) != action.nargs:  # as argparse counts them
            names = " ".join(action.metavar) if isinstance(action.metavar, tuple) else f"{action.nargs} values"
            raise fail(f"takes {action.nargs} values ({names}), not {len(items)}: {_spelled(value)}")
        converted = [_scalar(kind, item, fail) for item in items]
    elif isinstance(value, (list, dict)):
        raise fail(f"takes one value, not {'a list' if isinstance(value, list) else 'a mapping'} ({_spelled(value)})")
    else:
        converted = _scalar(kind, value, fail)
    choices = action.choices
    if choices is not None:
        for item in converted if isinstance(converted, list) else [converted]:
            if item not in choices:
                raise fail(f"must be one of {list(choices)}, not {_spelled(value)}")
    return converted


def apply_recipe(parser: argparse.ArgumentParser, recipe: Dict[str, Any], source: str,
                 problems: Optional[List[RecipeError]] = None) -> None:
    """Make the recipe's values the parser's defaults, after checking every key and type.

    The errors of all bad keys are raised together (and nothing is applied), or, where
    ``problems`` is given, added to it, the bad keys taken out of ``recipe`` and the others
    applied."""
    actions = {action.dest: action for action in parser._actions}  # argparse has no public map
    if not isinstance(recipe, Recipe):
        recipe = Recipe(recipe)
    values, found, bad = {}, [], []
    for dest, value in recipe.items():
        where, key = recipe.where(dest, source), recipe.key(dest)
        action = actions.get(dest)
        if action is None or dest in ("help", "yaml_cfg"):
            found.append(UnknownKey(f"{where}: unknown key '{shown(dest)}' (no flag --{shown(dest.replace('_', '-'))})"))
            bad.append(dest)
            continue
        flag = action.option_strings[0] if action.option_strings else dest

        def fail(message, where=where, key=key, flag=flag):
            return RecipeError(f"{where}: '{key}' ({flag}) {message}")

        try:
            values[dest] = convert_value(action, value, fail)
        except RecipeError as err:
            found.append(err)
            bad.append(dest)
    _collect(found, problems)
    for dest in bad:
        del recipe[dest]
    recipe.update(values)
    parser.set_defaults(**values)
