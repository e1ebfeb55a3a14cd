"""The experts' compute seam: what a backend is, and the TE backend.

The one patched experts class (``grouped_experts.PatchedTEGroupedMLP``) holds one backend object,
chosen once per config by the plan (``plan.plan_for``). A backend owns the experts' forward,
``backward_dw`` and its checkpoint hook, and declares, as class attributes, what it supports
(precisions, activations, expert TP, device token counts, single grouped parameters, ...);
what it needs of this process (libraries, kernels, GPU) is its ``unavailable`` class method.
The plan combines those declarations with the config (``plan.backend_blocker``).

Backends: ``te`` (here: megatron-core's own TE GroupedLinear path), ``grouped_mm``
(``grouped_mm``, F8), ``fp8_grouped_mm`` (``fp8_grouped_mm``, F10) and ``op_fuser``
(``op_fuser``, F4).

With ``moe_device_tokens_per_expert`` and a Transformer Engine whose module GroupedLinear
takes ``m_splits_tensor`` (ROCm's TE), the ``te`` backend also hands the GPU-resident counts
to FC1's and FC2's GroupedLinear, so TE's grouped GEMM reads them on the device instead of
uploading the host list again for every GEMM: the experts' spec builds FC1 and FC2 as
subclasses that take the counts (``expert_submodules``), and the backend hands them the counts
right before megatron-core's forward runs. The host list is still made, once per layer:
that GroupedLinear reads it on the host too (output rows, kernel launch grid, and the
per-expert split outside its Triton path), so a placeholder list would give wrong results.

Tensor names carry their shape (the legend is in README.md, "The series").
"""

import dataclasses
import functools
import logging
from typing import Optional, Tuple

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.grouped_params import grouped_at_birth, grouped_names_for
from megatron.moe_patches.fields import log_once, patch_option

logger = logging.getLogger(__name__)

# Precisions a backend computes in: no FP8/FP4 recipe, FP8, FP4.
BF16, FP8, FP4 = "bf16", "FP8", "FP4"

