"""GLU block interleave for the op-fuser grouped MLP (part of F4).

A gated FC1 stores its 2F output rows *concatenated*: gate rows 0..F-1, then linear
rows F..2F-1 (megatron-core's layout, and every checkpoint's). TE's fused GLU kernels
can read them *block-interleaved* with block size s instead: s gate rows, s linear
rows, s gate rows, ... (``moe_mlp_glu_interleave_size = s``).

The op-fuser experts keep their FC1 parameters interleaved in memory and convert at the
checkpoint boundary, so checkpoints always hold the concatenated layout and load with
interleave on or off: plain state dicts through module hooks, distributed ones through
``concatenated_factory``, which the optimizer applies to its states too (main params,
Adam moments are interleaved in memory like the parameters). The two conversions are
exact inverses (pure row permutations).

Checkpoints written elsewhere may hold FC1 interleaved (a model that keeps FC1 interleaved
in memory and saves it as it is): ``interleaved_checkpoint_factory`` reads those, putting
the same permutation between the checkpoint and the entry's own layout.
"""

from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

# Set on tensors that concatenated_factory already put back into the interleaved layout, so
# the module's load hook (the next stop of a distributed model load) leaves them alone.
MERGED_INTERLEAVED = "_glu_already_interleaved"


def _blocks(rows: int, size: int) -> int:
    if rows % (2 * size):
        raise ValueError(f"GLU interleave size {size} does not divide half of {rows} rows")
    return rows // (2 * size)


def to_interleaved(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """Concatenated [gate; linear] rows along ``dim`` -> blocks of ``size`` alternating."""
    t = t.movedim(dim, 0)
    blocks = _blocks(t.shape[0], size)
    out = t.reshape(2, blocks, size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return out.movedim(0, dim).contiguous()


def to_concatenated(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of ``to_interleaved``."""
    t = t.movedim(dim, 0)
    blocks = _blocks(t.shape[0], size)
    out = t.reshape(blocks, 2, size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return out.movedim(0, dim).contiguous()


def _expert_keys(state_dict, prefix: str):
    for key in list(state_dict):
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name and name.rstrip("0123456789") in ("weight", "bias") and name[-1].isdigit():
            yield key


def interleave_parameters(linear_fc1, size: int) -> None:
    """Put FC1's per-expert weights and biases into the interleaved layout, in place, and
    make its state dicts speak the concatenated layout (save and load)."""
    with torch.no_grad():  # in place: the parameters keep their storage (and DDP's buffer, if any)
        for name, param in linear_fc1.named_parameters(recurse=False):
            if name.rstrip("0123456789") in ("weight", "bias"):
                param.copy_(to_interleaved(param.detach(), size))

    def save_concatenated(module, state_dict, prefix, local_metadata):
        for key in _expert_keys(state_dict, prefix):
            # keep_vars callers (sharded_state_dict) get the live parameter and wrap it in
            # concatenated_factory, so optimizer states convert the same way.
            if not isinstance(state_dict[key], torch.nn.Parameter):
                state_dict[key] = to_concatenated(state_dict[key].detach(), size)
        return state_dict

    def load_interleaved(module, state_dict, prefix, *args):
        for key in _expert_keys(state_dict, prefix):
            if not getattr(state_dict[key], MERGED_INTERLEAVED, False):  # a distributed load did it
                state_dict[key] = to_interleaved(state_dict[key], size)

    linear_fc1._register_state_dict_hook(save_concatenated)
    linear_fc1._register_load_state_dict_pre_hook(load_interleaved, with_module=True)
    linear_fc1.glu_interleave_size = size


def _relayout(entry, to_saved, from_saved) -> ShardedTensorFactory:
    """``entry`` (a ShardedTensor or a factory such as the SwiGLU split) saving its rows through
    ``to_saved`` and loading them through ``from_saved``. Its data stays the parameter, so
    optimizers still find it by identity and pass their states through the same conversion."""

    def build(key, data, replica_id, flattened_range):
        saved = to_saved(data)
        if isinstance(entry, ShardedTensorFactory):
            return entry.build_fn(key, saved, replica_id, flattened_range)
        return replace(entry, key=key, data=saved, dtype=saved.dtype, replica_id=replica_id)

    def merge(loaded):
        merged = entry.merge_fn(loaded) if isinstance(entry, ShardedTensorFactory) else loaded
        return from_saved(merged)

    return ShardedTensorFactory(entry.key, entry.data, build, merge, entry.replica_id)


# concatenated_factory notes the stock entry and size it wraps, so that reading an interleaved
# checkpoint can convert between the checkpoint and the stock entry (saved -> concatenated ->
# memory) instead of undoing this factory's own permutation.
WRAPPED_ENTRY = "_glu_concatenated_of"


def concatenated_factory(entry, size: int) -> ShardedTensorFactory:
    """A sharded-state-dict entry over an interleaved tensor that saves it concatenated.

    ``entry`` is the stock entry (a ShardedTensor or a factory such as the SwiGLU split)
    built over the interleaved parameter; its data stays the parameter, so optimizers
    still find it by identity and pass their states through the same conversion.
    """

    def load(standard):
        merged = to_interleaved(standard, size)
        setattr(merged, MERGED_INTERLEAVED, True)
        return merged

    factory = _relayout(entry, lambda t: to_concatenated(t, size), load)
    setattr(factory, WRAPPED_ENTRY, (entry, size))
    return factory


def interleaved_checkpoint_factory(entry, size: int) -> ShardedTensorFactory:
    """``entry`` (a model's sharded FC1 entry) reading a checkpoint whose FC1 rows are
    interleaved with block ``size``: loads (optimizer states too) reach the entry's own layout
    as if the checkpoint held them concatenated.

    The rows are those of one tensor-parallel shard, so the checkpoint must have been saved
    with the same (expert) tensor-parallel size as the one reading it.
    """
    wrapped = getattr(entry, WRAPPED_ENTRY, None)
    if wrapped is not None:
        stock, memory_size = wrapped
        return concatenated_factory(interleaved_checkpoint_factory(stock, size), memory_size)
    return _relayout(entry, lambda t: to_interleaved(t, size), lambda t: to_concatenated(t, size))
