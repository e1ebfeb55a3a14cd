"""The experts' weight gradient added into fp32 main grads (F13), one GPU, CUDA events.

Per FC of one MoE layer (tokens x top-k rows grouped by expert, routing drawn uniformly):

- ``unfused``: what runs without the fusion: torch._grouped_mm writes the bf16 weight gradient
  [E, out, in], then DDP's hook adds it into the fp32 main grad (one add over the grouped
  parameter; per-expert parameters would add once per expert);
- ``fused``: kernels/main_grad_accumulation.py's Triton kernel, for each tile configuration given.

Floor: the fp32 main grad read and written once (8 bytes per weight) against the HBM
bandwidth, or the GEMM's FLOPs at the dense bf16 rate, whichever is larger.

    python3 benchmarks/wgrad_main_grad.py --tokens 4096 --out results.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.moe_patches.kernels.main_grad_accumulation import (  # noqa: E402
    MainGradTable, Tiles, TILES, grouped_wgrad_into_main_grad)

SHAPES = {  # hidden, moe_ffn, experts, topk
    "qwen3-like": (2048, 768, 128, 8),
    "deepseek-like": (2048, 1408, 64, 6),
    "mixtral-like": (4096, 14336, 8, 2),
}
CONFIGS = [TILES, Tiles(64, 128, 64, 4, 3), Tiles(128, 128, 32, 8, 4), Tiles(128, 64, 64, 4, 3)]


def timed(fn, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = []
    for name in args.shapes.split(","):
        hidden, ffn, experts, topk = SHAPES[name]
        rows = args.tokens * topk
        generator = torch.Generator(device="cuda").manual_seed(0)
        expert_R = torch.randint(0, experts, (rows,), device="cuda", generator=generator)
        offsets_E = torch.bincount(expert_R, minlength=experts).cumsum(0).to(torch.int32)
        for fc, (out_f, in_f) in (("fc1", (2 * ffn, hidden)), ("fc2", (hidden, ffn))):
            x_TI = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16, generator=generator)
            dy_TO = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16, generator=generator)
            main_grad = torch.zeros(experts, out_f, in_f, device="cuda")
            targets = list(main_grad.unbind(0))
            flops = 2.0 * rows * out_f * in_f
            floor_bytes = 8.0 * experts * out_f * in_f
            common = dict(shape=name, fc=fc, tokens=args.tokens, rows=rows, experts=experts, out=out_f, inp=in_f,
                          device=torch.cuda.get_device_name(), torch=torch.__version__)

            def unfused():
                main_grad.add_(torch._grouped_mm(dy_TO.t(), x_TI, offs=offsets_E))

            ms = timed(unfused, args.iters)
            results = {"unfused": ms}
            lines.append(dict(common, variant="unfused", ms=ms, tflops=flops / ms / 1e9,
                              hbm_tb_s_floor_bytes=floor_bytes / ms / 1e9))
            # numerics once: fused vs unfused from zero
            reference = torch._grouped_mm(dy_TO.t(), x_TI, offs=offsets_E).float()
            table = MainGradTable(triton=True)
            for tiles in CONFIGS:
                main_grad.zero_()
                grouped_wgrad_into_main_grad(x_TI, dy_TO, offsets_E, targets, table, tiles)
                max_rel = ((main_grad - reference).abs().max() / reference.abs().max()).item()
                ms = timed(lambda: grouped_wgrad_into_main_grad(x_TI, dy_TO, offsets_E, targets, table, tiles),
                           args.iters)
                results[str(tuple(tiles))] = ms
                lines.append(dict(common, variant="fused", tiles=list(tiles), ms=ms, tflops=flops / ms / 1e9,
                                  hbm_tb_s_floor_bytes=floor_bytes / ms / 1e9, max_rel_vs_bf16_unfused=max_rel,
                                  speedup_vs_unfused=results["unfused"] / ms))
            print(name, fc, {k: round(v, 3) for k, v in results.items()}, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
