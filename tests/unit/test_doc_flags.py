"""Every command-line flag README.md and patches/*.md name is one the driver accepts, so the
docs cannot name a flag that ``pretrain_gpt.py`` / ``megatron-moe-pretrain`` would answer with
an argparse error or a refusal.

What counts, read from the docs themselves: every ``--flag`` anywhere in them, in code blocks,
code spans (a span may wrap lines) and prose alike. Each mention is accepted where the
driver's parser (``arguments.build_parser``, as ``parse_args`` builds it) knows its flag and,
for a Megatron-LM flag the driver refuses (``megatron_lm_flags``), where the mention shows it
with the one value the driver runs with (``--eval-iters 0``, ``--no-load-rng``): the flag and
the words after it in its code span go through ``megatron_lm_flags.all_refusals`` as
``parse_args`` judges a command line.

The flags of other programs (pip, torchrun, the status command, the benchmarks) and the
Megatron-LM flags the docs name as refused or as Megatron-LM's alone are listed one by one
in ``NOT_DRIVER_FLAGS`` with the reason; nothing is left out by a pattern.
"""

import argparse
import contextlib
import io
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import pytest

from megatron.moe_patches.driver import megatron_lm_flags
from megatron.moe_patches.driver.arguments import build_parser, given_settings
from megatron.moe_patches.driver.recipes import Recipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "patches").glob("*.md"))]

# The flags the docs name that are not flags of this package's driver, each with where the docs
# use it and why it is not one. A flag here must still occur in the docs and must not be one the
# driver accepts (test_each_exclusion_is_needed).
NOT_DRIVER_FLAGS: Dict[str, str] = {
    # pip, in README's install steps
    "--no-build-isolation": "pip install: build against the torch already installed",
    "--no-deps": "pip install: keep the container's torch and TE",
    "--index-url": "pip install: PyTorch's CPU wheel index",
    "--target": "pip install: upstream megatron-core into its own directory",
    # torchrun, in the multi-GPU commands of README and patches/F12
    "--nproc-per-node": "torchrun: ranks per node",
    "--no-python": "torchrun: run the console script, not a Python file",
    # Megatron-LM's own loop, in README's section on it
    "--moe-pad-experts-for-cuda-graph-inference": "Megatron-LM: an inference setting its validate_args asks "
                                                  "for with local graphs at EP > 1 (README: why the MoE graphs "
                                                  "of the patch set do not need it)",
    # the package's other commands
    "--apply": "megatron-moe-patches status: apply the series in the status command's process",
    "--features": "megatron-moe-patches status --apply: which features to apply",
    "--json": "megatron-moe-patches status: print one JSON document",
    "--record": "python -m megatron.moe_patches.driver.functional: record golden values",
    # benchmarks/moe_layer.py, in README's Benchmarks section
    "--tokens": "benchmarks/moe_layer.py: token counts to time",
    "--variants": "benchmarks/moe_layer.py: the layer variants to time",
    # not a flag: README's example of how a field is spelled as a flag (moe_foo -> --moe-foo)
    "--moe-foo": "README's placeholder for the field-to-flag spelling",
    # Megatron-LM flags the docs name as refused by the driver or as Megatron-LM's alone
    "--fp8-param-gather": "patches/F10 lists it as a limit of the FP8 experts; the driver refuses it (FP8 params)",
    "--overlap-param-gather": "patches/README.md: what Megatron's DDP does under it; the driver refuses it",
    "--check-for-spiky-loss": "Megatron-LM: its loss check, refused with full_iteration in its loop (README)",
}

# A flag: two dashes, a letter, then letters, digits, '_' or '-' (a trailing '-' is prose).
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*(?<!-)")
CODE_SPAN = re.compile(r"`([^`]+)`")


class Mention(NamedTuple):
    where: str  # "README.md:77"
    flag: str
    values: Tuple[str, ...]  # what follows it in its code span or code line, up to the next flag


