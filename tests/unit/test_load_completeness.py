"""--load is refused before start-up, whatever flags accompany it, when the tracker names an
iteration that is not a complete checkpoint (checkpointing.incomplete_reason): exit status
2, one line naming the path and the fix. Complete: megatron-core's metadata.json, the tensor
index .metadata and every tensor file it names at full length, and a common state that
torch.load reads back as the load does (weights only). A directory without a tracker is
still "no checkpoint: train from scratch", as in Megatron-LM."""

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver import checkpointing, training

import checkpoint_files
from driver_model import REQUIRED

pytestmark = pytest.mark.usefixtures("one_rank")

UPSTREAM = Path(__file__).parent / "fixtures" / "upstream_0192_ckpt"  # megatron-core 0.19.2: no common.pt
# --load with the flags that change what it does; each must not skip the check.
FLAG_SETS = [
    [],
    ["--no-load-optim"],
    ["--use-checkpoint-args"],
    ["--exit-on-missing-checkpoint"],
    ["--no-load-optim", "--load-main-params-from-ckpt", "--bf16", "--use-distributed-optimizer"],
]


class NotAllowed:
    """A type torch.load(weights_only=True) refuses (a plain pickle would load it)."""


def common_bytes(common) -> bytes:
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return buffer.getvalue()


def tensor_file(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def _empty(path):
    shutil.rmtree(path)
    path.mkdir()


def _cut_short(file: Path):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


# (damage, what the refusal says about it): each breaks a complete checkpoint one way.
DAMAGES = {
    "empty folder": (_empty, "(it is empty)"),
    "common.pt of random bytes": (lambda p: (p / "common.pt").write_bytes(bytes(range(256)) * 4),
                                  "(its common state cannot be read ("),
    "common.pt cut short": (lambda p: (p / "common.pt").write_bytes(common_bytes({"iteration": 4})[:120]),
                            "(its common state cannot be read (RuntimeError: PytorchStreamReader"),
    "common.pt not a dict": (lambda p: torch.save([4], p / "common.pt"), "(its common state is a list, not a dict)"),
    "no common.pt": (lambda p: (p / "common.pt").unlink(), "(no common.pt (its common state"),
    "no metadata.json": (lambda p: (p / "metadata.json").unlink(),
                         "(no metadata.json, which megatron-core writes last: the save did not finish)"),
    "metadata.json cut short": (lambda p: (p / "metadata.json").write_text('{"sharded_backend": "tor'),
                                "(its metadata.json cannot be read (JSONDecodeError:"),
    "another sharded backend": (lambda p: (p / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"})),
                                "(its metadata.json names the sharded backend 'zarr'; pretrain_gpt.py reads torch_dist)"),
    "no .metadata": (lambda p: (p / ".metadata").unlink(), "(no .metadata (the index of its tensor files))"),
    ".metadata cut short": (lambda p: _cut_short(p / ".metadata"), "(its .metadata cannot be read ("),
    "tensor file missing": (lambda p: tensor_file(p).unlink(), "a tensor file its .metadata names, is missing)"),
    "tensor file cut short": (lambda p: _cut_short(tensor_file(p)), " is cut short ("),
}


def damaged_root(tmp_path, damage, older=True) -> Path:
    """A --load directory whose tracker names iteration 4, damaged by ``damage``; with
    ``older``, a complete iteration 2 beside it."""
    root = tmp_path / "ckpt"
    if older:
        checkpoint_files.checkpoint_root(root, 2)
    checkpoint_files.checkpoint_root(root, 4)
    DAMAGES[damage][0](root / "iter_0000004")
    return root


def refusal_start(root) -> str:
    return (f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names iteration 4, but "
            f"{root / 'iter_0000004'} is not a complete checkpoint ")


# --- refused before start-up, naming the path and the fix ----------------------------------


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_incomplete_checkpoint_is_refused_naming_what_is_wrong(tmp_path, damage, refused):
    root = damaged_root(tmp_path, damage)
    message = refused([*REQUIRED, "--load", str(root)])
    assert message.startswith(refusal_start(root)) and DAMAGES[damage][1] in message, message
    assert message.endswith(
        f"; write 2 into {checkpointing.TRACKER} to resume from {root / 'iter_0000002'}, the newest complete "
        "checkpoint there, or point --load at another checkpoint")


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda flags: " ".join(flags) or "alone")
@pytest.mark.parametrize("damage", ["empty folder", "common.pt of random bytes", "no metadata.json"])
def test_every_flag_set_gets_the_check(tmp_path, damage, flags, refused):
    root = damaged_root(tmp_path, damage)
    assert refused([*REQUIRED, "--load", str(root), *flags]).startswith(refusal_start(root))


def test_a_common_state_the_load_refuses_is_refused_by_name_not_as_incomplete(tmp_path, refused):
    """A common.pt naming a type megatron-core does not allow is no cut-short save: it is refused
    unread, naming the file and the type (not resumed from an older iteration)."""
    root = damaged_root(tmp_path, "empty folder")
    checkpoint_files.complete_iteration(root / "iter_0000004", {"iteration": 4, "args": NotAllowed()})
    file = root / "iter_0000004" / "common.pt"
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"{file} is not safe to load: it needs {NotAllowed.__module__}.NotAllowed, which no megatron-core "
        "checkpoint holds, so it was not read (reading it could run code); point --load at a checkpoint saved by "
        "megatron-core, or load it with the version that saved it")


