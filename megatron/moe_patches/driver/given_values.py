"""The values of the flags as given, before any rule derives others from them: every integer
flag's range (``INT_RANGES``), the domain of every float the driver passes on, and the paths
that may not be empty. A refusal names the flag the user set."""

import argparse
import math
from typing import Dict, List, NamedTuple, Optional, Tuple

from megatron.moe_patches.driver.parser import flag_of
from megatron.moe_patches.fields import shown

class IntRange(NamedTuple):
    """The values an integer flag takes: ``low`` .. ``high``; ``why`` says where ``high`` comes from."""

    low: Optional[int]  # None: judged by the patch set's own checks, which say more
    high: int
    why: str


INT32_MAX = 2**31 - 1
# Sizes and counts: at least 1 (0 would divide by zero or build nothing), and 32-bit, as the
# GEMM, attention and communication kernels take their sizes (and a larger one is no real run).
SIZE = IntRange(1, INT32_MAX, "2**31 - 1, the largest size the kernels take")
STEPS = IntRange(0, INT32_MAX, "2**31 - 1")
# Sample counts are no kernel sizes: a 15 T-token run at sequence 4096 takes 3.7 B samples
# (Megatron-LM takes them); megatron-core counts consumed samples in int64.
INT64_MAX = 2**63 - 1
SAMPLE_COUNT = IntRange(1, INT64_MAX, "2**63 - 1, the largest 64-bit count")
# The patch flags: config.validate_moe_patch_config refuses values below 1 (before start-up too).
PATCH_SIZE = IntRange(None, INT32_MAX, SIZE.why)
# Every integer flag the driver runs with (tests check that none is missing); unset (None)
# is not judged. The refused flags take one value only (megatron_lm_flags).
INT_RANGES: Dict[str, IntRange] = {
    **dict.fromkeys((
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "seq_length", "max_position_embeddings", "vocab_size", "rotary_base", "recompute_num_layers",
        "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk",
        "moe_shared_expert_intermediate_size", "moe_deepep_num_sms", "moe_hybridep_num_sms",
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "fp8_amax_history_len", "micro_batch_size", "global_batch_size",
        "train_iters", "lr_decay_iters", "log_interval", "save_interval", "eval_interval",
    ), SIZE),
    **dict.fromkeys(("train_samples", "lr_decay_samples"), SAMPLE_COUNT),
    **dict.fromkeys(("moe_mlp_glu_interleave_size", "moe_hybridep_num_blocks_permute",
                     "moe_hybridep_num_blocks_unpermute"), PATCH_SIZE),
    "lr_warmup_iters": STEPS,
    "lr_warmup_samples": IntRange(0, INT64_MAX, SAMPLE_COUNT.why),
    "eval_iters": STEPS,  # 0: no evaluation
    "rampup_batch_size": STEPS,  # each of START INCREMENT SAMPLES; START and INCREMENT >= 1 in check_args
    "cuda_graph_warmup_steps": STEPS,  # below 0 the capture step never comes
    "fp8_margin": IntRange(0, 127, "the scaling factor is divided by 2**margin in fp32, which ends at 2**127"),
    "timing_log_level": IntRange(0, 2, "Megatron-LM's levels"),
    # megatron-core's datasets seed their shuffle (numpy) with it: 0 .. 2**32 - 1; the torch
    # seeds it also makes (seed + 2718 + rank, ...) fit torch's 64-bit range then.
    "seed": IntRange(0, 2**32 - 1, "2**32 - 1, the largest seed the data shuffle takes"),
}
# The domain of every float the driver passes on (megatron-core checks none of them): finite, and
NOT_NEGATIVE = ("lr_warmup_iters", "lr_warmup_samples", "lr", "min_lr", "weight_decay", "clip_grad", "moe_aux_loss_coeff",
                "moe_z_loss_coeff", "moe_router_bias_update_rate")
# [0, 1); a warmup of the whole decay would leave no decay (refused below, as Megatron-LM does)
FRACTIONS = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2", "lr_warmup_fraction")
POSITIVE_FLOATS = ("init_method_std", "adam_eps", "layernorm_epsilon", "embedding_init_method_std",
                   "moe_expert_capacity_factor", "moe_router_topk_scaling_factor", "moe_input_jitter_eps")
