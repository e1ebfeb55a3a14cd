"""F7: optimizer checkpoints of grouped expert parameters, per expert.

A grouped parameter ([E, out, in], F5/F6) appears in the model's sharded state dict only
as E per-expert entries whose data are views of its rows: that keeps the stock keys, so
checkpoints load across layouts. megatron-core's optimizers, however, find each
parameter's checkpoint entry by identity (``entry.data is param``), so a grouped
parameter has none: the distributed optimizer raises ("Model param ... not in
model_sharded_state_dict") and the other optimizers skip its state.

``grouped_param_factories`` normalises that map: for every optimizer parameter without
an entry whose rows are exactly the data of E per-expert entries (matched by storage,
offset and shape, never by name), it adds one ``ShardedTensorFactory`` over the whole
parameter that builds those E entries (nested factories such as the SwiGLU split
included) and stacks them back on load. Optimizer states
(main params, exp_avg, exp_avg_sq) then go under the stock per-expert keys too, so they
load into indexed or grouped experts alike. An incomplete or ambiguous set of rows is an
error naming the parameter; nothing is guessed.

The distributed optimizer's other map, model param -> tensor of a plain model state dict
(``reload_model_params(state_dict)``, i.e. Megatron-LM's --load-main-params-from-ckpt),
matches names by substring: a grouped ``...weight`` matches every ``...weight0..N-1``,
an indexed ``weight1`` also matches ``weight10``. ``state_dict_param_map`` matches exact
names instead and converts layouts with F6's ``normalize_grouped_keys`` (so its refusals:
incomplete set, both layouts present, wrong leading dim).

The distributed optimizer's bucket formats (``dp_reshardable``, Megatron-LM's default, and
``dp_zero_gather_scatter``) store states as flat buffers in the order parameters lie in
memory: they load into the same parameter layout only (a grouped parameter holds its
experts in another order than per-expert ones; a GLU interleave permutes FC1 rows), and
megatron-core would load them into another one without a word, each expert's states in
another's place. The patched optimizer records its layout (``param_layout``) beside those
states and refuses a load across layouts by name (``bucket_layout_refusal``), whichever loop
loads it; ``fully_reshardable`` states are per parameter and load across layouts (above).

Patches: ``DistributedOptimizer`` (megatron.core.optimizer.distrib_optimizer) is replaced
by ``GroupedParamDistributedOptimizer``; ``get_param_id_to_sharded_param_map`` (the
other optimizers' lookup) by ``param_id_to_sharded_param_map``. Grouped *quantized*
parameters (whose FP8 casting would need whole-group shards) do not exist in this
version: no expert backend here holds FP8 parameters. Upstream: NVIDIA/Megatron-LM#3890,
#4324.
"""

import re
from collections import Counter
from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.moe_patches.checkpoint.grouped_keys import normalize_grouped_keys
from megatron.moe_patches.fields import flag_name

GROUPED_ENTRIES_KEY = "__grouped_param_factories__"
EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.)(?P<base>weight|bias)(?P<index>\d*)$")


def _row_index(param: torch.Tensor, view: torch.Tensor) -> Optional[int]:
    """i if ``view`` is exactly row i of ``param`` (same storage, offset, shape, strides)."""
    if view is None or param.dim() < 2 or view.shape != param.shape[1:] or view.stride() != param.stride()[1:]:
        return None
    if view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return None
    row, rest = divmod(view.storage_offset() - param.storage_offset(), param.stride(0))
    return row if rest == 0 and 0 <= row < param.shape[0] else None


def grouped_factory(param: torch.Tensor, rows: List) -> ShardedTensorFactory:
    """One factory over ``param`` standing for its per-expert entries ``rows`` (row order)."""

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:  # megatron-core 0.16.1's ShardedTensor refuses them too
            raise ValueError(f"{key}: flattened optimizer shards are not supported; use a "
                             "fully_reshardable or dp_reshardable distributed-optimizer checkpoint")
        built = {}
        for i, (entry, row) in enumerate(zip(rows, data.unbind(0))):
            if isinstance(entry, ShardedTensorFactory):
                built[i] = entry.build_fn(key, row, replica_id, None)
            else:
                built[i] = replace(entry, key=key, data=row, dtype=row.dtype, replica_id=replica_id)
        return built

    def merge(loaded: Dict) -> torch.Tensor:
        return torch.stack([rows[i].merge_fn(loaded[i]) if isinstance(rows[i], ShardedTensorFactory)
                            else loaded[i] for i in range(len(rows))])

    first = rows[0]
    return ShardedTensorFactory(first.key, param, build, merge, first.replica_id)


