"""Five rules that no other test held (a single-point edit of each went unnoticed), one
focused test each:

1. ``--moe-single-grouped-bias`` given alone is refused where no expert backend can hold
   grouped parameters: by the plan, by config validation and by pretrain_gpt.py.
2. The expert-TP half of the parallel-size rules: the plan refuses process groups whose
   expert TP differs from the config's (EP equal), and pretrain_gpt.py's world-size check
   counts ETP x EP x PP.
3. A killed re-save leaves the only complete checkpoint under its ``.replaced`` name; the
   next save of another iteration keeps it until a newer checkpoint is complete.
4. ``--use-checkpoint-args`` takes a saved False as well as a saved True: the driver's
   restore (model args and patch switches) and ``megatron_lm.restore_patch_args``.
5. The advice printed for a damaged latest iteration names the newest complete checkpoint.
"""

import argparse
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.moe_patches import megatron_lm
from megatron.moe_patches import plan as moe_plan
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.arguments import parse_args
from megatron.moe_patches.experts.grouped_mm import GroupedMMBackend

import checkpoint_files
from crash_save_child import MODEL_KEY, OPTIMIZER_KEY, WIDTH
from driver_model import REQUIRED, RUN

pytestmark = pytest.mark.usefixtures("one_rank")

HERE = Path(__file__).resolve().parent
PATCH_REFUSAL = "Invalid MoE patch configuration: "
BIAS_REFUSAL = "moe_single_grouped_bias=True needs an expert backend that holds grouped parameters"


# --- 1. --moe-single-grouped-bias alone, where no backend holds grouped parameters ----------

# A small gated MoE with expert biases (which --moe-single-grouped-bias needs), bf16.
BIASED_MOE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=True, bf16=True, params_dtype=torch.bfloat16,
)
# The same as pretrain_gpt.py flags (biases on: no --disable-bias-linear).
BIASED_MOE_FLAGS = [*RUN, "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024",
                    "--num-attention-heads", "4", "--swiglu", "--num-experts", "8", "--moe-ffn-hidden-size", "512",
                    "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--bf16"]


# Configs of that MoE where no backend holds grouped parameters, as flags.
NO_HOLDER_FLAGS = [
    [],  # no --moe-device-tokens-per-expert: neither grouped backend is asked for
    ["--moe-device-tokens-per-expert", "--fp8-format", "e4m3", "--fp8-recipe", "delayed"],  # a recipe neither takes
]


def test_single_grouped_bias_alone_is_refused_where_no_backend_holds_grouped_params(refused):
    # Where the grouped_mm backend runs, it holds them: the flag is accepted.
    held = PatchedTransformerConfig(**BIASED_MOE, moe_device_tokens_per_expert=True, moe_single_grouped_bias=True)
    assert moe_plan.plan_for(held).backend is GroupedMMBackend
    assert moe_plan.plan_for(held).single_grouped_refusal is None
    # Without --moe-device-tokens-per-expert no backend can: the plan says so, naming the flag.
    config = PatchedTransformerConfig(**BIASED_MOE)
    config.moe_single_grouped_bias = True  # set late: the plan alone decides
    assert not config.moe_single_grouped_weight
    refusal = moe_plan.plan_for(config).single_grouped_refusal
    assert refusal is not None and refusal.startswith(BIAS_REFUSAL), refusal
    assert "grouped_mm: moe_device_tokens_per_expert is off" in refusal
    # Config validation refuses it at construction ...
    with pytest.raises(ValueError) as err:
        PatchedTransformerConfig(**BIASED_MOE, moe_single_grouped_bias=True)
    assert BIAS_REFUSAL in str(err.value)
    # ... and pretrain_gpt.py before start-up (the preflight), whatever keeps the holders out.
    for flags in NO_HOLDER_FLAGS:
        message = refused([*BIASED_MOE_FLAGS, *flags, "--moe-single-grouped-bias"])
        assert message.startswith(PATCH_REFUSAL + BIAS_REFUSAL), (flags, message)


# --- 2. expert TP: the plan's process-group check and the world-size check ------------------


