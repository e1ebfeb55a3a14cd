"""Every pretraining command and flag set README.md shows is parsed and validated as the
driver does it, so README and the code cannot drift apart.

What counts, read from README.md itself:

- commands: each line of a code block, and each inline code span, that runs
  ``megatron-moe-pretrain`` or ``pretrain_gpt.py`` (directly, with ``python``, or under
  ``torchrun``) with flags; spans holding ``...`` are templates and a bare program name is
  a mention. Sections about Megatron-LM's own programs (a heading naming "Megatron-LM's
  own") are left out: their ``pretrain_gpt.py`` is Megatron-LM's. ``torchrun
  --nproc-per-node N`` sets WORLD_SIZE; a placeholder ``N`` is tried for 1, 2, 4 and 8 GPUs
  of one machine.
- flag sets: every row of a table with a ``flags`` column ("the same + ..." adds to the
  row above), and every code span of two or more flags in "Choosing the fast path" outside
  its tables. They go on the base model that section names (its first code span) with each
  table shape's sizes and run settings (``SHAPES``, ``MODEL_AND_RUN``); the world size is
  the one the parallel sizes need.
- the config-field table: each row's flag sets its field, and the table lists every field.

Each command and flag set runs through ``training.main`` as the console script does, on a
machine with no visible GPU: it must get through parsing and every check and stop at the
GPU check, nothing earlier (``--help`` prints the usage and exits 0). The machine is a GPU
machine's software stack otherwise: Triton, which ships with CUDA builds of torch, counts
as installed; without Transformer Engine the driver leaves TE's own probes to start-up.
"""

import re
import shlex
import warnings
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

import pytest
import torch

from megatron.moe_patches import capabilities
from megatron.moe_patches.driver import training
from megatron.moe_patches.driver.arguments import build_parser
from megatron.moe_patches.fields import PATCH_FIELDS

README = Path(__file__).resolve().parents[2] / "README.md"
PROGRAMS = {"megatron-moe-pretrain": "megatron-moe-pretrain", "pretrain_gpt.py": "pretrain_gpt.py"}
GPU_COUNTS = (1, 2, 4, 8)  # "N GPUs of one machine"
# Each model shape the fast-path tables name: experts, top-k, hidden size, expert FFN size.
SHAPES = {"Qwen3-30B-A3B-like": (128, 8, 2048, 768), "DeepSeek-V2-Lite-like": (64, 6, 2048, 1408),
          "Mixtral-like": (8, 2, 4096, 14336)}
# What a whole command adds to a flag set besides the shape: the rest of the model and the run.
MODEL_AND_RUN = ["--num-layers", "2", "--num-attention-heads", "16", "--seq-length", "1024",
                 "--max-position-embeddings", "1024", "--vocab-size", "32000", "--micro-batch-size", "1",
                 "--train-iters", "10", "--lr", "0.0001"]
FAST_PATH = "### Choosing the fast path"


class Case(NamedTuple):
    name: str  # where in README, for the test id and failure messages
    prog: str  # the command the user runs
    argv: List[str]
    world: int


# --- reading README -----------------------------------------------------------------------


def code_spans(text: str) -> List[str]:
    return re.findall(r"`([^`\n]+)`", text)


def code_block_lines(text: str) -> List[str]:
    """The lines of README's indented and fenced code blocks, comments dropped."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(re.split(r"\s+#\s", line.strip(), maxsplit=1)[0].strip())
    return [line for line in lines if line]


def flag_count(span: str) -> int:
    return sum(token.startswith("--") for token in span.split())


def sections(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(r"^#{1,6} ", rest, flags=re.MULTILINE)
    return rest[: end.start()] if end else rest


def tables(text: str):
    """Each markdown table of ``text`` as (header cells, rows of cells)."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            if len(block) > 2:
                found.append((block[0], block[2:]))  # block[1]: the |---| line
            block = []
    return found


def command(line: str) -> Optional[Case]:
    """The driver command on a README line, or None for anything else."""
    try:
        tokens = shlex.split(line)
    except ValueError:
        return None
    world = "1"
    if tokens[:1] == ["torchrun"]:
        tokens = tokens[1:]
        while tokens and tokens[0].startswith("--"):
            option = tokens.pop(0)
            if option in ("--nproc-per-node", "--nproc_per_node"):
                world = tokens.pop(0)
            elif option not in ("--no-python", "--standalone"):
                tokens.pop(0)
    elif tokens[:1] == ["python"]:
        tokens = tokens[1:]
    if not tokens or Path(tokens[0]).name not in PROGRAMS:
        return None
    prog, argv = PROGRAMS[Path(tokens[0]).name], tokens[1:]
    if not argv or "..." in line:
        return None  # a mention of the program, or a template
    return Case(line, prog, argv, world)


