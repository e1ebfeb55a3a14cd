"""The driver's usage, error, warning and GPU-check lines name the command the user ran:
``megatron-moe-pretrain`` (the console script), ``pretrain_gpt.py`` (the script in a clone)
or ``python -m megatron.moe_patches.driver.training``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver import training
from megatron.moe_patches.driver.cli import pretrain_main

ROOT = Path(__file__).resolve().parents[2]
BAD = ["--no-such-flag"]
REFUSAL = "unrecognized arguments: --no-such-flag"

pytestmark = pytest.mark.usefixtures("one_rank")


def run(command):
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_console_script_function_names_megatron_moe_pretrain(capsys):
    with pytest.raises(SystemExit) as refused:
        pretrain_main(BAD)
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"megatron-moe-pretrain: error: {REFUSAL}"
    with pytest.raises(SystemExit) as helped:
        pretrain_main(["--help"])
    assert helped.value.code == 0 and capsys.readouterr().out.startswith("usage: megatron-moe-pretrain ")


def test_warnings_and_the_gpu_check_name_it_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        pretrain_main(["--yaml-cfg", "tiny-moe-stock", "--load", str(tmp_path / "missing")])
    assert stopped.value.code == training.no_gpu_message("megatron-moe-pretrain")
    assert "passed its checks" in stopped.value.code and "--print-plan" in stopped.value.code
    assert capsys.readouterr().err.startswith(f"megatron-moe-pretrain: warning: --load {tmp_path / 'missing'}: ")


@pytest.mark.parametrize("command, prog", [
    ([sys.executable, "pretrain_gpt.py"], "pretrain_gpt.py"),
    ([sys.executable, "-m", "megatron.moe_patches.driver.training"], "python -m megatron.moe_patches.driver.training"),
])
def test_the_scripts_name_themselves(command, prog):
    out = run(command + BAD)
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == f"{prog}: error: {REFUSAL}", out.stderr[-2000:]


def test_the_installed_console_script_names_itself():
    script = shutil.which("megatron-moe-pretrain")
    if script is None:
        pytest.skip("megatron-moe-pretrain is not on PATH (the package is not installed with its scripts)")
    out = run([script, *BAD])
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == f"megatron-moe-pretrain: error: {REFUSAL}", (
        out.stderr[-2000:])


@pytest.mark.parametrize("argv", [["--version"], ["--yaml-cfg", "tiny-moe-stock", "--version"]])
def test_version(argv, capsys):
    from megatron.moe_patches.version import __version__

    with pytest.raises(SystemExit) as stopped:
        pretrain_main(argv)
    assert stopped.value.code == 0 and capsys.readouterr().out == f"megatron-moe-pretrain {__version__}\n"
