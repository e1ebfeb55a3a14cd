"""pretrain_gpt.py's arguments: Megatron-LM 0.16.1's flags and defaults, recipes, checks,
config mapping.

The flags the driver runs are defined here with Megatron-LM's names and defaults; its
other flags come from ``megatron_lm_flags``, which refuses each by name where it asks
for what the driver does not do. ``parse_args`` = defaults < ``--yaml-cfg`` recipe <
command line, then, before any CUDA or NCCL work: the checks of each setting on its own,
every problem found and all printed together (the recipe's keys, ``all_refusals`` of those
flags, ``given_value_problems``: empty paths, integer ranges, float domains); then, where there
is none, ``check_environment`` (the variables the run reads), ``apply_megatron_lm_rules`` (what
Megatron-LM makes of the flags as given), ``check_load`` (what ``--load`` holds;
``--use-checkpoint-args`` takes the checkpoint's model args here, else its model shape must be
this run's), ``check_args``
(Megatron-LM's required flags, ``INT_RANGES``, contradictions, parallel sizes against
``WORLD_SIZE``, the data files and output directories) and ``validate_config`` (the full
TransformerConfig with the patch fields, built as ``training.setup`` builds it). Every
refusal is one ``pretrain_gpt.py: error: ...`` line on stderr (more lines only where there
are several problems) naming the flags and the fix, with exit status 2 and no traceback; a
long value it echoes is shortened (``fields.shown``). ``--help`` and the errors of argparse, the
recipe reader and the checks of each setting on its own come before megatron-core is imported,
so they answer without its seconds of imports (a recipe's section key that no flag sets is
looked up among TransformerConfig's fields, which imports it); ``--attention-backend`` holds the
member's name (``megatron_lm_flags.AttnBackendName``) until just before ``validate_config``.
``transformer_config_kwargs`` maps the args to megatron-core's TransformerConfig
(patched by ``apply()``, so the MoE patch fields are accepted; on a megatron-core the
patch set does not install into, its own class, with the kwargs
``compat.fit_config_kwargs`` fits to it). The training loop and ``main`` are in
``driver.training``, which imports this module (never the reverse).
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import sys
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.driver import checkpointing, compat, megatron_lm_flags
from megatron.moe_patches.driver.patch_args import CHECKPOINT_RESTORED_ARGS, add_moe_patch_args, config_kwargs_from_args
from megatron.moe_patches.graph_scopes import (CAPTURED_SCOPES, GraphScope, LoopTraits, full_iteration_loop_refusal,
                                               scope_names)
from megatron.moe_patches.fields import DEVICE_SPLITS_ENV_ALIAS, SHOWN_LIMIT, env_switch, flag_name, shown
from megatron.moe_patches.driver.recipes import FIELD_ALIASES, Recipe, RecipeError, UnknownKey, apply_recipe, load_recipe
from megatron.moe_patches.version import __version__

# Megatron-LM's fusion switches: (flag, dest, what it fuses). On by default, as in Megatron-LM;
# transformer_config_kwargs gives them to the config as core_transformer_config_from_args does.
FUSION_FLAGS = (
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", "the attention's scaling, masking and softmax"),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", "the MLP's bias and GeLU"),
    ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "the MLP's bias and SwiGLU (--swiglu)"),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", "each layer's bias, dropout and residual add"),
    ("--no-rope-fusion", "apply_rope_fusion", "RoPE (--position-embedding-type rope; Transformer Engine's kernel)"),
)

# driver_flags.jsonl, one JSON object a flag, in --help order: "group" (its --help section),
# "flags" (the option strings), then add_argument's other arguments as they are, except
# "type" by name (_FLAG_TYPES), "choices" as a list or {"table": NAME} (a tuple of
# megatron_lm_flags) and a --attention-backend default {"attention_backend": member}. A row
# {"group": ..., "rows_of": "FUSION_FLAGS"} stands for the fusion switches of FUSION_FLAGS.
FLAG_TABLE = os.path.join(os.path.dirname(__file__), "driver_flags.jsonl")


@functools.lru_cache(maxsize=None)
def _flag_table() -> Tuple[dict, ...]:
    with open(FLAG_TABLE, encoding="utf-8") as table:
        return tuple(json.loads(line) for line in table)


def _flag_types(names: bool) -> dict:
    """Type names to callables; with ``names`` --attention-backend holds the member's name until
    ``megatron_lm_flags.resolve_names`` (megatron-core not imported yet)."""
    backend = megatron_lm_flags.attention_backend_name if names else megatron_lm_flags.attention_backend
    return {"int": int, "float": float, "attention_backend": backend}


def _add_argument_kwargs(row: dict, names: bool) -> dict:
    """add_argument's keyword arguments of a row of the flag table."""
    kwargs = {key: value for key, value in row.items() if key not in ("group", "flags")}
    if "type" in kwargs:
        kwargs["type"] = _flag_types(names)[kwargs["type"]]
    if isinstance(kwargs.get("choices"), dict):
        kwargs["choices"] = getattr(megatron_lm_flags, kwargs["choices"]["table"])
    if isinstance(kwargs.get("default"), dict):
        member = megatron_lm_flags.AttnBackendName(kwargs["default"]["attention_backend"])
        kwargs["default"] = member if names else member.value()
    elif isinstance(kwargs.get("default"), list):
        kwargs["default"] = list(kwargs["default"])  # each parser its own
    if isinstance(kwargs.get("metavar"), list):
        kwargs["metavar"] = tuple(kwargs["metavar"])  # argparse names each value of a tuple
    return kwargs


def _fusion_switches() -> Tuple[Tuple[Tuple[str, ...], dict], ...]:
    return tuple(((flag,), dict(action="store_false", dest=dest,
                                help=f"Compute {what} unfused (Megatron-LM's flag; fused by default, as there)."))
                 for flag, dest, what in FUSION_FLAGS)


