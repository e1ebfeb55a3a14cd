"""The driver's flags read from driver_flags.jsonl are the flags its former hand-written table
built: every action's class, dest, default, type, choices, nargs, metavar, const and help (a
digest), and the namespace of parsed defaults, for both parsers (``build_parser``'s ``names``).
The snapshot in fixtures/ was taken from that table before it became data."""

import hashlib
import json
from pathlib import Path

import pytest

from megatron.moe_patches.driver import arguments, parser

SNAPSHOT = Path(__file__).parent / "fixtures" / "driver_flags_before_table.json"


def described(parser) -> dict:
    rows = {}
    for action in parser._actions:
        choices = None if action.choices is None else [repr(choice) for choice in action.choices]
        digest = hashlib.sha256((action.help or "").encode()).hexdigest()[:12]
        rows[" ".join(action.option_strings) or action.dest] = [
            type(action).__name__, action.dest, repr(action.default), getattr(action.type, "__name__", repr(action.type)),
            choices, repr(action.nargs), repr(action.metavar), repr(action.const), action.required, digest]
    return rows


def parsed_defaults() -> dict:
    namespace = arguments.build_parser().parse_known_args([])[0]
    return {name: repr(value) for name, value in sorted(vars(namespace).items())}


@pytest.fixture(scope="module")
def snapshot():
    return json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("which, parser", [
    ("parser", lambda: arguments.build_parser()),
    ("parser_reading_names", lambda: parser.build_parser(parser.PROG, names=True)),
])
def test_every_flag_is_built_as_before(snapshot, which, parser):
    now = described(parser())
    before = snapshot[which]
    changed = {flag: (before[flag], now[flag]) for flag in before if now.get(flag) != before[flag]}
    assert set(now) == set(before) and not changed, changed


def test_parsed_defaults_are_as_before(snapshot):
    now = parsed_defaults()
    changed = {name: (value, now.get(name)) for name, value in snapshot["parsed_defaults"].items() if now.get(name) != value}
    assert set(now) == set(snapshot["parsed_defaults"]) and not changed, changed


def test_the_table_reads_every_kind_of_row():
    rows = parser._flag_table()
    assert {row["group"] for row in rows} >= {"model", "mixture of experts", "CUDA graphs", "data"}
    backend = arguments.build_parser().parse_known_args([])[0].attention_backend
    assert type(backend).__name__ == "AttnBackend" and backend.name == "auto"
    rampup = next(a for a in arguments.build_parser()._actions if a.dest == "rampup_batch_size")
    assert rampup.metavar == ("START", "INCREMENT", "SAMPLES")  # a tuple: argparse names each value
