import pytest
import torch

from megatron.moe_patches.checkpoint.grouped_keys import GroupedKeyError, normalize_grouped_keys

E = 3


def indexed_state(prefix="fc1.", bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {f"{prefix}weight{i}": torch.randn(4, 2, generator=g) for i in range(E)}
    if bias:
        state.update({f"{prefix}bias{i}": torch.randn(4, generator=g) for i in range(E)})
    state[f"{prefix}_extra_state"] = None
    return state


def test_indexed_to_grouped_and_back_is_exact():
    original = indexed_state()
    state = dict(original)
    assert normalize_grouped_keys(state, "fc1.", E, grouped=True) == ["fc1.weight", "fc1.bias"]
    assert set(state) == {"fc1.weight", "fc1.bias", "fc1._extra_state"}
    assert state["fc1.weight"].shape == (E, 4, 2)
    assert torch.equal(state["fc1.weight"][1], original["fc1.weight1"])
    normalize_grouped_keys(state, "fc1.", E, grouped=False)
    assert set(state) == set(original)
    assert all(torch.equal(state[k], original[k]) for k in original if k.startswith("fc1.w") or k.startswith("fc1.b"))


def test_target_layout_already_present_is_left_alone():
    state = indexed_state()
    before = dict(state)
    assert normalize_grouped_keys(state, "fc1.", E, grouped=False) == []
    assert state == before
    grouped = {"fc1.weight": torch.zeros(E, 4, 2)}
    assert normalize_grouped_keys(grouped, "fc1.", E, grouped=True) == []


def test_other_prefixes_are_untouched():
    state = {**indexed_state("fc1."), **indexed_state("fc2.", seed=1)}
    normalize_grouped_keys(state, "fc2.", E, grouped=True)
    assert "fc1.weight0" in state and "fc2.weight" in state and "fc2.weight0" not in state


@pytest.mark.parametrize(
    "mutate, grouped, message",
    [
        (lambda s: s.pop("fc1.weight1"), True, "incomplete expert set for fc1.weight: missing ['fc1.weight1']"),
        (lambda s: s.update({"fc1.weight": torch.zeros(E, 4, 2)}), True, "ambiguous checkpoint"),
        (lambda s: s.update({"fc1.weight2": torch.zeros(5, 2)}), True, "differ in shape"),
    ],
)
def test_refusals_name_the_key_and_change_nothing(mutate, grouped, message):
    state = indexed_state()
    mutate(state)
    snapshot = dict(state)
    with pytest.raises(GroupedKeyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        normalize_grouped_keys(state, "fc1.", E, grouped=grouped)
    assert state.keys() == snapshot.keys() and all(state[k] is snapshot[k] for k in state)


def test_grouped_tensor_with_wrong_expert_count_is_refused():
    state = {"fc1.weight": torch.zeros(E + 1, 4, 2)}
    with pytest.raises(GroupedKeyError, match="expected a leading dim of 3 experts"):
        normalize_grouped_keys(state, "fc1.", E, grouped=False)
    assert "fc1.weight" in state
