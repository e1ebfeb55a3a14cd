"""Pretrain a GPT/MoE model on megatron-core with the MoE patch set (see README.md)."""

import sys

from megatron.moe_patches.driver.training import main

if __name__ == "__main__":  # dist_checkpointing re-imports __main__ in worker processes
    sys.exit(main())