def test_plan_refuses_process_groups_whose_expert_tp_differs(moe_config):
    glu = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False)
    etp2 = moe_plan.plan_for(moe_config(**glu, expert_tensor_parallel_size=2))
    assert (etp2.ep_size, etp2.expert_tp_size) == (1, 2)
    etp2.check_parallel_sizes(1, 2)  # the config's sizes: accepted
    with pytest.raises(ValueError) as err:
        etp2.check_parallel_sizes(1, 1)  # EP equal, expert TP not
    assert str(err.value) == (
        "The MoE process groups have EP 1 and expert TP 1, but the config says expert_model_parallel_size=1 and "
        "expert_tensor_parallel_size=2: build the config with the sizes the groups have.")
    etp1 = moe_plan.plan_for(moe_config(**glu, expert_model_parallel_size=2))
    etp1.check_parallel_sizes(2, 1)
    with pytest.raises(ValueError, match="EP 2 and expert TP 2, but the config says expert_model_parallel_size=2 "
                                         "and expert_tensor_parallel_size=1"):
        etp1.check_parallel_sizes(2, 2)


MOE_FLAGS = [*REQUIRED, "--num-experts", "8", "--disable-bias-linear"]  # megatron-core: biases need ETP 1


@pytest.mark.parametrize("world, argv, message", [
    (6, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 4 does "
     "not divide the world size 6 (WORLD_SIZE, the ranks launched): launch a multiple of 4 ranks or change the sizes"),
    (2, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 4 ranks, "
     "more than the world size 2 (WORLD_SIZE, the ranks launched): launch at least 4 ranks or lower the sizes"),
])
def test_world_size_check_counts_the_expert_tp_size(world, argv, message, monkeypatch, refused):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert refused([*MOE_FLAGS, *argv]) == message


@pytest.mark.parametrize("world, argv, data_parallel", [
    (6, ["--expert-model-parallel-size", "2"], 6),  # the same EP with ETP 1 fits 6 ranks
    (4, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"], 4),
    # An explicit ETP 1 is not the TP size: ETP 1 x EP 2 = 2 ranks fit, though TP 2 x EP 2 would not.
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
         "--expert-model-parallel-size", "2"], 1),
])
def test_world_size_check_accepts_expert_grids_that_tile_the_world(world, argv, data_parallel, monkeypatch, parsed):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parsed([*MOE_FLAGS, *argv])
    assert args.data_parallel_size == data_parallel


# --- 3. the next save of another iteration keeps the only complete checkpoint --------------


_stores = itertools.count()


def save_in_child(tmp_path, *saves, kill=None):
    """crash_save_child.py's saves (ROOT ITERATION VALUE ...), the last killed at ``kill``
    (tests/save_kill_points.py) if given, in a session of its own (the kill takes its
    process group). Returns (exit status, output tail)."""
    argv = [sys.executable, str(HERE / "crash_save_child.py"), *(["--kill", kill] if kill else []),
            *map(str, saves)]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", STORE=str(tmp_path / f"store-{next(_stores)}"))
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output[-3000:]


def saved_contents(path):
    """(iteration, value) of the common state at ``path``, and whether its tensors are the
    stand-in state crash_save_child.py saves with that value."""
    common = checkpointing.read_common_state(str(path))
    tensors = {MODEL_KEY: torch.zeros(1, WIDTH), OPTIMIZER_KEY: torch.zeros(1, WIDTH)}
    dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    value = common["value"]
    whole = (torch.equal(tensors[MODEL_KEY], torch.full((1, WIDTH), float(value)))
             and torch.equal(tensors[OPTIMIZER_KEY], torch.full((1, WIDTH), -float(value))))
    return (common["iteration"], value), whole


def test_the_save_after_a_killed_resave_keeps_the_only_complete_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    copy = root / f"iter_0000010{checkpointing.REPLACED}"
    # Iteration 10 saved completely, then a re-save of it killed between its two renames:
    # the complete iteration 10 is only there as iter_0000010.replaced, which --load resumes from.
    status, output = save_in_child(tmp_path, root, 10, 10, root, 10, 11, kill="swap")
    assert status == -signal.SIGKILL, output
    assert not (root / "iter_0000010").exists() and (root / checkpointing.TRACKER).read_text() == "10"
    assert checkpointing.find_checkpoint(str(root)) == (str(copy), None)
    # The save of another iteration (20) starts by clearing killed saves, and is killed midway.
    status, output = save_in_child(tmp_path, root, 20, 20, kill="model")
    assert status == -signal.SIGKILL, output
    assert (root / f"iter_0000020{checkpointing.INCOMPLETE}").is_dir()  # it got as far as writing
    assert not (root / f"iter_0000010{checkpointing.INCOMPLETE}").exists()  # the killed re-save's leftover: gone
    # Iteration 10 is still there, complete, and still what --load resumes from.
    assert checkpointing.incomplete_reason(str(copy)) is None
    assert checkpointing.find_checkpoint(str(root)) == (str(copy), None)
    assert saved_contents(copy) == ((10, 10), True)
    # The save of iteration 30 completes: it is named, and what --load resumes from now.
    status, output = save_in_child(tmp_path, root, 30, 30)
    assert status == 0, output
    assert (root / checkpointing.TRACKER).read_text() == "30"
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000030"), None)
    assert saved_contents(root / "iter_0000030") == ((30, 30), True)
    assert not (root / f"iter_0000020{checkpointing.INCOMPLETE}").exists()


