"""--yaml-cfg reads Megatron-LM's YAML format as Megatron-LM 0.16.1 reads it: TransformerConfig
fields in the language_model / model_parallel sections and dests at the top level, null for
"not set", ${VAR} references to the environment in plain values, a key given at two levels
refused, and a setting the sections give under another name taken from the sections. Keys
that are no Megatron-LM setting stay errors; settings the driver refuses are refused by
name, with the file and line."""

from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver import megatron_lm_flags
from megatron.moe_patches.driver.arguments import build_parser, transformer_config_kwargs
from megatron.moe_patches.driver.recipes import read_recipe

pytestmark = pytest.mark.usefixtures("one_rank")

GPT_CONFIG = str(Path(__file__).resolve().parent / "fixtures" / "megatron_lm_gpt_config.yaml")


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.setenv("TRAIN_ITERS", "20")
    monkeypatch.setenv("CHECKPOINTS", "/scratch/ckpt")


def recipe(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_megatron_lm_config_file_parses_as_megatron_lm_reads_it(environment, parsed):
    args = parsed(["--yaml-cfg", GPT_CONFIG])
    assert {name: getattr(args, name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "num_experts", "swiglu", "ffn_hidden_size",
        "disable_bias_linear", "layernorm_epsilon", "layernorm_zero_centered_gamma", "num_query_groups",
        "moe_aux_loss_coeff", "moe_router_load_balancing_type", "train_iters", "save", "vocab_size", "lr",
        "lr_decay_style", "lr_decay_iters", "log_interval", "bf16", "kv_channels", "load",
    )} == dict(
        num_layers=4, hidden_size=256, num_attention_heads=8,
        num_experts=8,  # language_model's num_moe_experts, not the top level's num_experts: 4
        swiglu=True,  # activation_func: swiglu, over gated_linear_unit: False and the top level's swiglu: False
        ffn_hidden_size=640,  # null: Megatron-LM's SwiGLU default, int(4 * 256 * 2 / 3 / 64) * 64
        disable_bias_linear=True, layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True,
        num_query_groups=None,  # null: one group per head
        moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
        train_iters=20, save="/scratch/ckpt/gpt",  # ${TRAIN_ITERS}, ${CHECKPOINTS}
        vocab_size=4096,  # NullTokenizer, vocab_size 4095: ids 0 .. 4095
        lr=3e-4, lr_decay_style="cosine", lr_decay_iters=20,  # null: --train-iters
        log_interval=5, bf16=True, kv_channels=None, load=None,
    )
    kwargs = transformer_config_kwargs(args)
    assert kwargs["gated_linear_unit"] and kwargs["activation_func"] is torch.nn.functional.silu
    assert (kwargs["num_moe_experts"], kwargs["add_bias_linear"], kwargs["init_method_std"]) == (8, False, 0.01)


def test_the_command_line_overrides_the_file(environment, parsed):
    args = parsed(["--yaml-cfg", GPT_CONFIG, "--log-interval", "1", "--num-layers", "2"])
    assert (args.log_interval, args.num_layers) == (1, 2)


def test_environment_references_in_plain_values(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_ROOT", "/data")
    monkeypatch.setenv("RUN", "7")
    loaded = read_recipe(recipe(tmp_path, "save: ${DATA_ROOT}/runs/${RUN}\nload: '${DATA_ROOT}'\nseed: ${RUN}\n"),
                         build_parser())
    # Megatron-LM's reader expands plain values only, and gives strings (the flag's type reads them)
    assert dict(loaded) == {"save": "/data/runs/7", "load": "${DATA_ROOT}", "seed": "7"}


def test_an_unset_environment_variable_is_an_error(tmp_path, monkeypatch, refused):
    monkeypatch.delenv("TRAIN_ITERS", raising=False)
    monkeypatch.setenv("CHECKPOINTS", "/scratch/ckpt")
    line = next(number for number, text in enumerate(Path(GPT_CONFIG).read_text().splitlines(), 1)
                if text.startswith("train_iters:"))
    assert refused(["--yaml-cfg", GPT_CONFIG]) == (
        f"{GPT_CONFIG}:{line}: environment variable 'TRAIN_ITERS' is not set (the recipe reads ${{TRAIN_ITERS}})")


@pytest.mark.parametrize("text, message", [
    ("bf16: true\nmodel_parallel:\n  bf16: true\n",
     ":3: 'bf16' is set both at the top level (line 1) and in 'model_parallel'; Megatron-LM's YAML reader refuses "
     "that too: keep one"),
    ("language_model:\n  num_layers: 2\nmodel_parallel:\n  num_layers: 2\n",
     ":4: 'num_layers' is set both in 'language_model' (line 2) and in 'model_parallel'; Megatron-LM's YAML reader "
     "refuses that too: keep one"),
    ("language_model:\n  gated_linear_unit: true\n  activation_func: gelu\n",
     ":2: 'gated_linear_unit: true' with 'activation_func: gelu' is a gated GeLU, which this driver does not build: "
     "use activation_func swiglu, or gated_linear_unit false"),
    ("language_model:\n  activation_func: squaredrelu\n",
     ":2: 'activation_func' 'squaredrelu': this driver builds gelu or swiglu MLPs only"),
    ("language_model:\n  bias_activation_fusion: true\n",
     ":2: 'bias_activation_fusion' true: this driver builds the TransformerConfig with megatron-core's "
     "bias_activation_fusion=False (no flag sets it); leave it out"),
    ("model_parallel:\n  params_dtype: bfloat16\n",
     ":2: 'params_dtype' 'bfloat16': this driver builds the TransformerConfig with megatron-core's "
     "params_dtype=torch.float32 (no flag sets it); leave it out"),
    ("model_parallel:\n  pipeline_model_parallel_split_rank: 2\n",  # an older Megatron-LM's, gone by 0.16.1
     ":2: unknown key 'pipeline_model_parallel_split_rank' (no flag --pipeline-model-parallel-split-rank)"),
    ("log_learning_rate_to_tensorboard: true\n",
     ":1: unknown key 'log_learning_rate_to_tensorboard' (no flag --log-learning-rate-to-tensorboard)"),
    ("timers: null\n", ":1: unknown key 'timers' (no flag --timers)"),  # a config field: sections only
])
def test_what_megatron_lms_reader_refuses_or_the_driver_does_not_build(tmp_path, text, message, refused):
    path = recipe(tmp_path, text)
    assert refused(["--yaml-cfg", path]) == f"{path}{message}"


@pytest.mark.parametrize("text", [
    "swiglu: false\nlanguage_model:\n  gated_linear_unit: true\n",
    "language_model:\n  gated_linear_unit: true\nswiglu: false\n",
])
def test_the_sections_win_over_the_top_level_in_either_order(tmp_path, text):
    assert dict(read_recipe(recipe(tmp_path, text), build_parser())) == {"swiglu": True}


def test_activation_gelu_without_gating(tmp_path):
    text = "swiglu: true\nlanguage_model:\n  activation_func: gelu\n  gated_linear_unit: false\n"
    assert dict(read_recipe(recipe(tmp_path, text), build_parser())) == {"swiglu": False}


def test_config_fields_at_megatron_cores_defaults_are_accepted(tmp_path):
    text = "language_model:\n  num_layers: 2\n  persist_layer_norm: false\nmodel_parallel:\n  timers: null\n"
    assert dict(read_recipe(recipe(tmp_path, text), build_parser())) == {"num_layers": 2}


@pytest.mark.parametrize("key, value, flag, reason", [
    ("skip_train", "true", "--skip-train", megatron_lm_flags.EVALUATION),
    ("decrease_batch_size_if_needed", "true", "--decrease-batch-size-if-needed", megatron_lm_flags.BATCH_ROUNDING),
    ("dataloader_type", "cyclic", "--dataloader-type", megatron_lm_flags.DATA_LOADER),
])
def test_settings_the_driver_refuses_name_the_file_line_and_flag(tmp_path, environment, key, value, flag, reason,
                                                                 refused):
    text = Path(GPT_CONFIG).read_text().replace(f"\n{key}: ", f"\n{key}_was: ") + f"{key}: {value}\n"
    text = text.replace(f"\n{key}_was: ", "\n# was: ")
    path = recipe(tmp_path, text)
    line = len(text.splitlines())
    assert refused(["--yaml-cfg", path]) == f"{path}:{line}: '{key}' ({flag}): {reason}"


def test_refused_sections_settings_too(tmp_path, environment, refused):
    text = Path(GPT_CONFIG).read_text().replace("  tp_comm_overlap: False", "  tp_comm_overlap: True")
    path = recipe(tmp_path, text)
    line = next(number for number, row in enumerate(text.splitlines(), 1) if "tp_comm_overlap" in row)
    assert refused(["--yaml-cfg", path]) == (
        f"{path}:{line}: 'tp_comm_overlap' (--tp-comm-overlap): {megatron_lm_flags.TP_OVERLAP}")
