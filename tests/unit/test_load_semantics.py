"""--load as Megatron-LM does it, decided before start-up (issue 18): no checkpoint -> one
warning and training from scratch (an error with --exit-on-missing-checkpoint or
--use-checkpoint-args); a --load that is a file or a tracker that names no saved iteration
-> an error naming the file. Also: every arg --use-checkpoint-args takes from a checkpoint,
and the optimizer-state format load() reads."""

import argparse

import pytest

from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.arguments import build_parser, parse_args
from megatron.moe_patches.fields import PATCH_FIELDS

import checkpoint_files
from driver_model import REQUIRED

ERROR = "pretrain_gpt.py: error: "
WARNING = "pretrain_gpt.py: warning: "

pytestmark = pytest.mark.usefixtures("one_rank")


def checkpoint_root(tmp_path, iteration=4, tracker=None):
    """A --load directory with a tracker and a complete checkpoint of ``iteration``."""
    return checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration, tracker=tracker)


# --- no checkpoint: warn and start from scratch, or refuse -------------------------------


@pytest.mark.parametrize("kind, reason", [
    ("missing", "no such directory"),
    ("empty", "the directory is empty"),
    ("no_tracker", f"no checkpoint there (no {checkpointing.TRACKER})"),
])
def test_no_checkpoint_warns_once_and_trains_from_scratch(tmp_path, capsys, kind, reason, refused, parsed):
    root = tmp_path / kind
    if kind != "missing":
        root.mkdir()
    if kind == "no_tracker":
        (root / "iter_0000004").mkdir()
    assert checkpointing.find_checkpoint(str(root)) == (None, reason)
    capsys.readouterr()
    args = parsed([*REQUIRED, "--load", str(root)])
    assert args.load == str(root)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{WARNING}--load {root}: {reason}; training starts from scratch "
                   "(--exit-on-missing-checkpoint makes this an error)"]
    assert refused([*REQUIRED, "--load", str(root), "--exit-on-missing-checkpoint"]) == (
        f"--load {root}: {reason}, and --exit-on-missing-checkpoint is set: point --load at a checkpoint "
        "directory, or drop --exit-on-missing-checkpoint to train from scratch")
    assert refused([*REQUIRED, "--load", str(root), "--use-checkpoint-args"]) == (
        f"--use-checkpoint-args: --load {root} has no checkpoint to take the args from ({reason}); point "
        "--load at a checkpoint directory or drop --use-checkpoint-args")


def test_warning_is_printed_by_rank_0_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 1 of 2: a RANK beyond WORLD_SIZE is refused
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    parse_args([*REQUIRED, "--load", str(tmp_path / "missing")])
    assert capsys.readouterr().err == ""


def test_a_checkpoint_present_loads_quietly(tmp_path, capsys):
    root = checkpoint_root(tmp_path)
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000004"), None)
    capsys.readouterr()
    parse_args([*REQUIRED, "--load", str(root), "--exit-on-missing-checkpoint"])
    assert capsys.readouterr().err == ""


# --- unusable --load: errors naming the file ----------------------------------------------


def test_load_that_is_a_file(tmp_path, refused):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    assert refused([*REQUIRED, "--load", str(path)]) == (
        f"--load {path} is a file, not a checkpoint directory: point --load at the directory that holds "
        f"{checkpointing.TRACKER} and the iter_* directories")


@pytest.mark.parametrize("text", ["abc", "", "-4", "4.0", "release", "\u0664"])
def test_tracker_without_an_iteration_number(tmp_path, capsys, text, refused):
    root = checkpoint_root(tmp_path, tracker=text)
    tracker = root / checkpointing.TRACKER
    expected = (f"the checkpoint tracker {tracker} holds {text.strip()!r}, not an iteration number: write the "
                "iteration of a saved checkpoint into it (e.g. 100 for iter_0000100) or point --load elsewhere")
    assert refused([*REQUIRED, "--load", str(root)]) == expected
    with pytest.raises(checkpointing.CheckpointError) as exc:
        checkpointing.latest_iteration(str(root))
    assert str(exc.value) == expected


def test_tracker_that_is_not_text(tmp_path, refused):
    root = checkpoint_root(tmp_path)
    (root / checkpointing.TRACKER).write_bytes(b"\xff\xfe4")
    assert refused([*REQUIRED, "--load", str(root)]).startswith(
        f"cannot read the checkpoint tracker {root / checkpointing.TRACKER}:")


