"""Hostile or broken --yaml-cfg recipes are one-line refusals, never a hang or a traceback:
YAML aliases that expand past ``ALIAS_EXPANSION_VALUES`` values or ``ALIAS_EXPANSION_CHARACTERS``
characters beyond what the file writes (an alias bomb), an alias inside the value it names,
values nested past ``NESTING_LIMIT`` levels, scalars PyYAML cannot build; and no message
prints a large value whole. Recipes with a few anchors and aliases still load."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.moe_patches.driver.arguments import build_parser
from megatron.moe_patches.driver.recipes import (
    ALIAS_EXPANSION_CHARACTERS, ALIAS_EXPANSION_VALUES, NESTING_LIMIT, RecipeError, apply_recipe, read_recipe,
)
from megatron.moe_patches.fields import SHOWN_LIMIT

pytestmark = pytest.mark.usefixtures("one_rank")

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "megatron" / "moe_patches" / "recipes").glob("*.yaml"))

TOO_MANY_VALUES = (f"YAML aliases expand to more than {ALIAS_EXPANSION_VALUES} values beyond those the file "
                   "writes (an alias bomb?); write the values out")
TOO_MUCH_TEXT = (f"YAML aliases expand to more than {ALIAS_EXPANSION_CHARACTERS} characters of text beyond those "
                 "the file writes (an alias bomb?); write the values out")
TOO_DEEP = f"values nested more than {NESTING_LIMIT} levels deep (YAML aliases followed); a recipe nests a few levels"


def recipe(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def laughs(levels=9, width=9):
    """The "billion laughs" lists: the first holds ``width`` strings, each next one ``width``
    aliases of the one before (width ** levels strings in the last)."""
    names = [chr(ord("a") + level) for level in range(levels)]
    rows = [f"&{names[0]} [" + ", ".join(["lol"] * width) + "]"]
    rows += [f"&{name} [" + ", ".join([f"*{before}"] * width) + "]" for before, name in zip(names, names[1:])]
    return rows


def test_an_alias_bomb_in_a_flag_stops_pretrain_gpt_with_one_line(tmp_path):
    """The issue's case: under a flag the driver echoed the expanded value, and never finished
    building its repr. The subprocess's timeout is the guard against a hang."""
    path = recipe(tmp_path, "num-layers:\n" + "".join(f"  - {row}\n" for row in laughs()))
    assert Path(path).stat().st_size < 1500
    run = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), "--yaml-cfg", path],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    # a, b, c, d hold 10, 91, 820 and 7381 values; e, on line 6, is the first past the limit
    assert run.stderr.splitlines() == [f"pretrain_gpt.py: error: {path}:6: {TOO_MANY_VALUES}"]


def test_an_alias_bomb_at_the_top_level_is_refused_before_its_keys_are_read(tmp_path):
    text = "".join(f"{chr(ord('a') + level)}: {row}\n" for level, row in enumerate(laughs()))
    with pytest.raises(RecipeError) as err:
        read_recipe(recipe(tmp_path, text), build_parser())
    assert str(err.value) == f"{tmp_path / 'recipe.yaml'}:5: {TOO_MANY_VALUES}"


def test_aliases_repeating_a_long_string_are_refused(tmp_path):
    repeats = ALIAS_EXPANSION_CHARACTERS // 100_000 + 2  # 100,000 beyond the limit
    text = f"save: &long {'x' * 100_000}\ndata-path: [{', '.join(['*long'] * repeats)}]\n"
    with pytest.raises(RecipeError) as err:
        read_recipe(recipe(tmp_path, text), build_parser())
    assert str(err.value) == f"{tmp_path / 'recipe.yaml'}:2: {TOO_MUCH_TEXT}"


def test_an_alias_inside_the_value_it_names_is_refused(tmp_path, refused):
    path = recipe(tmp_path, "seed: 1\nnum-layers: &loop [1, *loop]\n")
    assert refused(["--yaml-cfg", path]) == (f"{path}:2: a YAML alias refers to a value that holds it: it would "
                                             "expand without end")


