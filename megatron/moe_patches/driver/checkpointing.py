"""torch_dist checkpoints for pretrain_gpt.py, in Megatron-LM's directory layout.

``<save>/iter_0000100/`` holds the sharded model and optimizer plus the common
state (iteration, scheduler, the run's args as a plain dict);
``<save>/latest_checkpointed_iteration.txt`` names the newest. ``--use-checkpoint-args``
takes the model-defining args and the MoE patch flags from the checkpoint, with
Megatron's ``_set_arg`` rule: a saved value is taken where the current one is unset,
and always for on/off flags (a store_true default is never "unset"). It reads Megatron-LM's
checkpoints too, whose args are its argparse Namespace (``args_from_megatron_lm``).

What ``--load`` holds is judged before start-up from the files alone
(``checkpoint.on_disk``: ``find_checkpoint``, ``incomplete_reason``, ``read_common_state``),
which Megatron-LM's loop shares.

``save`` is crash-safe: the iteration is written as ``iter_NNNNNNN.incomplete`` and renamed
to its name once all ranks have written it and rank 0 has flushed it; the tracker is then
replaced by rename too. Killed at any point, a save leaves the tracker naming a complete
checkpoint (the previous one, or this one) and, at most, an ``.incomplete`` directory that
nothing loads and the next save removes.

``load`` reads the optimizer states in the
format the checkpoint was saved in (``checkpoint_format``), refuses, before reading
anything, a checkpoint that cannot fill every sharded tensor of the model and optimizer
(``check_checkpoint_covers``), and fits the optimizer's plain state to the current
optimizer chain across EP changes (``fit_optimizer_state``). With ``--no-load-optim`` it
reads the model and the iteration only and refills the fp32 main params
(``reload_main_params``): from the loaded weights, or with ``--load-main-params-from-ckpt``
from the checkpoint's model tensors (Megatron-LM's rules).

The common state also says how the routed experts' gated FC1 rows are laid out
(``GLU_LAYOUT_KEY``; always concatenated here). ``load`` reads that first
(``saved_glu_layout``): a checkpoint holding FC1 block-interleaved (Megatron-LM's, when
its experts interleave) is converted to the concatenated layout while loading, optimizer
states included; an unknown layout is refused before any tensor is read.
"""

import argparse
import errno
import os
import re
import shutil
from typing import Iterator, List, Optional

# The files-only reading lives beside the patch set's other checkpoint code, for Megatron-LM's
# loop too; the driver's callers and tests find its names here as well.
from megatron.moe_patches.checkpoint.on_disk import (  # noqa: F401
    COMMON_FILE,
    CONFIG_FILE,
    INCOMPLETE,
    KILLED_SAVE,
    REPLACED,
    REPLACED_COPY,
    SAVED_ITERATION,
    TENSOR_INDEX,
    TRACKER,
    TRACKER_READ_LIMIT,
    UPSTREAM_COMMON_KEY,
    CheckpointError,
    find_checkpoint,
    incomplete_reason,
    iteration_dir,
    latest_iteration,
    missing_checkpoint_refusal,
    newest_complete_iteration,
    optimizer_layouts_saved_at,
    read_common_state,
    read_tensor_index,
)
from megatron.moe_patches.driver import compat
from megatron.moe_patches.driver.patch_args import restore_args_from_checkpoint


# Args that define the model's shape: a checkpoint is only loadable with its own.
MODEL_ARGS = [
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "seq_length", "max_position_embeddings", "vocab_size", "normalization",
    "swiglu", "disable_bias_linear", "position_embedding_type", "rotary_base", "rotary_percent",
    "untie_embeddings_and_output_weights", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
    "moe_router_topk", "moe_shared_expert_intermediate_size",
]
# Distributed-optimizer state formats: per-DP-rank flat buffers (survive a DP change), or
# per parameter under the model's keys (survive DP/EP and expert-layout changes; F7 maps
# grouped parameters to their per-expert keys). megatron-core builds one optimizer at EP=1
# but a ChainedOptimizer (dense + expert) at EP>1, which prefixes keys with "chained_N."
# unless told not to: per-parameter keys need no prefix, so EP sizes share them.
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


