"""torchrun worker for test_ep2_alltoall_fused_matches_stock: EP=2 alltoall MoE layer, stock
explicit padding vs F1's fused permute+pad, identical weights and inputs; rank 0 writes
every rank's comparison to argv[1]."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import compare, finish_worker, run_layer, start_worker  # noqa: E402  (this folder: sys.path[0])


def main(out_path):
    rank = start_worker(expert_model_parallel_size=2)
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply, revert
    from megatron.moe_patches.testing.layer_harness import MoEShape, moe_config_kwargs

    results = []
    for precision, experts, topk, tokens in (("tensorwise", 16, 2, 1000), ("tensorwise", 64, 8, 777), ("delayed", 16, 1, 300)):
        shape = MoEShape(hidden=256, moe_ffn=192, experts=experts, topk=topk)
        kwargs = moe_config_kwargs(shape, "bf16", fp8="e4m3", fp8_recipe=precision,
                                   expert_model_parallel_size=2)  # the groups' EP size
        revert()
        _, stock = run_layer(tc_module.TransformerConfig(**kwargs), tokens, seed=10 + rank)
        apply()
        layer, patched = run_layer(tc_module.TransformerConfig(**kwargs), tokens, seed=10 + rank)
        revert()
        results.append(
            dict(
                rank=rank,
                case=[precision, experts, topk, tokens],
                fused=layer.token_dispatcher.permute_step.pads and layer.experts.padding_plan.dispatcher_pads,
                activations=compare(stock, patched, [n for n in stock if "experts." not in n]),
                expert_wgrads=compare(stock, patched, [n for n in stock if "experts." in n]),
            )
        )
    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
