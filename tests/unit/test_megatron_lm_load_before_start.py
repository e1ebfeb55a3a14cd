"""Megatron-LM's loop judges the checkpoint --load names before start-up, from its files, as
this package's driver does (``megatron_lm.check_before_start``, the preflight run where Megatron-LM
validates its args): an incomplete or missing iteration (the tracker's or --ckpt-step's), a
missing checkpoint under --exit-on-missing-checkpoint, saved args of another model shape and
flat optimizer states saved in another expert parameter layout end the run with one error line and exit status 2. What
Megatron-LM loads as it is (no checkpoint, a matching one, --no-load-optim, other formats,
"release" trackers) passes."""

import argparse
import os
import shutil

import pytest

from megatron.moe_patches import megatron_lm
from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_KEY
from megatron.moe_patches.fields import PATCH_FIELDS

import checkpoint_files
from fake_megatron_lm import MEGATRON_LM_MODULES
from fake_megatron_lm import fake_training as install_fake_training, nothing_enabled  # noqa: F401  (autouse)

GROUPED = {"moe_single_grouped_weight": True, "moe_single_grouped_bias": False, "moe_mlp_glu_interleave_size": None}


@pytest.fixture
def initialize(monkeypatch):
    """Megatron-LM's initialize_megatron (a stand-in) after enable(); returns the error line
    of a refused run, or None where the run goes on."""
    package = install_fake_training(monkeypatch, MEGATRON_LM_MODULES)
    megatron_lm.enable()
    monkeypatch.setattr(megatron_lm, "_config_class_and_kwargs", lambda args: None)  # no config judged here

    def run(capsys, **given):
        defaults = {f.name: f.default for f in PATCH_FIELDS}
        args = argparse.Namespace(**{**defaults, "use_checkpoint_args": False, "ckpt_format": "torch_dist",
                                     "ckpt_step": None, "no_load_optim": False, "finetune": False,
                                     "exit_on_missing_checkpoint": False, **given})
        try:
            package.initialize.initialize_megatron(args)
        except SystemExit as exited:
            assert exited.code == 2
            lines = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
            assert len(lines) == 1, lines
            return lines[0].split(": error: ", 1)[1]
        return None

    yield run
    megatron_lm.disable()


def optimizer_state(sharding_type, layout):
    return {"optimizer": {"param_groups": []}, "param_state_sharding_type": sharding_type, LAYOUT_KEY: layout}


def test_a_tracker_naming_a_missing_iteration_is_refused_with_the_newest_complete_one(tmp_path, capsys, initialize):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    (root / "latest_checkpointed_iteration.txt").write_text("8")
    line = initialize(capsys, load=str(root))
    assert line.startswith(f"--load {root}: the checkpoint tracker") and "iteration 8" in line
    assert "write 4 into latest_checkpointed_iteration.txt" in line


def test_an_incomplete_ckpt_step_is_refused(tmp_path, capsys, initialize):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    (root / "iter_0000002").mkdir()
    line = initialize(capsys, load=str(root), ckpt_step=2)
    assert line == (f"--load {root} --ckpt-step 2: {root / 'iter_0000002'} is not a complete checkpoint (it is "
                    "empty); give --ckpt-step a saved iteration")
    assert initialize(capsys, load=str(root), ckpt_step=4) is None


def test_exit_on_missing_checkpoint_is_said_before_start_up(tmp_path, capsys, initialize):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert initialize(capsys, load=str(empty)) is None  # Megatron-LM trains from scratch
    line = initialize(capsys, load=str(empty), exit_on_missing_checkpoint=True)
    assert line.startswith(f"--load {empty}: the directory is empty, and --exit-on-missing-checkpoint is set")


def test_flat_optimizer_states_of_another_layout_are_refused_naming_the_flag(tmp_path, capsys, initialize):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", common={
        "iteration": 4, "args": {}, "optimizer": optimizer_state("dp_reshardable", GROUPED)})
    line = initialize(capsys, load=str(root))  # this run: per-expert weights
    assert line.startswith(f"--load {root / 'iter_0000004'}: the checkpoint's dp_reshardable")
    assert "--moe-single-grouped-weight True (checkpoint) vs False (now)" in line
    assert initialize(capsys, load=str(root), moe_single_grouped_weight=True) is None  # the same layout
    assert initialize(capsys, load=str(root), no_load_optim=True) is None  # the states are not loaded
    assert initialize(capsys, load=str(root), finetune=True) is None


