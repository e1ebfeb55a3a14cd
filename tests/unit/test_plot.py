"""benchmarks/plot.py draws every results file it can and skips, with a line saying why,
those it cannot (another benchmark's lines), instead of stopping at the first."""

import importlib.util
import json
from pathlib import Path

import pytest

PLOT = Path(__file__).resolve().parents[2] / "benchmarks" / "plot.py"
LAYER_LINE = {"shape": "mixtral", "tokens": 4096, "precision": "bf16", "variant": "stock", "tflops": 100.0,
              "speedup_vs_stock": 1.0, "device": "NVIDIA H100"}
STORES_LINE = {"rank": 0, "ep": 2, "kernel": "push_rows", "ms": 0.4, "tokens": 8192, "device": "NVIDIA H200"}


@pytest.fixture
def plot():
    spec = importlib.util.spec_from_file_location("benchmarks_plot", PLOT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # matplotlib is imported by main() only
    return module


def results(path, *lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_lines_of_another_benchmark_are_not_plottable(plot, tmp_path):
    stores = results(tmp_path / "stores.jsonl", STORES_LINE)
    with pytest.raises(plot.NotPlottable, match=r"stores.jsonl:1: not a layer benchmark line \(no shape, "):
        plot.load_rows(stores)
    mixed = results(tmp_path / "mixed.jsonl", LAYER_LINE, STORES_LINE)
    with pytest.raises(plot.NotPlottable, match="mixed.jsonl:2: "):
        plot.load_rows(mixed)
    assert plot.load_rows(results(tmp_path / "layer.jsonl", LAYER_LINE)) == [LAYER_LINE]


def test_a_file_without_a_chart_is_skipped_and_the_rest_drawn(plot, tmp_path, monkeypatch, capsys):
    files = [results(tmp_path / "a.jsonl", LAYER_LINE), results(tmp_path / "stores.jsonl", STORES_LINE),
             results(tmp_path / "z.jsonl", LAYER_LINE)]

    def chart(path, out_dir, plt):  # the drawing itself needs matplotlib: only what it reads
        plot.load_rows(path)
        return out_dir / f"{path.stem}.png"

    monkeypatch.setattr(plot, "plot_file", chart)
    assert plot.draw_charts(files, tmp_path / "charts", plt=None) == [tmp_path / "charts" / "a.png",
                                                                       tmp_path / "charts" / "z.png"]
    err = capsys.readouterr().err
    assert err.startswith("skipped: ") and "stores.jsonl:1: not a layer benchmark line" in err