def _add_standard_args(parser: argparse.ArgumentParser, names: bool = False) -> None:
    """The driver's own flags from its table, by --help group; ``names`` as in ``_build_parser``."""
    groups = {}
    for row in _flag_table():
        if row["group"] not in groups:
            groups[row["group"]] = parser.add_argument_group(row["group"])
        if row.get("rows_of") == "FUSION_FLAGS":
            rows = _fusion_switches()
        else:
            rows = ((tuple(row["flags"]), _add_argument_kwargs(row, names)),)
        for option_strings, kwargs in rows:
            groups[row["group"]].add_argument(*option_strings, **kwargs)


class DriverHelpFormatter(argparse.HelpFormatter):
    """``--help`` ends each flag's help with ``(default: VALUE)`` where the default is a value.

    Switches (``store_true``) and flags whose default is None or an empty list (unset) print
    none: their help says what happens without them.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS, []):
            return help_text
        return f"{help_text} (default: %(default)s)"


# A run of characters long enough to be an echoed value, not a word of a message.
_LONG_VALUE = re.compile(r"[^\s'\"]{%d,}" % (SHOWN_LIMIT + 1))


def shorten_long_values(message: str) -> str:
    """``message`` with every over-long value in it shortened as ``shown`` does (argparse's
    own messages echo what was typed whole)."""
    return _LONG_VALUE.sub(lambda match: shown(match.group(0)), message)


class DriverArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``prog: error: message`` on stderr, exit status 2.

    argparse would print the usage of every flag (some 70 lines) above the message first;
    ``--help`` still lists them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: List[str] = []  # problems found before argparse reads the command line

    def error(self, message: str):
        self.errors(self.pending + [message])

    def errors(self, messages: List[str]):
        """All of ``messages`` at once: one ``prog: error: ...`` line each (more where a message
        has several lines), exit status 2."""
        self.exit(2, "".join(f"{self.prog}: error: {shorten_long_values(message)}\n" for message in messages))


PROG = "pretrain_gpt.py"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The driver's parser; ``prog``: the command the user ran, which the usage, error and
    warning lines name (``megatron-moe-pretrain`` for the console script)."""
    return _build_parser(prog)


def _build_parser(prog: str, names: bool = False) -> argparse.ArgumentParser:
    """``build_parser``; with ``names``, the parser ``parse_args`` reads the command line and the
    recipe with: --attention-backend holds an ``AttnBackendName`` (the same flag, default, help
    and errors) until ``megatron_lm_flags.resolve_names``, so that ``--help`` and the errors
    argparse and the recipe reader report come before megatron-core is imported."""
    parser = DriverArgumentParser(
        prog=prog,
        description="GPT/MoE pretraining on megatron-core with the MoE patch set applied.",
        epilog="Megatron-LM 0.16.1's other flags are read as Megatron-LM reads them; one that asks for what "
        "this driver does not do is an error that says why (driver/megatron_lm_flags.jsonl lists them all).",
        formatter_class=DriverHelpFormatter,
        allow_abbrev=False,
    )
    _add_standard_args(parser, names)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="Print this package's version and exit.")
    megatron_lm_flags.add_refused_flags(parser)
    return add_moe_patch_args(parser)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:  # check_environment refuses it; warnings before that print anyway
        return 0


def _launcher_int(name: str, default: int, low: int, high: Optional[int], what: str) -> int:
    """An integer variable the launcher sets (torchrun), ``default`` where unset; a value
    outside [low, high] is a ValueError naming the variable and ``what`` it must be."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        raise ValueError(f"{name}={shown(value)!r} (set by the launcher) is not {what}")
    return number


def world_size_from_env() -> int:
    """The number of ranks the launcher starts (torchrun sets WORLD_SIZE; a plain run is 1)."""
    return _launcher_int("WORLD_SIZE", 1, 1, None, "a positive integer")


# The package's on/off environment variables (fields.env_switch reads them).
ENV_SWITCHES = (DEVICE_SPLITS_ENV_ALIAS,)
# With --deterministic-mode the driver sets these where they are unset; a value already set
# that allows non-deterministic kernels would win without a word.
DETERMINISTIC_ENV = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
}


def _check_deterministic_env() -> None:
    for name, accepted in DETERMINISTIC_ENV.items():
        value = os.environ.get(name)
        if value is not None and value not in accepted:
            raise ValueError(f"{name}={shown(value)!r} with --deterministic-mode: the run would not be "
                             f"deterministic; set {' or '.join(accepted)}, or unset it (the driver then sets it)")


def check_environment(args: argparse.Namespace) -> int:
    """The environment variables the run reads, judged before start-up: the launcher's
    ranks, the package's switches, and the determinism settings of --deterministic-mode.
    Returns the world size."""
    world = world_size_from_env()
    if world > 1 and "RANK" not in os.environ:
        # Each process would take rank 0 and wait for the others at the rendezvous forever.
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: start the {world} processes with torchrun "
                         f"(torchrun --nproc-per-node {world} ...), which sets RANK, LOCAL_RANK, MASTER_ADDR and "
                         "MASTER_PORT for each, or unset WORLD_SIZE for one process")
    for name in ("RANK", "LOCAL_RANK"):
        _launcher_int(name, 0, 0, world - 1, f"a rank from 0 to {world - 1} (WORLD_SIZE {world})")
    _launcher_int("MASTER_PORT", 0, 1, 65535, "a TCP port (1 to 65535)")
    _check_launcher_node(world)
    for name in ENV_SWITCHES:
        env_switch(name)
    if args.deterministic_mode:
        _check_deterministic_env()
    _check_symmetric_exchange_node(args, world)
    return world


def _check_launcher_node(world: int) -> None:
    """The launcher's node variables, where set, as torchrun sets them: LOCAL_WORLD_SIZE ranks on
    this node (1 to WORLD_SIZE), LOCAL_RANK (the GPU each rank takes) below it, and a MASTER_ADDR
    that names a host (an empty one fails the rendezvous at start-up)."""
    per_node = _launcher_int("LOCAL_WORLD_SIZE", world, 1, world, f"a rank count from 1 to {world} (WORLD_SIZE {world})")
    local = _launcher_int("LOCAL_RANK", 0, 0, None, "a rank")
    if local >= per_node:
        raise ValueError(f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={per_node} (set by the launcher): the local rank "
                         "must be below the ranks per node; launch with torchrun, which sets both")
    address = os.environ.get("MASTER_ADDR")
    if address is not None and not address.strip():
        raise ValueError(f"MASTER_ADDR={address!r} (set by the launcher) is empty: set the host of rank 0, or unset it "
                         "on one node (the driver then uses 127.0.0.1)")
    if address is not None and any(char.isspace() for char in address):
        raise ValueError(f"MASTER_ADDR={shown(address)!r} (set by the launcher) holds white space, so it names no "
                         "host: set the host name or address of rank 0, or unset it on one node (the driver then "
                         "uses 127.0.0.1)")
    _check_visible_gpus(per_node)


def _check_visible_gpus(per_node: int) -> None:
    """Each of the node's ranks takes its own GPU (LOCAL_RANK indexes the visible ones): a
    CUDA_VISIBLE_DEVICES that names fewer leaves the last ranks without one, found only at
    start-up. Unset or empty (no GPU: the GPU check says so) is not judged here."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return
    count = len(visible.split(","))
    if count < per_node:
        gpus = f"{count} GPU{'s' if count > 1 else ''}"
        raise ValueError(f"CUDA_VISIBLE_DEVICES={shown(visible)!r} names {gpus}, but the launcher starts {per_node} "
                         f"ranks on this node (LOCAL_WORLD_SIZE), one GPU each: name at least {per_node} GPUs, or "
                         f"start at most {count} ranks per node")


