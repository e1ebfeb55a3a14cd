"""Functional test cases in Megatron-LM's schema: run one, compare it with golden values.

A case is a folder with ``model_config.yaml``:

    ENV_VARS: {NAME: value}          # environment of the run
    TEST_TYPE: regular | ckpt-resume
    MODEL_ARGS: {--flag: value}      # pretrain_gpt.py arguments; true = on/off flag set
    METRICS: ["lm loss", ...]        # metrics read from the log lines

An optional ``TRACKS: <case>`` (our addition) names a baseline case whose golden lm loss
curve this case's must stay within the relative tolerance of, on common steps.

Metrics, under Megatron-LM's names, read from pretrain_gpt.py's iteration lines
(``training._log_line``): ``lm loss``; ``num-zeros`` ("num zeros", logged only with
``--log-num-zeros-in-grad``); ``iteration-time`` in seconds (printed in ms);
``mem-allocated-bytes`` and ``mem-max-allocated-bytes`` in bytes (printed in whole MiB,
so read back to 1 MiB). Any other metric is read as ``<metric>: <value>``.

Golden files: ``golden_values_<env>_<device>.json`` (``<device>`` from ``device_tag``:
"NVIDIA H100 80GB HBM3" -> ``h100``), holding ``{metric: {start_step, end_step,
step_interval, values: {"step": value}}}``. ``run_case`` uses the current GPU's file, and
without one falls back to the device-less ``golden_values_<env>.json``, from which only
``lm loss`` is compared, within the relative tolerance (another GPU model's kernels round
differently, and the other metrics depend on the GPU); ``--record`` writes the current
GPU's file.

Comparison, by metric:

- ``lm loss``, ``num-zeros`` (and any metric not named below): exact when the run is
  deterministic (``--deterministic-mode`` in MODEL_ARGS) and the golden file is the
  current GPU's own, else relative tolerance 0.05.
- ``mem-allocated-bytes``, ``mem-max-allocated-bytes``: relative tolerance 0.2. They are
  only compared against a golden file of the same GPU type (the device-named file), since
  the allocator's footprint follows the GPU, its kernels and library versions.
- ``iteration-time``: never fails; its mean against the golden mean is reported
  (``notes``), as timings vary with the machine's load.

A step of a golden file's metric that the run did not log fails for every metric; a
metric the golden file lacks (older files hold lm loss only) is not compared; a METRICS
entry the run logged nothing for fails. ``ckpt-resume`` trains 2N steps saving at N,
resumes a second run from step N, and requires the resumed steps to equal the
uninterrupted ones exactly for the strictly compared metrics (lm loss, num-zeros); memory
and time legitimately differ in a fresh process.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

RELATIVE_TOLERANCE = 0.05
MEMORY_TOLERANCE = 0.2
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+")

STRICT, LOOSE, REPORTED = "strict", "loose", "reported"
RULES = {
    "lm loss": STRICT,
    "num-zeros": STRICT,
    "mem-allocated-bytes": LOOSE,
    "mem-max-allocated-bytes": LOOSE,
    "iteration-time": REPORTED,
}
DEVICE_FREE_METRICS = ("lm loss",)  # what a device-less golden file is compared on
TRACKED_METRICS = ("lm loss",)  # TRACKS: the loss curve (zeros, memory, time follow the feature)

_NUMBER = r"([-+0-9.eEnaif]+)"  # nan and inf included
# Where training._log_line prints each metric, and how the printed value converts to the
# golden file's unit (Megatron-LM's: seconds, bytes, counts).
_FIELDS = {
    "lm loss": (re.compile(r"lm loss:\s*" + _NUMBER), float),
    "num-zeros": (re.compile(r"num zeros:\s*" + _NUMBER), lambda v: int(float(v))),
    "iteration-time": (re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUMBER),
                       lambda v: round(float(v) / 1000, 7)),  # rounded: no 0.12340000000000001
    "mem-allocated-bytes": (re.compile(r"mem \(MiB\):\s*" + _NUMBER + "/"), lambda v: int(float(v) * 2**20)),
    "mem-max-allocated-bytes": (re.compile(r"mem \(MiB\):\s*[-+0-9.eEnaif]+/" + _NUMBER),
                                lambda v: int(float(v) * 2**20)),
}

# Words of a GPU's name that say nothing about its model.
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro", "amd", "instinct"}


def device_tag(name: str) -> str:
    """A GPU name as the short tag of golden file names: "NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" -> "rtx4090". The words
    up to and including the first one with a digit (the model number), vendor words left
    out; memory size and form factor do not change what a run allocates."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _VENDOR_WORDS]
    tag = ""
    for word in words:
        tag += word
        if any(c.isdigit() for c in word):
            break
    return tag or "unknown"