def without_megatron_lm_sections(text: str) -> str:
    """README without the sections about Megatron-LM's own programs (its ``pretrain_gpt.py``
    is another program, with other flags)."""
    chunks = re.split(r"^(?=#{1,6} )", text, flags=re.MULTILINE)
    return "".join(chunk for chunk in chunks if "Megatron-LM's own" not in chunk.split("\n", 1)[0])


def readme_commands(text: str) -> List[Case]:
    cases = []
    text = without_megatron_lm_sections(text)
    for line in code_block_lines(text) + code_spans(text):
        case = command(line)
        if case is None:
            continue
        if case.world == "N":  # "on N GPUs of one machine"
            for n in GPU_COUNTS:
                cases.append(Case(f"{case.name} [N={n}]", case.prog,
                                  [str(n) if t == "N" else t for t in case.argv], n))
        else:
            assert "N" not in case.argv, f"README command {case.name!r}: a placeholder this test does not know"
            cases.append(case._replace(world=int(case.world)))
    return cases


def world_size(argv: List[str]) -> int:
    """The fewest ranks the parallel sizes in ``argv`` need (the driver's process grids)."""
    def size(flag, default=1):
        return int(argv[argv.index(flag) + 1]) if flag in argv else default

    tp, pp, ep = (size("--tensor-model-parallel-size"), size("--pipeline-model-parallel-size"),
                  size("--expert-model-parallel-size"))
    return max(tp * pp, size("--expert-tensor-parallel-size", tp) * ep * pp)


def shape_flags(shape_cell: str) -> List[str]:
    experts, topk, hidden, expert_ffn = SHAPES[shape_cell.split(" (")[0]]
    return ["--num-experts", str(experts), "--moe-router-topk", str(topk), "--hidden-size", str(hidden),
            "--ffn-hidden-size", str(4 * hidden), "--moe-ffn-hidden-size", str(expert_ffn), *MODEL_AND_RUN]


def fast_path_flag_sets(text: str) -> Tuple[List[Case], List[str]]:
    """The flag sets of "Choosing the fast path", each on the section's base model, and what
    is wrong with the tables as tables (a flags cell without flags, a precision column that
    contradicts its flags, a shape this test does not know)."""
    section = sections(text, FAST_PATH)
    intro = code_spans(section.split("\n|")[0])
    if not intro or flag_count(intro[0]) < 2:
        return [], [f"{FAST_PATH}: no code span of the base model's flags before its first table"]
    base_span = intro[0]
    base = base_span.split()
    cases, problems = [], []
    for header, rows in tables(section):
        if "flags" not in header:
            continue
        flags_at, precision_at = header.index("flags"), header.index("precision")
        previous: List[str] = []
        for row in rows:
            cell = row[flags_at]
            flags = [token for span in code_spans(cell) for token in span.split()]
            if not flags:
                problems.append(f"{row!r}: its flags cell holds no code span")
            if cell.startswith("the same"):
                flags = previous + flags
            previous = flags
            fp8 = "FP8" in row[precision_at]
            if ("--fp8-format" in flags) != fp8:
                problems.append(f"{row!r}: the precision column says {row[precision_at]!r}, the flags "
                                f"{'lack' if fp8 else 'hold'} --fp8-format")
            if row[0].split(" (")[0] not in SHAPES:
                problems.append(f"{row!r}: a model shape this test does not know (SHAPES)")
                continue
            argv = base + shape_flags(row[0]) + flags
            cases.append(Case(f"{row[0]} | {row[precision_at]} | {' '.join(flags)}", "megatron-moe-pretrain",
                              argv, world_size(argv)))
    prose = "\n".join(line for line in section.splitlines() if not line.startswith("|"))
    for span in code_spans(prose):
        if span == base_span or flag_count(span) < 2:
            continue
        for shape in SHAPES:
            argv = base + shape_flags(shape) + span.split()
            cases.append(Case(f"{shape} | {span}", "megatron-moe-pretrain", argv, world_size(argv)))
    return cases, problems


def field_table(text: str):
    """(field, flag span) of README's table of new config fields."""
    for header, rows in tables(text):
        if header == ["field", "flag"]:
            return [(code_spans(row[0])[0], code_spans(row[1])[0]) for row in rows]
    raise AssertionError("README has no | field | flag | table")


# --- running the driver -------------------------------------------------------------------


