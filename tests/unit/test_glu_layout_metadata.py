"""Checkpoints say how they hold the routed experts' gated FC1 rows (checkpointing.GLU_LAYOUT_KEY
in the common state): this driver always saves them concatenated. load reads the layout
before any tensor: no record means concatenated (unless Megatron-LM's args say its experts
interleaved), interleaved rows are converted while loading (optimizer states too), and an
unknown layout is refused by name. Real megatron-core sharded entries and a real torch_dist
load on one CPU rank (gloo)."""

import argparse
import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess  # noqa: E402
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory  # noqa: E402

from megatron.moe_patches.driver import checkpointing  # noqa: E402
from megatron.moe_patches.driver.checkpointing import CheckpointError  # noqa: E402
from megatron.moe_patches.experts.glu_interleave import concatenated_factory, interleave_parameters  # noqa: E402

from checkpoint_files import checkpoint_root  # noqa: E402

PREFIX = "decoder.layers.0.mlp.experts.linear_fc1."
E, ROWS, H = 2, 12, 3  # experts, FC1 rows (6 gate + 6 linear), hidden size
# Rows of the concatenated layout (gate 0-5, then linear 0-5) in the order a block-2
# interleave stores them: gate 0-1, linear 0-1, gate 2-3, linear 2-3, gate 4-5, linear 4-5.
SAVED_BLOCK = 2
SAVED_ORDER = [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
# ... and the order a block-3 interleave keeps them in memory.
MEMORY_BLOCK = 3
MEMORY_ORDER = [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]


def concatenated(name, expert):
    """Expert ``expert``'s FC1 ``name`` (weight or bias) in the concatenated layout: every
    element says its row, column and expert."""
    rows = torch.arange(ROWS, dtype=torch.float32)[:, None] * 10 + torch.arange(H) + 1000 * expert
    return rows if name == "weight" else rows[:, 0].contiguous()


def megatron_lm_args(**overrides):
    """Saved args as Megatron-LM keeps them (its Namespace), experts interleaving FC1."""
    values = dict(swiglu=True, moe_grouped_gemm=True, transformer_impl="transformer_engine",
                  moe_mlp_glu_interleave_size=SAVED_BLOCK, use_distributed_optimizer=True,
                  dist_ckpt_optim_fully_reshardable=True, tensor_model_parallel_size=1,
                  expert_tensor_parallel_size=1)
    return argparse.Namespace(**{**values, **overrides})


class Experts(torch.nn.Module):
    """E experts' FC1 as TE's grouped linear holds them (weight0.., bias0..), with the
    sharded state dict of megatron-core's TEGroupedMLP (SwiGLU split per expert), optionally
    interleaved in memory as the op-fuser experts keep them."""

    def __init__(self, memory_block=None):
        super().__init__()
        for e in range(E):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(torch.zeros(ROWS, H)))
            self.register_parameter(f"bias{e}", torch.nn.Parameter(torch.zeros(ROWS)))
        self.memory_block = memory_block
        if memory_block:
            interleave_parameters(self, memory_block)

    def sharded_state_dict(self):
        state = {}
        for e in range(E):
            for name in ("weight", "bias"):
                param = getattr(self, f"{name}{e}")
                stock = apply_swiglu_sharded_factory(
                    ShardedTensor.from_rank_offsets(PREFIX + name, param, (0, e, E), replica_id=0, prepend_axis_num=1),
                    ((0, e, E),),
                )
                state[f"{name}{e}"] = concatenated_factory(stock, self.memory_block) if self.memory_block else stock
        return state


class ExpAvgOptimizer:
    """An optimizer whose checkpoint holds one state per parameter under the parameter's
    entry (megatron-core's per-parameter formats build them with ``replace`` the same way)."""

    def sharded_state_dict(self, model_state, is_loading, metadata):
        self.metadata = metadata
        states = {name: replace(entry, key=f"optimizer.state.exp_avg.{entry.key}", data=torch.zeros_like(entry.data))
                  for name, entry in model_state.items()}
        return {"optimizer": {"param_groups": []}, "exp_avg": states}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


class Scheduler:
    def state_dict(self):
        return {"num_steps": 8}

    def load_state_dict(self, state):
        self.loaded = state


def write_checkpoint(root, common, order, iteration=4):
    """A torch_dist checkpoint under ``root`` (megatron-core 0.16.1's files) whose FC1 rows,
    model and exp_avg (the negated weights), are stored in ``order``."""
    path = root / f"iter_{iteration:07d}"
    tensors = {}
    for name in ("weight", "bias"):
        saved = torch.stack([concatenated(name, e)[order] for e in range(E)])
        tensors[PREFIX + name] = saved
        tensors[f"optimizer.state.exp_avg.{PREFIX}{name}"] = -saved
    dcp.save(tensors, checkpoint_id=str(path), no_dist=True)
    common = {"iteration": iteration, "opt_param_scheduler": {"num_steps": 8},
              "optimizer": {"optimizer": {"param_groups": []}}, **common}
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"}))
    (root / checkpointing.TRACKER).write_text(str(iteration))
    return path


