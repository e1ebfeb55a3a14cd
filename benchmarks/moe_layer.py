"""MoE layer forward+backward on one GPU: stock megatron-core vs the patch set's variants.

Every variant is measured in the same process as the stock path it is compared
with, on identical weights and inputs, and printed as one JSON line:

    python benchmarks/moe_layer.py --shapes qwen3-30b-a3b,mixtral --tokens 8192,32768 \
        --precisions bf16,fp8 --variants stock,patched

Fields: median ms (CUDA events), TFLOP/s of the expert GEMM work, peak MiB
allocated during the timed steps, and ``speedup_vs_stock`` (stock ms / variant ms).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from megatron.moe_patches import apply, revert  # noqa: E402
from megatron.moe_patches.plan import graph_scope  # noqa: E402
from megatron.moe_patches.graphs.layer_graphs import LayerGraphs  # noqa: E402
from megatron.moe_patches.testing.layer_harness import (  # noqa: E402
    SHAPES,
    build_moe_layer,
    expert_gemm_flops,
    forward_backward,
    fp8_context,
    init_single_gpu,
    moe_config_kwargs,
)

# name -> config fields set on top of the stock config; any variant but "stock" runs with
# the whole series applied. "patched" keeps every new field at its default, which switches
# on what needs no flag: F1's fused permute+pad under FP8. Feature issues add variants here.
GRAPHED = {"cuda_graph_impl": "local", "cuda_graph_scope": "moe"}
VARIANTS = {
    "stock": None,
    "patched": {},
    # F8 + the sync-free expert backends: grouped_mm (bf16), fp8_grouped_mm (F10, FP8 tensorwise).
    "device-splits": {"moe_device_tokens_per_expert": True},
    # ... with one [E, out, in] parameter per FC (F5): one gradient accumulation, not one per expert.
    "device-splits-grouped": {"moe_device_tokens_per_expert": True, "moe_single_grouped_weight": True},
    # F11: the same layers captured as CUDA graphs (forward + backward), replayed each step.
    "device-splits-graph": {"moe_device_tokens_per_expert": True, **GRAPHED},
    "device-splits-grouped-graph": {"moe_device_tokens_per_expert": True, "moe_single_grouped_weight": True,
                                    **GRAPHED},
    # F12: EP > 1 tokens through symmetric memory (no host sync, no chunk sort).
    "symmetric-exchange": {"moe_device_tokens_per_expert": True, "moe_symmetric_exchange": True},
    # ... captured as CUDA graphs (F11 at EP > 1).
    "symmetric-exchange-graph": {"moe_device_tokens_per_expert": True, "moe_symmetric_exchange": True, **GRAPHED},
    # ... with one [E, out, in] parameter per FC (F5).
    "symmetric-exchange-grouped": {"moe_device_tokens_per_expert": True, "moe_symmetric_exchange": True,
                                   "moe_single_grouped_weight": True},
    "symmetric-exchange-grouped-graph": {"moe_device_tokens_per_expert": True, "moe_symmetric_exchange": True,
                                         "moe_single_grouped_weight": True, **GRAPHED},
    # F4: the experts as one te.ops pipeline (basic ops on Hopper), with and without interleave.
    "op-fuser": {"use_transformer_engine_op_fuser": True},
    "op-fuser-interleave": {"use_transformer_engine_op_fuser": True, "moe_mlp_glu_interleave_size": 32},
}


def measure(layer, hidden, grad, warmup: int, iters: int, microbatches_per_step: int = 1):
    for _ in range(warmup):
        forward_backward(layer, hidden, grad)
        layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if i % microbatches_per_step == 0:
            # A step's first micro-batch, as megatron-core's schedules mark it: FP8 weight copies
            # (TE's and the FP8 experts') are requantized.
            layer.set_is_first_microbatch()
        start.record()
        forward_backward(layer, hidden, grad)
        end.record()
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


# Kernels of the expert-parallel exchange: NCCL's, and F12's stores, barriers and the owners'
# copies of each token to its experts' rows (torch's index_select).
EXCHANGE_KERNELS = ("nccl", "push_slots_kernel", "barrier", "indexselect")


def kernel_device_ms(layer, hidden, grad) -> dict:
    """Device time (ms) of each kernel name in one forward+backward."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward_backward(layer, hidden, grad)
        torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    times = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "self_device_time_total", None) or event.self_cuda_time_total
            times[event.key] = times.get(event.key, 0.0) + us / 1000
    return times


def exchange_ms(layer, hidden, grad) -> float:
    """Device time of the expert-parallel exchange's kernels in one forward+backward."""
    return sum(ms for name, ms in kernel_device_ms(layer, hidden, grad).items()
               if any(k in name.lower() for k in EXCHANGE_KERNELS))


