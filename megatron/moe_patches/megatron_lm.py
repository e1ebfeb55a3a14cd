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
- The patch set's config rules before GPU start-up: Megatron-LM builds its
  ``TransformerConfig`` (whose checks hold the patch set's rules) only at model
  construction, after torch.distributed and the GPUs are set up. ``enable`` wraps
  ``validate_args`` (and ``validate_yaml``, its ``--yaml-cfg`` twin) wherever
  ``megatron.training`` binds them: once Megatron-LM's own checks pass, the config is built
  from the args as Megatron-LM builds it, and a refused value ends the run with one
  ``error:`` line naming it (exit status 2, as argparse), not a traceback after start-up.
  Megatron-LM's rule that local CUDA graphs at EP > 1 need an inference-only flag is left to
  the patch set's own rule for its MoE graphs (``_training_graphs_at_ep``). The checkpoint
  ``--load`` names is judged from its files there too (``check_load_before_start``).
- Batches without host waits at TP 1: Megatron-LM's ``get_batch_on_this_tp_rank`` broadcasts
  each micro-batch within the tensor-parallel group and makes a device tensor from a host
  int on the way (the host waits for the GPU twice per micro-batch), even when the group is
  this rank alone. ``enable`` wraps it (in ``megatron.training.utils`` and in pretrain_gpt.py,
  which imported it by name): at TP 1 the same tensors go to the GPU, without the waits.

``disable()`` undoes ``enable()`` exactly. Importing this module changes nothing and
imports nothing of Megatron-LM.
"""

import argparse
import contextlib
import functools
import importlib
import os
from types import ModuleType
import sys
from typing import Callable, Dict, List, Optional, Set, Tuple

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.fields import restore_patch_args
from megatron.moe_patches.graph_scopes import (GraphScope, LoopTraits, full_iteration_loop_refusal, graph_scope,
                                               holds_moe_layers, scope_names)
from megatron.moe_patches.installer import apply, revert, status
from megatron.moe_patches.registry import MEGATRON_LM_WRAPS

# What enable() wraps, where, and why: the registry's table (the dataset helpers' stand-in, its
# last row, is set apart: only where the wheel ships them built).
_WRAPPED = {wrap.name: wrap.owners for wrap in MEGATRON_LM_WRAPS if wrap.name != "compile_helpers"}
_OPTIONAL = {wrap.name for wrap in MEGATRON_LM_WRAPS if wrap.optional}

# name -> (Megatron-LM's function, its wrapper) while enable() is in effect
_hooks: Dict[str, Tuple[Callable, Callable]] = {}
# the series entries enable() applied (not those applied before it): what disable() reverts
_enabled_features: Set[str] = set()
# (megatron.core.datasets.utils, its compile_helpers) while enable() stands in for the build
_helpers_build = None


def enable() -> None:
    """Apply the patch series, make ``--use-checkpoint-args`` restore the patch args, and run
    the patch set's config rules when Megatron-LM validates its args.

    Call it before Megatron-LM parses its flags (pretrain_gpt.py: first in its ``__main__``
    block). Calling it again changes nothing more. All or nothing: where a step fails (no
    Megatron-LM importable), what this call did is undone before the error is raised.
    """
    before, hooked, standing_in = _applied_ids(), set(_hooks), _helpers_build is not None
    try:
        apply()
        _enabled_features.update(_applied_ids() - before)
        owners = _owners()
        for name, make_wrapper in _WRAPPERS.items():
            _wrap(name, owners, make_wrapper)
        _skip_dataset_helpers_build()
    except BaseException:
        _undo(_applied_ids() - before, hooks=set(_hooks) - hooked, helpers_build=not standing_in)
        raise


def disable() -> None:
    """Undo ``enable()``: unwrap Megatron-LM's functions and revert the series entries that
    ``enable()`` applied (entries applied before it stay)."""
    _undo(set(_enabled_features), hooks=set(_hooks), helpers_build=True)


def _undo(features: Set[str], hooks: Set[str], helpers_build: bool) -> None:
    """Revert ``features``, unwrap the functions named in ``hooks`` and, where asked, put
    back megatron-core's ``compile_helpers``."""
    global _helpers_build
    for name in hooks:
        stock, wrapper = _hooks.pop(name)
        for module in _loaded_owners(name):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, stock)
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


def _applied_ids() -> Set[str]:
    return {row.id for row in status() if row.state == "applied"}


def _owners() -> Dict[str, ModuleType]:
    """Every module of ``_WRAPPED``, imported before any is changed (an optional function's
    modules may be missing)."""
    owners = {}
    for name, modules in _WRAPPED.items():
        for module_name in modules:
            try:
                owners[module_name] = importlib.import_module(module_name)
            except ImportError as err:
                if name in _OPTIONAL and module_name == modules[0]:
                    break
                raise ImportError(f"megatron_lm.enable() needs Megatron-LM's `megatron.training` importable "
                                  f"(a Megatron-LM checkout on PYTHONPATH): {err}") from err
    return owners


