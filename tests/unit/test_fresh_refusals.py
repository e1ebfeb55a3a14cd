"""Issue #46, a fresh round of bad inputs: each kind the sweep found accepted (or answered with a
traceback or a wrong reason) is refused before start-up with one line naming the flag, variable or
file and the fix, and the harmless spellings next to it still pass."""

import os

import pytest

from checkpoint_files import checkpoint_root, complete_iteration
from driver_model import REQUIRED

pytestmark = pytest.mark.usefixtures("one_rank")

# REQUIRED without its --train-iters 100: a sample-based run's flags go after it.
SAMPLES = [flag for i, flag in enumerate(REQUIRED) if flag != "--train-iters" and REQUIRED[i - 1] != "--train-iters"]


def recipe(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- --split: the weights megatron-core reads are the ones written --------------------------------


@pytest.mark.parametrize("split", ["98,1,1,0", "a,b,c", "nan,1,1", "inf,1,1", "-1,2,99", "1e3,1,1", ""])
def test_a_split_megatron_core_would_read_otherwise_is_refused(split, refused):
    assert refused([*REQUIRED, f"--split={split}"]).startswith(
        f"--split {split!r}: not weights megatron-core reads as written: give up to three weights")


def test_a_split_of_zeros_is_refused(refused):
    assert refused([*REQUIRED, "--split", "0,0,0"]).startswith("--split '0,0,0': the weights add up to 0")


@pytest.mark.parametrize("split", ["98,2", "98/2/0", "98 , 2, 0", "969, 30, 1", "100", ".5,0.25,1."])
def test_the_splits_megatron_lm_reads_pass(split, parsed):
    assert parsed([*REQUIRED, "--split", split]).split == split


# --- --rampup-batch-size: a ramp of 0 samples -----------------------------------------------------


def test_a_ramp_up_over_zero_samples_is_refused_not_a_traceback(refused):
    assert refused([*SAMPLES, "--train-samples", "400", "--global-batch-size", "8", "--rampup-batch-size",
                    "2", "2", "0"]).startswith("--rampup-batch-size 2 2 0: the ramp-up must take at least 1 sample")


@pytest.mark.parametrize("value, count", [("[2, 2]", 2), ("[2, 2, 100, 5]", 4), ("[]", 0)])
def test_a_recipe_list_of_the_wrong_length_names_the_key(tmp_path, value, count, refused):
    path = recipe(tmp_path, f"train_samples: 400\nglobal_batch_size: 8\nrampup_batch_size: {value}\n")
    assert refused([*SAMPLES, "--yaml-cfg", path]) == (
        f"{path}:3: 'rampup_batch_size' (--rampup-batch-size) takes 3 values (START INCREMENT SAMPLES), "
        f"not {count}: {value}")


# --- a run that would train nothing ---------------------------------------------------------------


def test_fewer_samples_than_one_batch_are_refused(refused, parsed):
    assert refused([*SAMPLES, "--train-samples", "5", "--global-batch-size", "8"]) == (
        "--train-samples 5 is less than one --global-batch-size 8: no iteration would run; give at least one "
        "batch of samples")
    assert parsed([*SAMPLES, "--train-samples", "8", "--global-batch-size", "8"]).train_iters == 1


def test_a_resume_at_the_end_passes_to_save_it_again(tmp_path, parsed):
    """Loading a checkpoint at the run's last iteration trains nothing and saves it again: how a
    checkpoint moves to another layout or parallelism (as in Megatron-LM), not a mistake."""
    root = checkpoint_root(tmp_path / "ckpt", 4)
    assert parsed([*SAMPLES, "--train-iters", "4", "--load", str(root)]).train_iters == 4


def test_a_resume_before_the_end_passes(tmp_path, parsed):
    root = checkpoint_root(tmp_path / "ckpt", 4)
    assert parsed([*SAMPLES, "--train-iters", "5", "--load", str(root)]).train_iters == 5


# --- --load holding a checkpoint without a usable tracker -----------------------------------------


def _fifo(path):
    os.mkfifo(path)


def _directory(path):
    os.mkdir(path)


def _link_to_a_device(path):
    os.symlink("/dev/zero", path)


@pytest.mark.parametrize("make, kind", [(_fifo, "not a regular file"), (_directory, "a directory"),
                                        (_link_to_a_device, "not a regular file")])
def test_a_tracker_that_is_no_file_is_refused_not_trained_over(tmp_path, make, kind, refused):
    root = tmp_path / "ckpt"
    root.mkdir()
    tracker = root / "latest_checkpointed_iteration.txt"
    make(tracker)
    assert refused([*REQUIRED, "--load", str(root)]).startswith(
        f"--load {root}: the checkpoint tracker {tracker} is {kind}: make it a file holding the iteration")


def test_an_iteration_directory_as_load_names_its_parent(tmp_path, refused):
    root = checkpoint_root(tmp_path / "ckpt", 4)
    assert refused([*REQUIRED, "--load", str(root / "iter_0000004")]) == (
        f"--load {root / 'iter_0000004'} is one iteration of a checkpoint (it holds common.pt, metadata.json, "
        f".metadata), not the checkpoint directory: point --load at the directory above it ({root}), which holds "
        "latest_checkpointed_iteration.txt")
    bare = complete_iteration(tmp_path / "bare")  # no tracker above it either
    assert refused([*REQUIRED, "--load", str(bare)]).startswith(f"--load {bare} is one iteration of a checkpoint")


def test_a_load_without_a_checkpoint_still_trains_from_scratch(tmp_path, parsed, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for folder in ("empty", "other"):
        assert parsed([*REQUIRED, "--load", str(tmp_path / folder)]).load == str(tmp_path / folder)
    assert "training starts from scratch" in capsys.readouterr().err


# --- --yaml-cfg and path values -------------------------------------------------------------------


def test_a_recipe_that_is_no_regular_file_says_so(tmp_path, refused):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.yaml"
    os.symlink(loop, loop)
    device = "not a regular file (a pipe, a device or a socket)"
    for path, says in ((fifo, device), ("/dev/null", device),
                       (loop, "a symbolic link that leads to no file")):
        assert refused([*REQUIRED, "--yaml-cfg", str(path)]).startswith(f"--yaml-cfg {path}: {says}; give the path")


def test_an_empty_yaml_cfg_is_refused_not_skipped(refused):
    assert refused([*REQUIRED, "--yaml-cfg", ""]) == (
        "--yaml-cfg '': an empty path (an unset shell variable?): give the path, or drop the flag")


@pytest.mark.parametrize("key", ["save", "load", "data_cache_path"])
def test_a_path_with_a_nul_character_is_refused(tmp_path, key, refused):
    path = recipe(tmp_path, f'{key}: "out\\0dir"\n')
    flag = "--" + key.replace("_", "-")
    assert refused([*REQUIRED, "--yaml-cfg", path]) == (
        f"{flag} 'out\\x00dir': a path with a NUL character, which no file name holds: write the path without it")


def test_odd_but_valid_paths_pass(tmp_path, parsed):
    unicode_recipe = recipe(tmp_path, "seed: 3\n", "récipe é ✓.yaml")
    args = parsed([*REQUIRED, "--yaml-cfg", unicode_recipe, "--save", str(tmp_path / "a\nb ✓")])
    assert (args.seed, args.save) == (3, str(tmp_path / "a\nb ✓"))


# --- the launcher's node variables ---------------------------------------------------------------


@pytest.mark.parametrize("env, message", [
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' (set by the launcher) is not a rank count from 1 to 1"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE='4' (set by the launcher) is not a rank count from 1 to 2 (WORLD_SIZE 2)"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two' (set by the launcher) is not a rank"),
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=3 with LOCAL_WORLD_SIZE=2 (set by the launcher): the local rank must be below the ranks per node"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR='' (set by the launcher) is empty: set the host of rank 0"),
    ({"MASTER_ADDR": "  "}, "MASTER_ADDR='  ' (set by the launcher) is empty"),
])
def test_launcher_node_variables_that_disagree_are_refused(env, message, monkeypatch, refused):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert refused(REQUIRED).startswith(message)


def test_launcher_node_variables_as_torchrun_sets_them_pass(monkeypatch, parsed):
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    parsed(REQUIRED)


def test_a_world_size_without_a_rank_is_refused(monkeypatch, refused):
    """WORLD_SIZE > 1 without RANK (not torchrun): every process would be rank 0 and wait at the
    rendezvous for ranks that never come."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    line = refused(list(REQUIRED))
    assert line.startswith("WORLD_SIZE=2 is set but RANK is not: start the 2 processes with torchrun")
