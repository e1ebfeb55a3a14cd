"""A torch_dist checkpoint must fill every ShardedTensor of the model, or nothing loads
(checkpointing.uncovered_tensors / check_checkpoint_covers). Real megatron-core
ShardedTensors and real torch DCP metadata; the GPU test does it with pretrain_gpt.py's model."""

import argparse
import pickle

import pytest
import torch

pytest.importorskip("megatron.core")
import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron.moe_patches.driver import checkpointing  # noqa: E402
from megatron.moe_patches.driver.checkpointing import IncompleteCheckpointError, uncovered_tensors  # noqa: E402

from checkpoint_files import complete_iteration  # noqa: E402

KEY = "decoder.layers.0.mlp.experts.linear_fc1.weight"
E, OUT, IN = 4, 2, 3


def per_expert(key=KEY, experts=range(E)):
    """Stock TE grouped experts: one ShardedTensor per expert under one key, expert axis prepended."""
    return [ShardedTensor.from_rank_offsets(key, torch.randn(OUT, IN), (0, e, E), replica_id=0,
                                              prepend_axis_num=1) for e in experts]


def grouped(key=KEY):
    return ShardedTensor.from_rank_offsets(key, torch.randn(E, OUT, IN), replica_id=0)


def saved(chunks, size=(E, OUT, IN), key=KEY):
    """DCP metadata of one tensor saved as ``chunks`` [(offsets, sizes)]."""
    storage = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )
    return Metadata(state_dict_metadata={key: storage})


PER_EXPERT_CHUNKS = [((e, 0, 0), (1, OUT, IN)) for e in range(E)]


def test_complete_checkpoints_pass_in_every_layout():
    assert uncovered_tensors({"model": per_expert()}, saved(PER_EXPERT_CHUNKS)) == []
    assert uncovered_tensors({"model": grouped()}, saved(PER_EXPERT_CHUNKS)) == []  # grouped from indexed
    assert uncovered_tensors({"model": per_expert()}, saved([((0, 0, 0), (E, OUT, IN))])) == []
    # EP=2 rank 1 holds experts 2, 3 only
    assert uncovered_tensors({"model": per_expert(experts=[2, 3])}, saved(PER_EXPERT_CHUNKS[2:])) == []


def test_missing_expert_chunk_is_named_with_its_region():
    problems = uncovered_tensors({"model": per_expert()}, saved(PER_EXPERT_CHUNKS[:2] + PER_EXPERT_CHUNKS[3:]))
    assert len(problems) == 1
    assert KEY in problems[0] and "(2, 0, 0)" in problems[0] and f"{OUT * IN} of {OUT * IN}" in problems[0]
    # A grouped parameter misses the same expert's rows
    problems = uncovered_tensors({"model": grouped()}, saved(PER_EXPERT_CHUNKS[:2] + PER_EXPERT_CHUNKS[3:]))
    assert len(problems) == 1 and f"{OUT * IN} of {E * OUT * IN}" in problems[0]


def test_missing_key_and_mis_shaped_tensor_are_named():
    other = "decoder.layers.0.mlp.experts.linear_fc2.weight"
    problems = uncovered_tensors({"a": per_expert(), "b": per_expert(key=other)}, saved(PER_EXPERT_CHUNKS))
    assert problems == [f"{other}: not in the checkpoint"] * E
    problems = uncovered_tensors({"model": grouped()}, saved(PER_EXPERT_CHUNKS, size=(E, OUT + 1, IN)))
    assert problems == [f"{KEY}: shape ({E}, {OUT + 1}, {IN}) in the checkpoint, ({E}, {OUT}, {IN}) in the model"]


def test_factories_are_built_and_checked():
    def build(key, tensor, replica_id, flattened_range):
        return {"rows": per_expert(key=key)}

    factory = ShardedTensorFactory(KEY, torch.zeros(1), build, lambda sub: sub, replica_id=0)
    assert uncovered_tensors({"model": factory}, saved(PER_EXPERT_CHUNKS)) == []
    assert len(uncovered_tensors({"model": factory}, saved(PER_EXPERT_CHUNKS[1:]))) == 1


def _rewrite_metadata(path, change):
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    change(metadata.state_dict_metadata)
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


class _Stateful:
    """Model, optimizer or scheduler stand-in: load_state_dict takes anything."""

    def sharded_state_dict(self):
        return {"w": per_expert()}

    def load_state_dict(self, state):
        pass