def top_kernels(layer, hidden, grad, count: int) -> dict:
    """The ``count`` kernels with the most device time in one forward+backward (ms, names cut
    at 90 characters), and their total under "total"."""
    times = {}
    for name, ms in kernel_device_ms(layer, hidden, grad).items():  # kernels whose cut names agree add up
        times[name[:90]] = times.get(name[:90], 0.0) + ms
    top = sorted(times.items(), key=lambda item: -item[1])[:count]
    return {"total": round(sum(times.values()), 3), **{name: round(ms, 3) for name, ms in top}}


def run_variant(name, shape, tokens, precision, warmup, iters, microbatches_per_step=1, seed=0, ep=1, kernels=0):
    """Time one variant; returns (median ms, peak MiB, backend name, exchange ms or None, top
    kernels or None). ``seed``: of this rank's input; ``ep`` > 1: the config's expert parallelism
    (the process group must match), and one step's exchange kernels are profiled; ``kernels``:
    how many of one step's kernels to report by device time."""
    import megatron.core.transformer.transformer_config as tc_module

    overrides = VARIANTS[name]
    revert()
    if overrides is not None:
        apply()
    layer = graphs = None
    try:
        config = tc_module.TransformerConfig(**moe_config_kwargs(shape, precision, expert_model_parallel_size=ep,
                                                                      **(overrides or {})))
        layer = build_moe_layer(config)
        generator = torch.Generator(device="cuda").manual_seed(seed)
        hidden = torch.randn(tokens, 1, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        grad = torch.randn_like(hidden)
        if graph_scope(config).by_layer:
            graphs = LayerGraphs([layer], hidden, context=lambda: fp8_context(config)).install()
        ms, peak = measure(layer, hidden, grad, warmup, iters, microbatches_per_step)
        backend = getattr(getattr(layer.experts, "backend", None), "name", "stock")
        exchange_time = exchange_ms(layer, hidden, grad) if ep > 1 else None
        kernel_times = top_kernels(layer, hidden, grad, kernels) if kernels else None
    finally:
        revert()
        if graphs is not None:
            graphs.uninstall()  # the layer's replaying forward refers back to it: free both now
        del layer, graphs
        torch.cuda.empty_cache()
    return ms, peak, backend, exchange_time, kernel_times


def benchmark_parser(description: str, tokens_help: str, precisions: str, out_help: str) -> argparse.ArgumentParser:
    """The flags this benchmark and moe_layer_ep.py share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--tokens", default="8192", help=tokens_help)
    parser.add_argument("--precisions", default=precisions,
                        help="comma list of bf16, fp8 (tensorwise), fp8-blockwise; a -bf16-wgrad suffix on an FP8 one: --no-fp8-wgrad")
    parser.add_argument("--variants", default="stock", help=f"comma list of {list(VARIANTS)}")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help=out_help)
    return parser


def selected_variants(parser: argparse.ArgumentParser, args) -> list:
    """The variants to run, stock first; unknown variant or shape names are a usage error."""
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown variant/shape: {unknown}")
    if "stock" not in variants:
        variants.insert(0, "stock")  # ratios always need the stock path of the same run
    return variants


def cases(args):
    """(shape name, shape, tokens, precision) for every case the flags select."""
    for shape_name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for precision in args.precisions.split(","):
                yield shape_name, SHAPES[shape_name], tokens, precision


def emit(row: dict, sink) -> None:
    """Print one result as a JSON line, and append it to ``sink`` when there is one."""
    line = json.dumps(row)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")


def main(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0], "comma list of token counts", "bf16,fp8",
                              "also append the JSON lines to this file")
    parser.add_argument("--microbatches-per-step", type=int, default=1,
                        help="timed iterations between optimizer steps (FP8 weight caches refresh at each)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="also profile one forward+backward and report this many kernels by device time")
    args = parser.parse_args(argv)
    variants = selected_variants(parser, args)

    init_single_gpu()
    sink = open(args.out, "a") if args.out else None
    device = torch.cuda.get_device_name()
    for shape_name, shape, tokens, precision in cases(args):
        stock_ms = None
        for variant in variants:
            ms, peak, backend, _, kernel_times = run_variant(
                variant, shape, tokens, precision, args.warmup, args.iters, args.microbatches_per_step,
                kernels=args.kernels,
            )
            stock_ms = ms if variant == "stock" else stock_ms
            emit(dict(
                shape=shape_name, tokens=tokens, precision=precision, variant=variant, backend=backend,
                ms=round(ms, 3),
                tflops=round(expert_gemm_flops(shape, tokens) / ms / 1e9, 1),
                peak_mib=round(peak),
                speedup_vs_stock=round(stock_ms / ms, 3),
                device=device,
                microbatches_per_step=args.microbatches_per_step,
                **({"kernels_ms": kernel_times} if kernel_times else {}),
            ), sink)
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
