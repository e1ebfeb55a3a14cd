"""pretrain_gpt.py refuses before start-up what would otherwise fail or be ignored later:
integer flags outside their real ranges, a --seq-length that sequence parallelism cannot
split, output directories that cannot be written, --data-path prefixes with no dataset,
environment variables outside their accepted values, a directory as --yaml-cfg; and every
message shortens a long value it echoes. Each refusal: exit status 2, one
``pretrain_gpt.py: error: ...`` line naming the flag or variable (the ``refused`` fixture)."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.driver import arguments, data_files, megatron_lm_flags, output_dirs
from megatron.moe_patches.driver.arguments import sequence_multiple
from megatron.moe_patches.driver.data_files import data_blend
from megatron.moe_patches.driver.given_values import INT_RANGES
from megatron.moe_patches.fields import DEVICE_SPLITS_ENV_ALIAS, env_switch, shown

from driver_model import REQUIRED, indexed_dataset

pytestmark = pytest.mark.usefixtures("one_rank")

ROOT = Path(__file__).resolve().parents[2]
ENV_READ = ("LOCAL_RANK", "MASTER_PORT", DEVICE_SPLITS_ENV_ALIAS, "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
            "CUBLAS_WORKSPACE_CONFIG")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The variables the driver judges, unset unless a test sets them."""
    for name in ENV_READ:
        monkeypatch.delenv(name, raising=False)


# --- integer flags: every one has a range ------------------------------------------------

def test_every_int_flag_of_the_driver_has_a_range():
    refused = {row.dest for row in megatron_lm_flags.FLAGS if row.refused or row.no_effect}  # never read
    int_flags = {action.dest for action in arguments.build_parser()._actions
                 if action.type is int and action.dest not in refused}
    assert int_flags and int_flags <= set(INT_RANGES), sorted(int_flags - set(INT_RANGES))


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed -1: must be at least 0"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: must be at most 4294967295 "
     "(2**32 - 1, the largest seed the data shuffle takes)"),
    (["--seed", str(2**32)], "--seed 4294967296: must be at most 4294967295 "
     "(2**32 - 1, the largest seed the data shuffle takes)"),
    (["--seq-length", "99999999999999999999999"], "--seq-length 99999999999999999999999: must be at most "
     "2147483647 (2**31 - 1, the largest size the kernels take)"),
    (["--micro-batch-size", str(2**31)], "--micro-batch-size 2147483648: must be at most 2147483647 "
     "(2**31 - 1, the largest size the kernels take)"),
    (["--cuda-graph-warmup-steps", "-5"], "--cuda-graph-warmup-steps -5: must be at least 0"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters -1: must be at least 0"),
    (["--fp8-margin", "128"], "--fp8-margin 128: must be at most 127 (the scaling factor is divided by "
     "2**margin in fp32, which ends at 2**127)"),
    (["--recompute-num-layers", "0"], "--recompute-num-layers 0: must be at least 1"),
    (["--moe-hybridep-num-blocks-permute", str(2**31)], "--moe-hybridep-num-blocks-permute 2147483648: must be "
     "at most 2147483647 (2**31 - 1, the largest size the kernels take)"),
])
def test_int_flags_outside_their_range_are_refused(argv, message, refused):
    assert refused([*REQUIRED, *argv]) == message


def test_int_flags_at_the_ends_of_their_range_pass(parsed):
    assert parsed([*REQUIRED, "--seed", "0"]).seed == 0
    assert parsed([*REQUIRED, "--seed", str(2**32 - 1)]).seed == 2**32 - 1
    assert parsed([*REQUIRED, "--cuda-graph-warmup-steps", "0"]).cuda_graph_warmup_steps == 0


def test_recipe_values_are_range_checked_too(tmp_path, refused):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seed: -3\n")
    assert refused([*REQUIRED, "--yaml-cfg", str(recipe)]) == "--seed -3: must be at least 0"


# --- sequence parallelism splits the sequence -------------------------------------------

@pytest.mark.parametrize("tp, cp, sp, multiple", [
    (2, 1, True, 2), (8, 1, True, 8), (2, 1, False, 1), (1, 2, False, 4), (2, 2, True, 4), (4, 2, True, 8),
    (3, 2, True, 12),
])
def test_sequence_multiple_is_megatron_cores_split(tp, cp, sp, multiple):
    assert sequence_multiple(tp, cp, sp) == multiple


def test_seq_length_that_sequence_parallelism_cannot_split_is_refused(monkeypatch, refused, parsed):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # as torchrun sets it
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert refused([*REQUIRED, "--seq-length", "255", *tp_sp]) == (
        "--seq-length 255 must be a multiple of 2 with --sequence-parallel and --tensor-model-parallel-size 2 "
        "(each tensor-parallel rank takes an equal share of the sequence): use e.g. --seq-length 256")
    assert parsed([*REQUIRED, "--seq-length", "256", *tp_sp]).seq_length == 256
    assert parsed([*REQUIRED, "--seq-length", "255", "--tensor-model-parallel-size", "2"]).seq_length == 255