def host_tokens_per_expert(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """The one place the experts take the per-expert counts to the host."""
    if tokens_per_expert_E.is_cuda:
        return tokens_per_expert_E.cpu()
    return tokens_per_expert_E


def run_forward_pre_hooks(modules, *args) -> None:
    """Run the forward pre-hooks of ``modules`` whose forward never runs: the op fuser's TE ops
    pipeline computes FC1 and FC2 in one call. Megatron's DDP waits there for those parameters'
    all-gather under --overlap-param-gather (and dispatches the next bucket's): skipped, the
    pipeline would read weights whose update has not landed, and later buckets would never be
    gathered. Backends that read the FCs' parameters themselves call the modules instead
    (``ExpertBackend.linear_step``), so torch runs the hooks."""
    for module in modules:
        for key, hook in list(module._forward_pre_hooks.items()):  # torch keeps them here only
            if key in module._forward_pre_hooks_with_kwargs:
                hook(module, args, {})
            else:
                hook(module, args)


class ExpertBackend:
    """The experts' compute. Subclasses override what differs from megatron-core's TE path.

    Every method takes ``experts``, the patched TEGroupedMLP that owns this backend (a
    backend keeps no reference to it: no reference cycle keeps a dropped layer alive).
    """

    # What it supports, read by the plan (the defaults: anything megatron-core's TE path runs).
    name = "?"
    requested_by: Optional[str] = None  # the patch field that asks for it (a fallback is logged)
    fallback_log_level = logging.INFO  # how loudly a fallback from it is said
    precisions = (BF16, FP8, FP4)  # what it computes in (BF16: no FP8/FP4 recipe)
    precision_note: Optional[str] = None  # said with a precision refusal (where that precision runs)
    fp8_recipes: Optional[Tuple[str, ...]] = None  # FP8 recipes it implements; None: all
    fp8_params = True  # runs with FP8 parameters (--fp8-param-gather)
    params_dtypes: Optional[Tuple[torch.dtype, ...]] = None  # parameter dtypes; None: any
    activations: Optional[Tuple[str, ...]] = None  # glu_activation() names it computes; None: any
    te_activation_func = True  # runs with --use-te-activation-func
    biases = True  # expert biases (add_bias_linear)
    expert_tp = True  # expert tensor parallelism > 1
    probs_on_input = True  # --moe-apply-probs-on-input
    delayed_wgrad = True  # --delay-wgrad-compute (backward_dw computes the weight gradients)
    activation_offloading = True  # --cpu-offloading / --fine-grained-activation-offloading
    activation_recompute = True  # selective recompute of moe_act
    holds_single_grouped_params = False  # moe_single_grouped_weight/_bias (F5)
    single_grouped_missing = "it keeps one parameter per expert"  # why not, where it does not
    takes_device_counts = False  # reads device token counts without a host sync (graph-safe, F11/F12)
    # adds weight gradients into DDP's fp32 main_grad in the GEMM under gradient_accumulation_fusion
    # (TE's modules and ops do it themselves; F13)
    wgrad_into_main_grad = True
    alignment: Optional[int] = None  # rows per expert under FP8/FP4 where not the recipe's (1: any)
    runs_package_kernels = False  # computes with this package's Triton kernels (or their PyTorch twins)
    # A mixin whose ``forward`` replaces FC1's and FC2's (TE's grouped linear) for a backend that
    # computes with their parameters itself; None: the stock classes. The backend then calls the
    # modules, and torch runs their forward pre-hooks before the parameters are read.
    linear_step: Optional[type] = None

    @classmethod
    def unavailable(cls, config) -> Optional[str]:
        """What this process lacks to run it for ``config`` (libraries, kernels, GPU), or None."""
        return None

    @classmethod
    def required_alignment(cls, config) -> Optional[int]:
        return cls.alignment

    @classmethod
    def reads_rows_past_groups(cls, config) -> bool:
        """Whether its results read the rows past the last expert's: F12 hands the experts a
        static bound of rows and writes zeros there only for backends that read them."""
        return True

    @classmethod
    def aligned_groups(cls, config) -> Tuple[Optional[int], Optional[str]]:
        """(rows, kernels): where a backend that takes any rows (``alignment`` 1) has faster
        kernels for groups each starting on a multiple of ``rows``, which the dispatcher pads
        where it can (the plan decides; ``experts.padding_plan.static_rows`` says it did);
        (None, None) otherwise."""
        return None, None

    @classmethod
    def quantized_rows(cls, config) -> bool:
        """Whether the experts read the 1x128 FP8 copy of the rows the dispatcher permutes
        (FC1's input) and of FC2's output gradient, and nothing else of theirs in FP8: on
        aligned groups the dispatcher then writes those copies as it moves the rows."""
        return False

    # megatron-core's own methods (apply() binds the experts' spec to the patched class,
    # never this name).
    stock = TEGroupedMLP

    @classmethod
    def linear_steps(cls, config) -> Tuple[type, ...]:
        """The class steps FC1's and FC2's classes gain, first in their MRO: the single grouped
        parameters the config asks for, where this backend holds them (F5: made at construction),
        then ``linear_step``."""
        grouped = grouped_names_for(config) if cls.holds_single_grouped_params else frozenset()
        return tuple(s for s in (grouped_at_birth(grouped) if grouped else None, cls.linear_step) if s is not None)

    @classmethod
    def expert_submodules(cls, config, submodules, plan):
        """The experts' ``MLPSubmodules`` this backend builds on: called before megatron-core's
        TEGroupedMLP builds linear_fc1/linear_fc2 from them, with the config's plan
        (``plan.plan_for``). FC1's and FC2's classes gain ``linear_steps`` (subclasses of the
        spec's classes, built by the stock constructor)."""
        steps = cls.linear_steps(config)
        if not steps:
            return submodules
        label = "With".join([cls.__name__.removesuffix("Backend"), *(s.__name__ for s in steps[:-1])])
        fc1, fc2 = (_with_spec_class(s, _subclass(f"{_spec_class(s).__name__}For{label}", *steps, _spec_class(s)))
                    for s in (submodules.linear_fc1, submodules.linear_fc2))
        return dataclasses.replace(submodules, linear_fc1=fc1, linear_fc2=fc2)

    def __init__(self, experts):
        """Prepare ``experts`` for this backend; called once. FCs built without ``linear_steps``
        (not from the spec ``expert_submodules`` returned) are refused: their forward is TE's,
        not the one this backend calls, or their parameters are not in the layout asked for."""
        for step in self.linear_steps(experts.config):
            for linear in (experts.linear_fc1, experts.linear_fc2):
                if not isinstance(linear, step):
                    raise TypeError(f"the {self.name} experts' FCs must be built from the spec its "
                                    f"expert_submodules returns (a {step.__name__}); got {type(linear).__name__}")

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        return self.stock.forward(experts, x_TH, host_tokens_per_expert(tokens_per_expert_E), probs_T)

    def backward_dw(self, experts):
        return self.stock.backward_dw(experts)

    def sharded_state_dict(self, experts, sharded: dict) -> dict:
        """Adjust the stock sharded state dict (layouts held differently in memory)."""
        return sharded


class TakesDeviceSplits:
    """Marks the FC classes built with the device-splits step (``_device_splits_step``): the
    TE backend hands those the counts."""


@functools.lru_cache(maxsize=None)
def _device_splits_step(te_grouped_linear: type) -> type:
    """A class that sits between megatron-core's TEGroupedLinear and TE's GroupedLinear and
    adds ``m_splits_tensor`` when the TE backend handed it device counts for this forward:
    megatron-core's wrapper calls ``super().forward(x, m_splits, is_first_microbatch=...)``
    and passes nothing else."""

    class PassesDeviceSplits(te_grouped_linear, TakesDeviceSplits):
        _handed_splits = None  # (host splits, the same counts on the GPU), for one forward

        def hand_device_splits(self, host_splits: list, counts_E: torch.Tensor) -> None:
            """Counts for the next forward only: it takes them, whether it uses them or not."""
            self._handed_splits = (host_splits, counts_E)

        def forward(self, inp, m_splits, *args, **kwargs):
            handed, self._handed_splits = self._handed_splits, None
            # Only counts equal to the splits TE gets: padded splits (FP8's Fp8Padding) never
            # meet unpadded device counts.
            if handed is not None and list(m_splits) == handed[0]:
                kwargs["m_splits_tensor"] = handed[1]
            return super().forward(inp, m_splits, *args, **kwargs)

    return PassesDeviceSplits


@functools.lru_cache(maxsize=None)
def _subclass(name: str, *bases: type) -> type:
    """A class over ``bases`` (in MRO order) called ``name``, made here: a name of its own, so
    that logs and tracebacks tell it from the spec's class it extends."""
    return type(name, bases, {"__module__": __name__, "__qualname__": name})


def _with_device_splits(linear_class: type, te_grouped_linear: type) -> type:
    # MRO: linear_class, its megatron-core bases, step, TE's GroupedLinear: megatron-core's
    # forward runs unchanged and its super().forward reaches the step.
    return _subclass(f"{linear_class.__name__}WithDeviceSplits", linear_class, _device_splits_step(te_grouped_linear))


def _spec_class(spec):
    return spec.module if isinstance(spec, ModuleSpec) else spec


def _with_spec_class(spec, module_class: type):
    return dataclasses.replace(spec, module=module_class) if isinstance(spec, ModuleSpec) else module_class


class TEBackend(ExpertBackend):
    """megatron-core's TE path: TE GroupedLinear per expert, counts copied to the host once
    per layer; with device splits (the plan's ``te_device_splits``) TE also gets them on the GPU."""

    name = "te"

    @classmethod
    def expert_submodules(cls, config, submodules, plan):
        """With device splits (the plan decided): FC1's and FC2's classes gain the step that
        hands TE the counts (subclasses, built by the stock constructor like any spec class)."""
        if not plan.te_device_splits:
            return submodules
        te_grouped_linear = cap.te_attr("GroupedLinear")
        specs = (submodules.linear_fc1, submodules.linear_fc2)
        if te_grouped_linear is None or not all(
            isinstance(_spec_class(s), type) and issubclass(_spec_class(s), te_grouped_linear) for s in specs
        ):
            return submodules
        fc1, fc2 = (_with_spec_class(s, _with_device_splits(_spec_class(s), te_grouped_linear)) for s in specs)
        return dataclasses.replace(submodules, linear_fc1=fc1, linear_fc2=fc2)

    def __init__(self, experts):
        self.passes_device_splits = False
        if not patch_option(experts.config, "moe_device_tokens_per_expert"):
            return
        # FCs built from the spec expert_submodules returned carry the plan's decision
        if all(isinstance(linear, TakesDeviceSplits) for linear in (experts.linear_fc1, experts.linear_fc2)):
            self.passes_device_splits = True
            te_splits = (
                "takes m_splits_tensor and gets the counts on the GPU, but still reads the list "
                "on the host (output rows, kernel grid)"
            )
        else:
            te_splits = "takes no device splits (m_splits_tensor)"
        # The flag asked for no host copy; this backend still makes one: worth a warning.
        log_once(
            logger,
            logging.WARNING,
            f"moe_device_tokens_per_expert: these experts run the TE backend (the log says why "
            f"not grouped_mm), and Transformer Engine {cap.te_version()}'s GroupedLinear {te_splits}: "
            "tokens_per_expert is copied to the host once per layer.",
        )

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        host_E = host_tokens_per_expert(tokens_per_expert_E)
        # Counts the dispatcher left on the host (allgather) stay host-only: TE's kernels
        # want the counts on the tokens' device.
        if self.passes_device_splits and tokens_per_expert_E.device == x_TH.device:
            # int32: the grouped-GEMM kernels behind m_splits_tensor read int32 group sizes.
            host_splits, counts_E = host_E.tolist(), tokens_per_expert_E.to(torch.int32)
            for linear in (experts.linear_fc1, experts.linear_fc2):
                linear.hand_device_splits(host_splits, counts_E)
        return self.stock.forward(experts, x_TH, host_E, probs_T)
