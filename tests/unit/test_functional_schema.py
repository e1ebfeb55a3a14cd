import argparse
import json
from pathlib import Path

import pytest

from megatron.moe_patches.driver import functional, training
from megatron.moe_patches.driver.functional import (
    command_args,
    compare,
    device_tag,
    find_golden,
    load_case,
    parse_metrics,
    report,
    run_case,
    to_golden,
)

ROOT = Path(__file__).resolve().parents[2]
LOG = "\n".join(
    f" [2026-11-21 05:00:00] iteration {i:8d}/       3 | consumed samples: {16 * i:12d} | "
    f"learning rate: 1.000000E-03 | lm loss: {v:.6E} | grad norm: 1.000"
    for i, v in [(1, 8.5), (2, 8.0), (3, 7.25)]
) + "\nsome other line | lm loss: 99\n"


def test_parse_metrics_reads_iteration_lines_only():
    assert parse_metrics(LOG, ["lm loss"]) == {"lm loss": {1: 8.5, 2: 8.0, 3: 7.25}}


def test_golden_round_trip_passes_exactly():
    metrics = parse_metrics(LOG, ["lm loss"])
    golden = {"lm loss": to_golden(metrics["lm loss"])}
    assert golden["lm loss"]["start_step"] == 1 and golden["lm loss"]["end_step"] == 3
    assert compare(golden, metrics, exact=True) == []


def test_compare_tolerance_and_failures():
    golden = {"lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1,
                          "values": {"1": 8.5, "2": 8.0, "3": 7.25}}}
    close = {"lm loss": {1: 8.5 * 1.04, 2: 8.0, 3: 7.25}}
    assert compare(golden, close, exact=False) == []
    assert compare(golden, close, exact=True) == ["lm loss step 1: 8.84 != golden 8.5 (exact)"]
    far = {"lm loss": {1: 8.5, 2: 8.0 * 1.06}}
    problems = compare(golden, far, exact=False)
    assert any("step 2" in p and "rel diff 0.060" in p for p in problems)
    assert any("step 3: missing" in p for p in problems)


def test_command_args():
    assert command_args({"--yaml-cfg": "r.yaml", "--train-iters": 10, "--bf16": True, "--fp8-format": None,
                         "--data-path": ["1", "a", "1", "b"], "--swiglu": False}) == [
        "--yaml-cfg", "r.yaml", "--train-iters", "10", "--bf16", "--data-path", "1", "a", "1", "b"]


def test_committed_cases_are_well_formed():
    cases = sorted((ROOT / "tests/functional").glob("*/model_config.yaml"))
    assert len(cases) >= 4
    for path in cases:
        case = load_case(path.parent)
        assert (ROOT / case["MODEL_ARGS"]["--yaml-cfg"]).is_file()
        assert case["METRICS"] == ALL_METRICS
        assert case["MODEL_ARGS"].get("--log-num-zeros-in-grad") is True  # num-zeros is logged only then


def test_bad_case_is_rejected(tmp_path):
    (tmp_path / "model_config.yaml").write_text("TEST_TYPE: sometimes\nMODEL_ARGS: {}\nMETRICS: []\n")
    with pytest.raises(ValueError, match="TEST_TYPE must be regular or ckpt-resume"):
        load_case(tmp_path)


def test_feature_cases_track_the_baseline_curve():
    """Committed goldens: each feature case's loss stays within rel 0.05 of the bf16 baseline's."""
    from megatron.moe_patches.driver.functional import tracking_problems

    tracked = [p.parent for p in (ROOT / "tests/functional").glob("*/model_config.yaml")
               if load_case(p.parent).get("TRACKS")]
    assert len(tracked) >= 3
    for case_dir in tracked:
        goldens = sorted(case_dir.glob("golden_values_*.json"))  # the device files too, once recorded
        assert goldens
        for golden in goldens:
            assert tracking_problems(case_dir, golden.name) == [], (case_dir.name, golden.name)


def test_tracking_detects_a_diverging_curve(tmp_path):
    import json

    from megatron.moe_patches.driver.functional import tracking_problems

    for name, values in (("base", {"1": 8.0, "2": 7.0}), ("feature", {"1": 8.1, "2": 7.9})):
        (tmp_path / name).mkdir()
        extra = "TRACKS: base\n" if name == "feature" else ""
        (tmp_path / name / "model_config.yaml").write_text(
            f"TEST_TYPE: regular\nMODEL_ARGS: {{}}\nMETRICS: [lm loss]\n{extra}")
        (tmp_path / name / "golden_values_dev.json").write_text(json.dumps(
            {"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": values}}))
    problems = tracking_problems(tmp_path / "feature")
    assert len(problems) == 1 and "step 2" in problems[0]


# --- Megatron-LM's golden metrics, read back from the driver's own log line -------------

