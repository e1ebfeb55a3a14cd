import sys
import types

import pytest

from megatron.moe_patches import capabilities as cap


def test_accepts_parameter():
    def explicit(inp, m_splits, m_splits_tensor=None):
        pass

    def opaque(*args, **kwargs):
        pass

    assert cap.accepts_parameter(explicit, "m_splits_tensor")
    assert not cap.accepts_parameter(explicit, "pad_offsets")
    assert not cap.accepts_parameter(opaque, "m_splits_tensor")  # says nothing: treat as absent
    assert not cap.accepts_parameter(None, "x")


def test_deep_ep_probe_reads_the_constructor(monkeypatch):
    class NewBuffer:
        def __init__(self, group, hidden_dim, num_blocks_permute=None, num_blocks_unpermute=None):
            pass

    class OldBuffer:
        def __init__(self, group, hidden_dim):
            pass

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=NewBuffer))
    assert cap.deep_ep_hybridep_blocks()
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=OldBuffer))
    assert not cap.deep_ep_hybridep_blocks()
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import fails
    assert not cap.deep_ep_hybridep_blocks()


def test_mcore_version_and_range():
    from packaging.version import Version

    assert cap.mcore_version() == Version("0.16.1")
    assert cap.mcore_supported()
    assert not cap.mcore_supported(Version("0.17.0"))
    assert not cap.mcore_supported(Version("0.16.0"))


def test_stock_unwraps_installed_replacements():
    stock_obj, patched_obj = object(), object()
    cap.note_installed(stock_obj, patched_obj)
    try:
        assert cap.stock(patched_obj) is stock_obj
        assert cap.stock(stock_obj) is stock_obj
    finally:
        cap.note_reverted(patched_obj)
    assert cap.stock(patched_obj) is patched_obj


@pytest.mark.skipif(cap.te_version() is not None, reason="TE is installed here")
def test_te_probes_answer_without_te():
    assert not cap.te_fused_permute_pad()
    assert not cap.te_op_fuser_grouped_mlp()
    assert not cap.te_grouped_linear_device_splits()
