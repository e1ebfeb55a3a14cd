"""Functional test cases in Megatron-LM's schema: run one, compare it with golden values.

A case is a folder with ``model_config.yaml``:

    ENV_VARS: {NAME: value}          # environment of the run
    TEST_TYPE: regular | ckpt-resume
    MODEL_ARGS: {--flag: value}      # pretrain_gpt.py arguments; true = on/off flag set
    METRICS: ["lm loss", ...]        # metrics read from the log lines

An optional ``TRACKS: <case>`` (our addition) names a baseline case whose golden curve
this case's golden curve must stay within the relative tolerance of, on common steps.

``golden_values_<env>.json``: ``{metric: {start_step, end_step, step_interval,
values: {"step": value}}}``. Comparison: relative tolerance 0.05, or exact when the run
is deterministic (``--deterministic-mode`` in MODEL_ARGS). ``ckpt-resume`` trains 2N
steps saving at N, resumes a second run from step N, and requires the resumed steps
to equal the uninterrupted ones exactly.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import yaml

RELATIVE_TOLERANCE = 0.05
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+")


def load_case(case_dir) -> dict:
    case = yaml.safe_load(Path(case_dir, "model_config.yaml").read_text())
    missing = {"MODEL_ARGS", "METRICS", "TEST_TYPE"} - set(case)
    if missing:
        raise ValueError(f"{case_dir}/model_config.yaml lacks {sorted(missing)}")
    if case["TEST_TYPE"] not in ("regular", "ckpt-resume"):
        raise ValueError(f"{case_dir}: TEST_TYPE must be regular or ckpt-resume, not {case['TEST_TYPE']!r}")
    case.setdefault("ENV_VARS", {})
    return case


def command_args(model_args: dict) -> List[str]:
    argv = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_metrics(log: str, metrics: List[str]) -> Dict[str, Dict[int, float]]:
    """{metric: {step: value}} from pretrain_gpt.py's iteration lines."""
    found: Dict[str, Dict[int, float]] = {m: {} for m in metrics}
    for line in log.splitlines():
        step = LOG_LINE.search(line)
        if not step:
            continue
        for metric in metrics:
            value = re.search(re.escape(metric) + r":\s*([-+0-9.eEnaif]+)", line)
            if value:
                found[metric][int(step.group(1))] = float(value.group(1))
    return found


def to_golden(values: Dict[int, float]) -> dict:
    steps = sorted(values)
    return {
        "start_step": steps[0],
        "end_step": steps[-1],
        "step_interval": steps[1] - steps[0] if len(steps) > 1 else 1,
        "values": {str(s): values[s] for s in steps},
    }


def compare(golden: dict, actual: Dict[str, Dict[int, float]], exact: bool) -> List[str]:
    """Every mismatch between golden values and a run, as readable lines (empty: pass)."""
    problems = []
    for metric, spec in golden.items():
        got = actual.get(metric, {})
        for step, want in spec["values"].items():
            have = got.get(int(step))
            if have is None:
                problems.append(f"{metric} step {step}: missing in the run")
            elif exact and have != want:
                problems.append(f"{metric} step {step}: {have!r} != golden {want!r} (exact)")
            elif not exact and abs(have - want) > RELATIVE_TOLERANCE * abs(want):
                problems.append(
                    f"{metric} step {step}: {have:.6g} vs golden {want:.6g} "
                    f"(rel diff {abs(have - want) / abs(want):.3f} > {RELATIVE_TOLERANCE})"
                )
    return problems


def tracking_problems(case_dir, golden_name: str = "golden_values_dev.json") -> List[str]:
    """Where a case's golden curve leaves its TRACKS baseline's by more than the tolerance."""
    case_dir = Path(case_dir)
    baseline = load_case(case_dir).get("TRACKS")
    if baseline is None:
        return []
    ours = json.loads((case_dir / golden_name).read_text())
    theirs = json.loads((case_dir.parent / baseline / golden_name).read_text())
    problems = []
    for metric, spec in ours.items():
        common = {s: v for s, v in theirs[metric]["values"].items() if s in spec["values"]}
        reference = {metric: {**theirs[metric], "values": common}}
        actual = {metric: {int(s): v for s, v in spec["values"].items()}}
        problems += [f"vs {baseline}: {p}" for p in compare(reference, actual, exact=False)]
    return problems


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(case: dict, extra: List[str], root: Path, log_path: Path) -> str:
    # A port of its own: the calling process may hold MASTER_PORT's (a test's process group).
    env = dict(os.environ, MASTER_PORT=str(free_port()), **{k: str(v) for k, v in case["ENV_VARS"].items()})
    cmd = [sys.executable, str(root / "pretrain_gpt.py"), *command_args(case["MODEL_ARGS"]), *extra]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    log_path.write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}); log: {log_path}\n{run.stderr[-3000:]}")
    return run.stdout


def run_case(case_dir, root, golden_name: str = "golden_values_dev.json", record: bool = False,
             log_dir: Optional[str] = None) -> dict:
    """Run a case; return {"metrics", "problems"}; with ``record`` write its golden values."""
    case_dir, root = Path(case_dir), Path(root)
    case = load_case(case_dir)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="functional-"))
    logs.mkdir(parents=True, exist_ok=True)
    exact = bool(case["MODEL_ARGS"].get("--deterministic-mode"))
    problems: List[str] = []
    if case["TEST_TYPE"] == "regular":
        metrics = parse_metrics(_run(case, [], root, logs / f"{case_dir.name}.log"), case["METRICS"])
    else:
        steps = int(case["MODEL_ARGS"]["--train-iters"])
        half = steps // 2
        ckpt = Path(tempfile.mkdtemp(prefix="ckpt-resume-"))
        try:
            save = ["--save", str(ckpt), "--save-interval", str(half)]
            metrics = parse_metrics(_run(case, save, root, logs / f"{case_dir.name}-full.log"), case["METRICS"])
            (ckpt / "latest_checkpointed_iteration.txt").write_text(str(half))  # resume from N
            resumed = parse_metrics(
                _run(case, ["--load", str(ckpt)], root, logs / f"{case_dir.name}-resumed.log"), case["METRICS"]
            )
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        for metric in case["METRICS"]:
            second_half = {s: v for s, v in metrics[metric].items() if s > half}
            if resumed[metric] != second_half:
                problems.append(f"{metric}: resumed steps {resumed[metric]} != uninterrupted {second_half}")
    golden_path = case_dir / golden_name
    if record:
        golden_path.write_text(json.dumps({m: to_golden(v) for m, v in metrics.items()}, indent=2) + "\n")
    else:
        problems += compare(json.loads(golden_path.read_text()), metrics, exact)
    return {"metrics": metrics, "problems": problems}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run functional test cases against golden values.")
    parser.add_argument("cases", nargs="+", help="case folders (tests/functional/<case>)")
    parser.add_argument("--record", action="store_true", help="write golden values from this run")
    parser.add_argument("--golden", default="golden_values_dev.json")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[3]  # the repository root (pretrain_gpt.py)
    failed = 0
    for case_dir in args.cases:
        result = run_case(case_dir, root, args.golden, args.record, args.log_dir)
        status = "RECORDED" if args.record else ("PASS" if not result["problems"] else "FAIL")
        print(json.dumps({"case": Path(case_dir).name, "status": status, "problems": result["problems"][:20]}))
        failed += bool(result["problems"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
