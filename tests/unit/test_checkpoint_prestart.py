"""Checkpoints judged before start-up (the issue: a checkpoint of another model passed the
pre-start checks; unreadable folders, a 6 GB tracker and a 5000-digit tracker ended in
tracebacks or unnamed messages; a dangling --save symlink failed at the first save):

1. the tracker is read at most ``checkpointing.TRACKER_READ_LIMIT`` bytes at a time, and a
   longer one is refused as not an iteration number, naming the file and how it starts;
2. a --load directory, tracker or named iteration this user cannot read is refused naming
   the path and the OS error (run as root, which reads everything, the OS errors are
   simulated);
3. a --save path through a symbolic link to a missing target, inside a file or where this
   user cannot write is refused naming the path and the fix;
4. a checkpoint whose saved args give the model other shapes than this run's flags is
   refused naming each flag with both values (unless --use-checkpoint-args takes them), and
   a saved arg of a type its flag cannot give is refused naming the arg.
"""

import argparse
import builtins
import errno
import os

import pytest

from megatron.moe_patches.checkpoint import on_disk  # where the tracker is read
from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.arguments import parse_args

import checkpoint_files
from driver_model import REQUIRED

pytestmark = pytest.mark.usefixtures("one_rank")

AS_ROOT = os.geteuid() == 0
needs_permissions = pytest.mark.skipif(AS_ROOT, reason="root reads and writes whatever the permissions say; "
                                       "the simulated tests below stand in")
NOT_A_NUMBER = ("not an iteration number: write the iteration of a saved checkpoint into it (e.g. 100 for "
                "iter_0000100) or point --load elsewhere")


def checkpoint_root(tmp_path, saved_args=None, iteration=4, tracker=None):
    """A --load directory with a complete checkpoint of ``iteration`` saved with ``saved_args``."""
    common = {"iteration": iteration, "args": {} if saved_args is None else saved_args}
    return checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration, common=common, tracker=tracker)


def denied(path):
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


# --- 1. the tracker is read a bounded number of bytes ---------------------------------------


def test_a_5000_digit_tracker_is_not_an_iteration(tmp_path, refused):
    root = checkpoint_root(tmp_path, tracker="7" * 5000)
    tracker = root / checkpointing.TRACKER
    expected = f"the checkpoint tracker {tracker} holds 5000 bytes, starting {'7' * 40!r}, {NOT_A_NUMBER}"
    assert refused([*REQUIRED, "--load", str(root)]) == expected
    with pytest.raises(checkpointing.CheckpointError) as exc:
        checkpointing.latest_iteration(str(root))
    assert str(exc.value) == expected


def test_a_6_gb_tracker_is_refused_from_its_first_bytes(tmp_path, monkeypatch, refused):
    """Sparse: 6 GiB of zero bytes that take no disk. Every read is counted and bounded; one
    that asks for the whole file fails the test before it reads anything."""
    root = checkpoint_root(tmp_path)
    tracker = root / checkpointing.TRACKER
    with open(tracker, "wb") as handle:
        handle.truncate(6 * 2**30)
    asked = []

    class Counted:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def fileno(self):
            return self.handle.fileno()

        def read(self, size=-1):
            asked.append(size)
            assert size is not None and 0 <= size <= checkpointing.TRACKER_READ_LIMIT + 1, "an unbounded read"
            return self.handle.read(size)

    def counted_open(path, *args, **kwargs):
        handle = builtins.open(path, *args, **kwargs)
        return Counted(handle) if os.path.basename(path) == checkpointing.TRACKER else handle

    monkeypatch.setattr(on_disk, "open", counted_open, raising=False)
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"the checkpoint tracker {tracker} holds {6 * 2**30} bytes, starting {chr(0) * 40!r}, {NOT_A_NUMBER}")
    assert asked and sum(asked) <= 2 * (checkpointing.TRACKER_READ_LIMIT + 1)


@pytest.mark.parametrize("text, iteration", [("4", 4), (" 4\n", 4), ("0000004", 4),
                                             ("4".rjust(checkpointing.TRACKER_READ_LIMIT), 4)])
