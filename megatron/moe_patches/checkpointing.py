"""torch_dist checkpoints for pretrain_gpt.py, in Megatron-LM's directory layout.

``<save>/iter_0000100/`` holds the sharded model and optimizer plus the common
state (iteration, scheduler, the run's args as a plain dict);
``<save>/latest_checkpointed_iteration.txt`` names the newest. ``--use-checkpoint-args``
takes the model-defining args and the MoE patch flags from the checkpoint, with
Megatron's ``_set_arg`` rule: a saved value is taken where the current one is unset,
and always for on/off flags (a store_true default is never "unset").
"""

import argparse
import os
from typing import List, Optional

from megatron.moe_patches.arguments import restore_args_from_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"

# Args that define the model's shape: a checkpoint is only loadable with its own.
MODEL_ARGS = [
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "seq_length", "max_position_embeddings", "vocab_size", "normalization",
    "swiglu", "disable_bias_linear", "position_embedding_type", "rotary_base",
    "untie_embeddings_and_output_weights", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
    "moe_router_topk", "moe_shared_expert_intermediate_size",
]
# Args that change the parameters' memory layout but not the model's checkpoint keys: the
# distributed optimizer's dp_reshardable states are flat buffers in memory layout, so they
# only load into the same layout (F4's GLU interleave permutes FC1 rows; a single grouped
# weight replaces E parameters by one). Converting them is F7's work (issue #5).
OPTIMIZER_LAYOUT_ARGS = ["moe_mlp_glu_interleave_size", "moe_single_grouped_weight", "moe_single_grouped_bias"]
# Distributed-optimizer state formats: per-DP-rank flat buffers (survive a DP change), or
# per parameter under the model's keys (survive DP/EP and expert-layout changes; F7 maps
# grouped parameters to their per-expert keys). megatron-core builds one optimizer at EP=1
# but a ChainedOptimizer (dense + expert) at EP>1, which prefixes keys with "chained_N."
# unless told not to: per-parameter keys need no prefix, so EP sizes share them.
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def optimizer_metadata(args) -> dict:
    return FULLY_RESHARDABLE if getattr(args, "dist_ckpt_optim_fully_reshardable", False) else DP_RESHARDABLE


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as handle:
        return int(handle.read().strip())


def restore_args(args: argparse.Namespace, saved: dict) -> List[str]:
    """Apply a checkpoint's saved args (a dict) to ``args``; return the names that changed.

    Model-defining args always come from the checkpoint (the weights fix them); the MoE
    patch flags follow ``arguments.restore_args_from_checkpoint`` (bools forced).
    """
    before = vars(args).copy()
    for name in MODEL_ARGS:
        if saved.get(name) is not None:
            setattr(args, name, saved[name])
    restore_args_from_checkpoint(args, argparse.Namespace(**saved))
    return [name for name, value in vars(args).items() if before.get(name) != value]


def saved_args(root: str) -> dict:
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER} there")
    return dist_checkpointing.load_common_state_dict(iteration_dir(root, iteration))["args"]


def _state(model, optimizer, scheduler, iteration, args, loading):
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], is_loading=loading, metadata=optimizer_metadata(args)
    )
    if not loading:
        state.update(iteration=iteration, opt_param_scheduler=scheduler.state_dict(), args=vars(args).copy())
    return state


def save(root: str, iteration: int, model, optimizer, scheduler, args) -> str:
    """Save a torch_dist checkpoint of ``model`` (the unwrapped GPTModel) and the optimizer."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_state(model, optimizer, scheduler, iteration, args, loading=False), path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w", encoding="utf-8") as handle:
            handle.write(str(iteration))
    dist.barrier()
    return path


def check_optimizer_layout(args: argparse.Namespace, saved: dict) -> None:
    """Refuse, before loading anything, optimizer states saved in another memory layout."""
    if saved.get("dist_ckpt_optim_fully_reshardable"):
        return  # states saved per parameter in the checkpoint layout (F7, glu_interleave)
    drift = [name for name in OPTIMIZER_LAYOUT_ARGS if name in saved and saved[name] != getattr(args, name, None)]
    if drift:
        pairs = ", ".join(f"--{n.replace('_', '-')} {saved[n]} (checkpoint) vs {getattr(args, n, None)} (now)"
                          for n in drift)
        raise ValueError(
            f"the checkpoint's optimizer states were saved in another parameter layout: {pairs}. "
            "Resume with the checkpoint's value (or --use-checkpoint-args)."
        )


def load(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> int:
    """Load the newest checkpoint under ``root``; returns its iteration."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER} there")
    path = iteration_dir(root, iteration)
    saved = dist_checkpointing.load_common_state_dict(path)["args"]
    check_optimizer_layout(args, saved)
    # The checkpoint's format decides how its optimizer states are read.
    layout = argparse.Namespace(dist_ckpt_optim_fully_reshardable=saved.get("dist_ckpt_optim_fully_reshardable", False))
    loaded = dist_checkpointing.load(_state(model, optimizer, scheduler, iteration, layout, loading=True), path)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    common = dist_checkpointing.load_common_state_dict(path)
    scheduler.load_state_dict(common["opt_param_scheduler"])
    return int(common["iteration"])
