"""Checkpoint directories for the driver's CPU tests, holding what megatron-core 0.16.1's
torch_dist save leaves in a complete iteration directory: the tensor files and their index
(``.metadata``), ``common.pt`` and ``metadata.json``. ``--load`` refuses an iteration
directory without them before start-up (``checkpointing.incomplete_reason``)."""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from megatron.moe_patches.driver import checkpointing

TORCH_DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


def complete_iteration(path, common=None, tensors=None) -> Path:
    """Make ``path`` a complete iteration directory; files it already holds are kept.
    ``common``: the common state (default: the iteration and empty args); ``tensors``: the
    tensors saved (default: one small weight)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / checkpointing.TENSOR_INDEX).exists():
        dcp.save(tensors or {"decoder.final_layernorm.weight": torch.ones(4)}, checkpoint_id=str(path),
                 no_dist=True)
    if not (path / checkpointing.COMMON_FILE).exists():
        torch.save({"iteration": 0, "args": {}} if common is None else common, path / checkpointing.COMMON_FILE)
    if not (path / checkpointing.CONFIG_FILE).exists():
        (path / checkpointing.CONFIG_FILE).write_text(json.dumps(TORCH_DIST_CONFIG))
    return path


def checkpoint_root(root, iteration=4, common=None, tracker=None) -> Path:
    """``root`` holding a complete checkpoint of ``iteration``, named by its tracker (or the
    tracker holding ``tracker``)."""
    root = Path(root)
    complete_iteration(root / f"iter_{iteration:07d}", {"iteration": iteration, "args": {}} if common is None
                       else common)
    (root / checkpointing.TRACKER).write_text(str(iteration) if tracker is None else tracker)
    return root
