"""A checkpoint's flat distributed-optimizer states saved in another expert parameter layout
are refused before start-up, by the same rule (and words) the optimizer's load applies after
it (``optimizer_state.bucket_layout_refusal``); per-parameter states, a matching layout and
--no-load-optim pass."""

import pytest

from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_KEY
from megatron.moe_patches.driver import checkpointing

import checkpoint_files
from driver_model import REQUIRED

GROUPED = {"moe_single_grouped_weight": True, "moe_single_grouped_bias": False, "moe_mlp_glu_interleave_size": None}
STOCK = {"moe_single_grouped_weight": False, "moe_single_grouped_bias": False, "moe_mlp_glu_interleave_size": None}


def optimizer(sharding_type, layout):
    state = {"optimizer": {"param_groups": []}, "param_state_sharding_type": sharding_type}
    if layout is not None:
        state[LAYOUT_KEY] = layout
    return state


def saved(tmp_path, optimizer_state):
    return checkpoint_files.checkpoint_root(tmp_path / "ckpt", common={"iteration": 4, "args": {},
                                                                       "optimizer": optimizer_state})


def test_the_layouts_a_checkpoint_records_are_read_before_start_up(tmp_path):
    chained = {0: optimizer("dp_reshardable", STOCK), 1: optimizer("dp_reshardable", GROUPED)}  # EP > 1
    root = saved(tmp_path, chained)
    path, _ = checkpointing.find_checkpoint(str(root))
    assert checkpointing.optimizer_layouts_saved_at(path) == [("dp_reshardable", STOCK), ("dp_reshardable", GROUPED)]


def test_flat_states_of_another_layout_are_refused_naming_the_flag(tmp_path, refused):
    root = saved(tmp_path, optimizer("dp_reshardable", GROUPED))
    line = refused([*REQUIRED, "--load", str(root)])  # this run: per-expert weights
    assert line.startswith(f"--load {root / 'iter_0000004'}: the checkpoint's dp_reshardable")
    assert "--moe-single-grouped-weight True (checkpoint) vs False (now)" in line
    assert "--dist-ckpt-optim-fully-reshardable" in line and "--no-load-optim" in line


@pytest.mark.parametrize("state, argv", [
    (optimizer("dp_reshardable", STOCK), []),  # the run's layout
    (optimizer("fully_reshardable", GROUPED), []),  # per parameter: loads into any layout
    (optimizer("dp_reshardable", None), []),  # no record: stock per-expert layout, as this run
    (optimizer("dp_reshardable", GROUPED), ["--no-load-optim"]),  # the states are not loaded
])
def test_what_loads_passes(tmp_path, parsed, state, argv):
    root = saved(tmp_path, state)
    args = parsed([*REQUIRED, "--load", str(root), *argv])
    assert args.load == str(root)


def test_the_expert_optimizer_of_a_chain_is_checked_too(tmp_path, refused):
    """At EP > 1 the dense optimizer comes first and matches any run; the expert optimizer after
    it holds the layout that must match (issue 57: only the first was read)."""
    root = saved(tmp_path, {0: optimizer("dp_reshardable", STOCK), 1: optimizer("dp_reshardable", GROUPED)})
    line = refused([*REQUIRED, "--load", str(root)])  # this run: per-expert weights
    assert line.startswith(f"--load {root / 'iter_0000004'}: the checkpoint's dp_reshardable")
    assert "--moe-single-grouped-weight True (checkpoint) vs False (now)" in line