# How the routed experts' gated FC1 rows lie in the checkpoint, under a common-state key of
# our own (none of megatron-core's or Megatron-LM's starts with "moe_patches"). This driver
# always saves them concatenated (glu_interleave converts at the boundary). Megatron-LM
# (megatron-core 0.19.2) records no layout: its grouped experts save FC1 as held in memory,
# interleaved when moe_mlp_glu_interleave_size is set, which only its saved args show, and
# it checks nothing on load (nor can it read this driver's dict args), so there is no form of
# ours it would understand. Not in content_metadata: there, a dict without its optimizer
# sharding type would break Megatron-LM's optimizer load.
GLU_LAYOUT_KEY = "moe_patches_expert_fc1"
SAVED_GLU_LAYOUT = {"glu_layout": "concatenated"}
# The checkpoint keys of routed experts' FC1 (TE grouped and sequential experts alike).
EXPERT_FC1 = re.compile(r"(^|\.)mlp\.experts\.linear_fc1\.(weight|bias)$")


def optimizer_metadata(args) -> dict:
    return FULLY_RESHARDABLE if getattr(args, "dist_ckpt_optim_fully_reshardable", False) else DP_RESHARDABLE


def checkpoint_format(saved: dict, glu_interleave_size: Optional[int] = None) -> argparse.Namespace:
    """How ``load`` reads a checkpoint's optimizer states: in the format the checkpoint was
    saved in (its own args), whatever this run's --dist-ckpt-optim-fully-reshardable says
    (that flag only decides how this run saves); and its expert FC1 rows: interleaved with
    ``glu_interleave_size`` (``saved_glu_layout``) or, given None, concatenated."""
    return argparse.Namespace(
        dist_ckpt_optim_fully_reshardable=bool(saved.get("dist_ckpt_optim_fully_reshardable", False)),
        checkpoint_glu_interleave_size=glu_interleave_size,
    )


def _megatron_lm_glu_layout(args) -> Optional[dict]:
    """The FC1 layout of a Megatron-LM checkpoint (saved args: its argparse Namespace), from
    those args: its TE grouped experts (TEGroupedMLP and the inference subclass) keep and
    save FC1 interleaved when a gated model sets moe_mlp_glu_interleave_size; sequential
    experts (the local implementation, or no grouped GEMM) ignore it."""
    if not isinstance(args, argparse.Namespace):
        return None  # this driver saves a dict
    size = getattr(args, "moe_mlp_glu_interleave_size", None)
    gated = getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)
    impl = getattr(args, "transformer_impl", "transformer_engine")
    grouped = impl == "inference_optimized" or (impl != "local" and getattr(args, "moe_grouped_gemm", False))
    if size is None or not gated or not grouped:
        return None
    return {"glu_layout": "interleaved", "glu_interleave_size": size}


def saved_glu_layout(common: dict, path: str) -> Optional[int]:
    """The block size the expert FC1 rows of the checkpoint at ``path`` (its common state
    ``common``) are interleaved with; None when they are concatenated. An unknown layout
    raises CheckpointError naming it."""
    record, source = common.get(GLU_LAYOUT_KEY), GLU_LAYOUT_KEY
    if record is None:
        # No record: this driver's older checkpoints (FC1 always saved concatenated), stock
        # megatron-core 0.16.1 ones (no interleave option), and Megatron-LM ones whose
        # experts did not interleave are concatenated; Megatron-LM ones that did say so in
        # their args.
        record, source = _megatron_lm_glu_layout(common.get("args")), "moe_mlp_glu_interleave_size in its args"
        if record is None:
            return None
    layout = record.get("glu_layout") if isinstance(record, dict) else None
    size = record.get("glu_interleave_size") if isinstance(record, dict) else None
    if layout == "concatenated":
        return None
    if layout == "interleaved" and isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    raise CheckpointError(
        f"checkpoint {path} holds the experts' FC1 rows in an unknown GLU layout, {record!r} (from {source}); "
        "this version reads 'concatenated', or 'interleaved' with a positive glu_interleave_size: load it "
        "with the version that saved it, or point --load at another checkpoint"
    )