def test_tracker_naming_a_missing_iteration(tmp_path, refused):
    root = checkpoint_root(tmp_path, tracker="40")
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names iteration 40, but "
        f"{root / 'iter_0000040'} does not exist; write 4 into {checkpointing.TRACKER} to resume from "
        f"{root / 'iter_0000004'}, the newest complete checkpoint there, or point --load at another checkpoint")


def test_use_checkpoint_args_needs_load_and_a_readable_checkpoint(tmp_path, refused):
    assert refused([*REQUIRED, "--use-checkpoint-args"]) == (
        "--use-checkpoint-args needs --load (the checkpoint directory)")
    root = checkpoint_root(tmp_path)
    (root / "iter_0000004" / checkpointing.COMMON_FILE).unlink()  # the tensors only
    assert refused([*REQUIRED, "--load", str(root), "--use-checkpoint-args"]).startswith(
        f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names iteration 4, but "
        f"{root / 'iter_0000004'} is not a complete checkpoint (no common.pt")


def test_load_raises_naming_the_path_when_nothing_is_there(tmp_path):
    with pytest.raises(checkpointing.CheckpointError, match="no such directory"):
        checkpointing.load(str(tmp_path / "missing"), None, None, None, argparse.Namespace())
    with pytest.raises(checkpointing.CheckpointError, match="no such directory"):
        checkpointing.saved_args(str(tmp_path / "missing"))


# --- which args a checkpoint sets ---------------------------------------------------------

# The model-defining args --use-checkpoint-args (and a resumed model) take from the
# checkpoint, all of them, with a saved value unlike every default and every value below.
SAVED_MODEL_ARGS = dict(
    num_layers=6, hidden_size=384, ffn_hidden_size=1536, num_attention_heads=12, num_query_groups=4,
    kv_channels=32, seq_length=1024, max_position_embeddings=2048, vocab_size=50000, normalization="RMSNorm",
    swiglu=True, disable_bias_linear=True, position_embedding_type="rope", rotary_base=500000,
    rotary_percent=0.5,
    untie_embeddings_and_output_weights=True, qk_layernorm=True, num_experts=16, moe_ffn_hidden_size=768,
    moe_router_topk=4, moe_shared_expert_intermediate_size=1024,
)
# Run settings a checkpoint never imposes.
NOT_RESTORED = dict(
    micro_batch_size=7, global_batch_size=70, train_iters=999, lr=0.5, min_lr=0.25, seed=99, save="/elsewhere",
    tensor_model_parallel_size=8, expert_model_parallel_size=8, pipeline_model_parallel_size=8, bf16=True,
    moe_token_dispatcher_type="flex", moe_grouped_gemm=True, lr_warmup_iters=50, log_interval=9,
    dist_ckpt_optim_fully_reshardable=True, transformer_impl="local",
)


def saved_patch_args():
    """Every patch field at a non-default value (on for flags, 7 + i for sizes)."""
    return {f.name: True if f.default is False else 7 + i for i, f in enumerate(PATCH_FIELDS)}


def test_the_list_of_model_args_is_complete():
    assert checkpointing.MODEL_ARGS == list(SAVED_MODEL_ARGS)


def test_every_model_arg_and_every_patch_arg_is_restored_and_nothing_else():
    args = parse_args([*REQUIRED, "--hidden-size", "128", "--num-layers", "4", "--num-attention-heads", "8"])
    before = vars(args).copy()
    saved = {**before, **SAVED_MODEL_ARGS, **saved_patch_args(), **NOT_RESTORED}
    taken = checkpointing.restore_args(args, saved)
    assert {name: getattr(args, name) for name in SAVED_MODEL_ARGS} == SAVED_MODEL_ARGS
    assert {name: getattr(args, name) for name in saved_patch_args()} == saved_patch_args()
    assert {name: getattr(args, name) for name in NOT_RESTORED} == {name: before[name] for name in NOT_RESTORED}
    assert sorted(taken) == sorted({*SAVED_MODEL_ARGS, *saved_patch_args()})