def test_a_tracker_within_the_limit_still_names_its_iteration(tmp_path, text, iteration):
    root = checkpoint_root(tmp_path, tracker=text)
    assert checkpointing.latest_iteration(str(root)) == iteration
    assert checkpointing.find_checkpoint(str(root)) == (str(root / "iter_0000004"), None)


def test_a_tracker_one_byte_over_the_limit_is_refused(tmp_path):
    root = checkpoint_root(tmp_path, tracker="4".rjust(checkpointing.TRACKER_READ_LIMIT + 1))
    with pytest.raises(checkpointing.CheckpointError, match=f"holds {checkpointing.TRACKER_READ_LIMIT + 1} bytes"):
        checkpointing.latest_iteration(str(root))


# --- 2. folders and trackers this user cannot read ------------------------------------------


def unreadable_folder(root, folder):
    return (f"--load {root}: cannot read {folder}: Permission denied; give this user read and execute "
            "permission on it (chmod u+rx), or point --load elsewhere")


def unreadable_tracker(tracker):
    return (f"cannot read the checkpoint tracker {tracker}: Permission denied; give this user read access to "
            "it, or point --load elsewhere")


@pytest.fixture
def restore_modes():
    """chmod'ed paths get their modes back, so that pytest can remove tmp_path."""
    changed = []

    def chmod(path, mode):
        changed.append((path, os.stat(path).st_mode))
        os.chmod(path, mode)

    yield chmod
    for path, mode in reversed(changed):
        os.chmod(path, mode)


@needs_permissions
@pytest.mark.parametrize("mode", [0o000, 0o300, 0o600], ids=["no-access", "no-read", "no-execute"])
def test_a_load_directory_without_read_or_execute_permission(tmp_path, refused, restore_modes, mode):
    root = checkpoint_root(tmp_path)
    restore_modes(root, mode)
    assert refused([*REQUIRED, "--load", str(root)]) == unreadable_folder(root, root)


@needs_permissions
def test_an_unreadable_iteration_directory_and_tracker(tmp_path, refused, restore_modes):
    root = checkpoint_root(tmp_path)
    restore_modes(root / "iter_0000004", 0o300)
    assert refused([*REQUIRED, "--load", str(root)]) == unreadable_folder(root, root / "iter_0000004")
    restore_modes(root / checkpointing.TRACKER, 0o000)
    assert refused([*REQUIRED, "--load", str(root)]) == unreadable_tracker(root / checkpointing.TRACKER)


@needs_permissions
def test_a_load_directory_inside_one_this_user_cannot_enter(tmp_path, refused, restore_modes):
    root = checkpoint_root(tmp_path)
    restore_modes(tmp_path, 0o600)
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root}: cannot read it: Permission denied; give this user access to it and its parent "
        "directories, or point --load elsewhere")


def refuse_listing(monkeypatch, folder):
    listdir = os.listdir

    def refusing(path="."):
        if os.fspath(path) == str(folder):
            raise denied(path)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refusing)


def refuse_lookup(monkeypatch, folder):
    """What a directory without execute permission does: it lists, its entries cannot be looked up."""
    lstat = os.lstat

    def refusing(path, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(folder):
            raise denied(path)
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", refusing)


@pytest.mark.parametrize("refuse", [refuse_listing, refuse_lookup], ids=["no-read", "no-execute"])
@pytest.mark.parametrize("which", ["root", "iteration"])
def test_unreadable_folders_simulated(tmp_path, monkeypatch, refused, refuse, which):
    root = checkpoint_root(tmp_path)
    folder = root if which == "root" else root / "iter_0000004"
    refuse(monkeypatch, folder)
    assert refused([*REQUIRED, "--load", str(root)]) == unreadable_folder(root, folder)


def test_an_unreadable_tracker_simulated(tmp_path, monkeypatch, refused):
    root = checkpoint_root(tmp_path)
    tracker = root / checkpointing.TRACKER

    def refusing(path, *args, **kwargs):
        if os.fspath(path) == str(tracker):
            raise denied(path)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(on_disk, "open", refusing, raising=False)
    assert refused([*REQUIRED, "--load", str(root)]) == unreadable_tracker(tracker)


def test_a_load_directory_that_cannot_be_looked_up_simulated(tmp_path, monkeypatch, refused):
    root = checkpoint_root(tmp_path)
    stat = os.stat

    def refusing(path, *args, **kwargs):
        if os.fspath(path) == str(root):
            raise denied(path)
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", refusing)
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root}: cannot read it: Permission denied; give this user access to it and its parent "
        "directories, or point --load elsewhere")


