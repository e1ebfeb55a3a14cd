"""pretrain_gpt.py's arguments: Megatron-LM 0.16.1's flags and defaults, recipes, checks,
config mapping.

The flags the driver runs are defined in ``parser`` with Megatron-LM's names and defaults;
its other flags come from ``megatron_lm_flags``, which refuses each by name where it asks
for what the driver does not do. The checks of one kind each live in the module named for
what they judge (``given_values``, ``launcher_env``, ``load_check``, ``data_files``,
``output_dirs``, ``config_refusals``); this module runs them in order. ``parse_args`` = defaults < ``--yaml-cfg`` recipe <
command line, then, before any CUDA or NCCL work: the checks of each setting on its own,
every problem found and all printed together (the recipe's keys, ``all_refusals`` of those
flags, ``given_value_problems``: empty paths, integer ranges, float domains); then, where there
is none, ``check_environment`` (the variables the run reads), ``apply_megatron_lm_rules`` (what
Megatron-LM makes of the flags as given), ``take_checkpoint_args`` (``--use-checkpoint-args``
takes the checkpoint's model args here), ``check_args``
(Megatron-LM's required flags, ``INT_RANGES``, contradictions, parallel sizes against
``WORLD_SIZE``, the data files and output directories) and the preflight both loops share
(``preflight.judge`` of ``driver_request``: the full TransformerConfig with the patch fields,
built once as ``training.setup`` uses it, this loop's traits inside a captured iteration, and
what ``--load`` holds: its model shape must be this run's, its optimizer layout too). Every
refusal is one ``pretrain_gpt.py: error: ...`` line on stderr (more lines only where there
are several problems) naming the flags and the fix, with exit status 2 and no traceback; a
long value it echoes is shortened (``fields.shown``). ``--help`` and the errors of argparse, the
recipe reader and the checks of each setting on its own come before megatron-core is imported,
so they answer without its seconds of imports (a recipe's section key that no flag sets is
looked up among TransformerConfig's fields, which imports it); ``--attention-backend`` holds the
member's name (``megatron_lm_flags.AttnBackendName``) until just before the preflight.
``transformer_config_kwargs`` maps the args to megatron-core's TransformerConfig
(patched by ``apply()``, so the MoE patch fields are accepted; on a megatron-core the
patch set does not install into, its own class, with the kwargs
``compat.fit_config_kwargs`` fits to it). The training loop and ``main`` are in
``driver.training``, which imports this module (never the reverse).
"""

import argparse
import functools
import importlib.util
import math
import os
import re
import sys
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.driver import compat, megatron_lm_flags
from megatron.moe_patches.driver.data_files import check_data_path, check_split, check_validation_split
from megatron.moe_patches.driver.given_values import check_ranges, given_value_problems
from megatron.moe_patches.driver.launcher_env import check_environment, launcher_rank
from megatron.moe_patches.driver.load_check import DriverWords, take_checkpoint_args
from megatron.moe_patches.driver.output_dirs import OUTPUT_DIRS, check_output_dir
from megatron.moe_patches.driver.parser import PROG, build_parser, dest_flags, flag_of, parser_defaults
from megatron.moe_patches.driver.patch_args import config_kwargs_from_args
from megatron.moe_patches.graph_scopes import CAPTURED_SCOPES, GraphScope, LoopTraits, scope_names
from megatron.moe_patches.fields import shown
from megatron.moe_patches.driver.recipes import Recipe, RecipeError, UnknownKey, apply_recipe, load_recipe
from megatron.moe_patches.preflight import CheckpointPolicy, PreflightRequest, Verdict, judge


def parse_args(argv: Optional[List[str]] = None, prog: str = PROG) -> argparse.Namespace:
    """Parse and validate pretrain_gpt.py's arguments; exits with status 2 on bad input.

    Everything here runs before any CUDA or NCCL work, so no bad input reaches a GPU.
    ``prog``: the command the user ran, named by the usage, error and warning lines.
    """
    return parse_and_judge(argv, prog)[0]


