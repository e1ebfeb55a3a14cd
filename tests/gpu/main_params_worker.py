"""One rank: build pretrain_gpt.py's model, then initialise the distributed optimizer's fp32
main params from a plain fp32 model state dict in the *other* expert layout
(``optimizer.reload_model_params(state_dict)``, Megatron-LM's --load-main-params-from-ckpt).
Records, per main-param shard, whether it equals its slice of the state dict bitwise, and
what megatron-core's own name map does with the same state dict.

    python main_params_worker.py OUT.json -- <pretrain_gpt.py args>
"""

import json
import re
import sys

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.moe_patches.driver import training
from megatron.moe_patches.driver.arguments import parse_args

INDEXED = re.compile(r"^(.*\.(?:weight|bias))(\d+)$")


def other_layout(state, grouped_model):
    """fp32 copies, slightly moved off the bf16 model, with experts in the other layout."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    state = {k: v.float() + 1e-3 * torch.randn(v.shape, device=v.device, generator=generator)
             for k, v in state.items() if torch.is_tensor(v) and "_extra_state" not in k}
    if grouped_model:
        return state  # the grouped model's state_dict already shows indexed experts
    stems = {}
    for key in list(state):
        match = INDEXED.match(key)
        if match:
            stems.setdefault(match[1], {})[int(match[2])] = state.pop(key)
    state.update({stem: torch.stack([rows[i] for i in range(len(rows))]) for stem, rows in stems.items()})
    return state


def main():
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    args = parse_args(argv)
    gpt, _, optimizer, _ = training.setup(args)
    grouped_model = any(name.endswith(".weight") and ".experts." in name and p.dim() == 3
                        for name, p in gpt.named_parameters())
    state = other_layout(gpt.state_dict(), grouped_model)
    names = {id(p): name for name, p in gpt.named_parameters()}
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    try:
        DistributedOptimizer._build_model_param_to_state_dict_param_map(optimizers[0], {"model": state})
        stock = None
    except Exception as exc:  # megatron-core's substring matching
        stock = f"{type(exc).__name__}: {exc}"
    optimizer.reload_model_params(state_dict={"model": state})

    def source(name):
        if name in state:
            return state[name]
        match = INDEXED.match(name)
        if match:  # indexed model param, grouped entry
            return state[match[1]][int(match[2])]
        return torch.stack([state[f"{name}{i}"] for i in range(sum(k.startswith(name) for k in state))])

    checked, mismatched, experts = 0, [], 0
    for opt in optimizers:
        for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                name = names[id(model_param)]
                span = opt._get_model_param_range_map(model_param)["param"]
                expected = source(name).reshape(-1)[span.start:span.end]
                checked += 1
                experts += ".experts." in name
                if not torch.equal(main_param, expected):
                    mismatched.append(name)
    with open(out, "w", encoding="utf-8") as handle:
        json.dump({"grouped_model": grouped_model, "checked": checked, "expert_params": experts,
                   "mismatched": mismatched, "stock_map": stock}, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
