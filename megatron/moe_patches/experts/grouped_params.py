"""F5: an expert FC's weights (and biases) as one [num_experts, ...] parameter.

``moe_single_grouped_weight`` / ``moe_single_grouped_bias`` ask the experts to hold each
FC's per-expert parameters as one grouped parameter. Only a backend that computes on
that layout can honour it: the plan's ``single_grouped_refusal`` names the backends
that can (today: the grouped_mm backend, F8) and is the one place that refuses the
others, at config validation and at construction alike.

``make_grouped`` turns a TE grouped linear's ``weight{i}`` / ``bias{i}`` into one
parameter each and keeps its checkpoints in the stock per-expert keys (a state-dict hook
presents indexed views; F6's pre-hook loads either layout), so plain and torch_dist
checkpoints stay interchangeable with stock experts.

Upstream: NVIDIA/Megatron-LM#3890, #4219.
"""

import torch

from megatron.moe_patches.checkpoint.grouped_keys import PARAM_NAMES, load_pre_hook


def _indexed_view_hook(module, state_dict, prefix, local_metadata):
    # state_dict post-hook: a grouped module reports stock per-expert keys (views).
    for name in PARAM_NAMES:
        key = prefix + name
        if key in state_dict:
            for i, part in enumerate(state_dict.pop(key).detach().unbind(0)):
                state_dict[f"{prefix}{name}{i}"] = part
    return state_dict


def make_grouped(module, num_gemms: int, names=PARAM_NAMES) -> None:
    """Replace ``{name}{i}`` of ``module`` by one grouped parameter ``{name}``, for each of
    ``names`` (weight, bias) that it holds.

    The grouped parameter copies the per-expert parameters' attributes (Megatron's
    ``allreduce``, ``sequence_parallel``, ... flags). Checkpoints keep the indexed keys.
    """
    for name in names:
        keys = [f"{name}{i}" for i in range(num_gemms)]
        if not all(key in module._parameters for key in keys):
            continue
        parts = [module._parameters.pop(key) for key in keys]
        grouped = torch.nn.Parameter(torch.stack([p.detach() for p in parts]), requires_grad=parts[0].requires_grad)
        for attr, value in vars(parts[0]).items():
            setattr(grouped, attr, value)
        module.register_parameter(name, grouped)
    module._register_state_dict_hook(_indexed_view_hook)
    module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