def grouped_param_factories(model_sharded_state_dict, params) -> Dict[str, ShardedTensorFactory]:
    """Factories for the ``params`` that the sharded state dict holds only as per-expert rows."""
    entries, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    entries = list(nested_values(entries))
    direct = {id(entry.data) for entry in entries}
    factories = {}
    for param in params:
        if id(param) in direct or param.dim() < 2:
            continue
        rows: Dict[int, List] = {}
        for entry in entries:
            row = _row_index(param, entry.data)
            if row is not None:
                rows.setdefault(row, []).append(entry)
        if not rows:
            continue
        name = rows[min(rows)][0].key
        if any(len(found) > 1 for found in rows.values()):
            raise ValueError(f"grouped parameter {name} {tuple(param.shape)}: a row has several checkpoint entries")
        if sorted(rows) != list(range(param.shape[0])):
            missing = sorted(set(range(param.shape[0])) - set(rows))
            raise ValueError(f"grouped parameter {name} {tuple(param.shape)}: no checkpoint entry for rows {missing}")
        factories[f"{name}#{len(factories)}"] = grouped_factory(param, [rows[i][0] for i in range(param.shape[0])])
    return factories


def _with_grouped_entries(model_sharded_state_dict, params):
    factories = grouped_param_factories(model_sharded_state_dict, params)
    if not factories:
        return model_sharded_state_dict
    return {**model_sharded_state_dict, GROUPED_ENTRIES_KEY: factories}


def param_id_to_sharded_param_map(model_sharded_state_dict, optim_params_iter):
    """``get_param_id_to_sharded_param_map`` that also maps grouped parameters."""
    params = list(optim_params_iter)
    return get_param_id_to_sharded_param_map(_with_grouped_entries(model_sharded_state_dict, params), params)


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module
        name = name[len("module."):]
    return name


def state_dict_param_map(named_params: Iterable[Tuple[str, torch.Tensor]], state_dict: Dict) -> Dict:
    """Model param -> its tensor in a plain model ``state_dict``, indexed or grouped alike.

    Exact names (wrapper prefixes ignored). A grouped ``p.weight`` [E, ...] absent from the
    dict is stacked from ``p.weight0..E-1``; an indexed ``p.weight3`` is row 3 of ``p.weight``.
    A missing or mis-shaped entry is an error naming the parameter.
    """
    named_params = [(_strip_wrappers(name), param) for name, param in named_params]
    entries = {_strip_wrappers(key): value for key, value in state_dict.items()}  # converted copy
    parsed = {name: EXPERT_PARAM.match(name) for name, _ in named_params}
    indexed_count = Counter(m["prefix"] + m["base"] for m in parsed.values() if m and m["index"])
    found = {}
    for name, param in named_params:
        match = parsed[name]
        if match:
            prefix, stem = match["prefix"], match["prefix"] + match["base"]
            if match["index"] and stem in entries:  # indexed param, grouped entry
                normalize_grouped_keys(entries, prefix, indexed_count[stem], grouped=False)
            elif not match["index"] and f"{stem}0" in entries and param.dim() > 1:  # grouped param, indexed entries
                normalize_grouped_keys(entries, prefix, param.shape[0], grouped=True)
        if name not in entries:
            raise KeyError(f"parameter {name}: no entry in the state dict")
        if tuple(entries[name].shape) != tuple(param.shape):
            raise ValueError(f"parameter {name}: shape {tuple(param.shape)}, state dict entry "
                             f"{tuple(entries[name].shape)}")
        found[param] = entries[name]
    return found


