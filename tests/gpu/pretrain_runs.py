"""What the checkpoint GPU tests share: tiny-recipe pretrain_gpt.py runs of each expert
layout, run side by side, and the checkpoints' tensors compared entry by entry."""

import contextvars
import heapq
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver.builtin_recipes import recipe_path
from megatron.moe_patches.driver.functional import free_port

ROOT = Path(__file__).resolve().parents[2]


class RunsFolder:
    """A test module's runs' folder, made when its first run needs it (background runs start
    before any fixture does), so that importing the module makes nothing; removed at the
    module's end by the fixture ``removed_after_module()`` makes."""

    def __init__(self, prefix: str):
        self.prefix, self._path, self._lock = prefix, None, threading.Lock()

    def path(self) -> Path:
        with self._lock:
            if self._path is None:
                self._path = Path(tempfile.mkdtemp(prefix=self.prefix))
            return self._path

    def remove(self) -> None:
        with self._lock:
            if self._path is not None:
                shutil.rmtree(self._path, ignore_errors=True)
                self._path = None

    def removed_after_module(self):
        """An autouse module fixture (bind it to a module-level name) that removes the folder
        after the module's last test; each test waits for its own runs."""

        @pytest.fixture(scope="module", autouse=True)
        def remove_runs_folder():
            yield
            self.remove()

        return remove_runs_folder


BASE = ["--yaml-cfg", "tiny-moe-stock", "--lr-decay-iters", "100", "--deterministic-mode",
        "--dist-ckpt-optim-fully-reshardable", "--log-interval", "1"]
STEPS = 4
LAYOUTS = {
    "te": [],  # TE grouped experts, indexed weight0..N-1 (stock layout)
    "indexed": ["--moe-device-tokens-per-expert"],  # grouped_mm compute, indexed parameters
    "grouped": ["--moe-device-tokens-per-expert", "--moe-single-grouped-weight"],  # one [E, out, in]
    # ... and at EP > 1 tokens exchanged through symmetric memory (F12; EP 1 has nothing to exchange)
    "exchange": ["--moe-device-tokens-per-expert", "--moe-single-grouped-weight", "--moe-symmetric-exchange"],
    "op_fuser": ["--use-transformer-engine-op-fuser"],
    "interleave": ["--use-transformer-engine-op-fuser", "--moe-mlp-glu-interleave-size", "32"],
    "sequential": [],  # SequentialMLP: the tiny recipe without --moe-grouped-gemm (see recipe_for)
    # stock TE experts with biases (see recipe_for); TEGroupedMLP takes biases without bias-dropout fusion only
    "te_bias": ["--no-bias-dropout-fusion"],
    "grouped_bias": ["--moe-device-tokens-per-expert", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
                     "--no-bias-dropout-fusion"],
}
# Recipe lines a layout drops: store_true flags of the tiny recipe it must not have.
DROPPED_RECIPE_LINES = {"sequential": "moe-grouped-gemm:", "te_bias": "disable-bias-linear:",
                        "grouped_bias": "disable-bias-linear:"}
LOSS_RTOL = 0.02  # other kernels (bf16 rounding) one step after a bitwise-equal state


def recipe_for(layout, workdir):
    """The tiny recipe, without the line DROPPED_RECIPE_LINES names for ``layout``."""
    if layout not in DROPPED_RECIPE_LINES:
        return []
    text = Path(recipe_path("tiny-moe-stock")).read_text()
    recipe = Path(workdir) / f"tiny-moe-{layout}.yaml"
    dropped = DROPPED_RECIPE_LINES[layout]
    recipe.write_text("\n".join(l for l in text.splitlines() if not l.startswith(dropped)) + "\n")
    return ["--yaml-cfg", str(recipe)]


