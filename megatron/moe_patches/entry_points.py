"""What the command-line entry points share: quiet megatron-core's import-time warnings.

megatron-core warns at import time, once per module, when neither Transformer Engine
nor Apex is there ("Transformer Engine and Apex are not installed. Falling back to ...")
and when Apex is missing ("Apex is not installed. Falling back to Torch Norm"). Those
fallbacks are expected (this package needs no Apex; without TE the status command is
all that runs), and a start of ``status`` printed eight lines of them. The entry points
(``python -m megatron.moe_patches``, ``megatron-moe-patches``, ``megatron-moe-pretrain``,
``pretrain_gpt.py``) call ``quiet_megatron_core_import_warnings()`` before anything
imports megatron-core. Importing the package as a library installs no filter: a
program that imports it keeps megatron-core's warnings as its own filters decide.
"""

import warnings

# Exactly megatron-core's fallback notices (warnings.filterwarnings matches the message
# from its start, ignoring case, and the module name from its start).
MEGATRON_CORE_FALLBACK_MESSAGE = r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back"
MEGATRON_CORE_MODULE = r"megatron\.core(\.|$)"


def quiet_megatron_core_import_warnings() -> None:
    """Ignore megatron-core's "... not installed. Falling back ..." UserWarnings, nothing else."""
    warnings.filterwarnings(
        "ignore",
        message=MEGATRON_CORE_FALLBACK_MESSAGE,
        category=UserWarning,
        module=MEGATRON_CORE_MODULE,
    )


__all__ = ["quiet_megatron_core_import_warnings"]