def _mentions_in_code(name: str, line: int, code: str) -> List[Mention]:
    """Each flag of a code span or code line that starts at ``line``, with the words after it
    up to the next flag."""
    found = list(FLAG.finditer(code))
    mentions = []
    for match, after in zip(found, found[1:] + [None]):
        tail = code[match.end(): after.start() if after else len(code)]
        if tail.startswith("="):  # --flag=value
            tail = tail[1:]
        where = f"{name}:{line + code.count(chr(10), 0, match.start())}"
        mentions.append(Mention(where, match.group(), tuple(tail.replace("\\", " ").split())))
    return mentions


def doc_mentions(name: str, text: str) -> List[Mention]:
    """Every ``--flag`` in one markdown file: code blocks (fenced, or indented by four spaces)
    line by line, inline code spans (which may wrap lines), then the prose around them."""
    mentions, prose, fenced = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced or line.startswith("    "):
            mentions += _mentions_in_code(name, number, line)
            prose.append("")
        else:
            prose.append(line)
    body = "\n".join(prose)
    for span in CODE_SPAN.finditer(body):
        mentions += _mentions_in_code(name, body.count("\n", 0, span.start()) + 1, span.group(1))
    # the prose, with each code span blanked out (its line breaks kept, so line numbers hold)
    rest = CODE_SPAN.sub(lambda span: "\n" * span.group().count("\n"), body)
    for number, line in enumerate(rest.splitlines(), 1):
        mentions += [Mention(f"{name}:{number}", flag, ()) for flag in FLAG.findall(line)]
    return mentions


def read_docs(texts: Optional[Dict[str, str]] = None) -> List[Mention]:
    """The mentions of every doc; ``texts`` (name -> text) replaces the files' contents."""
    if texts is None:
        texts = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in DOCS}
    return [mention for name, text in texts.items() for mention in doc_mentions(name, text)]


# --- what the driver accepts --------------------------------------------------------------

PARSER = build_parser()
OPTIONS = PARSER._option_string_actions  # argparse has no public lookup (arguments.given_settings reads it too)
REFUSED_DESTS = {row.dest for row in megatron_lm_flags.refused_flags()}


def _values_taken(action: argparse.Action, values: Tuple[str, ...]) -> List[str]:
    if action.nargs == 0:
        return []
    if action.nargs is None or action.nargs == "?":
        return list(values[:1])
    if isinstance(action.nargs, int):
        return list(values[:action.nargs])
    return list(values)  # "+" / "*"


def refusal(mention: Mention) -> Optional[str]:
    """Why the driver does not accept the flag as this mention shows it, or None."""
    action = OPTIONS.get(mention.flag)
    if action is None:
        return "not a flag of the driver (argparse refuses it)"
    if action.dest not in REFUSED_DESTS:
        return None
    argv = [mention.flag, *_values_taken(action, mention.values)]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = PARSER.parse_args(argv)
    except SystemExit:
        return f"{' '.join(argv)}: {errors.getvalue().strip()}"
    refusals = megatron_lm_flags.all_refusals(args, given_settings(PARSER, argv, Recipe()))
    return refusals[0] if refusals else None


def flags_the_driver_refuses(mentions: List[Mention]) -> List[str]:
    """``where: --flag: why`` for each mention, outside NOT_DRIVER_FLAGS, of a flag the driver
    does not accept as shown."""
    problems = []
    for mention in mentions:
        if mention.flag not in NOT_DRIVER_FLAGS:
            why = refusal(mention)
            if why is not None:
                problems.append(f"{mention.where}: {mention.flag}: {why}")
    return problems


MENTIONS = read_docs()


def test_the_reading_finds_flags_in_code_blocks_spans_and_prose():
    text = ("Prose names --prose-flag and `--span-flag 3`, a span that wraps `--a-flag\n"
            "  --b-flag x y` and one with `--c-flag=v`.\n"
            "\n"
            "    torchrun --nproc-per-node 2 pretrain_gpt.py --d-flag 1 \\\n"
            "        --e-flag\n"
            "```\n"
            "--f-flag  # a fenced line; `---` rules and dashes—like--these are no flags\n"
            "```\n"
            "| a | `--g-flag` |\n"
            "|---|---|\n")
    assert sorted(doc_mentions("x.md", text)) == sorted([
        Mention("x.md:1", "--prose-flag", ()), Mention("x.md:1", "--span-flag", ("3",)),
        Mention("x.md:1", "--a-flag", ()), Mention("x.md:2", "--b-flag", ("x", "y")),
        Mention("x.md:2", "--c-flag", ("v",)),
        Mention("x.md:4", "--nproc-per-node", ("2", "pretrain_gpt.py")), Mention("x.md:4", "--d-flag", ("1",)),
        Mention("x.md:5", "--e-flag", ()), Mention("x.md:7", "--f-flag", ("#", "a", "fenced", "line;", "`---`",
                                                                          "rules", "and", "dashes—like--these",
                                                                          "are", "no", "flags")),
        Mention("x.md:9", "--g-flag", ())])


