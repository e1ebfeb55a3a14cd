"""torch_dist checkpoints of pretrain_gpt.py move between megatron-core 0.16.1 (with the patch set)
and upstream megatron-core 0.19.2 (the features native, the patch set not installed) both ways.

For each origin version X and the other one Y: X trains the tiny MoE recipe STEPS + 1 steps,
saving A at STEPS; Y loads A and saves B at once; X loads B and saves C. A, B and C must hold
bitwise-equal tensors (parameters, fp32 main params, exp_avg, exp_avg_sq; the runs' own args
are not compared), and Y's step STEPS + 1 from A must give X's step STEPS + 1 loss: both run
the same Transformer Engine kernels on the same state and data, so the loss is compared
exactly. The upstream runs are peer processes with
``PYTHONPATH=$MOE_PATCHES_UPSTREAM_SITE:$PYTHONPATH:<repo>`` (default /tmp/site-upstream).

Layouts: ``te``, the recipe's TE grouped experts (indexed weight0..N-1 on both versions), and
``single_grouped``, one [E, out, in] weight per expert FC: on 0.16.1 the patch set's grouped_mm
experts (--moe-device-tokens-per-expert --moe-single-grouped-weight); on 0.19.2 its own, which
it accepts only with --use-transformer-engine-op-fuser and runs through TE's fused grouped-MLP
kernel (NVTE_CUTEDSL_FUSED_GROUPED_MLP, SM100), so that case skips on other GPUs. Both save
per-expert keys; their kernels differ, so those losses agree within LOSS_RTOL.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain_runs import (
    LAYOUTS,
    LOSS_RTOL,
    STEPS,
    differences,
    pretrain,
    side_by_side,
    tensors,
)

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = os.environ.get("MOE_PATCHES_UPSTREAM_SITE", "/tmp/site-upstream")
if not (Path(UPSTREAM) / "megatron" / "core" / "package_info.py").is_file():
    pytest.skip(f"upstream megatron-core 0.19.2 not installed at {UPSTREAM}", allow_module_level=True)

BASE_VERSION, UPSTREAM_VERSION = "0.16.1", "0.19.2"
UPSTREAM_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (UPSTREAM, os.environ.get("PYTHONPATH"), str(ROOT)) if p)}

# (layout, version) -> (the helper's layout, extra flags, extra environment)
SIDES = {
    ("te", BASE_VERSION): ("te", [], {}),
    ("te", UPSTREAM_VERSION): ("te", [], UPSTREAM_ENV),
    ("single_grouped", BASE_VERSION): ("grouped", [], {}),
    ("single_grouped", UPSTREAM_VERSION): (
        "te", ["--moe-single-grouped-weight", "--use-transformer-engine-op-fuser"],
        {**UPSTREAM_ENV, "NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}),
}
assert LAYOUTS["grouped"] == ["--moe-device-tokens-per-expert", "--moe-single-grouped-weight"]
SAME_KERNELS = {"te": True, "single_grouped": False}
CASES = [(layout, origin) for layout in ("te", "single_grouped") for origin in (BASE_VERSION, UPSTREAM_VERSION)]


def other(version):
    return UPSTREAM_VERSION if version == BASE_VERSION else BASE_VERSION


def run(layout, version, iters, save, load=None, extra=()):
    """pretrain_gpt.py of ``layout`` on megatron-core ``version``; its losses by iteration."""
    helper_layout, flags, env = SIDES[layout, version]
    return pretrain(helper_layout, iters, save, load=load, extra=[*flags, *extra], env=env)


def single_grouped_blocker():
    """Why upstream cannot train single grouped experts on this GPU, or None."""
    from megatron.moe_patches import capabilities

    if not capabilities.te_fused_grouped_mlp_kernel():
        return ("megatron-core 0.19.2 holds single grouped expert weights only with "
                "--use-transformer-engine-op-fuser, whose SwiGLU experts need TE's fused grouped-MLP kernel "
                "(GroupedMLP_CuTeGEMMGLU: SM100), which this GPU lacks")
    return None


def train_a(root, layout, origin):
    losses = run(layout, origin, STEPS + 1, root, extra=["--save-interval", str(STEPS)])
    (root / "latest_checkpointed_iteration.txt").write_text(str(STEPS))  # resume from STEPS
    return losses[STEPS + 1]


@pytest.fixture(scope="module")
def upstream_site():
    """The megatron-core the upstream runs import: its version and where it lives."""
    code = "import json, megatron.core as m; print(json.dumps([m.__version__, m.__file__]))"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, **UPSTREAM_ENV), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    version, location = json.loads(out.stdout.strip().splitlines()[-1])
    assert location.startswith(str(Path(UPSTREAM).resolve())) or location.startswith(UPSTREAM), location
    assert version.startswith("0.19"), version
    return version


@pytest.fixture(scope="module")
def round_trips(request, upstream_site, tmp_path_factory):
    """(layout, origin) -> its runs (futures): A, then B and D from A, then C from B; every
    selected case side by side, wave by wave."""
    cases = [(item.callspec.params["layout"], item.callspec.params["origin"]) for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")]
    if single_grouped_blocker():
        cases = [case for case in cases if case[0] != "single_grouped"]
    roots = {case: tmp_path_factory.mktemp(f"{case[0]}-from-{case[1]}") for case in cases}
    first = side_by_side({(case, "A"): (train_a, roots[case] / "A", *case) for case in cases})
    started = [case for case in cases if first[case, "A"].exception() is None]
    second = side_by_side({
        (case, name): (run, case[0], other(case[1]), STEPS + (name == "D"), roots[case] / name, roots[case] / "A")
        for case in started for name in ("B", "D")
    })
    third = side_by_side({
        (case, "C"): (run, case[0], case[1], STEPS, roots[case] / "C", roots[case] / "B")
        for case in started if second[case, "B"].exception() is None
    })
    runs = {**first, **second, **third}
    return {case: {"root": roots[case], **{name: f for (c, name), f in runs.items() if c == case}} for case in cases}


@pytest.mark.parametrize("layout, origin", CASES, ids=[f"{layout}-from-{origin}" for layout, origin in CASES])
def test_checkpoint_round_trip_between_versions(single_gpu, round_trips, layout, origin):
    if layout == "single_grouped" and single_grouped_blocker():
        pytest.skip(single_grouped_blocker())
    runs = round_trips[layout, origin]
    x_next = runs["A"].result()
    runs["B"].result()
    runs["C"].result()
    y_next = runs["D"].result()[STEPS + 1]
    root = runs["root"]
    a, b, c = tensors(root / "A"), tensors(root / "B"), tensors(root / "C")
    optimizer_keys = [k for k in a if k.startswith("optimizer.state.")]
    expert_keys = [k for k in optimizer_keys if ".experts." in k]
    # The plain common state (iteration, scheduler, optimizer param groups) as far as both
    # versions keep it; keys only one of them keeps are shown, not compared.
    plain = {k for k in set(a) | set(b) if not k.startswith("args.") and not torch.is_tensor(a.get(k, b.get(k)))}
    shared = sorted(k for k in plain if k in a and k in b)
    print(json.dumps({"layout": layout, "origin": origin, "other": other(origin), "tensors": len(a),
                      "optimizer_state_tensors": len(optimizer_keys), "expert_optimizer_tensors": len(expert_keys),
                      "a_vs_b": differences(a, b, tensors_only=True)[:4], "a_vs_c": differences(a, c)[:4],
                      "plain_a_vs_b": [k for k in shared if a[k] != b[k]][:6],
                      "plain_only_in_one": sorted(plain - set(shared))[:6], "next_loss": [x_next, y_next]}))
    assert expert_keys, "no expert optimizer states in the checkpoint"
    assert {"exp_avg", "exp_avg_sq", "param"} <= {k.split(".")[2] for k in expert_keys}
    assert differences(a, b, tensors_only=True) == []  # every tensor bitwise
    assert [k for k in shared if a[k] != b[k]] == []
    assert differences(a, c) == []  # C is saved by the origin version again: everything
    if SAME_KERNELS[layout]:
        assert y_next == x_next
    else:
        assert abs(y_next - x_next) <= LOSS_RTOL * abs(x_next)
