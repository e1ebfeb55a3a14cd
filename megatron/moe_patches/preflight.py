"""One preflight for both training loops: what a run asks, judged once before start-up.

Each loop (this package's driver, Megatron-LM's ``pretrain_gpt.py``) turns its own args into a
``PreflightRequest`` in a small adapter of its own and calls ``judge``; nothing else judges the
config, the graph scope's loop traits or the ``--load`` checkpoint before start-up. ``judge``
builds the TransformerConfig once (the patch set's rules run in it), reads the plan from it
(``Verdict.plan``), judges the checkpoint from its files (``checkpoint.on_disk``'s rules) and
returns them with the refusals, one message each, in the loop's words (``LoopWords``).

Loop-neutral: it imports neither the driver nor Megatron-LM, and megatron-core only when it
judges (the driver's ``--help`` answers without it).
"""

import dataclasses
import os
import types
import warnings
from typing import Any, List, Mapping, Optional, Tuple

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.graph_scopes import GraphScope, LoopTraits, full_iteration_loop_refusal, graph_scope

# Fields whose stock TransformerConfig checks ask Transformer Engine itself rather than
# judge the flags: without TE they fail for every value. Where the request leaves them to
# start-up and TE cannot be imported (a CPU machine), the config is built without them, the
# patch set's checks (which need no TE) run with them set, and megatron-core's TE checks wait
# for the GPU machine, where TE is installed and they run in full.
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


def plain_text(text) -> str:
    """A message on one line (its whitespace runs as single spaces)."""
    return " ".join(str(text).split())


class LoopWords:
    """How a loop words what ``judge`` finds, and reads a checkpoint's saved args (each loop
    saves its own kind). These defaults are Megatron-LM's; the driver has its own."""

    def config_error(self, error: BaseException) -> str:
        return plain_text(error)

    def saved_shape_args(self, path: str) -> Optional[dict]:
        """The args the checkpoint at ``path`` was saved with, as the shape rule reads them, or
        None where there are none to compare."""
        raise NotImplementedError

    def shape_refusal(self, path: str, differences: List[Tuple[str, Any, Any]]) -> str:
        """The refusal of a checkpoint of other shapes (``on_disk.model_shape_differences``)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """The checkpoint ``--load`` names and how the loop restores it."""

    root: Optional[str] = None  # --load; None: nothing to load
    step: Optional[int] = None  # --ckpt-step: that iteration, not the tracker's
    ckpt_format: str = "torch_dist"  # only torch_dist checkpoints are judged from their files
    exit_on_missing: bool = False  # --exit-on-missing-checkpoint
    model_args_from_checkpoint: bool = False  # --use-checkpoint-args: the model's shape is the checkpoint's
    load_optimizer: bool = True  # neither --no-load-optim nor --finetune
    release_checkpoints: bool = False  # the loop reads a "release" tracker's release/ folder (Megatron-LM)


@dataclasses.dataclass(frozen=True)
class PreflightRequest:
    """What a run asks, in no loop's terms: the config to build, what the loop runs inside a
    captured iteration, and the checkpoint to load."""

    config_class: Optional[type]  # None: no config to judge here
    config_kwargs: Mapping[str, Any]
    loop: LoopTraits = LoopTraits()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    run_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # as the checkpoint rules read them
    # None: ask whether TE imports, and leave the checks that ask TE to start-up where it does
    # not (``TE_PROBED_FIELDS``); True/False: the answer, given
    te_available: Optional[bool] = True
    # without a visible CUDA device, leave the MoE graph rule at EP > 1 (it asks the device
    # whether F12's exchange runs) to start-up
    device_rules_at_start_up: bool = False
    words: LoopWords = LoopWords()

    def __post_init__(self):  # read-only views: a verdict must not change what was asked
        object.__setattr__(self, "config_kwargs", types.MappingProxyType(dict(self.config_kwargs)))
        object.__setattr__(self, "run_args", types.MappingProxyType(dict(self.run_args)))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What ``judge`` found: the config (None where refused or not asked), the fields whose
    checks wait for start-up, the checkpoint to load, and the refusals and notes."""

    config: Any = None
    deferred: Tuple[str, ...] = ()
    refusals: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = ()  # warnings: said, not refused
    checkpoint: Optional[str] = None  # the iteration directory --load resumes from
    config_warnings: Tuple[warnings.WarningMessage, ...] = ()  # what the config's build warned

    @property
    def plan(self):
        """The config's plan (``plan.plan_for``, cached on the config), or None without MoE layers."""
        if self.config is None or getattr(self.config, "num_moe_experts", None) is None:
            return None
        from megatron.moe_patches.plan import plan_for

        return plan_for(self.config)

    def say_config_warnings(self) -> None:
        """Warn what the config's build warned (judged quietly, said where the loop wants it)."""
        for said in self.config_warnings:
            warnings.warn_explicit(said.message, said.category, said.filename, said.lineno)


