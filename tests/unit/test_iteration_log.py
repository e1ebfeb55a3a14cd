"""The training line has Megatron-LM core_v0.16.1's fields, names, order and formats, then this
driver's own; the MoE auxiliary losses come from megatron-core's tracker, per layer with
--moe-per-layer-logging. With MEGATRON_LM_PATH naming a Megatron-LM checkout, the field list
is also read from its own ``training_log``."""

import argparse
import ast
import os
import re
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver import iteration_log, training
from megatron.moe_patches.driver.arguments import parse_args
from megatron.moe_patches.driver.functional import parse_metrics

from driver_model import REQUIRED

# The whole line with every field on, as it must read (Megatron-LM's fields, then the driver's).
EXPECTED_FIELDS = [
    "iteration", "consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
    "learning rate", "global batch size", "lm loss", "load_balancing_loss", "z_loss", "loss scale", "grad norm",
    "num zeros", "params norm", "number of skipped iterations", "number of nan iterations",
    # this driver's
    "forward-backward (ms)", "optimizer (ms)", "tokens/s", "moe/load_balancing_loss_layer_0",
    "moe/load_balancing_loss_layer_1", "mem (MiB)", "progress",
]

# Fields of Megatron-LM's training_log that these runs never print, and why.
NOT_PRINTED_HERE = {
    "skipped samples": "only when samples were skipped (no data skipping in this driver)",
    "energy per GPU (J/iter/GPU)": "--log-energy, which this driver refuses",
    "power per GPU (W/GPU)": "--log-energy, which this driver refuses",
}


def line_args(**overrides):
    values = dict(global_batch_size=16, seq_length=256, train_iters=100, num_experts=8,
                  moe_router_load_balancing_type=["aux_loss"], moe_z_loss_coeff=1e-3, num_layers=2,
                  moe_per_layer_logging=True)
    values.update(overrides)
    return argparse.Namespace(**values)


def full_line(monkeypatch, **metric_overrides):
    monkeypatch.setattr(training, "model_flops_per_token", lambda a: 1e9)
    times = {"iteration": 0.5, "forward-backward": 0.4, "optimizer": 0.1}
    aux = {"z_loss": 0.25, "load_balancing_loss": 1.5,
           "moe/load_balancing_loss_layer_0": 1.0, "moe/load_balancing_loss_layer_1": 2.0}
    aux.update(metric_overrides)
    metrics = training.iteration_metrics(
        line_args(), 10, times, 1e-3, 2.5, 0.75, 2, 3 * 2**20, 5 * 2**20, num_zeros=12, params_norm=3.25,
        loss_scale=1.0, aux_losses={name: aux[name] for name in ("load_balancing_loss", "z_loss", *aux) if name in aux},
        counts={"skipped-iterations": 1, "nan-iterations": 0})
    return training._log_line(line_args(), 10, metrics, started=0.0)


def test_the_line_has_megatron_lms_fields_then_the_drivers(monkeypatch):
    assert iteration_log.field_names(full_line(monkeypatch)) == EXPECTED_FIELDS


def test_megatron_lms_number_formats(monkeypatch):
    line = full_line(monkeypatch)
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration       10/     100 \|", line), line
    for part in (" consumed samples:          160 |", " elapsed time per iteration (ms): 500.0 |",
                 " throughput per GPU (TFLOP/s/GPU): ", " learning rate: 1.000000E-03 |",
                 " global batch size:    16 |", " lm loss: 2.500000E+00 |", " load_balancing_loss: 1.500000E+00 |",
                 " z_loss: 2.500000E-01 |", " loss scale: 1.0 |", " grad norm: 0.750 |", " num zeros: 12 |",
                 " params norm: 3.250 |", " number of skipped iterations:   1 |", " number of nan iterations:   0 |",
                 " moe/load_balancing_loss_layer_1: 2.000000E+00 |", " mem (MiB): 3/5 |"):
        assert part in line, (part, line)
    assert line.endswith(" |")


def test_an_aux_loss_of_zero_is_left_out_as_megatron_lm_does(monkeypatch):
    names = iteration_log.field_names(full_line(monkeypatch, z_loss=0.0))
    assert "z_loss" not in names and "load_balancing_loss" in names


def test_the_functional_parser_reads_the_line(monkeypatch):
    read = parse_metrics(full_line(monkeypatch), ["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes",
                                              "load_balancing_loss"])
    assert read["lm loss"] == {10: 2.5} and read["num-zeros"] == {10: 12}
    assert read["load_balancing_loss"] == {10: 1.5}


@pytest.mark.parametrize("types, z_loss, names", [
    (["aux_loss"], None, ["load_balancing_loss"]),
    (["seq_aux_loss"], None, ["load_balancing_loss", "seq_load_balancing_loss"]),  # Megatron-LM's substring rule
    (["global_aux_loss", "aux_loss"], 1e-3, ["load_balancing_loss", "global_load_balancing_loss", "z_loss"]),
    (["none"], None, []),
    (["sinkhorn"], 1e-3, ["z_loss"]),
])
def test_aux_loss_names(types, z_loss, names):
    assert iteration_log.aux_loss_names(line_args(moe_router_load_balancing_type=types, moe_z_loss_coeff=z_loss)) == names
    assert iteration_log.aux_loss_names(line_args(num_experts=None)) == []


