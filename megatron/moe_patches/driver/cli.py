"""The ``megatron-moe-pretrain`` console script; ``pretrain_gpt.py`` calls the same function.

Launch it like pretrain_gpt.py: ``megatron-moe-pretrain --yaml-cfg tiny-moe`` on one GPU,
``torchrun --nproc-per-node N --no-python megatron-moe-pretrain ...`` on N.
"""

from typing import List, Optional

from megatron.moe_patches.cli import quiet_megatron_core_import_warnings


def pretrain_main(argv: Optional[List[str]] = None) -> int:
    """Parse the flags and train (``megatron.moe_patches.driver.training.main``)."""
    quiet_megatron_core_import_warnings()  # before the training module imports megatron-core
    from megatron.moe_patches.driver.training import main

    return main(argv)


__all__ = ["pretrain_main"]