def _check_symmetric_exchange_node(args: argparse.Namespace, world: int) -> None:
    """--moe-symmetric-exchange maps the expert-parallel peers' GPU memory: an expert group must lie
    within one node, i.e. expert TP x EP ranks (consecutive in megatron-core's rank order) within the
    launcher's ranks per node (LOCAL_WORLD_SIZE)."""
    if not getattr(args, "moe_symmetric_exchange", False) or args.expert_model_parallel_size == 1:
        return
    per_node = _launcher_int("LOCAL_WORLD_SIZE", world, 1, world, f"a rank count from 1 to {world}")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    group = etp * args.expert_model_parallel_size
    if group > per_node or per_node % group:
        ep = args.expert_model_parallel_size
        raise ValueError(f"--moe-symmetric-exchange with --expert-model-parallel-size {ep} (x expert TP {etp}) "
                         "needs each expert-parallel group on one node, but the launcher starts "
                         f"{per_node} ranks per node (LOCAL_WORLD_SIZE): use an EP of at most "
                         f"{max(per_node // etp, 1)} that divides it, or drop --moe-symmetric-exchange "
                         "(NCCL's all-to-all crosses nodes)")


def parse_args(argv: Optional[List[str]] = None, prog: str = PROG) -> argparse.Namespace:
    """Parse and validate pretrain_gpt.py's arguments; exits with status 2 on bad input.

    Everything here runs before any CUDA or NCCL work, so no bad input reaches a GPU.
    ``prog``: the command the user ran, named by the usage, error and warning lines.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(prog, names=True)  # megatron-core: imported by the checks that need it
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
        if _rank() == 0:
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
        check_load(args, warn)
        check_args(args, world_size=world_size)
        megatron_lm_flags.resolve_names(args)  # --attention-backend: megatron-core's AttnBackend member
        validate_config(args)
        check_grouped_expert_fusions(args)  # megatron-core's asserts there: after the patch set's rules
    except ValueError as err:
        parser.error(str(err))
    if parser.pending:
        parser.errors(parser.pending)
    return args


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
    """What Megatron-LM makes of the flags as given, once, before ``check_load`` takes any
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
            raise ValueError(f"--lr-warmup-fraction and {_flag(run.warmup)} both set the warmup: give one")
        decay = getattr(args, run.decay) or getattr(args, run.length)
        if decay is not None:  # a missing run length is reported by check_args
            setattr(args, run.warmup, args.lr_warmup_fraction * decay)  # Megatron-LM's warmup steps
    if args.eval_interval is None and args.eval_iters not in (0, megatron_lm_flags.BY_NAME["--eval-iters"].default):
        # Megatron-LM 0.16.1 sizes the validation data by --eval-interval and stops without it
        raise ValueError(f"--eval-iters {args.eval_iters} needs --eval-interval (how often to evaluate): "
                         "add it, or drop --eval-iters")


