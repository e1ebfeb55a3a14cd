"""Command-line flags for the patch fields, generated from the config dataclass.

Spelling follows Megatron-LM: field ``moe_foo_bar`` is ``--moe-foo-bar``; a bool
that defaults to False is ``store_true``; ``Optional[int]`` takes an int;
``Literal`` becomes ``choices``. Generating them keeps flags and fields from
drifting apart. ``add_moe_patch_args`` works as a Megatron-LM
``extra_args_provider``.
"""

import argparse
import logging
import typing
from typing import Dict, List, Literal, NamedTuple, get_args, get_origin

from megatron.moe_patches.fields import FORCED_ON_RESTORE, PATCH_FIELDS, MoEPatchFields, flag_name, restore_patch_args

logger = logging.getLogger(__name__)

GROUP_TITLE = "MoE patch set"


def _argparse_kwargs(field, annotation) -> dict:
    help_text = field.metadata.get("help", "")
    origin = get_origin(annotation)
    if origin is typing.Union:  # Optional[X]
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{field.name}: cannot make a flag for {annotation}")
        annotation, origin = inner[0], get_origin(inner[0])
    if annotation is bool:
        if field.default is not False:
            raise TypeError(f"{field.name}: bool flags must default to False (store_true)")
        return dict(action="store_true", help=help_text)
    if origin is Literal:
        choices = list(get_args(annotation))
        return dict(type=type(choices[0]), choices=choices, default=field.default, help=help_text)
    if annotation in (int, float, str):
        return dict(type=annotation, default=field.default, help=help_text)
    raise TypeError(f"{field.name}: cannot make a flag for {annotation}")


def _flag_specs():
    hints = typing.get_type_hints(MoEPatchFields)
    return [(field, flag_name(field.name), _argparse_kwargs(field, hints[field.name])) for field in PATCH_FIELDS]


def add_moe_patch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every patch flag to ``parser`` (a Megatron-LM ``extra_args_provider``).

    A flag the parser already has for the same destination (a newer Megatron-LM that
    ships it natively) is kept as it is; the same flag bound to another destination is
    a conflict and raises.
    """
    existing = parser._option_string_actions  # argparse has no public lookup
    group = None
    for field, flag, kwargs in _flag_specs():
        action = existing.get(flag)
        if action is not None:
            if action.dest != field.name:
                raise ValueError(
                    f"{flag} is already defined by the parser with dest={action.dest!r}; "
                    f"the MoE patch set needs dest={field.name!r}"
                )
            logger.info("%s is provided by the parser already; not adding it again", flag)
            continue
        if group is None:
            group = parser.add_argument_group(GROUP_TITLE)
        group.add_argument(flag, dest=field.name, **kwargs)
    return parser


def config_kwargs_from_args(args: argparse.Namespace) -> Dict[str, object]:
    """The patch fields' values from parsed args, as config constructor kwargs."""
    return {field.name: getattr(args, field.name) for field in PATCH_FIELDS if hasattr(args, field.name)}


class RestoredArg(NamedTuple):
    name: str
    force: bool  # overwrite the current value even when it is not None


# Which args a resumed run takes from the checkpoint's saved args, by the one rule both loops
# follow (``fields.restore_patch_args``).
CHECKPOINT_RESTORED_ARGS: List[RestoredArg] = [
    RestoredArg(field.name, force=field.name in FORCED_ON_RESTORE) for field in PATCH_FIELDS
]
restore_args_from_checkpoint = restore_patch_args
