"""A/B of two checkouts of this package on the MoE layer benchmark (``moe_layer.py``).

Runs each tree's own ``benchmarks/moe_layer.py`` in turn, ``--rounds`` times, alternating
which goes first, on the same GPU; every row keeps its same-process stock time, so a variant
is compared through its speedup over stock (stock ms / variant ms) and through its raw ms:

    python benchmarks/moe_layer_ab.py --a OLD_CHECKOUT --b . --variants device-splits-grouped,\
device-splits-grouped-graph --precisions bf16,fp8 --out benchmarks/results-ab.jsonl

Prints one JSON line per (tree, round, row) and, at the end, one summary line per case:
the median over rounds of B's ms / A's ms (above 1: B is slower).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run_tree(tree: Path, moe_layer_args: list) -> list:
    """The rows one run of ``tree``'s moe_layer.py prints."""
    command = [sys.executable, str(tree / "benchmarks" / "moe_layer.py"), *moe_layer_args]
    out = subprocess.run(command, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: moe_layer.py failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="the reference checkout")
    parser.add_argument("--b", required=True, help="the checkout under test")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args, moe_layer_args = parser.parse_known_args(argv)
    trees = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    sink = open(args.out, "a") if args.out else None
    rows = []
    for round_index in range(args.rounds):
        order = ("a", "b") if round_index % 2 == 0 else ("b", "a")
        for label in order:
            for row in run_tree(trees[label], moe_layer_args):
                row.update(tree=label, round=round_index)
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if sink:
                    sink.write(line + "\n")
    key = ("shape", "tokens", "precision", "variant")
    for case in sorted({tuple(r[k] for k in key) for r in rows}):
        ratios = []
        for round_index in range(args.rounds):
            pick = {r["tree"]: r["ms"] for r in rows if r["round"] == round_index and tuple(r[k] for k in key) == case}
            if {"a", "b"} <= set(pick):
                ratios.append(pick["b"] / pick["a"])
        summary = dict(zip(key, case), b_over_a_ms=round(statistics.median(ratios), 4), rounds=len(ratios),
                       summary=True)
        print(json.dumps(summary), flush=True)
        if sink:
            sink.write(json.dumps(summary) + "\n")
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
