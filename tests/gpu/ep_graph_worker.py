"""torchrun worker for test_ep2_graph_replay_is_bitwise_eager: an EP=2 layer with F12's
symmetric exchange captured as CUDA graphs (F11); replays on two inputs (other routing)
against the eager layer on the same inputs, bitwise."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import compare, finish_worker, small_moe_kwargs, start_worker  # noqa: E402

CASES = [("bf16-top8", 64, 8, 512, "bf16"), ("fp8-top2", 16, 2, 400, "fp8")]


def main(out_path):
    rank = start_worker(expert_model_parallel_size=2)
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply
    from megatron.moe_patches.moe_cuda_graph import MoELayerGraphs
    from megatron.moe_patches.testing.layer_harness import build_moe_layer, fp8_context

    apply()
    results = []
    for name, experts, topk, tokens, precision in CASES:
        config = tc_module.TransformerConfig(**small_moe_kwargs(
            experts, topk, precision=precision, moe_device_tokens_per_expert=True, moe_symmetric_exchange=True,
            cuda_graph_impl="local", cuda_graph_scope="moe"))
        layer = build_moe_layer(config)
        generator = torch.Generator(device="cuda").manual_seed(7 + rank)

        def inputs(scale):
            x = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
            return x * scale, torch.randn_like(x)

        def step(x, g):
            layer.zero_grad(set_to_none=True)
            x = x.detach().requires_grad_(True)
            with fp8_context(config):
                out, _ = layer(x)
            out.backward(g)
            result = {"output": out.detach().clone(), "input_grad": x.grad.clone()}
            result.update({f"grad:{n}": p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
            return result

        a, b = inputs(1.0), inputs(3.0)
        eager_a, eager_b = step(*a), step(*b)
        graphs = MoELayerGraphs([layer], a[0], context=lambda: fp8_context(config)).install()
        replay_a, replay_b = step(*a), step(*b)
        graphs.uninstall()
        results.append(dict(rank=rank, case=name, exchange=layer.token_dispatcher.exchange is not None,
                            backend=layer.experts.backend.name, routing_differs=not torch.equal(
                                eager_a["output"], eager_b["output"]),
                            replay_a=compare(eager_a, replay_a), replay_b=compare(eager_b, replay_b)))

    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
