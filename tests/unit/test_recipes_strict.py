"""--yaml-cfg recipes are read as strictly as the command line (issue 18): int means int,
float flags take ints, on/off flags take true/false, null means "not set" (as in
Megatron-LM's YAML files); files that are not UTF-8, not YAML, hold Python tags, set a key
twice or set nothing are refused with the file and line. Also Megatron's nested-recipe
aliases, each one."""

import pytest

from megatron.moe_patches.driver.arguments import build_parser, parse_args
from megatron.moe_patches.driver.recipes import FIELD_ALIASES, RecipeError, apply_recipe, flatten_recipe, read_recipe

from driver_model import REQUIRED, indexed_dataset

ERROR = "pretrain_gpt.py: error: "

pytestmark = pytest.mark.usefixtures("one_rank")


def recipe(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize("text, message", [
    ("num-layers: 2.7\n", "'num-layers' (--num-layers) needs an integer, not 2.7"),
    ("num-layers: 2.0\n", "'num-layers' (--num-layers) needs an integer, not 2.0"),
    ("num-layers: true\n", "'num-layers' (--num-layers) needs an integer, not true"),
    ("num-layers: [2, 4]\n", "'num-layers' (--num-layers) takes one value, not a list ([2, 4])"),
    ("num-layers: {a: 1}\n", "'num-layers' (--num-layers) takes one value, not a mapping ({'a': 1})"),
    ("moe-mlp-glu-interleave-size: 32.5\n",
     "'moe-mlp-glu-interleave-size' (--moe-mlp-glu-interleave-size) needs an integer, not 32.5"),
    ("moe-hybridep-num-blocks-permute: false\n",
     "'moe-hybridep-num-blocks-permute' (--moe-hybridep-num-blocks-permute) needs an integer, not false"),
    ("hidden-size: wide\n", "'hidden-size' (--hidden-size) cannot read 'wide' as int"),
    ("lr: true\n", "'lr' (--lr) needs a number, not true"),
    ("lr: [0.1]\n", "'lr' (--lr) takes one value, not a list ([0.1])"),
    ("lr: fast\n", "'lr' (--lr) cannot read 'fast' as float"),
    ("swiglu: 1\n", "'swiglu' (--swiglu) is an on/off flag; give true or false, not 1"),
    ("swiglu: 'yes'\n", "'swiglu' (--swiglu) is an on/off flag; give true or false, not 'yes'"),
    ("no-rope-fusion: 1\n", "'no-rope-fusion' (--no-rope-fusion) is an on/off flag; give true or false, not 1"),
    ("normalization: true\n", "'normalization' (--normalization) needs a string, not true"),
    ("normalization: BatchNorm\n",
     "'normalization' (--normalization) must be one of ['LayerNorm', 'RMSNorm'], not 'BatchNorm'"),
    ("save: 2024-01-01\n", "'save' (--save) needs a string, not datetime.date(2024, 1, 1) (quote it)"),
    ("data-path: [0.5, [a]]\n", "'data-path' (--data-path) needs a string, not ['a']"),
])
def test_values_are_as_strict_as_the_command_line(tmp_path, capsys, text, message, refused):
    path = recipe(tmp_path, "seed: 1\n" + text)
    assert refused(["--yaml-cfg", path]) == f"{path}:2: {message}"


def test_null_means_not_set(tmp_path):
    """As in Megatron-LM's YAML files: the flag keeps its default, and the key must still be a flag."""
    args = parse_args([*REQUIRED, "--yaml-cfg", recipe(tmp_path, "seed: 7\nnum-experts: null\nswiglu:\n"
                                                       "language_model:\n  num_query_groups: null\n")])
    assert (args.seed, args.num_experts, args.swiglu, args.num_query_groups) == (7, None, False, None)


def test_float_flags_take_ints_and_yaml_exponents(tmp_path):
    path = recipe(tmp_path, "lr: 1\nmin-lr: 1e-4\nclip-grad: 2\n")
    args = parse_args([*REQUIRED[:-2], "--yaml-cfg", path])  # the required flags but --lr, which the recipe sets
    assert (args.lr, args.min_lr, args.clip_grad) == (1.0, 1e-4, 2.0)
    assert all(type(v) is float for v in (args.lr, args.min_lr, args.clip_grad))


def test_good_values_and_lists(tmp_path):
    pre_a, pre_b = indexed_dataset(tmp_path, "pre_a"), indexed_dataset(tmp_path, "pre_b")
    args = parse_args(["--yaml-cfg", recipe(tmp_path, "num-layers: 4\nswiglu: true\nnormalization: RMSNorm\n"
                                            f"data-path: [0.3, {pre_a}, 0.7, {pre_b}]\nsplit: 98,2,0\n"),
                       *REQUIRED[2:]])
    assert (args.num_layers, args.swiglu, args.normalization, args.split) == (4, True, "RMSNorm", "98,2,0")
    assert args.data_path == ["0.3", pre_a, "0.7", pre_b]
    one = recipe(tmp_path, f"data-path: {pre_a}\n", "one.yaml")
    assert parse_args([*REQUIRED, "--yaml-cfg", one]).data_path == [pre_a]


def test_flag_named_switches_and_flags_with_another_dest(tmp_path):
    """A key may name the flag: ``no-fp8-wgrad: true`` gives it, false leaves it out;
    ``norm-epsilon`` sets layernorm_epsilon."""
    path = recipe(tmp_path, "no-fp8-wgrad: true\nno-rope-fusion: false\nnorm-epsilon: 1.0e-6\n"
                  "apply-layernorm-1p: true\n")
    loaded = read_recipe(path, build_parser())
    assert dict(loaded) == {"fp8_wgrad": False, "layernorm_epsilon": 1e-6, "layernorm_zero_centered_gamma": True}


def test_command_line_int_flags_refuse_floats_and_bools(capsys, refused):
    assert refused(["--num-layers", "2.7"]) == "argument --num-layers: invalid int value: '2.7'"
    assert refused(["--moe-mlp-glu-interleave-size", "true"]) == (
        "argument --moe-mlp-glu-interleave-size: invalid int value: 'true'")
    assert parse_args([*REQUIRED, "--lr", "1"]).lr == 1.0


@pytest.mark.parametrize("content, message", [
    ("num-layers: 2\nhidden-size: [64\n", ":3: invalid YAML: while parsing a flow sequence, expected ',' or ']', but got '<stream end>' (column 1)"),
    ("num-layers: 2\n  hidden-size: 64\n", ":2: invalid YAML: mapping values are not allowed here (column 14)"),
    ("num-layers: 2\n---\nnum-layers: 3\n", ":2: invalid YAML: expected a single document in the stream, but found "
     "another document (column 1)"),
    (b"num-layers: 2\n# caf\xe9\n", ":2: not UTF-8 text (byte 0xe9 at offset 19); save the recipe as UTF-8"),
    ("num-layers: 2\nhidden-size: !!python/object/apply:os.system ['echo owned > OWNED']\n",
     ":2: unsupported YAML tag !!python/object/apply:os.system: a recipe holds plain values (numbers, strings, "
     "true/false, lists); tags that build Python objects are refused"),
    ("!!python/object:argparse.Namespace {num_layers: 2}\n",
     ":1: unsupported YAML tag !!python/object:argparse.Namespace: a recipe holds plain values (numbers, strings, "
     "true/false, lists); tags that build Python objects are refused"),
    ("", ": the recipe is empty (it sets no flag); give 'flag: value' lines or drop --yaml-cfg"),
    ("# only a comment\n", ": the recipe is empty (it sets no flag); give 'flag: value' lines or drop --yaml-cfg"),
    ("{}\n", ": the recipe is empty (it sets no flag); give 'flag: value' lines or drop --yaml-cfg"),
    ("language_model: {}\n", ": the recipe sets no flag (empty sections, null values or flags set to false); "
     "give 'flag: value' lines"),
    ("num-layers: null\n", ": the recipe sets no flag (empty sections, null values or flags set to false); "
     "give 'flag: value' lines"),
    ("- num-layers: 2\n", ": a recipe must be a mapping of flag names to values, not list"),
    ("num-layers: 2\nseed: 3\nnum-layers: 4\n", ":3: 'num-layers' is set twice (also on line 1); keep one"),
    ("language_model:\n  num_layers: 2\n  num_layers: 3\n", ":3: 'num_layers' is set twice (also on line 2); keep one"),
    ("num_layers: 2\nnum-layers: 3\n", ":2: recipe sets 'num_layers' twice (as 'num_layers' and 'num-layers')"),
    ("seed: 1\n7: 2\n", ":2: key 7 is not a flag name"),
    ("seed: 1\nnum-laters: 3\n", ":2: unknown key 'num_laters' (no flag --num-laters)"),
    ("language_model:\n  hidden_sise: 8\n", ":2: unknown key 'hidden_sise' (no flag --hidden-sise)"),
    ("language_model: 3\n", ":1: recipe section 'language_model' must be a mapping"),
])
def test_bad_files_name_the_file_and_line(tmp_path, capsys, monkeypatch, content, message, refused):
    monkeypatch.chdir(tmp_path)
    path = recipe(tmp_path, content)
    assert refused(["--yaml-cfg", path]) == f"{path}{message}"
    assert not (tmp_path / "OWNED").exists()  # a tag is refused, never run


def test_missing_recipe_and_directory(tmp_path, refused):
    first = refused(["--yaml-cfg", str(tmp_path / "nope.yaml")])
    assert first.startswith(f"--yaml-cfg {tmp_path / 'nope.yaml'}: ")
    with pytest.raises(RecipeError, match="cannot read the recipe"):
        read_recipe(str(tmp_path), build_parser())


# --- Megatron's nested form: every alias, both ways ----------------------------------------


@pytest.mark.parametrize("key, value, dest, expected", [
    ("num_moe_experts", 4, "num_experts", 4),
    ("gated_linear_unit", True, "swiglu", True),
    ("gated_linear_unit", False, "swiglu", False),
    ("add_bias_linear", False, "disable_bias_linear", True),
    ("add_bias_linear", True, "disable_bias_linear", False),
    ("fp8", "hybrid", "fp8_format", "hybrid"),
])
def test_each_nested_alias(tmp_path, key, value, dest, expected):
    spelled = {True: "true", False: "false"}.get(value, value)
    for section in ("language_model", "model_parallel", None):  # any section, or the top level
        body = f"{key}: {spelled}\n" if section is None else f"{section}:\n  {key}: {spelled}\n"
        parser = build_parser()
        loaded = read_recipe(recipe(tmp_path, body), parser)
        assert dict(loaded) == {dest: expected}
        apply_recipe(parser, loaded, loaded.path)
        assert getattr(parser.parse_args([]), dest) == expected


def test_the_alias_table():
    assert {k: v[0] for k, v in FIELD_ALIASES.items()} == {
        "num_moe_experts": "num_experts", "gated_linear_unit": "swiglu", "activation_func": "swiglu",
        "add_bias_linear": "disable_bias_linear", "fp8": "fp8_format"}


def test_nested_recipe_parses_to_the_flat_one(tmp_path):
    nested = ("language_model:\n  num_layers: 3\n  hidden_size: 128\n  num_attention_heads: 4\n"
              "  gated_linear_unit: true\n  add_bias_linear: false\n  num_moe_experts: 4\n  moe_ffn_hidden_size: 64\n"
              "  moe_grouped_gemm: true\nmodel_parallel:\n  expert_model_parallel_size: 2\n"
              "bf16: true\nfp8: e4m3\nmicro_batch_size: 2\n")
    flat = ("num-layers: 3\nhidden-size: 128\nnum-attention-heads: 4\nswiglu: true\ndisable-bias-linear: true\n"
            "num-experts: 4\nmoe-ffn-hidden-size: 64\nmoe-grouped-gemm: true\nexpert-model-parallel-size: 2\n"
            "bf16: true\nfp8-format: e4m3\nmicro-batch-size: 2\n")
    a = build_parser()
    b = build_parser()
    apply_recipe(a, read_recipe(recipe(tmp_path, nested, "n.yaml"), a), "n.yaml")
    apply_recipe(b, read_recipe(recipe(tmp_path, flat, "f.yaml"), b), "f.yaml")
    assert vars(a.parse_args([])) == vars(b.parse_args([]))


def test_alias_values_are_checked_too(tmp_path, refused):
    path = recipe(tmp_path, "language_model:\n  add_bias_linear: 'no'\n")
    assert refused(["--yaml-cfg", path]) == f"{path}:2: 'add_bias_linear' is on/off: give true or false, not 'no'"
    path = recipe(tmp_path, "language_model:\n  num_moe_experts: 2.5\n", "b.yaml")
    assert refused(["--yaml-cfg", path]) == f"{path}:2: 'num_moe_experts' (--num-experts) needs an integer, not 2.5"
    with pytest.raises(RecipeError, match="sets 'num_experts' twice"):
        flatten_recipe({"num_experts": 2, "num_moe_experts": 4}, build_parser())
