"""F6: expert checkpoints load across the indexed and the grouped parameter layouts.

Layouts of one expert FC with E local experts: *indexed* (stock TE GroupedLinear:
``weight0 .. weight{E-1}``, ``bias0 ..``) and *grouped* (one ``weight`` [E, out, in],
``bias`` [E, out]).

- ``normalize_grouped_keys`` rewrites a state dict, in place, into the layout a module
  has: stacks a complete indexed set into the grouped key or splits the grouped key into
  the indexed set. It refuses, naming the keys and loading nothing, when a set is
  incomplete, when both layouts are present, or when shapes disagree.
- Patches: megatron-core's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``
  are replaced by subclasses that run it as a ``load_state_dict`` pre-hook, so stock
  (indexed) experts load grouped checkpoints.
- The grouped layout itself (``moe_single_grouped_weight``) is F5:
  ``experts.grouped_params.GroupedAtBirth`` installs ``load_pre_hook`` on grouped modules.
  A module's layout is its ``grouped_names`` (the names it holds grouped; empty: per expert),
  fixed at construction: the hook reads it and never looks for the parameters.

Upstream: NVIDIA/Megatron-LM#3890, #4636. The optimizers' map for grouped parameters is
F7 (checkpoint.optimizer_state); torch_dist loads check coverage in checkpointing.
"""

from typing import Collection, Dict, List, Union

import torch

PARAM_NAMES = ("weight", "bias")


class GroupedKeyError(KeyError):
    def __str__(self):  # KeyError would quote the message
        return self.args[0]


def normalize_grouped_keys(
    state_dict: Dict, prefix: str, num_gemms: int, grouped: Union[bool, Collection[str]]
) -> List[str]:
    """Rewrite ``state_dict`` (in place) into the indexed or grouped layout; return what changed.

    ``grouped``: True/False for every parameter name, or the names (weight, bias) held
    grouped. Nothing is modified when any check fails: all conversions are planned first.
    """
    plan = []
    for name in PARAM_NAMES:
        name_grouped = grouped if isinstance(grouped, bool) else name in grouped
        grouped_key = prefix + name
        indexed_keys = [f"{prefix}{name}{i}" for i in range(num_gemms)]
        present = [key for key in indexed_keys if key in state_dict]
        has_grouped = grouped_key in state_dict
        if has_grouped and present:
            raise GroupedKeyError(
                f"ambiguous checkpoint: both {grouped_key} and {present[0]}.. are present; "
                "keep one layout"
            )
        if name_grouped and present:
            if len(present) != num_gemms:
                missing = [key for key in indexed_keys if key not in state_dict]
                raise GroupedKeyError(f"incomplete expert set for {grouped_key}: missing {missing}")
            shapes = {tuple(state_dict[key].shape) for key in indexed_keys}
            if len(shapes) != 1:
                raise GroupedKeyError(f"expert tensors for {grouped_key} differ in shape: {sorted(shapes)}")
            plan.append(("stack", grouped_key, indexed_keys))
        elif not name_grouped and has_grouped:
            tensor = state_dict[grouped_key]
            if tensor.dim() < 1 or tensor.shape[0] != num_gemms:
                raise GroupedKeyError(
                    f"{grouped_key} has shape {tuple(tensor.shape)}; expected a leading dim of "
                    f"{num_gemms} experts"
                )
            plan.append(("split", grouped_key, indexed_keys))
    for action, grouped_key, indexed_keys in plan:
        if action == "stack":
            state_dict[grouped_key] = torch.stack([state_dict.pop(key) for key in indexed_keys])
        else:
            for key, part in zip(indexed_keys, state_dict.pop(grouped_key).unbind(0)):
                state_dict[key] = part
    return [grouped_key for _, grouped_key, _ in plan]


def load_pre_hook(module, state_dict, prefix, *args):
    """``load_state_dict`` pre-hook: bring the state dict into the module's own layout
    (``module.grouped_names``)."""
    normalize_grouped_keys(state_dict, prefix, module.num_gemms, module.grouped_names)


def with_key_conversion(owner, cls):
    """For apply(): ``cls`` (a TE grouped linear of the experts' spec) as a subclass that loads
    grouped or indexed expert keys; ``cls`` itself where TE is missing (nothing to patch)."""
    if cls is None:
        return cls

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        self._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)

    name = f"{cls.__name__}WithKeyConversion"  # its own name in module reprs, logs and tracebacks
    return type(name, (cls,), {"__init__": __init__, "grouped_names": frozenset(),  # per expert
                               "__module__": __name__, "__qualname__": name,
                               "__doc__": f"{cls.__name__} that loads grouped or indexed expert keys (F6)."})
