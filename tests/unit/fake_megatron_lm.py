"""A stand-in for Megatron-LM's ``megatron.training`` package in CPU tests (Megatron-LM is not
installed there): modules made from source text, registered for the test's duration."""

import sys
import textwrap
import types

import megatron
import pytest

from megatron.moe_patches import megatron_lm, revert


def fake_training(monkeypatch, modules):
    """Install a ``megatron.training`` package holding ``modules`` (name: source); returns it."""
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setattr(megatron, "training", package, raising=False)
    for name, source in modules.items():
        module = types.ModuleType(f"megatron.training.{name}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(textwrap.dedent(source), module.__dict__)
        setattr(package, name, module)
    return package


@pytest.fixture(autouse=True)
def nothing_enabled():
    """Every test starts and ends with megatron-core unpatched and Megatron-LM unwrapped (a test
    module that imports this fixture gets it for each of its tests)."""
    megatron_lm.disable()
    revert()
    yield
    megatron_lm.disable()
    revert()