# --- output directories -------------------------------------------------------------------

@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path"])
def test_output_dir_that_is_a_file_is_refused(flag, a_file, monkeypatch, refused):
    monkeypatch.setattr(arguments, "_tensorboard_installed", lambda: True)
    assert refused([*REQUIRED, flag, str(a_file)]) == (
        f"{flag} {a_file}: a file, not a directory: give a directory, or a path where one can be made")
    assert refused([*REQUIRED, flag, str(a_file / "run")]) == (
        f"{flag} {a_file / 'run'}: inside {a_file}, a file, not a directory: give a directory, or a path "
        "where one can be made")


def test_output_dir_under_an_unwritable_directory_is_refused(tmp_path, monkeypatch, refused):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = output_dirs.os.access
    # this user may be root, whom a file mode does not stop: ask the check's own question
    monkeypatch.setattr(output_dirs.os, "access", lambda path, mode: path != str(locked) and real_access(path, mode))
    assert refused([*REQUIRED, "--save", str(locked / "a" / "b")]) == (
        f"--save {locked / 'a' / 'b'}: {locked} is not writable: give a directory this user can write to")


def test_output_dir_that_can_be_made_passes_and_is_not_made_yet(tmp_path, parsed):
    save = tmp_path / "runs" / "one"
    assert parsed([*REQUIRED, "--save", str(save), "--data-cache-path", str(tmp_path)]).save == str(save)
    assert not (tmp_path / "runs").exists()


def test_save_that_is_a_file_stops_pretrain_gpt_before_start_up(a_file):
    run = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), *REQUIRED,
                          "--save", str(a_file)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [f"pretrain_gpt.py: error: --save {a_file}: a file, not a directory: give a "
                                       "directory, or a path where one can be made"]


# --- --data-path ----------------------------------------------------------------------------

@pytest.mark.parametrize("data_path, blend", [
    (["a"], (["a"], None)),
    (["a", "b"], (["a", "b"], None)),
    (["0.3", "a", "0.7", "b"], (["a", "b"], [0.3, 0.7])),
    (["0.5", "a", "0.5"], (["0.5", "a", "0.5"], None)),  # odd length: prefixes only, as Megatron-LM reads it
    (["1", "a", "b", "c"], (["1", "a", "b", "c"], None)),  # a prefix in a weight's place: prefixes only
])
def test_data_blend_reads_data_path_as_megatron_lm(data_path, blend):
    assert data_blend(data_path) == blend


SPLIT = ["--split", "98,2,0"]  # without it a warning comes first


def test_data_path_without_a_dataset_is_refused(tmp_path, refused):
    missing = tmp_path / "nosuch"
    assert refused([*REQUIRED, *SPLIT, "--data-path", str(missing)]) == (
        f"--data-path {missing}: no indexed dataset there ({missing}.bin, {missing}.idx not found); give each "
        "dataset's path without .bin/.idx, or leave --data-path out for mock data")
    half = tmp_path / "half"
    Path(f"{half}.bin").touch()
    assert refused([*REQUIRED, *SPLIT, "--data-path", str(half)]).startswith(
        f"--data-path {half}: no indexed dataset there ({half}.idx not found)")


def test_weighted_data_path_checks_every_prefix_and_weight(tmp_path, refused, parsed):
    first, missing = indexed_dataset(tmp_path, "first"), str(tmp_path / "second")
    assert refused([*REQUIRED, *SPLIT, "--data-path", "0.5", first, "0.5", missing]).startswith(
        f"--data-path {missing}: no indexed dataset there")
    second = indexed_dataset(tmp_path, "second")
    blend = ["0.5", first, "0.5", second]
    assert parsed([*REQUIRED, *SPLIT, "--data-path", *blend]).data_path == blend
    assert refused([*REQUIRED, *SPLIT, "--data-path", "-1", first, "2", second]) == (
        "--data-path weight -1.0: must be a finite number, at least 0")
    assert refused([*REQUIRED, *SPLIT, "--data-path", "nan", first, "1", second]) == (
        "--data-path weight nan: must be a finite number, at least 0")
    assert refused([*REQUIRED, *SPLIT, "--data-path", "0", first, "0", second]) == (
        "--data-path: every weight is 0; give at least one dataset a positive weight")


def test_mock_data_needs_no_files(parsed):
    assert parsed([*REQUIRED, "--mock-data"]).data_path is None


# --- environment variables ----------------------------------------------------------------

def test_switch_variable_outside_its_values_is_refused_by_the_driver(monkeypatch, refused):
    monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, "garbage")
    assert refused(REQUIRED) == (
        f"{DEVICE_SPLITS_ENV_ALIAS}='garbage': accepted values are 0 and 1 (unset: 0); set one or unset the variable")