def current_device_tag() -> Optional[str]:
    """The tag of this process's current GPU, or None without one."""
    import torch

    return device_tag(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def golden_file_name(env: str = "dev", device: Optional[str] = None) -> str:
    return f"golden_values_{env}_{device}.json" if device else f"golden_values_{env}.json"


def find_golden(case_dir, env: str = "dev", device: Optional[str] = None) -> Tuple[Path, bool]:
    """(golden file, whether it is ``device``'s own): ``device``'s file where the case has
    one, else the device-less file. FileNotFoundError when neither exists."""
    case_dir = Path(case_dir)
    if device:
        named = case_dir / golden_file_name(env, device)
        if named.is_file():
            return named, True
    plain = case_dir / golden_file_name(env)
    if plain.is_file():
        return plain, False
    wanted = " or ".join(dict.fromkeys(golden_file_name(env, d) for d in (device, None)))
    raise FileNotFoundError(f"{case_dir.name}: no golden values ({wanted}); record them on a GPU with --record")


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


def _field(metric: str):
    if metric in _FIELDS:
        return _FIELDS[metric]
    return re.compile(re.escape(metric) + r":\s*" + _NUMBER), float


def parse_metrics(log: str, metrics: List[str]) -> Dict[str, Dict[int, float]]:
    """{metric: {step: value}} from pretrain_gpt.py's iteration lines, in the golden files' units."""
    found: Dict[str, Dict[int, float]] = {m: {} for m in metrics}
    fields = {m: _field(m) for m in metrics}
    for line in log.splitlines():
        step = LOG_LINE.search(line)
        if not step:
            continue
        for metric, (pattern, convert) in fields.items():
            value = pattern.search(line)
            if value:
                found[metric][int(step.group(1))] = convert(value.group(1))
    return found


def to_golden(values: Dict[int, float]) -> dict:
    steps = sorted(values)
    return {
        "start_step": steps[0],
        "end_step": steps[-1],
        "step_interval": steps[1] - steps[0] if len(steps) > 1 else 1,
        "values": {str(s): values[s] for s in steps},
    }


def rule(metric: str) -> str:
    """How ``metric`` is compared: STRICT, LOOSE or REPORTED (the module docstring says why)."""
    return RULES.get(metric, STRICT)


def _outside(metric, step, have, want, tolerance) -> Optional[str]:
    if abs(have - want) <= tolerance * abs(want):
        return None
    diff = abs(have - want) / abs(want) if want else float("inf")
    return f"{metric} step {step}: {have:.6g} vs golden {want:.6g} (rel diff {diff:.3f} > {tolerance})"


def compare(golden: dict, actual: Dict[str, Dict[int, float]], exact: bool) -> List[str]:
    """Every mismatch between golden values and a run, as readable lines (empty: pass).

    Each golden metric by its ``rule``: STRICT exact (``exact``) or within
    RELATIVE_TOLERANCE, LOOSE within MEMORY_TOLERANCE, REPORTED values never fail. A golden
    step missing from the run fails whatever the rule."""
    problems = []
    for metric, spec in golden.items():
        got = actual.get(metric, {})
        how = rule(metric)
        for step, want in spec["values"].items():
            have = got.get(int(step))
            if have is None:
                problems.append(f"{metric} step {step}: missing in the run")
            elif how == REPORTED:
                continue
            elif how == STRICT and exact:
                if have != want:
                    problems.append(f"{metric} step {step}: {have!r} != golden {want!r} (exact)")
            else:
                tolerance = MEMORY_TOLERANCE if how == LOOSE else RELATIVE_TOLERANCE
                problem = _outside(metric, step, have, want, tolerance)
                if problem:
                    problems.append(problem)
    return problems


def report(golden: dict, actual: Dict[str, Dict[int, float]]) -> List[str]:
    """One line per REPORTED golden metric: the run's mean against the golden mean over
    their common steps, the first step (start-up, allocation) left out where there are more."""
    notes = []
    for metric, spec in golden.items():
        if rule(metric) != REPORTED:
            continue
        got = actual.get(metric, {})
        steps = sorted(int(s) for s in spec["values"] if int(s) in got)
        steps = steps[1:] if len(steps) > 1 else steps
        if not steps:
            notes.append(f"{metric}: no common steps with the golden values (reported only)")
            continue
        have = sum(got[s] for s in steps) / len(steps)
        want = sum(spec["values"][str(s)] for s in steps) / len(steps)
        change = f"{100 * (have - want) / want:+.1f}%" if want else "n/a"
        notes.append(f"{metric}: mean {have:.6g} vs golden {want:.6g} over steps {steps[0]}-{steps[-1]} "
                     f"({change}; reported only)")
    return notes


def tracking_problems(case_dir, golden_name: str = "golden_values_dev.json") -> List[str]:
    """Where a case's golden lm loss curve leaves its TRACKS baseline's by more than the tolerance."""
    case_dir = Path(case_dir)
    baseline = load_case(case_dir).get("TRACKS")
    if baseline is None:
        return []
    theirs_path = case_dir.parent / baseline / golden_name
    if not theirs_path.is_file():
        return [f"vs {baseline}: it has no {golden_name} to track"]
    ours = json.loads((case_dir / golden_name).read_text())
    theirs = json.loads(theirs_path.read_text())
    problems = []
    for metric in TRACKED_METRICS:
        if metric not in ours:
            continue
        if metric not in theirs:
            problems.append(f"vs {baseline}: {metric} not in its {golden_name}")
            continue
        spec = ours[metric]
        common = {s: v for s, v in theirs[metric]["values"].items() if s in spec["values"]}
        reference = {metric: {**theirs[metric], "values": common}}
        actual = {metric: {int(s): v for s, v in spec["values"].items()}}
        problems += [f"vs {baseline}: {p}" for p in compare(reference, actual, exact=False)]
    return problems


_PORTS = range(20000, 30000)  # below Linux's ephemeral range (32768-60999)
_port_lock = threading.Lock()
_next_port = None


def free_port() -> int:
    """A TCP port for a child process's rendezvous, different on every call of this process.

    Taken below the ephemeral range: a port the OS hands out there (bind to port 0) can be
    given to another process's outgoing connection before the child binds it, which fails
    the child's rendezvous with EADDRINUSE when many runs start side by side."""
    global _next_port
    with _port_lock:
        if _next_port is None:
            _next_port = _PORTS.start + (os.getpid() * 97) % len(_PORTS)
        for _ in range(len(_PORTS)):
            port, _next_port = _next_port, _PORTS.start + (_next_port + 1 - _PORTS.start) % len(_PORTS)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no free TCP port in {_PORTS.start}-{_PORTS.stop - 1}")


def _run(case: dict, extra: List[str], root: Path, log_path: Path) -> str:
    # A port of its own: the calling process may hold MASTER_PORT's (a test's process group).
    env = dict(os.environ, MASTER_PORT=str(free_port()), **{k: str(v) for k, v in case["ENV_VARS"].items()})
    cmd = [sys.executable, str(root / "pretrain_gpt.py"), *command_args(case["MODEL_ARGS"]), *extra]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    log_path.write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}); log: {log_path}\n{run.stderr[-3000:]}")
    return run.stdout


