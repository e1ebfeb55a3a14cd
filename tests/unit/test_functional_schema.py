from pathlib import Path

import pytest

from megatron.moe_patches.driver.functional import command_args, compare, load_case, parse_metrics, to_golden

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
        assert case["METRICS"] == ["lm loss"]


def test_bad_case_is_rejected(tmp_path):
    (tmp_path / "model_config.yaml").write_text("TEST_TYPE: sometimes\nMODEL_ARGS: {}\nMETRICS: []\n")
    with pytest.raises(ValueError, match="TEST_TYPE must be regular or ckpt-resume"):
        load_case(tmp_path)


def test_feature_cases_track_the_baseline_curve():
    """Committed goldens: each feature case stays within rel 0.05 of the bf16 baseline."""
    from megatron.moe_patches.driver.functional import tracking_problems

    tracked = [p.parent for p in (ROOT / "tests/functional").glob("*/model_config.yaml")
               if load_case(p.parent).get("TRACKS")]
    assert len(tracked) >= 3
    for case_dir in tracked:
        assert tracking_problems(case_dir) == [], case_dir.name


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
