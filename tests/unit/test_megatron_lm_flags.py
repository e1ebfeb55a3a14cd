"""pretrain_gpt.py takes Megatron-LM 0.16.1's flags (the table driver/megatron_lm_flags.jsonl,
read by driver/megatron_lm_flags.py): every one is accepted under Megatron-LM's name with
Megatron-LM's default, or refused by name with the reason (one line, exit status 2, before
start-up); flags Megatron-LM does not have stay argparse errors. With MEGATRON_LM_PATH set, the table is checked against Megatron-LM's own
parser as well."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from megatron.core.transformer.enums import AttnBackend

from megatron.moe_patches.driver import arguments, megatron_lm_flags, recipes
from megatron.moe_patches.driver.arguments import build_parser, transformer_config_kwargs
from megatron.moe_patches.driver.megatron_lm_flags import BY_NAME, FLAGS, NOT_OFFERED, refused_flags, supported_flags
from megatron.moe_patches.driver.recipes import FIELD_ALIASES

from driver_model import REQUIRED, indexed_dataset
from megatron_lm_on_cpu import SUBPROCESS_PREAMBLE

pytestmark = pytest.mark.usefixtures("one_rank")

ROOT = Path(__file__).resolve().parents[2]

# Megatron-LM core_v0.16.1's defaults of some flags launch scripts pass, written down from its
# megatron/training/arguments.py (flag -> (dest, default)).
MEGATRON_LM_DEFAULTS = {
    "--num-layers": ("num_layers", None),
    "--hidden-size": ("hidden_size", None),
    "--num-attention-heads": ("num_attention_heads", None),
    "--group-query-attention": ("group_query_attention", False),
    "--num-query-groups": ("num_query_groups", 1),
    "--seq-length": ("seq_length", None),
    "--max-position-embeddings": ("max_position_embeddings", None),
    "--position-embedding-type": ("position_embedding_type", "learned_absolute"),
    "--rotary-base": ("rotary_base", 10000),
    "--normalization": ("normalization", "LayerNorm"),
    "--norm-epsilon": ("layernorm_epsilon", 1e-5),
    "--disable-bias-linear": ("add_bias_linear", True),
    "--hidden-dropout": ("hidden_dropout", 0.1),
    "--attention-dropout": ("attention_dropout", 0.1),
    "--init-method-std": ("init_method_std", 0.02),
    "--transformer-impl": ("transformer_impl", "transformer_engine"),
    "--attention-backend": ("attention_backend", AttnBackend.auto),
    "--fp8-format": ("fp8", None),
    "--fp8-recipe": ("fp8_recipe", "delayed"),
    "--num-experts": ("num_experts", None),
    "--moe-router-topk": ("moe_router_topk", 2),
    "--moe-router-load-balancing-type": ("moe_router_load_balancing_type", "aux_loss"),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", 0.0),
    "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", "allgather"),
    "--cuda-graph-scope": ("cuda_graph_scope", []),
    "--micro-batch-size": ("micro_batch_size", None),
    "--global-batch-size": ("global_batch_size", None),
    "--train-iters": ("train_iters", None),
    "--lr": ("lr", None),
    "--min-lr": ("min_lr", 0.0),
    "--lr-decay-style": ("lr_decay_style", "linear"),
    "--lr-warmup-iters": ("lr_warmup_iters", 0),
    "--weight-decay": ("weight_decay", 0.01),
    "--adam-beta2": ("adam_beta2", 0.999),
    "--clip-grad": ("clip_grad", 1.0),
    "--seed": ("seed", 1234),
    "--split": ("split", None),
    "--vocab-size": ("vocab_size", None),
    "--tokenizer-type": ("tokenizer_type", None),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", 128),
    "--log-interval": ("log_interval", 100),
    "--eval-iters": ("eval_iters", 100),
    "--eval-interval": ("eval_interval", None),
    "--num-workers": ("num_workers", 2),
    "--no-load-optim": ("no_load_optim", None),
    "--no-rope-fusion": ("apply_rope_fusion", True),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", True),
    "--distributed-timeout-minutes": ("distributed_timeout_minutes", 10),
    "--ckpt-format": ("ckpt_format", "torch_dist"),
    "--optimizer": ("optimizer", "adam"),
}

# Where this driver runs otherwise than Megatron-LM's default: the flag that asks for the
# driver's behaviour is accepted, Megatron-LM's default (in a recipe) is refused.
RUNS_OTHERWISE = {
    "--no-persist-layer-norm": True,
    "--no-ckpt-fully-parallel-save": False, "--no-save-rng": True, "--no-load-rng": True,
    "--no-overlap-p2p-communication": False,
    "--no-create-attention-mask-in-dataloader": False, "--log-timers-to-tensorboard": True,
    "--no-log-loss-scale-to-tensorboard": False, "--log-memory-to-tensorboard": True,
    "--rerun-mode": "disabled", "--disable-msc": False,
}


def _driver_default(parser, mlm_dest):
    """The default of the driver's flag for Megatron-LM's dest, as Megatron-LM would hold it."""
    dest, transform = FIELD_ALIASES.get(mlm_dest, (mlm_dest, None))
    default = parser.get_default(dest)
    return transform(default) if transform else default


# --- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", MEGATRON_LM_DEFAULTS)
def test_megatron_lm_defaults_as_written_in_its_source(flag):
    row = BY_NAME[flag]
    assert (row.dest, row.megatron_lm_default) == MEGATRON_LM_DEFAULTS[flag]


@pytest.mark.parametrize("flag", [name for name in MEGATRON_LM_DEFAULTS if BY_NAME[name] in supported_flags()])
def test_supported_flags_parse_to_megatron_lm_defaults(flag):
    dest, default = MEGATRON_LM_DEFAULTS[flag]
    assert _driver_default(build_parser(), dest) == default


def test_every_supported_flag_is_the_drivers_own_with_megatron_lm_default():
    """Or with the row's ``runs_as``, where this driver's default differs (--log-throughput only)."""
    parser = build_parser()
    actions = parser._option_string_actions
    for row in supported_flags():
        action = actions[row.name]
        assert [actions[name] for name in row.names] == [action] * len(row.names), row.name
        assert action.help != argparse.SUPPRESS, row.name  # the driver's own, documented in --help
        assert action.nargs == row.nargs or row.action != "store", row.name
        assert _driver_default(parser, row.dest) == row.accepted, row.name
    assert [row.name for row in supported_flags() if row.accepted != row.megatron_lm_default] == ["--log-throughput"]


def test_the_table_file_reads_back_megatron_lms_special_values():
    """megatron_lm_flags.jsonl's special values, as Megatron-LM 0.16.1 has them."""
    import signal

    assert BY_NAME["--exit-signal"].default is signal.SIGTERM
    assert BY_NAME["--local-rank"].runs_as == megatron_lm_flags.FromEnv("LOCAL_RANK", 0)
    assert BY_NAME["--tensorboard-log-interval"].runs_as is NOT_OFFERED
    assert list(BY_NAME["--timing-log-level"].refused_values) == [2]  # a number, as argparse gives it
    assert BY_NAME["--no-load-optim"].default is None and BY_NAME["--no-load-optim"].action == "store_true"
    assert BY_NAME["--disable-bias-linear"].default is True and BY_NAME["--disable-bias-linear"].dest == "add_bias_linear"
    assert BY_NAME["--norm-epsilon"].type is float and BY_NAME["--fp16"].refused == megatron_lm_flags.FP16


