"""One rank of a CPU process group running the driver's ``checkpointing.save`` with megatron-core's
real torch_dist save, of a small stand-in state: each rank's row of a (world size, WIDTH)
"model" tensor holds VALUE + rank, the matching "optimizer" tensor its negation, and the
common state the iteration and VALUE. Saves one checkpoint per ROOT ITERATION VALUE triple,
in order; with ``--kill POINT`` (tests/save_kill_points.py) the last save is killed at that
point.

    python crash_save_child.py [--kill POINT] ROOT ITERATION VALUE [ROOT ITERATION VALUE ...]

The process group comes from RANK, WORLD_SIZE (default 0 and 1) and STORE (a FileStore path).
"""

import argparse
import os
import sys
from pathlib import Path

# torch and megatron-core are imported where used: megatron-core's save starts a process that
# re-imports this file, and needs neither.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: save_kill_points

WIDTH = 8
MODEL_KEY = "decoder.weight"
OPTIMIZER_KEY = "optimizer.state.exp_avg.decoder.weight"


def run_megatron_core_save_on_cpu() -> None:
    """megatron-core's torch_dist save assumes a GPU in three places that do not touch the
    files: the device of a failure flag it all-reduces, a stream sync, and a memory probe
    (psutil) in its writer processes."""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *args: None
    torch.cuda.current_device = lambda: "cpu"
    filesystem_async._process_memory = lambda: 0


def stand_in_state(model, optimizer, scheduler, iteration, args, loading):
    """``checkpointing._state`` for the stand-in: model and optimizer tensors, common state."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    row = torch.full((1, WIDTH), float(args.value + rank))
    return {
        "model": {"weight": ShardedTensor.from_rank_offsets(MODEL_KEY, row, (0, rank, world))},
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets(OPTIMIZER_KEY, -row, (0, rank, world))},
        "iteration": iteration,
        "value": args.value,
        "args": {"value": args.value},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", default=None)
    parser.add_argument("saves", nargs="+")
    options = parser.parse_args()
    run_megatron_core_save_on_cpu()
    import torch.distributed as dist

    from megatron.moe_patches.driver import checkpointing

    checkpointing._state = stand_in_state
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo", store=dist.FileStore(os.environ["STORE"], world), rank=rank, world_size=world)
    triples = [options.saves[i:i + 3] for i in range(0, len(options.saves), 3)]
    for number, (root, iteration, value) in enumerate(triples):
        if options.kill and number == len(triples) - 1:
            import save_kill_points

            save_kill_points.install(options.kill, int(iteration))
        checkpointing.save(root, int(iteration), None, None, None, argparse.Namespace(value=int(value)))
    dist.destroy_process_group()


if __name__ == "__main__":  # megatron-core's save starts a process that re-imports __main__
    main()
