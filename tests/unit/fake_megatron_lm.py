"""A stand-in for Megatron-LM's ``megatron.training`` package in CPU tests (Megatron-LM is not
installed there): modules made from source text, registered for the test's duration."""

import sys
import textwrap
import types

import megatron


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