def test_an_unreadable_older_iteration_does_not_break_the_resume_advice(tmp_path, monkeypatch, refused):
    """The advice for a tracker naming a missing iteration looks at every iteration there."""
    root = checkpoint_root(tmp_path, tracker="40")
    checkpoint_files.complete_iteration(root / "iter_0000002", {"iteration": 2, "args": {}})
    refuse_listing(monkeypatch, root / "iter_0000004")
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names iteration 40, but "
        f"{root / 'iter_0000040'} does not exist; write 2 into {checkpointing.TRACKER} to resume from "
        f"{root / 'iter_0000002'}, the newest complete checkpoint there, or point --load at another checkpoint")
    assert checkpointing.incomplete_reason(str(root / "iter_0000004")) == "it cannot be read: Permission denied"


# --- 3. --save where no directory can be made -----------------------------------------------


def test_a_dangling_save_symlink(tmp_path, refused):
    link, missing = tmp_path / "checkpoints", tmp_path / "gone" / "checkpoints"
    link.symlink_to(missing)
    assert refused([*REQUIRED, "--save", str(link)]) == (
        f"--save {link}: a symbolic link to {missing}, which does not exist: make that directory "
        f"(mkdir -p {missing}), or give another path")


def test_a_save_path_through_a_dangling_symlink(tmp_path, refused):
    (tmp_path / "runs").symlink_to("scratch/runs")  # relative: to tmp_path/scratch/runs
    save = tmp_path / "runs" / "run1"
    assert refused([*REQUIRED, "--save", str(save)]) == (
        f"--save {save}: inside {tmp_path / 'runs'}, a symbolic link to scratch/runs, which does not exist: "
        f"make that directory (mkdir -p {tmp_path / 'scratch' / 'runs'}), or give another path")


def test_a_save_symlink_to_a_directory_or_to_where_one_can_be_made_is_accepted(tmp_path, parsed):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert parsed([*REQUIRED, "--save", str(tmp_path / "link")]).save == str(tmp_path / "link")
    assert parsed([*REQUIRED, "--save", str(tmp_path / "link" / "new" / "run")]).save


def test_a_save_path_inside_a_file(tmp_path, refused):
    (tmp_path / "notes").write_text("")
    save = tmp_path / "notes" / "ckpt"
    assert refused([*REQUIRED, "--save", str(save)]) == (
        f"--save {save}: inside {tmp_path / 'notes'}, a file, not a directory: give a directory, or a path where "
        "one can be made")


def test_a_save_path_whose_parent_is_not_writable(tmp_path, monkeypatch, refused, restore_modes):
    parent = tmp_path / "read-only"
    parent.mkdir()
    if AS_ROOT:  # root writes anywhere: say the parent is read-only
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(parent)
                            else access(path, mode, **kw))
    else:
        restore_modes(parent, 0o500)
    save = parent / "ckpt"
    assert refused([*REQUIRED, "--save", str(save)]) == (
        f"--save {save}: {parent} is not writable: give a directory this user can write to")


# --- 4. the saved args against this run's model shape ---------------------------------------


def saved_by(argv):
    """The shape args a run of ``argv`` saves (the driver saves all of its args after check_args)."""
    args = vars(parse_args([*REQUIRED, *argv]))
    return {name: args[name] for name in (*checkpointing.MODEL_ARGS, "tokenizer_type")}