def check_load(args: argparse.Namespace, warn: Callable[[str], None] = print) -> Optional[str]:
    """What ``--load`` holds, decided before start-up (Megatron-LM's rules).

    No checkpoint there (no such directory, an empty one, no tracker file): one warning
    and training starts from scratch, or an error with ``--exit-on-missing-checkpoint``
    and with ``--use-checkpoint-args``. A ``--load`` that is a file, or a tracker that does
    not name a saved iteration, is an error naming the file. With ``--use-checkpoint-args``
    the checkpoint's model args are taken here, each of a type its flag gives; without it, a
    checkpoint whose saved args give the model other shapes (``MODEL_SHAPE``) is refused.
    Returns the checkpoint directory or None.
    """
    if not args.load:
        if getattr(args, "use_checkpoint_args", False):
            raise ValueError("--use-checkpoint-args needs --load (the checkpoint directory)")
        return None
    path, missing = checkpointing.find_checkpoint(args.load)
    if path is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise checkpointing.missing_checkpoint_refusal(args.load, missing)
        if args.use_checkpoint_args:
            raise ValueError(
                f"--use-checkpoint-args: --load {args.load} has no checkpoint to take the args from ({missing}); "
                "point --load at a checkpoint directory or drop --use-checkpoint-args"
            )
        warn(f"--load {args.load}: {missing}; training starts from scratch "
             "(--exit-on-missing-checkpoint makes this an error)")
        return None
    if args.use_checkpoint_args:
        saved = checkpointing.saved_args(args.load)
        _check_saved_types(saved, [*checkpointing.MODEL_ARGS, *(arg.name for arg in CHECKPOINT_RESTORED_ARGS)], path,
                           "drop --use-checkpoint-args and give the model flags, or point --load at another checkpoint")
        taken = checkpointing.restore_args(args, saved)
        if _rank() == 0:
            print(f"--use-checkpoint-args: took {sorted(taken)} from {path}", flush=True)
    else:
        saved = checkpointing.args_saved_at(path)
        if saved is not None:  # a checkpoint saved without args has no shape to compare
            _check_saved_types(saved, MODEL_SHAPE, path, "point --load at another checkpoint")
            _check_model_shape(args, saved, path)
    # the refusal the optimizer's load would raise after start-up, said before it
    refusal = None if getattr(args, "no_load_optim", False) else checkpointing.optimizer_layout_refusal(path, args)
    if refusal is not None:
        raise ValueError(refusal)
    return path


def _ffn_default(values: dict) -> Optional[int]:
    hidden = values.get("hidden_size")
    if hidden is None:
        return None
    return megatron_lm_ffn_hidden_size(argparse.Namespace(hidden_size=hidden, swiglu=bool(values.get("swiglu"))))


def _kv_channels_default(values: dict) -> Optional[int]:
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    return hidden // heads if hidden and heads and hidden % heads == 0 else None


def _shape_value(values: dict, name: str):
    """The value of the shape arg ``name`` the model is built with, from a run's or a checkpoint's args."""
    value = values.get(name)
    return MODEL_SHAPE[name](values) if value is None and MODEL_SHAPE[name] is not None else value


# The args that fix the shapes of the model's tensors (``on_disk.MODEL_SHAPE_ARGS``, both loops'
# list) and the vocabulary, each with the value the model is built with where it is unset (a
# function of the other args), or None: unset is no such size (no experts, no shared expert),
# or, for the required flags, not given (check_args says so). A checkpoint of other shapes is
# another model: megatron-core also loads an embedding table of another vocabulary without a
# word (the rows both have, the rest zeros).
_BUILT_WITH_WHEN_UNSET: Dict[str, Callable[[dict], object]] = {
    "ffn_hidden_size": _ffn_default,
    "num_query_groups": lambda values: values.get("num_attention_heads"),  # unset: one per head
    "kv_channels": _kv_channels_default,
    "moe_ffn_hidden_size": lambda values: _shape_value(values, "ffn_hidden_size") if values.get("num_experts") else None,
}
# vocab_size: the token ids, end of document included (the embedding table's rows, unpadded)
MODEL_SHAPE: Dict[str, Optional[Callable[[dict], object]]] = {
    name: _BUILT_WITH_WHEN_UNSET.get(name) for name in (*on_disk.MODEL_SHAPE_ARGS, "vocab_size")}


def _check_model_shape(args: argparse.Namespace, saved: dict, path: str) -> None:
    """Refuse a checkpoint whose saved args give the model another shape than this run's flags.
    Compared: each ``MODEL_SHAPE`` arg the checkpoint saved. A value the run derives (it did
    not give the flag) is not reported where the checkpoint's own args derive the saved one, or
    where the run has no such size: the flags it derives from differ, and are reported."""
    run = vars(args)
    null_tokenizer = args.tokenizer_type == megatron_lm_flags.NULL_TOKENIZER
    differences = []
    for name, default in MODEL_SHAPE.items():
        if name not in saved:
            continue  # saved before the arg existed
        saved_value, run_value = _shape_value(saved, name), _shape_value(run, name)
        if default is None and name in REQUIRED and (saved_value is None or run_value is None):
            continue
        derived = run[name] is None and default is not None
        if saved_value == run_value or (derived and (run_value is None or default(saved) == saved_value)):
            continue
        shown_values = []
        for value in (saved_value, run_value):
            if isinstance(value, bool):
                value = "on" if value else "off"
            elif name == "vocab_size" and null_tokenizer and isinstance(value, int):
                value -= 1  # as this run's --vocab-size counts it (NullTokenizer adds the end of document)
            shown_values.append("none" if value is None else _saved_text(value))
        differences.append(f"{_flag(name)} {shown_values[0]}, this run has {shown_values[1]}")
    if differences:
        raise ValueError(f"--load {path} was saved with {'; '.join(differences)}: give the same model flags, or "
                         "--use-checkpoint-args to take them from the checkpoint")


def _saved_text(value, typed: bool = False) -> str:
    """A value from a checkpoint's args as a message shows it, never built whole where it may be
    long: a str (quoted where ``typed``) or a number of at most 64 bits shortened as ``shown``
    does; anything else by its type only. ``typed``: with its type."""
    kind = type(value).__name__
    if isinstance(value, (str, float)) or (isinstance(value, int) and value.bit_length() <= 64):
        text = repr(shown(value)) if isinstance(value, str) and typed else shown(value)
        return f"{text} (type {kind})" if typed else text
    return f"of type {kind}"


# What a saved arg of a flag of each type may hold (a bool is no number here), and its name.
SAVED_TYPES = {int: (int, "an int"), float: ((int, float), "a number"), str: (str, "a str")}


def _check_saved_types(saved: dict, names, path: str, fix: str) -> None:
    """Refuse a checkpoint whose saved args hold, for one of ``names``, a value its flag could not
    give: another type (a str where an int belongs, an int for an on/off flag) or a value not
    among the flag's choices. Unset (None) is no value."""
    actions = _parser_actions()
    for name in names:
        value, action = saved.get(name), actions.get(name)
        if value is None or action is None:
            continue
        if action.nargs == 0:
            wanted, fits = "on/off (a bool)", isinstance(value, bool)
        elif action.type in SAVED_TYPES:
            types, wanted = SAVED_TYPES[action.type]
            fits = isinstance(value, types) and not isinstance(value, bool)
        else:
            wanted, fits = "", True
        if fits and action.choices is not None:
            wanted, fits = f"one of {', '.join(map(str, action.choices))}", value in action.choices
        if not fits:
            raise ValueError(f"--load {path} was saved with {_flag(name)} {_saved_text(value, typed=True)}, "
                             f"which is not {wanted}: its saved args are not ones "
                             f"pretrain_gpt.py reads; {fix}")


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
        raise ValueError(f"{_flag(name)} {shown(value)}: must be at least {limits.low}")
    if value > limits.high:
        raise ValueError(f"{_flag(name)} {shown(value)}: must be at most {limits.high} ({limits.why})")


def _check_path(args: argparse.Namespace, name: str) -> None:
    value = getattr(args, name, None)
    if value is None:
        return
    entries = value if isinstance(value, list) else [value]
    if not entries or any(not str(entry).strip() for entry in entries):
        given = "with no value" if not entries else shown(repr(value))
        raise ValueError(f"{_flag(name)} {given}: an empty path (an unset shell variable?): give the "
                         f"{'dataset prefixes' if name == 'data_path' else 'path'}, or drop the flag")
    if any("\0" in str(entry) for entry in entries):
        raise ValueError(f"{_flag(name)} {shown(repr(value))}: a path with a NUL character, which no file name "
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
            problem(name, f"{_flag(name)} {value}: must be a finite number")
    for name, value in _values(args, NOT_NEGATIVE):
        if value < 0:
            problem(name, f"{_flag(name)} {value}: must not be negative")
    for name, value in _values(args, FRACTIONS):
        if not 0 <= value < 1:
            problem(name, f"{_flag(name)} {value}: must be at least 0 and below 1")
    for name, value in _values(args, POSITIVE_FLOATS):
        if value <= 0:
            problem(name, f"{_flag(name)} {value}: must be above 0")
    for name, value in _values(args, UP_TO_ONE):
        if not 0 < value <= 1:
            problem(name, f"{_flag(name)} {value}: must be above 0 and at most 1")
    return list(found.values())


def _check_ranges(args: argparse.Namespace) -> None:
    problems = _range_problems(args)
    if problems:
        raise ValueError(problems[0])


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
    length_flag = _flag(RUN_LENGTHS[unit].length)
    for name in other:
        if _is_set(args, name):
            raise ValueError(f"{_flag(name)} with {length_flag}: Megatron-LM counts a run in iterations or in "
                             f"samples, not both: give {length_flag} with "
                             f"{' and '.join(map(_flag, RUN_LENGTHS[unit][1:]))}, or the other unit throughout")
    if unit == "iterations":
        for name in ONLY_SAMPLE_BASED:
            if _is_set(args, name):
                raise ValueError(f"{_flag(name)} with {length_flag}: Megatron-LM ramps the batch size up in "
                                 "sample-based training only: give --train-samples (and --lr-warmup-samples, "
                                 "--lr-decay-samples) instead of --train-iters, or drop it")


def _flag(name: str) -> str:
    """The flag of the dest ``name``, as the user types it."""
    return _dest_flags().get(name, flag_name(name))


def _check_required(args: argparse.Namespace) -> None:
    missing = [" or ".join(map(_flag, REQUIRED_ONE_OF.get(name, (name,)))) for name in REQUIRED
               if all(getattr(args, one, None) is None for one in REQUIRED_ONE_OF.get(name, (name,)))]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (Megatron-LM has no default for "
                         f"{'it' if len(missing) == 1 else 'them'}); give {'it' if len(missing) == 1 else 'them'}"
                         " on the command line or in the --yaml-cfg recipe")


def megatron_lm_ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's --ffn-hidden-size default: 4 x hidden, or with SwiGLU 2/3 of that (its two
    input projections keep the parameter count), rounded down to a multiple of 64."""
    if args.swiglu:
        return int(4 * args.hidden_size * 2 / 3 / 64) * 64
    return 4 * args.hidden_size


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
    _check_ranges(args)
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
    if args.cuda_graph_scope and args.cuda_graph_impl == "none":
        raise ValueError("--cuda-graph-scope needs --cuda-graph-impl local or transformer_engine")
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
            f"{_flag(run.warmup)} {warmup} must be below {_flag(run.decay)} "
            f"{decay} (which defaults to {_flag(run.length)}): shorten the warmup or "
            f"set {_flag(run.decay)}"
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
    _check_split(args)
    _check_validation_split(args)
    _check_data_path(args)
    for name in OUTPUT_DIRS:
        if getattr(args, name, None):
            _check_output_dir(_flag(name), getattr(args, name))


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


# One weight of --split as megatron-core reads it: the digits and dots of the text
# (re.findall("[.0-9]+")); a weight spelled otherwise ("-1", "1e3", "nan") would be read as other weights.
SPLIT_WEIGHT = re.compile(r"[0-9]*\.?[0-9]+|[0-9]+\.")
SPLIT_SEPARATOR = re.compile(r"\s*[,/]\s*")


def _check_split(args: argparse.Namespace) -> None:
    """--split: up to three weights (train, validation, test) separated by commas or slashes, as
    megatron-core reads them (missing ones are 0, as there), not all 0. Any other text megatron-core
    would read as other weights (it skips all but digits and dots), as NaN shares, or stop on."""
    if args.split is None:
        return
    weights = SPLIT_SEPARATOR.split(args.split.strip())
    fix = "give up to three weights (train, validation, test) separated by commas, e.g. 969,30,1"
    if len(weights) > 3 or not all(SPLIT_WEIGHT.fullmatch(weight) for weight in weights):
        raise ValueError(f"--split {shown(args.split)!r}: not weights megatron-core reads as written: {fix}")
    if not sum(float(weight) for weight in weights) > 0:
        raise ValueError(f"--split {shown(args.split)!r}: the weights add up to 0, so no split gets a share: {fix}")
    if float(weights[0]) == 0 and getattr(args, "data_path", None):  # mock data: megatron-core splits it 1,1,1
        raise ValueError(f"--split {shown(args.split)!r} with --data-path: the training split (the first weight) is "
                         "empty, so there is nothing to train on: give it a share, e.g. 969,30,1")


def _check_validation_split(args: argparse.Namespace) -> None:
    """Evaluation reads the validation split: one that --split leaves empty would make
    --eval-interval change nothing (Megatron-LM then skips evaluation without a word)."""
    if not (args.eval_interval and args.eval_iters) or args.split is None:
        return  # no --split: megatron-core splits mock data 1,1,1; --data-path has the legacy split by now
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        weights = parse_and_normalize_split(args.split)
    except (AssertionError, ValueError, ZeroDivisionError):
        return  # not a split megatron-core reads: left to its own refusal at start-up
    if len(weights) < 2 or weights[1] == 0:
        raise ValueError(f"--eval-interval {args.eval_interval} with --split {shown(args.split)}: the validation split "
                         "(the second weight) is empty, so there is nothing to evaluate on: give it a share, "
                         "or drop --eval-interval")


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


def data_blend(data_path: List[str]) -> Tuple[List[str], Optional[List[float]]]:
    """--data-path as Megatron-LM reads it: (prefixes, weights). Weight-prefix pairs where
    the list has an even length and every entry in a weight's place is a number; otherwise
    every entry is a prefix (weights None)."""
    weights = data_path[0::2]
    if len(data_path) % 2 == 0 and all(_is_number(weight) for weight in weights):
        return list(data_path[1::2]), [float(weight) for weight in weights]
    return list(data_path), None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# Megatron's indexed dataset: the tokens in PREFIX.bin, their index in PREFIX.idx.
DATASET_FILES = (".bin", ".idx")


def _check_data_path(args: argparse.Namespace) -> None:
    """Every --data-path prefix names an indexed dataset, and the weights can blend them."""
    if not args.data_path:
        return
    prefixes, weights = data_blend(args.data_path)
    for weight in weights or []:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"--data-path weight {weight}: must be a finite number, at least 0")
    if weights and not sum(weights) > 0:
        raise ValueError("--data-path: every weight is 0; give at least one dataset a positive weight")
    for prefix in prefixes:
        missing = [prefix + ending for ending in DATASET_FILES if not os.path.isfile(prefix + ending)]
        if missing:
            raise ValueError(
                f"--data-path {shown(prefix)}: no indexed dataset there ({', '.join(map(shown, missing))} not "
                "found); give each dataset's path without .bin/.idx, or leave --data-path out for mock data"
            )
        problem = _index_header_problem(prefix + ".idx")
        if problem:
            raise ValueError(f"--data-path {shown(prefix)}: {shown(prefix + '.idx')} {problem}; rebuild the dataset "
                             "with Megatron-LM's tools/preprocess_data.py, or point --data-path at another one")


# megatron-core's indexed-dataset index opens with this magic, then format version 1 (uint64,
# little-endian) and the tokens' dtype code (one byte, 1-8).
INDEX_MAGIC = b"MMIDIDX\x00\x00"


def _index_header_problem(path: str) -> Optional[str]:
    """Why ``path`` is no megatron-core dataset index (its first 18 bytes read), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(INDEX_MAGIC) + 9)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not head.startswith(INDEX_MAGIC):
        return "is not a megatron-core dataset index (its first bytes are not the index header)"
    if len(head) < len(INDEX_MAGIC) + 9:
        return "ends inside its header"
    version = int.from_bytes(head[len(INDEX_MAGIC):len(INDEX_MAGIC) + 8], "little")
    dtype_code = head[-1]
    if version != 1 or not 1 <= dtype_code <= 8:
        return f"has index format version {version} and dtype code {dtype_code} (megatron-core reads version 1, codes 1-8)"
    return None


# Directories the run writes into (made when it first writes).
OUTPUT_DIRS = ("save", "tensorboard_dir", "data_cache_path")


# The most bytes of the relative paths the run writes under an output directory (a checkpoint's
# iter_NNNNNNN.incomplete/__0_0.distcp, megatron-core's cached index files named by a hash).
WRITTEN_UNDER_OUTPUT = 128


def _check_path_lengths(flag: str, path: str, target: str, existing: str) -> None:
    """Each name in ``target`` within the file system's NAME_MAX, and ``target`` with room for
    what the run writes under it within its PATH_MAX (read where ``existing`` lies): else the
    first write fails after start-up."""
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    for name in target.split(os.sep):
        if len(os.fsencode(name)) > name_max:
            raise ValueError(f"{flag} {shown(path)!r}: the name {name[:20]}... is {len(os.fsencode(name))} bytes, but "
                             f"the file system takes names of at most {name_max} (NAME_MAX): give shorter names")
    length = len(os.fsencode(target))
    if length + WRITTEN_UNDER_OUTPUT >= path_max:
        raise ValueError(f"{flag} {shown(path)!r}: it is {length} bytes long, and the run writes files under it: the "
                         f"file system takes paths of at most {path_max} bytes (PATH_MAX), so keep it under "
                         f"{path_max - WRITTEN_UNDER_OUTPUT}: give a shorter path")


def _check_save_tracker(path: str) -> None:
    """The first save writes the checkpoint tracker into --save: a directory of that name there
    makes it fail after the first save's work."""
    tracker = os.path.join(path, on_disk.TRACKER)
    if os.path.isdir(tracker):
        raise ValueError(f"--save {shown(path)!r}: {shown(tracker)} is a directory, where the first save writes the "
                         "checkpoint tracker (a file): remove it, or give another --save directory")


def _check_output_dir(flag: str, path: str) -> None:
    """``path`` is a writable directory or can be made one: its nearest existing ancestor is
    a writable directory, nothing on the way is a symbolic link to a missing target (the
    run could make no directory there), and its names and length are within the file system's
    limits. Nothing is made here."""
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        if os.path.islink(existing):
            link = os.readlink(existing)
            what = "a symbolic link" if existing == target else f"inside {shown(existing)}, a symbolic link"
            raise ValueError(f"{flag} {shown(path)}: {what} to {shown(link)}, which does not exist: make that "
                             f"directory (mkdir -p {shown(os.path.join(os.path.dirname(existing), link))}), "
                             "or give another path")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "a file" if existing == target else f"inside {shown(existing)}, a file"
        raise ValueError(f"{flag} {shown(path)}: {what}, not a directory: give a directory, or a path where one "
                         "can be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown(path)}: {shown(existing)} is not writable: give a directory this user "
                         "can write to")
    _check_path_lengths(flag, path, target, existing)
    if flag == "--save":
        _check_save_tracker(path)


@functools.lru_cache(maxsize=None)
def _parser_actions() -> Dict[str, argparse.Action]:
    return {action.dest: action for action in build_parser()._actions}


@functools.lru_cache(maxsize=None)
def _parser_defaults() -> Dict[str, object]:
    return {dest: action.default for dest, action in _parser_actions().items()}


def _check_graph_scope(args) -> None:
    """The allow-list of scopes (``plan.graphs.CAPTURED_SCOPES``), and what this loop runs inside
    a captured iteration (``plan.graphs.full_iteration_loop_refusal``)."""
    if args.cuda_graph_impl == "none":
        return
    scope = CAPTURED_SCOPES.get(frozenset(scope_names(args.cuda_graph_scope)))
    given = " ".join(args.cuda_graph_scope or ["(none: each layer whole)"])
    if scope is None:
        raise ValueError(f"--cuda-graph-scope {given}: this pretrain_gpt.py captures moe (each MoE layer), "
                         "each transformer layer whole (no scope, or attn moe) or full_iteration; use one of "
                         "those, or Megatron-LM's training loop for megatron-core's other graph scopes")
    if scope is GraphScope.FULL_ITERATION:
        if args.cuda_graph_impl != "local":
            raise ValueError("--cuda-graph-scope full_iteration needs --cuda-graph-impl local (megatron-core's "
                             "capture of the whole iteration)")
        traits = LoopTraits(host_nan_check=bool(args.check_for_nan_in_loss_and_grad),
                            batch_rampup=args.rampup_batch_size is not None)
        refusal = full_iteration_loop_refusal(traits)
        if refusal is not None:
            raise ValueError(refusal)


def _check_only_with(args: argparse.Namespace) -> None:
    for enabling, dependents in ONLY_WITH.items():
        if getattr(args, enabling):
            continue
        for name in dependents:
            if getattr(args, name) != _parser_defaults()[name]:
                raise ValueError(f"{_dest_flags()[name]} needs {_dest_flags()[enabling]}")


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


# --- the full TransformerConfig, before start-up ---------------------------------------

PATCH_ERROR_PREFIX = "Invalid MoE patch configuration"

# Fields whose stock TransformerConfig checks ask Transformer Engine itself rather than
# judge the flags: without TE they fail for every value. Where TE cannot be imported
# (a CPU machine), validate_config builds the config without them, then runs the patch
# set's checks (which need no TE) with them set, and leaves megatron-core's TE checks to
# setup() on the GPU machine, where TE is installed and they run in full.
TE_PROBED_FIELDS = {
    "moe_permute_fusion": "megatron-core imports TE's fused permute kernels to check it",
    "apply_rope_fusion": "megatron-core imports TE's fused RoPE kernels to check it",
    "fp8": "megatron-core checks TE's version for FP8 MoE training",
    "fp8_recipe": "read only together with fp8",
    "moe_router_padding_for_quantization": "megatron-core checks it against fp8 (check_args checks it instead)",
}
# The same where megatron-core has the patch set's fields natively (and the patch set does
# not install): its own checks of these ask TE's version.
NATIVE_TE_PROBED_FIELDS = {
    "moe_single_grouped_weight": "megatron-core checks TE's version for single grouped weights",
    "moe_single_grouped_bias": "megatron-core checks TE's version for single grouped biases",
}

# Config field -> the flag's dest, where they differ.
_CONFIG_FIELD_DESTS = {
    **{field: dest for field, (dest, _) in FIELD_ALIASES.items()},
    "activation_func": "swiglu",
    "params_dtype": "bf16",
    "pipeline_dtype": "bf16",
}


@functools.lru_cache(maxsize=None)
def _dest_flags() -> Dict[str, str]:
    return {a.dest: a.option_strings[0] for a in _build_parser(PROG, names=True)._actions if a.option_strings}


def flags_named_in(text: str) -> List[str]:
    """The flags behind the config field names a message mentions, in order."""
    flags = []
    for word in re.findall(r"[A-Za-z][A-Za-z0-9_]*", text):
        if "_" not in word and word not in _CONFIG_FIELD_DESTS:
            continue  # plain words ("load", "seed") are not field names here
        flag = _dest_flags().get(_CONFIG_FIELD_DESTS.get(word, word))
        if flag and flag not in flags and flag not in text:
            flags.append(flag)
    return flags