ALL_METRICS = ["lm loss", "num-zeros", "mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time"]
MiB = 2**20


def log_line(step, loss, zeros=None, mem=300 * MiB, max_mem=412 * MiB, seconds=0.1234, train_iters=100):
    """An iteration line made by training._log_line itself, so parser and formatter cannot drift."""
    args = argparse.Namespace(global_batch_size=16, seq_length=256, train_iters=train_iters, hidden_size=256,
                              num_attention_heads=4, num_query_groups=None, kv_channels=None,
                              group_query_attention=False, swiglu=True, num_experts=None, ffn_hidden_size=1024,
                              num_layers=2, vocab_size=4096, tensor_model_parallel_size=1)
    metrics = training.iteration_metrics(args, step, {"iteration": seconds}, 1e-3, loss, 0.5, 1, mem, max_mem,
                                         num_zeros=zeros)
    return training._log_line(args, step, metrics, started=0.0)


def test_every_metric_round_trips_through_the_log_line():
    line = log_line(7, 2.345678, zeros=1234.0, mem=300 * MiB, max_mem=412 * MiB, seconds=0.1234)
    assert parse_metrics(line + "\n", ALL_METRICS) == {
        "lm loss": {7: 2.345678},
        "num-zeros": {7: 1234},
        "mem-allocated-bytes": {7: 300 * MiB},
        "mem-max-allocated-bytes": {7: 412 * MiB},
        "iteration-time": {7: 0.1234},  # seconds, as Megatron-LM's golden files hold it
    }


def test_num_zeros_absent_without_the_flag():
    assert parse_metrics(log_line(1, 2.5), ["num-zeros", "lm loss"]) == {"num-zeros": {}, "lm loss": {1: 2.5}}


def test_memory_reads_back_to_the_mebibyte():
    parsed = parse_metrics(log_line(1, 2.5, mem=300 * MiB + 1000, max_mem=int(412.4 * MiB)), ALL_METRICS)
    assert parsed["mem-allocated-bytes"] == {1: 300 * MiB}
    assert parsed["mem-max-allocated-bytes"] == {1: 412 * MiB}


def golden_of(values):
    return {metric: to_golden(v) for metric, v in values.items()}


RUN = {
    "lm loss": {1: 8.5, 2: 8.0},
    "num-zeros": {1: 100, 2: 120},
    "mem-allocated-bytes": {1: 300 * MiB, 2: 300 * MiB},
    "mem-max-allocated-bytes": {1: 400 * MiB, 2: 400 * MiB},
    "iteration-time": {1: 0.5, 2: 0.1},
}


def scaled(metric, factor):
    return {**RUN, metric: {s: v * factor for s, v in RUN[metric].items()}}


def test_strict_metrics_exact_when_deterministic_else_five_percent():
    golden = golden_of(RUN)
    assert compare(golden, RUN, exact=True) == []
    for metric in ("lm loss", "num-zeros"):
        assert compare(golden, scaled(metric, 1.04), exact=False) == []
        assert [p.split(":")[0] for p in compare(golden, scaled(metric, 1.04), exact=True)] == [
            f"{metric} step 1", f"{metric} step 2"]
        problems = compare(golden, scaled(metric, 1.06), exact=False)
        assert len(problems) == 2 and all("rel diff 0.060 > 0.05" in p for p in problems)


@pytest.mark.parametrize("metric", ["mem-allocated-bytes", "mem-max-allocated-bytes"])
def test_memory_is_compared_loosely_never_exactly(metric):
    golden = golden_of(RUN)
    assert compare(golden, scaled(metric, 1.15), exact=True) == []
    assert compare(golden, scaled(metric, 0.85), exact=True) == []
    problems = compare(golden, scaled(metric, 1.25), exact=True)
    assert len(problems) == 2 and all(p.startswith(metric) and "> 0.2" in p for p in problems)


def test_iteration_time_never_fails_and_is_reported():
    golden = golden_of(RUN)
    slow = scaled("iteration-time", 10.0)
    assert compare(golden, slow, exact=True) == []
    notes = report(golden, slow)
    assert notes == ["iteration-time: mean 1 vs golden 0.1 over steps 2-2 (+900.0%; reported only)"]


def test_missing_metrics_old_golden_passes_but_the_run_must_have_the_golden_ones():
    lm_loss_only = golden_of({"lm loss": RUN["lm loss"]})
    assert compare(lm_loss_only, RUN, exact=True) == []  # an older golden file: the rest is not compared
    for metric in ALL_METRICS:  # the timing too: a step the golden has must be in the run
        run = {m: v for m, v in RUN.items() if m != metric}
        assert compare(golden_of(RUN), run, exact=True) == [
            f"{metric} step 1: missing in the run", f"{metric} step 2: missing in the run"]


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA RTX A6000", "rtxa6000"),
    ("", "unknown"),
])
def test_device_tag(name, tag):
    assert device_tag(name) == tag