def run_case(case_dir, root, env: str = "dev", record: bool = False, log_dir: Optional[str] = None,
             device: Optional[str] = None) -> dict:
    """Run a case; return {"metrics", "problems", "notes", "golden"} (``golden``: the file
    compared with or written). ``device``: the golden files' device tag (default: this
    process's GPU's). With ``record`` write ``golden_values_<env>_<device>.json``."""
    case_dir, root = Path(case_dir), Path(root)
    case = load_case(case_dir)
    device = device or current_device_tag()
    notes: List[str] = []
    if record:
        if not device:
            raise RuntimeError("--record names the golden file for the GPU it ran on: no GPU is visible")
        golden_path, own_device = case_dir / golden_file_name(env, device), True
    else:  # before the run: a case without golden values fails in seconds, not minutes
        golden_path, own_device = find_golden(case_dir, env, device)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="functional-"))
    logs.mkdir(parents=True, exist_ok=True)
    # Bit for bit only where it holds by construction: a deterministic run on the GPU model
    # that recorded the golden file.
    exact = bool(case["MODEL_ARGS"].get("--deterministic-mode")) and own_device
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
            if rule(metric) != STRICT:  # memory and time differ in a fresh process
                continue
            second_half = {s: v for s, v in metrics[metric].items() if s > half}
            if resumed[metric] != second_half:
                problems.append(f"{metric}: resumed steps {resumed[metric]} != uninterrupted {second_half}")
    unlogged = [
        f"{m}: not in the run's iteration lines"
        + (" (MODEL_ARGS needs --log-num-zeros-in-grad: true)" if m == "num-zeros" else "")
        for m in case["METRICS"] if not metrics[m]
    ]
    problems += unlogged
    if record:
        if unlogged:
            raise RuntimeError(f"{case_dir.name}: nothing to record: " + "; ".join(unlogged))
        golden_path.write_text(json.dumps({m: to_golden(v) for m, v in metrics.items()}, indent=2) + "\n")
    else:
        golden = json.loads(golden_path.read_text())
        if not own_device:
            skipped = sorted(set(golden) - set(DEVICE_FREE_METRICS))
            golden = {m: spec for m, spec in golden.items() if m in DEVICE_FREE_METRICS}
            notes.append(f"{golden_path.name} names no GPU: compared {list(golden)} only, within rel "
                         f"{RELATIVE_TOLERANCE}" + (f", not {skipped}" if skipped else "")
                         + (f"; record {golden_file_name(env, device)} with --record for the rest" if device else ""))
        problems += compare(golden, metrics, exact)
        notes += report(golden, metrics)
    return {"metrics": metrics, "problems": problems, "notes": notes, "golden": golden_path.name}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run functional test cases against golden values.")
    parser.add_argument("cases", nargs="+", help="case folders (tests/functional/<case>)")
    parser.add_argument("--record", action="store_true",
                        help="write golden_values_<env>_<device>.json from this run, for this GPU")
    parser.add_argument("--env", default="dev", help="the <env> part of the golden file names (default: dev)")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[3]  # the repository root (pretrain_gpt.py)
    failed = 0
    for case_dir in args.cases:
        result = run_case(case_dir, root, args.env, args.record, args.log_dir)
        status = "RECORDED" if args.record else ("PASS" if not result["problems"] else "FAIL")
        print(json.dumps({"case": Path(case_dir).name, "status": status, "golden": result["golden"],
                          "problems": result["problems"][:20], "notes": result["notes"]}))
        failed += bool(result["problems"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
