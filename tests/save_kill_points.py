"""SIGKILL at one point of ``checkpointing.save``, for the crash-safe save tests (the CPU
child ``tests/unit/crash_save_child.py`` and the GPU worker ``tests/gpu/crash_save_worker.py``).

``install(point, iteration)`` arms ``point`` for the save of ``iteration`` only; reaching it
kills the whole process group (megatron-core writes the tensor files in forked processes),
so the process must lead its own group (start it with ``start_new_session=True``). Points,
in the order a save reaches them (megatron-core 0.16.1 writes common.pt, the tensor files,
their index, then metadata.json; the driver then renames and names it in the tracker):

- ``common``: half of common.pt written
- ``model`` / ``optimizer``: a tensor file open, before the first model / optimizer tensor
  is written into it
- ``index``: the tensor files written, their index (.metadata) not
- ``config``: half of metadata.json written
- ``publish``: every file written, nothing flushed or renamed
- ``swap``: re-saving an iteration, the old directory moved aside, the new one not yet named
- ``tracker``: the new tracker written beside the old one, not yet renamed over it
"""

import functools
import io
import os
import signal

POINTS = ("common", "model", "optimizer", "index", "config", "publish", "swap", "tracker")
_armed = {"now": False}


def kill() -> None:
    os.killpg(0, signal.SIGKILL)


def _when_armed(original, condition=lambda *args, **kwargs: True, before=None):
    """``original``, killing the process group instead where armed and ``condition`` holds
    (after ``before(*args, **kwargs)``, which leaves a part-written file)."""
    @functools.wraps(original)  # megatron-core inspects _write_item's signature
    def wrapper(*args, **kwargs):
        if _armed["now"] and condition(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            kill()
        return original(*args, **kwargs)

    return wrapper


def _write_half(data: bytes, path) -> None:
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])


def _half_of_torch_save(obj, path, *args, **kwargs):
    buffer = io.BytesIO()
    _torch_save(obj, buffer)
    _write_half(buffer.getvalue(), path)


def _half_of_config(config, checkpoint_dir):
    import dataclasses
    import json

    _write_half(json.dumps(dataclasses.asdict(config)).encode(), os.path.join(checkpoint_dir, "metadata.json"))


def _tensor_key(*args, **kwargs) -> str:
    from torch.distributed.checkpoint.planner import WriteItem

    return next(a for a in args if isinstance(a, WriteItem)).index.fqn


_torch_save = None


def _install_common():
    global _torch_save
    import torch

    _torch_save = torch.save
    torch.save = _when_armed(torch.save, lambda obj, path, *a, **k: str(path).endswith("common.pt"),
                             before=_half_of_torch_save)


def _install_tensor(optimizer: bool):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    is_wanted = lambda *args, **kwargs: _tensor_key(*args, **kwargs).startswith("optimizer.") == optimizer
    filesystem_async._write_item = _when_armed(filesystem_async._write_item, is_wanted)


def _install_index():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    FileSystemWriterAsync.finish = _when_armed(FileSystemWriterAsync.finish)


def _install_config():
    from megatron.core.dist_checkpointing import serialization

    serialization.save_config = _when_armed(serialization.save_config, before=_half_of_config)


def _install_publish():
    from megatron.moe_patches.driver import checkpointing

    checkpointing._publish = _when_armed(checkpointing._publish)


def _install_swap():
    from megatron.moe_patches.driver import checkpointing

    def naming_while_moved_aside(source, destination, *args, **kwargs):
        return str(source).endswith(checkpointing.INCOMPLETE) and os.path.isdir(f"{destination}{checkpointing.REPLACED}")

    os.rename = _when_armed(os.rename, naming_while_moved_aside)


def _install_tracker():
    from megatron.moe_patches.driver import checkpointing

    os.replace = _when_armed(os.replace, lambda source, destination, *a, **k: str(destination).endswith(
        checkpointing.TRACKER))


INSTALL = {
    "common": _install_common, "model": lambda: _install_tensor(False), "optimizer": lambda: _install_tensor(True),
    "index": _install_index, "config": _install_config, "publish": _install_publish, "swap": _install_swap,
    "tracker": _install_tracker,
}


def install(point: str, iteration: int) -> None:
    """Kill this process group at ``point`` of the save of ``iteration``."""
    from megatron.moe_patches.driver import checkpointing

    if os.getpgrp() != os.getpid():
        raise RuntimeError("save_kill_points kills its process group: start this process in a session of its own")
    INSTALL[point]()
    save = checkpointing.save

    @functools.wraps(save)
    def armed_save(root, at_iteration, *args, **kwargs):
        _armed["now"] = at_iteration == iteration
        try:
            return save(root, at_iteration, *args, **kwargs)
        finally:
            _armed["now"] = False

    checkpointing.save = armed_save
