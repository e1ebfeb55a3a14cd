"""checkpointing.read_common_state reads a checkpoint's common state in both forms megatron-core
writes: a common.pt beside the torch_dist files (0.16.1, this driver) and, with no common.pt,
the torch_dist item megatron-core 0.19.2 keeps it in; with neither it refuses on one line.

fixtures/upstream_0192_ckpt is a checkpoint saved by megatron-core 0.19.2's
dist_checkpointing.save (torch_dist, one rank, two small ShardedTensors under "model" and the
common state below); these tests read it with the megatron-core installed here (0.16.1).
"""

import argparse
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.checkpointing import CheckpointError

FIXTURE = Path(__file__).parent / "fixtures" / "upstream_0192_ckpt"

# Exactly what the fixture was saved with, besides its tensors.
EXPECTED_COMMON = {
    "args": {"num_layers": 2, "hidden_size": 4, "swiglu": True, "lr": 0.0003, "moe_router_topk": None,
             "data_path": ["a", "b"]},
    "iteration": 7,
    "opt_param_scheduler": {"max_lr": 0.0003, "num_steps": 70, "decay_style": "cosine"},
    "moe_patches_expert_fc1": {"glu_layout": "concatenated"},
}
EXPECTED_WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)
EXPECTED_BIAS = torch.tensor([0.5, -1.5])


def in_root(tmp_path, source, iteration=7):
    """A --load directory whose tracker names a copy of the checkpoint directory ``source``."""
    root = tmp_path / "ckpt"
    shutil.copytree(source, root / f"iter_{iteration:07d}")
    (root / checkpointing.TRACKER).write_text(str(iteration))
    return root


class RawBytesPlanner(DefaultSavePlanner):
    """Writes a BytesIO item's bytes as they are (the default planner pickles the BytesIO)."""

    def transform_object(self, write_item, object):
        return object


