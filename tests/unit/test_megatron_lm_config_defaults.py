"""Megatron-LM's defaults that are megatron-core config fields reach the config (the fusions run
fused, the softmax precision, RoPE's share of channels, the NaN check), Megatron-LM's own
normalisations apply as there, settings that change nothing on the run are accepted (a note
where useful), and only what the driver cannot run is refused, with the reason. Each as a flag
and as a recipe key."""

import pytest
import torch

from megatron.moe_patches.driver import megatron_lm_flags, training
from megatron.moe_patches.driver.arguments import transformer_config_kwargs

from driver_model import REQUIRED

pytestmark = pytest.mark.usefixtures("one_rank")

# (flag, recipe key, config field) of Megatron-LM's fusion switches: fused by default, as there
FUSIONS = [
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", "masked_softmax_fusion", []),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias_dropout_fusion", []),
    ("--no-rope-fusion", "apply_rope_fusion", "apply_rope_fusion", ["--position-embedding-type", "rope"]),
    ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "bias_activation_fusion", ["--swiglu"]),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", "bias_activation_fusion", []),
]


def recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return ["--yaml-cfg", str(path)]


def config(parsed, argv):
    return transformer_config_kwargs(parsed([*REQUIRED, *argv]))


@pytest.mark.parametrize("flag, key, field, needs", FUSIONS, ids=[row[0] for row in FUSIONS])
def test_fusions_run_fused_by_default_and_the_flag_or_key_turns_them_off(flag, key, field, needs, parsed, tmp_path):
    assert config(parsed, needs)[field] is True  # Megatron-LM's default
    assert config(parsed, [*needs, flag])[field] is False
    assert config(parsed, [*needs, *recipe(tmp_path, f"{key}: false\n")])[field] is False
    assert config(parsed, [*needs, *recipe(tmp_path, f"{key}: true\n")])[field] is True  # Megatron-LM's YAML


