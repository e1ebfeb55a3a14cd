"""Crash-safe saves on real runs: pretrain_gpt.py (the tiny MoE recipe, --deterministic-mode)
saving every EVERY iterations is killed with SIGKILL during its save of iteration KILLED, at
each point (the model's tensors, the optimizer's, the common state, the tracker;
crash_save_worker.py). The directory then names iteration KILLED - EVERY, complete; resumed
with --load, the run continues from there and its losses equal an uninterrupted run's from
that iteration on, and its own save of KILLED completes over what the killed save left."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.functional import free_port
from pretrain_runs import BASE, ROOT, RunsFolder, later, later_once, pretrain, process_slot  # tests/gpu is on sys.path (conftest.py)

STEPS, EVERY, KILLED = 8, 2, 6
RESUMED = KILLED - EVERY  # the last checkpoint the killed run completed
POINTS = ["model", "optimizer", "common", "tracker"]
SAVES = ("--save-interval", str(EVERY))
RUNS = RunsFolder("crash-safe-save-")
work_dir = RUNS.path
remove_work_dir = RUNS.removed_after_module()


def uninterrupted():
    """Future of the losses of the run nothing kills, run once whichever test asks first."""
    return later_once(pretrain, "te", STEPS, work_dir() / "uninterrupted", None, ("python",), SAVES)


def killed_run(point, root):
    """pretrain_gpt.py saving into ``root``, killed at ``point`` of its save of KILLED."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "crash_save_worker.py"), point, str(KILLED), "--",
           *BASE, "--train-iters", str(STEPS), "--save", str(root), *SAVES]
    with process_slot:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, start_new_session=True,
                              env=dict(os.environ, MASTER_PORT=str(free_port())))


def iteration_dirs(root):
    """{name: why it is not a complete checkpoint, or None} for every iter_NNNNNNN directory."""
    return {name: checkpointing.incomplete_reason(str(root / name)) for name in sorted(os.listdir(root))
            if checkpointing.SAVED_ITERATION.fullmatch(name)}


def kill_and_resume(point):
    """The killed run, what it left, and the resumed run's losses and what that left."""
    root = work_dir() / point
    run = killed_run(point, root)
    after_kill = {"tracker": (root / checkpointing.TRACKER).read_text(), "listing": sorted(os.listdir(root)),
                  "iterations": iteration_dirs(root), "found": checkpointing.find_checkpoint(str(root))[0]}
    resumed = pretrain("te", STEPS, root, load=root, extra=SAVES)
    after_resume = {"tracker": (root / checkpointing.TRACKER).read_text(), "listing": sorted(os.listdir(root)),
                    "iterations": iteration_dirs(root)}
    return {"status": run.returncode, "log": run.stdout[-3000:] + run.stderr[-3000:], "after_kill": after_kill,
            "resumed": resumed, "after_resume": after_resume, "uninterrupted": uninterrupted().result()}


BACKGROUND = {
    "test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint": (
        "point", lambda point: later(kill_and_resume, point)),
}


@pytest.mark.parametrize("point", [pytest.param("model", marks=pytest.mark.quick), *POINTS[1:]])
def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(background, point):
    runs = background
    after_kill, after_resume = runs["after_kill"], runs["after_resume"]
    print(json.dumps({"point": point, "after_kill": after_kill, "after_resume": after_resume,
                      "resumed": runs["resumed"]}))
    assert runs["status"] == -signal.SIGKILL, runs["log"]  # killed at the point, not ended otherwise
    assert after_kill["tracker"] == str(RESUMED)
    assert after_kill["found"] == str(checkpointing.iteration_dir(str(work_dir() / point), RESUMED))
    # Nothing with an iteration's name is incomplete; before the tracker, iteration KILLED has none.
    assert all(reason is None for reason in after_kill["iterations"].values()), after_kill
    saved_before = [f"iter_{i:07d}" for i in range(EVERY, KILLED + (point == "tracker"), EVERY)]
    assert list(after_kill["iterations"]) == saved_before, after_kill
    # Resumed from RESUMED: the same losses as the run nothing killed, from there on.
    assert sorted(runs["resumed"]) == list(range(RESUMED + 1, STEPS + 1))
    assert runs["resumed"] == {i: loss for i, loss in runs["uninterrupted"].items() if i > RESUMED}
    # Its saves (KILLED among them) completed over the leftovers, and removed them.
    assert after_resume["tracker"] == str(STEPS)
    assert list(after_resume["iterations"]) == [f"iter_{i:07d}" for i in range(EVERY, STEPS + 1, EVERY)]
    assert all(reason is None for reason in after_resume["iterations"].values()), after_resume
    assert not [name for name in after_resume["listing"] if name.endswith((".incomplete", ".replaced"))]
