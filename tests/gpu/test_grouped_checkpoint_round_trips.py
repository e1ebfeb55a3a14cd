"""Issue #5 on the GPU: torch_dist checkpoints with the distributed optimizer (fully_reshardable
states) survive expert layout changes. For each layout pair X -> Y: train X, save A; load A as
Y and save B at once; load B as X and save C. A, B and C must hold bitwise-equal tensors
(parameters, fp32 main params, exp_avg, exp_avg_sq), and one more step from A must give the
same loss as X and as Y (X's step STEPS + 1 comes from its uninterrupted run: the
ckpt-resume functional case shows resuming is exact)."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver.functional import free_port
from pretrain_runs import (  # tests/gpu is on sys.path (conftest.py)
    BASE,
    LAYOUTS,
    LOSS_RTOL,
    ROOT,
    RunsFolder,
    STEPS,
    differences,
    later,
    later_once,
    pretrain,
    process_slot,
    tensors,
)

# (X, Y, next-step losses bitwise equal): equal where both layouts run the same kernels.
PAIRS = [("indexed", "grouped", True), ("te", "grouped", False), ("te", "op_fuser", False),
         ("op_fuser", "interleave", False), ("grouped", "sequential", False), ("te_bias", "grouped_bias", False)]
RUNS = RunsFolder("checkpoint-round-trips-")
work_dir = RUNS.path
remove_work_dir = RUNS.removed_after_module()


def train_a(layout):
    root = work_dir() / f"A-{layout}"
    losses = pretrain(layout, STEPS + 1, root, extra=["--save-interval", str(STEPS)])
    (root / "latest_checkpointed_iteration.txt").write_text(str(STEPS))  # resume from STEPS
    return root, losses[STEPS + 1]


def trained(layout):
    """Future of (checkpoint A of ``layout`` at STEPS, the loss of its step STEPS + 1), trained
    once whichever test asks first."""
    return later_once(train_a, layout)


def round_trip(x, y):
    """B = A loaded as y and saved at once, D = y's next step from A (beside B), then C = B
    loaded back as x. Its directories and the two next-step losses."""
    a_root, x_next = trained(x).result()
    root = work_dir() / f"{x}-{y}"
    root.mkdir()  # recipe_for writes a layout's recipe beside its runs
    d = later(pretrain, y, STEPS + 1, root / "D", a_root)
    pretrain(y, STEPS, root / "B", a_root)
    pretrain(x, STEPS, root / "C", root / "B")
    return {"a": a_root, "b": root / "B", "c": root / "C", "x_next": x_next, "y_next": d.result()[STEPS + 1]}


@pytest.mark.parametrize("x, y, same_kernels", PAIRS)
def test_layout_round_trip_keeps_every_tensor(single_gpu, background, x, y, same_kernels):
    runs = background
    x_next, y_next = runs["x_next"], runs["y_next"]
    a, b, c = tensors(runs["a"]), tensors(runs["b"]), tensors(runs["c"])
    optimizer_keys = [k for k in a if k.startswith("optimizer.state.")]
    expert_keys = [k for k in optimizer_keys if ".experts." in k]
    print(json.dumps({"pair": [x, y], "tensors": len(a), "optimizer_state_tensors": len(optimizer_keys),
                      "expert_optimizer_tensors": len(expert_keys), "a_vs_b": differences(a, b)[:4],
                      "a_vs_c": differences(a, c)[:4], "next_loss": [x_next, y_next]}))
    assert expert_keys, "no expert optimizer states in the checkpoint"
    assert {"exp_avg", "exp_avg_sq", "param"} <= {k.split(".")[2] for k in expert_keys}
    assert differences(a, b) == [] and differences(a, c) == []
    if same_kernels:
        assert y_next == x_next
    else:
        assert abs(y_next - x_next) <= LOSS_RTOL * abs(x_next)


# megatron-core stacks the layers: one key per expert FC, shape [layers, experts, out, in]
def one_rank_worker(worker, tmp_path, worker_args, layout_args):
    """Run ``tests/gpu/<worker> OUT <worker_args> -- <pretrain args>`` as one rank; its JSON."""
    out = tmp_path / f"{Path(worker).stem}.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / worker), str(out), *map(str, worker_args), "--",
           *BASE, *layout_args]
    with process_slot:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, MASTER_PORT=str(free_port())))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


FC1, FC2 = (f"decoder.layers.mlp.experts.experts.linear_fc{i}.weight" for i in (1, 2))


def damaged_copy(a_root, dest, damage):
    """Copy checkpoint A, then damage its DCP metadata: drop layer 0 expert 3's first chunk of FC1
    ("missing_expert") or widen FC2 by one column ("mis_shaped"). Returns the text the
    refusal must contain: the key, and for a missing chunk its offset."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(a_root, dest)
    path = dest / f"iter_{STEPS:07d}"
    metadata = FileSystemReader(str(path)).read_metadata()
    entries = metadata.state_dict_metadata
    key = FC1 if damage == "missing_expert" else FC2
    assert key in entries, sorted(k for k in entries if ".experts." in k and "_extra_state" not in k)
    if damage == "missing_expert":
        chunks = entries[key].chunks
        dropped = min((c for c in chunks if tuple(c.offsets[:2]) == (0, 3)), key=lambda c: tuple(c.offsets))
        entries[key].chunks = [c for c in chunks if c is not dropped]  # SwiGLU FC1: its gate half
        expected = f"{key}: the region at offset {tuple(dropped.offsets)}"
    else:
        entries[key].size = torch.Size([*entries[key].size[:-1], entries[key].size[-1] + 1])
        expected = f"{key}: shape {tuple(entries[key].size)} in the checkpoint"
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return expected


