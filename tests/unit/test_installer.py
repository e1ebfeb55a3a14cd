import dataclasses
import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

import megatron.core.transformer.transformer_config as tc_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.moe_patches import apply, capabilities, installer, is_applied, revert, status
from megatron.moe_patches.config import PatchedMLATransformerConfig, PatchedTransformerConfig

# Load the modules that consume the config class, so rebinding has real work to do.
importlib.import_module("megatron.core.models.gpt.gpt_model")
importlib.import_module("megatron.core.transformer.moe.moe_layer")


def megatron_bindings():
    """(module, name) -> id(value) for every module-level name in megatron-core."""
    return {
        (name, attr): id(value)
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith("megatron.core")
        for attr, value in list(vars(module).items())
    }


def names_bound_to(obj):
    return {
        (name, attr)
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith("megatron.core")
        for attr, value in list(vars(module).items())
        if value is obj
    }


def test_import_changes_nothing():
    code = (
        "import sys, megatron.core.transformer.transformer_config as t; before = t.TransformerConfig;"
        "import megatron.moe_patches, megatron.moe_patches.driver.arguments, megatron.moe_patches.driver.training;"
        "assert t.TransformerConfig is before; assert not megatron.moe_patches.installer._applied;"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def registry_sites(features=None):
    """(module, attribute) of every binding the registry lists for ``features`` whose owner
    module is imported (a class owner's attributes are not module-level names)."""
    from megatron.moe_patches.registry import SERIES

    return {
        (b.owner, b.attribute)
        for f in SERIES if features is None or f.id in features
        for b in f.bindings
        if ":" not in b.owner and b.owner in sys.modules
    }


def test_apply_sets_exactly_the_registry_bindings_and_revert_restores_identity(reverted):
    before = megatron_bindings()
    consumers = names_bound_to(TransformerConfig) - registry_sites({"C0"})
    assert len(consumers) > 5  # megatron-core modules that imported the name: left alone

    apply(["C0"])
    assert is_applied("C0")
    assert tc_module.TransformerConfig is PatchedTransformerConfig
    assert tc_module.MLATransformerConfig is PatchedMLATransformerConfig
    after = megatron_bindings()
    changed = {site for site, value in after.items() if before.get(site) != value}
    assert changed == registry_sites({"C0"})
    assert names_bound_to(TransformerConfig) == consumers

    revert()
    assert not is_applied("C0")
    assert megatron_bindings() == before


def test_the_whole_series_sets_no_name_outside_the_registry(reverted):
    apply()  # imports every owner module once
    revert()
    before = megatron_bindings()
    apply()
    after = megatron_bindings()
    changed = {site for site, value in after.items() if before.get(site) != value}
    assert changed and changed <= registry_sites()
    revert()
    assert megatron_bindings() == before


def test_apply_twice_equals_apply_once(reverted):
    apply()
    once = megatron_bindings()
    rows_once = [r.state for r in status()]
    applied_once = list(installer._applied)
    apply(["C0"])
    apply()
    assert megatron_bindings() == once
    assert [r.state for r in status()] == rows_once
    assert list(installer._applied) == applied_once
    assert "C0" in installer._applied


def test_revert_covers_an_optional_owner_imported_while_applied(reverted, monkeypatch):
    # Megatron-LM's argument module, imported after apply(), copies the patched name from
    # megatron.core.transformer; revert() must put the stock class back there too.
    import types

    monkeypatch.delitem(sys.modules, "megatron.training.arguments", raising=False)
    apply(["C0"])
    from megatron.core import transformer as package

    fake = types.ModuleType("megatron.training.arguments")
    fake.TransformerConfig = package.TransformerConfig  # what its import line does
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", fake)
    assert fake.TransformerConfig is PatchedTransformerConfig
    revert()
    assert fake.TransformerConfig is TransformerConfig


def test_revert_of_prerequisite_reverts_dependents(reverted, monkeypatch):
    fake = installer.get("F3")
    monkeypatch.setattr(installer, "_applied", {"C0": [], fake.id: []})
    revert(["C0"])
    assert installer._applied == {}


def test_pending_features_are_reported_not_installed(reverted):
    rows = {r.id: r for r in apply()}
    assert rows["C0"].state == "applied"
    for feature in installer.SERIES:
        if feature.module is None:
            assert rows[feature.id].state == "pending"
            assert f"issue #{feature.issue}" in rows[feature.id].reason
            assert feature.id not in installer._applied


def test_unknown_feature_id_is_an_error():
    with pytest.raises(KeyError, match="unknown patch 'F99'"):
        apply(["F99"])


def test_a_string_names_features_not_characters(reverted):
    apply("F2")
    assert is_applied("F2") and is_applied("C0") and not is_applied("F4")
    revert("F2")
    assert not is_applied("F2") and is_applied("C0")
    apply("C0, F6")
    assert is_applied("F6")


def test_untested_megatron_core_version_is_skipped(reverted, monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(capabilities, "mcore_version", lambda: Version("0.15.0"))
    rows = {r.id: r for r in apply()}
    assert rows["C0"].state == "skipped"
    assert "outside the tested range" in rows["C0"].reason
    assert tc_module.TransformerConfig is TransformerConfig


@dataclass
class NewerTransformerConfig(TransformerConfig):
    """Stands in for a megatron-core that ships the fields natively."""

    use_transformer_engine_op_fuser: bool = False
    moe_mlp_glu_interleave_size: Optional[int] = None
    moe_single_grouped_weight: bool = False
    moe_single_grouped_bias: bool = False
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_permute_fusion_into_hybridep: bool = False
    moe_device_tokens_per_expert: bool = False
    moe_symmetric_exchange: bool = False


def test_native_features_detected_and_not_installed(reverted, monkeypatch):
    monkeypatch.setattr(tc_module, "TransformerConfig", NewerTransformerConfig)
    rows = {r.id: r for r in apply()}
    for feature_id in ("C0", "F2", "F4", "F5", "F6", "F8"):
        assert rows[feature_id].state == "native", rows[feature_id]
    # Not detectable through config fields (F10-F13: no megatron-core has them): installed,
    # with the native C0 as their base.
    assert {rows[f].state for f in ("F1", "F3", "F7", "F10", "F11", "F12", "F13")} == {"applied"}
    assert tc_module.TransformerConfig is NewerTransformerConfig
    assert set(installer._applied) == {"F1", "F3", "F7", "F10", "F11", "F12", "F13"}


def test_native_probe_sees_stock_class_while_applied(reverted):
    apply(["C0"])
    # The patched class has the fields; megatron-core as shipped does not.
    assert {r.id: r.state for r in status()}["C0"] == "applied"
    assert not installer.get("C0").native()
    assert not installer.get("F4").native()


def test_cli_status_lists_every_entry():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron.moe_patches", "status", "--apply", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)["features"]  # one JSON document, the rows under "features"
    assert [r["id"] for r in rows] == [f.id for f in installer.SERIES]
    assert rows[0]["state"] == "applied"
    assert all(r["upstream"] for r in rows)


def test_whole_series_apply_revert_restores_identity(reverted):
    from megatron.core.extensions import transformer_engine_spec_provider as spec_provider
    from megatron.core.transformer.moe import experts, moe_layer, token_dispatcher

    before = megatron_bindings()
    stock_classes = (experts.TEGroupedMLP, moe_layer.MoEAlltoAllTokenDispatcher, token_dispatcher._HybridEPManager)
    rows = {r.id: r.state for r in apply()}
    assert {rows[f] for f in ("C0", "F1", "F2", "F3", "F8")} == {"applied"}
    # The experts come from the layer spec: its provider names the patched class; the
    # experts module keeps the stock one (the patched class calls its methods).
    assert spec_provider.TEGroupedMLP is not stock_classes[0] and issubclass(spec_provider.TEGroupedMLP, stock_classes[0])
    assert experts.TEGroupedMLP is stock_classes[0]
    # One patched class per stock dispatcher, carrying F1 and F8 as options.
    assert moe_layer.MoEAlltoAllTokenDispatcher.__module__ == "megatron.moe_patches.dispatch.dispatchers"
    assert issubclass(moe_layer.MoEAlltoAllTokenDispatcher, stock_classes[1])
    assert token_dispatcher._HybridEPManager.__module__ == "megatron.moe_patches.dispatch.hybridep_blocks"
    revert()
    assert megatron_bindings() == before
    assert (spec_provider.TEGroupedMLP, moe_layer.MoEAlltoAllTokenDispatcher, token_dispatcher._HybridEPManager) == stock_classes


def test_revert_one_feature_keeps_the_others(reverted):
    from megatron.core.extensions import transformer_engine_spec_provider as experts

    stock_experts = experts.TEGroupedMLP
    apply()
    revert(["F1"])  # F3 requires F1, and F4, F5, F8 require F3: all go, C0, F2, F6, F7 stay
    assert not any(is_applied(f) for f in ("F1", "F3", "F4", "F5", "F8"))
    assert all(is_applied(f) for f in ("C0", "F2", "F6", "F7"))
    assert experts.TEGroupedMLP is stock_experts