@pytest.fixture
def gpu_machine_without_gpu(monkeypatch):
    """No visible GPU; Triton importable (it comes with CUDA builds of torch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(capabilities, "triton_available", lambda: True)
    monkeypatch.setenv("RANK", "0")  # rank 0 of what the command launches
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def run_driver(case: Case, capsys, monkeypatch):
    """``training.main`` on the case's flags and world: (exit code or message, stdout, stderr)."""
    from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings
    from megatron.moe_patches.driver.training import main

    monkeypatch.setenv("WORLD_SIZE", str(case.world))
    capsys.readouterr()
    with warnings.catch_warnings(), pytest.raises(SystemExit) as stopped:
        quiet_megatron_core_import_warnings()
        main(list(case.argv), prog=case.prog)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def assert_stops_at_the_gpu_check(case: Case, capsys, monkeypatch):
    code, out, err = run_driver(case, capsys, monkeypatch)
    error = next((line for line in err.splitlines() if ": error: " in line), None)
    assert error is None, f"README's {case.name!r} is refused before the GPU check:\n{err}"
    assert code == training.no_gpu_message(case.prog), (
        f"README's {case.name!r} did not stop at the GPU check: {code!r}\n{err}")


TEXT = README.read_text(encoding="utf-8")
COMMANDS = readme_commands(TEXT)
FLAG_SETS, TABLE_PROBLEMS = fast_path_flag_sets(TEXT)


def test_readme_has_the_commands_and_flag_sets_this_test_reads():
    """The extraction finds what README shows (an empty list would pass everything)."""
    names = [case.name for case in COMMANDS]
    assert "megatron-moe-pretrain --yaml-cfg tiny-moe" in names
    assert any("torchrun" in name for name in names) and "megatron-moe-pretrain --help" in names
    assert PRINTS_A_PLAN
    graphs = [case for case in FLAG_SETS if "--cuda-graph-impl" in case.argv]
    exchange = [case for case in FLAG_SETS if "--moe-symmetric-exchange" in case.argv]
    assert len(FLAG_SETS) >= 10 and len(graphs) >= 5 and exchange
    assert all(case.world == 2 for case in exchange)


def test_readme_fast_path_tables_are_consistent():
    assert TABLE_PROBLEMS == []


PRINTS_A_PLAN = [c for c in COMMANDS if "--print-plan" in c.argv]


@pytest.mark.parametrize("case", [c for c in COMMANDS if c.argv != ["--help"] and c not in PRINTS_A_PLAN],
                         ids=lambda c: c.name)
def test_readme_command_stops_at_the_gpu_check(case, gpu_machine_without_gpu, capsys, monkeypatch):
    assert_stops_at_the_gpu_check(case, capsys, monkeypatch)


@pytest.mark.parametrize("case", PRINTS_A_PLAN, ids=lambda c: c.name)
def test_readme_plan_command_prints_a_plan_without_a_gpu(case, gpu_machine_without_gpu, capsys, reverted):
    from megatron.moe_patches.driver.training import main

    assert main(list(case.argv), prog=case.prog) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines[0].startswith("expert backend: ") and any(l.startswith("exchange: ") for l in lines)


@pytest.mark.parametrize("case", [c for c in COMMANDS if c.argv == ["--help"]], ids=lambda c: c.name)
def test_readme_help_command_prints_the_usage_of_the_command_run(case, gpu_machine_without_gpu, capsys,
                                                                 monkeypatch):
    code, out, _ = run_driver(case, capsys, monkeypatch)
    assert code == 0 and out.startswith(f"usage: {case.prog} ")


@pytest.mark.parametrize("case", FLAG_SETS, ids=lambda c: c.name)
def test_readme_flag_set_stops_at_the_gpu_check(case, gpu_machine_without_gpu, capsys, monkeypatch):
    assert_stops_at_the_gpu_check(case, capsys, monkeypatch)


def test_a_broken_readme_flag_set_is_caught(gpu_machine_without_gpu, capsys, monkeypatch):
    """The same reading and checks refuse README's graph flag sets at EP 1 without the fused
    permute (what README listed before): the checks above can fail. (F12's exchange sends
    tokens unpermuted: its flag sets need no fused permute.)"""
    broken = TEXT.replace(" --moe-permute-fusion", "")
    assert broken != TEXT
    cases = [c for c in fast_path_flag_sets(broken)[0]
             if "--cuda-graph-impl" in c.argv and "--moe-symmetric-exchange" not in c.argv]
    assert cases
    for case in cases:
        code, _, err = run_driver(case, capsys, monkeypatch)
        assert code == 2 and "--moe-permute-fusion" in err, (case.name, code, err)


def test_readme_field_table_flags_set_their_fields():
    rows = field_table(TEXT)
    assert sorted(field for field, _ in rows) == sorted(f.name for f in PATCH_FIELDS)
    parser = build_parser()
    for field, span in rows:
        flag, *rest = span.split()
        value = ["2"] if rest[:1] == ["N"] else []
        args = parser.parse_args([flag, *value])
        assert getattr(args, field) == (2 if value else True), (field, span)


def test_world_size_of_the_placeholder_is_each_gpu_count():
    torchrun = [c for c in COMMANDS if c.name.startswith("torchrun")]
    assert sorted({c.world for c in torchrun}) == list(GPU_COUNTS)
    assert all(str(c.world) in c.argv for c in torchrun if "--expert-model-parallel-size" in c.argv)
