"""One --load model-shape rule for both loops (``on_disk.model_shape_differences``): the same
checkpoint of another shape is refused by this package's driver and by Megatron-LM's loop,
each naming the one flag that differs in its own words; a checkpoint of this shape loads."""

import argparse

import pytest

from megatron.moe_patches.checkpoint import on_disk

import checkpoint_files
from driver_model import REQUIRED
from fake_megatron_lm import fake_training, nothing_enabled  # noqa: F401  (autouse)
from test_megatron_lm_load_before_start import initialize  # noqa: F401  (the fixture: Megatron-LM's start-up)

pytestmark = pytest.mark.usefixtures("one_rank")

# Every shape arg given, so that neither loop derives one from another.
SHAPE = dict(num_layers=2, hidden_size=512, ffn_hidden_size=2048, swiglu=False, num_attention_heads=8,
             group_query_attention=True, num_query_groups=8, kv_channels=64, num_experts=8, moe_ffn_hidden_size=512,
             moe_shared_expert_intermediate_size=None, vocab_size=32000)

# (arg, this run's value): the checkpoint keeps SHAPE's
MISMATCHES = [
    ("num_layers", 4), ("hidden_size", 256), ("ffn_hidden_size", 1024), ("swiglu", True),
    ("num_attention_heads", 16), ("num_query_groups", 4), ("kv_channels", 32), ("num_experts", 16),
    ("moe_ffn_hidden_size", 256), ("moe_shared_expert_intermediate_size", 1024), ("vocab_size", 50000),
]


def driver_argv(shape):
    """The driver's flags for ``shape``: a switch where True, none where unset or off."""
    argv = []
    for name, value in shape.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    return argv


def driver_shown(value):
    return "none" if value is None else ("on" if value else "off") if isinstance(value, bool) else str(value)


def test_the_rule_compares_every_shape_arg_and_the_vocabulary():
    assert [name for name, _ in MISMATCHES] == [*on_disk.MODEL_SHAPE_ARGS, "vocab_size"]


@pytest.mark.parametrize("name, value", MISMATCHES, ids=[name for name, _ in MISMATCHES])
def test_both_loops_refuse_the_same_other_shape(tmp_path, capsys, refused, initialize, name, value):
    run = {**SHAPE, name: value}
    flag = "--" + name.replace("_", "-")
    driver_root = checkpoint_files.checkpoint_root(tmp_path / "driver", common={"iteration": 4, "args": SHAPE})
    assert refused([*REQUIRED, *driver_argv(run), "--load", str(driver_root)]) == (
        f"--load {driver_root / 'iter_0000004'} was saved with {flag} {driver_shown(SHAPE[name])}, this run has "
        f"{driver_shown(value)}: give the same model flags, or --use-checkpoint-args to take them from the checkpoint")
    saved = argparse.Namespace(**SHAPE)  # Megatron-LM saves its args as a Namespace
    loop_root = checkpoint_files.checkpoint_root(tmp_path / "loop", common={"iteration": 4, "args": saved})
    assert initialize(capsys, load=str(loop_root), **run) == (
        f"--load {loop_root / 'iter_0000004'}: the checkpoint holds another model: {flag} {SHAPE[name]} "
        f"(checkpoint) vs {value} (now); give the checkpoint's sizes, add --use-checkpoint-args to take them from "
        "it, or point --load at a checkpoint of this model")


def test_both_loops_load_the_same_shape(tmp_path, capsys, parsed, initialize):
    driver_root = checkpoint_files.checkpoint_root(tmp_path / "driver", common={"iteration": 4, "args": SHAPE})
    assert parsed([*REQUIRED, *driver_argv(SHAPE), "--load", str(driver_root)]).load == str(driver_root)
    saved = argparse.Namespace(**SHAPE)
    loop_root = checkpoint_files.checkpoint_root(tmp_path / "loop", common={"iteration": 4, "args": saved})
    assert initialize(capsys, load=str(loop_root), **SHAPE) is None
