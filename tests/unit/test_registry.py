import importlib
from pathlib import Path

from megatron.moe_patches.fields import PATCH_FIELD_NAMES
from megatron.moe_patches.registry import BY_ID, SERIES

ROOT = Path(__file__).resolve().parents[2]


def test_series_order_and_ids():
    assert [f.id for f in SERIES] == ["C0", "F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8", "F10", "F11", "F12", "F13"]
    assert set(BY_ID) == {f.id for f in SERIES}


def test_every_entry_is_documented_and_points_somewhere_real():
    for feature in SERIES:
        page = ROOT / feature.page
        assert page.is_file(), feature.page
        assert page.read_text().startswith(f"# {feature.id} "), feature.page
        assert feature.upstream and feature.te_requirement and feature.test
        assert set(feature.fields) <= set(PATCH_FIELD_NAMES), feature.id
        assert all(dep in BY_ID for dep in feature.requires)
        importlib.import_module(feature.module)  # the one hop from the registry to the code


def test_every_binding_names_a_real_owner_and_object_and_says_why():
    bindings = [b for feature in SERIES for b in feature.bindings]
    assert len(bindings) <= 24  # the short list
    for binding in bindings:
        assert len(binding.reason) > 30, binding
        module_name, _, qualname = binding.patched.partition(":")
        patched = getattr(importlib.import_module(module_name), qualname)
        # functions and classes, or a value megatron-core reads by name (F13's APEX stand-ins)
        assert callable(patched) or binding.owner == "megatron.core.tensor_parallel.layers", binding.patched
        assert patched is not None, binding.patched
        if binding.optional:  # Megatron-LM's modules
            assert binding.owner.startswith("megatron.training."), binding
            continue
        owner_module, _, owner_class = binding.owner.partition(":")
        owner = importlib.import_module(owner_module)
        owner = getattr(owner, owner_class) if owner_class else owner
        # a name megatron-core defines only where APEX imports is absent here, and present otherwise
        assert (binding.attribute in vars(owner)) is not binding.absent_in_stock, binding


def test_every_proving_test_exists():
    for feature in SERIES:
        paths = [p.strip() for p in feature.test.split(",")]
        missing = [p for p in paths if not (ROOT / p).is_file()]
        assert not missing, f"{feature.id} names tests that do not exist: {missing}"
        assert all(p.startswith("tests/") for p in paths), feature.id


def test_what_installs_the_experts_also_installs_the_dispatchers():
    # The experts skip their own padding when the plan gives it to our dispatchers: a feature
    # that installs the experts class must bring the dispatchers (F1) with it.
    def closure(feature_id):
        feature = BY_ID[feature_id]
        return {feature_id}.union(*(closure(dep) for dep in feature.requires))

    for feature in SERIES:
        installs_experts = any(b.patched.endswith(":PatchedTEGroupedMLP") for b in feature.bindings)
        if installs_experts or feature.id in ("F4", "F5", "F8"):
            assert {"F1", "F3"} <= closure(feature.id), feature.id
