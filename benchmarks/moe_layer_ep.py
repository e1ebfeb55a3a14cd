"""MoE layer forward+backward with expert parallelism across every rank of a torchrun job:
stock megatron-core vs the patch set's variants, in one run, on identical weights.

    torchrun --nproc-per-node 2 benchmarks/moe_layer_ep.py --shapes qwen3-30b-a3b,mixtral \\
        --tokens 8192 --precisions bf16,fp8 --variants stock,device-splits

EP = the world size (the shapes' expert counts must divide by it); ``--tokens`` is per GPU,
each rank draws its own input. Rank 0 prints one JSON line per case and variant, with
``ep``: the slowest rank's median ms (a step waits for it) and the mean over ranks, expert
GEMM TFLOP/s per GPU, the largest peak MiB, the exchange kernels' device time (NCCL's or F12's) in one
forward+backward (the expert-parallel exchange) and its share of the step, and
``speedup_vs_stock`` against the stock layer of the same run.
"""

import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_layer.py, beside this file

from moe_layer import benchmark_parser, cases, emit, run_variant, selected_variants  # noqa: E402
from megatron.moe_patches.testing.layer_harness import SHAPES, expert_gemm_flops, init_expert_parallel  # noqa: E402


def gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0], "comma list of token counts per GPU", "bf16",
                              "rank 0 also appends the JSON lines to this file")
    parser.add_argument("--kernels", type=int, default=0,
                        help="rank 0 also profiles one forward+backward and reports this many kernels by device time")
    args = parser.parse_args(argv)
    variants = selected_variants(parser, args)

    ep = init_expert_parallel()
    rank = dist.get_rank()
    not_divisible = [s for s in args.shapes.split(",") if SHAPES[s].experts % ep]
    if not_divisible:
        parser.error(f"EP={ep} does not divide the expert count of {not_divisible}")
    sink = open(args.out, "a") if args.out and rank == 0 else None
    device = torch.cuda.get_device_name()
    for shape_name, shape, tokens, precision in cases(args):
        stock_ms = None
        for variant in variants:
            ms, peak, backend, exchange_time, kernel_times = run_variant(
                variant, shape, tokens, precision, args.warmup, args.iters, seed=rank, ep=ep, kernels=args.kernels
            )
            per_rank = gather((ms, peak, exchange_time))
            slowest = max(r[0] for r in per_rank)
            stock_ms = slowest if variant == "stock" else stock_ms
            exchange = statistics.mean(r[2] for r in per_rank)
            row = dict(
                shape=shape_name, tokens_per_gpu=tokens, ep=ep, precision=precision, variant=variant,
                backend=backend, ms=round(slowest, 3),
                mean_ms=round(statistics.mean(r[0] for r in per_rank), 3),
                tflops_per_gpu=round(expert_gemm_flops(shape, tokens) / slowest / 1e9, 1),
                peak_mib=round(max(r[1] for r in per_rank)),
                exchange_ms=round(exchange, 3), exchange_share=round(exchange / slowest, 3),
                speedup_vs_stock=round(stock_ms / slowest, 3), device=device,
                **({"kernels_ms": kernel_times} if kernel_times else {}),
            )
            if rank == 0:
                emit(row, sink)
    if sink:
        sink.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
