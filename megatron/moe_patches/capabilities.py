"""Capability probes for the installed megatron-core, Transformer Engine, deep_ep and DeepGEMM.

Everything here imports lazily and never raises on a missing library: a probe
answers False (or None for a version) instead. Probes look at what the code
offers (dataclass fields, attributes, signature parameters), because version
strings say little about forks and backports.
"""

import ast
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from typing import Callable, NamedTuple, Optional, Tuple

from packaging.version import InvalidVersion, Version

SUPPORTED_MCORE = (Version("0.16.1"), Version("0.17"))  # [low, high)


def _version_of(dist: str) -> Optional[Version]:
    try:
        return Version(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return None


def mcore_loaded() -> bool:
    """Whether this process has imported megatron-core (its import takes seconds)."""
    return "megatron.core" in sys.modules


def mcore_version() -> Optional[Version]:
    """Version of the imported megatron-core (from the package, so a source tree counts); before
    megatron-core is imported, of the one ``import megatron.core`` would load, read from its
    package_info.py without importing it."""
    if not mcore_loaded():
        return _version_on_path() or _version_of("megatron-core")
    try:
        from megatron.core import package_info

        return Version(package_info.__version__)
    except ImportError:
        return _version_of("megatron-core")


def _version_on_path() -> Optional[Version]:
    """The version in megatron/core/package_info.py of the first ``megatron`` folder on the
    import path that holds megatron-core, or None where there is none or it reads otherwise."""
    spec = importlib.util.find_spec("megatron")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        core = os.path.join(str(folder), "core")
        if os.path.isfile(os.path.join(core, "__init__.py")):
            return _package_info_version(os.path.join(core, "package_info.py"))
    return None


def _package_info_version(path: str) -> Optional[Version]:
    """MAJOR.MINOR.PATCH + PRE_RELEASE, the literals megatron-core's package_info.py assigns."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        parts = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                 and node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
        return Version(f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}")
    except (OSError, SyntaxError, ValueError, KeyError, InvalidVersion):
        return None


def apex_wgrad_fusion() -> bool:
    """Whether megatron-core's linear layers find APEX's fused_weight_gradient_mlp_cuda (their
    ``_grad_accum_fusion_available``); asked without importing megatron-core where it is not yet."""
    if mcore_loaded():
        return bool(mcore_attr("tensor_parallel.layers", "_grad_accum_fusion_available"))
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def lands_after_tested_range(probe: Callable[[], bool]) -> Callable[[], bool]:
    """A native probe for a feature that no megatron-core of the tested range has (each landed
    upstream after it): there, before megatron-core is imported, the answer is no without the
    import; otherwise ``probe`` asks megatron-core (tests/unit/test_fast_commands.py checks
    that both answers agree)."""

    def native() -> bool:
        if not mcore_loaded() and mcore_supported():
            return False
        return probe()

    native.probe = probe
    return native


def mcore_supported(version: Optional[Version] = None) -> bool:
    version = version or mcore_version()
    return version is not None and SUPPORTED_MCORE[0] <= version < SUPPORTED_MCORE[1]


@functools.lru_cache(maxsize=None)
def te_version() -> Optional[Version]:
    """Transformer Engine's version, or None when TE's PyTorch side cannot be imported."""
    try:
        import transformer_engine.pytorch  # noqa: F401  (the part this project uses)
    except Exception:  # ImportError, or a broken CUDA library behind it
        return None
    for dist in ("transformer-engine", "transformer_engine"):
        version = _version_of(dist)
        if version is not None:
            return version
    import transformer_engine

    return Version(transformer_engine.__version__)


def te_attr(path: str):
    """``transformer_engine.pytorch.<path>`` or None."""
    if te_version() is None:
        return None
    module_name, _, attr = ("transformer_engine.pytorch." + path).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr, None)
    except ImportError:
        return None


def accepts_parameter(fn, name: str) -> bool:
    """Whether ``fn`` declares a parameter called ``name``.

    A bare ``*args, **kwargs`` signature says nothing, so it counts as "no":
    passing an unknown keyword to such a wrapper is exactly the failure to avoid.
    """
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# --- Transformer Engine -----------------------------------------------------------------


def te_fused_permute_pad() -> bool:
    """TE's fused permute+pad with probs and an unpermute that takes pad_offsets (F1)."""
    return te_attr("permutation.moe_permute_and_pad_with_probs") is not None and accepts_parameter(
        te_attr("permutation.moe_unpermute"), "pad_offsets"
    )


def te_op_fuser_grouped_mlp() -> bool:
    """TE ops for a grouped MLP pipeline: GroupedLinear and the router-prob-scaled GLUs (F4)."""
    return all(te_attr(f"ops.{op}") is not None for op in ("GroupedLinear", "ScaledSwiGLU"))


def te_fused_grouped_mlp_kernel() -> bool:
    """TE fuses the grouped-MLP op pipeline into one kernel on this GPU (SM100 + cuDNN FE today)."""
    fused = te_attr("ops.fused.GroupedMLP_CuTeGEMMGLU")
    try:
        return fused is not None and bool(fused.is_supported())
    except Exception:  # no GPU, or a probe that cannot run here: not available
        return False


def te_ops_grouped_linear_has(option: str) -> bool:
    """Whether ``te.pytorch.ops.GroupedLinear`` takes a constructor option (F4/F5)."""
    return accepts_parameter(te_attr("ops.GroupedLinear"), option)


def te_grouped_linear_device_splits() -> bool:
    """Whether TE's module GroupedLinear.forward takes m_splits as a tensor (F8, ROCm TE)."""
    grouped_linear = te_attr("GroupedLinear")
    return accepts_parameter(getattr(grouped_linear, "forward", None), "m_splits_tensor")


def triton_available() -> bool:
    """Triton (the FP8 experts' quantization kernels) is importable."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def deep_gemm_grouped_fp8() -> bool:
    """Whether DeepGEMM's FP8 grouped GEMM over device-side expert ends
    (``m_grouped_fp8_gemm_nt_contiguous`` with ``use_psum_layout``) is importable: DeepGEMM
    built from source binds it through pybind11 (the parameter is in its docstring), PyPI's
    ``sgl-deep-gemm`` wheel wraps its torch op in a Python function (in its signature)."""
    try:
        deep_gemm = importlib.import_module("deep_gemm")
    except Exception:  # noqa: BLE001 - a broken install counts as none
        return False
    gemm = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None)
    if gemm is None:
        return False
    return accepts_parameter(gemm, "use_psum_layout") or "use_psum_layout" in (getattr(gemm, "__doc__", None) or "")


class HybridEPOptions(NamedTuple):
    """What deep_ep's HybridEP buffer takes beyond megatron-core's own calls (F2)."""

    block_counts: bool  # num_blocks_permute / num_blocks_unpermute in its constructor
    permute_fusion: bool  # fuse_permute_dispatch / fuse_unpermute_combine in dispatch / combine


def hybridep_options(buffer_class=None) -> HybridEPOptions:
    """What the HybridEP buffer class megatron-core builds (``fused_a2a.HybridEPBuffer``, deep_ep's)
    takes; ``buffer_class``: another class to read (a test's stand-in). None installed: nothing."""
    if buffer_class is None:
        buffer_class = mcore_attr("transformer.moe.fused_a2a", "HybridEPBuffer")
    init = getattr(buffer_class, "__init__", None)
    return HybridEPOptions(
        block_counts=all(accepts_parameter(init, name) for name in ("num_blocks_permute", "num_blocks_unpermute")),
        permute_fusion=accepts_parameter(getattr(buffer_class, "dispatch_with_permute", None), "fuse_permute_dispatch")
        and accepts_parameter(getattr(buffer_class, "combine_with_unpermute", None), "fuse_unpermute_combine"),
    )


class MachineFacts(NamedTuple):
    """What the plan's rules read of this process's machine and libraries: a plan made under
    other facts is made again (``plan.plan_for`` keys its cache on them)."""

    cuda_capability: Optional[Tuple[int, int]]  # None: no CUDA device
    triton: bool
    te_version: Optional[str]
    te_device_splits: bool
    te_fused_permute_pad: bool
    te_ops: Tuple[str, ...]  # which of TE_OPS te.pytorch.ops has (the op fuser's probe reads two)
    te_ops_grouped_linear_scale_bias: bool
    te_fused_grouped_mlp_kernel: bool
    deep_gemm_grouped_fp8: bool
    hybridep: HybridEPOptions
    symmetric_memory: bool  # torch.distributed._symmetric_memory (F12)


# The te.pytorch.ops the op-fuser backend builds (F4): its rules ask for each by name.
TE_OPS = ("GroupedLinear", "ScaledSwiGLU", "ScaledClampedQGeGLU")


def _cuda_capability() -> Optional[Tuple[int, int]]:
    import torch

    if not torch.cuda.is_available():
        return None
    try:  # initializes CUDA (no context: nothing lands on a device before the launcher picks one)
        return tuple(torch.cuda.get_device_capability())
    except RuntimeError:  # a device torch sees but cannot start counts as none
        return None


def machine_facts() -> MachineFacts:
    version = te_version()
    return MachineFacts(
        cuda_capability=_cuda_capability(),
        triton=triton_available(),
        te_version=None if version is None else str(version),
        te_device_splits=te_grouped_linear_device_splits(),
        te_fused_permute_pad=te_fused_permute_pad(),
        te_ops=tuple(op for op in TE_OPS if te_attr(f"ops.{op}") is not None),
        te_ops_grouped_linear_scale_bias=te_ops_grouped_linear_has("scale_bias"),
        te_fused_grouped_mlp_kernel=te_fused_grouped_mlp_kernel(),
        deep_gemm_grouped_fp8=deep_gemm_grouped_fp8(),
        hybridep=hybridep_options(),
        symmetric_memory=importlib.util.find_spec("torch.distributed._symmetric_memory") is not None,
    )


# --- megatron-core: does it already have a feature natively? ----------------------------

# id(patched object) -> (patched, stock) for everything apply() installed, so that native
# probes see megatron-core as shipped rather than the patches themselves.
_installed = {}


def note_installed(stock, patched) -> None:
    _installed[id(patched)] = (patched, stock)


def note_reverted(patched) -> None:
    _installed.pop(id(patched), None)


def stock(obj):
    """The stock object behind ``obj`` if ``obj`` is one of our installed replacements
    (each patched class replaces a stock one directly), else ``obj``."""
    entry = _installed.get(id(obj))
    return entry[1] if entry is not None and entry[0] is obj else obj


def _config_fields(config_class=None) -> set:
    if config_class is None:
        config_class = mcore_attr("transformer.transformer_config", "TransformerConfig")
    return {f.name for f in dataclasses.fields(config_class)}


def mcore_has_fields(*names: str, config_class=None) -> bool:
    return set(names) <= _config_fields(config_class)


def mcore_attr(module: str, path: str):
    """``megatron.core.<module>.<path>`` (dotted attribute path) or None."""
    try:
        obj = importlib.import_module("megatron.core." + module)
    except Exception:  # a megatron-core module that needs a missing optional library
        return None
    for part in path.split("."):
        obj = stock(getattr(obj, part, None))
        if obj is None:
            return None
    return obj
