"""Functional cases: pretrain_gpt.py runs compared with committed golden values (GPU).
Each run starts when collection ends (``BACKGROUND``, tests/conftest.py): the tiny model
leaves most of a GPU idle, so the runs train side by side with the tests pytest runs first."""

import os
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = sorted(p.name for p in HERE.iterdir() if (p / "model_config.yaml").is_file())


QUICK = "tiny_moe_device_splits"  # the -m quick representative: trains 50 steps on the sync-free path


def run(case):
    from megatron.moe_patches.driver.functional import run_case

    log_dir = os.environ.get("FUNCTIONAL_LOG_DIR") or tempfile.mkdtemp(prefix=f"functional-{case}-")
    return run_case(HERE / case, HERE.parents[1], log_dir=log_dir)


BACKGROUND = {"test_case_matches_golden_values": ("case", run)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == QUICK else c for c in CASES])
def test_case_matches_golden_values(case, background):
    result = background  # a failed run raises here, in its own case
    print(f"{case} vs {result['golden']}:", *result["notes"], sep="\n  ")  # reported-only metrics (-rA, -s)
    assert not result["problems"], "\n".join(result["problems"][:20])