def run_args(**values):
    return argparse.Namespace(**{"no_load_optim": False, "bf16": False, **values})


# --- save: the layout is recorded in the common state --------------------------------------


def test_save_records_the_concatenated_layout_in_the_common_state(tmp_path, monkeypatch):
    saves = []
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, path: saves.append(state))
    model = Experts(memory_block=MEMORY_BLOCK)  # interleaved in memory, saved concatenated
    args = argparse.Namespace(moe_mlp_glu_interleave_size=MEMORY_BLOCK, dist_ckpt_optim_fully_reshardable=True)
    checkpointing.save(str(tmp_path), 4, model, ExpAvgOptimizer(), Scheduler(), args)
    (state,) = saves
    _, common = save_preprocess(state, validate_access_integrity=False)  # what megatron-core writes as common
    assert common["moe_patches_expert_fc1"] == {"glu_layout": "concatenated"}
    assert common["args"]["moe_mlp_glu_interleave_size"] == MEMORY_BLOCK  # the memory layout, not the saved one
    # ... and the record is what load reads as concatenated, whatever the args say.
    assert checkpointing.saved_glu_layout(common, "ckpt") is None
    assert checkpointing.saved_glu_layout({**common, "args": megatron_lm_args()}, "ckpt") is None


# --- load: the layout, read before any tensor ------------------------------------------------


@pytest.mark.parametrize("common, expected", [
    # This driver's older checkpoints: no record, args a dict, FC1 saved concatenated even
    # when the experts interleaved in memory.
    ({"args": {"moe_mlp_glu_interleave_size": 32, "swiglu": True, "moe_grouped_gemm": True}}, None),
    ({"args": {}}, None),
    # Stock megatron-core 0.16.1 / Megatron-LM without the interleave.
    ({"args": argparse.Namespace(swiglu=True, moe_grouped_gemm=True)}, None),
    ({"args": megatron_lm_args(moe_mlp_glu_interleave_size=None)}, None),
    # Megatron-LM experts that ignore the size: not gated, sequential (local or no grouped GEMM).
    ({"args": megatron_lm_args(swiglu=False)}, None),
    ({"args": megatron_lm_args(transformer_impl="local")}, None),
    ({"args": megatron_lm_args(moe_grouped_gemm=False)}, None),
    # Megatron-LM's grouped experts interleaved: the block size.
    ({"args": megatron_lm_args()}, SAVED_BLOCK),
    ({"args": megatron_lm_args(swiglu=False, quick_geglu=True, moe_mlp_glu_interleave_size=32)}, 32),
    ({"args": megatron_lm_args(moe_grouped_gemm=False, transformer_impl="inference_optimized")}, SAVED_BLOCK),
    # A record wins over the args.
    ({"args": megatron_lm_args(), "moe_patches_expert_fc1": {"glu_layout": "concatenated"}}, None),
    ({"args": {}, "moe_patches_expert_fc1": {"glu_layout": "interleaved", "glu_interleave_size": 64}}, 64),
])
def test_layout_of_a_checkpoint(common, expected):
    assert checkpointing.saved_glu_layout(common, "ckpt") == expected


@pytest.mark.parametrize("memory_block", [None, MEMORY_BLOCK])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_interleaved_rows_load_concatenated(tmp_path, one_rank_group, memory_block, with_optimizer):
    """A Megatron-LM checkpoint holding FC1 block-2 interleaved loads as the concatenated rows,
    exp_avg too; experts interleaving in memory (block 3) get them in their own order once."""
    write_checkpoint(tmp_path, {"args": megatron_lm_args()}, SAVED_ORDER)
    model, optimizer, scheduler = Experts(memory_block), ExpAvgOptimizer(), Scheduler()
    args = run_args(no_load_optim=not with_optimizer)
    assert checkpointing.load(str(tmp_path), model, optimizer, scheduler, args) == 4
    order = MEMORY_ORDER if memory_block else list(range(ROWS))
    for e in range(E):
        for name in ("weight", "bias"):
            expected = concatenated(name, e)[order]
            assert torch.equal(getattr(model, f"{name}{e}").detach(), expected), (name, e)
            if with_optimizer:
                assert torch.equal(optimizer.loaded["exp_avg"][f"{name}{e}"], -expected), (name, e)
    assert not with_optimizer or optimizer.metadata == checkpointing.FULLY_RESHARDABLE


