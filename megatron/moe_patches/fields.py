"""The patch set's config fields and how feature code reads them (a leaf: imports nothing
of this package, so every module may import it).

``MoEPatchFields`` is the dataclass mixin the patched configs inherit (``config.py``);
``metadata["help"]`` is each field's --help text (``metadata["argparse_meta"]`` repeats it
for Megatron-LM's flag generator). Feature code reads a field with
``patch_option(config, name)``, which also answers for configs built from megatron-core's
stock classes (they lack the fields: the default applies). ``log_once`` is the one
"say it once per process" helper the patch modules share. ``env_switch`` is the one reader
of the package's on/off environment variables, and ``shown`` how every message echoes a
value the user gave.
"""

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

# The seed (ROCm PR) switches device-resident splits on with this variable.
DEVICE_SPLITS_ENV_ALIAS = "NVTE_USE_GROUPED_GEMM_TRITON"
# The values an on/off environment variable takes; unset is off.
SWITCH_VALUES = ("0", "1")

# A value longer than this is echoed shortened (a path fits whole).
SHOWN_LIMIT = 200
SHOWN_HEAD = 60


def shown(value) -> str:
    """``value`` as a message echoes it: whole, or its first characters and its length."""
    text = str(value)
    if len(text) <= SHOWN_LIMIT:
        return text
    return f"{text[:SHOWN_HEAD]}... ({len(text)} characters)"


def env_switch(name: str) -> bool:
    """An on/off environment variable: unset or 0 is off, 1 is on; any other value is a
    ValueError naming the variable (it would otherwise read as off without a word)."""
    value = os.environ.get(name)
    if value is None:
        return False
    if value not in SWITCH_VALUES:
        raise ValueError(f"{name}={shown(value)!r}: accepted values are {' and '.join(SWITCH_VALUES)} "
                         "(unset: 0); set one or unset the variable")
    return value == "1"


def _field(default, help: str):
    # Megatron-LM generates a flag for each field of the config class and passes
    # ``metadata["argparse_meta"]`` on to ``add_argument``: through it, the patch flags it makes
    # from the patched config carry this help too (its other source, a field docstring in the
    # class's own source, does not reach fields inherited from a second base class).
    return dataclasses.field(default=default, metadata={"help": help, "argparse_meta": {"help": help}})


@dataclass
class MoEPatchFields:
    """The fields this patch set adds; ``metadata["help"]`` is each flag's --help text."""

    use_transformer_engine_op_fuser: bool = _field(
        False,
        "Run the TE grouped experts as one transformer_engine.pytorch.ops pipeline "
        "(FC1 -> router-prob-weighted activation -> FC2).",
    )
    moe_mlp_glu_interleave_size: Optional[int] = _field(
        None,
        "Store FC1's GLU output rows as alternating gate/linear blocks of this many rows "
        "(must divide the per-partition MoE FFN size). Default: the concatenated layout.",
    )
    moe_single_grouped_weight: bool = _field(
        False, "Store each expert FC weight as one [num_experts, out, in] grouped parameter."
    )
    moe_single_grouped_bias: bool = _field(
        False, "Store each expert FC bias as one [num_experts, out] grouped parameter."
    )
    moe_hybridep_num_blocks_permute: Optional[int] = _field(
        None, "CUDA thread blocks for the permute fused into HybridEP dispatch (default: HybridEP chooses)."
    )
    moe_hybridep_num_blocks_unpermute: Optional[int] = _field(
        None,
        "CUDA thread blocks for the unpermute fused into HybridEP combine (default: HybridEP chooses).",
    )
    moe_permute_fusion_into_hybridep: bool = _field(
        False,
        "Fuse the permute into HybridEP's dispatch and the unpermute into its combine (flex "
        "dispatcher, hybridep backend; needs a deep_ep whose HybridEP takes fuse_permute_dispatch).",
    )
    moe_device_tokens_per_expert: bool = _field(
        False,
        "Keep tokens_per_expert on the GPU from routing to the expert GEMMs (no host sync where "
        "the expert backend takes device splits). NVTE_USE_GROUPED_GEMM_TRITON=1 also sets it.",
    )
    moe_symmetric_exchange: bool = _field(
        False,
        "Exchange tokens between the expert-parallel ranks of one NVLink node through symmetric "
        "GPU memory (alltoall dispatcher, with --moe-device-tokens-per-expert): split sizes stay on "
        "the GPU, no host sync, tokens land grouped by local expert. NCCL's all-to-all otherwise.",
    )


PATCH_FIELDS = tuple(dataclasses.fields(MoEPatchFields))
PATCH_FIELD_NAMES = tuple(f.name for f in PATCH_FIELDS)


# --use-checkpoint-args, both loops (the driver's resume and Megatron-LM's through
# megatron_lm.enable()): switches are forced, since a switch left off on the command line is
# False, never None, and "only where unset" would never take a True saved in the checkpoint.
FORCED_ON_RESTORE = frozenset(f.name for f in PATCH_FIELDS if isinstance(f.default, bool))


def restore_patch_args(args, checkpoint_args) -> list:
    """Set the patch args in ``args`` from a checkpoint's saved args (Megatron-LM's rule for
    the args it restores); returns the names set. A forced arg (``FORCED_ON_RESTORE``) takes
    the saved value, any other only where ``args`` has None; an arg the checkpoint does not
    hold, or holds as None (saved before the patch set had it), changes nothing."""
    restored = []
    for name in PATCH_FIELD_NAMES:
        saved = getattr(checkpoint_args, name, None)
        if saved is None:
            continue
        if name in FORCED_ON_RESTORE or getattr(args, name, None) is None:
            setattr(args, name, saved)
            restored.append(name)
    return restored


def patch_option(config, name: str):
    """A patch field's value, or its default for a config built from a stock class."""
    if name not in PATCH_FIELD_NAMES:
        raise KeyError(f"{name!r} is not a field of MoEPatchFields")
    default = next(f.default for f in PATCH_FIELDS if f.name == name)
    return getattr(config, name, default)


_said = set()


def flag_name(field_name: str) -> str:
    """Megatron-LM's flag for a config field or arg: ``moe_foo_bar`` is ``--moe-foo-bar``."""
    return "--" + field_name.replace("_", "-")


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log ``message`` the first time it comes up in this process (layers are built many times)."""
    if message not in _said:
        _said.add(message)
        logger.log(level, message)


# megatron-core 0.16.1's switch to its legacy GroupedMLP experts; later versions dropped
# the field (and those experts) altogether, so a config without it never uses them.
LEGACY_GROUPED_GEMM = "moe_use_legacy_grouped_gemm"


def uses_legacy_grouped_gemm(config) -> bool:
    """Whether ``config`` asks for megatron-core's legacy GroupedMLP experts (False where
    its TransformerConfig has no such field)."""
    return bool(getattr(config, LEGACY_GROUPED_GEMM, False))


def glu_activation(config) -> Optional[str]:
    """"swiglu" or "quick_geglu" for the gated activations the fused backends compute, else None."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if not config.gated_linear_unit:
        return None
    if config.activation_func is torch.nn.functional.silu:
        return "swiglu"
    if config.activation_func is quick_gelu:
        return "quick_geglu"
    return None
