"""apply()/revert() refuse a bad ``features`` argument by name, saying what they take,
before installing or reverting anything."""

import pytest

from megatron.moe_patches import apply, installer, revert

SERIES = "the series: C0, F1,"


@pytest.mark.parametrize("call", [apply, revert])
@pytest.mark.parametrize("features, error, message", [
    (42, TypeError, "features: got int 42; expected None (the whole series), a feature id such as 'F4'"),
    (b"F4", TypeError, "features: got bytes b'F4'; expected None"),
    ([None], TypeError, "features[0]: got NoneType None; expected a feature id string"),
    (["C0", 3], TypeError, "features[1]: got int 3; expected a feature id string"),
    ({"F4": False}, TypeError, "features: got dict {'F4': False}; a mapping is not taken (its keys would be "
                               "selected whatever their values say): pass None (the whole series)"),
])
def test_features_of_the_wrong_type_are_refused_by_name(call, features, error, message, reverted):
    with pytest.raises(error) as caught:
        call(features)
    assert str(caught.value).startswith(message) and SERIES in str(caught.value)


@pytest.mark.parametrize("call", [apply, revert])
def test_unknown_feature_is_a_value_error_and_a_key_error(call, reverted):
    for kind in (ValueError, KeyError):
        with pytest.raises(kind) as caught:
            call("C0,F99")
        assert str(caught.value) == ("features: unknown patch 'F99'; the series is C0, F1, F2, F3, F4, F5, F6, F7, "
                                     "F8, F10, F11, F12, F13")


def test_a_refused_list_installs_nothing(reverted):
    with pytest.raises(TypeError):
        apply(["C0", None])
    assert not installer._applied


def test_a_mapping_installs_nothing(reverted):
    """apply({"F4": False}) iterated the dict's keys and installed F4 (issue 57)."""
    with pytest.raises(TypeError, match="features: got dict"):
        apply({"F4": False})
    assert not installer._applied