def test_losses_and_times_average_over_the_interval_and_counts_reset():
    totals = iteration_log.IntervalTotals()
    totals.add({"lm loss": torch.tensor(2.0)}, {"iteration": 0.2}, skipped=False)
    totals.add({"lm loss": torch.tensor(float("nan"))}, {"iteration": 0.4}, skipped=True)
    totals.add({"lm loss": torch.tensor(4.0)}, {"iteration": 0.6}, skipped=False)
    averaged = totals.averages()
    assert averaged["losses"] == {"lm loss": 3.0}  # per advanced iteration
    assert averaged["times"] == pytest.approx({"iteration": 0.4})  # per iteration
    assert averaged["counts"] == {"skipped-iterations": 1, "nan-iterations": 1}
    assert totals.averages()["counts"] == {"skipped-iterations": 0, "nan-iterations": 0}


def test_tensorboard_gets_no_interval_counts():
    metrics = {"lm loss": 1.0, "skipped-iterations": 0, "nan-iterations": 0, "moe/z_loss_layer_0": 1.0}
    assert iteration_log.tensorboard_metrics(metrics) == {"lm loss": 1.0, "moe/z_loss_layer_0": 1.0}


@pytest.mark.parametrize("per_layer", [False, True])
def test_per_layer_logging_adds_each_layers_loss(per_layer, monkeypatch):
    """megatron-core's tracker is asked as Megatron-LM asks it; with the flag each layer's value
    (handed to the writer) joins the metrics."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    calls = []

    def fake_track(**kwargs):
        calls.append(kwargs)
        kwargs["total_loss_dict"]["load_balancing_loss"] = 1.5
        if kwargs["writer"] is not None and kwargs["per_layer_logging"]:
            kwargs["writer"].add_scalar("load_balancing_loss", 1.5, 0)
            for layer, value in enumerate((1.0, 2.0)):
                kwargs["writer"].add_scalar(f"moe/load_balancing_loss_layer_{layer}", value, 0)

    monkeypatch.setattr(moe_utils, "track_moe_metrics", fake_track)
    losses = training.track_moe_losses(line_args(moe_per_layer_logging=per_layer, moe_z_loss_coeff=None), 4)
    assert calls[0]["loss_scale"] == 0.25 and calls[0]["track_names"] == ["load_balancing_loss"]
    assert calls[0]["per_layer_logging"] is per_layer and calls[0]["num_layers"] == 2
    expected = {"load_balancing_loss": 1.5}
    if per_layer:
        expected.update({"moe/load_balancing_loss_layer_0": 1.0, "moe/load_balancing_loss_layer_1": 2.0})
    assert losses == expected


def test_moe_per_layer_logging_is_accepted(one_rank):
    assert parse_args(REQUIRED).moe_per_layer_logging is False
    assert parse_args([*REQUIRED, "--moe-per-layer-logging"]).moe_per_layer_logging is True


# --- against Megatron-LM's own source ---

def _template(node) -> str:
    """A string expression of ``log_string += ...`` with its placeholders as "{}"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _template(node.func.value)
    return ""  # a helper's text (sequence packing): not a field of these runs


def megatron_lm_fields(source: str) -> list:
    """The field names ``training_log`` appends to its line, in source order ("<losses>" for
    the loop over the losses)."""
    function = next(node for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.FunctionDef) and node.name == "training_log")
    appends = sorted((node for node in ast.walk(function)
                      if isinstance(node, (ast.AugAssign, ast.Assign))
                      and getattr(node.targets[0] if isinstance(node, ast.Assign) else node.target, "id", "")
                      == "log_string"), key=lambda node: (node.lineno, node.col_offset))
    fields = []
    for node in appends:
        text = re.sub(r"\{[^}]*\}", "{}", _template(node.value)).strip()
        if not text or text.startswith("["):
            continue
        name = text.split(":", 1)[0] if ":" in text else text.split()[0]
        fields.append("<losses>" if name == "{}" else name)
    return fields


MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")


@pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout to "
                                            "compare the line with its training_log")
def test_fields_in_megatron_lms_order_as_its_training_log_prints_them(monkeypatch):
    source = (Path(MEGATRON_LM) / "megatron" / "training" / "training.py").read_text()
    theirs = [name for name in megatron_lm_fields(source) if name not in NOT_PRINTED_HERE]
    assert theirs == list(iteration_log.MEGATRON_LM_FIELDS)
    ours = iteration_log.field_names(full_line(monkeypatch))
    losses = ["lm loss", "load_balancing_loss", "z_loss"]
    at = theirs.index("<losses>")
    assert ours[:len(theirs) + len(losses) - 1] == theirs[:at] + losses + theirs[at + 1:]


def test_the_source_reader_finds_fields_in_order():
    """The reader above on a stand-in of the same shape (runs without a checkout)."""
    source = '''
def training_log(args):
    log_string = f" [{now}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(1, 2)
    if args.skipped:
        log_string += ' skipped samples: {:12d} |'.format(3)
    log_string += f' learning rate: {lr:.6E} |'
    for key in losses:
        log_string += ' {}: {:.6E} |'.format(key, 1.0)
    log_string += helper(args)
    log_string += ' number of nan iterations: {:3d} |'.format(0)
'''
    assert megatron_lm_fields(source) == ["iteration", "skipped samples", "learning rate", "<losses>",
                                          "number of nan iterations"]