def test_switch_variable_is_refused_where_the_package_reads_it(monkeypatch):
    monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, "yes")
    with pytest.raises(ValueError, match=f"{DEVICE_SPLITS_ENV_ALIAS}='yes': accepted values are 0 and 1"):
        PatchedTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("1", True)])
def test_switch_variable_accepted_values(value, on, monkeypatch):
    if value is not None:
        monkeypatch.setenv(DEVICE_SPLITS_ENV_ALIAS, value)
    assert env_switch(DEVICE_SPLITS_ENV_ALIAS) is on


@pytest.mark.parametrize("env, message", [
    ({"RANK": "1"}, "RANK='1' (set by the launcher) is not a rank from 0 to 0 (WORLD_SIZE 1)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' (set by the launcher) is not a rank from 0 to 1 (WORLD_SIZE 2)"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' (set by the launcher) is not a rank from 0 to 0 (WORLD_SIZE 1)"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' (set by the launcher) is not a TCP port (1 to 65535)"),
])
def test_launcher_variables_out_of_range_are_refused(env, message, monkeypatch, refused):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert refused(REQUIRED) == message


def test_launcher_variables_in_range_pass(monkeypatch, parsed):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert parsed(REQUIRED).data_parallel_size == 2


@pytest.mark.parametrize("name, value", [("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
                                         ("CUBLAS_WORKSPACE_CONFIG", ":0:0")])
def test_deterministic_mode_refuses_variables_that_undo_it(name, value, monkeypatch, refused, parsed):
    monkeypatch.setenv(name, value)
    assert refused([*REQUIRED, "--deterministic-mode"]).startswith(
        f"{name}={value!r} with --deterministic-mode: the run would not be deterministic; set ")
    assert parsed(REQUIRED).deterministic_mode is False  # without it the driver does not read them


# --- --yaml-cfg and long values -----------------------------------------------------------

def test_directory_as_yaml_cfg_is_reported_as_a_directory(tmp_path, refused):
    assert refused(["--yaml-cfg", str(tmp_path)]).startswith(
        f"--yaml-cfg {tmp_path}: a directory, not a recipe file; give the path of a recipe file or a built-in "
        "recipe's name (")


def test_shown_shortens_long_values_only():
    assert shown("x" * 200) == "x" * 200
    assert shown("y" * 5000) == "y" * 60 + "... (5000 characters)"


LONG = "z" * 5000
SHORTENED = "z" * 60 + "... (5000 characters)"


@pytest.mark.parametrize("argv", [
    ["--yaml-cfg", LONG],  # the driver's own message
    ["--seq-length", "9" * 5000],  # argparse's (invalid int value)
    ["--moe-token-dispatcher-type", LONG],  # argparse's (invalid choice)
])
def test_long_values_are_echoed_shortened(argv, refused):
    line = refused([*REQUIRED, *argv])
    assert "... (5000 characters)" in line and len(line) < 600, line[:300]


def test_long_output_path_is_echoed_shortened(tmp_path, refused):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    line = refused([*REQUIRED, "--save", str(blocker / LONG)])
    assert line.startswith(f"--save {str(blocker / LONG)[:60]}... (") and len(line) < 600, line[:300]


def test_long_recipe_value_is_echoed_shortened(tmp_path, refused):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"num-layers: {LONG}\n")
    line = refused([*REQUIRED, "--yaml-cfg", str(recipe)])
    assert SHORTENED in line and len(line) < 600


@pytest.mark.parametrize("content, says", [
    (b"", "is not a megatron-core dataset index"),
    (b"garbage that is no index at all", "is not a megatron-core dataset index"),
    (b"MMIDIDX\x00\x00\x01", "ends inside its header"),
    (b"MMIDIDX\x00\x00" + (2).to_bytes(8, "little") + bytes([4]), "has index format version 2 and dtype code 4"),
    (b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([9]), "has index format version 1 and dtype code 9"),
])
def test_a_garbage_dataset_index_is_refused_before_start_up(tmp_path, refused, content, says):
    """Not at the dataset build after start-up: the .idx's header is read (18 bytes)."""
    prefix = indexed_dataset(tmp_path)
    open(prefix + ".idx", "wb").write(content)
    line = refused([*REQUIRED, *SPLIT, "--data-path", prefix])
    assert line.startswith(f"--data-path {prefix}: {prefix}.idx {says}") and "preprocess_data.py" in line


def test_the_index_header_is_megatron_cores(tmp_path):
    """The magic the check reads is the one megatron-core writes, and an index megatron-core
    writes passes."""
    import numpy
    import torch
    from megatron.core.datasets import indexed_dataset as mcore_indexed

    assert data_files.INDEX_MAGIC == mcore_indexed._INDEX_HEADER
    prefix = str(tmp_path / "written")
    builder = mcore_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert data_files._index_header_problem(prefix + ".idx") is None