@pytest.mark.parametrize("row, error", [
    ('{"flag": "--x", "refused": "NO_SUCH_REASON"}', "no reason named NO_SUCH_REASON"),
    ('{"flag": "--x", "refused": "_Marker"}', "no reason named _Marker"),
    ('{"flag": "--x", "refuse": "FP16"}', "unknown fields ['refuse']"),
    ('{"flag": "--x", "type": "complex"}', "complex"),
    ('{"flag": "--x", "default": {"env": "RANK"}}', "unknown special value"),
    ('{"flag": "--x"', "Expecting"),
    ('["--x"]', "a row is a JSON object"),
    ('{"flag": "--x", "aliases": "--y"}', "aliases: a list each"),
    ('{"flag": "--x", "type": "str", "refused_values": ["a"]}', "refused_values: an object"),
    ('{"flag": "--x", "action": "store_ture"}', "action 'store_ture'"),
    ('{"flag": "--x", "action": "boolean_optional"}', "boolean_optional with a default"),
])
def test_a_bad_row_of_the_table_file_is_an_error_naming_its_line(tmp_path, row, error):
    table = tmp_path / "flags.jsonl"
    table.write_text('{"flag": "--fine", "type": "int", "default": 1}\n' + row + "\n")
    with pytest.raises(ValueError) as raised:
        megatron_lm_flags._read_table(str(table))
    assert str(raised.value).startswith(f"{table}:2: ") and error in str(raised.value)


