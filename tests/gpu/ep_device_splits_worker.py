"""torchrun worker for test_ep2_device_splits_match_stock: an EP=2 alltoall MoE layer, stock TE
experts vs F8 + grouped_mm, identical weights and inputs; also counts the host syncs that
torch's sync debug mode sees in one forward+backward (the all-to-all split sizes need one)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import (  # noqa: E402  (this folder: sys.path[0])
    finish_worker, host_syncs_during, max_rel_error, run_layer, small_moe_kwargs, start_worker,
)


def main(out_path):
    rank = start_worker(expert_model_parallel_size=2)
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply, revert
    from megatron.moe_patches.testing.layer_harness import forward_backward

    results = []
    for experts, topk, tokens in ((16, 2, 1000), (64, 8, 777)):
        kwargs = small_moe_kwargs(experts, topk, expert_model_parallel_size=2)  # the groups' EP size
        revert()
        _, stock = run_layer(tc_module.TransformerConfig(**kwargs), tokens, seed=20 + rank)
        apply()
        layer, patched = run_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True), tokens, seed=20 + rank)
        hidden = torch.randn(tokens, 1, kwargs["hidden_size"], device="cuda", dtype=torch.bfloat16)
        forward_backward(layer, hidden)
        syncs = host_syncs_during(lambda: forward_backward(layer, hidden))
        revert()
        errors = max_rel_error(stock, patched)
        results.append(dict(rank=rank, case=[experts, topk, tokens], backend=layer.experts.backend.name,
                            bitwise=all(torch.equal(stock[n], patched[n]) for n in stock),
                            max_rel=max(errors.values()), host_syncs=len(syncs), where=syncs[:4]))
    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
