"""``python -m megatron.moe_patches status [--apply [--features C0,F4]] [--json]``.

Also the ``megatron-moe-patches`` command. ``--json`` prints one JSON document:
``{"megatron_moe_patches": "0.2.0", "megatron_core": "0.16.1", "transformer_engine": "2.14.0"
or null, "features": [...]}`` with one object per series entry (``id``, ``title``, ``state``,
``reason``, ``te_ok``, ``upstream``). States: applied, native, skipped, off (see README.md,
"Status states"). Without ``--apply`` nothing imports megatron-core (its import takes seconds):
the report reads its version from its files. Output cut short by a closed pipe
(``status | head -1``) ends the command quietly.
"""

import argparse
import json
import os
import sys

from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings
from megatron.moe_patches.version import __version__


def _feature_ids(parser: argparse.ArgumentParser, value: str) -> list:
    from megatron.moe_patches.registry import BY_ID

    ids = [part.strip() for part in value.split(",") if part.strip()]
    if not ids:
        parser.error("--features: give comma-separated feature ids, e.g. --features C0,F4")
    unknown = [feature_id for feature_id in ids if feature_id not in BY_ID]
    if unknown:
        parser.error(
            f"--features: unknown feature id {', '.join(unknown)}; the series is {', '.join(BY_ID)}"
        )
    return ids


def build_parser(prog: str):
    """The command's parser and its ``status`` subcommand's."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print this package's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "status",
        help="print what is applied, native, skipped or off, and why",
        description="One row per series entry (C0, F1-F8, F10-F13): applied, native, skipped or off, "
        "with the reason. Without --apply it reports this process's state (nothing applied: C0 and F13 off, "
        "the rest skipped because they need C0); --apply shows what apply() installs here.",
    )
    show.add_argument("--apply", action="store_true", help="apply() first (in this process only), then report")
    show.add_argument("--features", default=None, metavar="IDS",
                      help="comma-separated ids for --apply, e.g. C0,F4 (default: the whole series)")
    show.add_argument("--json", action="store_true",
                      help='one JSON document: {"megatron_moe_patches", "megatron_core", "transformer_engine", '
                      '"features": [rows]}')
    return parser, show


def report_lines(rows, as_json: bool) -> list:
    """The status report: a header naming the versions, then one line a row (or one JSON document)."""
    from megatron.moe_patches import capabilities as cap
    from megatron.moe_patches.registry import BY_ID

    mcore, te = cap.mcore_version(), cap.te_version()
    if as_json:
        document = {
            "megatron_moe_patches": __version__,
            "megatron_core": str(mcore) if mcore is not None else None,
            "transformer_engine": str(te) if te is not None else None,
            "features": [{**row.__dict__, "upstream": list(BY_ID[row.id].upstream)} for row in rows],
        }
        return [json.dumps(document, indent=2)]
    header = (f"megatron-moe-patches {__version__} | megatron-core {mcore or 'not installed'}"
              f" | Transformer Engine {te or 'not installed'}")
    return [header, *(row.line() for row in rows)]


def main(argv=None) -> int:
    called_as = os.path.basename(sys.argv[0] or "")
    prog = "megatron-moe-patches" if called_as.startswith("megatron-moe-patches") else "python -m megatron.moe_patches"
    parser, show = build_parser(prog)
    args = parser.parse_args(argv)
    if args.features is not None and not args.apply:
        show.error("--features selects what --apply installs; give --apply too")
    features = _feature_ids(show, args.features) if args.features is not None else None

    quiet_megatron_core_import_warnings()  # before apply() imports megatron-core
    from megatron.moe_patches.installer import apply, status

    rows = apply(features) if args.apply else status()
    return print_closing_quietly(report_lines(rows, args.json))


def print_closing_quietly(lines) -> int:
    """Print ``lines``; a reader that closed the pipe early (``| head -1``) ends the command with
    status 0 and no traceback, the rest of the output dropped."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
