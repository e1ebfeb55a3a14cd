"""Charts from the benchmark JSON lines: ``python benchmarks/plot.py [files...] [--out DIR]``.

One PNG per results file (default: every ``benchmarks/*.jsonl``) in ``benchmarks/charts/``,
with two panels (a file of other lines, such as ``exchange_stores.py``'s kernel timings,
is skipped with a line saying so; the exit status is 1 only when no chart was drawn):

- speedup vs stock: one bar per non-stock variant for each case (shape, precision,
  tokens), the ``speedup_vs_stock`` that ``moe_layer.py`` computed against the stock
  layer of the same run;
- TFLOP/s vs tokens: expert GEMM TFLOP/s of every variant, stock included.

A file whose lines carry ``tree`` / ``run`` fields (before/after comparisons) keeps each
run apart: every ratio is one run against that run's own stock. Each chart's title names
the device and says so. Needs matplotlib (``pip install -e ".[plot]"``); nothing else in
the repository imports it.
"""

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

HERE = Path(__file__).resolve().parent
RUN_FIELDS = ("tree", "run")  # fields that tell runs apart inside one file
SHAPE_ORDER = ("qwen3-30b-a3b", "deepseek-v2-lite", "mixtral")
PER_GPU_FIELDS = {"tokens_per_gpu": "tokens", "tflops_per_gpu": "tflops"}


# The fields a chart reads from every line (moe_layer.py's and moe_layer_ep.py's results).
CHART_FIELDS = ("shape", "tokens", "precision", "variant", "tflops", "speedup_vs_stock")


class NotPlottable(ValueError):
    """A results file these charts cannot draw (another benchmark's lines, or none)."""