def pretrain(layout, iters, save, load=None, launcher=("python",), extra=(), expect_failure=False, env=None):
    """One pretrain_gpt.py run of ``layout``; its logged losses by iteration. ``env``: variables
    set for the run on top of this process's (e.g. a PYTHONPATH with another megatron-core)."""
    cmd = [*launcher, "pretrain_gpt.py", *BASE, *LAYOUTS[layout], *recipe_for(layout, Path(save).parent),
           "--train-iters", str(iters), "--save", str(save), *extra]
    if launcher == ("python",):
        cmd[0] = sys.executable
    else:
        cmd[3:3] = ["--master-port", str(free_port())]
    if load:
        cmd += ["--load", str(load)]
    env = dict(os.environ, **(env or {}), MASTER_PORT=str(free_port()))  # this process holds its own port
    with process_slot:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    if expect_failure:
        assert run.returncode != 0, run.stdout[-2000:]
        return run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    losses = {int(m.group(1)): float(m.group(2))
              for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", run.stdout)}
    return losses


def flatten(tree, prefix=""):
    """Nested dicts/lists of tensors -> {dotted path: tensor}."""
    if isinstance(tree, (dict, list, tuple)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return {k: v for key, sub in items for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def tensors(ckpt_root, iteration=STEPS):
    from megatron.core import dist_checkpointing

    from megatron.moe_patches.driver import checkpointing, compat

    path = str(Path(ckpt_root) / f"iter_{iteration:07d}")
    if not os.path.isfile(os.path.join(path, "common.pt")) and compat.load_takes_common_strategy():
        # Saved by megatron-core 0.19.2, which keeps the common state inside the torch_dist
        # files: megatron-core 0.16.1 reads it through the driver's strategy.
        return flatten(dist_checkpointing.load(dist_checkpointing.load_tensors_metadata(path), path,
                                               validate_access_integrity=False,
                                               common_strategy=checkpointing._common_state_strategy()))
    return flatten(dist_checkpointing.load_plain_tensors(path))


def differences(a, b, tensors_only=False):
    """Checkpoint entries that differ; each run's own args and expert parameter layout (common
    state: F7 records the layout beside the optimizer's states) are not compared.
    ``tensors_only``: also skip the plain values, whose nesting follows the optimizer chain."""
    from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_KEY

    def compared(entries):
        return {k: v for k, v in entries.items() if not k.startswith("args.") and LAYOUT_KEY not in k.split(".")
                and (torch.is_tensor(v) or not tensors_only)}

    a, b = compared(a), compared(b)
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())[:6]}"]
    return [k for k in a if not (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k])]


# The runs are pretrain_gpt.py processes of a tiny model, which leaves most of a GPU idle:
# independent runs go side by side, at most this many processes at a time.
PARALLEL = int(os.environ.get("MOE_PATCHES_GPU_PARALLEL", "6"))
# A run's rank: the order in which the request that started its chain came (tests ask in
# pytest's order when collection ends); None on a test's own thread, which waits on it now.
_rank = contextvars.ContextVar("run_rank", default=None)
_ranks = itertools.count()


class OrderedSlots:
    """At most ``size`` run processes at a time; a freed slot goes to the waiting run of the
    lowest rank (a test's own thread first). Results then come in the order pytest reports
    them: the second run of a chain does not queue behind every later test's first run, which
    left the first test waiting for the whole suite's runs before it printed anything."""

    def __init__(self, size):
        self._free, self._waiting, self._changed = size, [], threading.Condition()
        self._tickets = itertools.count()

    def __enter__(self):
        rank = _rank.get()
        me = (-1 if rank is None else rank, next(self._tickets))
        with self._changed:
            heapq.heappush(self._waiting, me)
            self._changed.wait_for(lambda: self._free > 0 and self._waiting[0] == me)
            heapq.heappop(self._waiting)
            self._free -= 1
            self._changed.notify_all()  # the next in line may take another free slot

    def __exit__(self, *exc_info):
        with self._changed:
            self._free += 1
            self._changed.notify_all()


process_slot = OrderedSlots(PARALLEL)  # held while a run's process lives
_threads = ThreadPoolExecutor(64)  # threads that wait on runs cost nothing: the slots cap the work


def later(function, *args):
    """Start ``function(*args)`` in a thread now; its Future. Chains of runs (A, then B from A)
    go this way: a waiting thread holds no process slot, and the chain keeps the rank of the
    request that started it."""
    context = contextvars.copy_context()
    if context.get(_rank) is None:
        context.run(_rank.set, next(_ranks))
    return _threads.submit(context.run, function, *args)


_once, _once_lock = {}, threading.Lock()


def later_once(function, *args):
    """``later(function, *args)``, started at most once per session for the same function and
    arguments, whichever test asks first: the Future every asker shares (an eager run several
    tests compare with, a checkpoint several round trips start from)."""
    with _once_lock:
        if (function, args) not in _once:
            _once[function, args] = later(function, *args)
        return _once[function, args]


def side_by_side(jobs):
    """{key: (function, *args)} run concurrently -> {key: Future} (all finished)."""
    futures = {key: later(*job) for key, job in jobs.items()}
    for future in futures.values():
        future.exception()  # wait, whatever the outcome
    return futures