def test_what_megatron_lm_reads_its_own_way_is_left_to_it(tmp_path, capsys, initialize):
    release = tmp_path / "release-ckpt"
    release.mkdir()
    (release / "latest_checkpointed_iteration.txt").write_text("release\n")
    (release / "release").mkdir()
    assert initialize(capsys, load=str(release)) is None
    broken = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    shutil.rmtree(broken / "iter_0000004")
    assert initialize(capsys, load=str(broken), ckpt_format="torch") is None  # another format: not these files
    assert initialize(capsys, load=str(broken)) is not None  # torch_dist: judged


SHAPE = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, group_query_attention=False,
             num_query_groups=1, kv_channels=64, swiglu=False, num_experts=8, moe_ffn_hidden_size=128,
             moe_shared_expert_intermediate_size=None)


def test_a_checkpoint_of_another_model_shape_is_refused_naming_each_flag(tmp_path, capsys, initialize):
    saved = argparse.Namespace(**{**SHAPE, "hidden_size": 512, "num_experts": 16})  # Megatron-LM saves its args
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", common={"iteration": 4, "args": saved})
    line = initialize(capsys, load=str(root), **SHAPE)
    assert line == (f"--load {root / 'iter_0000004'}: the checkpoint holds another model: --hidden-size 512 "
                    "(checkpoint) vs 256 (now); --num-experts 16 (checkpoint) vs 8 (now); give the checkpoint's "
                    "sizes, add --use-checkpoint-args to take them from it, or point --load at a checkpoint of "
                    "this model")
    assert initialize(capsys, load=str(root), **{**SHAPE, "use_checkpoint_args": True}) is None
    # num_query_groups counts only with --group-query-attention; an arg not saved is not compared
    same = argparse.Namespace(**{k: v for k, v in SHAPE.items() if k != "moe_ffn_hidden_size"}, )
    same.num_query_groups = 2
    other = checkpoint_files.checkpoint_root(tmp_path / "other", common={"iteration": 4, "args": same})
    assert initialize(capsys, load=str(other), **SHAPE) is None


def test_a_load_that_plainly_holds_a_checkpoint_is_never_trained_over(tmp_path, capsys, initialize):
    """A tracker that is no regular file, or one iteration's directory given as --load: there
    is a checkpoint, so training from scratch (no tracker read) would hide it."""
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    line = initialize(capsys, load=str(root / "iter_0000004"))
    assert line.startswith(f"--load {root / 'iter_0000004'} is one iteration of a checkpoint")
    assert f"point --load at the directory above it ({root})" in line
    (root / "latest_checkpointed_iteration.txt").unlink()
    (root / "latest_checkpointed_iteration.txt").mkdir()
    line = initialize(capsys, load=str(root))
    assert line.startswith(f"--load {root}: the checkpoint tracker {root / 'latest_checkpointed_iteration.txt'} "
                           "is a directory")


def test_a_tracker_that_is_a_pipe_is_refused_without_reading_it(tmp_path, capsys, initialize):
    """Megatron-LM's loop reads the tracker as the driver does: a named pipe is never opened (an
    open would wait for a writer forever)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    os.mkfifo(root / "latest_checkpointed_iteration.txt")
    line = initialize(capsys, load=str(root))
    assert line == (f"--load {root}: the checkpoint tracker {root / 'latest_checkpointed_iteration.txt'} is not a "
                    "regular file: make it a file holding the iteration to resume from (e.g. 100 for iter_0000100), "
                    "or point --load elsewhere")


def test_a_release_tracker_without_a_release_folder_is_refused(tmp_path, capsys, initialize):
    """Megatron-LM loads a "release" tracker's checkpoint from release/: without that folder
    its load fails after start-up (issue 57)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert initialize(capsys, load=str(root)) == (
        f"--load {root}: the checkpoint tracker {root / 'latest_checkpointed_iteration.txt'} names Megatron-LM's "
        f"release checkpoint, but {root / 'release'} is not a directory: put the release checkpoint there, or "
        "write the iteration of a saved checkpoint into the tracker")
