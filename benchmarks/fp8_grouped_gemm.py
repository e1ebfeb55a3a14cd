"""FP8 grouped GEMMs of MoE experts, one GPU: fprop, dgrad and wgrad of FC1 and FC2 on
Qwen3-30B-A3B-, DeepSeek-V2-Lite- and Mixtral-like shapes, timed for bf16
``torch._grouped_mm``, ``torch._scaled_grouped_mm`` (rowwise scales; wgrad in its 2d-2d form
as F10 calls it) and the Triton kernels of ``megatron/moe_patches/kernels/fp8_grouped_gemm.py``
(tensorwise and blockwise recipes, a few fixed configurations each), and with --deepgemm
DeepGEMM's SM90 blockwise grouped GEMM (``m_grouped_fp8_gemm_nt_contiguous``, groups read from
device-side ends, "psum" layout) for fprop and dgrad. DeepGEMM needs every expert's rows to
start on a 128-row boundary, so --deepgemm needs --group-align 128 (every peer sees those rows).

Per line: the shape, CUDA-event ms (median of --iters after 3 warm-up calls), TFLOP/s
(2 * rows * K * N per GEMM), and for every FP8 path the max abs and max relative (to the
largest reference magnitude) error against the PyTorch twin of its recipe on the same FP8
inputs. Routing: ``--tokens`` tokens x top-k routed rows, a seeded uneven split over the
experts, each expert's rows a multiple of --group-align (default 16, what torch's 2d-2d FP8
wgrad needs); the Triton wgrad reads token-major copies whose expert segments are padded to
128 columns.

    python3 benchmarks/fp8_grouped_gemm.py --out results.jsonl
    python3 benchmarks/fp8_grouped_gemm.py --shapes qwen3 --configs picked   # the rule's pick only
    python3 benchmarks/fp8_grouped_gemm.py --deepgemm --group-align 128 --configs picked   # DeepGEMM installed

Nothing here is a test: no timing decides an outcome.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.moe_patches.kernels import fp8_scaling as fs  # noqa: E402
from megatron.moe_patches.kernels import fp8_grouped_gemm as g  # noqa: E402

MODELS = {  # hidden, ffn (FC1 writes 2 * ffn: gate and up), experts, top-k
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (2048, 1408, 64, 6),
    "mixtral": (4096, 14336, 8, 2),
}
ALTERNATIVES = {  # tried beside the rule's pick with --configs auto
    ("nt", "tensorwise"): ["m128n256k128s3w8", "m256n128k128s3w8"],
    ("nt", "blockwise"): ["m128n128k128s4w8", "m128n256k128s3w8"],
    ("wgrad", "tensorwise"): ["m128n128k128s4w8", "m128n256k128s3w8"],
    ("wgrad", "blockwise"): ["m128n128k128s4w8", "m128n256k128s3w8"],
}


def routed_ends(rows, experts, seed, align=16):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.5
    counts = torch.multinomial(weights / weights.sum(), rows, replacement=True, generator=gen).bincount(
        minlength=experts)
    counts = (counts + align - 1) // align * align
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), int(counts.sum()), int(counts.max())


def time_ms(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[iters // 2]


def errors(got, want):
    d = (got.float() - want.float()).abs().max().item()
    m = want.float().abs().max().item()
    return {"max_abs": d, "max_rel": d / m if m else float("nan")}


def entry(fn, flops, iters, want=None):
    try:
        out = fn()
        result = errors(out, want) if want is not None else {}
        del out
        ms = time_ms(fn, iters)
        return {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), **result}
    except Exception as exc:  # noqa: BLE001 - the line says what failed, the run goes on
        return {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}


def configs_for(gemm, recipe, K, N, fast, choice):
    picked = g.pick_config(gemm, recipe, K, N, fast).name
    names = [picked] if choice == "picked" else [picked] + ALTERNATIVES[(gemm, recipe)]
    if choice not in ("auto", "picked"):
        names = [picked] + choice.split(",")
    blockwise = recipe == "blockwise"
    return list(dict.fromkeys(n for n in names if not (blockwise and g.CONFIGS[n].block_k != 128)))


def triton_runs(make, gemm, recipe, K, N, fast, flops, iters, want, choice):
    runs = []
    for name in configs_for(gemm, recipe, K, N, fast, choice):
        runs.append({"config": name, **entry(lambda: make(name), flops, iters, want)})
    return runs


def best(runs):
    timed = [r for r in runs if "ms" in r]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def deepgemm_nt(deep_gemm, a8, sa, b8, sb, ends, N):
    """DeepGEMM's blockwise grouped fprop/dgrad on 128-aligned groups (device-side ends). Its
    SM90 kernel reads the 1x128 scales MN-major and TMA-aligned: converted once here, outside
    the timing, as a quantizer would write them."""
    sa_mn = deep_gemm.get_mn_major_tma_aligned_tensor(sa)
    y = torch.empty(a8.shape[0], N, device=a8.device, dtype=torch.bfloat16)

    def run():
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8, sa_mn), (b8, sb), y, ends, use_psum_layout=True)
        return y

    return run


def bench_fc(model, fc, rows, experts, I, O, args):
    """One FC y_TO = x_TI . w_EOI^T: three GEMMs, each a JSON line."""
    ends, T, max_rows = routed_ends(rows, experts, seed=2 * list(MODELS).index(model) + (fc == "fc2"),
                                    align=args.group_align)
    torch.manual_seed(0)
    x = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)
    w_EOI = (torch.randn(experts, O, I, device="cuda") / I**0.5).to(torch.bfloat16)
    E = experts
    ones_E = torch.ones(E, device="cuda")

    # tensorwise: one scale per tensor, as a per-expert vector (what the kernels take)
    x8, sx = fs.quantize_tensorwise(x)
    dy8, sdy = fs.quantize_tensorwise(dy)
    w8_EOI, sw = fs.quantize_tensorwise(w_EOI)
    w8_EIO = w8_EOI.transpose(1, 2).contiguous()
    sx_E, sdy_E, sw_E = sx * ones_E, sdy * ones_E, sw * ones_E
    # blockwise: 1x128 activations and gradients, 128x128 weights (TE's Float8BlockScaling)
    bx8, bsx = fs.quantize_1x128(x)
    bdy8, bsdy = fs.quantize_1x128(dy)
    bw8_EOI, bsw_EOI = fs.quantize_128x128(w_EOI)
    bw8_EIO, bsw_EIO = fs.transpose_128x128(bw8_EOI, bsw_EOI)

    base = {"model": model, "fc": fc, "tokens": args.tokens, "rows": T, "E": E, "max_rows_per_expert": max_rows,
            "group_align": args.group_align,
            "device": torch.cuda.get_device_name()}

    for gemm, a8, sa, b8, sb, a_b, b_b, sa_b, sb_b, K, N, bf16_fn in (
        ("fprop", x8, sx_E, w8_EOI, sw_E, bx8, bw8_EOI, bsx, bsw_EOI, I, O,
         lambda: torch._grouped_mm(x, w_EOI.transpose(1, 2), offs=ends)),
        ("dgrad", dy8, sdy_E, w8_EIO, sw_E, bdy8, bw8_EIO, bsdy, bsw_EIO, O, I,
         lambda: torch._grouped_mm(dy, w_EOI, offs=ends)),
    ):
        flops = 2.0 * T * K * N
        line = {**base, "gemm": gemm, "K": K, "N": N}
        line["bf16_grouped_mm"] = entry(bf16_fn, flops, args.iters)
        want = g.fp8_grouped_nt_reference(a8, b8, ends, sa, sb)
        sa_T = torch.repeat_interleave(sa, torch.diff(ends, prepend=ends.new_zeros(1)).long(), output_size=T)
        line["scaled_grouped_mm_rowwise"] = entry(
            lambda: torch._scaled_grouped_mm(a8, b8.transpose(1, 2), sa_T, sb[:, None].expand(-1, N).contiguous(),
                                             offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True),
            flops, args.iters, want)
        line["triton_tensorwise"] = triton_runs(
            lambda c: g.fp8_grouped_nt(a8, b8, ends, sa, sb, "tensorwise", fast_accum=True, config=c),
            "nt", "tensorwise", K, N, True, flops, args.iters, want, args.configs)
        del want
        want = g.fp8_grouped_nt_reference(a_b, b_b, ends, sa_b, sb_b, "blockwise")
        line["triton_blockwise"] = triton_runs(
            lambda c: g.fp8_grouped_nt(a_b, b_b, ends, sa_b, sb_b, "blockwise", config=c),
            "nt", "blockwise", K, N, False, flops, args.iters, want, args.configs)
        if args.deep_gemm:
            line["deepgemm_blockwise"] = entry(deepgemm_nt(args.deep_gemm, a_b, sa_b, b_b, sb_b, ends, N),
                                               flops, args.iters, want)
        del want
        summarize(line)
        emit(line, args)

    # wgrad: dW_EOI = dy^T x per expert (N = O, K = I), contraction over each expert's rows
    flops = 2.0 * T * I * O
    line = {**base, "gemm": "wgrad", "K": I, "N": O}
    line["bf16_grouped_mm"] = entry(lambda: torch._grouped_mm(dy.t(), x, offs=ends), flops, args.iters)
    layout = g.token_major_layout(ends, T)
    dy8_OP, x8_IP = g.to_token_major(dy8, layout), g.to_token_major(x8, layout)
    want = g.fp8_grouped_wgrad_reference(dy8_OP, x8_IP, layout.padded_ends_E, sdy_E, sx_E)  # float32
    dy8_OT, x8_IT = dy8.t().contiguous(), x8.t().contiguous()  # rows already 16-aligned per expert
    line["scaled_grouped_mm_rowwise"] = entry(
        lambda: torch._scaled_grouped_mm(dy8_OT, x8_IT.t(), sdy_E[:, None].expand(-1, O).reshape(-1),
                                         sx_E[:, None].expand(-1, I).reshape(-1), offs=ends,
                                         out_dtype=torch.bfloat16, use_fast_accum=False),
        flops, args.iters, want)
    dy8_OT = x8_IT = None  # free them (the lambdas above have run)
    line["triton_tensorwise"] = triton_runs(
        lambda c: g.fp8_grouped_wgrad(dy8_OP, x8_IP, layout.padded_ends_E, sdy_E, sx_E, "tensorwise", config=c),
        "wgrad", "tensorwise", I, O, False, flops, args.iters, want, args.configs)
    main_grad = torch.zeros(E, O, I, device="cuda")
    line["triton_tensorwise_accumulate"] = entry(
        lambda: g.fp8_grouped_wgrad(dy8_OP, x8_IP, layout.padded_ends_E, sdy_E, sx_E, "tensorwise",
                                    accumulate_into=main_grad), flops, args.iters)
    dy8_OP = x8_IP = want = None
    bdy8_OP, bsdy_OP = fs.quantize_1x128(g.to_token_major(dy, layout))
    bx8_IP, bsx_IP = fs.quantize_1x128(g.to_token_major(x, layout))
    want = g.fp8_grouped_wgrad_reference(bdy8_OP, bx8_IP, layout.padded_ends_E, bsdy_OP, bsx_IP, "blockwise")
    line["triton_blockwise"] = triton_runs(
        lambda c: g.fp8_grouped_wgrad(bdy8_OP, bx8_IP, layout.padded_ends_E, bsdy_OP, bsx_IP, "blockwise", config=c),
        "wgrad", "blockwise", I, O, False, flops, args.iters, want, args.configs)
    if args.deep_gemm:
        line["deepgemm_blockwise"] = {"skipped": "DeepGEMM's SM90 K-grouped FP8 GEMM takes the experts' row "
                                                 "counts as a host list (a sync each call, no CUDA graph)"}
    line["triton_blockwise_accumulate"] = entry(
        lambda: g.fp8_grouped_wgrad(bdy8_OP, bx8_IP, layout.padded_ends_E, bsdy_OP, bsx_IP, "blockwise",
                                    accumulate_into=main_grad), flops, args.iters)
    summarize(line)
    emit(line, args)


def summarize(line):
    bf16 = line["bf16_grouped_mm"].get("ms")
    for key in ("scaled_grouped_mm_rowwise", "triton_tensorwise", "triton_blockwise", "deepgemm_blockwise"):
        value = line.get(key)
        top = best(value) if isinstance(value, list) else (value if value and "ms" in value else None)
        if top and bf16:
            line.setdefault("speedup_vs_bf16", {})[key] = round(bf16 / top["ms"], 3)


def emit(line, args):
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", default="auto",
                        help="auto (the rule's pick and ALTERNATIVES), picked, or comma-separated CONFIGS names")
    parser.add_argument("--group-align", type=int, default=16,
                        help="round every expert's row count up to a multiple of this (16 or more)")
    parser.add_argument("--deepgemm", action="store_true",
                        help="also time DeepGEMM's blockwise fprop/dgrad (needs deep_gemm installed)")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.group_align < 16 or args.group_align % 16:
        parser.error(f"--group-align must be a multiple of 16, not {args.group_align}")
    if args.deepgemm:
        if args.group_align % 128:
            parser.error("--deepgemm needs --group-align 128 (DeepGEMM's groups start on 128-row boundaries)")
        import deep_gemm  # the error names the missing package
    args.deep_gemm = deep_gemm if args.deepgemm else None  # the module the peer calls
    started = time.time()
    for model in args.shapes.split(","):
        hidden, ffn, experts, topk = MODELS[model]
        rows = args.tokens * topk
        bench_fc(model, "fc1", rows, experts, hidden, 2 * ffn, args)
        torch.cuda.empty_cache()
        bench_fc(model, "fc2", rows, experts, ffn, hidden, args)
        torch.cuda.empty_cache()
    print(json.dumps({"done_s": round(time.time() - started, 1)}), file=sys.stderr)


if __name__ == "__main__":
    main()
