"""The pre-start checks of each setting on its own report every problem in one run: the
recipe's bad keys, the refused Megatron-LM flags and the values out of their domain, one
``pretrain_gpt.py: error: ...`` line each, exit status 2."""

import pytest

from megatron.moe_patches.driver.arguments import build_parser
from megatron.moe_patches.driver.recipes import RecipeError, apply_recipe, read_recipe

from conftest import ERROR, _parse_as_entry_point
from driver_model import REQUIRED


def errors(argv, capsys):
    """The error lines of a run of ``argv`` that must be refused, without their prefix."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        _parse_as_entry_point(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert lines and all(line.startswith(ERROR) for line in lines), err
    return [line[len(ERROR):] for line in lines]


def write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_recipe_with_three_bad_keys_prints_all_three(tmp_path, capsys, one_rank):
    path = write(tmp_path, "fp16: true\nnot_a_flag: 1\nhidden_dropout: 1.5\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path], capsys)
    assert len(lines) == 3, lines
    assert lines[0] == f"{path}:2: unknown key 'not_a_flag' (no flag --not-a-flag)"
    assert lines[1].startswith(f"{path}:1: 'fp16' (--fp16): fp16 training"), lines
    assert lines[2] == "--hidden-dropout 1.5: must be at least 0 and below 1"


def test_each_kind_of_bad_recipe_key_is_reported(tmp_path, capsys, one_rank):
    path = write(tmp_path, "num_layers: two\nlanguage_model:\n  no_such_field: 1\nadd_bias_linear: maybe\n"
                           "lr_warmup_fraction: .nan\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path], capsys)
    assert len(lines) == 4, lines
    assert lines[0] == f"{path}:3: unknown key 'no_such_field' (no flag --no-such-field)"
    assert lines[1] == f"{path}:4: 'add_bias_linear' is on/off: give true or false, not 'maybe'"
    assert lines[2] == f"{path}:1: 'num_layers' (--num-layers) cannot read 'two' as int"
    assert lines[3] == "--lr-warmup-fraction nan: must be a finite number"


def test_a_command_line_with_two_refused_flags_and_an_empty_save(capsys, one_rank):
    lines = errors([*REQUIRED, "--fp16", "--save", "", "--use-cpu-initialization"], capsys)
    assert len(lines) == 3, lines
    assert lines[0].startswith("--fp16: fp16 training"), lines
    assert lines[1].startswith("--use-cpu-initialization: this driver initializes the weights on the GPU"), lines
    assert lines[2].startswith("--save '': an empty path"), lines


def test_a_flag_given_twice_is_reported_once(tmp_path, capsys, one_rank):
    path = write(tmp_path, "fp16: true\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path, "--fp16"], capsys)
    assert len(lines) == 1 and lines[0].startswith("--fp16: "), lines


def test_one_flag_one_line(capsys, one_rank):
    """A float flag out of more than one domain (NaN is not finite and not a fraction) is one
    line, and a single problem prints exactly one line as before."""
    lines = errors([*REQUIRED, "--hidden-dropout", "nan"], capsys)
    assert lines == ["--hidden-dropout nan: must be a finite number"]
    assert errors([*REQUIRED, "--fp16"], capsys) == [errors([*REQUIRED, "--fp16"], capsys)[0]]


def test_the_recipe_problems_come_before_an_unknown_flag(tmp_path, capsys, one_rank):
    path = write(tmp_path, "not_a_flag: 1\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path, "--no-such-flag"], capsys)
    assert lines == [f"{path}:1: unknown key 'not_a_flag' (no flag --not-a-flag)",
                     "unrecognized arguments: --no-such-flag"]


def test_later_checks_wait_for_the_collected_ones(capsys, one_rank, monkeypatch):
    """check_environment onwards runs only where the settings on their own pass."""
    monkeypatch.setenv("WORLD_SIZE", "zero")
    assert errors([*REQUIRED, "--fp16"], capsys)[0].startswith("--fp16: ")
    assert errors(REQUIRED, capsys) == ["WORLD_SIZE='zero' (set by the launcher) is not a positive integer"]


def test_a_broken_file_is_still_one_error(tmp_path, capsys, one_rank):
    path = write(tmp_path, "fp16: true\nnot_a_flag: [1\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path], capsys)
    assert len(lines) == 1 and lines[0].startswith(path), lines


def test_the_recipe_functions_raise_every_bad_key_together(tmp_path):
    parser = build_parser()
    path = write(tmp_path, "not_a_flag: 1\nother_unknown: 2\nnum_layers: 4\n")
    with pytest.raises(RecipeError) as exc:
        read_recipe(path, parser)
    assert [str(problem) for problem in exc.value.problems] == [
        f"{path}:1: unknown key 'not_a_flag' (no flag --not-a-flag)",
        f"{path}:2: unknown key 'other_unknown' (no flag --other-unknown)"]
    assert str(exc.value) == "\n".join(str(problem) for problem in exc.value.problems)

    problems = []
    recipe = read_recipe(path, parser, problems)
    assert len(problems) == 2 and dict(recipe) == {"num_layers": 4}

    with pytest.raises(RecipeError) as exc:
        apply_recipe(parser, {"num_layers": "x", "hidden_size": "y", "lr": 0.1}, "r.yaml")
    assert len(exc.value.problems) == 2
    assert parser.get_default("lr") is None  # nothing applied

    problems = []
    apply_recipe(parser, {"num_layers": "x", "lr": 0.1}, "r.yaml", problems)
    assert len(problems) == 1 and parser.get_default("lr") == 0.1


def test_unknown_keys_and_an_impossible_combination_in_one_run(tmp_path, capsys, one_rank):
    """Two keys no flag takes and a value the settings together refuse (top-k above the expert
    count): all three in one run, the keys first."""
    path = write(tmp_path, "num-experts: 4\nmoe-router-topk: 8\nbogus_key: 1\nanother_bogus: 2\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path], capsys)
    assert lines == [f"{path}:3: unknown key 'bogus_key' (no flag --bogus-key)",
                     f"{path}:4: unknown key 'another_bogus' (no flag --another-bogus)",
                     "--moe-router-topk 8 exceeds --num-experts 4"]


def test_unknown_keys_alone_are_still_refused(tmp_path, capsys, one_rank):
    path = write(tmp_path, "num-experts: 4\nbogus_key: 1\n")
    assert errors([*REQUIRED, "--yaml-cfg", path], capsys) == [f"{path}:2: unknown key 'bogus_key' (no flag --bogus-key)"]


def test_a_bad_value_keeps_the_combination_checks_back(tmp_path, capsys, one_rank):
    """A value refused on its own leaves the setting unread: the checks of the settings together
    would judge a value the user did not give, so they wait for the next run."""
    path = write(tmp_path, "num-experts: 4\nmoe-router-topk: 8\nbogus_key: 1\nnum-layers: two\n")
    lines = errors([*REQUIRED, "--yaml-cfg", path], capsys)
    assert len(lines) == 2 and "bogus_key" in lines[0] and "num-layers" in lines[1], lines