def _expert_tensor_parallel_size(args: dict) -> int:
    return args.get("expert_tensor_parallel_size") or args.get("tensor_model_parallel_size") or 1


def check_glu_conversion(args: argparse.Namespace, saved: dict, size: int, path: str, with_optimizer: bool) -> None:
    """Refuse, before loading anything, an interleaved FC1 checkpoint that cannot be converted."""
    where = f"checkpoint {path} holds the experts' FC1 rows interleaved (block {size})"
    saved_tp, run_tp = _expert_tensor_parallel_size(saved), _expert_tensor_parallel_size(vars(args))
    if saved_tp != run_tp:  # each shard's rows were interleaved on their own
        raise CheckpointError(
            f"{where} per expert-tensor-parallel shard of {saved_tp}, and this run has {run_tp}: "
            f"resume with --expert-tensor-parallel-size {saved_tp} to convert them"
        )
    if with_optimizer and saved.get("use_distributed_optimizer") and not saved.get("dist_ckpt_optim_fully_reshardable"):
        raise CheckpointError(
            f"{where} and its distributed-optimizer states as dp_reshardable flat buffers, whose FC1 rows "
            "cannot be converted: resume with --no-load-optim, or use a checkpoint saved with "
            "--dist-ckpt-optim-fully-reshardable"
        )


def read_interleaved_fc1(model_state, size: int):
    """``model_state`` (the model's sharded state dict, changed in place) reading expert FC1
    rows saved interleaved with block ``size``: the optimizer's states follow its entries."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron.moe_patches.experts.glu_interleave import interleaved_checkpoint_factory

    def convert(entry):
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and EXPERT_FC1.search(entry.key):
            return interleaved_checkpoint_factory(entry, size)
        return entry

    return dict_list_map_inplace(convert, model_state)


# Megatron-LM saves its whole argparse Namespace as the common state's "args" (this driver
# saves a dict). Its model-defining args mostly have this driver's names; the rest follow
# its rules: --disable-bias-linear stores add_bias_linear=False; num_query_groups counts
# only with --group-query-attention (one group per head otherwise); and the embedding
# table has padded_vocab_size rows (the tokenizer's size, eod included, padded), which is
# what this driver's --vocab-size must come to. Model features Megatron-LM builds and this
# driver does not are refused by name, each with the value that means "not used".
MEGATRON_LM_FEATURES_NOT_BUILT = (
    ("multi_latent_attention", False),
    ("squared_relu", False),
    ("quick_geglu", False),
    ("mtp_num_layers", None),
    ("moe_layer_freq", 1),
    ("rotary_percent", 1.0),
)
MEGATRON_LM_CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
}


def args_from_megatron_lm(saved: argparse.Namespace, path: str) -> dict:
    """The args of a Megatron-LM checkpoint (its saved Namespace) as this driver's saved-args
    dict; CheckpointError for a model this driver does not build."""
    args = dict(vars(saved))
    for name, unused in MEGATRON_LM_FEATURES_NOT_BUILT:
        value = args.get(name, unused)
        if unused in (None, False):
            used = bool(value)
        elif isinstance(value, (list, tuple)):  # --moe-layer-freq as one entry per layer
            used = any(entry != unused for entry in value)
        else:
            used = value != unused
        if used:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {path} was saved by Megatron-LM with {flag if value is True else f'{flag} {value}'}, "
                "a model pretrain_gpt.py does not build: resume it with Megatron-LM, or point --load elsewhere"
            )
    for name, choices in MEGATRON_LM_CHOICES.items():
        if args.get(name) is not None and args[name] not in choices:
            raise CheckpointError(
                f"checkpoint {path} was saved by Megatron-LM with --{name.replace('_', '-')} {args[name]}, which "
                f"pretrain_gpt.py does not build (it offers {', '.join(choices)}): resume it with Megatron-LM, or "
                "point --load elsewhere"
            )
    if "add_bias_linear" in args and "disable_bias_linear" not in args:
        args["disable_bias_linear"] = not args["add_bias_linear"]
    if "group_query_attention" in args and not args["group_query_attention"]:
        args["num_query_groups"] = args.get("num_attention_heads")  # multi-head attention
    if args.get("padded_vocab_size"):
        args["vocab_size"] = args["padded_vocab_size"]
    return args


def restore_args(args: argparse.Namespace, saved: dict) -> List[str]:
    """Apply a checkpoint's saved args (a dict) to ``args``; return the names that changed.

    Model-defining args always come from the checkpoint (the weights fix them); the MoE
    patch flags follow ``patch_args.restore_args_from_checkpoint`` (bools forced).
    """
    before = vars(args).copy()
    for name in MODEL_ARGS:
        if saved.get(name) is not None:
            setattr(args, name, saved[name])
    restore_args_from_checkpoint(args, argparse.Namespace(**saved))
    return [name for name, value in vars(args).items() if before.get(name) != value]


def _common_state_strategy():
    """A load strategy for megatron-core's ``dist_checkpointing.load`` that reads the common
    state through ``read_common_state``: its default one reads common.pt only."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonState(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_common_state(str(checkpoint_dir))

    return CommonState()