def test_the_flags_are_megatron_lms_only_once_each():
    names = [name for row in FLAGS for name in row.names]
    assert len(names) == len(set(names)) == len(BY_NAME)
    assert all(row.refused is None or not row.refused_values for row in FLAGS)
    for dest in {row.dest for row in FLAGS}:  # rows sharing a dest run with one value
        assert len({repr(row.accepted) for row in FLAGS if row.dest == dest and row.refused}) <= 1, dest


def _asking_argv(row):
    """The row's flag given as a launch script would give it, asking for something."""
    if row.action != "store":
        return [row.name]
    accepted = row.accepted
    if row.type is int:
        value = str(accepted + 1) if isinstance(accepted, int) else "7"
    elif row.type is float:
        value = "0.25" if accepted != 0.25 else "0.5"
    elif row.type is megatron_lm_flags.signal_by_name:
        value = "SIGINT"
    else:
        value = "something-else"
    count = row.nargs if isinstance(row.nargs, int) else 1
    return [row.name, *[value] * count]


# The setting that makes an ``only_with`` row's flag count: given after the row's flag.
ONLY_WITH_ARGV = {"tensorboard_dir": ["--tensorboard-dir", "/tmp/tb"], "wandb_project": ["--wandb-project", "p"],
                  "overlap_param_gather": ["--overlap-param-gather"]}


@pytest.mark.parametrize("row", refused_flags(), ids=lambda row: row.name)
def test_each_refused_flag_is_refused_by_name_with_the_reason(row, refused, parsed):
    argv = _asking_argv(row)
    parser = build_parser()
    value = parser.parse_args([*REQUIRED, *argv]).__dict__[row.dest]
    context = ONLY_WITH_ARGV[row.only_with] if row.only_with else []
    if row.accepted is not NOT_OFFERED and value == row.accepted:  # asks for what the driver does
        assert row.dest not in vars(parsed([*REQUIRED, *argv]))
    else:
        assert refused([*REQUIRED, *argv, *context]) == f"{row.name}: {row.refused}"
        if row.only_with:  # without that setting Megatron-LM reads no value of it: accepted
            assert row.dest not in vars(parsed([*REQUIRED, *argv]))
    for alias in row.names[1:]:
        if row.action != "boolean_optional" and value != row.accepted:
            assert refused([*REQUIRED, alias, *argv[1:], *context]) == f"{alias}: {row.refused}"


def test_refused_flags_at_the_value_the_driver_runs_with_are_accepted(parsed):
    accepted = [[row.name, getattr(row.accepted, "name", str(row.accepted))] for row in refused_flags()
                if row.action == "store" and isinstance(row.accepted, (int, float, str)) and row.nargs is None]
    args = parsed([*REQUIRED, *(token for pair in accepted for token in pair)])
    assert accepted and not {row.dest for row in refused_flags()} & set(vars(args))  # kept out of the args


def _namespace_default(dest):
    """Megatron-LM's value for ``dest`` when no flag sets it: the first of its flags' defaults
    (argparse's rule; it matters for --enable-/--disable-chunked-prefill only)."""
    return next(row.megatron_lm_default for row in FLAGS if row.dest == dest)


def test_where_the_driver_runs_otherwise_than_megatron_lms_default():
    rows = {row.name: row.accepted for row in refused_flags()
            if row.accepted is not NOT_OFFERED and row.accepted != _namespace_default(row.dest)}
    assert rows == RUNS_OTHERWISE
    assert [row.name for row in refused_flags() if row.accepted is NOT_OFFERED] == ["--tensorboard-log-interval"]


@pytest.mark.parametrize("flag", RUNS_OTHERWISE)
def test_the_drivers_behaviour_is_accepted_and_megatron_lms_default_refused(flag, tmp_path, refused, parsed):
    row = BY_NAME[flag]
    if row.action != "store":
        parsed([*REQUIRED, flag])  # a Megatron-LM script asking for what the driver does runs
    recipe = tmp_path / "r.yaml"
    value = False if row.megatron_lm_default is None else row.megatron_lm_default  # None: a switch not given
    recipe.write_text(f"{row.dest}: {json.dumps(value)}\n")
    context = ONLY_WITH_ARGV[row.only_with] if row.only_with else []
    assert refused([*REQUIRED, "--yaml-cfg", str(recipe), *context]) == (
        f"{recipe}:1: '{row.dest}' ({flag}): {row.refused}")


