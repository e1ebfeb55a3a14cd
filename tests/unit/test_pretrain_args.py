import argparse
from pathlib import Path

import pytest
import torch
import yaml

from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.driver.arguments import build_parser, parse_args, transformer_config_kwargs
from megatron.moe_patches.driver.recipes import RecipeError, flatten_recipe

from driver_model import REQUIRED

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "megatron/moe_patches/recipes/tiny-moe-stock.yaml")
NESTED = str(ROOT / "megatron/moe_patches/recipes/tiny-moe-nested.yaml")


def write(tmp_path, data, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_flat_and_nested_recipes_give_the_same_model():
    flat, nested = parse_args(["--yaml-cfg", TINY]), parse_args(["--yaml-cfg", NESTED])
    keys = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_experts",
            "moe_ffn_hidden_size", "moe_router_topk", "moe_grouped_gemm", "swiglu", "disable_bias_linear",
            "moe_token_dispatcher_type", "bf16", "seq_length", "global_batch_size", "lr"]
    assert {k: getattr(flat, k) for k in keys} == {k: getattr(nested, k) for k in keys}
    assert flat.num_experts == 8 and flat.swiglu and flat.disable_bias_linear


def test_command_line_overrides_the_recipe():
    args = parse_args(["--yaml-cfg", TINY, "--hidden-size", "128", "--moe-router-topk", "1", "--moe-router-pre-softmax"])
    assert (args.hidden_size, args.moe_router_topk, args.num_layers) == (128, 1, 2)


def test_unknown_recipe_key_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", write(tmp_path, {"num-layers": 2, "num-laters": 3})])
    assert "unknown key 'num_laters'" in capsys.readouterr().err


def test_nested_unknown_key_and_bad_values(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", write(tmp_path, {"language_model": {"hidden_sise": 8}})])
    assert "unknown key 'hidden_sise'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", write(tmp_path, {"swiglu": "yes"})])
    assert "on/off flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", write(tmp_path, {"moe-token-dispatcher-type": "ring"})])
    assert "must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", write(tmp_path, {"hidden-size": "wide"})])
    assert "cannot read 'wide' as int" in capsys.readouterr().err


def test_duplicate_key_across_forms():
    """One key at the top level and in a section: Megatron-LM's YAML reader stops on it too."""
    with pytest.raises(RecipeError, match="'num_layers' is set both at the top level .* and in 'language_model'"):
        flatten_recipe({"num_layers": 2, "language_model": {"num_layers": 3}}, build_parser())