def _state_dict_per_chunk(state_dict: Dict, chunks: int) -> List[Dict]:
    """Megatron's model state dict forms: {"model0": ..} / {"model_0": ..} (NeMo) per chunk,
    {"model": ..} or the bare dict for one chunk."""
    for prefix in ("model", "model_"):
        if f"{prefix}0" in state_dict:
            return [state_dict[f"{prefix}{i}"] for i in range(chunks)]
    if chunks != 1:
        raise KeyError(f"{chunks} model chunks but the state dict has no model0/model_0 entries")
    return [state_dict.get("model", state_dict)]


# The config fields that decide how expert parameters lie in memory, and their stock values.
LAYOUT_FIELDS = {"moe_single_grouped_weight": False, "moe_single_grouped_bias": False,
                 "moe_mlp_glu_interleave_size": None}
LAYOUT_KEY = "moe_patches_param_layout"  # beside the optimizer's own common state
BUCKET_FORMATS = ("dp_reshardable", "dp_zero_gather_scatter")  # states in memory order


def param_layout(config) -> Dict:
    """How ``config``'s expert parameters lie in memory (the LAYOUT_FIELDS it sets)."""
    return {name: getattr(config, name, stock) for name, stock in LAYOUT_FIELDS.items()}


def bucket_layout_refusal(sharding_type: Optional[str], saved: Optional[Dict], current: Dict) -> Optional[str]:
    """Why optimizer states of ``sharding_type`` saved in layout ``saved`` cannot load into
    ``current``, or None. ``saved`` None: the checkpoint records no layout (stock
    megatron-core, whose experts are per-expert, or an earlier version of this package)."""
    if sharding_type not in BUCKET_FORMATS:
        return None  # per parameter: F7 maps layouts exactly
    saved = {**LAYOUT_FIELDS, **(saved or {})} if saved is not None else None
    if saved == current or (saved is None and current == LAYOUT_FIELDS):
        return None
    fix = ("Resume with the layout it was saved with (--use-checkpoint-args restores it), or load it "
           "that way once and save with --dist-ckpt-optim-fully-reshardable, whose per-parameter "
           "states load into any layout; --no-load-optim loads the model alone.")
    if saved is None:
        now = ", ".join(f"{flag_name(n)} {v}" for n, v in current.items() if v != LAYOUT_FIELDS[n])
        return (f"the checkpoint's {sharding_type} distributed-optimizer states record no expert parameter "
                f"layout, and this run's layout is not the stock one ({now}): they would load in another "
                f"order, each expert's states in another expert's place. {fix}")
    pairs = ", ".join(f"{flag_name(n)} {saved[n]} (checkpoint) vs {current[n]} (now)"
                      for n in LAYOUT_FIELDS if saved[n] != current[n])
    return (f"the checkpoint's {sharding_type} distributed-optimizer states are flat buffers in another expert "
            f"parameter layout: {pairs}; loading them would put each expert's states in another expert's "
            f"place. {fix}")


class GroupedParamDistributedOptimizer(DistributedOptimizer):
    """DistributedOptimizer whose checkpoints hold grouped parameters' states per expert and
    record the expert parameter layout of their bucket states."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, sharding_type=None,
                           metadata=None):
        params = [p for buffer in self.buffers for p in buffer.param_index_map]
        model_sharded_state_dict = _with_grouped_entries(model_sharded_state_dict, params)
        state = super().sharded_state_dict(model_sharded_state_dict, is_loading, sharding_type, metadata)
        state[LAYOUT_KEY] = self._param_layout()  # a plain value: the checkpoint's common state
        return state

    def load_state_dict(self, state_dict):
        refusal = bucket_layout_refusal(state_dict.get("param_state_sharding_type"), state_dict.get(LAYOUT_KEY),
                                        self._param_layout())
        if refusal is not None:
            raise ValueError(refusal)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != LAYOUT_KEY})

    def _param_layout(self) -> Dict:
        return param_layout(self.model_chunks[0].config)

    def _build_model_param_to_state_dict_param_map(self, state_dict):
        per_chunk = _state_dict_per_chunk(state_dict, len(self.model_chunks))
        found = {}
        for chunk, chunk_state in zip(self.model_chunks, per_chunk):
            found.update(state_dict_param_map(chunk.named_parameters(), chunk_state))
        return found
