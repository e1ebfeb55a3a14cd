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


def test_hybridep_options_read_megatron_cores_buffer_class(monkeypatch):
    """Without a class given, the probe reads the one fused_a2a imported from deep_ep."""
    from megatron.core.transformer.moe import fused_a2a

    class NewBuffer:
        def __init__(self, group, hidden_dim, num_blocks_permute=None, num_blocks_unpermute=None):
            pass

    class OldBuffer:
        def __init__(self, group, hidden_dim):
            pass

    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", NewBuffer, raising=False)
    assert cap.hybridep_options() == (True, False)
    monkeypatch.setattr(fused_a2a, "HybridEPBuffer", OldBuffer)
    assert cap.hybridep_options() == (False, False)
    monkeypatch.delattr(fused_a2a, "HybridEPBuffer")  # deep_ep not installed
    assert cap.hybridep_options() == (False, False)


def test_hybridep_options_need_both_halves_of_each_pair():
    """A buffer that takes one of two block counts, or fuses the permute into dispatch but not the
    unpermute into combine, takes neither option (issue 57: ``any`` passed for ``all``)."""

    class HalfBuffer:
        def __init__(self, group, hidden_dim, num_blocks_permute=None):
            pass

        def dispatch_with_permute(self, hidden, fuse_permute_dispatch=False):
            pass

        def combine_with_unpermute(self, hidden):
            pass

    class WholeBuffer(HalfBuffer):
        def __init__(self, group, hidden_dim, num_blocks_permute=None, num_blocks_unpermute=None):
            pass

        def combine_with_unpermute(self, hidden, fuse_unpermute_combine=False):
            pass

    assert cap.hybridep_options(HalfBuffer) == (False, False)
    assert cap.hybridep_options(WholeBuffer) == (True, True)


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


@pytest.fixture
def fake_te(monkeypatch):
    """``te_attr`` answering from a dict: what a Transformer Engine offers, path by path."""
    offered = {}
    monkeypatch.setattr(cap, "te_attr", lambda path: offered.get(path))
    return offered


def test_fused_permute_pad_needs_both_kernels_and_the_pad_offsets_parameter(fake_te):
    def unpermute(inp, row_id_map, probs=None, pad_offsets=None):
        pass

    def old_unpermute(inp, row_id_map, probs=None):
        pass

    assert not cap.te_fused_permute_pad()
    fake_te["permutation.moe_permute_and_pad_with_probs"] = object()
    assert not cap.te_fused_permute_pad()  # no unpermute at all
    fake_te["permutation.moe_unpermute"] = old_unpermute
    assert not cap.te_fused_permute_pad()  # an unpermute that cannot unpad
    fake_te["permutation.moe_unpermute"] = unpermute
    assert cap.te_fused_permute_pad()
    del fake_te["permutation.moe_permute_and_pad_with_probs"]
    assert not cap.te_fused_permute_pad()


def test_op_fuser_needs_grouped_linear_and_the_scaled_swiglu(fake_te):
    fake_te["ops.GroupedLinear"] = object()
    assert not cap.te_op_fuser_grouped_mlp()
    fake_te["ops.ScaledSwiGLU"] = object()
    assert cap.te_op_fuser_grouped_mlp()
    del fake_te["ops.GroupedLinear"]
    assert not cap.te_op_fuser_grouped_mlp()


def test_device_splits_probe_reads_grouped_linears_forward(fake_te):
    class RocmGroupedLinear:
        def forward(self, inp, m_splits, m_splits_tensor=None, is_first_microbatch=None):
            pass

    class NvidiaGroupedLinear:
        def forward(self, inp, m_splits, is_first_microbatch=None):
            pass

    fake_te["GroupedLinear"] = NvidiaGroupedLinear
    assert not cap.te_grouped_linear_device_splits()
    fake_te["GroupedLinear"] = RocmGroupedLinear
    assert cap.te_grouped_linear_device_splits()


def test_fused_grouped_mlp_kernel_probe(fake_te):
    class Fused:
        supported = True

        @classmethod
        def is_supported(cls):
            if cls.supported is None:
                raise RuntimeError("no GPU")
            return cls.supported

    assert not cap.te_fused_grouped_mlp_kernel()
    fake_te["ops.fused.GroupedMLP_CuTeGEMMGLU"] = Fused
    assert cap.te_fused_grouped_mlp_kernel()
    Fused.supported = False
    assert not cap.te_fused_grouped_mlp_kernel()
    Fused.supported = None  # the probe cannot run here: not available
    assert not cap.te_fused_grouped_mlp_kernel()


def test_supported_range_is_half_open():
    from packaging.version import Version

    low, high = cap.SUPPORTED_MCORE
    assert cap.mcore_supported(low) and cap.mcore_supported(Version("0.16.9"))
    assert not cap.mcore_supported(high)


def test_stock_ignores_an_entry_whose_id_was_reused(monkeypatch):
    """Entries are keyed by id(): an object that got the id of a replacement freed since must not
    be taken for it."""
    newcomer, gone_patched, stock_obj = object(), object(), object()
    monkeypatch.setitem(cap._installed, id(newcomer), (gone_patched, stock_obj))
    assert cap.stock(newcomer) is newcomer