def parse_and_judge(argv: Optional[List[str]] = None, prog: str = PROG) -> Tuple[argparse.Namespace, Verdict]:
    """``parse_args``, and the preflight's verdict on the args (``preflight.judge``: the config
    built once, its plan, the checkpoint --load names), which start-up reuses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog, names=True)  # megatron-core: imported by the checks that need it
    first, _ = parser.parse_known_args(argv)
    recipe, bad_keys = Recipe(), []  # the recipe's bad keys, all of them; the others are applied
    if first.yaml_cfg:
        try:
            recipe = load_recipe(first.yaml_cfg, parser, bad_keys)
            apply_recipe(parser, recipe, getattr(recipe, "path", None) or first.yaml_cfg, bad_keys)
        except RecipeError as err:  # a file that is no recipe (YAML syntax, an alias bomb, empty)
            parser.error(str(err))
        except OSError as err:  # a --yaml-cfg that names no file and no built-in recipe
            message = str(err)
            parser.error(message if message.startswith("--yaml-cfg") else f"--yaml-cfg {shown(first.yaml_cfg)}: {message}")
        parser.pending = [str(problem) for problem in bad_keys]
    args = parser.parse_args(argv)  # unknown flags: argparse names them (after the recipe's problems) and exits

    def warn(message: str) -> None:
        if launcher_rank() == 0:
            print(f"{parser.prog}: warning: {message}", file=sys.stderr, flush=True)

    # The checks of each setting on its own: every problem found, then all printed together.
    given = given_settings(parser, argv, recipe)
    problems = parser.pending + megatron_lm_flags.all_refusals(args, given)
    notes = [*recipe.notes, *megatron_lm_flags.no_effect_notes(args, given)]
    megatron_lm_flags.drop_refused(args)
    problems += given_value_problems(args)
    if problems and not (problems == parser.pending and all(isinstance(bad, UnknownKey) for bad in bad_keys)):
        parser.errors(problems)
    # Unknown recipe keys alone: the checks of the settings together run too (parser.error
    # prints the keys first), so that one run reports them all.
    for note in notes:
        warn(note)
    try:
        world_size = check_environment(args)
        apply_megatron_lm_rules(args, warn)
        take_checkpoint_args(args)
        given_shape = dict(vars(args))  # the model's shape as given: check_args fills in derived sizes
        check_args(args, world_size=world_size)
        megatron_lm_flags.resolve_names(args)  # --attention-backend: megatron-core's AttnBackend member
        verdict = judge(driver_request(args, given_shape))
        if verdict.refusals:
            parser.errors(parser.pending + list(verdict.refusals))
        for said in verdict.notes:
            warn(said)
        check_grouped_expert_fusions(args)  # megatron-core's asserts there: after the patch set's rules
    except ValueError as err:
        parser.error(str(err))
    if parser.pending:
        parser.errors(parser.pending)
    return args, verdict


def given_settings(parser: argparse.ArgumentParser, argv: List[str], recipe: Recipe) -> List[Tuple[str, str]]:
    """(dest, how it was given) for each flag on the command line, in order, then each key
    the recipe sets: what ``megatron_lm_flags.all_refusals`` judges, and names in its messages."""
    options = parser._option_string_actions  # argparse has no public lookup
    given = []
    for token in argv:
        option = token.split("=", 1)[0]
        if option.startswith("--") and option in options:
            given.append((options[option].dest, option))
    flags = {}
    for action in parser._actions:
        if action.option_strings:
            flags.setdefault(action.dest, action.option_strings[0])
    for dest in recipe:
        given.append((dest, f"{recipe.where(dest)}: '{recipe.key(dest)}' ({flags.get(dest, dest)})"))
    return given


# Megatron-LM's legacy split of --data-path, used (with a warning) where --split is not given.
LEGACY_SPLIT = "969, 30, 1"


def apply_megatron_lm_rules(args: argparse.Namespace, warn: Callable[[str], None] = print) -> None:
    """What Megatron-LM makes of the flags as given, once, before ``take_checkpoint_args`` takes any
    args from a checkpoint: the values the driver runs with, under the names it reads."""
    if not args.group_query_attention:
        if args.num_query_groups != 1:  # Megatron-LM ignores it: refuse rather than drop it
            raise ValueError(f"--num-query-groups {args.num_query_groups} takes effect only with "
                             "--group-query-attention (as in Megatron-LM): add it, or drop --num-query-groups")
        args.num_query_groups = None  # multi-head attention, as config, checkpoints and logs read it
    if "full" in (args.cuda_graph_scope or []):  # megatron-core's old name of the whole layer
        if args.cuda_graph_scope != ["full"]:
            raise ValueError(f"--cuda-graph-scope {' '.join(args.cuda_graph_scope)}: full (the whole layer, "
                             "megatron-core's old spelling) stands alone; drop it, or the other scopes")
        warn("--cuda-graph-scope full is deprecated (megatron-core): each layer is captured whole without "
             "--cuda-graph-scope; running as that")
        args.cuda_graph_scope = []
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        warn("Disabling sequence parallelism because tensor model parallelism is disabled")  # Megatron-LM's words
        args.sequence_parallel = False
    if args.tokenizer_type == megatron_lm_flags.NULL_TOKENIZER and args.vocab_size is not None:
        args.vocab_size += 1  # Megatron-LM's null tokenizer adds the end-of-document id N to ids 0 .. N - 1
    if args.data_path and args.split is None:
        warn(f"--data-path without --split: using Megatron-LM's legacy split {LEGACY_SPLIT!r}")
        args.split = LEGACY_SPLIT
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:  # Megatron-LM keeps a single entry unlisted
            setattr(args, name, value[0])
    _check_run_length_units(args)
    if args.lr_warmup_fraction is not None:
        run = RUN_LENGTHS[counted_in(args)]
        if getattr(args, run.warmup):
            raise ValueError(f"--lr-warmup-fraction and {flag_of(run.warmup)} both set the warmup: give one")
        decay = getattr(args, run.decay) or getattr(args, run.length)
        if decay is not None:  # a missing run length is reported by check_args
            setattr(args, run.warmup, args.lr_warmup_fraction * decay)  # Megatron-LM's warmup steps
    if args.eval_interval is None and args.eval_iters not in (0, megatron_lm_flags.BY_NAME["--eval-iters"].default):
        # Megatron-LM 0.16.1 sizes the validation data by --eval-interval and stops without it
        raise ValueError(f"--eval-iters {args.eval_iters} needs --eval-interval (how often to evaluate): "
                         "add it, or drop --eval-iters")


# Megatron-LM flags whose dest is the TransformerConfig field of that name: Megatron-LM
# hands them to the config as given, and so does transformer_config_kwargs. Their
# Megatron-LM defaults are megatron-core's, so a run that gives none builds the same config.
CONFIG_FIELD_FLAGS = (
    "attention_backend", "fp32_residual_connection", "apply_residual_connection_post_layernorm",
    "layernorm_epsilon", "layernorm_zero_centered_gamma", "add_qkv_bias", "rotary_interleaved",
    "embedding_init_method_std", "recompute_method", "recompute_num_layers", "recompute_modules",
    "distribute_saved_activations", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "clone_scatter_output_in_embedding",
)
FP8_CONFIG_FIELD_FLAGS = ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
MOE_CONFIG_FIELD_FLAGS = (
    "moe_shared_expert_gate", "moe_shared_expert_overlap", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_router_score_function", "moe_router_dtype",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_force_load_balancing",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy", "moe_layer_recompute", "moe_router_fusion", "moe_apply_probs_on_input",
    "moe_deepep_num_sms", "moe_hybridep_num_sms",
)
# Flags that act only together with another (the key): without it a value other than the
# default would change nothing, so it is refused.
ONLY_WITH = {
    "num_experts": (
        "moe_grouped_gemm", "moe_permute_fusion", "moe_router_padding_for_quantization", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "overlap_moe_expert_parallel_comm", "moe_router_topk",
        "moe_router_pre_softmax", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", *MOE_CONFIG_FIELD_FLAGS,
    ),
    "fp8_format": ("fp8_recipe", "fp8_wgrad", *FP8_CONFIG_FIELD_FLAGS),
    "cross_entropy_loss_fusion": ("cross_entropy_fusion_impl",),
    "moe_router_enable_expert_bias": ("moe_router_bias_update_rate",),
    "moe_expert_capacity_factor": ("moe_pad_expert_input_to_capacity", "moe_token_drop_policy"),
    "recompute_granularity": ("recompute_method", "recompute_num_layers", "distribute_saved_activations"),
    "bf16": ("fp32_residual_connection",),  # an fp32 model's residual stream is fp32 already
}


# Megatron-LM has no default for these and stops without them; so does this driver.
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
            "vocab_size", "micro_batch_size", "train_iters", "lr")
# A required setting that another may stand for: the run's length, in iterations or in samples.
REQUIRED_ONE_OF = {"train_iters": ("train_iters", "train_samples")}


class RunLength(NamedTuple):
    """The dests that count a run, and its learning-rate schedule, in one unit."""

    length: str
    warmup: str
    decay: str


# Megatron-LM counts a run in iterations or in samples (its scheduler's steps are samples either
# way): the settings of one unit, then the settings of the other that its asserts refuse with it.
RUN_LENGTHS = {
    "iterations": RunLength("train_iters", "lr_warmup_iters", "lr_decay_iters"),
    "samples": RunLength("train_samples", "lr_warmup_samples", "lr_decay_samples"),
}
ONLY_SAMPLE_BASED = ("rampup_batch_size",)  # Megatron-LM: no ramp-up in iteration-based training


def counted_in(args: argparse.Namespace) -> str:
    """"samples" where --train-samples sets the run's length, else "iterations" (Megatron-LM's test)."""
    return "samples" if getattr(args, "train_samples", None) else "iterations"


def _is_set(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name, None) not in (None, 0)  # warmups are 0 when unset


def _check_run_length_units(args: argparse.Namespace) -> None:
    """Megatron-LM's asserts: no setting counted in the other unit than the run's length."""
    if args.train_iters is None and args.train_samples is None:
        return  # _check_required names both
    unit = counted_in(args)
    other = RUN_LENGTHS["iterations" if unit == "samples" else "samples"]
    length_flag = flag_of(RUN_LENGTHS[unit].length)
    for name in other:
        if _is_set(args, name):
            raise ValueError(f"{flag_of(name)} with {length_flag}: Megatron-LM counts a run in iterations or in "
                             f"samples, not both: give {length_flag} with "
                             f"{' and '.join(map(flag_of, RUN_LENGTHS[unit][1:]))}, or the other unit throughout")
    if unit == "iterations":
        for name in ONLY_SAMPLE_BASED:
            if _is_set(args, name):
                raise ValueError(f"{flag_of(name)} with {length_flag}: Megatron-LM ramps the batch size up in "
                                 "sample-based training only: give --train-samples (and --lr-warmup-samples, "
                                 "--lr-decay-samples) instead of --train-iters, or drop it")


def _check_required(args: argparse.Namespace) -> None:
    missing = [" or ".join(map(flag_of, REQUIRED_ONE_OF.get(name, (name,)))) for name in REQUIRED
               if all(getattr(args, one, None) is None for one in REQUIRED_ONE_OF.get(name, (name,)))]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (Megatron-LM has no default for "
                         f"{'it' if len(missing) == 1 else 'them'}); give {'it' if len(missing) == 1 else 'them'}"
                         " on the command line or in the --yaml-cfg recipe")


def megatron_lm_ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's --ffn-hidden-size default for these args."""
    return on_disk.ffn_hidden_size_default(args.hidden_size, args.swiglu)