def refusal(root, differences):
    return (f"--load {root / 'iter_0000004'} was saved with {differences}: give the same model flags, or "
            "--use-checkpoint-args to take them from the checkpoint")


def test_a_checkpoint_of_another_width_is_refused_before_start_up(tmp_path, refused, parsed):
    root = checkpoint_root(tmp_path, saved_by([]))  # hidden 512
    assert refused([*REQUIRED, "--load", str(root), "--hidden-size", "256"]) == (
        refusal(root, "--hidden-size 512, this run has 256"))  # not the FFN size and head size it derives
    assert parsed([*REQUIRED, "--load", str(root)]).hidden_size == 512
    assert parsed([*REQUIRED, "--load", str(root), "--ffn-hidden-size", "2048", "--kv-channels", "64",
                   "--group-query-attention", "--num-query-groups", "8"]).hidden_size == 512  # the defaults, given


@pytest.mark.parametrize("saved_flags, run_flags, differences", [
    ([], ["--num-layers", "4"], "--num-layers 2, this run has 4"),
    ([], ["--ffn-hidden-size", "1024"], "--ffn-hidden-size 2048, this run has 1024"),
    (["--ffn-hidden-size", "1024"], [], "--ffn-hidden-size 1024, this run has 2048"),
    ([], ["--swiglu"], "--swiglu off, this run has on"),
    ([], ["--num-attention-heads", "4"], "--num-attention-heads 8, this run has 4"),
    ([], ["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 8, this run has 2"),
    ([], ["--kv-channels", "32"], "--kv-channels 64, this run has 32"),
    ([], ["--vocab-size", "50000"], "--vocab-size 32000, this run has 50000"),
    ([], ["--tokenizer-type", "NullTokenizer"], "--vocab-size 31999, this run has 32000"),  # as this run counts
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "49999"], ["--tokenizer-type", "NullTokenizer"],
     "--vocab-size 49999, this run has 32000"),
    (["--num-experts", "8", "--moe-ffn-hidden-size", "512"], [], "--num-experts 8, this run has none"),
    (["--num-experts", "8"], ["--num-experts", "16"], "--num-experts 8, this run has 16"),
    (["--num-experts", "8"], ["--num-experts", "8", "--moe-ffn-hidden-size", "512"],
     "--moe-ffn-hidden-size 2048, this run has 512"),
    (["--num-experts", "8", "--moe-shared-expert-intermediate-size", "1024"], ["--num-experts", "8"],
     "--moe-shared-expert-intermediate-size 1024, this run has none"),
    ([], ["--num-layers", "4", "--hidden-size", "256"], "--num-layers 2, this run has 4; --hidden-size 512, this "
     "run has 256"),
])
def test_each_shape_flag_is_compared(tmp_path, refused, saved_flags, run_flags, differences):
    root = checkpoint_root(tmp_path, saved_by(saved_flags))
    assert refused([*REQUIRED, "--load", str(root), *run_flags]) == refusal(root, differences)


@pytest.mark.parametrize("saved_flags, run_flags", [
    ([], ["--seq-length", "256", "--max-position-embeddings", "1024"]),  # sequences are no shape
    (["--tokenizer-type", "NullTokenizer"], ["--tokenizer-type", "NullTokenizer"]),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "31999"], []),  # 32000 ids either way
    (["--num-experts", "8", "--moe-ffn-hidden-size", "512"], ["--num-experts", "8", "--moe-ffn-hidden-size", "512"]),
    (["--swiglu"], ["--swiglu"]),
])
def test_the_same_shapes_load(tmp_path, parsed, saved_flags, run_flags):
    root = checkpoint_root(tmp_path, saved_by(saved_flags))
    assert parsed([*REQUIRED, "--load", str(root), *run_flags]).load == str(root)


def test_an_arg_the_checkpoint_did_not_save_is_not_compared(tmp_path, parsed):
    root = checkpoint_root(tmp_path, {"num_layers": 2})  # saved before the others existed
    assert parsed([*REQUIRED, "--load", str(root), "--hidden-size", "256"]).hidden_size == 256