def judge(request: PreflightRequest) -> Verdict:
    """Build the config once, judge the loop's traits and the checkpoint; every refusal found."""
    refusals: List[str] = []
    config, deferred, caught = None, (), ()
    if request.config_class is not None:
        config, deferred, caught, refusal = _build_config(request)
        refusals += [refusal] if refusal is not None else []
    # read from the kwargs: the loop's traits are refused whatever else the config holds
    if graph_scope(types.SimpleNamespace(**request.config_kwargs)) is GraphScope.FULL_ITERATION:
        refusal = full_iteration_loop_refusal(request.loop)
        refusals += [refusal] if refusal is not None else []
    checkpoint, said, refusal = _judge_checkpoint(request)
    refusals += [refusal] if refusal is not None else []
    return Verdict(config=None if refusals else config, deferred=tuple(deferred), refusals=tuple(refusals),
                   notes=said, checkpoint=checkpoint, config_warnings=tuple(caught))


# --- the config ---------------------------------------------------------------------------


def _holds_patch_rules(config_class: type) -> bool:
    return getattr(config_class, "patch_rules", None) is not None  # PatchedTransformerConfig's


def _left_to_start_up(request: PreflightRequest, kwargs: dict, patched: bool) -> Tuple[List[str], List[str]]:
    """(fields set after construction, their megatron-core checks left to start-up; fields left
    out of this judgement whole)."""
    te_available = request.te_available
    if te_available is None:
        from megatron.moe_patches import capabilities

        te_available = capabilities.te_version() is not None
    probed = TE_PROBED_FIELDS if patched else {**TE_PROBED_FIELDS, **NATIVE_TE_PROBED_FIELDS}
    deferred = [] if te_available else [n for n in probed if kwargs.get(n) not in (None, False)]
    graphs = kwargs.get("cuda_graph_impl") not in (None, "none")
    if "moe_permute_fusion" in deferred and graphs:
        deferred.append("cuda_graph_impl")  # the MoE graph rule reads moe_permute_fusion
    unjudged = []
    if request.device_rules_at_start_up and patched and graphs and kwargs.get("moe_symmetric_exchange") \
            and (kwargs.get("expert_model_parallel_size") or 1) > 1:
        import torch

        if not torch.cuda.is_available():
            unjudged.append("cuda_graph_impl")
    return deferred, unjudged


def _build_config(request: PreflightRequest):
    """(config or None, deferred fields, the build's warnings, refusal or None): the one build.
    The patch set's own refusal of the kwargs speaks before megatron-core's asserts."""
    kwargs = dict(request.config_kwargs)
    patched = _holds_patch_rules(request.config_class)
    deferred, unjudged = _left_to_start_up(request, kwargs, patched)
    late = {name: kwargs.pop(name) for name in deferred if name not in unjudged}
    left_out = {name: kwargs.pop(name) for name in unjudged}
    deferred += [name for name in unjudged if name not in deferred]
    with warnings.catch_warnings(record=True) as caught:  # said by the loop (Verdict.say_config_warnings)
        warnings.simplefilter("always")
        try:
            config = request.config_class(**kwargs)
        except (ValueError, AssertionError, ImportError) as err:  # ImportError: a TE without the asked kernels
            refusal = patch_refusal({**kwargs, **late}, request.config_class) if patched else None
            return None, deferred, caught, request.words.config_error(refusal or err)
    for name, value in late.items():
        setattr(config, name, value)
    if late and patched:  # the patch set's checks need no TE: run them with the real values
        try:
            request.config_class.patch_rules(config)
        except ValueError as err:
            return None, deferred, caught, request.words.config_error(err)
    for name, value in left_out.items():  # as the run will hold them
        setattr(config, name, value)
    return config, deferred, caught, None