def saved_args(root: str) -> dict:
    """The args dict saved with the checkpoint ``--load root`` resumes from (CPU only, no
    process group: usable before start-up): this driver's dict, or a Megatron-LM
    checkpoint's Namespace in this driver's names (``args_from_megatron_lm``)."""
    path, missing = find_checkpoint(root)
    if path is None:
        raise CheckpointError(f"--load {root}: {missing}")
    saved = args_saved_at(path)
    if saved is None:
        raise CheckpointError(
            f"{path} holds no saved args (a checkpoint of neither pretrain_gpt.py nor Megatron-LM); point "
            "--load at one of theirs, or drop --use-checkpoint-args"
        )
    return saved


def args_saved_at(path: str) -> Optional[dict]:
    """The args dict saved with the checkpoint at ``path`` (an iteration directory), as
    ``saved_args`` returns it; None where its common state holds none."""
    try:
        saved = read_common_state(path).get("args")
    except CheckpointError:
        raise
    except Exception as err:  # megatron-core's CheckpointingException, unpickling errors
        reason = " ".join(str(err).split())[:300]
        raise CheckpointError(
            f"cannot read the saved args of {path} ({reason}): the save did not finish, or it is a checkpoint "
            "of neither pretrain_gpt.py nor Megatron-LM; point --load at a complete one"
        ) from None
    if isinstance(saved, argparse.Namespace):  # saved by Megatron-LM
        return args_from_megatron_lm(saved, path)
    return saved if isinstance(saved, dict) else None