def test_deep_nesting_is_refused_without_a_traceback(tmp_path, refused):
    path = recipe(tmp_path, "seed: 1\nnum-layers: " + "[" * 1000 + "]" * 1000 + "\n")
    assert refused(["--yaml-cfg", path]) == f"{path}:2: {TOO_DEEP}"


def test_deep_nesting_through_aliases_is_refused(tmp_path, refused):
    """Each anchor nests 40 levels around the one before: 30 of them nest 1200 deep."""
    rows = [f"- &level{index} " + "[" * 40 + (f"*level{index - 1}" if index else "1") + "]" * 40
            for index in range(30)]
    path = recipe(tmp_path, "num-layers:\n" + "".join(f"  {row}\n" for row in rows))
    assert refused(["--yaml-cfg", path]) == f"{path}:3: {TOO_DEEP}"


@pytest.mark.parametrize("levels", [NESTING_LIMIT, NESTING_LIMIT + 1])
def test_the_nesting_limit_counts_every_level(tmp_path, refused, levels):
    """The recipe's mapping is one level and the string a last one: lists make up the rest."""
    lists = levels - 2
    path = recipe(tmp_path, "num-layers: " + "[" * lists + "x" + "]" * lists + "\n")
    message = refused(["--yaml-cfg", path])
    if levels > NESTING_LIMIT:
        assert message == f"{path}:1: {TOO_DEEP}"
    else:
        assert message.startswith(f"{path}:1: 'num-layers' (--num-layers) takes one value, not a list ([[[[")


def refusal(path):
    """The recipe's own message (pretrain_gpt.py's error line also shortens long words)."""
    parser = build_parser()
    with pytest.raises(RecipeError) as err:
        apply_recipe(parser, read_recipe(path, parser), path)
    return str(err.value)


def test_a_huge_scalar_is_shortened_in_the_message(tmp_path):
    path = recipe(tmp_path, "seed: 1\nnum-layers: " + "9x" * 50_000 + "\n")
    assert refusal(path) == (f"{path}:2: 'num-layers' (--num-layers) cannot read '{'9x' * 30}... "
                             "(100000 characters)' as int")


def test_a_list_repeating_a_long_string_is_shortened_without_printing_it(tmp_path):
    """A few aliases of one long string: the message shows the list's start, not its repr."""
    path = recipe(tmp_path, f"save: &long {'x' * 50_000}\nnum-layers: [*long, *long, *long]\n")
    assert refusal(path) == (f"{path}:2: 'num-layers' (--num-layers) takes one value, not a list "
                             f"(['{'x' * 58}... (over {SHOWN_LIMIT} characters))")


@pytest.mark.parametrize("value, message", [
    ("1" * 5000, f"cannot read '{'1' * 60}... (5000 characters)' as !!int: Exceeds the limit (4300 digits)"),
    ("2024-13-45", "cannot read '2024-13-45' as !!timestamp: month must be in 1..12"),
], ids=["int-over-4300-digits", "no-such-date"])
def test_a_scalar_yaml_cannot_build_is_one_line(tmp_path, refused, value, message):
    path = recipe(tmp_path, f"seed: 1\nsave: {value}\n")
    assert refused(["--yaml-cfg", path]).startswith(f"{path}:2: {message}")


def test_a_recipe_with_a_few_anchors_and_aliases_loads(tmp_path):
    text = ("save: &runs /scratch/runs\n"
            "load: *runs\n"
            "data-path: &blend [0.3, /data/a, 0.7, /data/b]\n"
            "train-data-path: *blend\n"
            "language_model:\n"
            "  hidden_size: &width 256\n"
            "  moe_ffn_hidden_size: *width\n")
    assert dict(read_recipe(recipe(tmp_path, text), build_parser())) == {
        "save": "/scratch/runs", "load": "/scratch/runs", "data_path": [0.3, "/data/a", 0.7, "/data/b"],
        "train_data_path": [0.3, "/data/a", 0.7, "/data/b"], "hidden_size": 256, "moe_ffn_hidden_size": 256}


@pytest.mark.parametrize("path", RECIPES, ids=[path.name for path in RECIPES])
def test_the_shipped_recipes_still_load(path):
    assert read_recipe(str(path), build_parser())