def write_upstream_form(path, payload: bytes):
    """A torch_dist checkpoint holding one tensor and ``payload`` as the common-state item."""
    dcp.save({"decoder.bias": torch.zeros(2), checkpointing.UPSTREAM_COMMON_KEY: io.BytesIO(payload)},
             checkpoint_id=str(path), planner=RawBytesPlanner(), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return path


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- megatron-core 0.19.2's form ------------------------------------------------------------


def test_the_upstream_checkpoint_has_no_common_file():
    """The fixture holds its common state only inside the torch_dist files."""
    assert sorted(p.name for p in FIXTURE.iterdir()) == [".metadata", "__0_0.distcp", "metadata.json"]


def test_reads_the_common_state_megatron_core_0192_saved():
    common = checkpointing.read_common_state(str(FIXTURE))
    assert common == EXPECTED_COMMON
    assert type(common["args"]) is dict and common["args"]["moe_router_topk"] is None


def test_saved_args_of_an_upstream_checkpoint(tmp_path):
    assert checkpointing.saved_args(str(in_root(tmp_path, FIXTURE))) == EXPECTED_COMMON["args"]


class Model:
    def __init__(self):
        self.loaded = None

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing import ShardedTensor

        return {"decoder.weight": ShardedTensor.from_rank_offsets("decoder.weight", torch.zeros(3, 4)),
                "decoder.bias": ShardedTensor.from_rank_offsets("decoder.bias", torch.zeros(2))}

    def load_state_dict(self, state):
        self.loaded = state


def test_load_resumes_from_an_upstream_checkpoint(tmp_path, one_rank_group):
    """checkpointing.load end to end: iteration from the common state, the model's tensors
    through megatron-core 0.16.1's load (its own common-state read would need common.pt)."""
    model = Model()
    args = argparse.Namespace(no_load_optim=True, bf16=False)
    assert checkpointing.load(str(in_root(tmp_path, FIXTURE)), model, None, None, args) == 7
    assert torch.equal(model.loaded["decoder.weight"], EXPECTED_WEIGHT)
    assert torch.equal(model.loaded["decoder.bias"], EXPECTED_BIAS)


RAN = []


class Payload:
    """Unpickling this runs code: a reader that allows any type would record it."""

    def __reduce__(self):
        return RAN.append, ("unpickled",)


def test_an_upstream_common_state_with_unsafe_objects_is_refused_unread(tmp_path):
    path = write_upstream_form(tmp_path / "iter_0000001", pickled([{"args": Payload()}]))
    with pytest.raises(CheckpointError, match="not safe to load") as refused:
        checkpointing.read_common_state(str(path))
    assert RAN == [] and "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_megatron_lm_namespace_args_read_in_the_upstream_form(tmp_path):
    """Megatron-LM saves its args as an argparse.Namespace, which megatron-core allows."""
    saved = {"args": argparse.Namespace(swiglu=True, moe_mlp_glu_interleave_size=None), "iteration": 3}
    path = write_upstream_form(tmp_path / "iter_0000003", pickled([saved]))
    assert checkpointing.read_common_state(str(path)) == saved


def test_an_upstream_item_that_is_not_a_common_state_is_refused(tmp_path):
    path = write_upstream_form(tmp_path / "iter_0000001", pickled({"iteration": 3}))
    with pytest.raises(CheckpointError, match="is not a common state dict"):
        checkpointing.read_common_state(str(path))


# --- this project's form: common.pt --------------------------------------------------------


def test_a_checkpoint_with_a_common_file_reads_weights_only(tmp_path, monkeypatch):
    """torch_dist tensors plus common.pt, as megatron-core 0.16.1 (and so this driver's save)
    writes them: read as megatron-core's load_common_state_dict reads it (torch.load, weights
    only), but with weights_only given, so no environment variable lets a payload run."""
    path = tmp_path / "iter_0000004"
    dcp.save({"decoder.bias": torch.zeros(2)}, checkpoint_id=str(path), no_dist=True)
    common = {"args": {"hidden_size": 8, "seq_length": 32}, "iteration": 4,
              "opt_param_scheduler": {"num_steps": 40}, "optimizer": {"optimizer": {"param_groups": []}}}
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"}))
    assert checkpointing.read_common_state(str(path)) == common
    (tmp_path / checkpointing.TRACKER).write_text("4")
    assert checkpointing.saved_args(str(tmp_path)) == common["args"]
    torch.save({**common, "args": Payload()}, path / "common.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # turns off torch.load's default only
    with pytest.raises(CheckpointError, match="common.pt is not safe to load: it needs "):
        checkpointing.read_common_state(str(path))
    assert RAN == []


# --- neither: refused, naming the path and the fix -----------------------------------------


def refusal(path):
    with pytest.raises(CheckpointError) as refused:
        checkpointing.read_common_state(str(path))
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        f"{path} holds no common state: neither common.pt nor a torch_dist 'common_state/shard_0_1' item "
        "(the save did not finish, or it is not a megatron-core torch_dist checkpoint); point --load at a "
        "complete one")
    return message


def test_a_directory_with_neither_form_is_refused(tmp_path):
    empty = tmp_path / "iter_0000002"
    empty.mkdir()
    refusal(empty)
    tensors_only = tmp_path / "iter_0000003"  # torch_dist files, but no common state in them
    dcp.save({"decoder.bias": torch.zeros(2)}, checkpoint_id=str(tensors_only), no_dist=True)
    refusal(tensors_only)


def test_load_and_saved_args_refuse_it_before_reading_tensors(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    write_upstream_form(root / "iter_0000005", pickled([{"iteration": 5}]))  # megatron-core's files ...
    (root / "iter_0000005" / ".metadata").unlink()  # ... but no index of the tensors: no common state
    (root / checkpointing.TRACKER).write_text("5")
    monkeypatch.setattr(dist_checkpointing, "load", lambda *a, **kw: pytest.fail("tensors were read"))
    expected = "^" + re.escape(f"--load {root}: the checkpoint tracker {root / checkpointing.TRACKER} names "
                               f"iteration 5, but {root / 'iter_0000005'} is not a complete checkpoint (no .metadata")
    with pytest.raises(CheckpointError, match=expected):
        checkpointing.saved_args(str(root))
    with pytest.raises(CheckpointError, match=expected):
        checkpointing.load(str(root), Model(), None, None, argparse.Namespace(no_load_optim=True, bf16=False))
