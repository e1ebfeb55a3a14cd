"""Model-level benchmark: a Qwen3-30B-A3B-shaped slice (its attention and MoE shapes, 4 layers,
sequence 4096) trained in Megatron-LM's own loop and in this package's driver, one GPU.

Each run is a real pretraining run launched as a user launches it (torchrun, Megatron-LM
flags, mock data): Megatron-LM's pretrain_gpt.py from the checkout MEGATRON_LM_PATH names
(edited as README says; as shipped for ``stock``), or this repository's pretrain_gpt.py.
Variants:

- ``stock``: megatron-core 0.16.1's MoE layer (TE grouped experts, host-synced token counts);
- ``eager``: the fast path (device token counts with the grouped_mm / fp8_grouped_mm expert
  backends, one [E, out, in] weight per FC), no graphs;
- ``graphed``: the fast path with the MoE layers captured as CUDA graphs
  (``--cuda-graph-scope moe``);
- ``graphed-fused``: ``graphed`` with Megatron-LM's default gradient-accumulation fusion
  (F13: weight gradients added into the fp32 main grads by the GEMMs; the other variants pass
  ``--no-gradient-accumulation-fusion``, which Megatron-LM as shipped needs without APEX).

Per run it writes one JSON line: median ms per iteration over the iterations after the
warm-up (graphs are captured by then), tokens/s, TFLOP/s per GPU (Megatron-LM's own count,
from its log line), peak MiB allocated (torch's peak over the whole run, read at exit), the
median forward-backward and optimizer ms (``--timing-log-level 1``), the losses, and
``speedup_vs_stock`` against the stock run of the same loop and precision in this
invocation. ``--profile`` adds one Megatron-LM-loop run per precision of the graphed
variant under torch.profiler and a breakdown of one iteration's GPU time by kernel family.

    python3 benchmarks/moe_model.py --loops megatron-lm,driver --precisions bf16,fp8 \\
        --variants stock,eager,graphed --out results.jsonl
"""

import argparse
import atexit
import glob
import gzip
import json
import os
import re
import runpy
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = 4
SEQ = 4096
SLICE = [
    "--num-layers", str(LAYERS), "--hidden-size", "2048", "--ffn-hidden-size", "6144",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
    "--qk-layernorm", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-experts", "128", "--moe-ffn-hidden-size", "768", "--moe-router-topk", "8", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--lr-decay-iters", "100", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--split", "100,0,0",
    "--log-interval", "1", "--log-throughput", "--timing-log-level", "1",
    "--eval-iters", "0", "--seed", "1234", "--distributed-timeout-minutes", "10",
]
# Megatron-LM evaluates every --eval-interval steps; the driver only trains (and refuses the flag).
LOOP_FLAGS = {"megatron-lm": ["--eval-interval", "100000"], "driver": []}
FAST = ["--moe-device-tokens-per-expert", "--moe-single-grouped-weight"]
GRAPH_WARMUP = 2
NO_FUSION = ["--no-gradient-accumulation-fusion"]  # Megatron-LM as shipped needs it without APEX
GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe",
          "--cuda-graph-warmup-steps", str(GRAPH_WARMUP)]