def _loaded_owners(name: str) -> List[ModuleType]:
    return [sys.modules[m] for m in _WRAPPED[name] if m in sys.modules]


def _wrap(name: str, owners: Dict[str, ModuleType], make_wrapper: Callable[[Callable], Callable]) -> None:
    """Bind ``make_wrapper(stock)`` wherever Megatron-LM holds ``name``: the modules that
    imported it by name keep their own binding, so patching the defining module alone
    misses them."""
    defining = owners.get(_WRAPPED[name][0])
    if name in _hooks or defining is None or not hasattr(defining, name):
        if name not in _OPTIONAL and name not in _hooks:
            raise ImportError(f"megatron_lm.enable(): Megatron-LM's {_WRAPPED[name][0]} has no {name}")
        return
    stock = getattr(defining, name)
    wrapper = make_wrapper(stock)
    for module_name in _WRAPPED[name]:
        module = owners.get(module_name)
        if module is not None and getattr(module, name, None) is stock:
            setattr(module, name, wrapper)
    _hooks[name] = (stock, wrapper)


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


def _checking_the_config(validate: Callable) -> Callable:
    @functools.wraps(validate)
    def validate_and_check_the_config(args, *rest, **kwargs):
        with _training_graphs_at_ep(args):
            result = validate(args, *rest, **kwargs)
        validated = result if isinstance(result, argparse.Namespace) else args
        check_config_before_start(validated)
        check_load_before_start(validated)
        return result

    return validate_and_check_the_config


@contextlib.contextmanager
def _training_graphs_at_ep(args: argparse.Namespace):
    """Megatron-LM asserts --moe-pad-experts-for-cuda-graph-inference for local CUDA graphs at
    EP > 1: a flag of inference's text generation (its routers sync with the host) that
    training never reads. The patch set's dropless MoE graphs (scope ``moe``, the whole layer, the
    whole iteration: ``graph_scopes.holds_moe_layers``) are judged by its own rules once
    Megatron-LM's checks pass (sync-free counts, the symmetric exchange), so Megatron-LM's check
    sees the flag set and the user's value comes back after it."""
    lifted = (getattr(args, "cuda_graph_impl", "none") == "local"
              and (getattr(args, "expert_model_parallel_size", 1) or 1) > 1
              and getattr(args, "num_experts", None)
              and holds_moe_layers(scope_names(getattr(args, "cuda_graph_scope", None)))
              and not getattr(args, "moe_pad_experts_for_cuda_graph_inference", False))
    if lifted:
        args.moe_pad_experts_for_cuda_graph_inference = True
    try:
        yield
    finally:
        if lifted:
            args.moe_pad_experts_for_cuda_graph_inference = False


def check_config_before_start(args: argparse.Namespace) -> None:
    """Build the TransformerConfig from ``args`` as Megatron-LM's model builder does; a value
    its checks refuse (the patch set's rules among them) ends the run with one ``error:`` line
    and exit status 2, before torch.distributed and the GPUs start."""
    from megatron.training.arguments import core_transformer_config_from_args

    try:
        core_transformer_config_from_args(args)
        refusal = full_iteration_refusal(args)
        if refusal is not None:
            raise ValueError(refusal)
    except ValueError as error:
        _refuse(error)


def full_iteration_refusal(args: argparse.Namespace) -> Optional[str]:
    """What in Megatron-LM's loop a ``full_iteration`` graph cannot hold, or None: its traits
    (timers at ``--timing-log-level``, the spiky-loss check; with Megatron-LM's default
    --barrier-with-level-1-timing its timers wait in a barrier too) judged by the rule both loops
    share (``graph_scopes.full_iteration_loop_refusal``)."""
    if graph_scope(args) is not GraphScope.FULL_ITERATION:
        return None
    traits = LoopTraits(timing_level=getattr(args, "timing_log_level", 0) or 0,
                        spiky_loss_check=bool(getattr(args, "check_for_spiky_loss", False)))
    return full_iteration_loop_refusal(traits)


def check_load_before_start(args: argparse.Namespace) -> None:
    """Judge the torch_dist checkpoint ``--load`` names from its files, as this package's
    driver does before start-up (``checkpoint.on_disk``): a tracker that is no iteration
    number or names an iteration that is missing or incomplete (``--ckpt-step``'s iteration
    too), an unreadable directory, a missing checkpoint under --exit-on-missing-checkpoint,
    saved args that give the model other shapes (without --use-checkpoint-args), and
    distributed-optimizer states saved in another expert parameter layout (F7's rule)
    end the run with one ``error:`` line and exit status 2 instead of failing after start-up.
    Other checkpoint formats and Megatron-LM's "release" checkpoints are left to Megatron-LM (a
    "release" tracker without its release/ folder is refused)."""
    root = getattr(args, "load", None)
    if not root or getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return
    try:
        if _names_a_release(root):
            _check_release_folder(root)
            return
        step = getattr(args, "ckpt_step", None)
        if step is not None:
            path = on_disk.iteration_dir(root, step)
            reason = on_disk.incomplete_reason(path)
            if reason is not None:
                raise on_disk.CheckpointError(f"--load {root} --ckpt-step {step}: {path} is not a complete "
                                              f"checkpoint ({reason}); give --ckpt-step a saved iteration")
        else:
            path, missing = on_disk.find_checkpoint(root)
            if path is None:
                if getattr(args, "exit_on_missing_checkpoint", False):
                    raise on_disk.missing_checkpoint_refusal(root, missing)
                return  # Megatron-LM trains from scratch, and says so
        if not getattr(args, "use_checkpoint_args", False):
            _check_model_shape(args, path)
        if not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)):
            refusal = on_disk.optimizer_layout_refusal(path, args)
            if refusal is not None:
                raise on_disk.CheckpointError(refusal)
    except on_disk.CheckpointError as error:
        _refuse(error)