def saved_concatenated_fc1(model_state, memory_size: int):
    """``model_state`` (changed in place) holding expert FC1 rows that the model keeps
    interleaved with block ``memory_size`` and puts in its sharded state dict as they are
    (megatron-core's own grouped experts, ``compat.memory_glu_interleave``): saved and
    loaded concatenated instead, optimizer states included, as this driver's checkpoints
    always hold them (``SAVED_GLU_LAYOUT``)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from megatron.moe_patches.experts.glu_interleave import concatenated_factory

    def convert(entry):
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and EXPERT_FC1.search(entry.key):
            return concatenated_factory(entry, memory_size)
        return entry

    return dict_list_map_inplace(convert, model_state)


def _model_state(model, args, loading):
    state = model.sharded_state_dict()
    memory_size = compat.memory_glu_interleave(getattr(model, "config", None))
    if memory_size:
        state = saved_concatenated_fc1(state, memory_size)
    size = getattr(args, "checkpoint_glu_interleave_size", None) if loading else None
    return read_interleaved_fc1(state, size) if size else state


def _state(model, optimizer, scheduler, iteration, args, loading):
    """The checkpoint's state: saving, ``args`` are the run's; loading, ``checkpoint_format``'s."""
    state = {"model": _model_state(model, args, loading)}
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], is_loading=loading, metadata=optimizer_metadata(args)
    )
    if not loading:
        state.update(iteration=iteration, opt_param_scheduler=scheduler.state_dict(), args=vars(args).copy())
        state[GLU_LAYOUT_KEY] = dict(SAVED_GLU_LAYOUT)
    return state


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync(path: str) -> None:
    """Flush ``path`` (a file's bytes, or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems (network ones) refuse to flush a directory: nothing more to do there.
        if not (os.path.isdir(path) and err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """Flush every file under ``path`` and the directories themselves. megatron-core's tensor
    writers flush their own files (on every node); common.pt and metadata.json it does not."""
    for folder, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)


def _remove_killed_saves(root: str) -> None:
    """Clear what killed saves left under ``root``: every ``iter_*.incomplete`` directory, and
    each ``iter_*.replaced`` one whose iteration has its name again (while it has not, the
    copy is the checkpoint ``find_checkpoint`` resumes from)."""
    for name in os.listdir(root):
        leftover = os.path.join(root, name)
        if KILLED_SAVE.fullmatch(name):
            _remove(leftover)
        elif REPLACED_COPY.fullmatch(name) and os.path.lexists(leftover[:-len(REPLACED)]):
            _remove(leftover)


def _publish(root: str, staging: str, path: str) -> None:
    """Give the fully written iteration in ``staging`` its name ``path``: renames, so a reader
    sees the whole checkpoint or none of it. An older directory of that name (a re-save of the
    iteration) is moved aside first and removed once the new one has the name."""
    _fsync_tree(staging)
    replaced = path + REPLACED
    if os.path.lexists(path):
        os.rename(path, replaced)
    os.rename(staging, path)
    _fsync(root)
    _remove(replaced)


def _write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in the tracker: written beside it, flushed, then renamed over it, so
    the tracker names the previous checkpoint or this one, never a cut-short number."""
    tracker = os.path.join(root, TRACKER)
    written = tracker + ".tmp"
    with open(written, "w", encoding="utf-8") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(written, tracker)
    _fsync(root)


def save(root: str, iteration: int, model, optimizer, scheduler, args) -> str:
    """Save a torch_dist checkpoint of ``model`` (the unwrapped GPTModel) and the optimizer as
    ``<root>/iter_NNNNNNN``, crash-safe: every rank writes into ``iter_NNNNNNN.incomplete``;
    after all have written (megatron-core: common.pt, the tensor files and their index, then
    metadata.json), rank 0 flushes it to the disk, renames it to its name and then names it
    in the tracker. A save killed at any point leaves the tracker naming the previous
    checkpoint, complete, or this one, complete. Returns the checkpoint's directory."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    staging = path + INCOMPLETE
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        _remove_killed_saves(root)
        os.makedirs(staging)
    dist.barrier()  # the staging directory exists, empty, for every rank
    dist_checkpointing.save(_state(model, optimizer, scheduler, iteration, args, loading=False), staging)
    dist.barrier()  # every rank has written its part
    if dist.get_rank() == 0:
        _publish(root, staging, path)
        _write_tracker(root, iteration)
    dist.barrier()  # no rank goes on (or ends the run) before the checkpoint is named
    return path


def check_optimizer_layout(args: argparse.Namespace, saved: dict) -> None:
    """Refuse, before loading anything, optimizer states saved in another memory layout: the
    patched optimizer's own rule (F7; it checks again at load, in any loop), read from the
    checkpoint's args, so a mismatch stops the run before any GPU work."""
    from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_FIELDS, bucket_layout_refusal

    if not saved.get("use_distributed_optimizer"):
        return  # torch optimizers' states are per parameter
    sharding = "fully_reshardable" if saved.get("dist_ckpt_optim_fully_reshardable") else "dp_reshardable"
    layout_of = lambda values: {n: values.get(n, stock) for n, stock in LAYOUT_FIELDS.items()}
    refusal = bucket_layout_refusal(sharding, layout_of(saved), layout_of(vars(args)))
    if refusal is not None:
        raise ValueError(refusal)