def patch_refusal(kwargs: dict, config_class: type) -> Optional[ValueError]:
    """The patch set's own refusal (``config_class.patch_rules``) of these config kwargs,
    judged without megatron-core's checks (whose bare asserts would otherwise speak first), or None."""
    config = object.__new__(config_class)  # the fields, none of the checks
    for field in dataclasses.fields(config_class):
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
        config_class.patch_rules(config)
    except ValueError as err:
        return err
    except Exception:  # a value the checks cannot read before megatron-core's normalisation
        return None
    return None


# --- the checkpoint --load names ------------------------------------------------------------


def _judge_checkpoint(request: PreflightRequest) -> Tuple[Optional[str], Tuple[str, ...], Optional[str]]:
    """(the iteration directory to load or None, warnings, refusal or None) of the torch_dist
    checkpoint ``--load`` names, judged from its files: a tracker that is no iteration number or
    names one missing or incomplete (``--ckpt-step``'s too), an unreadable directory, a missing
    checkpoint under --exit-on-missing-checkpoint, saved args of other model shapes (without
    --use-checkpoint-args) and optimizer states in another expert parameter layout (F7)."""
    policy = request.checkpoint
    if not policy.root or policy.ckpt_format != "torch_dist":
        return None, (), None  # other formats: the loop reads them its own way
    try:
        path, said = _checkpoint_to_load(policy)
        if path is None:
            return None, said, None
        if not policy.model_args_from_checkpoint:
            saved = request.words.saved_shape_args(path)
            differences = [] if saved is None else on_disk.model_shape_differences(saved, request.run_args)
            if differences:
                raise on_disk.CheckpointError(request.words.shape_refusal(path, differences))
        refusal = (on_disk.optimizer_layout_refusal(path, types.SimpleNamespace(**request.run_args))
                   if policy.load_optimizer else None)
        if refusal is not None:
            raise on_disk.CheckpointError(refusal)
    except ValueError as error:  # CheckpointError, and a loop's reader of the saved args
        return None, (), str(error)
    return path, (), None


def _checkpoint_to_load(policy: CheckpointPolicy) -> Tuple[Optional[str], Tuple[str, ...]]:
    """(the iteration directory the run resumes from, or None: none, or one the loop reads its
    own way; warnings)."""
    root = policy.root
    if policy.release_checkpoints and _names_a_release(root):
        _check_release_folder(root)
        return None, ()  # Megatron-LM reads its release checkpoints its own way
    if policy.step is not None:
        path = on_disk.iteration_dir(root, policy.step)
        reason = on_disk.incomplete_reason(path)
        if reason is not None:
            raise on_disk.CheckpointError(f"--load {root} --ckpt-step {policy.step}: {path} is not a complete "
                                          f"checkpoint ({reason}); give --ckpt-step a saved iteration")
        return path, ()
    path, missing = on_disk.find_checkpoint(root)
    if path is None:
        if policy.exit_on_missing:
            raise on_disk.missing_checkpoint_refusal(root, missing)
        return None, (f"--load {root}: {missing}; training starts from scratch "
                      "(--exit-on-missing-checkpoint makes this an error)",)
    return path, ()


def _names_a_release(root: str) -> bool:
    """Whether the tracker under ``root`` names Megatron-LM's "release" checkpoint."""
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