def test_refused_flags_that_are_config_fields_run_with_megatron_cores_default():
    """What a refused flag accepts is what the driver builds: megatron-core's config default
    (Megatron-LM's None for a switch megatron-core keeps False counts as off)."""
    defaults = recipes._config_field_defaults()
    unused = {"--cp-comm-type"}  # read only with context parallelism, which is refused
    for row in refused_flags():
        if row.dest in defaults and row.accepted is not NOT_OFFERED and row.name not in unused:
            assert row.accepted == defaults[row.dest] or (row.accepted, defaults[row.dest]) == (None, False), row.name


def test_config_field_flags_default_to_megatron_cores_defaults():
    """Flags handed to TransformerConfig as given: without them the config is megatron-core's."""
    for name in (*arguments.CONFIG_FIELD_FLAGS, *arguments.FP8_CONFIG_FIELD_FLAGS, *arguments.MOE_CONFIG_FIELD_FLAGS):
        row = next(row for row in supported_flags() if row.dest == name)
        assert row.megatron_lm_default == recipes._config_field_defaults()[name], name




@pytest.mark.parametrize("argv, message", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD: " + megatron_lm_flags.WSD),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized: "
     + megatron_lm_flags.INFERENCE),
    (["--position-embedding-type", "mrope"], "--position-embedding-type mrope: " + megatron_lm_flags.MROPE),
    (["--fp8-recipe", "custom"], "--fp8-recipe custom: " + megatron_lm_flags.QUANTIZATION_RECIPES),
    (["--timing-log-level", "2"], "--timing-log-level 2: " + megatron_lm_flags.TIMING_LEVEL_2),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer: "
     + megatron_lm_flags.TOKENIZERS),
])
def test_values_a_supported_flag_does_not_offer_are_refused(argv, message, refused):
    assert refused([*REQUIRED, *argv]) == message


def test_every_refused_value_is_refused(refused):
    for row in supported_flags():
        for value, reason in row.refused_values.items():
            assert refused([*REQUIRED, row.name, str(value)]) == f"{row.name} {value}: {reason}"


def test_flags_megatron_lm_does_not_have_stay_argparse_errors(refused):
    assert refused([*REQUIRED, "--eval-iterz", "5"]) == "unrecognized arguments: --eval-iterz 5"


def test_pretrain_gpt_refuses_with_one_line_each_and_exit_2():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    run = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "pretrain_gpt.py"), *REQUIRED,
                          "--skip-train", "--decrease-batch-size-if-needed"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [f"pretrain_gpt.py: error: --skip-train: {megatron_lm_flags.EVALUATION}",
                                       "pretrain_gpt.py: error: --decrease-batch-size-if-needed: "
                                       f"{megatron_lm_flags.BATCH_ROUNDING}"]


# --- Megatron-LM's defaults and rules, as the driver runs them -----------------------------


def test_defaults_now_megatron_lms(parsed):
    args = parsed(REQUIRED)
    assert (args.lr_decay_style, args.log_interval, args.split, args.cuda_graph_scope) == ("linear", 100, None, [])
    assert args.no_load_optim is None


def test_ffn_hidden_size_defaults_as_in_megatron_lm(parsed):
    assert parsed(REQUIRED).ffn_hidden_size == 4 * 512
    assert parsed([*REQUIRED, "--swiglu"]).ffn_hidden_size == 1344  # int(4 * 512 * 2 / 3 / 64) * 64


def test_num_query_groups_counts_with_group_query_attention_only(parsed, refused):
    assert transformer_config_kwargs(parsed(REQUIRED))["num_query_groups"] is None  # multi-head attention
    gqa = parsed([*REQUIRED, "--group-query-attention", "--num-query-groups", "4"])
    assert transformer_config_kwargs(gqa)["num_query_groups"] == 4
    assert refused([*REQUIRED, "--num-query-groups", "4"]).startswith(
        "--num-query-groups 4 takes effect only with --group-query-attention")


def test_null_tokenizer_counts_the_vocabulary_as_megatron_lm(parsed, refused):
    assert parsed(REQUIRED).vocab_size == 32000  # no tokenizer: ids 0 .. 31999, the last one EOD
    assert parsed([*REQUIRED, "--tokenizer-type", "NullTokenizer"]).vocab_size == 32001  # ids 0 .. 32000, EOD 32000


