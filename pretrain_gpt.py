"""Pretrain a GPT/MoE model on megatron-core with the MoE patch set (see README.md).

The same as the ``megatron-moe-pretrain`` command that the package installs.
"""

import sys

from megatron.moe_patches.driver.cli import pretrain_main

if __name__ == "__main__":  # dist_checkpointing re-imports __main__ in worker processes
    sys.exit(pretrain_main(prog="pretrain_gpt.py"))