def damaged_loads(layout):
    """Checkpoint A of ``layout`` loaded intact, damaged two ways, and at its later save, in
    one worker process: (the texts the refusals must contain, the worker's outcomes)."""
    a_root, _ = trained(layout).result()
    work = work_dir() / f"damaged-{layout}"
    work.mkdir()
    missing, mis_shaped = work / "missing_expert", work / "mis_shaped"
    expected = [damaged_copy(a_root, missing, "missing_expert"), damaged_copy(a_root, mis_shaped, "mis_shaped")]
    later_save = work / "A-next"  # A's own root, pointing at its last save (step STEPS + 1)
    shutil.copytree(a_root, later_save)
    (later_save / "latest_checkpointed_iteration.txt").write_text(str(STEPS + 1))
    # A first (real Adam states to compare); the later save last: a load that succeeds changes
    # the model, so "unchanged" after a refused one means something
    outcomes = one_rank_worker("damaged_checkpoint_worker.py", work, [a_root, missing, mis_shaped, later_save],
                               [*LAYOUTS[layout], "--train-iters", str(STEPS)])
    return expected, outcomes


@pytest.mark.parametrize("layout", ["te", "grouped"])
def test_damaged_checkpoint_is_refused_and_loads_nothing(single_gpu, background, layout):
    expected, outcomes = background
    print(json.dumps({"layout": layout, "outcomes": outcomes}))
    intact, missing_outcome, mis_shaped_outcome, intact_later = outcomes
    assert intact["error"] is None and intact_later["error"] is None
    assert missing_outcome["error"] and expected[0] in missing_outcome["error"]
    assert mis_shaped_outcome["error"] and expected[1] in mis_shaped_outcome["error"]
    assert missing_outcome["unchanged"] and mis_shaped_outcome["unchanged"]
    assert not intact_later["unchanged"]


def main_params_run(layout):
    return one_rank_worker("main_params_worker.py", Path(tempfile.mkdtemp(prefix=f"main-params-{layout}-",
                                                                          dir=work_dir())), [],
                           [*LAYOUTS[layout], "--train-iters", "1"])


# Started when collection ends (tests/conftest.py); the chains of runs return their Futures
# at once (their threads are this module's own, not the shared pool's).
BACKGROUND = {
    "test_layout_round_trip_keeps_every_tensor": (("x", "y"), lambda pair: later(round_trip, *pair)),
    "test_damaged_checkpoint_is_refused_and_loads_nothing": ("layout", lambda layout: later(damaged_loads, layout)),
    "test_main_params_load_from_a_state_dict_in_the_other_layout": ("layout", main_params_run),
}


