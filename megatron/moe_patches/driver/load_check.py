"""What --load holds, as the driver reads it before start-up: the args --use-checkpoint-args
takes from it (each of a type its flag gives), and the driver's words and saved-args reader for
``preflight.judge``, which judges the checkpoint (its model shape, its optimizer layout) for
both loops."""

import argparse
from typing import Any, List, Optional, Tuple

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.driver import checkpointing
from megatron.moe_patches.driver.config_refusals import config_error_message
from megatron.moe_patches.driver.launcher_env import launcher_rank
from megatron.moe_patches.driver.parser import flag_of, parser_actions
from megatron.moe_patches.driver.patch_args import CHECKPOINT_RESTORED_ARGS
from megatron.moe_patches.fields import shown
from megatron.moe_patches.preflight import LoopWords


def take_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the checkpoint's model args, taken before the flags are checked
    together (each of a type its flag gives). No checkpoint to take them from is an error
    (``--exit-on-missing-checkpoint``'s where given). What --load holds is judged later, with
    the config (``preflight.judge``: ``driver_request``)."""
    if not args.use_checkpoint_args:
        return
    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load (the checkpoint directory)")
    path, missing = checkpointing.find_checkpoint(args.load)
    if path is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise checkpointing.missing_checkpoint_refusal(args.load, missing)
        raise ValueError(
            f"--use-checkpoint-args: --load {args.load} has no checkpoint to take the args from ({missing}); "
            "point --load at a checkpoint directory or drop --use-checkpoint-args"
        )
    saved = checkpointing.saved_args(args.load)
    _check_saved_types(saved, [*checkpointing.MODEL_ARGS, *(arg.name for arg in CHECKPOINT_RESTORED_ARGS)], path,
                       "drop --use-checkpoint-args and give the model flags, or point --load at another checkpoint")
    taken = checkpointing.restore_args(args, saved)
    if launcher_rank() == 0:
        print(f"--use-checkpoint-args: took {sorted(taken)} from {path}", flush=True)


class DriverWords(LoopWords):
    """The driver's words for what ``preflight.judge`` finds, and its reader of saved args (its
    own dict, or Megatron-LM's Namespace in its names)."""

    def __init__(self, null_tokenizer: bool):
        self.null_tokenizer = null_tokenizer  # --vocab-size counts the ids without the end of document

    def config_error(self, error: BaseException) -> str:
        return config_error_message(error)

    def saved_shape_args(self, path: str) -> Optional[dict]:
        saved = checkpointing.args_saved_at(path)
        if saved is not None:  # a checkpoint saved without args has no shape to compare
            _check_saved_types(saved, on_disk.MODEL_SHAPE, path, "point --load at another checkpoint")
        return saved

    def shape_refusal(self, path: str, differences: List[Tuple[str, Any, Any]]) -> str:
        said = []
        for name, saved_value, run_value in differences:
            shown_values = []
            for value in (saved_value, run_value):
                if isinstance(value, bool):
                    value = "on" if value else "off"
                elif name == "vocab_size" and self.null_tokenizer and isinstance(value, int):
                    value -= 1  # as this run's --vocab-size counts it (NullTokenizer adds the end of document)
                shown_values.append("none" if value is None else _saved_text(value))
            said.append(f"{flag_of(name)} {shown_values[0]}, this run has {shown_values[1]}")
        return (f"--load {path} was saved with {'; '.join(said)}: give the same model flags, or "
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
    actions = parser_actions()
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
            raise ValueError(f"--load {path} was saved with {flag_of(name)} {_saved_text(value, typed=True)}, "
                             f"which is not {wanted}: its saved args are not ones "
                             f"pretrain_gpt.py reads; {fix}")
