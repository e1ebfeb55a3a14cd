"""checkpointing.save is crash-safe: a save killed (SIGKILL) at any point never leaves a
checkpoint that --load takes as complete; --load resumes from the last complete one, and the
next save of that iteration completes over what the killed one left.

The saves run in child processes (crash_save_child.py: megatron-core's real torch_dist save on
CPU, of a small stand-in state), killed at each point of tests/save_kill_points.py. In each
case the child saves iteration 2 (value 20), then is killed during its save of iteration 4,
or (``swap``) during a re-save of iteration 2 over it.
"""

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.moe_patches.driver import checkpointing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: save_kill_points
import save_kill_points  # noqa: E402

from crash_save_child import MODEL_KEY, OPTIMIZER_KEY, WIDTH  # noqa: E402

KILLED_ITERATION = {point: 2 if point == "swap" else 4 for point in save_kill_points.POINTS}


def child(tmp_path, args, rank=0, world=1, store=None):
    """Start crash_save_child.py in a session of its own (a kill takes its process group)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), STORE=str(store or tmp_path / "store"))
    return subprocess.Popen([sys.executable, str(HERE / "crash_save_child.py"), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finished(process):
    output, _ = process.communicate(timeout=300)
    return process.returncode, output[-3000:]


def saved(path, world=1):
    """(the common state's iteration and value, the model and optimizer tensors) at ``path``."""
    tensors = {MODEL_KEY: torch.zeros(world, WIDTH), OPTIMIZER_KEY: torch.zeros(world, WIDTH)}
    dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    common = checkpointing.read_common_state(str(path))
    return (common["iteration"], common["value"]), tensors


def rows(value, world=1):
    model = torch.stack([torch.full((WIDTH,), float(value + rank)) for rank in range(world)])
    return {MODEL_KEY: model, OPTIMIZER_KEY: -model}


def holds(path, iteration, value, world=1):
    return matches(saved(path, world), iteration, value, world)


def matches(contents, iteration, value, world=1):
    """Whether ``contents`` (``saved``'s) are those of the save of ``iteration`` with ``value``."""
    (at, saved_value), tensors = contents
    expected = rows(value, world)
    return (at, saved_value) == (iteration, value) and all(torch.equal(tensors[k], expected[k]) for k in expected)


def state_of(root, run):
    """What a killed save left under ``root``, and the killed child's (exit status, output)."""
    names = sorted(os.listdir(root))
    try:
        found = checkpointing.find_checkpoint(str(root))[0]
    except checkpointing.CheckpointError as err:  # what --load would say
        found = str(err)
    return {
        "run": run,
        "tracker": (root / checkpointing.TRACKER).read_text(),
        "found": found,
        "found holds": saved(found) if found and os.path.isdir(found) else None,
        "listing": names,
        "incomplete": {n: checkpointing.incomplete_reason(str(root / n))
                       for n in names if checkpointing.SAVED_ITERATION.fullmatch(n)},
    }


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Every point: a child saves iteration 2 (value 20), then is killed at the point of its
    next save (value 41); then one child makes the next save of each killed iteration (value
    42). ({point: ``state_of`` after the kill}, the next saves' (exit status, output), {point: root})."""
    work = tmp_path_factory.mktemp("crash-safe-save")
    roots = {point: work / point for point in save_kill_points.POINTS}

    def kill_at(point):
        root = roots[point]
        run = finished(child(work, ["--kill", point, root, 2, 20, root, KILLED_ITERATION[point], 41],
                             store=work / f"store-{point}"))
        return state_of(root, run)

    with ThreadPoolExecutor(len(roots)) as pool:
        after_kill = dict(zip(roots, pool.map(kill_at, roots)))
    next_saves = [a for point, root in roots.items() for a in (root, KILLED_ITERATION[point], 42)]
    return after_kill, finished(child(work, next_saves, store=work / "store-next")), roots


@pytest.mark.parametrize("point", save_kill_points.POINTS)
def test_a_killed_save_leaves_the_last_complete_checkpoint_named(killed, point):
    after_kill, _, roots = killed
    state = after_kill[point]
    status, output = state["run"]
    assert status == -signal.SIGKILL, output  # the point was reached
    assert state["tracker"] == "2"
    # Every directory with an iteration's name is complete; the unfinished save has another name.
    assert all(reason is None for reason in state["incomplete"].values()), state
    expected = roots[point] / ("iter_0000002.replaced" if point == "swap" else "iter_0000002")
    assert state["found"] == str(expected) and matches(state["found holds"], 2, 20)


@pytest.mark.parametrize("point", save_kill_points.POINTS)
def test_the_next_save_of_that_iteration_completes_over_the_leftovers(killed, point):
    _, (status, output), roots = killed
    assert status == 0, output
    iteration = KILLED_ITERATION[point]
    root = roots[point]
    assert (root / checkpointing.TRACKER).read_text() == str(iteration)
    assert checkpointing.find_checkpoint(str(root)) == (str(checkpointing.iteration_dir(str(root), iteration)), None)
    assert holds(checkpointing.iteration_dir(str(root), iteration), iteration, 42)
    assert [name for name in os.listdir(root) if name.endswith((".incomplete", ".replaced"))] == []


def test_two_ranks_write_one_checkpoint_that_rank_0_names(tmp_path):
    """Both ranks write into the same staging directory; rank 0 names it once both are done."""
    root = tmp_path / "ckpt"
    ranks = [child(tmp_path, [root, 2, 20, root, 4, 40], rank=rank, world=2) for rank in (0, 1)]
    for status, output in map(finished, ranks):
        assert status == 0, output
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", checkpointing.TRACKER]
    assert (root / checkpointing.TRACKER).read_text() == "4"
    assert holds(root / "iter_0000004", 4, 40, world=2) and holds(root / "iter_0000002", 2, 20, world=2)


# --- the steps of the protocol, in process ----------------------------------------------------


def test_the_tracker_is_replaced_by_a_flushed_copy_never_written_in_place(tmp_path, monkeypatch):
    (tmp_path / checkpointing.TRACKER).write_text("2")
    tracker, events = str(tmp_path / checkpointing.TRACKER), []
    real_open, real_fsync, real_replace = open, os.fsync, os.replace

    def recording_open(file, mode="r", *args, **kwargs):
        events.append(("open", str(file), mode))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", recording_open)
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a), str(b))) or real_replace(a, b))
    checkpointing._write_tracker(str(tmp_path), 4)
    assert [e for e in events if e[0] == "open" and e[1] == tracker] == []  # never opened in place
    written = [e[1] for e in events if e[0] == "open" and "w" in e[2]]
    assert len(written) == 1 and events.index(("fsync", written[0])) < events.index(("replace", written[0], tracker))
    assert events[-1] == ("fsync", str(tmp_path))  # the rename itself reaches the disk
    assert (tmp_path / checkpointing.TRACKER).read_text() == "4" and os.listdir(tmp_path) == [checkpointing.TRACKER]


def test_every_file_reaches_the_disk_before_the_iteration_is_named(tmp_path, monkeypatch):
    """Flushed, then renamed, then the rename flushed (before the tracker may name it)."""
    path = checkpointing.iteration_dir(str(tmp_path), 4)
    staging = path + checkpointing.INCOMPLETE
    files = checkpoint_files_in(staging)
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", str(a), str(b))) or real_rename(a, b))
    checkpointing._publish(str(tmp_path), staging, path)
    renamed = events.index(("rename", staging, path))
    assert {("fsync", name) for name in [*files, staging]} <= set(events[:renamed])
    assert ("fsync", str(tmp_path)) in events[renamed:]
    assert sorted(os.listdir(path)) == sorted(os.path.basename(name) for name in files)


def checkpoint_files_in(staging):
    """A staging directory with megatron-core's files (contents do not matter here)."""
    os.makedirs(staging)
    names = ["common.pt", "__0_0.distcp", "__0_1.distcp", ".metadata", "metadata.json"]
    for name in names:
        Path(staging, name).write_bytes(b"x")
    return [os.path.join(staging, name) for name in names]