def _sharded_tensors(tree) -> Iterator:
    """Every ShardedTensor in a sharded state dict, factories built (F4/F7 ones nest)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for value in nested_values([tree]):
        if isinstance(value, ShardedTensorFactory):
            yield from _sharded_tensors(value.build())
        elif isinstance(value, ShardedTensor):
            yield value


def _overlap(offsets_a, sizes_a, offsets_b, sizes_b) -> int:
    volume = 1
    for oa, sa, ob, sb in zip(offsets_a, sizes_a, offsets_b, sizes_b):
        volume *= max(0, min(oa + sa, ob + sb) - max(oa, ob))
    return volume


def uncovered_tensors(sharded_state_dict, metadata) -> List[str]:
    """What a torch_dist checkpoint (its DCP ``metadata``) cannot fill in ``sharded_state_dict``.

    torch DCP reads the saved chunks that overlap each target and leaves the rest of the
    target as it was: a checkpoint missing one expert's chunk would load "successfully"
    with that expert still at its initial weights. So every ShardedTensor must find its
    key, its global shape, and its whole local region among the saved chunks (saved chunks
    never overlap, so covered volume = local volume means fully covered).
    """
    problems = []
    for tensor in _sharded_tensors(sharded_state_dict):
        saved = metadata.state_dict_metadata.get(tensor.key)
        if saved is None or not hasattr(saved, "chunks"):
            problems.append(f"{tensor.key}: not in the checkpoint")
            continue
        if tuple(saved.size) != tuple(tensor.global_shape) and not tensor.allow_shape_mismatch:
            problems.append(f"{tensor.key}: shape {tuple(saved.size)} in the checkpoint, "
                            f"{tuple(tensor.global_shape)} in the model")
            continue
        if tensor.flattened_range is not None or tensor.allow_shape_mismatch:
            continue  # regions not expressible as one box; DCP and megatron-core check these
        offsets = tuple(tensor.global_offset)
        sizes = (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape)
        volume = 1
        for size in sizes:
            volume *= size
        covered = sum(_overlap(offsets, sizes, c.offsets, c.sizes) for c in saved.chunks)
        if covered != volume:
            problems.append(f"{tensor.key}: the region at offset {offsets} of size {sizes} is "
                            f"{volume - covered} of {volume} elements short in the checkpoint")
    return problems


class IncompleteCheckpointError(RuntimeError):
    pass


def check_checkpoint_covers(sharded_state_dict, path: str) -> None:
    """Refuse, on every rank and before anything is read, a checkpoint that cannot fill the model."""
    import torch.distributed as dist

    problems = uncovered_tensors(sharded_state_dict, read_tensor_index(path))
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, problems)
        problems = sorted({p for rank_problems in per_rank for p in rank_problems})
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise IncompleteCheckpointError(
            f"checkpoint {path} does not match this model; nothing was loaded:\n  {shown}\n"
            "Check that --load points at a checkpoint of this model (same --num-experts, hidden sizes) "
            "and that the save finished."
        )


def fit_optimizer_state(optimizer, loaded: dict):
    """``loaded`` (the optimizer part of a loaded checkpoint) shaped for ``optimizer.load_state_dict``.

    Per-parameter states come back shaped as asked, but megatron-core keeps an optimizer's
    plain state (param groups with ``step``, the sharding type) in the checkpoint's common
    part, shaped like the *saving* optimizer: a ChainedOptimizer of one (EP=1: experts are
    ordinary data-parallel params) or of two (EP>1: dense, expert; int keys). Across an EP
    change each current optimizer gets the plain state with every saved param group, each
    also offered for the other ``is_expert_parallel`` value: DistributedOptimizer matches
    groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), and an expert
    parameter's hyperparameters do not depend on EP.
    """
    count = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    wanted = [loaded] if count == 1 else [loaded.get(i, {}) for i in range(count)]
    if all("optimizer" in part for part in wanted):
        return loaded  # saved by an optimizer of this shape
    saved = [loaded] if "optimizer" in loaded else [
        loaded[k] for k in sorted(k for k in loaded if isinstance(k, int)) if "optimizer" in loaded[k]
    ]
    if not saved:
        raise ValueError("the checkpoint's optimizer state has no param groups (not a megatron-core optimizer's)")
    exact = [group for entry in saved for group in entry["optimizer"]["param_groups"]]
    other_ep = [{**group, "is_expert_parallel": not group["is_expert_parallel"]}
                for group in exact if "is_expert_parallel" in group]
    plain = {k: v for k, v in saved[0].items() if not isinstance(k, int) and k != "param_state"}
    plain["optimizer"] = {**plain["optimizer"], "param_groups": other_ep + exact}  # last match wins
    fitted = [{**plain, **{k: v for k, v in part.items() if not isinstance(k, int)}} for part in wanted]
    return fitted[0] if count == 1 else fitted


def reload_main_params(optimizer, loaded: Optional[dict]) -> None:
    """Refill the fp32 main params after a load without optimizer states: from the model's
    (just loaded) params, or, given ``loaded`` ({"model": tensors}), from the checkpoint's
    model tensors (megatron-core's ``reload_model_params(state_dict)``).

    Each optimizer of a chain gets ``loaded`` itself: megatron-core's ChainedOptimizer hands
    a one-chunk state dict to its first optimizer only, so at EP > 1 the expert optimizer's
    main params would come from the model instead of the checkpoint."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        part.reload_model_params(state_dict=loaded)


def load(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> int:
    """Load the newest checkpoint under ``root``; returns its iteration."""
    from megatron.core import dist_checkpointing

    path, missing = find_checkpoint(root)
    if path is None:
        raise CheckpointError(f"--load {root}: {missing}")
    iteration = latest_iteration(root)
    common = read_common_state(path)
    saved = common["args"]
    if isinstance(saved, argparse.Namespace):  # Megatron-LM saves the Namespace itself
        saved = vars(saved)
    glu_interleave_size = saved_glu_layout(common, path)
    with_optimizer = not getattr(args, "no_load_optim", False)
    if glu_interleave_size:
        check_glu_conversion(args, saved, glu_interleave_size, path, with_optimizer)
    reading = checkpoint_format(saved, glu_interleave_size)
    if with_optimizer:
        check_optimizer_layout(args, saved)
        state = _state(model, optimizer, scheduler, iteration, reading, loading=True)
    else:  # the model only: the saved optimizer states (and their layout) do not matter
        state = {"model": _model_state(model, reading, loading=True)}
    check_checkpoint_covers(state, path)
    if compat.load_takes_common_strategy():
        # megatron-core merges the common part (the optimizer's plain state) in here, read by
        # default from common.pt only, which megatron-core 0.19.2's checkpoints lack.
        loaded = dist_checkpointing.load(state, path, common_strategy=_common_state_strategy())
    else:  # a megatron-core (0.19.2) that reads both forms of the common state itself
        loaded = dist_checkpointing.load(state, path)
    model.load_state_dict(loaded["model"])
    if with_optimizer:
        optimizer.load_state_dict(fit_optimizer_state(optimizer, loaded["optimizer"]))
        scheduler.load_state_dict(common["opt_param_scheduler"])
    elif args.bf16:  # Megatron-LM: only mixed precision keeps main params apart from the model's
        from_checkpoint = getattr(args, "load_main_params_from_ckpt", False)
        reload_main_params(optimizer, {"model": loaded["model"]} if from_checkpoint else None)
    return int(common["iteration"])