def test_golden_lookup_prefers_the_device_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="golden_values_dev_h100.json or golden_values_dev.json"):
        find_golden(tmp_path, "dev", "h100")
    (tmp_path / "golden_values_dev.json").write_text("{}")
    assert find_golden(tmp_path, "dev", "h100") == (tmp_path / "golden_values_dev.json", False)
    assert find_golden(tmp_path, "dev", None) == (tmp_path / "golden_values_dev.json", False)
    (tmp_path / "golden_values_dev_h100.json").write_text("{}")
    assert find_golden(tmp_path, "dev", "h100") == (tmp_path / "golden_values_dev_h100.json", True)
    assert find_golden(tmp_path, "dev", "h200") == (tmp_path / "golden_values_dev.json", False)
    with pytest.raises(FileNotFoundError, match="golden_values_lts_h100.json or golden_values_lts.json"):
        find_golden(tmp_path, "lts", "h100")


# --- run_case end to end, with pretrain_gpt.py's log lines made by the real formatter ----

def fake_runs(monkeypatch, losses, zeros=True, mem_factor=1.0, seconds=0.1):
    """pretrain_gpt.py stood in for by its own log lines: ``losses`` {step: loss}; a run
    with --load logs the steps after its checkpoint only, in a fresh process's memory."""
    def run(case, extra, root, log_path):
        steps, fresh = sorted(losses), 0
        if "--load" in extra:
            steps, fresh = steps[len(steps) // 2:], 7
        return "\n".join(
            log_line(s, losses[s], zeros=float(100 + s) if zeros else None,
                     mem=int((300 + s + fresh) * MiB * mem_factor),
                     max_mem=int(400 * MiB * mem_factor), seconds=seconds, train_iters=len(losses))
            for s in steps) + "\ntraining done\n"

    monkeypatch.setattr(functional, "_run", run)


def write_case(path, test_type="regular", steps=4):
    path.mkdir()
    (path / "model_config.yaml").write_text(
        f"TEST_TYPE: {test_type}\nMODEL_ARGS:\n  --train-iters: {steps}\n  --deterministic-mode: true\n"
        "  --log-num-zeros-in-grad: true\nMETRICS:\n" + "".join(f"  - {m}\n" for m in ALL_METRICS))
    return path


LOSSES = {1: 8.5, 2: 8.25, 3: 8.0, 4: 7.75}


@pytest.mark.parametrize("test_type", ["regular", "ckpt-resume"])
def test_record_writes_the_device_file_and_compares_with_it(tmp_path, monkeypatch, test_type):
    case = write_case(tmp_path / "case", test_type)
    fake_runs(monkeypatch, LOSSES)
    recorded = run_case(case, tmp_path, record=True, device="h100", log_dir=str(tmp_path / "logs"))
    assert recorded["golden"] == "golden_values_dev_h100.json" and recorded["problems"] == []
    golden = json.loads((case / "golden_values_dev_h100.json").read_text())
    assert list(golden) == ALL_METRICS
    assert golden["num-zeros"]["values"] == {"1": 101, "2": 102, "3": 103, "4": 104}
    assert golden["mem-allocated-bytes"]["values"]["1"] == 301 * MiB
    assert golden["iteration-time"]["values"]["4"] == 0.1

    fake_runs(monkeypatch, LOSSES, mem_factor=1.1, seconds=0.3)  # same numbers, another machine's load
    result = run_case(case, tmp_path, device="h100", log_dir=str(tmp_path / "logs"))
    assert result["problems"] == [] and result["golden"] == "golden_values_dev_h100.json"
    assert any(n.startswith("iteration-time: mean 0.3 vs golden 0.1") for n in result["notes"])

    fake_runs(monkeypatch, LOSSES, mem_factor=1.3)
    problems = run_case(case, tmp_path, device="h100", log_dir=str(tmp_path / "logs"))["problems"]
    assert problems and all(p.startswith("mem-") for p in problems)

    fake_runs(monkeypatch, {**LOSSES, 3: 8.000001})
    problems = run_case(case, tmp_path, device="h100", log_dir=str(tmp_path / "logs"))["problems"]
    assert problems == ["lm loss step 3: 8.000001 != golden 8.0 (exact)"]


def test_a_listed_metric_the_run_does_not_log_fails(tmp_path, monkeypatch):
    case = write_case(tmp_path / "case")
    fake_runs(monkeypatch, LOSSES, zeros=False)
    with pytest.raises(RuntimeError, match="num-zeros: not in the run's iteration lines.*--log-num-zeros-in-grad"):
        run_case(case, tmp_path, record=True, device="h100", log_dir=str(tmp_path / "logs"))
    (case / "golden_values_dev.json").write_text(json.dumps(golden_of({"lm loss": LOSSES})))
    problems = run_case(case, tmp_path, device="h100", log_dir=str(tmp_path / "logs"))["problems"]
    assert problems == ["num-zeros: not in the run's iteration lines (MODEL_ARGS needs --log-num-zeros-in-grad: true)"]


def test_a_device_less_golden_file_compares_lm_loss_only(tmp_path, monkeypatch):
    case = write_case(tmp_path / "case")
    fake_runs(monkeypatch, LOSSES, mem_factor=3.0, seconds=9.0)
    other = golden_of({**RUN, "lm loss": LOSSES})  # memory far off: not compared from this file
    (case / "golden_values_dev.json").write_text(json.dumps(other))
    result = run_case(case, tmp_path, device="h200", log_dir=str(tmp_path / "logs"))
    assert result["golden"] == "golden_values_dev.json" and result["problems"] == []
    assert result["notes"] == [
        "golden_values_dev.json names no GPU: compared ['lm loss'] only, within rel 0.05, not ['iteration-time', "
        "'mem-allocated-bytes', 'mem-max-allocated-bytes', 'num-zeros']; record golden_values_dev_h200.json "
        "with --record for the rest"]
    fake_runs(monkeypatch, {**LOSSES, 2: 9.0})
    assert run_case(case, tmp_path, device="h200", log_dir=str(tmp_path / "logs"))["problems"] == [
        "lm loss step 2: 9 vs golden 8.25 (rel diff 0.091 > 0.05)"]


def test_a_deterministic_case_is_exact_against_its_own_gpus_file_only(tmp_path, monkeypatch):
    """Another GPU model's kernels round differently: a device-less golden file (recorded
    elsewhere) is met within the tolerance, the GPU's own file bit for bit."""
    case = write_case(tmp_path / "case")  # --deterministic-mode
    (case / "golden_values_dev.json").write_text(json.dumps(golden_of({"lm loss": LOSSES})))
    fake_runs(monkeypatch, {**LOSSES, 3: 8.004})  # 0.05 % off at one step
    assert run_case(case, tmp_path, device="h200", log_dir=str(tmp_path / "logs"))["problems"] == []
    (case / "golden_values_dev_h200.json").write_text(json.dumps(golden_of({**RUN, "lm loss": LOSSES})))
    problems = run_case(case, tmp_path, device="h200", log_dir=str(tmp_path / "logs"))["problems"]
    assert "lm loss step 3: 8.004 != golden 8.0 (exact)" in problems


@pytest.mark.parametrize("case_dir", sorted(p.parent for p in (ROOT / "tests/functional").glob("*/model_config.yaml")),
                         ids=lambda p: p.name)
def test_committed_lm_loss_goldens_still_pass(case_dir, tmp_path, monkeypatch):
    """Each case's METRICS now lists Megatron-LM's five; its lm-loss-only golden_values_dev.json
    still passes a run that logs its own golden losses, on a GPU without a device file."""
    golden = json.loads((case_dir / "golden_values_dev.json").read_text())
    losses = {int(s): v for s, v in golden["lm loss"]["values"].items()}
    fake_runs(monkeypatch, losses)
    result = run_case(case_dir, ROOT, device="nodevice", log_dir=str(tmp_path))
    assert result["golden"] == "golden_values_dev.json"
    assert result["problems"] == []


def test_tracking_follows_the_loss_curve_only(tmp_path):
    """A feature case's zeros, memory and time may differ from the baseline's; its loss may not."""
    from megatron.moe_patches.driver.functional import tracking_problems

    for name, factor in (("base", 1.0), ("feature", 2.0)):
        write_case(tmp_path / name)
        if name == "feature":
            with open(tmp_path / name / "model_config.yaml", "a") as config:
                config.write("TRACKS: base\n")
        values = {m: {s: v * (factor if m != "lm loss" else 1.0) for s, v in RUN[m].items()} for m in RUN}
        (tmp_path / name / "golden_values_dev_h100.json").write_text(json.dumps(golden_of(values)))
    assert tracking_problems(tmp_path / "feature", "golden_values_dev_h100.json") == []
    assert tracking_problems(tmp_path / "feature", "golden_values_dev_h200.json") == [
        "vs base: it has no golden_values_dev_h200.json to track"]


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    """Child rendezvous ports: never one the OS may hand to an outgoing connection meanwhile."""
    import socket

    from megatron.moe_patches.driver.functional import free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(p < 32768 for p in ports)
    with socket.socket() as sock:  # a port held by someone is skipped
        sock.bind(("127.0.0.1", ports[-1] + 1))
        assert free_port() != ports[-1] + 1
