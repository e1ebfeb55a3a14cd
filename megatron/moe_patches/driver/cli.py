"""The ``megatron-moe-pretrain`` console script; ``pretrain_gpt.py`` calls the same function.

Launch it like pretrain_gpt.py: ``megatron-moe-pretrain --yaml-cfg tiny-moe`` on one GPU,
``torchrun --nproc-per-node N --no-python megatron-moe-pretrain ...`` on N.
"""

from typing import List, Optional

from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings


COMMAND = "megatron-moe-pretrain"


def pretrain_main(argv: Optional[List[str]] = None, prog: str = COMMAND) -> int:
    """Parse the flags and train (``megatron.moe_patches.driver.training.main``). ``prog``:
    the command the user ran, named by the usage and error lines; ``pretrain_gpt.py``
    passes its own name."""
    quiet_megatron_core_import_warnings()  # before the training module imports megatron-core
    from megatron.moe_patches.driver.training import main

    return main(argv, prog=prog)


__all__ = ["COMMAND", "pretrain_main"]
