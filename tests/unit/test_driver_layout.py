"""The driver subpackage's import direction: training -> arguments, never back; patch
modules import neither the driver nor the test helpers."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron" / "moe_patches"


def imported_modules(path: Path):
    """Every module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_megatron_init():
    assert not (ROOT / "megatron" / "__init__.py").exists()  # megatron is a namespace shared with megatron-core


@pytest.mark.parametrize("name", ["arguments", "parser", "given_values", "launcher_env", "load_check", "data_files",
                                  "output_dirs", "config_refusals", "patch_args", "recipes", "checkpointing",
                                  "functional", "compat"])
def test_driver_modules_never_import_training(name):
    assert "megatron.moe_patches.driver.training" not in imported_modules(PACKAGE / "driver" / f"{name}.py")


PATCH_MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("driver", "testing"))


@pytest.mark.parametrize("path", PATCH_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_patch_modules_import_neither_driver_nor_testing(path):
    bad = [m for m in imported_modules(path) if m.startswith(("megatron.moe_patches.driver", "megatron.moe_patches.testing"))]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_training_module_runs_as_main():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron.moe_patches.driver.training", "--help"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--moe-device-tokens-per-expert" in out.stdout