def test_unknown_flag_and_contradictions(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--num-layerz", "2"])
    assert "unrecognized arguments: --num-layerz" in capsys.readouterr().err
    for argv, message in [
        (["--fp8-format", "e4m3"], "--fp8-format needs --bf16"),
        (["--mock-data", "--data-path", "x"], "contradict each other"),
        (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
        (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
        (["--micro-batch-size", "4", "--global-batch-size", "6"], "must be a multiple of"),
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], "divisible by"),
        (["--yaml-cfg", TINY, "--train-iters", "4"], "--lr-warmup-iters 10 must be below --lr-decay-iters 4"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv if "--yaml-cfg" in argv else [*REQUIRED, *argv])
        assert message in capsys.readouterr().err, argv


def test_args_to_config():
    args = parse_args(["--yaml-cfg", TINY, "--moe-device-tokens-per-expert", "--moe-mlp-glu-interleave-size", "64"])
    kwargs = transformer_config_kwargs(args)
    fusion = kwargs.pop("moe_permute_fusion")  # stock validation asks TE about it (not on CPU)
    rope_fusion = kwargs.pop("apply_rope_fusion")  # the same (Megatron-LM's default, on with RoPE)
    config = PatchedTransformerConfig(**kwargs)
    assert fusion is True and rope_fusion is True
    assert config.num_moe_experts == 8 and config.moe_ffn_hidden_size == 512
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert config.add_bias_linear is False and config.params_dtype is torch.bfloat16
    assert config.moe_device_tokens_per_expert and config.moe_mlp_glu_interleave_size == 64
    assert config.hidden_dropout == 0.0 and config.normalization == "RMSNorm"


def test_dense_model_has_no_moe_fields():
    kwargs = transformer_config_kwargs(parse_args(REQUIRED))
    assert "num_moe_experts" not in kwargs and kwargs["ffn_hidden_size"] == 4 * 512


def test_checkpoint_arg_restore():
    hybridep = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
    saved = vars(parse_args(["--yaml-cfg", TINY, "--use-transformer-engine-op-fuser", *hybridep,
                             "--moe-hybridep-num-blocks-permute", "32"])).copy()
    args = parse_args([*REQUIRED, "--hidden-size", "1000", "--num-experts", "4", *hybridep,
                       "--moe-hybridep-num-blocks-permute", "8"])
    taken = checkpointing.restore_args(args, saved)
    assert args.hidden_size == 256 and args.num_experts == 8  # model shape: always the checkpoint's
    assert args.use_transformer_engine_op_fuser is True  # bool: forced past its False default
    assert args.moe_hybridep_num_blocks_permute == 8  # set on the command line: kept
    assert "hidden_size" in taken and "moe_hybridep_num_blocks_permute" not in taken


def test_checkpoint_tracker(tmp_path):
    assert checkpointing.latest_iteration(str(tmp_path)) is None
    (tmp_path / checkpointing.TRACKER).write_text("40\n")
    assert checkpointing.latest_iteration(str(tmp_path)) == 40
    assert checkpointing.iteration_dir("/ckpt", 40) == "/ckpt/iter_0000040"


def test_optimizer_states_refused_across_glu_interleave():
    saved = vars(parse_args(["--yaml-cfg", TINY, "--use-transformer-engine-op-fuser",
                             "--moe-mlp-glu-interleave-size", "32"])).copy()
    same = parse_args(["--yaml-cfg", TINY, "--use-transformer-engine-op-fuser", "--moe-mlp-glu-interleave-size", "32"])
    checkpointing.check_optimizer_layout(same, saved)  # same layout: loads
    other = parse_args(["--yaml-cfg", TINY, "--use-transformer-engine-op-fuser"])
    with pytest.raises(ValueError, match="--moe-mlp-glu-interleave-size 32 \\(checkpoint\\) vs None"):
        checkpointing.check_optimizer_layout(other, saved)


def test_fully_reshardable_optimizer_states_load_across_grouped_layouts():
    grouped = ["--yaml-cfg", TINY, "--moe-device-tokens-per-expert", "--moe-single-grouped-weight"]
    indexed = parse_args(["--yaml-cfg", TINY, "--moe-device-tokens-per-expert"])
    with pytest.raises(ValueError, match="--moe-single-grouped-weight True \\(checkpoint\\)"):
        checkpointing.check_optimizer_layout(indexed, vars(parse_args(grouped)).copy())  # per-rank buffers
    saved = vars(parse_args([*grouped, "--dist-ckpt-optim-fully-reshardable"])).copy()
    checkpointing.check_optimizer_layout(indexed, saved)  # per-expert keys (F7): loads
    interleaved = parse_args(["--yaml-cfg", TINY, "--use-transformer-engine-op-fuser", "--moe-mlp-glu-interleave-size", "32"])
    checkpointing.check_optimizer_layout(interleaved, saved)  # concatenated layout on disk: loads
    assert checkpointing.optimizer_metadata(parse_args(grouped)) == checkpointing.DP_RESHARDABLE
    assert checkpointing.optimizer_metadata(argparse.Namespace(**saved)) == checkpointing.FULLY_RESHARDABLE
    # Per-parameter keys must not depend on EP (megatron-core chains optimizers at EP > 1).
    assert checkpointing.FULLY_RESHARDABLE["chained_optim_avoid_prefix"] is True
