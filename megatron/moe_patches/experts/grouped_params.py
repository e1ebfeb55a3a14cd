"""F5: an expert FC's weights (and biases) as one [num_experts, ...] parameter, made so at birth.

``moe_single_grouped_weight`` / ``moe_single_grouped_bias`` ask the experts to hold each
FC's per-expert parameters as one grouped parameter. Only a backend that computes on
that layout can honour it: the plan's ``single_grouped_refusal`` names the backends
that can (today: the grouped_mm backend, F8) and is the one place that refuses the
others, at config validation and at construction alike.

Such a backend builds FC1 and FC2 from classes that gain ``GroupedAtBirth``
(``ExpertBackend.expert_submodules``). Its layout, the class attribute ``grouped_names``, is
a fact of the class: the forward, F13's main-grad targets and the checkpoint hooks read it
and never look for ``weight{i}``. TE's GroupedLinear constructor announces each expert's
``weight{i}`` / ``bias{i}`` through ``register_parameter`` (with how to initialise it) and
then calls ``reset_parameters``: the step keeps the announcements of the grouped names
instead of registering them, makes one [E, ...] parameter per name, and initialises expert
``i``'s slice as TE initialises ``weight{i}`` (its init_fn under its RNG tracker, in TE's
order), so the values are those of stock per-expert experts. No per-expert weight is ever held.

Checkpoints keep the stock per-expert keys (a state-dict hook presents indexed views; F6's
pre-hook loads either layout), so plain and torch_dist checkpoints stay interchangeable
with stock experts.

Upstream: NVIDIA/Megatron-LM#3890, #4219.
"""

import functools
import re
from typing import NamedTuple, Optional

import torch

from megatron.moe_patches.checkpoint.grouped_keys import PARAM_NAMES, load_pre_hook
from megatron.moe_patches.fields import patch_option

_PER_EXPERT_NAME = re.compile(r"(weight|bias)(\d+)")


def grouped_names_for(config) -> frozenset:
    """The names (weight, bias) ``config`` asks the experts to hold as one [E, ...] parameter."""
    held = PARAM_NAMES if config.add_bias_linear else ("weight",)
    return frozenset(name for name in held if patch_option(config, f"moe_single_grouped_{name}"))


class Announced(NamedTuple):
    """One per-expert parameter as TE's constructor announced it."""

    name: str  # weight or bias
    index: int  # the expert
    shape: torch.Size  # what TE allocated (its tensor itself is dropped)
    dtype: torch.dtype
    device: torch.device
    init_meta: dict  # register_parameter's keywords: init_fn, get_rng_state_tracker, ...


def _indexed_view_hook(module, state_dict, prefix, local_metadata):
    # state_dict post-hook: a grouped module reports stock per-expert keys (views).
    for name in PARAM_NAMES:
        key = prefix + name
        if name in module.grouped_names and key in state_dict:
            for i, part in enumerate(state_dict.pop(key).detach().unbind(0)):
                state_dict[f"{prefix}{name}{i}"] = part
    return state_dict


def initialise_as_te(module, tensor: torch.Tensor, init_meta: dict) -> None:
    """What TE's reset_parameters does to one parameter: its init_fn, under a fork of its RNG
    tracker (the module's named tracker where it has one, as TE's experts do)."""
    init_fn, tracker = init_meta.get("init_fn"), init_meta.get("get_rng_state_tracker")
    if init_fn is None:
        raise ValueError(f"{type(module).__name__}: a per-expert parameter was announced without an init_fn")
    if tracker is None:
        init_fn(tensor)
        return
    name = getattr(module, "rng_tracker_name", None)
    with tracker().fork(name) if name else tracker().fork():
        init_fn(tensor)


class GroupedAtBirth:
    """FC class step (before the spec's TE grouped linear in the MRO): ``grouped_names`` held
    as one [E, out, in] / [E, out] parameter from construction. Subclasses made by
    ``grouped_at_birth`` set ``grouped_names``."""

    grouped_names: frozenset = frozenset()

    def __init__(self, *args, **kwargs):
        # set before TE's constructor runs: it announces the experts from inside
        self.__dict__["_announced"] = []
        super().__init__(*args, **kwargs)
        self._check_born_grouped()
        self._register_state_dict_hook(_indexed_view_hook)
        self._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)

    def _check_born_grouped(self) -> None:
        # A TE whose constructor no longer goes through these two methods fails here, by name.
        seam = "(the seam of TE's GroupedLinear constructor that single grouped parameters rely on)"
        for name in sorted(self.grouped_names):
            count = sum(a.name == name for a in self._announced)
            if count != self.num_gemms:
                raise RuntimeError(f"{type(self).__name__}: its constructor announced {count} of {self.num_gemms} "
                                   f"{name}{{i}} through register_parameter {seam}")
            if "_grouped_made" not in self.__dict__:
                raise RuntimeError(f"{type(self).__name__}: its constructor never called reset_parameters {seam}")

    def register_parameter(self, name: str, param: Optional[torch.nn.Parameter], **init_meta) -> None:
        per_expert = _PER_EXPERT_NAME.fullmatch(name)
        if per_expert is None or param is None or "_grouped_made" in self.__dict__:
            super().register_parameter(name, param, **init_meta)
            return
        base, index = per_expert.group(1), int(per_expert.group(2))
        self._announced.append(Announced(base, index, param.shape, param.dtype, param.device, init_meta))
        if base not in self.grouped_names:  # held per expert (e.g. biases beside a grouped weight)
            super().register_parameter(name, param, **init_meta)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Replaces TE's: the grouped parameters are made on the first call (TE's constructor
        makes it once its experts are announced), then every announced parameter is initialised
        in announcement order, a grouped one slice by slice."""
        if "_grouped_made" not in self.__dict__:
            self._make_grouped()
        if defer_init:
            return
        with torch.no_grad():  # slices of a leaf parameter, initialised in place
            for a in self._announced:
                grouped = a.name in self.grouped_names
                tensor = self._parameters[a.name][a.index] if grouped else self._parameters[f"{a.name}{a.index}"]
                initialise_as_te(self, tensor, a.init_meta)

    def _make_grouped(self) -> None:
        self.__dict__["_grouped_made"] = True  # announcements end here
        for name in PARAM_NAMES:
            parts = [a for a in self._announced if a.name == name]
            if name in self.grouped_names and parts:
                first = parts[0]
                grouped = torch.empty((len(parts), *first.shape), dtype=first.dtype, device=first.device)
                super().register_parameter(name, torch.nn.Parameter(grouped))


@functools.lru_cache(maxsize=None)
def grouped_at_birth(names: frozenset) -> type:
    """The ``GroupedAtBirth`` step holding ``names`` (one class per layout)."""
    label = "GroupedWeightAndBias" if len(names) == 2 else f"Grouped{next(iter(names)).title()}"
    return type(label, (GroupedAtBirth,), {"grouped_names": frozenset(names), "__module__": __name__,
                                            "__qualname__": label})
