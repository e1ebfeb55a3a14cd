"""The grouped-GEMM Triton kernels of another checkout (A) against this one's (B), on the same
inputs in one process: whether each output is bitwise equal, the max abs difference, and
CUDA-event ms (median of 3 rounds alternating which goes first, 20 calls each). For kernel
changes meant to leave the results alone. Cases: tests/gpu/test_fp8_grouped_gemm.py's problems
(fprop, dgrad, wgrad, both recipes) and F13's weight gradient into fp32 main grads at the
Qwen3-30B-A3B slice's 65536 routed rows. A's two kernel modules are loaded from its files;
what they import of this package (``kernels/gemm_tile.py``, ``capabilities``) is this checkout's.

    python3 benchmarks/kernels_ab.py OLD_CHECKOUT results.jsonl
"""
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]
import test_fp8_grouped_gemm as T  # noqa: E402  (Problem, SHAPES)
from wgrad_main_grad import timed  # noqa: E402  (this folder's: CUDA-event ms after 3 warm-up calls)
from megatron.moe_patches.kernels import fp8_grouped_gemm as new_g, main_grad_accumulation as new_m  # noqa: E402

def load(name: str, path: Path):
    """A module of the other checkout, from its file, under a name of its own."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(sink, case, run_a, run_b, rounds=3):
    a, b = run_a(), run_b()
    ms = {"a": [], "b": []}
    for round_index in range(rounds):
        for label in ("a", "b") if round_index % 2 == 0 else ("b", "a"):
            ms[label].append(timed(run_a if label == "a" else run_b, 20))
    row = dict(case=case, bitwise=bool(torch.equal(a, b)), max_abs_diff=(a.float() - b.float()).abs().max().item(),
               old_ms=statistics.median(ms["a"]), new_ms=statistics.median(ms["b"]),
               device=torch.cuda.get_device_name())
    row["new_over_old"] = row["new_ms"] / row["old_ms"]
    print(json.dumps(row), flush=True)
    sink.write(json.dumps(row) + "\n")


def fp8_cases(sink, old_g):
    for shape in ("qwen3-fc1", "qwen3-fc2", "odd"):
        for recipe in ("tensorwise", "blockwise"):
            p = T.Problem(**T.SHAPES[shape], recipe=recipe, seed=7)
            for fast in (False, True) if recipe == "tensorwise" else (False,):
                compare(sink, f"{shape} {recipe} fprop fast={fast}",
                        lambda: p.fprop(old_g.fp8_grouped_nt, fast_accum=fast),
                        lambda: p.fprop(new_g.fp8_grouped_nt, fast_accum=fast))
            compare(sink, f"{shape} {recipe} dgrad",
                    lambda: p.dgrad(old_g.fp8_grouped_nt), lambda: p.dgrad(new_g.fp8_grouped_nt))
            compare(sink, f"{shape} {recipe} wgrad fp32",
                    lambda: p.wgrad(old_g.fp8_grouped_wgrad), lambda: p.wgrad(new_g.fp8_grouped_wgrad))
            compare(sink, f"{shape} {recipe} wgrad bf16",
                    lambda: p.wgrad(old_g.fp8_grouped_wgrad, out_dtype=torch.bfloat16),
                    lambda: p.wgrad(new_g.fp8_grouped_wgrad, out_dtype=torch.bfloat16))
            base = torch.randn(len(p.counts), p.O, p.I, device="cuda")
            into_a, into_b = base.clone(), base.clone()
            compare(sink, f"{shape} {recipe} wgrad accumulate(x1)",  # each call from the same main grad
                    lambda: p.wgrad(old_g.fp8_grouped_wgrad, accumulate_into=into_a.copy_(base)),
                    lambda: p.wgrad(new_g.fp8_grouped_wgrad, accumulate_into=into_b.copy_(base)))


def main_grad_table(module):
    """A MainGradTable of either checkout (before the plan decided Triton, it asked itself)."""
    try:
        return module.MainGradTable(triton=True)
    except TypeError:
        return module.MainGradTable()


def main_grad_cases(sink, old_m):
    rows, experts = 8192 * 8, 128  # the slice's micro-batch: 8192 tokens x top 8
    for fc, (out_features, in_features) in (("fc1", (1536, 2048)), ("fc2", (2048, 768))):
        gen = torch.Generator(device="cuda").manual_seed(0)
        expert_R = torch.randint(0, experts, (rows,), device="cuda", generator=gen)
        ends_E = torch.bincount(expert_R, minlength=experts).cumsum(0).to(torch.int32)
        x_TI = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy_TO = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        base = torch.randn(experts, out_features, in_features, device="cuda", generator=gen)
        into_a, into_b = base.clone(), base.clone()
        table_a, table_b = main_grad_table(old_m), main_grad_table(new_m)

        def run(module, into, table):
            module.grouped_wgrad_into_main_grad(x_TI, dy_TO, ends_E, list(into.copy_(base).unbind(0)), table)
            return into

        compare(sink, f"main_grad qwen3 {fc} (x1 from same base)",
                lambda: run(old_m, into_a, table_a), lambda: run(new_m, into_b, table_b))


def main():
    old = Path(sys.argv[1]) / "megatron" / "moe_patches" / "kernels"
    with open(sys.argv[2], "a") as sink:
        fp8_cases(sink, load("old_fp8_grouped_gemm", old / "fp8_grouped_gemm.py"))
        main_grad_cases(sink, load("old_main_grad_accumulation", old / "main_grad_accumulation.py"))


if __name__ == "__main__":
    main()