def test_the_docs_name_the_flags_this_test_reads():
    """The reading finds what the docs show (an empty list would pass everything), in README
    and in every patches/ page that names flags."""
    flags = {mention.flag for mention in MENTIONS}
    files = {mention.where.split(":")[0] for mention in MENTIONS}
    assert len(flags) >= 70, sorted(flags)
    assert {"README.md", "patches/C0-config-fields.md", "patches/F2-hybridep-blocks.md",
            "patches/F10-fp8-grouped-mm.md", "patches/F11-moe-cuda-graph.md", "patches/F12-symmetric-exchange.md",
            "patches/F13-wgrad-into-main-grad.md", "patches/README.md"} <= files
    assert {"--expert-model-parallel-size", "--moe-hybridep-num-blocks-permute", "--no-fp8-wgrad",
            "--moe-symmetric-exchange", "--use-transformer-engine-op-fuser", "--no-gradient-accumulation-fusion",
            "--no-rope-fusion"} <= flags
    assert ("--eval-iters", ("0",)) in {(m.flag, m.values) for m in MENTIONS}


def test_every_flag_the_docs_name_is_accepted_by_the_driver():
    problems = flags_the_driver_refuses(MENTIONS)
    assert not problems, "flags the docs name that the driver does not accept:\n" + "\n".join(problems)


@pytest.mark.parametrize("added, flag", [
    ("    megatron-moe-pretrain --yaml-cfg tiny-moe --moe-no-such-flag\n", "--moe-no-such-flag"),
    ("The flag `--moe-no-such-flag` does it.\n", "--moe-no-such-flag"),
    ("Plain prose naming --moe-no-such-flag.\n", "--moe-no-such-flag"),
    ("| shape | bf16 | `--moe-device-tokens-per-expert --moe-no-such-flag` |\n", "--moe-no-such-flag"),
    ("Train in fp16: `--fp16`.\n", "--fp16"),  # a Megatron-LM flag the driver refuses
    ("Evaluate only: `--skip-train`.\n", "--skip-train"),  # refused: the driver trains, then evaluates
    ("Launch with `--nproc-per-node 4`.\n", None),  # in NOT_DRIVER_FLAGS: not reported
])
def test_a_flag_the_driver_does_not_accept_is_reported(added, flag):
    """The check can fail: README with one line added at its end, in memory, is reported at
    that line (and nothing else changes)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    line = text.count("\n") + 1
    before = flags_the_driver_refuses(read_docs({"README.md": text}))
    after = flags_the_driver_refuses(read_docs({"README.md": text + added}))
    new = [problem for problem in after if problem not in before]
    if flag is None:
        assert after == before
    else:
        assert len(new) == 1 and new[0].startswith(f"README.md:{line}: {flag}: ") and len(after) == len(before) + 1, (
            new)


def test_each_exclusion_is_needed():
    """Every flag of NOT_DRIVER_FLAGS occurs in the docs, and no mention of it shows a form the
    driver accepts (else it would not need the table)."""
    for flag in NOT_DRIVER_FLAGS:
        mentions = [mention for mention in MENTIONS if mention.flag == flag]
        assert mentions, f"{flag}: the docs no longer name it; drop it from NOT_DRIVER_FLAGS"
        accepted = [mention.where for mention in mentions if refusal(mention) is None]
        assert not accepted, f"{flag}: the driver accepts it as {accepted}; drop it from NOT_DRIVER_FLAGS"
