"""The environment variables a driver run reads, judged before start-up: the launcher's
ranks and node (torchrun's WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, CUDA_VISIBLE_DEVICES), the package's switches, and --deterministic-mode's
settings."""

import argparse
import os
from typing import Optional

from megatron.moe_patches.fields import DEVICE_SPLITS_ENV_ALIAS, env_switch, shown

def launcher_rank() -> int:
    """This process's RANK (0 where unset or unreadable)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:  # check_environment refuses it; warnings before that print anyway
        return 0


def _launcher_int(name: str, default: int, low: int, high: Optional[int], what: str) -> int:
    """An integer variable the launcher sets (torchrun), ``default`` where unset; a value
    outside [low, high] is a ValueError naming the variable and ``what`` it must be."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        raise ValueError(f"{name}={shown(value)!r} (set by the launcher) is not {what}")
    return number


def world_size_from_env() -> int:
    """The number of ranks the launcher starts (torchrun sets WORLD_SIZE; a plain run is 1)."""
    return _launcher_int("WORLD_SIZE", 1, 1, None, "a positive integer")


# The package's on/off environment variables (fields.env_switch reads them).
ENV_SWITCHES = (DEVICE_SPLITS_ENV_ALIAS,)
# With --deterministic-mode the driver sets these where they are unset; a value already set
# that allows non-deterministic kernels would win without a word.
DETERMINISTIC_ENV = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
}


def _check_deterministic_env() -> None:
    for name, accepted in DETERMINISTIC_ENV.items():
        value = os.environ.get(name)
        if value is not None and value not in accepted:
            raise ValueError(f"{name}={shown(value)!r} with --deterministic-mode: the run would not be "
                             f"deterministic; set {' or '.join(accepted)}, or unset it (the driver then sets it)")


def check_environment(args: argparse.Namespace) -> int:
    """The environment variables the run reads, judged before start-up: the launcher's
    ranks, the package's switches, and the determinism settings of --deterministic-mode.
    Returns the world size."""
    world = world_size_from_env()
    if world > 1 and "RANK" not in os.environ:
        # Each process would take rank 0 and wait for the others at the rendezvous forever.
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: start the {world} processes with torchrun "
                         f"(torchrun --nproc-per-node {world} ...), which sets RANK, LOCAL_RANK, MASTER_ADDR and "
                         "MASTER_PORT for each, or unset WORLD_SIZE for one process")
    for name in ("RANK", "LOCAL_RANK"):
        _launcher_int(name, 0, 0, world - 1, f"a rank from 0 to {world - 1} (WORLD_SIZE {world})")
    _launcher_int("MASTER_PORT", 0, 1, 65535, "a TCP port (1 to 65535)")
    _check_launcher_node(world)
    for name in ENV_SWITCHES:
        env_switch(name)
    if args.deterministic_mode:
        _check_deterministic_env()
    _check_symmetric_exchange_node(args, world)
    return world


def _check_launcher_node(world: int) -> None:
    """The launcher's node variables, where set, as torchrun sets them: LOCAL_WORLD_SIZE ranks on
    this node (1 to WORLD_SIZE), LOCAL_RANK (the GPU each rank takes) below it, and a MASTER_ADDR
    that names a host (an empty one fails the rendezvous at start-up)."""
    per_node = _launcher_int("LOCAL_WORLD_SIZE", world, 1, world, f"a rank count from 1 to {world} (WORLD_SIZE {world})")
    local = _launcher_int("LOCAL_RANK", 0, 0, None, "a rank")
    if local >= per_node:
        raise ValueError(f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={per_node} (set by the launcher): the local rank "
                         "must be below the ranks per node; launch with torchrun, which sets both")
    address = os.environ.get("MASTER_ADDR")
    if address is not None and not address.strip():
        raise ValueError(f"MASTER_ADDR={address!r} (set by the launcher) is empty: set the host of rank 0, or unset it "
                         "on one node (the driver then uses 127.0.0.1)")
    if address is not None and any(char.isspace() for char in address):
        raise ValueError(f"MASTER_ADDR={shown(address)!r} (set by the launcher) holds white space, so it names no "
                         "host: set the host name or address of rank 0, or unset it on one node (the driver then "
                         "uses 127.0.0.1)")
    _check_visible_gpus(per_node)


def _check_visible_gpus(per_node: int) -> None:
    """Each of the node's ranks takes its own GPU (LOCAL_RANK indexes the visible ones): a
    CUDA_VISIBLE_DEVICES that names fewer leaves the last ranks without one, found only at
    start-up. Unset or empty (no GPU: the GPU check says so) is not judged here."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return
    count = len(visible.split(","))
    if count < per_node:
        gpus = f"{count} GPU{'s' if count > 1 else ''}"
        raise ValueError(f"CUDA_VISIBLE_DEVICES={shown(visible)!r} names {gpus}, but the launcher starts {per_node} "
                         f"ranks on this node (LOCAL_WORLD_SIZE), one GPU each: name at least {per_node} GPUs, or "
                         f"start at most {count} ranks per node")


def _check_symmetric_exchange_node(args: argparse.Namespace, world: int) -> None:
    """--moe-symmetric-exchange maps the expert-parallel peers' GPU memory: an expert group must lie
    within one node, i.e. expert TP x EP ranks (consecutive in megatron-core's rank order) within the
    launcher's ranks per node (LOCAL_WORLD_SIZE)."""
    if not getattr(args, "moe_symmetric_exchange", False) or args.expert_model_parallel_size == 1:
        return
    per_node = _launcher_int("LOCAL_WORLD_SIZE", world, 1, world, f"a rank count from 1 to {world}")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    group = etp * args.expert_model_parallel_size
    if group > per_node or per_node % group:
        ep = args.expert_model_parallel_size
        raise ValueError(f"--moe-symmetric-exchange with --expert-model-parallel-size {ep} (x expert TP {etp}) "
                         "needs each expert-parallel group on one node, but the launcher starts "
                         f"{per_node} ranks per node (LOCAL_WORLD_SIZE): use an EP of at most "
                         f"{max(per_node // etp, 1)} that divides it, or drop --moe-symmetric-exchange "
                         "(NCCL's all-to-all crosses nodes)")