VARIANTS = {
    "stock": NO_FUSION,
    "eager": FAST + NO_FUSION,
    "graphed": FAST + GRAPHS + NO_FUSION,
    # F13: Megatron-LM's default gradient-accumulation fusion, without APEX
    "graphed-fused": FAST + GRAPHS,
    # each transformer layer whole in one graph (attention and MoE; no --cuda-graph-scope)
    "graphed-layer": FAST + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-warmup-steps", str(GRAPH_WARMUP)],
    # megatron-core's capture of the whole iteration (every micro-batch's forward and backward)
    "full-iteration": FAST + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
                              "--cuda-graph-warmup-steps", str(GRAPH_WARMUP), "--no-check-for-nan-in-loss-and-grad"],
}
BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
PRECISIONS = {
    "bf16": [],
    "fp8": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "fp8-blockwise": BLOCKWISE,
    "fp8-blockwise-bf16-wgrad": BLOCKWISE + ["--no-fp8-wgrad"],
}
LOOPS = ("megatron-lm", "driver")
PEAK_LINE = "benchmark peak allocated MiB:"
# Kernel families of the profiled iteration, first match wins (lower-case substrings).
FAMILIES = (
    ("attention", ("flash", "fmha", "cudnn", "attn")),
    ("expert GEMMs", ("grouped", "groupproblemshape", "_scaled_mm", "f8f8", "deep_gemm")),
    ("fp32 grad accumulation", ("cudafunctor_add<float>",)),
    ("optimizer", ("multi_tensor", "adam", "l2norm", "scale_kernel")),
    ("FP8 quantization", ("cast_transpose", "quantize", "weight_tiles_kernel", "rows_kernel", "both_kernel", "amax")),
    ("other GEMMs", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("permute / routing", ("permute", "sort", "topk", "router", "histogram", "cumsum", "scatter", "gather",
                           "index")),
    ("normalization / rope", ("norm", "rope", "rotary")),
    ("loss / embedding", ("cross_entropy", "embedding", "log_softmax", "vocab")),
    ("communication", ("nccl",)),
    ("memcpy / memset", ("memcpy", "memset")),
)


def run_child(loop: str) -> None:
    """Inside the torchrun worker: run the loop's pretrain_gpt.py, then print torch's peak."""
    import torch

    atexit.register(lambda: print(f"{PEAK_LINE} {torch.cuda.max_memory_allocated() / 2**20:.0f}", flush=True))
    if loop == "megatron-lm":
        from megatron.moe_patches.testing import megatron_lm_pretrain

        megatron_lm_pretrain.main()
    else:
        sys.argv[0] = str(ROOT / "pretrain_gpt.py")
        runpy.run_path(sys.argv[0], run_name="__main__")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch(loop, variant, precision, iters, global_batch, extra=()):
    """One torchrun of one loop; (returncode, output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
           str(free_port()), __file__, "--child", loop, *SLICE, *LOOP_FLAGS[loop], *VARIANTS[variant],
           *PRECISIONS[precision], "--micro-batch-size", "1", "--global-batch-size", str(global_batch),
           "--train-iters", str(iters), *extra]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH"),
                                                      env.get("MEGATRON_LM_PATH")]))
    if loop == "megatron-lm" and variant == "stock":
        env["MEGATRON_LM_AS_SHIPPED"] = "1"
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=540)
    return run.returncode, run.stdout + run.stderr


ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


def field(line: str, label: str):
    match = re.search(re.escape(label) + r"\s*:?\s*([0-9.Ee+-]+)", line)
    return float(match.group(1)) if match else None


def timer_ms(block: str, name: str):
    """Megatron-LM's timer report line ``name ....: (min, max)`` (or one number): the max."""
    match = re.search(rf"^\s*{re.escape(name)}\s*\.*:?\s*\(?([0-9.]+)(?:,\s*([0-9.]+))?\)?", block, re.M)
    if not match:
        return None
    return float(match.group(2) or match.group(1))


def parse(output: str, warmup: int) -> dict:
    """Per-iteration numbers of the log, medians over the iterations after ``warmup``."""
    rows = {}
    for match in ITERATION.finditer(output):
        step, line = int(match.group(1)), match.group(2)
        rows[step] = {
            "ms": field(line, "elapsed time per iteration (ms)"),
            "tflops": field(line, "throughput per GPU (TFLOP/s/GPU)"),
            "loss": field(line, "lm loss"),
        }
    # Timer reports follow each iteration line in Megatron-LM's log; the driver puts phases on it.
    chunks = ITERATION.split(output)
    for i in range(1, len(chunks) - 2, 3):
        step, line, after = int(chunks[i]), chunks[i + 1], chunks[i + 2]
        rows[step]["forward-backward ms"] = field(line, "forward-backward (ms)") or timer_ms(after, "forward-backward")
        rows[step]["optimizer ms"] = field(line, "optimizer (ms)") or timer_ms(after, "optimizer")
    timed = [rows[s] for s in sorted(rows) if s > warmup]

    def median(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return round(statistics.median(values), 2) if values else None

    peak = re.findall(re.escape(PEAK_LINE) + r"\s*([0-9.]+)", output)
    return {
        "ms": median("ms"), "tflops_per_gpu": median("tflops"), "forward_backward_ms": median("forward-backward ms"),
        "optimizer_ms": median("optimizer ms"), "peak_mib": float(peak[-1]) if peak else None,
        "timed_iterations": len(timed), "losses": {s: rows[s]["loss"] for s in sorted(rows)},
    }


def captured(output: str):
    """Layers the patch set captured (MoE layers, or transformer layers whole); 'iteration' where
    the whole iteration was captured."""
    if "Capture CUDA graph for training" in output or "captured the whole training iteration" in output:
        return "iteration"
    counts = re.findall(r"moe_patches: captured (\d+) (?:MoE|transformer) layers", output)
    return sum(int(n) for n in counts)


def family(kernel: str) -> str:
    name = kernel.lower()
    for label, needles in FAMILIES:
        if any(n in name for n in needles):
            return label
    return "other elementwise"


def profile_breakdown(trace_dir: str) -> dict:
    """GPU ms by kernel family in one profiled iteration (torch.profiler's chrome trace)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)
    if not files:
        return {"error": f"no trace under {trace_dir}"}
    path = max(files, key=os.path.getmtime)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    totals, kernels = {}, {}
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in event:
            label = family(event["name"])
            totals[label] = totals.get(label, 0.0) + event["dur"] / 1000.0
            kernels[event["name"][:120]] = kernels.get(event["name"][:120], 0.0) + event["dur"] / 1000.0
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    result = {"gpu_ms_by_family": {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
              "top_kernels_ms": {k: round(v, 2) for k, v in top}}
    result.update(host_breakdown(events))
    return result


def _top(events, category, count):
    totals, calls = {}, {}
    for event in events:
        if event.get("cat") == category and "dur" in event:
            name = event["name"][:140]
            totals[name] = totals.get(name, 0.0) + event["dur"] / 1000.0
            calls[name] = calls.get(name, 0) + 1
    return {k: [round(v, 2), calls[k]] for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:count]}


def host_breakdown(events) -> dict:
    """Where the host's time goes in the profiled iteration: the GPU's idle time (the kernels'
    span minus their union), the CUDA runtime calls (syncs show as long ones) and the Python
    functions by inclusive time ([ms, calls])."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (spans[-1][1] - spans[0][0]) / 1000.0 if spans else 0.0
    return {"gpu_span_ms": round(span, 2), "gpu_idle_ms": round(span - busy / 1000.0, 2),
            "cuda_runtime_ms_calls": _top(events, "cuda_runtime", 12),
            "host_syncs_by_caller": sync_callers(events),
            "python_ms_calls": _top(events, "python_function", 40)}


def sync_callers(events, depth=7) -> dict:
    """The Python callers (innermost ``depth`` frames) of each CUDA runtime call that waits for
    the GPU, counted: where a loop's host stalls."""
    frames = {}
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            frames.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    callers = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "dur" not in e:
            continue
        if not any(k in e["name"] for k in ("Synchronize", "cudaMemcpy(", "cudaMemcpy ")) and e["name"] != "cudaMemcpy":
            continue
        around = [f for f in frames.get((e.get("pid"), e.get("tid")), [])
                  if f["ts"] <= e["ts"] and f["ts"] + f["dur"] >= e["ts"] + e["dur"]]
        stack = " < ".join(f["name"][:90] for f in sorted(around, key=lambda f: f["dur"])[:depth])
        key = f"{e['name']}: {stack}"
        ms, calls = callers.get(key, (0.0, 0))
        callers[key] = (ms + e["dur"] / 1000.0, calls + 1)
    return {k: [round(v[0], 2), v[1]] for k, v in sorted(callers.items(), key=lambda kv: -kv[1][1])[:20]}


def one(loop, variant, precision, iters, global_batch, warmup, device, extra=()):
    code, output = launch(loop, variant, precision, iters, global_batch, extra)
    line = {"benchmark": "moe_model", "device": device, "loop": loop, "variant": variant, "precision": precision,
            "layers": LAYERS, "seq_length": SEQ, "micro_batch": 1, "global_batch": global_batch, "iters": iters,
            "extra_flags": " ".join(extra), "returncode": code}
    if code != 0:
        # the first errors (the cause; a failed capture reports only "a previous error" at its end) and the end
        lines = output.splitlines()
        at = next((i for i, l in enumerate(lines) if re.search(r"Error:|error:|Exception:", l)), len(lines))
        line["error"] = "\n".join(lines[max(0, at - 40):at + 3])[-5000:] + "\n...\n" + output[-1500:]
        return line
    line.update(parse(output, warmup))
    if line["ms"]:
        line["tokens_per_s"] = round(global_batch * SEQ / (line["ms"] / 1000.0))
    if variant != "stock" and variant != "eager":
        line["captured"] = captured(output)
    return line


def profiled(variant, precision, iters, global_batch, device, start, extra=()):
    trace_dir = tempfile.mkdtemp(prefix="moe-model-trace-")
    extra = [*extra, "--profile", "--use-pytorch-profiler", "--profile-step-start", str(start),
             "--profile-step-end", str(start + 1), "--tensorboard-dir", trace_dir]
    code, output = launch("megatron-lm", variant, precision, iters, global_batch, extra)
    line = {"benchmark": "moe_model_profile", "device": device, "loop": "megatron-lm", "variant": variant,
            "precision": precision, "global_batch": global_batch, "profiled_iteration": start,
            "extra_flags": " ".join(extra[:-8]), "returncode": code}
    if code != 0:
        line["error"] = output[-3000:]
    else:
        line.update(profile_breakdown(trace_dir))
        line["gpu_ms_total"] = round(sum(line.get("gpu_ms_by_family", {}).values()), 2)
    return line


def chart(results: str, png: str) -> None:
    """tokens/s of each loop x precision x variant (the runs of the most common extra flags),
    each bar's speedup over the stock run of its loop and precision where the file has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in open(results) if l.strip()]
    rows = [r for r in rows if r.get("benchmark") == "moe_model" and r.get("ms")]
    flags = statistics.mode([r.get("extra_flags", "") for r in rows]) if rows else ""
    rows = [r for r in rows if r.get("extra_flags", "") == flags]
    stock = {(r["loop"], r["precision"]): r["ms"] for r in rows if r["variant"] == "stock"}
    groups = sorted({(r["loop"], r["precision"]) for r in rows}, key=lambda g: (LOOPS.index(g[0]), g[1]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        labelled = False
        for j, group in enumerate(groups):
            row = next((r for r in rows if (r["loop"], r["precision"]) == group and r["variant"] == variant), None)
            if row is None:
                continue
            x = j + (i - (len(VARIANTS) - 1) / 2) * width
            ax.bar(x, row["tokens_per_s"], width, color=f"C{i}", label=None if labelled else variant)
            labelled = True
            if group in stock:
                ax.annotate(f"{stock[group] / row['ms']:.2f}x", (x, row["tokens_per_s"]), ha="center",
                            va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{loop}\n{precision}" for loop, precision in groups])
    ax.set_ylabel("tokens/s (one GPU)")
    device = rows[0]["device"] if rows else "?"
    ax.set_title(f"Qwen3-30B-A3B-shaped slice, {LAYERS} layers, seq {SEQ}: {device}\n"
                 "speedup vs the stock run of the same loop and precision (same invocation)"
                 + (f"\nflags added to every run: {flags}" if flags else ""), fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        loop = sys.argv[2]
        del sys.argv[1:3]
        return run_child(loop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--iters", type=int, default=10, help="training iterations per run")
    parser.add_argument("--global-batch-size", type=int, default=4,
                        help="sequences per step (micro-batch 1: this many micro-batches)")
    parser.add_argument("--profile", action="store_true", help="also profile one Megatron-LM iteration")
    parser.add_argument("--profile-variant", default="graphed-fused", choices=VARIANTS,
                        help="the variant --profile runs")
    parser.add_argument("--extra", default="", help="more flags for every run (e.g. to find a loop's overheads)")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--chart", nargs=2, metavar=("RESULTS", "PNG"), help="only draw RESULTS' chart into PNG")
    args = parser.parse_args()
    if args.chart:
        return chart(*args.chart)
    extra = shlex.split(args.extra)
    import torch

    device = torch.cuda.get_device_name()
    warmup = GRAPH_WARMUP + 2  # the capture runs after the warm-up steps; time what follows
    stock_ms = {}
    for loop in filter(None, args.loops.split(",")):
        for precision in args.precisions.split(","):
            for variant in args.variants.split(","):
                line = one(loop, variant, precision, args.iters, args.global_batch_size, warmup, device, extra)
                if variant == "stock" and line.get("ms"):
                    stock_ms[(loop, precision)] = line["ms"]
                if line.get("ms") and (loop, precision) in stock_ms:
                    line["speedup_vs_stock"] = round(stock_ms[(loop, precision)] / line["ms"], 3)
                emit(line, args.out)
    if args.profile:
        for precision in args.precisions.split(","):
            emit(profiled(args.profile_variant, precision, warmup + 4, args.global_batch_size, device, warmup + 2,
                          extra), args.out)


def emit(line, out):
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
