"""Issue #57, round four of bad inputs: each input the sweep found reaching start-up is refused
before it with one line naming the flag, variable or file and the fix; the two valid inputs it
found refused (a sample count above 2**31 - 1, a recipe's empty graph scope) pass; and the
ramp-up's iterations are counted without stepping through the ramp-up sample by sample."""

import argparse
import os
import random
from pathlib import Path

import pytest

from megatron.moe_patches.driver import arguments, output_dirs
from megatron.moe_patches.driver.training import main
from megatron.moe_patches.fields import shown
from megatron.moe_patches.driver.arguments import batch_calculator, sample_based_iterations

from checkpoint_files import checkpoint_root
from driver_model import REQUIRED, indexed_dataset

pytestmark = pytest.mark.usefixtures("one_rank")

# REQUIRED without its --train-iters 100: a sample-based run's flags go after it.
SAMPLES = [flag for i, flag in enumerate(REQUIRED) if flag != "--train-iters" and REQUIRED[i - 1] != "--train-iters"]
TINY_MOE = Path(arguments.__file__).parents[1] / "recipes" / "tiny-moe-stock.yaml"
MOE_GRAPHS = ["--yaml-cfg", "tiny-moe-stock", "--train-iters", "20", "--moe-device-tokens-per-expert",
              "--cuda-graph-impl", "local"]


# --- forced load balancing draws random numbers inside the captured layer -----------------


@pytest.mark.parametrize("scope", [["moe"], [], ["attn", "moe"]], ids=["moe", "whole layer", "attn moe"])
def test_forced_load_balancing_is_refused_with_a_graph_of_the_moe_layer(scope, refused):
    line = refused([*MOE_GRAPHS, *(["--cuda-graph-scope", *scope] if scope else []),
                    "--moe-router-force-load-balancing"])
    assert "--moe-router-force-load-balancing draws random numbers inside the layer" in line


def test_forced_load_balancing_without_graphs_passes(parsed):
    assert parsed(["--yaml-cfg", "tiny-moe-stock", "--train-iters", "20",
                   "--moe-router-force-load-balancing"]).moe_router_force_load_balancing


# --- --split that leaves nothing to train on ---------------------------------------------


@pytest.mark.parametrize("split", ["0,100,0", "0,1", "0.0,0,5"])
def test_a_split_without_a_training_share_is_refused_with_a_data_path(tmp_path, split, refused):
    data = indexed_dataset(tmp_path)
    assert refused([*REQUIRED, "--data-path", data, "--split", split]) == (
        f"--split {split!r} with --data-path: the training split (the first weight) is empty, so there is nothing "
        "to train on: give it a share, e.g. 969,30,1")


def test_a_split_with_a_training_share_passes(tmp_path, parsed):
    assert parsed([*REQUIRED, "--data-path", indexed_dataset(tmp_path), "--split", "1,99,0"]).split == "1,99,0"


# --- output paths longer than the file system takes --------------------------------------


@pytest.mark.parametrize("flag", ["--save", "--data-cache-path"])
def test_an_output_path_with_a_name_over_name_max_is_refused(tmp_path, flag, refused):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / ("n" * (limit + 1)) / "run"
    assert refused([*REQUIRED, flag, str(path)]) == (
        f"{flag} {shown(str(path))!r}: the name {'n' * 20}... is {limit + 1} bytes, but the file system takes names of at "
        f"most {limit} (NAME_MAX): give shorter names")