def test_megatron_lms_yaml_sections_set_the_fusions(parsed, tmp_path):
    text = ("language_model:\n  bias_swiglu_fusion: true\n  masked_softmax_fusion: true\n  bias_dropout_fusion: true\n"
            "  apply_rope_fusion: true\n  attention_softmax_in_fp32: false\nposition_embedding_type: rope\n"
            "swiglu: true\n")
    kwargs = config(parsed, recipe(tmp_path, text))
    assert {name: kwargs[name] for name in ("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                                            "apply_rope_fusion", "attention_softmax_in_fp32")} == dict(
        bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
        attention_softmax_in_fp32=False)


def test_megatron_lms_normalisations_of_the_fusions(parsed):
    assert config(parsed, [])["apply_rope_fusion"] is False  # learned positions: no RoPE to fuse
    assert config(parsed, ["--disable-bias-linear"])["bias_activation_fusion"] is False  # no bias for GeLU
    assert config(parsed, ["--disable-bias-linear", "--swiglu"])["bias_activation_fusion"] is True  # SwiGLU keeps it
    assert config(parsed, ["--no-bias-swiglu-fusion"])["bias_activation_fusion"] is True  # GeLU reads its own switch


def test_attention_softmax_in_fp32_as_in_megatron_lm(parsed, tmp_path):
    assert config(parsed, [])["attention_softmax_in_fp32"] is False  # Megatron-LM's default, not megatron-core's
    assert config(parsed, ["--attention-softmax-in-fp32"])["attention_softmax_in_fp32"] is True
    assert config(parsed, recipe(tmp_path, "attention_softmax_in_fp32: true\n"))["attention_softmax_in_fp32"] is True


def test_rotary_percent_reaches_the_model(parsed, tmp_path, refused):
    assert parsed(REQUIRED).rotary_percent == 1.0
    assert parsed([*REQUIRED, "--position-embedding-type", "rope", "--rotary-percent", "0.5"]).rotary_percent == 0.5
    assert parsed([*REQUIRED, *recipe(tmp_path, "rotary_percent: 0.5\n")]).rotary_percent == 0.5
    assert refused([*REQUIRED, "--rotary-percent", "0"]) == "--rotary-percent 0.0: must be above 0 and at most 1"
    assert "rotary_percent=args.rotary_percent" in open(training.__file__).read()  # GPTModel's argument


def test_nan_check_on_by_default_and_off_with_the_flag_or_key(parsed, tmp_path):
    assert training.ddp_config_kwargs(parsed(REQUIRED))["check_for_nan_in_grad"] is True
    assert training.ddp_config_kwargs(parsed([*REQUIRED, "--no-check-for-nan-in-loss-and-grad"]))[
        "check_for_nan_in_grad"] is False
    args = parsed([*REQUIRED, *recipe(tmp_path, "check_for_nan_in_loss_and_grad: false\n")])
    assert args.check_for_nan_in_loss_and_grad is False


def test_the_loss_check_stops_on_nan_and_inf():
    training.check_loss_finite(torch.tensor(2.5))
    for value, what in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        with pytest.raises(RuntimeError, match=f"found {what} in local forward loss calculation"):
            training.check_loss_finite(torch.tensor(value))


def test_sequence_parallel_at_tp_1_is_switched_off_as_megatron_lm_does(parsed, capsys, tmp_path):
    for argv in (["--sequence-parallel"], recipe(tmp_path, "model_parallel:\n  sequence_parallel: true\n")):
        assert parsed([*REQUIRED, *argv]).sequence_parallel is False
        assert "Disabling sequence parallelism because tensor model parallelism is disabled" in capsys.readouterr().err


@pytest.mark.parametrize("text", [
    "model_parallel:\n  tp_comm_atomic_ag: true\n  tp_comm_atomic_rs: true\nnum_layers: 2\n",  # no flag sets them
    "accumulate_allreduce_grads_in_fp32: false\n",  # Megatron-LM forces it on with bf16
    "wandb_project: ''\nwandb_exp_name: ''\nwandb_save_dir: ''\nwandb_entity: ''\n",  # '': no W&B
    "wandb_exp_name: run\n",  # without a project Megatron-LM starts no W&B
    "num_workers: 2\n",
    # TensorBoard switches without --tensorboard-dir: nothing is written
    "log_timers_to_tensorboard: false\nlog_memory_to_tensorboard: false\nlog_loss_scale_to_tensorboard: true\n"
    "log_validation_ppl_to_tensorboard: true\nlog_world_size_to_tensorboard: true\ntensorboard_log_interval: 1\n"
    "tensorboard_queue_size: 10\n",
])
def test_settings_that_change_nothing_on_the_run_are_accepted(text, parsed, tmp_path):
    args = parsed([*REQUIRED, "--num-layers", "2", *recipe(tmp_path, text)])
    for name in ("wandb_project", "num_workers", "accumulate_allreduce_grads_in_fp32", "log_timers_to_tensorboard"):
        assert not hasattr(args, name)  # taken out of the args, as the refused flags are


def test_flags_that_change_nothing_are_accepted_with_a_note(parsed, capsys):
    parsed([*REQUIRED, "--num-workers", "8", "--wandb-project", "", "--wandb-exp-name", "run"])
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: warning: --num-workers 8: changes nothing here: {megatron_lm_flags.NO_WORKERS}"]
    parsed([*REQUIRED, "--num-workers", "0", "--accumulate-allreduce-grads-in-fp32"])  # what the driver does
    assert capsys.readouterr().err == ""


def test_tensorboard_switches_are_judged_with_a_tensorboard_folder(refused, tmp_path):
    argv = [*REQUIRED, "--tensorboard-dir", str(tmp_path / "tb"), *recipe(tmp_path, "log_memory_to_tensorboard: false\n")]
    assert refused(argv) == (f"{tmp_path / 'recipe.yaml'}:1: 'log_memory_to_tensorboard' (--log-memory-to-tensorboard): "
                             f"{megatron_lm_flags.ALWAYS_LOGGED}")


def test_wandb_is_still_refused_where_it_would_log(refused):
    assert refused([*REQUIRED, "--wandb-project", "p"]) == f"--wandb-project: {megatron_lm_flags.WANDB}"
    assert refused([*REQUIRED, "--wandb-exp-name", "run", "--wandb-project", "p"]) == (
        f"--wandb-exp-name: {megatron_lm_flags.WANDB}")


def test_log_throughput_false_leaves_the_throughput_out(parsed, tmp_path, monkeypatch):
    """The driver logs it by default; a recipe's false leaves it out of the log line and the
    TensorBoard scalars, as Megatron-LM does without --log-throughput."""
    monkeypatch.setattr(training, "model_flops_per_token", lambda args: 1e9)
    for argv, logged in (([], True), (["--log-throughput"], True),
                         (recipe(tmp_path, "log_throughput: false\n"), False)):
        args = parsed([*REQUIRED, *argv])
        assert args.log_throughput is logged
        metrics = training.iteration_metrics(args, 1, {"iteration": 0.5}, 1e-3, 2.5, 0.75, 1, 0, 0)
        line = training._log_line(args, 1, metrics, 0.0)
        assert ({"throughput", "tokens-per-sec"} <= set(metrics)) is logged
        assert ("throughput per GPU (TFLOP/s/GPU)" in line and "tokens/s" in line) is logged, line


@pytest.mark.parametrize("extra, fix", [
    ([], "add --no-bias-dropout-fusion or --disable-bias-linear"),
    (["--no-bias-dropout-fusion"], "add --no-bias-gelu-fusion, --swiglu or --disable-bias-linear"),
])
def test_grouped_te_experts_refuse_the_fusions_megatron_core_refuses_with_the_fix(extra, fix, refused):
    argv = [*REQUIRED, "--num-experts", "4", "--moe-grouped-gemm", *extra]
    assert refused(argv).endswith(fix)


def test_grouped_te_experts_run_the_fusions_megatron_core_runs(parsed):
    moe = ["--num-experts", "4", "--moe-grouped-gemm"]
    for argv in (["--disable-bias-linear"], ["--swiglu", "--no-bias-dropout-fusion"]):
        assert parsed([*REQUIRED, *moe, *argv]).bias_dropout_fusion is ("--no-bias-dropout-fusion" not in argv)


def test_every_no_effect_row_says_why():
    for row in megatron_lm_flags.no_effect_flags():
        assert row.refused is None and row.no_effect, row.name
    assert all(isinstance(why, str) and why for why in megatron_lm_flags.NO_EFFECT_FIELDS.values())