def _tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _check_split_sizes(args: argparse.Namespace) -> None:
    """Each size a parallel size splits must divide by it (the layers assert so at model build)."""
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # megatron-core's default: the TP size
    splits = [("--ffn-hidden-size", args.ffn_hidden_size, "--tensor-model-parallel-size", tp)]
    if args.num_experts is not None:
        splits.append(("--moe-ffn-hidden-size", args.moe_ffn_hidden_size or args.ffn_hidden_size,
                       "--expert-tensor-parallel-size" if args.expert_tensor_parallel_size else
                       "--expert-tensor-parallel-size (the TP size by default)", etp))
        if args.moe_shared_expert_intermediate_size is not None:
            splits.append(("--moe-shared-expert-intermediate-size", args.moe_shared_expert_intermediate_size,
                           "--tensor-model-parallel-size", tp))
    for size_flag, size, parallel_flag, parallel in splits:
        if size % parallel:
            raise ValueError(f"{size_flag} {size} must be divisible by {parallel_flag} {parallel} (each rank "
                             f"holds an equal slice): choose sizes that divide")


def check_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Fill derived defaults and reject contradictions (ValueError naming the flags and the fix).

    ``world_size``: the ranks the run has (``WORLD_SIZE``); the parallel sizes must fit it.
    """
    _check_required(args)
    check_ranges(args)
    if args.fp8_format and not args.bf16:
        raise ValueError("--fp8-format needs --bf16 (FP8 GEMMs on bf16 parameters)")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path contradict each other: choose one")
    if args.use_checkpoint_args and not args.load:
        raise ValueError("--use-checkpoint-args needs --load")
    if args.tensorboard_dir and not _tensorboard_installed():
        raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                         "(or this package's 'tensorboard' extra), or drop --tensorboard-dir")
    _check_graph_scope(args)
    _check_only_with(args)
    if args.num_experts is None:
        if args.expert_model_parallel_size > 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts (an MoE model)")
    else:
        if args.num_experts % args.expert_model_parallel_size:
            raise ValueError(
                f"--num-experts {args.num_experts} must be divisible by --expert-model-parallel-size "
                f"{args.expert_model_parallel_size} (each expert-parallel rank holds the same number of "
                "experts): choose an EP size that divides the number of experts"
            )
        if args.moe_router_topk > args.num_experts:
            raise ValueError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    if args.moe_router_padding_for_quantization:
        if not args.fp8_format:
            raise ValueError("--moe-router-padding-for-quantization needs --fp8-format (it pads for FP8 GEMMs)")
        if args.moe_token_dispatcher_type == "allgather":
            raise ValueError("--moe-router-padding-for-quantization does not work with --moe-token-dispatcher-type "
                             "allgather: use alltoall or flex")
    _check_main_params_load(args)
    _check_expert_parallel_overlap(args)
    if args.pipeline_model_parallel_size > 1 and args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError("--num-layers must be divisible by --pipeline-model-parallel-size")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups is not None:
        groups = args.num_query_groups
        if args.num_attention_heads % groups:
            raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads}")
        if groups % tp and tp % groups:
            raise ValueError(f"--num-query-groups {groups} must be a multiple or a divisor of "
                             f"--tensor-model-parallel-size {tp}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                         f"{args.num_attention_heads} (or set --kv-channels)")
    _check_sequence_split(args)
    if args.expert_model_parallel_size > 1 and tp > 1 and not args.sequence_parallel:
        raise ValueError("--expert-model-parallel-size > 1 with --tensor-model-parallel-size > 1 needs "
                         "--sequence-parallel")
    args.ffn_hidden_size = args.ffn_hidden_size or megatron_lm_ffn_hidden_size(args)
    _check_split_sizes(args)
    if args.max_position_embeddings < args.seq_length:  # Megatron-LM's rule, whatever the position embedding
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                         f"{args.seq_length}: raise it")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    run = RUN_LENGTHS[counted_in(args)]
    setattr(args, run.decay, getattr(args, run.decay) or getattr(args, run.length))
    warmup, decay = getattr(args, run.warmup), getattr(args, run.decay)
    if warmup >= decay:  # megatron-core's scheduler: warmup < decay
        raise ValueError(
            f"{flag_of(run.warmup)} {warmup} must be below {flag_of(run.decay)} "
            f"{decay} (which defaults to {flag_of(run.length)}): shorten the warmup or "
            f"set {flag_of(run.decay)}"
        )
    _check_parallel_sizes(args, world_size)
    model_parallel = tp * args.pipeline_model_parallel_size
    data_parallel = world_size // model_parallel
    args.data_parallel_size = data_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel
    if args.global_batch_size % (args.micro_batch_size * data_parallel):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of "
            f"--micro-batch-size x data-parallel size = {args.micro_batch_size * data_parallel}"
        )
    if args.rampup_batch_size is not None and args.train_samples:  # iteration-based: refused before
        _check_rampup(args)
    if args.train_samples:  # Megatron-LM's iterations of a sample-based run, ramp-up included
        args.train_iters = sample_based_iterations(args)
        if args.train_iters == 0:  # Megatron-LM would run no iteration and stop without a word
            raise ValueError(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                             f"{args.global_batch_size}: no iteration would run; give at least one batch of samples")
    check_split(args)
    check_validation_split(args)
    check_data_path(args)
    for name in OUTPUT_DIRS:
        if getattr(args, name, None):
            check_output_dir(flag_of(name), getattr(args, name))


def batch_calculator(args: argparse.Namespace, rank: int = 1):
    """megatron-core's calculator of the global batch size and micro-batches per step for these
    args (a ramp-up with --rampup-batch-size, else constant); ``update(consumed_samples, ...)``
    moves it on. ``rank`` 0 logs what it decides, as in Megatron-LM."""
    from megatron.core import num_microbatches_calculator as calculators

    shape = (args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False, rank)
    if args.rampup_batch_size is None:
        return calculators.ConstantNumMicroBatchesCalculator(*shape)
    return calculators.RampupBatchsizeNumMicroBatchesCalculator(*shape, *args.rampup_batch_size)


def _ramp_up_level(consumed: int, samples_per_increment: float) -> int:
    """The increments megatron-core's ramp-up calculator has made after ``consumed`` samples
    (its own float arithmetic, so that the counts match it to the sample)."""
    return int(consumed / samples_per_increment)


def _last_sample_at_level(level: int, samples_per_increment: float) -> int:
    """The largest consumed-sample count at which the calculator is still at ``level``."""
    last = math.ceil((level + 1) * samples_per_increment) - 1  # then nudged past float rounding
    while _ramp_up_level(last + 1, samples_per_increment) <= level:
        last += 1
    while last > 0 and _ramp_up_level(last, samples_per_increment) > level:
        last -= 1
    return last


@functools.lru_cache(maxsize=8)
def _sample_based_run(rampup: Optional[Tuple[int, int, int]], global_batch: int, micro_batch: int,
                      data_parallel: int, train_samples: int) -> Tuple[int, Tuple[int, ...]]:
    """(iterations, the global batch sizes the ramp-up steps take) of a sample-based run, counted as
    Megatron-LM's update_train_iters counts them: ramp-up steps while neither the ramp-up's nor the
    run's samples are passed, then full batches (a partial last one dropped). Each batch size the
    ramp-up reaches is counted in one step (its steps in closed form), not iteration by iteration:
    a ramp-up over billions of samples would spin for minutes."""
    if rampup is None:
        return train_samples // global_batch, ()
    start, increment, ramp_samples = rampup
    samples_per_increment = ramp_samples / ((global_batch - start) // increment)  # as megatron-core divides
    iterations, consumed, sizes = 0, 0, set()
    while consumed <= ramp_samples and consumed <= train_samples:
        level = _ramp_up_level(consumed, samples_per_increment)
        batch = start + level * increment
        last = min(ramp_samples, train_samples, _last_sample_at_level(level, samples_per_increment))
        steps = (last - consumed) // batch + 1  # the steps that start at or before ``last``
        sizes.add(batch)
        consumed += steps * batch
        iterations += steps
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations, tuple(sorted(sizes))


def sample_based_iterations(args: argparse.Namespace) -> int:
    """The iterations of a --train-samples run (Megatron-LM's rule, ramp-up included)."""
    rampup = tuple(args.rampup_batch_size) if args.rampup_batch_size is not None else None
    return _sample_based_run(rampup, args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                             args.train_samples)[0]


def _check_rampup(args: argparse.Namespace) -> None:
    """What megatron-core's ramp-up calculator asserts at start-up, and, for every global batch size
    the ramp-up takes, the divisibility it asserts only when the run gets there."""
    start, increment, samples = args.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1:
        raise ValueError(f"{flag}: the start batch size and the increment must be at least 1")
    if samples < 1:  # megatron-core's calculator divides by the samples per increment
        raise ValueError(f"{flag}: the ramp-up must take at least 1 sample (0 divides by zero in megatron-core's "
                         "calculator); to train at --global-batch-size from the start, drop --rampup-batch-size")
    if start >= args.global_batch_size:
        raise ValueError(f"{flag}: the start batch size must be below --global-batch-size "
                         f"{args.global_batch_size}, which the ramp-up grows to")
    if (args.global_batch_size - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size {args.global_batch_size} minus the start batch size "
                         f"must be a multiple of the increment (Megatron-LM's rule)")
    step = args.micro_batch_size * args.data_parallel_size
    _, sizes = _sample_based_run((start, increment, samples), args.global_batch_size, args.micro_batch_size,
                                 args.data_parallel_size, args.train_samples)
    uneven = [size for size in sizes if size % step]
    if uneven:
        raise ValueError(f"{flag}: the ramp-up reaches a global batch size of {uneven[0]}, not a multiple of "
                         f"--micro-batch-size x data-parallel size = {step} (megatron-core stops there): "
                         "choose a start and an increment that are multiples of it")


def bias_gelu_fusion(args: argparse.Namespace) -> bool:
    """Megatron-LM's rule: no bias, no bias-GeLU fusion (read after --use-checkpoint-args)."""
    return args.bias_gelu_fusion and not args.disable_bias_linear


def apply_rope_fusion(args: argparse.Namespace) -> bool:
    """Megatron-LM's rule: RoPE fusion only with RoPE (read after --use-checkpoint-args)."""
    return args.apply_rope_fusion and args.position_embedding_type == "rope"


def check_grouped_expert_fusions(args: argparse.Namespace) -> None:
    """megatron-core's TEGroupedMLP (the experts of --moe-grouped-gemm with Transformer Engine)
    asserts that no expert bias meets the bias-dropout fusion, and fuses the bias-activation of
    SwiGLU only: Megatron-LM stops there at start-up or in the first step, this driver before."""
    if args.num_experts is None or not args.moe_grouped_gemm or args.transformer_impl != "transformer_engine":
        return
    if not args.disable_bias_linear and args.bias_dropout_fusion:
        raise ValueError("--moe-grouped-gemm with expert biases (no --disable-bias-linear) and the bias-dropout "
                         "fusion: megatron-core's TEGroupedMLP refuses that pair (Megatron-LM stops at its assert); "
                         "add --no-bias-dropout-fusion or --disable-bias-linear")
    if not args.swiglu and bias_gelu_fusion(args):
        raise ValueError("--moe-grouped-gemm with GeLU experts and the bias-GeLU fusion: megatron-core's TEGroupedMLP "
                         "fuses SwiGLU's bias-activation only (Megatron-LM stops in the first step); add "
                         "--no-bias-gelu-fusion, --swiglu or --disable-bias-linear")


def sequence_multiple(tensor_parallel: int, context_parallel: int, sequence_parallel: bool) -> int:
    """What --seq-length must be a multiple of, by megatron-core's splits: context
    parallelism cuts each sequence into 2 x CP chunks (two per CP rank, for causal load
    balance), and sequence parallelism splits each CP rank's seq-length / CP tokens across
    the TP ranks."""
    multiple = 2 * context_parallel if context_parallel > 1 else 1
    if sequence_parallel:
        multiple = math.lcm(multiple, context_parallel * tensor_parallel)
    return multiple


def _check_sequence_split(args: argparse.Namespace) -> None:
    # Context parallelism is refused by name (megatron_lm_flags), so its size is 1 here.
    tp = args.tensor_model_parallel_size
    multiple = sequence_multiple(tp, getattr(args, "context_parallel_size", 1), args.sequence_parallel)
    if args.seq_length % multiple:
        raise ValueError(
            f"--seq-length {args.seq_length} must be a multiple of {multiple} with --sequence-parallel and "
            f"--tensor-model-parallel-size {tp} (each tensor-parallel rank takes an equal share of the sequence): "
            f"use e.g. --seq-length {args.seq_length + multiple - args.seq_length % multiple}"
        )


# Directories the run writes into (made when it first writes).


def _check_graph_scope(args) -> None:
    """The allow-list of scopes this loop captures (``graph_scopes.CAPTURED_SCOPES``); what it runs
    inside a captured iteration is judged with the config (``driver_traits``)."""
    if args.cuda_graph_impl == "none":
        if args.cuda_graph_scope:
            raise ValueError("--cuda-graph-scope needs --cuda-graph-impl local or transformer_engine")
        return
    scope = CAPTURED_SCOPES.get(frozenset(scope_names(args.cuda_graph_scope)))
    given = " ".join(args.cuda_graph_scope or ["(none: each layer whole)"])
    if scope is None:
        raise ValueError(f"--cuda-graph-scope {given}: this pretrain_gpt.py captures moe (each MoE layer), "
                         "each transformer layer whole (no scope, or attn moe) or full_iteration; use one of "
                         "those, or Megatron-LM's training loop for megatron-core's other graph scopes")
    if scope is GraphScope.FULL_ITERATION and args.cuda_graph_impl != "local":
        raise ValueError("--cuda-graph-scope full_iteration needs --cuda-graph-impl local (megatron-core's "
                         "capture of the whole iteration)")


def _check_only_with(args: argparse.Namespace) -> None:
    for enabling, dependents in ONLY_WITH.items():
        if getattr(args, enabling):
            continue
        for name in dependents:
            if getattr(args, name) != parser_defaults()[name]:
                raise ValueError(f"{dest_flags()[name]} needs {dest_flags()[enabling]}")


def _check_main_params_load(args: argparse.Namespace) -> None:
    if not getattr(args, "load_main_params_from_ckpt", False):
        return
    flag = "--load-main-params-from-ckpt"
    if not args.no_load_optim:  # Megatron-LM's rule: loaded optimizer states hold their own main params
        raise ValueError(f"{flag} needs --no-load-optim (with the optimizer states loaded, the main params come "
                         "from them): add --no-load-optim or drop the flag")
    if not args.load:
        raise ValueError(f"{flag} needs --load (the checkpoint directory)")
    if not args.bf16:
        raise ValueError(f"{flag} needs --bf16 (only mixed precision keeps fp32 main params apart from the model's "
                         "params): add --bf16 or drop the flag")
    if not args.use_distributed_optimizer:
        raise ValueError(f"{flag} needs --use-distributed-optimizer (megatron-core's other mixed-precision "
                         "optimizer cannot take main params from a state dict): add it or drop the flag")


# megatron-core's TransformerConfig asserts: the all-to-all overlap hangs on older torch.
OVERLAP_MIN_TORCH = (2, 6)
# Megatron-LM's floors for --delay-wgrad-compute: TE without gradient-accumulation fusion, and
# TE with --overlap-grad-reduce.
DELAY_WGRAD_MIN_TE = "2.7.0"
DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE = "2.8.0"


def _torch_version() -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def _check_expert_parallel_overlap(args: argparse.Namespace) -> None:
    """megatron-core 0.16.1's requirements of overlap_moe_expert_parallel_comm and
    delay_wgrad_compute (TransformerConfig.__post_init__), as flags, plus what this driver
    does not offer (virtual pipeline stages)."""
    overlap = "--overlap-moe-expert-parallel-comm"
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        if args.expert_model_parallel_size < 2:
            raise ValueError(f"{overlap} needs --expert-model-parallel-size > 1 (it hides the expert-parallel "
                             "all-to-all): raise the EP size or drop the flag")
        if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
            raise ValueError(f"{overlap} needs --moe-token-dispatcher-type alltoall or flex, not "
                             f"{args.moe_token_dispatcher_type}")
        if not args.bf16:
            raise ValueError(f"{overlap} needs --bf16 (megatron-core overlaps bf16/fp16 models only): add --bf16")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError(f"{overlap} with --pipeline-model-parallel-size > 1 needs virtual pipeline stages, "
                             "which pretrain_gpt.py does not offer: use --pipeline-model-parallel-size 1")
        if _torch_version() < OVERLAP_MIN_TORCH:
            raise ValueError(f"{overlap} needs torch >= 2.6 (the all-to-all overlap hangs on older versions); "
                             f"this is torch {torch.__version__}: upgrade torch or drop the flag")
    if getattr(args, "delay_wgrad_compute", False):
        delay = "--delay-wgrad-compute"
        if not args.overlap_moe_expert_parallel_comm:
            raise ValueError(f"{delay} needs {overlap} (megatron-core computes the delayed weight gradients in "
                             f"its overlapped schedule): add {overlap}")
        if args.transformer_impl != "transformer_engine":
            raise ValueError(f"{delay} needs --transformer-impl transformer_engine (megatron-core's own layers "
                             "compute weight gradients at once)")
        from megatron.moe_patches import capabilities
        from packaging.version import Version

        te = capabilities.te_version()  # None where TE cannot be imported: checked on the GPU machine
        if te is not None and te < Version(DELAY_WGRAD_MIN_TE) and not args.gradient_accumulation_fusion:
            raise ValueError(f"{delay} with --no-gradient-accumulation-fusion needs Transformer Engine >= "
                             f"{DELAY_WGRAD_MIN_TE}; this is {te}: upgrade TE or drop one of the flags")
        if te is not None and args.overlap_grad_reduce and te < Version(DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE):
            raise ValueError(f"{delay} with --overlap-grad-reduce needs Transformer Engine >= "
                             f"{DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE}; this is {te}: upgrade TE or drop "
                             "--overlap-grad-reduce")


def _check_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    """megatron-core's process grids: TP x PP x DP and ETP x EP x PP x expert-DP both tile the world."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # megatron-core's default: the TP size
    grids = [
        (tp * pp, f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"),
        (etp * ep * pp, f"--expert-tensor-parallel-size {etp}"
         f"{'' if args.expert_tensor_parallel_size else ' (the TP size by default)'} x "
         f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}"),
    ]
    for ranks, product in grids:
        if ranks > world_size:
            raise ValueError(
                f"{product} = {ranks} ranks, more than the world size {world_size} (WORLD_SIZE, the ranks "
                f"launched): launch at least {ranks} ranks or lower the sizes"
            )
        if world_size % ranks:
            raise ValueError(
                f"{product} = {ranks} does not divide the world size {world_size} (WORLD_SIZE, the ranks "
                f"launched): launch a multiple of {ranks} ranks or change the sizes"
            )


def driver_traits(args: argparse.Namespace) -> LoopTraits:
    """What this loop runs inside a captured iteration (``graph_scopes.full_iteration_loop_refusal``)."""
    return LoopTraits(host_nan_check=bool(args.check_for_nan_in_loss_and_grad),
                      batch_rampup=args.rampup_batch_size is not None)


def driver_request(args: argparse.Namespace, given_shape: Optional[dict] = None,
                   te_available: Optional[bool] = None) -> PreflightRequest:
    """The driver's args as the preflight's request: the TransformerConfig ``training.setup``
    builds (patch fields included), this loop's traits and --load. ``given_shape``: the args as
    given, before derived sizes were filled in (the checkpoint's shape rule tells them apart).

    ``te_available`` None: probe it; without TE the fields whose megatron-core checks ask it wait
    for ``setup()`` (``preflight.TE_PROBED_FIELDS``), and without a visible CUDA device so does
    the MoE graph rule of an EP > 1 config (it asks whether F12's exchange runs on this device).
    """
    kwargs = transformer_config_kwargs(args)
    if torch.cuda.is_available():  # config checks may ask the GPU: this rank's, not GPU 0 for all
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    checkpoint = CheckpointPolicy(root=args.load,
                                  exit_on_missing=bool(getattr(args, "exit_on_missing_checkpoint", False)),
                                  model_args_from_checkpoint=bool(args.use_checkpoint_args),
                                  load_optimizer=not getattr(args, "no_load_optim", False))
    return PreflightRequest(
        config_class=compat.config_class(),  # megatron-core's own where the patch set does not install
        config_kwargs=kwargs, loop=driver_traits(args), checkpoint=checkpoint,
        run_args=vars(args) if given_shape is None else given_shape, te_available=te_available,
        device_rules_at_start_up=True,
        words=DriverWords(null_tokenizer=args.tokenizer_type == megatron_lm_flags.NULL_TOKENIZER))


def plan_lines(verdict: Verdict) -> List[str]:
    """--print-plan: the plan (``plan.plan_for``) of the config the verdict holds (this run's, on
    this machine), one decision a line."""
    plan = verdict.plan
    if plan is None:
        return ["no MoE layer (--num-experts is not set): nothing to plan"]
    return list(plan.lines())


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def same_named(args: argparse.Namespace, names) -> dict:
    """{name: the value of the flag of that dest} for each of ``names``: the config fields
    that take a flag's value as it is."""
    return {name: getattr(args, name) for name in names}


# TransformerConfig fields that take the flag of the same dest as it is (transformer_config_kwargs
# gives the others, each worked out from the flags, by name); with --num-experts, the MoE ones.
SAME_NAMED_CONFIG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups",  # None (multi-head) without --group-query-attention
    "kv_channels", "normalization", "qk_layernorm", "init_method_std", "hidden_dropout", "attention_dropout",
    "transformer_impl", "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "sequence_parallel", "bf16", "deterministic_mode", "gradient_accumulation_fusion",
    "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "cuda_graph_impl", "cuda_graph_warmup_steps",
    # Megatron-LM's fusion switches that core_transformer_config_from_args passes as they are
    "masked_softmax_fusion", "bias_dropout_fusion", "attention_softmax_in_fp32",
)
SAME_NAMED_MOE_CONFIG_FIELDS = (
    "moe_router_topk", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_permute_fusion", "moe_router_pre_softmax",
    "moe_router_padding_for_quantization", "moe_shared_expert_intermediate_size",
)


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """TransformerConfig constructor kwargs from the parsed args."""
    kwargs = dict(
        same_named(args, (*SAME_NAMED_CONFIG_FIELDS, *CONFIG_FIELD_FLAGS)),
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        cuda_graph_scope=args.cuda_graph_scope or [],  # [] the whole layer ("full" is deprecated)
        recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
        # Megatron-LM's fusion switches, as core_transformer_config_from_args reads them
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else bias_gelu_fusion(args),
        apply_rope_fusion=apply_rope_fusion(args),
    )
    if args.fp8_format:
        kwargs.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_wgrad=args.fp8_wgrad,
                      **same_named(args, FP8_CONFIG_FIELD_FLAGS))
    if args.num_experts is not None:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            **same_named(args, (*SAME_NAMED_MOE_CONFIG_FIELDS, *MOE_CONFIG_FIELD_FLAGS)),
        )
    kwargs.update(config_kwargs_from_args(args))
    return compat.fit_config_kwargs(kwargs)
