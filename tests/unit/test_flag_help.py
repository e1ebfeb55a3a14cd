"""Every flag of pretrain_gpt.py has --help text, and --help shows the defaults."""

import argparse
import re

import pytest

from megatron.moe_patches.driver import megatron_lm_flags
from megatron.moe_patches.driver.arguments import build_parser

# Megatron-LM's flags the driver refuses, or takes as changing nothing, stay out of --help: the
# epilog says so, and the table (megatron_lm_flags) gives each one's reason.
REFUSED = {name for row in (*megatron_lm_flags.refused_flags(), *megatron_lm_flags.no_effect_flags())
           for name in row.names}


def _flag_actions():
    return [action for action in build_parser()._actions
            if not isinstance(action, argparse._HelpAction) and not REFUSED & set(action.option_strings)]


def _help_text():
    parser = build_parser()
    parser.formatter_class = _wide(parser.formatter_class)
    return parser.format_help()


def _wide(formatter_class):
    """The parser's formatter with a wide line, so one flag's help stays on one line."""
    return lambda prog: formatter_class(prog, width=10_000, max_help_position=10_000)


def test_every_flag_has_help_text():
    missing = [action.option_strings[0] if action.option_strings else action.dest
               for action in _flag_actions()
               if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    assert not missing, f"flags without help text: {missing}"


def _flag_line(help_text, flag):
    lines = [line for line in help_text.splitlines() if re.match(rf"\s+{re.escape(flag)}(\s|$)", line)]
    assert len(lines) == 1, f"{flag}: {lines}"
    return lines[0]


@pytest.mark.parametrize("flag, default", [
    ("--log-interval", "100"),
    ("--lr-decay-style", "linear"),
    ("--num-query-groups", "1"),
    ("--moe-token-dispatcher-type", "allgather"),
])
def test_help_shows_the_default(flag, default):
    assert f"(default: {default})" in _flag_line(_help_text(), flag)


def test_help_shows_no_noise_defaults():
    """Switches (store_true) and unset (None) defaults print no '(default: ...)' suffix;
    their help text says what happens without them."""
    text = _help_text()
    assert "default: False)" not in text and "default: None)" not in text
    assert "(default:" not in _flag_line(text, "--bf16")
    assert "(default:" not in _flag_line(text, "--moe-single-grouped-weight")


def test_refused_flags_stay_out_of_help_and_the_epilog_says_why():
    text = _help_text()
    assert "--skip-train" not in text and "--fp16" not in text
    assert "one that asks for what this driver does not do is an error that says why" in " ".join(text.split())


def test_every_default_carrying_flag_shows_it():
    text = _help_text()
    for action in _flag_actions():
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, []):
            continue
        line = _flag_line(text, action.option_strings[0])
        assert f"(default: {action.default})" in line, line