@pytest.mark.parametrize("flag", ["--save", "--data-cache-path"])
def test_an_output_path_over_path_max_is_refused(tmp_path, flag, refused):
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    path = tmp_path.joinpath(*["d" * 200] * (limit // 200 + 1))
    line = refused([*REQUIRED, flag, str(path)])
    assert line.startswith(f"{flag} '{str(path)[:40]}") and line.endswith(
        f": it is {len(str(path))} bytes long, and the run writes files under it: the file system takes paths of at most "
        f"{limit} bytes (PATH_MAX), so keep it under {limit - output_dirs.WRITTEN_UNDER_OUTPUT}: give a shorter path")


def test_a_long_but_valid_output_path_passes(tmp_path, parsed):
    path = tmp_path / ("n" * 200) / ("m" * 200)
    assert parsed([*REQUIRED, "--save", str(path)]).save == str(path)


# --- --save where the tracker is a directory ----------------------------------------------


def test_a_save_directory_whose_tracker_is_a_directory_is_refused(tmp_path, refused):
    save = tmp_path / "out"
    (save / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    assert refused([*REQUIRED, "--save", str(save)]) == (
        f"--save {shown(str(save))!r}: {shown(save / 'latest_checkpointed_iteration.txt')} is a directory, where the first save "
        "writes the checkpoint tracker (a file): remove it, or give another --save directory")


def test_a_save_directory_with_a_tracker_file_passes(tmp_path, parsed):
    root = checkpoint_root(tmp_path / "out", 4)
    assert parsed([*REQUIRED, "--save", str(root)]).save == str(root)


# --- the launcher's variables -------------------------------------------------------------


@pytest.mark.parametrize("address", ["node 1", " node1", "node1\t", "10.0.0.1 10.0.0.2"])
def test_a_master_addr_with_white_space_is_refused(monkeypatch, address, refused):
    monkeypatch.setenv("MASTER_ADDR", address)
    assert refused(REQUIRED) == (
        f"MASTER_ADDR={address!r} (set by the launcher) holds white space, so it names no host: set the host name "
        "or address of rank 0, or unset it on one node (the driver then uses 127.0.0.1)")


@pytest.mark.parametrize("visible, per_node", [("0", 2), ("0,1", 4), ("GPU-5f2a,GPU-77c1", 8)])
def test_fewer_visible_gpus_than_ranks_on_the_node_are_refused(monkeypatch, visible, per_node, refused):
    monkeypatch.setenv("WORLD_SIZE", str(per_node))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    count = len(visible.split(","))
    assert refused([*REQUIRED, "--global-batch-size", str(per_node)]) == (
        f"CUDA_VISIBLE_DEVICES={visible!r} names {count} GPU{'s' if count > 1 else ''}, but the launcher starts "
        f"{per_node} ranks on this node (LOCAL_WORLD_SIZE), one GPU each: name at least {per_node} GPUs, or start "
        f"at most {count} ranks per node")


@pytest.mark.parametrize("visible", ["0,1", "0,1,2,3", ""])
def test_enough_visible_gpus_or_none_given_pass(monkeypatch, visible, parsed):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # "": no GPU at all, which the GPU check says
    assert parsed([*REQUIRED, "--global-batch-size", "2"]).data_parallel_size == 2


# --- sample counts above 2**31 - 1 are real runs ------------------------------------------


def test_a_sample_count_above_int32_passes(parsed):
    """A 15 T-token run at sequence 4096 takes 3.7 B samples; Megatron-LM accepts them."""
    args = parsed([*SAMPLES, "--train-samples", "3000000000", "--global-batch-size", "1024",
                   "--lr-decay-samples", "3000000000", "--lr-warmup-samples", "2500000000"])
    assert (args.train_samples, args.train_iters) == (3_000_000_000, 3_000_000_000 // 1024)


def test_a_sample_count_above_int64_is_refused(refused):
    assert refused([*SAMPLES, "--train-samples", str(2**63)]).startswith(f"--train-samples {2**63}: ")


# --- a recipe's empty graph scope is the whole layer --------------------------------------


def test_an_empty_scope_list_in_a_recipe_is_the_whole_layer(tmp_path, parsed, capsys, reverted):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY_MOE.read_text() + "cuda-graph-impl: local\ncuda-graph-scope: []\n"
                      "moe-device-tokens-per-expert: true\n")
    assert parsed(["--yaml-cfg", str(recipe)]).cuda_graph_scope == []
    capsys.readouterr()
    assert main(["--yaml-cfg", str(recipe), "--print-plan"], prog="pretrain_gpt.py") == 0
    assert "CUDA graph of the transformer layer: can be captured" in capsys.readouterr().out.splitlines()


# --- the ramp-up counted in closed form ---------------------------------------------------


def stepwise(rampup, global_batch, micro_batch, data_parallel, train_samples):
    """(iterations, ramp-up batch sizes) as Megatron-LM's update_train_iters counts them: megatron-core's
    calculator stepped one iteration at a time (the reference; slow for long ramp-ups)."""
    args = argparse.Namespace(global_batch_size=global_batch, micro_batch_size=micro_batch,
                              data_parallel_size=data_parallel, rampup_batch_size=list(rampup))
    calculator = batch_calculator(args)
    iterations, consumed, sizes = 0, 0, set()
    while consumed <= rampup[2] and consumed <= train_samples:
        calculator.update(consumed, consistency_check=False)
        batch = calculator.get_current_global_batch_size()
        sizes.add(batch)
        consumed += batch
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations, tuple(sorted(sizes))


def test_the_closed_form_counts_as_the_calculator_steps():
    draw = random.Random(57)
    for _ in range(400):
        start, increment = draw.randint(1, 40), draw.randint(1, 40)
        global_batch = start + increment * draw.randint(1, 30)
        rampup = (start, increment, draw.randint(1, 5000))
        train_samples = draw.randint(1, 8000)
        expected = stepwise(rampup, global_batch, 1, 1, train_samples)
        assert arguments._sample_based_run(rampup, global_batch, 1, 1, train_samples) == expected, (
            rampup, global_batch, train_samples)


def test_a_ramp_up_over_two_billion_samples_is_counted_in_few_steps(monkeypatch):
    """--train-samples 2000000000 --rampup-batch-size 8 8 2000000000 spun in the stepwise loop;
    the closed form takes one step per batch size the ramp-up reaches."""
    levels = []
    real = arguments._ramp_up_level
    monkeypatch.setattr(arguments, "_ramp_up_level", lambda *a: levels.append(a) or real(*a))
    args = argparse.Namespace(rampup_batch_size=[8, 8, 2_000_000_000], global_batch_size=1024,
                              micro_batch_size=1, data_parallel_size=1, train_samples=2_000_000_000)
    arguments._sample_based_run.cache_clear()
    iterations = sample_based_iterations(args)
    assert 2_000_000_000 // 1024 < iterations < 2_000_000_000 // 8 and len(levels) < 10_000
