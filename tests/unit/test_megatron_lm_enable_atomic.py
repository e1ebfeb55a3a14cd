"""``megatron_lm.enable()`` is all or nothing: a step that fails (no Megatron-LM importable)
leaves megatron-core and Megatron-LM as they were before the call, and the error says what is
missing. The fake ``megatron.training`` follows test_megatron_lm_integration.py's."""

import sys

import pytest

from megatron.moe_patches import apply, megatron_lm, status

from fake_megatron_lm import fake_training, nothing_enabled  # noqa: F401  (an autouse fixture)

MISSING = ("megatron_lm.enable() needs Megatron-LM's `megatron.training` importable "
           "(a Megatron-LM checkout on PYTHONPATH): No module named 'megatron.training'")


def states():
    return {row.id: row.state for row in status()}


def applied_ids():
    return {row.id for row in status() if row.state == "applied"}


def assert_nothing_enabled():
    assert megatron_lm._hooks == {}
    assert megatron_lm._enabled_features == set()
    assert megatron_lm._helpers_build is None


class _NoMegatronLM:
    """A meta path finder for which ``megatron.training`` does not exist."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron.training" or name.startswith("megatron.training."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def no_megatron_lm(monkeypatch):
    for name in [m for m in sys.modules if m == "megatron.training" or m.startswith("megatron.training.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoMegatronLM(), *sys.meta_path])


CHECKPOINTING = """
    def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
        return args
"""
ARGUMENTS = """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    def validate_args(args, defaults={}):
        return args
"""
INITIALIZE = ("from megatron.training.checkpointing import load_args_from_checkpoint\n"
              "from megatron.training.arguments import validate_args\n")


@pytest.fixture
def training(monkeypatch):
    yield fake_training(monkeypatch, {"checkpointing": CHECKPOINTING, "arguments": ARGUMENTS,
                                      "initialize": INITIALIZE})
    megatron_lm.disable()  # before the fake modules leave sys.modules


@pytest.fixture
def checkpointing_only(monkeypatch):
    """Megatron-LM's checkpointing imports, its initialize does not (a dependency missing)."""
    yield fake_training(monkeypatch, {"checkpointing": CHECKPOINTING, "arguments": ARGUMENTS})
    megatron_lm.disable()


def test_without_megatron_lm_enable_applies_nothing_and_says_what_is_missing(no_megatron_lm):
    before = states()
    with pytest.raises(ImportError) as raised:
        megatron_lm.enable()
    assert states() == before and not applied_ids()
    assert_nothing_enabled()
    assert str(raised.value) == MISSING
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)


def test_a_failed_enable_keeps_entries_applied_before_it(no_megatron_lm):
    apply("C0")
    with pytest.raises(ImportError):
        megatron_lm.enable()
    assert applied_ids() == {"C0"}
    assert_nothing_enabled()


def test_a_failure_in_the_last_step_unwraps_load_args_from_checkpoint(training, monkeypatch):
    stock = training.checkpointing.load_args_from_checkpoint
    stock_validate = training.arguments.validate_args

    def fails():
        raise RuntimeError("no helpers")

    monkeypatch.setattr(megatron_lm, "_skip_dataset_helpers_build", fails)
    with pytest.raises(RuntimeError, match="no helpers"):
        megatron_lm.enable()
    assert training.checkpointing.load_args_from_checkpoint is stock
    assert training.initialize.load_args_from_checkpoint is stock
    assert training.arguments.validate_args is stock_validate is training.initialize.validate_args
    assert not applied_ids()
    assert_nothing_enabled()


def test_an_initialize_that_does_not_import_leaves_checkpointing_unwrapped(checkpointing_only):
    stock = checkpointing_only.checkpointing.load_args_from_checkpoint
    with pytest.raises(ImportError, match="No module named 'megatron.training.initialize'"):
        megatron_lm.enable()
    assert checkpointing_only.checkpointing.load_args_from_checkpoint is stock
    assert not applied_ids()
    assert_nothing_enabled()