# --- 4. --use-checkpoint-args takes saved False values ---------------------------------------

# A run asking for everything on: gated, no biases, device token counts, single grouped weights.
ALL_ON = [*REQUIRED, "--num-experts", "8", "--moe-grouped-gemm", "--swiglu", "--disable-bias-linear",
          "--qk-layernorm", "--untie-embeddings-and-output-weights", "--bf16", "--moe-device-tokens-per-expert",
          "--moe-single-grouped-weight",
          "--no-bias-dropout-fusion", "--no-bias-gelu-fusion"]  # the saved biased GeLU experts: TEGroupedMLP's rule
# What a checkpoint saved with all of them off holds (model args and patch switches).
SAVED_OFF = dict(swiglu=False, disable_bias_linear=False, qk_layernorm=False,
                 untie_embeddings_and_output_weights=False, moe_device_tokens_per_expert=False,
                 moe_single_grouped_weight=False)


def test_driver_restore_takes_saved_false_values():
    args = parse_args(ALL_ON)
    assert all(getattr(args, name) is True for name in SAVED_OFF)
    saved = {**vars(args), **SAVED_OFF}
    taken = checkpointing.restore_args(args, saved)
    assert {name: getattr(args, name) for name in SAVED_OFF} == SAVED_OFF
    assert set(SAVED_OFF) <= set(taken)


def test_use_checkpoint_args_takes_saved_false_values_before_start_up(tmp_path, parsed):
    saved = {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "num_experts": 8, **SAVED_OFF}
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", 4, common={"iteration": 4, "args": saved})
    args = parsed([*ALL_ON, "--load", str(root), "--use-checkpoint-args"])
    assert {name: getattr(args, name) for name in SAVED_OFF} == SAVED_OFF


def test_megatron_lm_restore_takes_saved_false_switches():
    args = argparse.Namespace(moe_device_tokens_per_expert=True, moe_single_grouped_weight=True,
                              moe_single_grouped_bias=True, use_transformer_engine_op_fuser=False)
    saved = argparse.Namespace(moe_device_tokens_per_expert=False, moe_single_grouped_weight=False,
                               moe_single_grouped_bias=False, use_transformer_engine_op_fuser=False)
    restored = megatron_lm.restore_patch_args(args, saved)
    assert (args.moe_device_tokens_per_expert, args.moe_single_grouped_weight, args.moe_single_grouped_bias,
            args.use_transformer_engine_op_fuser) == (False, False, False, False)
    assert {"moe_device_tokens_per_expert", "moe_single_grouped_weight", "moe_single_grouped_bias"} <= set(restored)


# --- 5. the resume advice names the newest complete checkpoint ------------------------------


def test_resume_advice_names_the_newest_complete_checkpoint(tmp_path, refused):
    root = tmp_path / "ckpt"
    for iteration in (10, 20):
        checkpoint_files.complete_iteration(root / f"iter_{iteration:07d}")
    checkpoint_files.complete_iteration(root / "iter_0000025")
    (root / "iter_0000025" / checkpointing.CONFIG_FILE).unlink()  # damaged too: not complete
    checkpoint_files.checkpoint_root(root, 30)
    (root / "iter_0000030" / checkpointing.CONFIG_FILE).unlink()  # the tracker's iteration, damaged
    message = refused([*REQUIRED, "--load", str(root)])
    assert message.startswith(f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names "
                              f"iteration 30, but {root / 'iter_0000030'} is not a complete checkpoint "), message
    assert message.endswith(
        f"; write 20 into {checkpointing.TRACKER} to resume from {root / 'iter_0000020'}, the newest complete "
        "checkpoint there, or point --load at another checkpoint"), message
    assert checkpointing.newest_complete_iteration(str(root)) == 20