def load_rows(path: Path) -> List[dict]:
    """The file's benchmark lines; NotPlottable, saying why, where a chart cannot be drawn."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise NotPlottable(f"{path}:{number}: not a JSON line ({err.msg})") from None
        for per_gpu, name in PER_GPU_FIELDS.items():  # moe_layer_ep.py's lines: per GPU
            if per_gpu in row and name not in row:
                row[name] = row[per_gpu]
        missing = [key for key in CHART_FIELDS if key not in row]
        if missing:  # e.g. exchange_stores.py's kernel timings
            raise NotPlottable(f"{path}:{number}: not a layer benchmark line (no {', '.join(missing)})")
        rows.append(row)
    if not rows:
        raise NotPlottable(f"{path}: no benchmark lines")
    return rows


def run_label(row: dict) -> str:
    parts = []
    if "run" in row:
        parts.append(f"run {row['run']}")
    if "tree" in row:
        parts.append(str(row["tree"]))
    return ", ".join(parts)


def case_key(row: dict) -> Tuple:
    shape = SHAPE_ORDER.index(row["shape"]) if row["shape"] in SHAPE_ORDER else len(SHAPE_ORDER)
    return (row.get("run", 0), shape, row["shape"], row["precision"], row["tokens"])


def case_label(row: dict) -> str:
    lines = [row["shape"], f"{row['precision']} {row['tokens'] // 1024}k tok"]
    if "run" in row:
        lines.append(f"run {row['run']}")
    return "\n".join(lines)


def series_name(row: dict) -> str:
    tree = row.get("tree")
    return f"{row['variant']} ({tree})" if tree else row["variant"]


def title_for(path: Path, rows: Sequence[dict]) -> str:
    devices = sorted({row.get("device", "unknown device") for row in rows})
    runs = sorted({row.get("run") for row in rows if "run" in row})
    if runs:
        how = f"{len(runs)} runs kept apart: each ratio is from one run, against that run's own stock"
    else:
        how = "one run: each ratio is variant vs stock from that single run"
    eps = sorted({row["ep"] for row in rows if "ep" in row})
    where = f" — EP={'/'.join(map(str, eps))}, tokens and TFLOP/s per GPU" if eps else ""
    return f"{path.stem} — {', '.join(devices)}{where}\n{how} (compare ratios only within one run on one device)"


def plot_file(path: Path, out_dir: Path, plt) -> Path:
    rows = load_rows(path)
    precisions = len({row["precision"] for row in rows})

    # Panel 1: speedup per case, one bar per non-stock series.
    cases: "OrderedDict[Tuple, str]" = OrderedDict()
    for row in sorted(rows, key=case_key):
        cases.setdefault(case_key(row), case_label(row))
    series = list(OrderedDict.fromkeys(series_name(r) for r in rows if r["variant"] != "stock"))
    speedup: Dict[Tuple[str, Tuple], float] = {
        (series_name(r), case_key(r)): r["speedup_vs_stock"] for r in rows if r["variant"] != "stock"
    }

    fig, (ax_speed, ax_tflops) = plt.subplots(
        1, 2, figsize=(max(13, 0.9 * len(cases) + 8), 5.8), gridspec_kw={"width_ratios": [min(max(len(cases), 4), 9), 4]}
    )
    width = 0.8 / max(len(series), 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    case_keys = list(cases)
    for i, name in enumerate(series):
        xs, ys = [], []
        for x, key in enumerate(case_keys):
            if (name, key) in speedup:
                xs.append(x - 0.4 + width * (i + 0.5))
                ys.append(speedup[(name, key)])
        bars = ax_speed.bar(xs, ys, width, label=name, color=colors[i % len(colors)])
        ax_speed.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, rotation=90, padding=2)
    ax_speed.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_speed.set_xticks(range(len(case_keys)), list(cases.values()), fontsize=7)
    ax_speed.set_ylabel("speedup vs stock (stock ms / variant ms)")
    top = max(speedup.values(), default=1.0)
    ax_speed.set_ylim(0, max(1.2, top * 1.18))
    ax_speed.legend(fontsize=7, loc="upper right")
    ax_speed.set_title("speedup vs stock per shape and variant", fontsize=9)

    # Panel 2: TFLOP/s vs tokens. Colour: shape; marker: variant; filled bf16, hollow fp8;
    # series and runs side by side (a small offset on the token axis), never averaged;
    # a before/after file draws "before" faded.
    shapes = list(OrderedDict.fromkeys(r["shape"] for r in sorted(rows, key=case_key)))
    variants = list(OrderedDict.fromkeys(r["variant"] for r in rows))
    markers = "osD^vPX*"
    groups = list(OrderedDict.fromkeys(run_label(r) for r in rows))
    lines: Dict[Tuple, List[Tuple[float, float]]] = {}
    for row in rows:
        key = (row["shape"], row["precision"], row["variant"], run_label(row))
        lines.setdefault(key, []).append((row["tokens"], row["tflops"]))
    offsets = {}
    for j, (variant, group) in enumerate((v, g) for g in groups for v in variants):
        offsets[(variant, group)] = (j - (len(variants) * len(groups) - 1) / 2) * 0.06
    for (shape, precision, variant, group), points in lines.items():
        points.sort()
        shift = 2 ** offsets[(variant, group)]
        color = colors[shapes.index(shape) % len(colors)]
        marker = markers[variants.index(variant) % len(markers)]
        ax_tflops.plot(
            [tokens * shift for tokens, _ in points], [tflops for _, tflops in points],
            marker=marker, color=color, markerfacecolor=color if precision == "bf16" else "white",
            alpha=0.4 if group.endswith("before") else 1.0, linewidth=0.9, markersize=5,
        )
    token_values = sorted({row["tokens"] for row in rows})
    ax_tflops.set_xscale("log", base=2)
    ax_tflops.set_xticks(token_values, [f"{t // 1024}k" for t in token_values])
    ax_tflops.minorticks_off()
    ax_tflops.set_xlim(token_values[0] / 1.6, token_values[-1] * 1.6)
    ax_tflops.set_xlabel("tokens per step")
    ax_tflops.set_ylabel("expert GEMM TFLOP/s")
    ax_tflops.set_ylim(bottom=0)
    ax_tflops.set_title("TFLOP/s vs tokens", fontsize=9)
    handles = [plt.Line2D([], [], color=colors[i % len(colors)], linewidth=2, label=s) for i, s in enumerate(shapes)]
    handles += [plt.Line2D([], [], color="gray", marker=markers[i % len(markers)], linestyle="", label=v)
                for i, v in enumerate(variants)]
    if precisions > 1 or rows[0]["precision"] != "bf16":
        handles += [plt.Line2D([], [], color="gray", marker="o", linestyle="", label="bf16 (filled)"),
                    plt.Line2D([], [], color="gray", marker="o", markerfacecolor="white", linestyle="",
                               label="fp8 (hollow)")]
    if any(g.endswith("before") for g in groups):
        handles += [plt.Line2D([], [], color="gray", marker="o", linestyle="", alpha=0.4, label="before (faded)"),
                    plt.Line2D([], [], color="gray", marker="o", linestyle="", label="after")]
    ax_tflops.legend(handles=handles, fontsize=6.5, loc="best")

    fig.suptitle(title_for(path, rows), fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{path.stem}.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="JSON-lines results (default: benchmarks/*.jsonl)")
    parser.add_argument("--out", type=Path, default=HERE / "charts", help="folder for the PNGs (default: benchmarks/charts)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        parser.error("needs matplotlib: pip install -e \".[plot]\" (or pip install matplotlib)")
    files = args.files or sorted(HERE.glob("*.jsonl"))
    if not files:
        parser.error(f"no results files in {HERE}")
    return 0 if draw_charts(files, args.out, plt) else 1


def draw_charts(files: Sequence[Path], out_dir: Path, plt) -> List[Path]:
    """One chart per file; a file no chart can be drawn from is skipped with a line saying
    why, and the others are drawn all the same. Returns the charts written."""
    written = []
    for path in files:
        try:
            written.append(plot_file(path, out_dir, plt))
        except NotPlottable as err:
            print(f"skipped: {err}", file=sys.stderr)
            continue
        print(written[-1])
    return written


if __name__ == "__main__":
    sys.exit(main())