def _check_model_shape(args: argparse.Namespace, path: str) -> None:
    """Refuse a checkpoint whose saved args (Megatron-LM's Namespace) give the model other
    shapes than this run's flags (``on_disk.model_shape_differences``, the driver's rule too):
    its load would fail after start-up, tensor by tensor."""
    try:
        saved = on_disk.read_common_state(path).get("args")
    except Exception:  # noqa: BLE001 - an unreadable common state: find_checkpoint named it already
        return
    if not isinstance(saved, argparse.Namespace):
        return  # saved by another program (this package's driver saves a dict): not comparable here
    differ = [f"--{name.replace('_', '-')} {theirs} (checkpoint) vs {ours} (now)"
              for name, theirs, ours in on_disk.model_shape_differences(vars(saved), vars(args))]
    if differ:
        raise on_disk.CheckpointError(
            f"--load {path}: the checkpoint holds another model: {'; '.join(differ)}; give the checkpoint's "
            "sizes, add --use-checkpoint-args to take them from it, or point --load at a checkpoint of this model")


def _names_a_release(root: str) -> bool:
    """Whether the tracker under ``root`` names Megatron-LM's "release" checkpoint (read as
    the driver reads trackers)."""
    try:
        return on_disk.tracker_text(root) == "release"
    except on_disk.CheckpointError:
        return False  # find_checkpoint names the error


def _check_release_folder(root: str) -> None:
    """Megatron-LM loads a "release" tracker's checkpoint from ``root``/release, which it reads
    its own way; a missing folder would fail its load after start-up."""
    release = os.path.join(root, "release")
    if not os.path.isdir(release):
        raise on_disk.CheckpointError(
            f"--load {root}: the checkpoint tracker {os.path.join(root, on_disk.TRACKER)} names Megatron-LM's release "
            f"checkpoint, but {release} is not a directory: put the release checkpoint there, or write the iteration "
            "of a saved checkpoint into the tracker")


def _refuse(error: Exception) -> None:
    """One ``<program>: error: ...`` line and exit status 2, as argparse ends a bad command."""
    message = " ".join(str(error).split())
    print(f"{os.path.basename(sys.argv[0] or 'pretrain_gpt.py')}: error: {message}", file=sys.stderr)
    raise SystemExit(2) from None


# The batch keys Megatron-LM's get_batch_on_this_tp_rank returns, in its order (pretrain_gpt.py
# unpacks the values it leaves in the dict by position).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "cu_seqlens", "max_seqlen",
              "local_cp_size")


def _to_gpu(tensor):
    return tensor.cuda(non_blocking=True)


def _moving_batches_at_tp1(get_batch_on_this_tp_rank: Callable) -> Callable:
    @functools.wraps(get_batch_on_this_tp_rank)
    def get_batch_without_waits_at_tp1(data_iterator, *rest, **kwargs):
        from megatron.core import parallel_state
        from megatron.training import get_args

        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or getattr(get_args(), "hybrid_context_parallel", False)):
            return get_batch_on_this_tp_rank(data_iterator, *rest, **kwargs)
        # TP 1: this rank is the whole group, so the broadcasts change nothing; the batch is
        # Megatron-LM's own, moved to the GPU as it moves it.
        data = next(data_iterator)
        return {key: _to_gpu(data[key]) if key in data else None for key in BATCH_KEYS}

    return get_batch_without_waits_at_tp1


_WRAPPERS = {
    "load_args_from_checkpoint": _restoring_patch_args,
    "validate_args": _checking_the_config,
    "validate_yaml": _checking_the_config,
    "get_batch_on_this_tp_rank": _moving_batches_at_tp1,
}


def _report(names: List[str], checkpoint_args: argparse.Namespace) -> None:
    from megatron.training.utils import print_rank_0  # Megatron-LM is there once enable() ran

    for name in names:
        print_rank_0(f"moe_patches: {name} = {getattr(checkpoint_args, name)!r} from the checkpoint's args")


__all__ = ["enable", "disable", "restore_patch_args", "check_config_before_start"]
