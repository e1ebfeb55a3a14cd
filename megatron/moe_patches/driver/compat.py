"""What the imported megatron-core offers pretrain_gpt.py, decided in this one place.

The driver runs on megatron-core 0.16.1, where ``apply()`` installs the patch set, and
on versions that ship the patch set's features themselves (0.19.2), where ``apply()``
installs nothing and the driver uses megatron-core's own classes. Everything that
differs between the two is decided here, from what the code offers (dataclass fields,
signature parameters, the installer's verdict), never from a version string. The
answers are cheap to recompute; signature probes are kept per probed function.

- ``patch_set_installs``: whether ``apply()`` installs the patch set's config (C0), so
  that ``TransformerConfig`` is the patched class after it. Everything the patch set
  adds by itself (its validation, F8's ``moe_device_tokens_per_expert``, F11's CUDA-graph
  capture) exists only then.
- ``config_class`` / ``fit_config_kwargs``: the TransformerConfig ``setup()`` builds and
  the kwargs it takes. Where the patch set does not install, a driver option without a
  config field there is refused by name (or left out when it is off), and where the
  CUDA-graph scope field was renamed ``cuda_graph_modules`` the new one is passed, empty.
- ``wgrad_fusion_needs_apex``: whether gradient accumulation fusion (Megatron-LM's default)
  is turned off because only APEX's CUDA extension could run it here (no patch set, F13).
- ``null_tokenizer``: the mock data's tokenizer with the same token ids everywhere
  (megatron-core's NullTokenizer changed what its argument counts).
- ``load_takes_common_strategy``: whether ``dist_checkpointing.load`` takes a common-state
  strategy (0.16.1 reads common.pt only unless given one; later versions read both forms).
- ``memory_glu_interleave``: the block size in which megatron-core's own grouped experts
  keep (and would save) gated FC1 rows interleaved, for the checkpoints to hold them
  concatenated as the patch set's experts save them.
"""

import dataclasses
import functools
import importlib.util
from typing import Optional

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.fields import flag_name


def patch_set_installs() -> bool:
    """Whether ``apply()`` installs the patch set's config fields (C0) here."""
    from megatron.moe_patches.installer import installs

    return installs("C0")


def config_class():
    """The TransformerConfig class ``setup()`` builds: the patched one where the patch set
    installs (``apply()`` rebinds megatron-core's name to it), megatron-core's own otherwise."""
    if patch_set_installs():
        from megatron.moe_patches.config import PatchedTransformerConfig

        return PatchedTransformerConfig
    return cap.mcore_attr("transformer.transformer_config", "TransformerConfig")


def config_fields() -> frozenset:
    return frozenset(field.name for field in dataclasses.fields(config_class()))


def _not_here() -> str:
    low, high = cap.SUPPORTED_MCORE
    return (f"megatron-core {cap.mcore_version()}, where the MoE patch set does not install "
            f"(it installs into megatron-core >= {low}, < {high})")


def wgrad_fusion_needs_apex() -> bool:
    """Where the patch set does not install (no F13 stand-in): whether gradient accumulation
    fusion cannot run, megatron-core's own linears asking for APEX's
    ``fused_weight_gradient_mlp_cuda``, which is not installed."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None


def fit_config_kwargs(kwargs: dict) -> dict:
    """``kwargs`` (``arguments.transformer_config_kwargs``) as ``config_class()`` takes them.

    Where the patch set installs, unchanged. Elsewhere: an option whose config field this
    megatron-core lacks is left out when it is off (None or False) and refused (ValueError
    naming its flag) when it is on; so are CUDA graphs, which this driver captures with the
    patch set (F11); deprecated fields are not passed where they were renamed (the graph
    scope; the flex dispatcher's per-backend SM counts, of which the chosen backend's passes);
    and gradient accumulation fusion is off where it would need APEX (``wgrad_fusion_needs_apex``).
    """
    if patch_set_installs():
        return kwargs
    impl = kwargs.get("cuda_graph_impl", "none")
    if impl not in (None, "none"):
        raise ValueError(
            f"--cuda-graph-impl {impl}: this pretrain_gpt.py captures MoE layers as CUDA graphs with the "
            f"MoE patch set (F11), and this is {_not_here()}: drop --cuda-graph-impl and --cuda-graph-scope"
        )
    fields = config_fields()
    missing = sorted(name for name, value in kwargs.items()
                     if name not in fields and value is not None and value is not False)
    if missing:
        flags = ", ".join(flag_name(name) for name in missing)
        raise ValueError(
            f"{flags}: {_not_here()}, has no {'/'.join(missing)} config field; drop "
            f"{'it' if len(missing) == 1 else 'them'}, or train on a megatron-core the patch set installs into"
        )
    fitted = {name: value for name, value in kwargs.items() if name in fields}
    if fitted.get("gradient_accumulation_fusion") and wgrad_fusion_needs_apex():
        fitted["gradient_accumulation_fusion"] = False  # DDP adds the weight gradients instead (setup says so)
    if "cuda_graph_modules" in fields:
        # The scope field's new name; cuda_graph_scope is its deprecated alias there, and the
        # old "full" default warns: graphs are off, so no modules (the whole layer, unused).
        fitted.pop("cuda_graph_scope", None)
        fitted["cuda_graph_modules"] = []
    if "moe_flex_dispatcher_num_sms" in fields:
        # One SM count there for whichever flex backend runs; the per-backend fields are its
        # deprecated aliases, and two different values (Megatron-LM's defaults 20 and 16) are refused.
        per_backend = {backend: fitted.pop(f"moe_{backend}_num_sms", None) for backend in ("deepep", "hybridep")}
        backend = fitted.get("moe_flex_dispatcher_backend")
        if per_backend.get(backend) is not None:
            fitted["moe_flex_dispatcher_num_sms"] = per_backend[backend]
    return fitted


@functools.lru_cache(maxsize=None)
def _takes(function, parameter: str) -> bool:
    return cap.accepts_parameter(function, parameter)


def _tokenizer_takes_eod_id() -> bool:
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return _takes(NullTokenizer.__init__, "eod_id")


def null_tokenizer(vocab_size: int):
    """megatron-core's NullTokenizer with token ids 0 .. vocab_size - 1, the last one EOD.

    megatron-core 0.16.1's ``NullTokenizer(n)`` has n + 1 ids (EOD is n); later ones take
    the number of ids and an ``eod_id`` (default: the last). The mock data is built from
    the vocabulary size and the EOD id, so both must be the same on every version."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    if _tokenizer_takes_eod_id():
        return NullTokenizer(vocab_size, eod_id=vocab_size - 1)
    return NullTokenizer(vocab_size - 1)


def load_takes_common_strategy() -> bool:
    from megatron.core import dist_checkpointing

    return _takes(dist_checkpointing.load, "common_strategy")


def memory_glu_interleave(config) -> Optional[int]:
    """The block size of the interleaved gated FC1 rows megatron-core's own TE grouped
    experts keep in memory and put in their sharded state dict as they are (versions
    with a native ``moe_mlp_glu_interleave_size``), or None: where the patch set installs
    its experts convert at the checkpoint boundary themselves, and sequential experts,
    dense layers and models without the option hold FC1 concatenated."""
    if config is None or patch_set_installs():
        return None
    size = getattr(config, "moe_mlp_glu_interleave_size", None)
    grouped = (
        getattr(config, "num_moe_experts", None) is not None
        and getattr(config, "moe_grouped_gemm", False)
        and getattr(config, "transformer_impl", None) == "transformer_engine"
    )
    return size if size and grouped and getattr(config, "gated_linear_unit", False) else None
