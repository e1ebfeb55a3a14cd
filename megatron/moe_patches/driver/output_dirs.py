"""The directories a run writes into (--save, --tensorboard-dir, --data-cache-path): each a
writable directory, or one that can be made, within the file system's name and path limits."""

import os

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.fields import shown

OUTPUT_DIRS = ("save", "tensorboard_dir", "data_cache_path")


# The most bytes of the relative paths the run writes under an output directory (a checkpoint's
# iter_NNNNNNN.incomplete/__0_0.distcp, megatron-core's cached index files named by a hash).
WRITTEN_UNDER_OUTPUT = 128


def _check_path_lengths(flag: str, path: str, target: str, existing: str) -> None:
    """Each name in ``target`` within the file system's NAME_MAX, and ``target`` with room for
    what the run writes under it within its PATH_MAX (read where ``existing`` lies): else the
    first write fails after start-up."""
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    for name in target.split(os.sep):
        if len(os.fsencode(name)) > name_max:
            raise ValueError(f"{flag} {shown(path)!r}: the name {name[:20]}... is {len(os.fsencode(name))} bytes, but "
                             f"the file system takes names of at most {name_max} (NAME_MAX): give shorter names")
    length = len(os.fsencode(target))
    if length + WRITTEN_UNDER_OUTPUT >= path_max:
        raise ValueError(f"{flag} {shown(path)!r}: it is {length} bytes long, and the run writes files under it: the "
                         f"file system takes paths of at most {path_max} bytes (PATH_MAX), so keep it under "
                         f"{path_max - WRITTEN_UNDER_OUTPUT}: give a shorter path")


def _check_save_tracker(path: str) -> None:
    """The first save writes the checkpoint tracker into --save: a directory of that name there
    makes it fail after the first save's work."""
    tracker = os.path.join(path, on_disk.TRACKER)
    if os.path.isdir(tracker):
        raise ValueError(f"--save {shown(path)!r}: {shown(tracker)} is a directory, where the first save writes the "
                         "checkpoint tracker (a file): remove it, or give another --save directory")


def check_output_dir(flag: str, path: str) -> None:
    """``path`` is a writable directory or can be made one: its nearest existing ancestor is
    a writable directory, nothing on the way is a symbolic link to a missing target (the
    run could make no directory there), and its names and length are within the file system's
    limits. Nothing is made here."""
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        if os.path.islink(existing):
            link = os.readlink(existing)
            what = "a symbolic link" if existing == target else f"inside {shown(existing)}, a symbolic link"
            raise ValueError(f"{flag} {shown(path)}: {what} to {shown(link)}, which does not exist: make that "
                             f"directory (mkdir -p {shown(os.path.join(os.path.dirname(existing), link))}), "
                             "or give another path")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "a file" if existing == target else f"inside {shown(existing)}, a file"
        raise ValueError(f"{flag} {shown(path)}: {what}, not a directory: give a directory, or a path where one "
                         "can be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown(path)}: {shown(existing)} is not writable: give a directory this user "
                         "can write to")
    _check_path_lengths(flag, path, target, existing)
    if flag == "--save":
        _check_save_tracker(path)
