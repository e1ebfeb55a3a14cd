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
  ``megatron.training`` binds them: once Megatron-LM's own checks pass, the preflight both
  loops share (``check_before_start``: ``preflight.judge``) builds the config once from the
  args as Megatron-LM builds it and judges the checkpoint ``--load`` names from its files; a
  refused value ends the run with one ``error:`` line naming it (exit status 2, as argparse),
  not a traceback after start-up. Megatron-LM's rule that local CUDA graphs at EP > 1 need an
  inference-only flag is left to the patch set's own rule for its MoE graphs
  (``_training_graphs_at_ep``).
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
from megatron.moe_patches.graph_scopes import LoopTraits, holds_moe_layers, scope_names
from megatron.moe_patches.installer import apply, revert, status
from megatron.moe_patches.preflight import CheckpointPolicy, LoopWords, PreflightRequest, judge, plain_text
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
        check_before_start(result if isinstance(result, argparse.Namespace) else args)
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


def check_before_start(args: argparse.Namespace) -> None:
    """The preflight both loops share (``preflight.judge``), on Megatron-LM's validated args
    (``megatron_lm_request``): the TransformerConfig built once from them as Megatron-LM's model
    builder does (the patch set's rules among its checks), what this loop runs inside a
    ``full_iteration`` graph, and the torch_dist checkpoint --load names. A refusal ends the run
    with one ``error:`` line each and exit status 2, before torch.distributed and the GPUs start."""
    try:
        request = megatron_lm_request(args)
    except ValueError as error:  # Megatron-LM's own mapping of the args refused them
        _refuse(str(error))
    verdict = judge(request)
    verdict.say_config_warnings()
    if verdict.refusals:
        _refuse(*verdict.refusals)


def megatron_lm_request(args: argparse.Namespace) -> PreflightRequest:
    """Megatron-LM's args as the preflight's request. Its loop's traits inside a captured
    iteration: timers at ``--timing-log-level`` (with Megatron-LM's default
    --barrier-with-level-1-timing they wait in a barrier too) and the spiky-loss check. Its
    checkpoints: --ckpt-step, "release" trackers, --finetune; other formats are left to it."""
    config = _config_class_and_kwargs(args)
    traits = LoopTraits(timing_level=getattr(args, "timing_log_level", 0) or 0,
                        spiky_loss_check=bool(getattr(args, "check_for_spiky_loss", False)))
    checkpoint = CheckpointPolicy(
        root=getattr(args, "load", None), step=getattr(args, "ckpt_step", None),
        ckpt_format=getattr(args, "ckpt_format", "torch_dist"),
        exit_on_missing=bool(getattr(args, "exit_on_missing_checkpoint", False)),
        model_args_from_checkpoint=bool(getattr(args, "use_checkpoint_args", False)),
        load_optimizer=not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)),
        release_checkpoints=True)
    return PreflightRequest(config_class=config[0] if config else None, config_kwargs=config[1] if config else {},
                            loop=traits, checkpoint=checkpoint, run_args=vars(args), words=MegatronLMWords())


# The config classes Megatron-LM's core_transformer_config_from_args picks by name in its module.
_CONFIG_CLASS_NAMES = ("TransformerConfig", "MLATransformerConfig", "HeterogeneousTransformerConfig")


def _config_class_and_kwargs(args: argparse.Namespace) -> Optional[Tuple[type, dict]]:
    """(the config class, its kwargs) that Megatron-LM's ``core_transformer_config_from_args``
    builds from ``args``, read by running it with stand-ins of its config classes that keep what
    they are given (so the config is built once, by the preflight, with Megatron-LM's own mapping)."""
    from megatron.training import arguments

    stock = {name: getattr(arguments, name) for name in _CONFIG_CLASS_NAMES
             if isinstance(getattr(arguments, name, None), type)}
    try:
        for name, config_class in stock.items():
            setattr(arguments, name, _kwargs_keeper(config_class))
        kept = arguments.core_transformer_config_from_args(args)
    finally:
        for name, config_class in stock.items():
            setattr(arguments, name, config_class)
    return kept.config_class, kept.kwargs


def _kwargs_keeper(config_class: type) -> type:
    """A class with ``config_class``'s dataclass fields (what Megatron-LM reads of it) whose
    construction keeps the class and the kwargs, and checks nothing."""

    class KwargsOf(config_class):
        def __init__(self, **kwargs):  # not the dataclass's: no __post_init__, no checks
            self.config_class, self.kwargs = config_class, kwargs

    return KwargsOf


class MegatronLMWords(LoopWords):
    """Megatron-LM's loop's words for a checkpoint of other shapes, and its saved args (a Namespace)."""

    def saved_shape_args(self, path: str) -> Optional[dict]:
        try:
            saved = on_disk.read_common_state(path).get("args")
        except Exception:  # noqa: BLE001 - an unreadable common state: find_checkpoint named it already
            return None
        # saved by another program (this package's driver saves a dict): not comparable here
        return vars(saved) if isinstance(saved, argparse.Namespace) else None

    def shape_refusal(self, path: str, differences) -> str:
        differ = [f"--{name.replace('_', '-')} {theirs} (checkpoint) vs {ours} (now)"
                  for name, theirs, ours in differences]
        return (f"--load {path}: the checkpoint holds another model: {'; '.join(differ)}; give the checkpoint's "
                "sizes, add --use-checkpoint-args to take them from it, or point --load at a checkpoint of this model")


def _refuse(*refusals: str) -> None:
    """One ``<program>: error: ...`` line each and exit status 2, as argparse ends a bad command."""
    program = os.path.basename(sys.argv[0] or 'pretrain_gpt.py')
    for refusal in refusals:
        print(f"{program}: error: {plain_text(refusal)}", file=sys.stderr)
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


__all__ = ["enable", "disable", "restore_patch_args", "check_before_start"]
