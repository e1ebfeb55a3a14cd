"""pretrain_gpt.py validates everything before any CUDA or NCCL work (issue 18): flag
ranges, parallel sizes against WORLD_SIZE, and the full (patched) TransformerConfig.
Every refusal is ``pretrain_gpt.py: error: ...`` on stderr with exit status 2."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches import preflight
from megatron.moe_patches.driver import arguments, config_refusals
from megatron.moe_patches.driver.arguments import driver_request, parse_args, transformer_config_kwargs

from driver_model import REQUIRED, RUN

pytestmark = pytest.mark.usefixtures("one_rank")

ROOT = Path(__file__).resolve().parents[2]
ERROR = "pretrain_gpt.py: error: "
# The tiny MoE of the shipped recipe, as flags (no fused permute: that asks TE on CPU).
MOE_MODEL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4",
             "--swiglu", "--disable-bias-linear", "--num-experts", "8", "--moe-ffn-hidden-size", "512",
             "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--bf16"]
MOE = [*RUN, *MOE_MODEL]


def validate_config(args, te_available=None):
    """The preflight's judgement of the driver's args (a refusal raised); the fields whose
    megatron-core checks wait for setup()."""
    verdict = preflight.judge(driver_request(args, te_available=te_available))
    if verdict.refusals:
        raise ValueError("\n".join(verdict.refusals))
    return list(verdict.deferred)


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be at least 1"),
    (["--num-layers", "0"], "--num-layers 0: must be at least 1"),
    (["--hidden-size", "-8"], "--hidden-size -8: must be at least 1"),
    (["--train-iters", "0"], "--train-iters 0: must be at least 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0: must be at least 1"),
    (["--log-interval", "0"], "--log-interval 0: must be at least 1"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0: must be at least 1"),
    (["--num-experts", "0"], "--num-experts 0: must be at least 1"),
    (["--num-experts", "8", "--moe-router-topk", "0"], "--moe-router-topk 0: must be at least 1"),
    (["--lr", "-0.1"], "--lr -0.1: must not be negative"),
    (["--lr", "nan"], "--lr nan: must be a finite number"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout 1.0: must be at least 0 and below 1"),
    (["--adam-eps", "0"], "--adam-eps 0.0: must be above 0"),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 is above --lr 0.01"),
    (["--micro-batch-size", "4", "--global-batch-size", "6"],
     "--global-batch-size 6 must be a multiple of --micro-batch-size x data-parallel size = 4"),
    (["--hidden-size", "100", "--num-attention-heads", "8"],
     "--hidden-size 100 must be divisible by --num-attention-heads 8 (or set --kv-channels)"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 must divide --num-attention-heads 8"),
    (["--seq-length", "1024", "--max-position-embeddings", "512"],
     "--max-position-embeddings 512 is below --seq-length 1024: raise it"),
    (["--seq-length", "1024", "--max-position-embeddings", "512", "--position-embedding-type", "rope"],
     "--max-position-embeddings 512 is below --seq-length 1024: raise it"),  # Megatron-LM's rule for RoPE too
    (["--num-query-groups", "4"], "--num-query-groups 4 takes effect only with --group-query-attention (as in "
     "Megatron-LM): add it, or drop --num-query-groups"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
     "--lr-warmup-fraction and --lr-warmup-iters both set the warmup: give one"),
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe needs --fp8-format"),
    (["--moe-router-topk", "4"], "--moe-router-topk needs --num-experts"),
    (["--num-experts", "8", "--moe-token-drop-policy", "position"],
     "--moe-token-drop-policy needs --moe-expert-capacity-factor"),
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity"),
    (["--fp32-residual-connection"], "--fp32-residual-connection needs --bf16"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size > 1 needs --num-experts (an MoE model)"),
    (["--moe-ffn-hidden-size", "64"], "--moe-ffn-hidden-size needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 exceeds --num-experts 4"),
    (["--num-experts", "4", "--moe-router-padding-for-quantization", "--moe-token-dispatcher-type", "alltoall"],
     "--moe-router-padding-for-quantization needs --fp8-format (it pads for FP8 GEMMs)"),
])
def test_bad_flags_are_refused_before_start_up(argv, message, refused):
    assert refused([*REQUIRED, *argv]) == message


@pytest.mark.parametrize("argv, note", [
    (["--save-interval", "10"], "--save-interval 10: changes nothing without --save, as in Megatron-LM: drop it, or give "
     "--save"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint True: changes nothing without --load, as in "
     "Megatron-LM: drop it, or give --load"),
])
def test_settings_megatron_lm_reads_only_with_another_are_noted_without_it(argv, note, parsed, capsys):
    args = parsed([*REQUIRED, *argv])
    assert f"pretrain_gpt.py: warning: {note}" in capsys.readouterr().err.splitlines()
    assert args.save is None and args.load is None


def test_megatron_lm_required_flags_are_required(refused):
    assert refused([]) == (
        "--num-layers, --hidden-size, --num-attention-heads, --seq-length, --max-position-embeddings, --vocab-size, "
        "--micro-batch-size, --train-iters or --train-samples, --lr: required (Megatron-LM has no default for them); give them on the "
        "command line or in the --yaml-cfg recipe")
    assert refused(REQUIRED[2:]) == ("--num-layers: required (Megatron-LM has no default for it); give it on the "
                                     "command line or in the --yaml-cfg recipe")


@pytest.mark.parametrize("world, argv, message", [
    (1, ["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 must be divisible by --expert-model-parallel-size 4 (each expert-parallel rank holds "
     "the same number of experts): choose an EP size that divides the number of experts"),
    (4, ["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 must be divisible by --expert-model-parallel-size 4 (each expert-parallel rank holds "
     "the same number of experts): choose an EP size that divides the number of experts"),
    (1, ["--num-experts", "8", "--expert-model-parallel-size", "4"],
     "--expert-tensor-parallel-size 1 (the TP size by default) x --expert-model-parallel-size 4 x "
     "--pipeline-model-parallel-size 1 = 4 ranks, more than the world size 1 (WORLD_SIZE, the ranks "
     "launched): launch at least 4 ranks or lower the sizes"),
    (6, ["--num-experts", "8", "--expert-model-parallel-size", "4"],
     "--expert-tensor-parallel-size 1 (the TP size by default) x --expert-model-parallel-size 4 x "
     "--pipeline-model-parallel-size 1 = 4 does not divide the world size 6 (WORLD_SIZE, the ranks "
     "launched): launch a multiple of 4 ranks or change the sizes"),
    (1, ["--num-experts", "8", "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 1 x --pipeline-model-parallel-size 1 = 2 "
     "ranks, more than the world size 1 (WORLD_SIZE, the ranks launched): launch at least 2 ranks or lower the sizes"),
    (1, ["--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 2 ranks, more than the world size 1 "
     "(WORLD_SIZE, the ranks launched): launch at least 2 ranks or lower the sizes"),
    (3, ["--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 2 does not divide the world size 3 "
     "(WORLD_SIZE, the ranks launched): launch a multiple of 2 ranks or change the sizes"),
    (3, ["--tensor-model-parallel-size", "3", "--sequence-parallel"],
     "--num-attention-heads 8 must be divisible by --tensor-model-parallel-size 3"),
    (4, ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size > 1 with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (2, ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-model-parallel-size", "2"],  # ETP defaults to the TP size, as in megatron-core
     "--expert-tensor-parallel-size 2 (the TP size by default) x --expert-model-parallel-size 2 x "
     "--pipeline-model-parallel-size 1 = 4 ranks, more than the world size 2 (WORLD_SIZE, the ranks launched): "
     "launch at least 4 ranks or lower the sizes"),
    (2, ["--micro-batch-size", "2", "--global-batch-size", "6"],
     "--global-batch-size 6 must be a multiple of --micro-batch-size x data-parallel size = 4"),
])
def test_parallel_sizes_are_checked_against_world_size(world, argv, message, capsys, monkeypatch, refused):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert refused([*REQUIRED, *argv]) == message


def test_parallel_sizes_that_fit_the_world_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args([*MOE, "--expert-model-parallel-size", "4", "--micro-batch-size", "2"])
    assert args.data_parallel_size == 8 and args.global_batch_size == 16


def test_bad_world_size_variable(capsys, monkeypatch, refused):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert refused(REQUIRED) == "WORLD_SIZE='abc' (set by the launcher) is not a positive integer"


def test_patch_checks_run_before_start_up(capsys, refused):
    assert refused([*MOE, "--moe-mlp-glu-interleave-size", "48"]) == (
        "Invalid MoE patch configuration: moe_mlp_glu_interleave_size=48 must divide the per-partition MoE FFN "
        "size 512 (moe_ffn_hidden_size=512 / expert_tensor_parallel_size=1); choose a divisor of it. "
        "[--moe-mlp-glu-interleave-size, --moe-ffn-hidden-size, --expert-tensor-parallel-size]")
    assert refused([*MOE, "--moe-hybridep-num-blocks-permute", "0"]) == (
        "Invalid MoE patch configuration: moe_hybridep_num_blocks_permute=0 must be a positive integer, or None "
        "to let HybridEP choose. [--moe-hybridep-num-blocks-permute]")
    assert refused([*REQUIRED, "--num-experts", "8", "--moe-single-grouped-weight"]).startswith(
        "Invalid MoE patch configuration: moe_single_grouped_weight=True needs TE grouped experts")


def test_several_patch_problems_one_per_line(capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOE, "--moe-hybridep-num-blocks-permute", "0", "--moe-hybridep-num-blocks-unpermute", "0"])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(ERROR + "Invalid MoE patch configuration: moe_hybridep_num_blocks_permute=0")
    assert lines[1].startswith("  - moe_hybridep_num_blocks_unpermute=0 must be a positive integer")


def test_patch_message_wins_over_megatron_core_asserts(capsys, monkeypatch, refused):
    """Op fuser with ETP 2 and expert biases: megatron-core's own bare assert ("Bias in Moe
    is only supported when ETP==1") fires first at construction; the patch set's message is
    the one reported."""
    argv = [*REQUIRED, "--num-experts", "8", "--moe-grouped-gemm", "--swiglu", "--use-transformer-engine-op-fuser",
            "--expert-tensor-parallel-size", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = transformer_config_kwargs(parser_only(argv))
    with pytest.raises(AssertionError):  # what surfaced before
        PatchedTransformerConfig(**kwargs)
    assert refused(argv) == (
        "Invalid MoE patch configuration: use_transformer_engine_op_fuser=True does not support expert tensor "
        "parallelism: expert_tensor_parallel_size=2; set --expert-tensor-parallel-size 1 or drop "
        "--use-transformer-engine-op-fuser.")


def parser_only(argv):
    """Parsed flags with derived defaults, none of parse_args' refusals."""
    args = arguments.build_parser().parse_args(argv)
    arguments.apply_megatron_lm_rules(args)
    args.ffn_hidden_size = args.ffn_hidden_size or arguments.megatron_lm_ffn_hidden_size(args)
    return args


