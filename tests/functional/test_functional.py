"""Functional cases: pretrain_gpt.py runs compared with committed golden values (GPU)."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron.moe_patches.driver.functional import run_case

HERE = Path(__file__).resolve().parent
CASES = sorted(p.name for p in HERE.iterdir() if (p / "model_config.yaml").is_file())


QUICK = "tiny_moe_device_splits"  # the -m quick representative: trains 50 steps on the sync-free path


# Each case is its own pretrain_gpt.py process: the tiny model leaves most of a GPU idle, so
# the selected cases run side by side and each test reads its own case's result.
PARALLEL = int(os.environ.get("MOE_PATCHES_GPU_PARALLEL", "4"))


@pytest.fixture(scope="module")
def case_results(request, tmp_path_factory):
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    log_dir = os.environ.get("FUNCTIONAL_LOG_DIR") or tmp_path_factory.mktemp("functional-logs")
    with ThreadPoolExecutor(PARALLEL) as pool:
        return {case: pool.submit(run_case, HERE / case, HERE.parents[1], log_dir=log_dir) for case in selected}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == QUICK else c for c in CASES])
def test_case_matches_golden_values(case, case_results):
    result = case_results[case].result()  # a failed run raises here, in its own case
    print(f"{case} vs {result['golden']}:", *result["notes"], sep="\n  ")  # reported-only metrics (-rA, -s)
    assert not result["problems"], "\n".join(result["problems"][:20])
