"""The megatron-core methods a feature calls or overrides by name (``Feature.relies_on``): each
exists in the megatron-core this package supports, each is one the feature's code names, and
where one is missing apply() skips the feature (and what requires it) with a warning naming
it, instead of installing an override megatron-core would never call."""

import inspect
import logging

import pytest

from megatron.moe_patches import revert, status
from megatron.moe_patches.installer import _resolvable, apply
from megatron.moe_patches.registry import SERIES, get


@pytest.fixture(autouse=True)
def unpatched():
    revert()
    yield
    revert()


def test_every_method_a_feature_relies_on_exists_in_megatron_core():
    paths = [path for feature in SERIES for path in feature.relies_on]
    assert paths, "no feature lists the methods it relies on"
    assert [path for path in paths if not _resolvable(path)] == []


def test_each_listed_method_is_one_the_features_code_names():
    """A listed name the feature's modules never mention would be a stale entry."""
    from megatron.moe_patches.dispatch import dispatchers, exchanges

    source = inspect.getsource(dispatchers) + inspect.getsource(exchanges)
    for path in get("F1").relies_on:
        name = path.rpartition(".")[2]
        assert name in source, path


def test_a_missing_method_skips_the_feature_and_says_which(monkeypatch, caplog):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.delattr(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize")  # as if renamed upstream
    with caplog.at_level(logging.INFO, logger="megatron.moe_patches.installer"):
        apply()
    rows = {row.id: row for row in status()}
    assert rows["F1"].state == "skipped"
    assert "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize" in rows["F1"].reason
    assert rows["F3"].state == "skipped" and "needs F1" in rows["F3"].reason  # what requires it
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("_maybe_dtoh_and_synchronize" in message for message in warned), warned
    assert rows["C0"].state == "applied"  # the rest of the series is unaffected