def test_use_checkpoint_args_takes_the_saved_shapes(tmp_path, parsed):
    root = checkpoint_root(tmp_path, saved_by(["--num-experts", "8"]))
    args = parsed([*REQUIRED, "--load", str(root), "--hidden-size", "256", "--use-checkpoint-args"])
    assert (args.hidden_size, args.num_experts) == (512, 8)


def test_a_megatron_lm_checkpoint_of_another_shape(tmp_path, refused):
    saved = argparse.Namespace(num_layers=2, hidden_size=1024, num_attention_heads=8, add_bias_linear=True,
                               group_query_attention=False, num_query_groups=1, padded_vocab_size=32000,
                               ffn_hidden_size=4096, kv_channels=128, swiglu=False, num_experts=None)
    root = checkpoint_root(tmp_path, saved)
    assert refused([*REQUIRED, "--load", str(root)]) == refusal(root, "--hidden-size 1024, this run has 512")


# --- 4. restored args of the types their flags give -----------------------------------------


@pytest.mark.parametrize("name, value, shown, wanted", [
    ("hidden_size", "512", "--hidden-size '512' (type str)", "an int"),
    ("num_layers", 2.0, "--num-layers 2.0 (type float)", "an int"),
    ("num_experts", True, "--num-experts True (type bool)", "an int"),
    ("swiglu", 1, "--swiglu 1 (type int)", "on/off (a bool)"),
    ("normalization", "BatchNorm", "--normalization 'BatchNorm' (type str)", "one of LayerNorm, RMSNorm"),
    ("moe_mlp_glu_interleave_size", "8", "--moe-mlp-glu-interleave-size '8' (type str)", "an int"),
    ("moe_device_tokens_per_expert", "yes", "--moe-device-tokens-per-expert 'yes' (type str)", "on/off (a bool)"),
])
def test_use_checkpoint_args_refuses_a_saved_value_of_another_type(tmp_path, refused, name, value, shown, wanted):
    root = checkpoint_root(tmp_path, {**saved_by([]), name: value})
    assert refused([*REQUIRED, "--load", str(root), "--use-checkpoint-args"]) == (
        f"--load {root / 'iter_0000004'} was saved with {shown}, which is not {wanted}: its saved args are not "
        "ones pretrain_gpt.py reads; drop --use-checkpoint-args and give the model flags, or point --load at "
        "another checkpoint")


def test_a_saved_shape_of_another_type_is_refused_without_use_checkpoint_args(tmp_path, refused, parsed):
    root = checkpoint_root(tmp_path, {**saved_by([]), "hidden_size": "512"})
    assert refused([*REQUIRED, "--load", str(root)]) == (
        f"--load {root / 'iter_0000004'} was saved with --hidden-size '512' (type str), which is not an int: its "
        "saved args are not ones pretrain_gpt.py reads; point --load at another checkpoint")
    # An arg no shape depends on is not this run's concern without --use-checkpoint-args.
    root = checkpoint_root(tmp_path / "other", {**saved_by([]), "moe_mlp_glu_interleave_size": "8"})
    assert parsed([*REQUIRED, "--load", str(root)]).moe_mlp_glu_interleave_size is None


@pytest.mark.parametrize("value, shown", [
    ([512] * 100_000, "of type list"),
    (2**100, "of type int"),  # beyond 64 bits: not written out (str() of a 5000-digit int raises)
    ("5" * 10_000, f"'{'5' * 60}... (10000 characters)' (type str)"),
], ids=["list", "100-bit-int", "long-str"])
def test_a_long_saved_value_is_named_by_its_type_or_shortened(tmp_path, refused, value, shown):
    root = checkpoint_root(tmp_path, {**saved_by([]), "swiglu": value})
    assert refused([*REQUIRED, "--load", str(root), "--use-checkpoint-args"]).startswith(
        f"--load {root / 'iter_0000004'} was saved with --swiglu {shown}, which is not on/off (a bool): ")