@pytest.mark.parametrize("layout", ["te", pytest.param("grouped", marks=pytest.mark.quick)])
def test_main_params_load_from_a_state_dict_in_the_other_layout(layout, background):
    """reload_model_params(state_dict) (--load-main-params-from-ckpt): fp32 main params of
    indexed experts from a grouped state dict and the reverse, bitwise."""
    result = background
    print(json.dumps({"layout": layout, **result}))
    assert result["grouped_model"] == (layout == "grouped")
    assert result["expert_params"] > 0 and result["mismatched"] == []
    assert result["stock_map"]  # megatron-core's substring map cannot do it


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP=2 needs 2 GPUs")
@pytest.mark.parametrize("layout", ["te", "grouped", "exchange"])
def test_ep1_ep2_ep1_round_trip(single_gpu, tmp_path, layout):
    torchrun = ("torchrun", "--nproc-per-node", "2")
    ep2 = ["--expert-model-parallel-size", "2"]
    x_next = pretrain(layout, STEPS + 1, tmp_path / "A", launcher=torchrun,  # DP=2, EP=1
                      extra=["--save-interval", str(STEPS)])[STEPS + 1]
    (tmp_path / "A" / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    y_next = pretrain(layout, STEPS + 1, tmp_path / "D", load=tmp_path / "A", launcher=torchrun, extra=ep2)[STEPS + 1]
    pretrain(layout, STEPS, tmp_path / "B", load=tmp_path / "A", launcher=torchrun, extra=ep2)
    pretrain(layout, STEPS, tmp_path / "C", load=tmp_path / "B", launcher=torchrun)
    a, b, c = tensors(tmp_path / "A"), tensors(tmp_path / "B"), tensors(tmp_path / "C")
    steps = [sorted({v for k, v in t.items() if k.endswith(".step")}) for t in (a, b, c)]
    print(json.dumps({"layout": layout, "tensors": len(a), "a_vs_b": differences(a, b, tensors_only=True)[:4],
                      "a_vs_c": differences(a, c)[:4], "optimizer_steps": steps, "next_loss": [x_next, y_next]}))
    # EP=2 chains a dense and an expert optimizer: its plain state nests differently, same values
    assert differences(a, b, tensors_only=True) == [] and differences(a, c) == []
    assert steps[0] == steps[1] == steps[2] != []  # Adam bias correction continues
    assert abs(y_next - x_next) <= LOSS_RTOL * abs(x_next)  # EP=2 reduces in another order
    # Expert 3 lives on EP rank 0 only: rank 1 must refuse too (or it would wait in the load forever).
    expected = damaged_copy(tmp_path / "B", tmp_path / "B-damaged", "missing_expert")
    log = pretrain(layout, STEPS, tmp_path / "E", load=tmp_path / "B-damaged", launcher=torchrun, extra=ep2,
                   expect_failure=True)
    assert log.count(expected) >= 2, log[-3000:]  # named on both ranks


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="EP=4 needs 4 GPUs")
def test_ep1_ep4_ep1_round_trip_through_the_exchange(single_gpu, tmp_path):
    """The exchange layout saved at EP=1 (DP=4) resumes at EP=4 (two experts per rank) and
    back, every tensor bitwise; the next step's loss at EP=4 follows EP=1's (4 sequences per
    micro-batch, so that DP=4 divides the tiny recipe's global batch)."""
    torchrun = ("torchrun", "--nproc-per-node", "4")
    batch = ["--micro-batch-size", "4"]
    ep4 = [*batch, "--expert-model-parallel-size", "4"]
    x_next = pretrain("exchange", STEPS + 1, tmp_path / "A", launcher=torchrun,
                      extra=[*batch, "--save-interval", str(STEPS)])[STEPS + 1]
    (tmp_path / "A" / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    y_next = pretrain("exchange", STEPS + 1, tmp_path / "D", load=tmp_path / "A", launcher=torchrun,
                      extra=ep4)[STEPS + 1]
    pretrain("exchange", STEPS, tmp_path / "B", load=tmp_path / "A", launcher=torchrun, extra=ep4)
    pretrain("exchange", STEPS, tmp_path / "C", load=tmp_path / "B", launcher=torchrun, extra=batch)
    a, b, c = tensors(tmp_path / "A"), tensors(tmp_path / "B"), tensors(tmp_path / "C")
    print(json.dumps({"tensors": len(a), "a_vs_b": differences(a, b, tensors_only=True)[:4],
                      "a_vs_c": differences(a, c)[:4], "next_loss": [x_next, y_next]}))
    assert differences(a, b, tensors_only=True) == [] and differences(a, c) == []
    assert abs(y_next - x_next) <= LOSS_RTOL * abs(x_next)
