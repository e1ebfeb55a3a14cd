import importlib
from pathlib import Path

from megatron.moe_patches.config import PATCH_FIELD_NAMES
from megatron.moe_patches.registry import BY_ID, SERIES

ROOT = Path(__file__).resolve().parents[2]


def test_series_order_and_ids():
    assert [f.id for f in SERIES] == ["C0", "F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8"]
    assert set(BY_ID) == {f.id for f in SERIES}


def test_every_entry_is_documented_and_points_somewhere_real():
    for feature in SERIES:
        page = ROOT / feature.page
        assert page.is_file(), feature.page
        assert page.read_text().startswith(f"# {feature.id} "), feature.page
        assert feature.upstream and feature.te_requirement and feature.test
        assert set(feature.fields) <= set(PATCH_FIELD_NAMES), feature.id
        assert all(dep in BY_ID for dep in feature.requires)
        if feature.module is not None:
            assert callable(importlib.import_module(feature.module).replacements)
