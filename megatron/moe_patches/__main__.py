"""``python -m megatron.moe_patches status [--apply] [--features C0,F4] [--json]``."""

import argparse
import json
import sys

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.installer import apply, status
from megatron.moe_patches.registry import BY_ID


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.moe_patches")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("status", help="print what is applied, native, skipped or off, and why")
    show.add_argument("--apply", action="store_true", help="apply() first, then report")
    show.add_argument("--features", default=None, help="comma-separated ids for --apply (default: all)")
    show.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)

    if args.apply:
        rows = apply(args.features.split(",") if args.features else None)
    else:
        rows = status()
    te = cap.te_version()
    header = f"megatron-core {cap.mcore_version()} | Transformer Engine {te or 'not installed'}"
    if args.json:
        for row in rows:
            print(json.dumps({**row.__dict__, "upstream": BY_ID[row.id].upstream}))
    else:
        print(header)
        for row in rows:
            print(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