# (0, 1]: RoPE rotates a share of each head's channels, at least one
UP_TO_ONE = ("rotary_percent",)
# Flags that name a file or directory: an empty value (an unset shell variable) is refused, never
# read as "not given" (an empty --yaml-cfg would otherwise run without the recipe); so is a NUL
# character (a recipe's "\0"), which no path the OS takes holds: os calls raise on it mid-run.
PATH_FLAGS = ("yaml_cfg", "save", "load", "data_path", "data_cache_path", "tensorboard_dir")


def _values(args: argparse.Namespace, names) -> List[Tuple[str, object]]:
    """(name, value) for each value the flags hold: every entry of a list (--moe-aux-loss-coeff
    takes one per load-balancing type), none where unset."""
    pairs = []
    for name in names:
        value = getattr(args, name, None)
        pairs += [(name, item) for item in (value if isinstance(value, list) else [value]) if item is not None]
    return pairs


def _check_int_range(name: str, value: int) -> None:
    limits = INT_RANGES[name]
    if limits.low is not None and value < limits.low:
        raise ValueError(f"{flag_of(name)} {shown(value)}: must be at least {limits.low}")
    if value > limits.high:
        raise ValueError(f"{flag_of(name)} {shown(value)}: must be at most {limits.high} ({limits.why})")


def _check_path(args: argparse.Namespace, name: str) -> None:
    value = getattr(args, name, None)
    if value is None:
        return
    entries = value if isinstance(value, list) else [value]
    if not entries or any(not str(entry).strip() for entry in entries):
        given = "with no value" if not entries else shown(repr(value))
        raise ValueError(f"{flag_of(name)} {given}: an empty path (an unset shell variable?): give the "
                         f"{'dataset prefixes' if name == 'data_path' else 'path'}, or drop the flag")
    if any("\0" in str(entry) for entry in entries):
        raise ValueError(f"{flag_of(name)} {shown(repr(value))}: a path with a NUL character, which no file name "
                         "holds: write the path without it")


def given_value_problems(args: argparse.Namespace) -> List[str]:
    """The values as given, before any rule derives others from them: a refusal names the flag
    the user set (a NaN --lr-warmup-fraction, not the --lr-warmup-iters it would become). Every
    problem, one message per flag."""
    return _path_problems(args) + _range_problems(args)


def check_given_values(args: argparse.Namespace) -> None:
    """``given_value_problems``: ValueError for the first."""
    problems = given_value_problems(args)
    if problems:
        raise ValueError(problems[0])


def _path_problems(args: argparse.Namespace) -> List[str]:
    problems = []
    for name in PATH_FLAGS:
        try:
            _check_path(args, name)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _range_problems(args: argparse.Namespace) -> List[str]:
    """One message for each flag with a value out of its domain (the first such value of a
    list flag), in the order of the checks: integer ranges, then finite, not negative,
    fractions, above 0."""
    found: Dict[str, str] = {}

    def problem(name: str, message: str) -> None:
        found.setdefault(name, message)

    for name, value in _values(args, INT_RANGES):
        try:
            _check_int_range(name, value)
        except ValueError as err:
            problem(name, str(err))
    for name, value in _values(args, NOT_NEGATIVE + FRACTIONS + POSITIVE_FLOATS + UP_TO_ONE):
        if isinstance(value, float) and not math.isfinite(value):
            problem(name, f"{flag_of(name)} {value}: must be a finite number")
    for name, value in _values(args, NOT_NEGATIVE):
        if value < 0:
            problem(name, f"{flag_of(name)} {value}: must not be negative")
    for name, value in _values(args, FRACTIONS):
        if not 0 <= value < 1:
            problem(name, f"{flag_of(name)} {value}: must be at least 0 and below 1")
    for name, value in _values(args, POSITIVE_FLOATS):
        if value <= 0:
            problem(name, f"{flag_of(name)} {value}: must be above 0")
    for name, value in _values(args, UP_TO_ONE):
        if not 0 < value <= 1:
            problem(name, f"{flag_of(name)} {value}: must be above 0 and at most 1")
    return list(found.values())


def check_ranges(args: argparse.Namespace) -> None:
    problems = _range_problems(args)
    if problems:
        raise ValueError(problems[0])
