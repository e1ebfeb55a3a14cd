"""torchrun worker for tests/gpu/test_symmetric_exchange.py: an alltoall MoE layer at EP = the
world size with F12's symmetric exchange against the same layer with NCCL's all-to-all (same
experts, same row order: bitwise weight gradients; the output and input gradient summed in
another order) and against stock megatron-core (a tolerance); host syncs counted in one
forward+backward. Cases: top-k 1/2/8, zero-token experts, a rank that receives nothing,
quick-GEGLU, biases, FP8 tensorwise."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import (  # noqa: E402  (this folder: sys.path[0])
    compare, finish_worker, host_syncs_during, max_rel_error, run_layer, small_moe_kwargs, start_worker,
)


def restricted_routing(num_experts, topk, allowed, seed):
    """A router stand-in choosing top-k among ``allowed`` experts only (random scores)."""
    allowed = torch.tensor(allowed, device="cuda")

    def route(hidden_states, *args, **kwargs):
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        generator = torch.Generator(device="cuda").manual_seed(seed)
        scores = torch.full((tokens, num_experts), float("-inf"), device="cuda")
        scores[:, allowed] = torch.randn(tokens, allowed.numel(), device="cuda", generator=generator)
        top_values, top_experts = scores.topk(topk, dim=1)
        probs = torch.zeros(tokens, num_experts, device="cuda").scatter_(1, top_experts, top_values.softmax(-1))
        return probs, probs > 0

    return route


CASES = [  # name, experts, topk, tokens, kwargs, allowed experts (None: the router)
    ("top1", 16, 1, 1000, {}, None),
    ("top2", 16, 2, 1000, {}, None),
    ("top8", 64, 8, 777, {}, None),
    ("zero-token-experts", 16, 2, 600, {}, [1, 2, 5, 9, 11, 12]),
    ("rank1-receives-nothing", 16, 2, 600, {}, list(range(8))),
    ("quick-geglu", 16, 2, 500, {"activation": "quick_geglu"}, None),
    ("bias", 16, 2, 500, {"add_bias_linear": True}, None),
    ("fp8", 16, 2, 1000, {"precision": "fp8"}, None),
    ("fp8-bf16-wgrad", 64, 8, 512, {"precision": "fp8-bf16-wgrad"}, None),
]


def main(out_path):
    ep = int(os.environ["WORLD_SIZE"])
    rank = start_worker(expert_model_parallel_size=ep)
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply, revert
    from megatron.moe_patches.dispatch.exchanges import SymmetricMemoryAllToAll
    from megatron.moe_patches.testing.layer_harness import forward_backward

    results = []
    for name, experts, topk, tokens, extra, allowed in CASES:
        kwargs = small_moe_kwargs(experts, topk, expert_model_parallel_size=ep, **extra)  # the groups' EP size
        routing = None if allowed is None else restricted_routing(experts, topk, allowed, seed=40 + rank)
        seed = 20 + rank
        revert()
        _, stock = run_layer(tc_module.TransformerConfig(**kwargs), tokens, seed=seed, routing_fn=routing)
        apply()
        fast = dict(kwargs, moe_device_tokens_per_expert=True)
        _, nccl = run_layer(tc_module.TransformerConfig(**fast), tokens, seed=seed, routing_fn=routing)
        config = tc_module.TransformerConfig(**fast, moe_symmetric_exchange=True)
        layer, exchanged = run_layer(config, tokens, seed=seed, routing_fn=routing)
        hidden = torch.randn(tokens, 1, kwargs["hidden_size"], device="cuda", dtype=torch.bfloat16)
        syncs = host_syncs_during(lambda: forward_backward(layer, hidden))
        revert()
        results.append(dict(
            rank=rank, ep=ep, case=name, backend=layer.experts.backend.name,
            exchange=isinstance(layer.token_dispatcher.exchange, SymmetricMemoryAllToAll),
            weights_vs_nccl=compare(nccl, exchanged, [n for n in nccl if n.startswith("grad:")]),
            sums_vs_nccl=compare(nccl, exchanged, ["output", "input_grad"]),
            max_rel_vs_stock=max(max_rel_error(stock, exchanged).values()),
            nccl_max_rel_vs_stock=max(max_rel_error(stock, nccl).values()),
            host_syncs=len(syncs), where=syncs[:4],
        ))
    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
