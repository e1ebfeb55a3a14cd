"""pretrain_gpt.py answers ``--help`` and the errors of its command line and recipe without
importing megatron-core or Transformer Engine (seconds of imports for a one-line answer).

Each command runs in a fresh interpreter, as a user runs it; the wrapper then reports which
of the two were imported by the time the driver exited. The --attention-backend names that
stand in for megatron-core's AttnBackend until the checks that need it are compared with the
enum here, and the parser ``parse_args`` reads the command line with is compared with
``build_parser``'s.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron.moe_patches.driver import megatron_lm_flags
from megatron.moe_patches.driver.arguments import PROG, build_parser
from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings

from driver_model import REQUIRED

ROOT = Path(__file__).resolve().parents[2]

# Runs pretrain_gpt.py as ``python pretrain_gpt.py ARGS`` does, catches its exit and prints,
# as the last line of stdout, its exit code and whether megatron-core and TE were imported.
WRAPPER = """
import json, runpy, sys
sys.argv = ["pretrain_gpt.py", *json.loads(sys.argv[1])]
code = None
try:
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
except SystemExit as stop:
    code = stop.code
sys.stdout.flush()
print("\\n" + json.dumps({"code": code, "megatron.core": "megatron.core" in sys.modules,
                          "transformer_engine": "transformer_engine" in sys.modules}))
"""


def run_driver(argv):
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(argv)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report, out


def _recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


CASES = {
    "help": (lambda tmp: ["--help"], 0, None),
    "unknown flag": (lambda tmp: ["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    "bad int": (lambda tmp: ["--num-layers", "two"], 2, "argument --num-layers: invalid int value: 'two'"),
    "bad attention backend": (lambda tmp: ["--attention-backend", "fastest"], 2,
                              "argument --attention-backend: invalid choice: 'fastest' (choose from flash, fused, "
                              "unfused, local, auto)"),
    "backend given, unknown flag": (lambda tmp: ["--attention-backend", "flash", "--no-such-flag"], 2,
                                    "unrecognized arguments: --no-such-flag"),
    "missing recipe": (lambda tmp: ["--yaml-cfg", str(tmp / "absent.yaml")], 2, "no such file"),
    "recipe not YAML": (lambda tmp: ["--yaml-cfg", _recipe(tmp, "num-layers: [1\n")], 2, "invalid YAML"),
    "recipe's bad key and value": (lambda tmp: ["--yaml-cfg", _recipe(tmp, "attention_backend: flash\n"
                                                                         "num-layers: 2.5\nbogus: 1\n")], 2,
                                   "unknown key 'bogus'"),
    "required flags missing": (lambda tmp: [], 2, "required (Megatron-LM has no default for them)"),
}


@pytest.mark.parametrize("case", CASES)
def test_help_and_argument_errors_import_no_megatron_core(case, tmp_path):
    make_argv, code, message = CASES[case]
    report, out = run_driver(make_argv(tmp_path))
    assert report["code"] == code, out.stderr[-3000:]
    if message is None:
        assert out.stdout.startswith(f"usage: {PROG} ")
    else:
        assert f"{PROG}: error: " in out.stderr and message in out.stderr, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not report["megatron.core"], f"{case}: megatron-core was imported"
    assert not report["transformer_engine"], f"{case}: Transformer Engine was imported"


def test_attention_backend_names_are_megatron_cores():
    with warnings.catch_warnings():
        quiet_megatron_core_import_warnings()
        from megatron.core.transformer.enums import AttnBackend

    assert megatron_lm_flags.ATTENTION_BACKENDS == tuple(member.name for member in AttnBackend)
    for name in megatron_lm_flags.ATTENTION_BACKENDS:
        assert megatron_lm_flags.attention_backend(name) is AttnBackend[name]
        assert megatron_lm_flags.AttnBackendName(name).value() is AttnBackend[name]
        assert str(megatron_lm_flags.AttnBackendName(name)) == str(AttnBackend[name])
    assert megatron_lm_flags.BY_NAME["--attention-backend"].megatron_lm_default is AttnBackend.auto


def test_parse_args_parser_is_build_parsers():
    """The same flags, defaults (as printed), help and errors; only --attention-backend's values
    wait as names."""
    full, named = build_parser(), build_parser(PROG, names=True)
    assert full.format_help() == named.format_help()
    assert [action.option_strings for action in full._actions] == [action.option_strings for action in named._actions]
    for mine, theirs in zip(full._actions, named._actions):
        assert (mine.dest, mine.nargs, mine.choices, mine.help, str(mine.default)) == (
            theirs.dest, theirs.nargs, theirs.choices, theirs.help, str(theirs.default)), mine.dest
        if mine.dest != "attention_backend":
            assert (mine.type, mine.default) == (theirs.type, theirs.default), mine.dest
    assert named.get_default("attention_backend") == megatron_lm_flags.AttnBackendName("auto")
    assert named.parse_args(["--attention-backend", "local"]).attention_backend == (
        megatron_lm_flags.AttnBackendName("local"))


@pytest.mark.usefixtures("one_rank")
def test_parse_args_gives_megatron_cores_members(parsed, tmp_path):
    from megatron.core.transformer.enums import AttnBackend

    assert parsed(list(REQUIRED)).attention_backend is AttnBackend.auto
    assert parsed([*REQUIRED, "--attention-backend", "unfused"]).attention_backend is AttnBackend.unfused
    recipe = _recipe(tmp_path, "attention_backend: fused\n")
    assert parsed([*REQUIRED, "--yaml-cfg", recipe]).attention_backend is AttnBackend.fused
    assert parsed([*REQUIRED, "--yaml-cfg", recipe, "--attention-backend", "flash"]).attention_backend is (
        AttnBackend.flash)


def test_a_recipes_bad_attention_backend_reads_as_before(refused, tmp_path):
    recipe = _recipe(tmp_path, "attention_backend: fastest\n")
    assert refused([*REQUIRED, "--yaml-cfg", recipe]) == (
        f"{recipe}:1: 'attention_backend' (--attention-backend) cannot read 'fastest' as attention_backend")