def test_model_args_override_the_command_line_patch_sizes_do_not():
    saved = {**SAVED_MODEL_ARGS, **saved_patch_args()}
    sizes = [f.name for f in PATCH_FIELDS if f.default is None]
    argv = ["--hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "1"]
    for name in sizes:
        argv += ["--" + name.replace("_", "-"), "32"]
    args = build_parser().parse_args(argv)  # flags only: the checkpoint decides the rest
    checkpointing.restore_args(args, saved)
    assert (args.hidden_size, args.num_experts, args.moe_router_topk) == (384, 16, 4)
    assert all(getattr(args, name) == 32 for name in sizes)  # set now: kept (Megatron's _set_arg)


def test_old_checkpoints_without_an_arg_keep_the_current_value():
    args = parse_args([*REQUIRED, "--hidden-size", "128"])
    taken = checkpointing.restore_args(args, {"num_layers": 3, "kv_channels": None})
    assert (args.num_layers, args.hidden_size, args.kv_channels) == (3, 128, None) and taken == ["num_layers"]


def test_use_checkpoint_args_takes_them_before_validation(tmp_path, capsys, monkeypatch, refused):
    """parse_args takes the checkpoint's args before start-up, and validates the result."""
    root = checkpoint_root(tmp_path)
    saved = vars(parse_args([*REQUIRED, "--hidden-size", "384", "--num-attention-heads", "12",
                             "--num-layers", "6"])).copy()
    monkeypatch.setattr(checkpointing, "read_common_state", lambda path: {"args": saved})
    capsys.readouterr()
    args = parse_args([*REQUIRED, "--load", str(root), "--use-checkpoint-args", "--hidden-size", "64"])
    assert (args.hidden_size, args.num_attention_heads, args.num_layers, args.ffn_hidden_size) == (384, 12, 6, 1536)
    assert f"from {root / 'iter_0000004'}" in capsys.readouterr().out
    # The checkpoint's 12 heads do not split over 8 TP ranks: refused before start-up.
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert refused([*REQUIRED, "--load", str(root), "--use-checkpoint-args", "--tensor-model-parallel-size", "8",
                    "--sequence-parallel"]) == (
        "--num-attention-heads 12 must be divisible by --tensor-model-parallel-size 8")


# --- which format load() reads the optimizer states in -------------------------------------


class _Model:
    def sharded_state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


class _Optimizer:
    def __init__(self):
        self.metadata = []

    def sharded_state_dict(self, model_state, is_loading, metadata):
        assert is_loading
        self.metadata.append(metadata)
        return {"optimizer": {"param_groups": []}}

    def load_state_dict(self, state):
        self.loaded = state


class _Scheduler:
    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize("saved_flag, current_flag, expected", [
    (True, False, checkpointing.FULLY_RESHARDABLE),
    (False, True, checkpointing.DP_RESHARDABLE),
    (None, True, checkpointing.DP_RESHARDABLE),  # saved before the flag existed
    (True, True, checkpointing.FULLY_RESHARDABLE),
])
def test_load_reads_the_format_the_checkpoint_was_saved_in(tmp_path, monkeypatch, saved_flag, current_flag, expected):
    from megatron.core import dist_checkpointing

    root = checkpoint_root(tmp_path)
    saved = {} if saved_flag is None else {"dist_ckpt_optim_fully_reshardable": saved_flag}
    common = {"args": saved, "iteration": 4, "opt_param_scheduler": {"num_steps": 16}}
    monkeypatch.setattr(checkpointing, "read_common_state", lambda path: common)
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, path, **kw: state)
    monkeypatch.setattr(checkpointing, "check_checkpoint_covers", lambda state, path: None)
    optimizer, scheduler = _Optimizer(), _Scheduler()
    args = argparse.Namespace(dist_ckpt_optim_fully_reshardable=current_flag)
    assert checkpointing.load(str(root), _Model(), optimizer, scheduler, args) == 4
    assert optimizer.metadata == [expected]
    assert scheduler.loaded == {"num_steps": 16}
    assert checkpointing.checkpoint_format(saved).dist_ckpt_optim_fully_reshardable is bool(saved_flag)
    # This run's own saves follow its flag.
    assert checkpointing.optimizer_metadata(args) == (
        checkpointing.FULLY_RESHARDABLE if current_flag else checkpointing.DP_RESHARDABLE)
