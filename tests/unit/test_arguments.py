import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver.patch_args import (
    CHECKPOINT_RESTORED_ARGS,
    add_moe_patch_args,
    config_kwargs_from_args,
    flag_name,
    restore_args_from_checkpoint,
)
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.fields import PATCH_FIELD_NAMES

ROOT = Path(__file__).resolve().parents[2]


def parse(argv):
    return add_moe_patch_args(argparse.ArgumentParser()).parse_args(argv)


def test_flag_spelling():
    assert flag_name("moe_single_grouped_weight") == "--moe-single-grouped-weight"
    assert flag_name("use_transformer_engine_op_fuser") == "--use-transformer-engine-op-fuser"


def test_defaults_match_config_defaults():
    args = parse([])
    config = PatchedTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    assert config_kwargs_from_args(args) == {n: getattr(config, n) for n in PATCH_FIELD_NAMES}


def test_args_round_trip_into_config():
    args = parse(
        [
            "--moe-mlp-glu-interleave-size", "32",
            "--moe-single-grouped-weight",
            "--moe-device-tokens-per-expert",
        ]
    )
    assert args.moe_mlp_glu_interleave_size == 32 and args.moe_single_grouped_weight
    config = PatchedTransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
        moe_ffn_hidden_size=64, moe_grouped_gemm=True, gated_linear_unit=True, add_bias_linear=False,
        activation_func=torch.nn.functional.silu, bf16=True, params_dtype=torch.bfloat16,
        **config_kwargs_from_args(args),
    )
    for name, value in config_kwargs_from_args(args).items():
        assert getattr(config, name) == value


def test_int_flags_reject_non_integers(capsys):
    with pytest.raises(SystemExit):
        parse(["--moe-hybridep-num-blocks-permute", "many"])
    assert "invalid int value" in capsys.readouterr().err


def test_existing_flag_with_same_dest_is_kept():
    parser = argparse.ArgumentParser()
    native = parser.add_argument("--use-transformer-engine-op-fuser", action="store_true")
    add_moe_patch_args(parser)
    assert parser._option_string_actions["--use-transformer-engine-op-fuser"] is native
    assert parser.parse_args(["--moe-single-grouped-bias"]).moe_single_grouped_bias


def test_existing_flag_with_other_dest_is_a_conflict():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-single-grouped-weight", dest="something_else", action="store_true")
    with pytest.raises(ValueError, match="--moe-single-grouped-weight is already defined"):
        add_moe_patch_args(parser)


def test_the_driver_and_megatron_lm_restore_by_one_rule():
    """One restore function for both loops, forcing exactly the driver's store_true flags."""
    from megatron.moe_patches import megatron_lm
    from megatron.moe_patches.driver.arguments import build_parser
    from megatron.moe_patches.fields import FORCED_ON_RESTORE, restore_patch_args

    assert restore_args_from_checkpoint is restore_patch_args is megatron_lm.restore_patch_args
    switches = {action.dest for action in build_parser()._actions
                if isinstance(action, argparse._StoreTrueAction) and action.dest in PATCH_FIELD_NAMES}
    assert FORCED_ON_RESTORE == switches


def test_restore_list_forces_bools_only():
    forced = {name for name, force in CHECKPOINT_RESTORED_ARGS if force}
    assert {name for name, _ in CHECKPOINT_RESTORED_ARGS} == set(PATCH_FIELD_NAMES)
    assert forced == {
        "use_transformer_engine_op_fuser",
        "moe_single_grouped_weight",
        "moe_single_grouped_bias",
        "moe_permute_fusion_into_hybridep",
        "moe_device_tokens_per_expert",
        "moe_symmetric_exchange",
    }


def test_restore_from_checkpoint_args():
    args = parse(["--moe-hybridep-num-blocks-unpermute", "12"])
    saved = argparse.Namespace(
        use_transformer_engine_op_fuser=True,  # store_true default False must not block it
        moe_mlp_glu_interleave_size=64,  # current None: restored
        moe_hybridep_num_blocks_unpermute=40,  # current 12 and not forced: kept
        moe_single_grouped_weight=None,  # nothing saved: current value stays
    )
    restored = restore_args_from_checkpoint(args, saved)
    assert args.use_transformer_engine_op_fuser is True
    assert args.moe_mlp_glu_interleave_size == 64
    assert args.moe_hybridep_num_blocks_unpermute == 12
    assert args.moe_single_grouped_weight is False
    assert sorted(restored) == ["moe_mlp_glu_interleave_size", "use_transformer_engine_op_fuser"]


def test_restore_from_old_checkpoint_without_the_args():
    args = parse(["--moe-single-grouped-weight"])
    assert restore_args_from_checkpoint(args, argparse.Namespace(num_layers=2)) == []
    assert args.moe_single_grouped_weight is True


def test_pretrain_gpt_help_lists_every_flag_and_needs_a_gpu():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    for name in PATCH_FIELD_NAMES:
        assert flag_name(name) in out.stdout
    run = subprocess.run(  # a valid model: Megatron-LM's required flags come from the recipe
        [sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), "--yaml-cfg", "tiny-moe-stock"],
        capture_output=True, text=True, cwd=ROOT,
    )
    if not torch.cuda.is_available():
        assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr
