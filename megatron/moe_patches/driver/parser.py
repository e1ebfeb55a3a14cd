"""pretrain_gpt.py's parser: the driver's flags from ``driver_flags.jsonl``, Megatron-LM's
others (``megatron_lm_flags``) and the patch flags, with one-line errors; and the flag each
dest is given by, as the checks' messages name it.

``build_parser(names=True)`` is the parser ``arguments.parse_args`` reads with: its
--attention-backend holds the member's name until megatron-core is imported.
"""

import argparse
import functools
import json
import os
import re
from typing import Dict, List, Tuple

from megatron.moe_patches.driver import megatron_lm_flags
from megatron.moe_patches.driver.patch_args import add_moe_patch_args
from megatron.moe_patches.fields import SHOWN_LIMIT, flag_name, shown
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
    """The driver's own flags from its table, by --help group; ``names`` as in ``build_parser``."""
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


def build_parser(prog: str = PROG, names: bool = False) -> argparse.ArgumentParser:
    """The driver's parser; ``prog``: the command the user ran, which the usage, error and
    warning lines name (``megatron-moe-pretrain`` for the console script). With ``names``, the
    parser ``parse_args`` reads the command line and the recipe with: --attention-backend holds
    an ``AttnBackendName`` (the same flag, default, help and errors) until
    ``megatron_lm_flags.resolve_names``, so that ``--help`` and the errors argparse and the
    recipe reader report come before megatron-core is imported."""
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


def flag_of(name: str) -> str:
    """The flag of the dest ``name``, as the user types it."""
    return dest_flags().get(name, flag_name(name))


@functools.lru_cache(maxsize=None)
def parser_actions() -> Dict[str, argparse.Action]:
    return {action.dest: action for action in build_parser()._actions}


@functools.lru_cache(maxsize=None)
def parser_defaults() -> Dict[str, object]:
    return {dest: action.default for dest, action in parser_actions().items()}


@functools.lru_cache(maxsize=None)
def dest_flags() -> Dict[str, str]:
    return {a.dest: a.option_strings[0] for a in build_parser(PROG, names=True)._actions if a.option_strings}
