"""Helpers of the driver's CPU tests: one rank, a one-rank process group, and what a refused
command line prints."""

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

# Test modules import their shared helpers (driver_model) from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

ERROR = "pretrain_gpt.py: error: "


@pytest.fixture(autouse=True)
def launched_rank(monkeypatch):
    """The tests that set WORLD_SIZE stand for one rank of a launched job: torchrun sets RANK
    with it (the driver refuses WORLD_SIZE > 1 without RANK); rank 0 unless a test says."""
    if "RANK" not in os.environ:
        monkeypatch.setenv("RANK", "0")


@pytest.fixture
def one_rank(monkeypatch):
    """Rank 0 of one: WORLD_SIZE unset (a test that sets it stands for rank 0 of a launched job,
    whose launcher sets RANK with it)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")


def _parse_as_entry_point(argv):
    """parse_args as the entry points run it: megatron-core's fallback notices quieted first."""
    from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings
    from megatron.moe_patches.driver.arguments import parse_args

    with warnings.catch_warnings():
        quiet_megatron_core_import_warnings()
        return parse_args(argv)


@pytest.fixture
def parsed():
    """``parsed(argv)``: the args pretrain_gpt.py would run with (what it prints goes to capsys)."""
    return _parse_as_entry_point


@pytest.fixture
def refused(capsys):
    """``refused(argv)``: parse_args must exit 2 with a one-line error and no traceback;
    returns that line without its ``pretrain_gpt.py: error: `` prefix."""
    def run(argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            _parse_as_entry_point(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith(ERROR), err
        return err.splitlines()[0][len(ERROR):]

    return run


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank, as megatron-core's load needs one."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
