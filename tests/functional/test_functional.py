"""Functional cases: pretrain_gpt.py runs compared with committed golden values (GPU)."""

import os
from pathlib import Path

import pytest

from megatron.moe_patches.driver.functional import run_case

HERE = Path(__file__).resolve().parent
CASES = sorted(p.name for p in HERE.iterdir() if (p / "model_config.yaml").is_file())


QUICK = "tiny_moe_device_splits"  # the -m quick representative: trains 50 steps on the sync-free path


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == QUICK else c for c in CASES])
def test_case_matches_golden_values(case, tmp_path):
    result = run_case(HERE / case, HERE.parents[1], log_dir=os.environ.get("FUNCTIONAL_LOG_DIR", tmp_path))
    assert not result["problems"], "\n".join(result["problems"][:20])