@pytest.mark.parametrize("common", [
    # This driver's older checkpoint (no record) of experts interleaving in memory.
    {"args": {"moe_mlp_glu_interleave_size": MEMORY_BLOCK, "swiglu": True, "moe_grouped_gemm": True,
              "dist_ckpt_optim_fully_reshardable": True}},
    {"args": {}, "moe_patches_expert_fc1": {"glu_layout": "concatenated"}},
])
def test_concatenated_rows_load_as_saved(tmp_path, one_rank_group, common):
    write_checkpoint(tmp_path, common, list(range(ROWS)))
    model, optimizer = Experts(), ExpAvgOptimizer()
    checkpointing.load(str(tmp_path), model, optimizer, Scheduler(), run_args())
    assert all(torch.equal(getattr(model, f"weight{e}").detach(), concatenated("weight", e)) for e in range(E))
    assert all(torch.equal(optimizer.loaded["exp_avg"][f"bias{e}"], -concatenated("bias", e)) for e in range(E))


# --- refusals, before anything is read ------------------------------------------------------


class Untouched:
    """Model/optimizer/scheduler that fails the test if load gets as far as using it."""

    def __getattr__(self, name):
        raise AssertionError(f"load used {name} after a refusal")


def refusal(tmp_path, monkeypatch, common, args):
    """load's error for a checkpoint with ``common`` state; asserts nothing was read."""
    path = checkpoint_root(tmp_path, 4) / "iter_0000004"
    monkeypatch.setattr(checkpointing, "read_common_state", lambda p: common)
    monkeypatch.setattr(dist_checkpointing, "load", lambda *a, **kw: pytest.fail("tensors were read"))
    with pytest.raises(CheckpointError) as refused:
        checkpointing.load(str(tmp_path), Untouched(), Untouched(), Untouched(), args)
    message = str(refused.value)
    assert "\n" not in message
    return message, path


@pytest.mark.parametrize("common, shown", [
    ({"args": {}, "moe_patches_expert_fc1": {"glu_layout": "blocked"}},
     "{'glu_layout': 'blocked'} (from moe_patches_expert_fc1)"),
    ({"args": {}, "moe_patches_expert_fc1": {"glu_layout": "interleaved"}},
     "{'glu_layout': 'interleaved'} (from moe_patches_expert_fc1)"),
    ({"args": {}, "moe_patches_expert_fc1": {"glu_layout": "interleaved", "glu_interleave_size": 0}},
     "{'glu_layout': 'interleaved', 'glu_interleave_size': 0} (from moe_patches_expert_fc1)"),
    ({"args": {}, "moe_patches_expert_fc1": "concatenated"}, "'concatenated' (from moe_patches_expert_fc1)"),
    ({"args": megatron_lm_args(moe_mlp_glu_interleave_size="32")},
     "{'glu_layout': 'interleaved', 'glu_interleave_size': '32'} (from moe_mlp_glu_interleave_size in its args)"),
])
def test_unknown_layout_is_refused_by_name(tmp_path, monkeypatch, common, shown):
    message, path = refusal(tmp_path, monkeypatch, common, run_args())
    assert message == (
        f"checkpoint {path} holds the experts' FC1 rows in an unknown GLU layout, {shown}; this version reads "
        "'concatenated', or 'interleaved' with a positive glu_interleave_size: load it with the version that "
        "saved it, or point --load at another checkpoint")


def test_interleaved_rows_of_another_expert_tensor_parallel_size_are_refused(tmp_path, monkeypatch):
    common = {"args": megatron_lm_args(expert_tensor_parallel_size=2)}
    message, path = refusal(tmp_path, monkeypatch, common, run_args(tensor_model_parallel_size=1))
    assert message == (
        f"checkpoint {path} holds the experts' FC1 rows interleaved (block 2) per expert-tensor-parallel shard "
        "of 2, and this run has 1: resume with --expert-tensor-parallel-size 2 to convert them")


def test_interleaved_rows_with_flat_optimizer_buffers_are_refused(tmp_path, monkeypatch):
    common = {"args": megatron_lm_args(dist_ckpt_optim_fully_reshardable=False)}
    message, path = refusal(tmp_path, monkeypatch, common, run_args())
    assert message == (
        f"checkpoint {path} holds the experts' FC1 rows interleaved (block 2) and its distributed-optimizer "
        "states as dp_reshardable flat buffers, whose FC1 rows cannot be converted: resume with --no-load-optim, "
        "or use a checkpoint saved with --dist-ckpt-optim-fully-reshardable")


def test_flat_optimizer_buffers_do_not_matter_without_the_optimizer(tmp_path, one_rank_group):
    write_checkpoint(tmp_path, {"args": megatron_lm_args(dist_ckpt_optim_fully_reshardable=False)}, SAVED_ORDER)
    model = Experts()
    checkpointing.load(str(tmp_path), model, ExpAvgOptimizer(), Scheduler(), run_args(no_load_optim=True))
    assert torch.equal(model.bias1.detach(), concatenated("bias", 1))
