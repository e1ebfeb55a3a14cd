"""The pretrain_gpt.py entry point: argument parsing now, the training loop with issue #7.

Running it without --help stops with a clear message until the loop lands, so nobody
mistakes it for a training run.
"""

import argparse
import sys

from megatron.moe_patches.arguments import add_moe_patch_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT/MoE pretraining on megatron-core with the MoE patch set applied.",
        allow_abbrev=False,
    )
    return add_moe_patch_args(parser)


def main(argv=None) -> int:
    build_parser().parse_args(argv)
    print(
        "pretrain_gpt.py: the training loop is not implemented yet (issue #7); "
        "only argument parsing and --help work in this version.",
        file=sys.stderr,
    )
    return 2