def test_megatron_core_refusals_are_reported_with_their_flags(capsys, refused):
    assert refused([*MOE, "--moe-router-topk", "1"]) == (
        "megatron-core's TransformerConfig refuses these arguments: Please use --moe-router-pre-softmax "
        "when topk is 1.")
    assert config_refusals.config_error_message(ValueError(
        "num_attention_heads (8) must be a multiple of tensor_model_parallel_size (3).")) == (
        "megatron-core's TransformerConfig refuses these arguments: num_attention_heads (8) must be a multiple "
        "of tensor_model_parallel_size (3). [--num-attention-heads, --tensor-model-parallel-size]")
    assert config_refusals.config_error_message(AssertionError()) == (
        "megatron-core's TransformerConfig refuses these arguments: AssertionError without a message")


def test_te_probing_checks_are_left_to_setup_only_without_te(capsys, refused):
    """Without TE, megatron-core refuses moe_permute_fusion and MoE FP8 for any value (it
    asks TE itself): those checks wait for setup() on the GPU machine. The patch set's
    checks still see the real values."""
    args = parse_args([*MOE, "--moe-permute-fusion", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"])
    kwargs = transformer_config_kwargs(args)
    with pytest.raises((ValueError, TypeError, ImportError)):  # TE is absent on this CPU machine
        PatchedTransformerConfig(**kwargs)
    assert validate_config(args, te_available=False) == ["moe_permute_fusion", "fp8", "fp8_recipe"]
    assert validate_config(parse_args(MOE), te_available=False) == []
    # Where TE is importable nothing is set aside: pretending so here, megatron-core's probe
    # for the fused permute kernels fails, and that is reported as a refusal.
    with pytest.raises(ValueError, match="refuses these arguments: cannot import name 'fused_permute'"):
        validate_config(parse_args([*MOE, "--moe-permute-fusion"]), te_available=True)
    # The deferred fields still reach the patch set's checks (the grouped_mm backend is bf16-only).
    assert refused([*MOE, "--moe-device-tokens-per-expert", "--moe-single-grouped-weight", "--fp8-format", "e4m3"],
                   ).startswith("Invalid MoE patch configuration: moe_single_grouped_weight=True needs an "
                                      "expert backend that holds grouped parameters")
    assert set(preflight.TE_PROBED_FIELDS) == {"moe_permute_fusion", "fp8", "fp8_recipe",
                                               "moe_router_padding_for_quantization", "apply_rope_fusion"}


def test_fp8_wgrad_flag_maps_into_the_config():
    fp8 = [*MOE, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    assert transformer_config_kwargs(parse_args(fp8))["fp8_wgrad"] is True  # megatron-core's default
    assert transformer_config_kwargs(parse_args([*fp8, "--no-fp8-wgrad"]))["fp8_wgrad"] is False
    assert "fp8_wgrad" not in transformer_config_kwargs(parse_args(MOE))  # no FP8: not set


def test_fp8_settings_without_fp8_are_refused(refused):
    assert refused([*MOE, "--no-fp8-wgrad"]) == "--no-fp8-wgrad needs --fp8-format"  # would change nothing


def test_grouped_mm_single_grouped_weight_validates_on_cpu():
    args = parse_args([*MOE, "--moe-device-tokens-per-expert", "--moe-single-grouped-weight"])
    assert validate_config(args, te_available=False) == []


def test_router_fields_map_into_the_config():
    args = parse_args([*MOE, "--moe-router-topk", "3", "--moe-router-load-balancing-type", "seq_aux_loss",
                       "--moe-aux-loss-coeff", "0.25", "--moe-router-pre-softmax", "--fp8-format", "e4m3",
                       "--moe-router-padding-for-quantization", "--moe-shared-expert-intermediate-size", "384"])
    kwargs = transformer_config_kwargs(args)
    router = {k: kwargs[k] for k in ("moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                                     "moe_router_pre_softmax", "moe_router_padding_for_quantization",
                                     "moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
                                     "moe_shared_expert_intermediate_size", "num_moe_experts",
                                     "moe_ffn_hidden_size", "moe_grouped_gemm", "moe_permute_fusion")}
    assert router == dict(moe_router_topk=3, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.25,
                          moe_router_pre_softmax=True, moe_router_padding_for_quantization=True,
                          moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend="deepep",
                          moe_shared_expert_intermediate_size=384, num_moe_experts=8, moe_ffn_hidden_size=512,
                          moe_grouped_gemm=True, moe_permute_fusion=False)
    for name in preflight.TE_PROBED_FIELDS:
        kwargs.pop(name, None)
    config = PatchedTransformerConfig(**kwargs)
    assert (config.moe_router_topk, config.moe_router_load_balancing_type, config.moe_aux_loss_coeff,
            config.moe_router_pre_softmax) == (3, "seq_aux_loss", 0.25, True)
    flex = transformer_config_kwargs(parse_args([*MOE[:-2], "flex", "--bf16", "--moe-flex-dispatcher-backend",
                                                 "hybridep", "--moe-router-load-balancing-type", "none"]))
    assert (flex["moe_token_dispatcher_type"], flex["moe_flex_dispatcher_backend"],
            flex["moe_router_load_balancing_type"], flex["moe_router_pre_softmax"],
            flex["moe_router_topk"]) == ("flex", "hybridep", "none", False, 2)
    defaults = transformer_config_kwargs(parse_args(MOE))
    assert (defaults["moe_router_load_balancing_type"], defaults["moe_aux_loss_coeff"],
            defaults["moe_router_padding_for_quantization"]) == ("aux_loss", 0.0, False)


def test_moe_ffn_defaults_to_ffn_and_dense_models_have_no_router():
    kwargs = transformer_config_kwargs(parse_args([*RUN, *MOE_MODEL[:12], *MOE_MODEL[14:]]))  # no --moe-ffn-hidden-size
    assert kwargs["moe_ffn_hidden_size"] == 1024
    assert not any(k.startswith("moe_router") for k in transformer_config_kwargs(parse_args(REQUIRED)))


class _FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _scheduler(argv, monkeypatch):
    """training.build_optimizer's LR schedule for these flags (megatron-core's scheduler)."""
    import megatron.core.optimizer as optimizer_module

    from megatron.moe_patches.driver import training

    monkeypatch.setattr(optimizer_module, "get_megatron_optimizer", lambda config, models: _FakeOptimizer())
    args = argparse.Namespace(**vars(parser_only(argv)))
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    args.global_batch_size = args.global_batch_size or args.micro_batch_size
    return training.build_optimizer(args, None)[1]


def test_warmup_equal_to_decay_is_refused_like_megatron_cores_scheduler(capsys, monkeypatch, refused):
    """megatron-core's scheduler needs warmup < decay: warmup == decay is refused before
    start-up, warmup == decay - 1 starts."""
    argv = [*REQUIRED, "--train-iters", "10", "--lr-warmup-iters", "10", "--global-batch-size", "4"]
    assert refused(argv) == (
        "--lr-warmup-iters 10 must be below --lr-decay-iters 10 (which defaults to --train-iters): shorten the "
        "warmup or set --lr-decay-iters")
    with pytest.raises(AssertionError):
        _scheduler(argv, monkeypatch)
    assert refused([*REQUIRED, "--lr-decay-iters", "6", "--lr-warmup-iters", "6"]).startswith(
        "--lr-warmup-iters 6 must be below --lr-decay-iters 6")
    below = [*REQUIRED, "--train-iters", "10", "--lr-warmup-iters", "9", "--global-batch-size", "4"]
    assert parse_args(below).lr_decay_iters == 10
    scheduler = _scheduler(below, monkeypatch)
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps) == (9 * 4, 10 * 4)
    assert parse_args([*REQUIRED, "--train-iters", "10", "--lr-warmup-iters", "10",
                       "--lr-decay-iters", "11"]).lr_decay_iters == 11


def run_pretrain(*argv, env=None):
    import os

    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, env=full_env)


def test_pretrain_gpt_exits_2_with_one_line_and_no_traceback():
    run = run_pretrain(*REQUIRED, "--micro-batch-size", "0")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [ERROR + "--micro-batch-size 0: must be at least 1"]
    run = run_pretrain(*REQUIRED, "--num-experts", "8", "--moe-single-grouped-weight")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[0].startswith(ERROR + "Invalid MoE patch configuration: moe_single_grouped_weight")
    run = run_pretrain("--num-layerz", "2")  # argparse's own errors: one line too
    assert run.returncode == 2 and run.stderr.splitlines() == [ERROR + "unrecognized arguments: --num-layerz 2"]
