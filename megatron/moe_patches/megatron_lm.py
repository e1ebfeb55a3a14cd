"""Training with Megatron-LM's own ``pretrain_gpt.py`` (Megatron-LM core_v0.16.1).

One call, first thing in pretrain_gpt.py's ``if __name__ == "__main__":`` block::

    from megatron.moe_patches import megatron_lm
    ...
    if __name__ == "__main__":
        megatron_lm.enable()

What it does, and why there:

- ``apply()``: Megatron-LM 0.16.1 generates its transformer flags from the
  ``TransformerConfig`` class bound in ``megatron.training.arguments`` and builds the
  config from the args through that class's dataclass fields. Both read the class when
  they run, so with the patched class bound first the patch flags exist and reach the
  config; bound later, they are unknown flags or miss the config. pretrain_gpt.py parses
  its flags a first time before ``pretrain(...)``, in
  ``inprocess_restart.maybe_wrap_for_inprocess_restart`` (which also answers ``--help``):
  hence the top of the block. The generated flags take their help text from the fields'
  ``metadata["argparse_meta"]`` (``fields.py``).
- ``--use-checkpoint-args``: Megatron-LM's ``load_args_from_checkpoint`` restores a fixed
  list of args. ``enable`` wraps it wherever ``megatron.training`` binds it, so that the
  patch args come back from the checkpoint's saved args as well, by Megatron-LM's own
  rule for the args it restores.

``disable()`` undoes ``enable()`` exactly. Importing this module changes nothing and
imports nothing of Megatron-LM.
"""

import argparse
import functools
import importlib
import os
from types import ModuleType
from typing import Callable, List, Optional, Set, Tuple

from megatron.moe_patches.fields import PATCH_FIELDS
from megatron.moe_patches.installer import apply, revert, status

_CHECKPOINTING = "megatron.training.checkpointing"
# Where Megatron-LM holds load_args_from_checkpoint: its defining module, and initialize, which
# imported it by name and is the one that calls it.
_CHECKPOINT_ARGS_OWNERS = (_CHECKPOINTING, "megatron.training.initialize")

# (stock load_args_from_checkpoint, its wrapper) while enable() is in effect
_hook: Optional[Tuple[Callable, Callable]] = None
# the series entries enable() applied (not those applied before it): what disable() reverts
_enabled_features: Set[str] = set()
# (megatron.core.datasets.utils, its compile_helpers) while enable() stands in for the build
_helpers_build = None


def enable() -> None:
    """Apply the patch series and make ``--use-checkpoint-args`` restore the patch args.

    Call it before Megatron-LM parses its flags (pretrain_gpt.py: first in its ``__main__``
    block). Calling it again changes nothing more. All or nothing: where a step fails (no
    Megatron-LM importable), what this call did is undone before the error is raised.
    """
    before, hooked, standing_in = _applied_ids(), _hook is not None, _helpers_build is not None
    try:
        apply()
        _enabled_features.update(_applied_ids() - before)
        _hook_checkpoint_args()
        _skip_dataset_helpers_build()
    except BaseException:
        _undo(_applied_ids() - before, hook=not hooked, helpers_build=not standing_in)
        raise


def disable() -> None:
    """Undo ``enable()``: unwrap ``load_args_from_checkpoint`` and revert the series entries
    that ``enable()`` applied (entries applied before it stay)."""
    _undo(set(_enabled_features), hook=True, helpers_build=True)


def _undo(features: Set[str], hook: bool, helpers_build: bool) -> None:
    """Revert ``features`` and, where asked, unwrap ``load_args_from_checkpoint`` and put
    back megatron-core's ``compile_helpers``."""
    global _hook, _helpers_build
    if hook and _hook is not None:
        stock, wrapper = _hook
        _bind_checkpoint_args(wrapper, stock)
        _hook = None
    if features:
        revert(sorted(features))
        _enabled_features.difference_update(features)
    if helpers_build and _helpers_build is not None:
        utils, stock = _helpers_build
        utils.compile_helpers = stock
        _helpers_build = None


def _skip_dataset_helpers_build() -> None:
    """Megatron-LM's start-up builds megatron-core's dataset helpers with ``make`` in
    megatron-core's folder. The megatron-core wheel ships them compiled but without the
    Makefile, so that build fails and the run exits; where the compiled module imports there
    is nothing to build, and the build step is skipped."""
    global _helpers_build
    from megatron.core.datasets import utils

    if _helpers_build is not None or os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile")):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401  (what the build makes)
    except ImportError:
        return  # nothing prebuilt: Megatron-LM's own build runs and says what fails
    _helpers_build = (utils, utils.compile_helpers)
    utils.compile_helpers = lambda: None


def restore_patch_args(args: argparse.Namespace, checkpoint_args: argparse.Namespace) -> List[str]:
    """Set the patch args in ``args`` from a checkpoint's saved args; returns the names set.

    Megatron-LM's rule for the args it restores: a forced arg takes the checkpoint's value,
    any other only where ``args`` has None; a checkpoint without the arg (saved before the
    patch set) changes nothing. Switches are forced: a store_true flag is False, never None,
    when not given, so "only where None" would never take a True saved in the checkpoint.
    """
    restored = []
    for field in PATCH_FIELDS:
        saved = getattr(checkpoint_args, field.name, None)
        if saved is None:
            continue
        forced = isinstance(field.default, bool)
        if forced or getattr(args, field.name, None) is None:
            setattr(args, field.name, saved)
            restored.append(field.name)
    return restored


def _applied_ids() -> Set[str]:
    return {row.id for row in status() if row.state == "applied"}


def _hook_checkpoint_args() -> None:
    """Bind the wrapper where ``megatron.training`` holds ``load_args_from_checkpoint``:
    ``initialize`` imported it by name, so patching the defining module alone misses it."""
    global _hook
    if _hook is not None:
        return
    stock = _checkpoint_args_owners()[0].load_args_from_checkpoint
    wrapper = _restoring_patch_args(stock)
    _bind_checkpoint_args(stock, wrapper)
    _hook = (stock, wrapper)


def _checkpoint_args_owners() -> List[ModuleType]:
    """The modules of ``_CHECKPOINT_ARGS_OWNERS``, all imported before any is changed."""
    try:
        return [importlib.import_module(name) for name in _CHECKPOINT_ARGS_OWNERS]
    except ImportError as err:
        raise ImportError(f"megatron_lm.enable() needs Megatron-LM's `megatron.training` importable "
                          f"(a Megatron-LM checkout on PYTHONPATH): {err}") from err


def _bind_checkpoint_args(current: Callable, new: Callable) -> None:
    for module in _checkpoint_args_owners():
        if module.load_args_from_checkpoint is current:
            module.load_args_from_checkpoint = new


def _restoring_patch_args(load_args_from_checkpoint: Callable) -> Callable:
    @functools.wraps(load_args_from_checkpoint)
    def load_args_with_patch_args(args, *rest, **kwargs):
        result = load_args_from_checkpoint(args, *rest, **kwargs)
        # Megatron-LM returns (args, checkpoint_args) when it read a checkpoint's args, and
        # args alone when there was none to read.
        if isinstance(result, tuple):
            _report(restore_patch_args(*result), result[1])
        return result

    return load_args_with_patch_args


def _report(names: List[str], checkpoint_args: argparse.Namespace) -> None:
    from megatron.training.utils import print_rank_0  # Megatron-LM is there once enable() ran

    for name in names:
        print_rank_0(f"moe_patches: {name} = {getattr(checkpoint_args, name)!r} from the checkpoint's args")


__all__ = ["enable", "disable", "restore_patch_args"]