def test_load_refuses_a_damaged_checkpoint_before_reading(tmp_path, monkeypatch):
    """checkpointing.load on a real DCP checkpoint whose metadata lost a key: it raises naming
    the key and never calls dist_checkpointing.load (wiring; the GPU test checks the model)."""
    from megatron.core import dist_checkpointing

    path = tmp_path / "iter_0000004"
    complete_iteration(path, tensors={KEY: torch.randn(E, OUT, IN)})
    (tmp_path / checkpointing.TRACKER).write_text("4")
    reads = []
    common = {"args": {}, "iteration": 4, "opt_param_scheduler": {}}
    monkeypatch.setattr(checkpointing, "read_common_state", lambda p: common)
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, p, **kw: reads.append(p) or state)
    monkeypatch.setattr(checkpointing, "_state", lambda model, *rest, loading: {"model": model.sharded_state_dict(),
                                                           "optimizer": {"optimizer": {"param_groups": []}}})

    def load():
        return checkpointing.load(str(tmp_path), _Stateful(), _Stateful(), _Stateful(), argparse.Namespace())

    assert load() == 4 and len(reads) == 1  # intact: read
    _rewrite_metadata(path, lambda md: md.update({"renamed": md.pop(KEY)}))
    with pytest.raises(IncompleteCheckpointError, match="nothing was loaded") as refused:
        load()
    assert f"{KEY}: not in the checkpoint" in str(refused.value) and len(reads) == 1


# --- optimizer plain state across EP sizes (checkpointing.fit_optimizer_state) ---------------

IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def group(wd_mult, expert, step=4):
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert, "is_decoupled_lr": False,
            "step": step, "lr": 1e-3}


def picked(state, wd_mult, expert):
    """The saved group megatron-core's DistributedOptimizer.load_state_dict would use (last match wins)."""
    by_identity = {tuple(g[k] for k in IDENTITY): g for g in state["optimizer"]["param_groups"]}
    return by_identity[(wd_mult, 1.0, expert, False)]


class _Chain:
    def __init__(self, count):
        self.chained_optimizers = [object()] * count


def test_optimizer_state_of_the_same_shape_is_untouched():
    single = {"optimizer": {"param_groups": [group(1.0, False)]}, "param_state": {}, "param_state_sharding_type": "x"}
    assert checkpointing.fit_optimizer_state(_Chain(1), single) is single
    chained = {0: dict(single), 1: dict(single)}
    assert checkpointing.fit_optimizer_state(_Chain(2), chained) is chained


def test_ep1_optimizer_state_fits_the_ep2_chain():
    """EP=1 saved one optimizer (experts in data-parallel groups); EP=2 has dense + expert."""
    loaded = {"optimizer": {"param_groups": [group(1.0, False), group(0.0, False)]},
              "param_state_sharding_type": "fully_reshardable",
              0: {"param_state": "dense"}, 1: {"param_state": "expert"}}
    dense, expert = checkpointing.fit_optimizer_state(_Chain(2), loaded)
    assert (dense["param_state"], expert["param_state"]) == ("dense", "expert")
    assert dense["param_state_sharding_type"] == expert["param_state_sharding_type"] == "fully_reshardable"
    assert picked(dense, 0.0, False)["step"] == 4 and picked(expert, 1.0, True)["step"] == 4
    assert picked(expert, 0.0, True)["wd_mult"] == 0.0
    assert len(loaded["optimizer"]["param_groups"]) == 2  # the loaded tree is not modified


def test_ep2_optimizer_state_fits_one_optimizer_and_exact_groups_win():
    loaded = {0: {"optimizer": {"param_groups": [group(1.0, False, step=4)]}, "param_state_sharding_type": "f"},
              1: {"optimizer": {"param_groups": [group(1.0, True, step=5)]}, "param_state_sharding_type": "f"},
              "param_state": "all"}
    state = checkpointing.fit_optimizer_state(_Chain(1), loaded)
    assert state["param_state"] == "all" and state["param_state_sharding_type"] == "f"
    assert picked(state, 1.0, False)["step"] == 4  # the dense group, not the expert group relabelled
    assert picked(state, 1.0, True)["step"] == 5


def test_optimizer_state_without_param_groups_is_refused():
    with pytest.raises(ValueError, match="no param groups"):
        checkpointing.fit_optimizer_state(_Chain(2), {0: {"param_state": 1}, 1: {"param_state": 2}})
