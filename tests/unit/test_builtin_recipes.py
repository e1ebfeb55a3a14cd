"""--yaml-cfg takes a built-in recipe's name or a path; anything else names the built-ins."""

from pathlib import Path

import pytest
import yaml

from megatron.moe_patches.driver.arguments import parse_args
from megatron.moe_patches.driver.builtin_recipes import UnknownRecipe, builtin_recipes, recipe_path, resolve

from driver_model import REQUIRED

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "megatron" / "moe_patches" / "recipes"
NAMES = ["deepseek-v2-lite-proxy", "mixtral-proxy", "qwen3-30b-a3b-proxy", "tiny-moe", "tiny-moe-nested",
         "tiny-moe-stock"]


def test_builtin_recipes_are_listed_by_name():
    recipes = builtin_recipes()
    assert list(recipes) == NAMES
    assert all(Path(path).is_file() for path in recipes.values())


def test_name_finds_the_builtin_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the name alone must find it
    by_name = parse_args(["--yaml-cfg", "tiny-moe"])
    by_path = parse_args(["--yaml-cfg", str(RECIPES / "tiny-moe.yaml")])
    assert vars(by_name) | {"yaml_cfg": None} == vars(by_path) | {"yaml_cfg": None}
    assert (by_name.num_experts, by_name.hidden_size, by_name.moe_router_topk) == (8, 256, 2)
    assert parse_args(["--yaml-cfg", "tiny-moe-nested.yaml"]).num_experts == 8
    assert Path(recipe_path("mixtral-proxy")) == RECIPES / "mixtral-proxy.yaml"


def test_a_path_still_works_and_wins_over_a_name(tmp_path, monkeypatch):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(yaml.safe_dump({"num-experts": 4, "hidden-size": 64, "num-attention-heads": 4}))
    assert parse_args([*REQUIRED, "--yaml-cfg", str(recipe)]).num_experts == 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-moe").write_text(yaml.safe_dump({"num-experts": 2}))
    assert resolve("tiny-moe") == "tiny-moe"  # an existing file is that file
    assert parse_args([*REQUIRED, "--yaml-cfg", "tiny-moe"]).num_experts == 2


@pytest.mark.parametrize("value", ["tiny", "no/such/dir/tiny-moe.yaml", "examples/recipes/tiny-moe.yaml"])
def test_unknown_recipe_is_an_error_naming_the_builtins(value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownRecipe):
        resolve(value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--yaml-cfg", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--yaml-cfg {value}" in err and "the built-in recipes are " + ", ".join(NAMES) in err
    assert "Traceback" not in err


def test_old_examples_path_points_at_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownRecipe, match="--yaml-cfg tiny-moe\\)"):
        resolve("examples/recipes/tiny-moe.yaml")
    with pytest.raises(UnknownRecipe, match="no built-in recipe 'tiny'"):
        recipe_path("tiny")
