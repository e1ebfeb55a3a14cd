"""One rank: build pretrain_gpt.py's model and optimizer, then try to load each checkpoint
root given, in order; record the error (if any) and whether the model's parameters, fp32
main params and Adam states are bitwise what they were before the attempt. (Load an intact
checkpoint first: megatron-core allocates Adam states, uninitialized, on a first load.)

    python damaged_checkpoint_worker.py OUT.json ROOT [ROOT ...] -- <pretrain_gpt.py args>
"""

import json
import sys

import torch

from megatron.moe_patches.driver import checkpointing, training
from megatron.moe_patches.driver.arguments import parse_args


def _bits(tensor):
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def snapshot(gpt, optimizer):
    tensors = [_bits(p) for p in gpt.parameters()]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for main_param in group["params"]:
                tensors.append(_bits(main_param))
                tensors += [_bits(v) for v in opt.optimizer.state.get(main_param, {}).values() if torch.is_tensor(v)]
    return tensors


def main():
    split = sys.argv.index("--")
    out, roots, argv = sys.argv[1], sys.argv[2:split], sys.argv[split + 1:]
    args = parse_args(argv)
    gpt, _, optimizer, scheduler = training.setup(args)
    results = []
    for root in roots:
        before, error = snapshot(gpt, optimizer), None
        try:
            checkpointing.load(root, gpt, optimizer, scheduler, args)
        except Exception as exc:  # the outcome under test
            error = f"{type(exc).__name__}: {exc}"
        after = snapshot(gpt, optimizer)
        unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        results.append({"root": root, "error": error, "unchanged": unchanged, "tensors": len(before)})
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(results, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
