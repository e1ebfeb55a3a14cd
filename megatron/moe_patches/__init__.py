"""MoE patch set for megatron-core 0.16.1.

Importing this package changes nothing in megatron-core. Call ``apply()`` to
install the series (see ``registry.SERIES``), ``revert()`` to undo it and
``status()`` (or ``python -m megatron.moe_patches status``) to see what is
applied, native or skipped and why.
"""

from megatron.moe_patches.installer import apply, is_applied, revert, status
from megatron.moe_patches.registry import SERIES
from megatron.moe_patches.version import __version__

__all__ = ["apply", "revert", "status", "is_applied", "SERIES", "__version__"]