def _with_flags(text: str) -> str:
    flags = flags_named_in(text)
    return f"{text} [{', '.join(flags)}]" if flags else text


def config_error_message(err: Exception) -> str:
    """A config construction error as pretrain_gpt.py reports it: the first line says the
    first problem and names its flags."""
    text = str(err).strip()
    if text.startswith(PATCH_ERROR_PREFIX):
        problems = [" ".join(p.split()) for p in re.split(r"\n\s*- ", text)[1:]] or [text]
        lines = [f"{PATCH_ERROR_PREFIX}: {_with_flags(problems[0])}"]
        lines += [f"  - {_with_flags(problem)}" for problem in problems[1:]]
        return "\n".join(lines)
    text = " ".join(text.split()) or f"{type(err).__name__} without a message"
    return f"megatron-core's TransformerConfig refuses these arguments: {_with_flags(text)}"


def _patch_refusal(kwargs: dict) -> Optional[ValueError]:
    """The patch set's own refusal of these config kwargs, judged without megatron-core's
    checks (whose bare asserts would otherwise speak first), or None."""
    from megatron.moe_patches.config import PatchedTransformerConfig, validate_moe_patch_config

    config = object.__new__(PatchedTransformerConfig)  # the fields, none of the checks
    for field in dataclasses.fields(PatchedTransformerConfig):
        if field.name in kwargs:
            value = kwargs[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        setattr(config, field.name, value)
    if config.expert_tensor_parallel_size is None:  # megatron-core's defaults the checks read
        config.expert_tensor_parallel_size = config.tensor_model_parallel_size
    if config.num_moe_experts is not None and config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    try:
        validate_moe_patch_config(config)
    except ValueError as err:
        return err
    except Exception:  # a value the checks cannot read before megatron-core's normalisation
        return None
    return None


def validate_config(args: argparse.Namespace, te_available: Optional[bool] = None) -> List[str]:
    """Build the TransformerConfig ``training.setup`` builds (patch fields included) and
    turn its refusals into a ValueError naming the flags. For combinations the patch set
    knows, its message wins over megatron-core's asserts.

    Returns the fields whose megatron-core checks were left to ``setup()`` because they ask
    Transformer Engine and it is not importable here (see ``TE_PROBED_FIELDS``); with TE
    (``te_available`` None: probe it) every check runs now. Without a visible CUDA device,
    the MoE graph rule of an EP > 1 config (it asks whether F12's exchange can run on this
    device) is left to ``setup()`` too.
    """
    from megatron.moe_patches import capabilities
    from megatron.moe_patches.config import validate_moe_patch_config

    kwargs = transformer_config_kwargs(args)
    config_class = compat.config_class()  # megatron-core's own where the patch set does not install
    patched = compat.patch_set_installs()
    if torch.cuda.is_available():  # config checks may ask the GPU: this rank's, not GPU 0 for all
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if te_available is None:
        te_available = capabilities.te_version() is not None
    probed = TE_PROBED_FIELDS if patched else {**TE_PROBED_FIELDS, **NATIVE_TE_PROBED_FIELDS}
    deferred = [] if te_available else [n for n in probed if kwargs.get(n) not in (None, False)]
    if "moe_permute_fusion" in deferred and kwargs.get("cuda_graph_impl") not in (None, "none"):
        deferred.append("cuda_graph_impl")  # the MoE graph rule reads moe_permute_fusion
    # Left to setup() whole: the MoE graph rule at EP > 1 asks whether this process can run
    # F12's exchange, which needs a CUDA device; with none visible, that is the GPU check's to say.
    unjudged = []
    if (patched and not torch.cuda.is_available() and kwargs.get("cuda_graph_impl") not in (None, "none")
            and kwargs.get("moe_symmetric_exchange") and (kwargs.get("expert_model_parallel_size") or 1) > 1):
        unjudged.append("cuda_graph_impl")
    late = {name: kwargs.pop(name) for name in deferred if name not in unjudged}
    for name in unjudged:
        kwargs.pop(name)
    deferred += [name for name in unjudged if name not in deferred]
    try:
        with warnings.catch_warnings():  # setup() builds it again; its warnings show there once
            warnings.simplefilter("ignore")
            config = config_class(**kwargs)
    except (ValueError, AssertionError, ImportError) as err:  # ImportError: a TE without the asked kernels
        refusal = _patch_refusal({**kwargs, **late}) if patched else None
        raise ValueError(config_error_message(refusal or err)) from None
    if late and patched:  # the patch set's checks need no TE: run them with the real values
        for name, value in late.items():
            setattr(config, name, value)
        try:
            validate_moe_patch_config(config)
        except ValueError as err:
            raise ValueError(config_error_message(err)) from None
    return deferred


def plan_lines(args: argparse.Namespace) -> List[str]:
    """--print-plan: the plan (``plan.plan_for``) of the config this run builds, on this
    machine, one decision a line. The fields ``validate_config`` leaves to the GPU machine
    (megatron-core asks TE or the GPU about them) are set after construction."""
    from megatron.moe_patches.plan import plan_for

    deferred = validate_config(args)
    kwargs = transformer_config_kwargs(args)
    late = {name: kwargs.pop(name) for name in deferred if name in kwargs}
    with warnings.catch_warnings():  # megatron-core's advice on the config: not the plan's
        warnings.simplefilter("ignore")
        config = compat.config_class()(**kwargs)
    for name, value in late.items():
        setattr(config, name, value)
    if config.num_moe_experts is None:
        return ["no MoE layer (--num-experts is not set): nothing to plan"]
    return list(plan_for(config).lines())


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
