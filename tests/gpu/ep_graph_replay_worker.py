"""torchrun worker for test_ep2_graph_replays_equal_eager: MoE layers at EP=2 with F12's
symmetric exchange captured as CUDA graphs (F11), replayed on two inputs with different
routing, against the eager layers on the same inputs (bitwise). One case stacks two layers,
which share the exchange's buffers."""

import faulthandler
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import compare, finish_worker, small_moe_kwargs, start_worker  # noqa: E402

CASES = [  # name, experts, top-k, tokens, precision, layers
    ("bf16-top8", 64, 8, 512, "bf16", 1),
    ("bf16-top2-two-layers", 16, 2, 600, "bf16", 2),
    ("fp8-top2", 16, 2, 400, "fp8", 1),
]


def main(out_path):
    # A rank left waiting in a barrier for a peer that failed prints its stack and exits.
    faulthandler.dump_traceback_later(240, exit=True)
    rank = start_worker(expert_model_parallel_size=2)
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply
    from megatron.moe_patches.dispatch.exchanges import SymmetricMemoryAllToAll
    from megatron.moe_patches.graphs.layer_graphs import LayerGraphs
    from megatron.moe_patches.testing.layer_harness import build_moe_layer, fp8_context

    apply()
    results = []
    for name, experts, topk, tokens, precision, depth in CASES:
        config = tc_module.TransformerConfig(**small_moe_kwargs(
            experts, topk, precision=precision, expert_model_parallel_size=2, moe_device_tokens_per_expert=True,
            moe_symmetric_exchange=True, cuda_graph_impl="local", cuda_graph_scope="moe"))
        layers = [build_moe_layer(config, seed=1234 + i) for i in range(depth)]
        generator = torch.Generator(device="cuda").manual_seed(7 + rank)

        def inputs(scale):
            x = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
            return x * scale, torch.randn_like(x)

        def step(x, g):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            x = x.detach().requires_grad_(True)
            out = x
            with fp8_context(config):
                for layer in layers:
                    out, _ = layer(out)
            out.backward(g)
            result = {"output": out.detach().clone(), "input_grad": x.grad.clone()}
            for i, layer in enumerate(layers):
                result.update({f"grad{i}:{n}": p.grad.clone() for n, p in layer.named_parameters()
                               if p.grad is not None})
            return result

        a, b = inputs(1.0), inputs(3.0)
        eager_a, eager_b = step(*a), step(*b)
        graphs = LayerGraphs(layers, a[0], context=lambda: fp8_context(config)).install()
        replay_a, replay_b = step(*a), step(*b)
        replays = graphs.replays
        graphs.uninstall()
        torch.cuda.synchronize()
        print(f"rank {rank} {name}: replays {replays}, bitwise {compare(eager_a, replay_a)['bitwise']}", flush=True)
        results.append(dict(rank=rank, case=name, layers=depth, replays=replays,
                            exchange=all(isinstance(layer.token_dispatcher.exchange, SymmetricMemoryAllToAll)
                                         for layer in layers),
                            backend=layers[0].experts.backend.name,
                            routing_differs=not torch.equal(eager_a["output"], eager_b["output"]),
                            replay_a=compare(eager_a, replay_a), replay_b=compare(eager_b, replay_b)))

    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