def test_a_tracker_naming_a_missing_folder(tmp_path, refused):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", 2, tracker="4")
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names iteration 4, but "
        f"{root / 'iter_0000004'} does not exist; write 2 into {checkpointing.TRACKER} to resume from "
        f"{root / 'iter_0000002'}, the newest complete checkpoint there, or point --load at another checkpoint")


def test_without_a_complete_checkpoint_the_fix_says_so(tmp_path, refused):
    root = damaged_root(tmp_path, "no metadata.json", older=False)
    (root / "iter_0000002.incomplete").mkdir()  # a killed save's leftover is no checkpoint
    assert refused([*REQUIRED, "--load", str(root)]).endswith(
        "(no metadata.json, which megatron-core writes last: the save did not finish); no complete checkpoint is "
        "there: point --load at another checkpoint, or at an empty directory to train from scratch")


def test_the_refusal_comes_before_the_gpu_check(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py's main: the --load refusal exits 2 before any GPU work."""
    root = damaged_root(tmp_path, "common.pt of random bytes")
    monkeypatch.setattr(training, "require_gpu", lambda *a: pytest.fail("reached the GPU check"))
    monkeypatch.setattr(training, "pretrain", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exc:
        training.main([*REQUIRED, "--load", str(root)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"pretrain_gpt.py: error: {refusal_start(root)}")


def test_load_and_saved_args_refuse_it_too(tmp_path):
    root = damaged_root(tmp_path, "common.pt of random bytes")
    for read in (checkpointing.saved_args, lambda r: checkpointing.load(r, None, None, None, None)):
        with pytest.raises(checkpointing.CheckpointError, match="^" + refusal_start(root).replace("(", r"\(")):
            read(str(root))


# --- accepted ------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", FLAG_SETS[:2], ids=["alone", "no-load-optim"])
def test_a_complete_checkpoint_is_accepted_quietly(tmp_path, flags, parsed, capsys):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", 4)
    (root / "iter_0000006.incomplete").mkdir()  # a killed later save changes nothing
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000004"), None)
    assert checkpointing.incomplete_reason(str(root / "iter_0000004")) is None
    capsys.readouterr()
    parsed([*REQUIRED, "--load", str(root), *flags])
    assert capsys.readouterr().err == ""


def test_megatron_core_0192_checkpoints_keep_their_common_state_inside(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(UPSTREAM, root / "iter_0000007")
    (root / checkpointing.TRACKER).write_text("7")
    assert not (root / "iter_0000007" / "common.pt").exists()
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000007"), None)


def test_no_tracker_still_means_training_from_scratch(tmp_path, parsed, capsys):
    """Megatron-LM's rule: no tracker, no checkpoint, whatever iteration folders are there."""
    root = tmp_path / "ckpt"
    (root / "iter_0000004").mkdir(parents=True)  # incomplete, but no tracker names it
    assert checkpointing.find_checkpoint(str(root)) == (None, f"no checkpoint there (no {checkpointing.TRACKER})")
    capsys.readouterr()
    parsed([*REQUIRED, "--load", str(root)])
    assert "training starts from scratch" in capsys.readouterr().err


def test_a_save_killed_while_replacing_the_named_iteration_resumes_from_the_copy(tmp_path):
    """Killed between moving the named iteration aside and naming the new one (save's two
    renames): the moved copy is complete, and is what --load resumes from."""
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", 4)
    (root / "iter_0000004").rename(root / "iter_0000004.replaced")
    checkpoint_files.complete_iteration(root / "iter_0000004.incomplete")  # the new one, unnamed
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000004.replaced"), None)
    _empty(root / "iter_0000004.replaced")  # but only a complete copy
    with pytest.raises(checkpointing.CheckpointError, match="iter_0000004 does not exist"):
        checkpointing.find_checkpoint(str(root))