def test_warmup_fraction_and_recompute_activations(parsed, refused):
    args = parsed([*REQUIRED, "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50"])
    assert args.lr_warmup_iters == pytest.approx(5.0)  # Megatron-LM: the fraction of the decay
    kwargs = transformer_config_kwargs(parsed([*REQUIRED, "--recompute-activations"]))
    assert kwargs["recompute_granularity"] == "selective"


def test_data_path_without_split_takes_megatron_lms_legacy_split(parsed, capsys, tmp_path):
    args = parsed([*REQUIRED, "--data-path", indexed_dataset(tmp_path)])
    assert args.split == arguments.LEGACY_SPLIT == "969, 30, 1"
    assert "--data-path without --split" in capsys.readouterr().err


def test_config_field_flags_reach_the_config(parsed):
    moe = ["--num-experts", "8", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-z-loss-coeff", "0.001", "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
           "--moe-aux-loss-coeff", "0.01", "0.001"]
    kwargs = transformer_config_kwargs(parsed([*REQUIRED, *moe, "--attention-backend", "flash", "--norm-epsilon",
                                               "1e-6", "--apply-layernorm-1p", "--add-qkv-bias"]))
    assert (kwargs["attention_backend"], kwargs["layernorm_epsilon"], kwargs["layernorm_zero_centered_gamma"],
            kwargs["add_qkv_bias"]) == (AttnBackend.flash, 1e-6, True, True)
    assert (kwargs["moe_router_score_function"], kwargs["moe_router_enable_expert_bias"],
            kwargs["moe_z_loss_coeff"]) == ("sigmoid", True, 0.001)
    assert kwargs["moe_router_load_balancing_type"] == ["seq_aux_loss", "global_aux_loss"]
    assert kwargs["moe_aux_loss_coeff"] == [0.01, 0.001]
    single = transformer_config_kwargs(parsed([*REQUIRED, "--num-experts", "8", "--moe-aux-loss-coeff", "0.01"]))
    assert single["moe_aux_loss_coeff"] == 0.01  # one entry: a number, as Megatron-LM keeps it


# --- against Megatron-LM's own parser -----------------------------------------------------

_LIST_MEGATRON_LM_FLAGS = textwrap.dedent("""
    import argparse, json, sys, warnings
    warnings.simplefilter("ignore")
    from megatron.training.arguments import add_megatron_arguments
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    json.dump([dict(names=a.option_strings, dest=a.dest, default=repr(a.default), action=type(a).__name__,
                    nargs=a.nargs) for a in parser._actions if a.option_strings and a.dest != "help"], sys.stdout)
""")
_ACTIONS = {"store": "_StoreAction", "store_true": "_StoreTrueAction", "store_false": "_StoreFalseAction",
            "boolean_optional": "BooleanOptionalAction"}


def test_every_flag_of_megatron_lms_parser_is_in_the_table():
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if not checkout:
        pytest.skip("set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])))
    # SUBPROCESS_PREAMBLE: megatron_lm_on_cpu's stand-in for megatron-core's `import triton` (an
    # import only) where Triton is not installed, as on CPU CI; parsing launches no kernel.
    run = subprocess.run([sys.executable, "-c", SUBPROCESS_PREAMBLE + _LIST_MEGATRON_LM_FLAGS], capture_output=True,
                         text=True, env=env,
                         cwd=checkout)
    assert run.returncode == 0, f"importing megatron.training.arguments from {checkout} failed:\n{run.stderr[-3000:]}"
    flags = json.loads(run.stdout)
    missing = [flag["names"][0] for flag in flags if not set(flag["names"]) <= set(BY_NAME)]
    assert not missing, f"Megatron-LM flags missing from driver/megatron_lm_flags.py: {missing}"
    for flag in flags:
        row = BY_NAME[flag["names"][0]]
        assert tuple(flag["names"]) == row.names, flag["names"]
        nargs = flag["nargs"] if flag["action"] == "_StoreAction" else None  # switches: argparse's 0
        assert (flag["dest"], flag["default"], flag["action"], nargs) == (
            row.dest, repr(row.megatron_lm_default), _ACTIONS[row.action], row.nargs), flag["names"]
    assert len(flags) == len(FLAGS)
