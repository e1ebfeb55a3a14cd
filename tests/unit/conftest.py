"""Helpers of the driver's CPU tests: one rank, and what a refused command line prints."""

import pytest

ERROR = "pretrain_gpt.py: error: "


@pytest.fixture
def one_rank(monkeypatch):
    """No launcher around: WORLD_SIZE and RANK unset."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def refused(capsys):
    """``refused(argv)``: parse_args must exit 2 with a one-line error and no traceback;
    returns that line without its ``pretrain_gpt.py: error: `` prefix."""
    from megatron.moe_patches.driver.arguments import parse_args

    def run(argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith(ERROR), err
        return err.splitlines()[0][len(ERROR):]

    return run
