"""The console scripts setup.py declares resolve to callables, pretrain_gpt.py is the same
program as megatron-moe-pretrain, and the recipes ship as package data."""

import ast
import fnmatch
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_keywords() -> dict:
    """The literal keyword arguments of the setup() call in setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )
    found = {}
    for keyword in call.keywords:
        try:
            found[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:  # computed values (packages=find_namespace_packages(...))
            pass
    return found


def console_scripts() -> dict:
    scripts = {}
    for line in setup_keywords()["entry_points"]["console_scripts"]:
        name, _, target = (part.strip() for part in line.partition("="))
        scripts[name] = target
    return scripts


def resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_console_scripts_are_declared_and_callable():
    scripts = console_scripts()
    assert {"megatron-moe-patches", "megatron-moe-pretrain"} <= set(scripts)
    for name, target in scripts.items():
        assert callable(resolve(target)), name


def test_pretrain_command_is_pretrain_gpt():
    from megatron.moe_patches.driver.cli import pretrain_main

    assert resolve(console_scripts()["megatron-moe-pretrain"]) is pretrain_main
    spec = importlib.util.spec_from_file_location("pretrain_gpt_script", ROOT / "pretrain_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # the __main__ guard keeps it from training
    assert script.pretrain_main is pretrain_main


def test_pretrain_command_help_runs_without_a_gpu():
    code = "import sys; from megatron.moe_patches.driver.cli import pretrain_main; sys.exit(pretrain_main(['--help']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--yaml-cfg" in out.stdout and "--moe-device-tokens-per-expert" in out.stdout


def test_recipes_are_package_data():
    from megatron.moe_patches.driver.builtin_recipes import builtin_recipes

    patterns = setup_keywords()["package_data"]["megatron.moe_patches.recipes"]
    folder = ROOT / "megatron" / "moe_patches" / "recipes"
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert files and all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files)
    assert sorted(Path(path).name for path in builtin_recipes().values()) == files
    assert not (ROOT / "examples" / "recipes").exists()  # one copy of each recipe
