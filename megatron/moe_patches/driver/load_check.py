"""What --load holds, judged before start-up as Megatron-LM would find it after: a checkpoint
or none, its saved args (taken with --use-checkpoint-args, each of a type its flag gives), the
model shape it was saved with, and the optimizer layout it holds."""

import argparse
from typing import Callable, Optional

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.driver import checkpointing, megatron_lm_flags
from megatron.moe_patches.driver.launcher_env import launcher_rank
from megatron.moe_patches.driver.parser import flag_of, parser_actions
from megatron.moe_patches.driver.patch_args import CHECKPOINT_RESTORED_ARGS
from megatron.moe_patches.fields import shown

def check_load(args: argparse.Namespace, warn: Callable[[str], None] = print) -> Optional[str]:
    """What ``--load`` holds, decided before start-up (Megatron-LM's rules).

    No checkpoint there (no such directory, an empty one, no tracker file): one warning
    and training starts from scratch, or an error with ``--exit-on-missing-checkpoint``
    and with ``--use-checkpoint-args``. A ``--load`` that is a file, or a tracker that does
    not name a saved iteration, is an error naming the file. With ``--use-checkpoint-args``
    the checkpoint's model args are taken here, each of a type its flag gives; without it, a
    checkpoint whose saved args give the model other shapes (``on_disk.MODEL_SHAPE``) is refused.
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
        if launcher_rank() == 0:
            print(f"--use-checkpoint-args: took {sorted(taken)} from {path}", flush=True)
    else:
        saved = checkpointing.args_saved_at(path)
        if saved is not None:  # a checkpoint saved without args has no shape to compare
            _check_saved_types(saved, on_disk.MODEL_SHAPE, path, "point --load at another checkpoint")
            _check_model_shape(args, saved, path)
    # the refusal the optimizer's load would raise after start-up, said before it
    refusal = None if getattr(args, "no_load_optim", False) else checkpointing.optimizer_layout_refusal(path, args)
    if refusal is not None:
        raise ValueError(refusal)
    return path


def _check_model_shape(args: argparse.Namespace, saved: dict, path: str) -> None:
    """Refuse a checkpoint whose saved args give the model another shape than this run's flags
    (``on_disk.model_shape_differences``, the rule Megatron-LM's loop applies too)."""
    null_tokenizer = args.tokenizer_type == megatron_lm_flags.NULL_TOKENIZER
    differences = []
    for name, saved_value, run_value in on_disk.model_shape_differences(saved, vars(args)):
        shown_values = []
        for value in (saved_value, run_value):
            if isinstance(value, bool):
                value = "on" if value else "off"
            elif name == "vocab_size" and null_tokenizer and isinstance(value, int):
                value -= 1  # as this run's --vocab-size counts it (NullTokenizer adds the end of document)
            shown_values.append("none" if value is None else _saved_text(value))
        differences.append(f"{flag_of(name)} {shown_values[0]}, this run has {shown_values[1]}")
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
