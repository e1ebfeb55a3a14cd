"""``megatron_lm.enable()``: the patch set in Megatron-LM's own pretrain_gpt.py.

The first tests need no Megatron-LM: the fields' help for its flag generator, and the
wiring of the checkpoint-args hook against a small fake ``megatron.training``. The tests
marked ``real_megatron_lm`` run Megatron-LM core_v0.16.1 itself (its argument parser and
--help, pretrain_gpt.py edited as README says, the config it builds, ``initialize_megatron``
reading a checkpoint's args); they need the checkout named by ``MEGATRON_LM_PATH`` and skip
without it. On a machine without Triton (CPU CI) they import it with megatron_lm_on_cpu's
stand-in for megatron-core's ``import triton`` (an import only: no kernel runs in them).
"""

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.moe_patches import apply, megatron_lm, status
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.fields import PATCH_FIELD_NAMES, PATCH_FIELDS

from fake_megatron_lm import MEGATRON_LM_MODULES as FAKE_MODULES
from fake_megatron_lm import fake_training as install_fake_training, nothing_enabled  # noqa: F401  (autouse)
from megatron_lm_on_cpu import SUBPROCESS_PREAMBLE, import_batch_invariant_kernels

STOCK_CONFIG = tc_module.TransformerConfig
SWITCHES = [f.name for f in PATCH_FIELDS if f.default is False]
SETTINGS = [f.name for f in PATCH_FIELDS if f.default is None]


def flag(name):
    return "--" + name.replace("_", "-")


def saved_patch_args():
    """What a run with every patch flag set saves in its checkpoint (an int setting gets 8)."""
    return {**{name: True for name in SWITCHES}, **{name: 8 for name in SETTINGS}}


def applied_ids():
    return {row.id for row in status() if row.state == "applied"}


def test_all_patch_fields_are_switches_or_int_settings():
    # The tests below pass True / 8 for every patch flag; a field of another kind needs its own value.
    assert sorted(SWITCHES + SETTINGS) == sorted(PATCH_FIELD_NAMES)


def test_importing_the_module_changes_nothing():
    code = (
        "import sys, megatron.core.transformer.transformer_config as t; before = t.TransformerConfig;"
        "import megatron.moe_patches.megatron_lm;"
        "assert t.TransformerConfig is before;"
        "assert not [m for m in sys.modules if m.startswith('megatron.training')];"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_every_patch_flag_gets_its_help_through_megatron_lm_argparse_meta():
    # Megatron-LM's flag generator passes metadata["argparse_meta"] on to add_argument.
    for field in PATCH_FIELDS:
        assert field.metadata["argparse_meta"] == {"help": field.metadata["help"]}, field.name
        assert field.metadata["help"].strip()


# README's lines for Megatron-LM's pretrain_gpt.py: the import, and the call that opens its
# __main__ block.
README_IMPORT = "from megatron.moe_patches import megatron_lm\n"
MAIN_BLOCK = 'if __name__ == "__main__":\n'
README_CALL = "    megatron_lm.enable()\n"


def test_readme_shows_the_lines_the_pretrain_gpt_test_adds():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert README_IMPORT + "\n" + MAIN_BLOCK + README_CALL in readme


# --- the wiring, against a fake megatron.training (fake_megatron_lm.MEGATRON_LM_MODULES) -------


@pytest.fixture
def fake_training(monkeypatch):
    """A stand-in ``megatron.training`` package (its modules as attributes)."""
    package = install_fake_training(monkeypatch, FAKE_MODULES)
    yield package
    megatron_lm.disable()  # before the fake modules leave sys.modules


SMALL_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def parsed_defaults(**given):
    """The args Megatron-LM parses for a small model when no patch flag is given (plus
    ``given``)."""
    return argparse.Namespace(**{**SMALL_MODEL, **{f.name: f.default for f in PATCH_FIELDS}, **given})


def test_enable_applies_the_series(fake_training):
    megatron_lm.enable()
    assert tc_module.TransformerConfig is PatchedTransformerConfig
    assert {row.id for row in status() if row.state == "off"} == set()
    megatron_lm.disable()
    assert tc_module.TransformerConfig is STOCK_CONFIG and not applied_ids()


def test_use_checkpoint_args_restores_the_patch_args(fake_training, monkeypatch):
    megatron_lm.enable()
    # Every patch arg set at once contradicts itself; the config check is tested below.
    monkeypatch.setattr(megatron_lm, "_config_class_and_kwargs", lambda args: None)  # no config judged
    fake_training.checkpointing.SAVED_ARGS["ckpt"] = argparse.Namespace(**saved_patch_args())
    args = parsed_defaults(load="ckpt", use_checkpoint_args=True)

    fake_training.initialize.initialize_megatron(args)

    assert {name: getattr(args, name) for name in PATCH_FIELD_NAMES} == saved_patch_args()
    assert len(fake_training.utils.PRINTED) == len(PATCH_FIELD_NAMES)


def test_no_checkpoint_to_read_changes_nothing(fake_training):
    megatron_lm.enable()
    args = parsed_defaults(load="elsewhere", use_checkpoint_args=True)
    fake_training.initialize.initialize_megatron(args)
    assert args == parsed_defaults(load="elsewhere", use_checkpoint_args=True)


def test_restore_forces_switches_and_keeps_settings_given_on_the_command_line():
    args = argparse.Namespace(moe_single_grouped_weight=False, moe_mlp_glu_interleave_size=16,
                              moe_hybridep_num_blocks_permute=None)
    saved = argparse.Namespace(moe_single_grouped_weight=True, moe_mlp_glu_interleave_size=32,
                               moe_hybridep_num_blocks_permute=4)
    restored = megatron_lm.restore_patch_args(args, saved)
    assert sorted(restored) == ["moe_hybridep_num_blocks_permute", "moe_single_grouped_weight"]
    assert (args.moe_single_grouped_weight, args.moe_mlp_glu_interleave_size,
            args.moe_hybridep_num_blocks_permute) == (True, 16, 4)


def test_a_checkpoint_from_before_the_patch_set_changes_nothing():
    args = argparse.Namespace(moe_single_grouped_weight=True, moe_mlp_glu_interleave_size=None)
    assert megatron_lm.restore_patch_args(args, argparse.Namespace(num_layers=2)) == []
    assert args == argparse.Namespace(moe_single_grouped_weight=True, moe_mlp_glu_interleave_size=None)


def test_enable_twice_wraps_once_and_disable_restores_megatron_lm(fake_training):
    stock = fake_training.checkpointing.load_args_from_checkpoint
    megatron_lm.enable()
    megatron_lm.enable()
    wrapped = fake_training.checkpointing.load_args_from_checkpoint
    assert wrapped is not stock and wrapped.__wrapped__ is stock
    assert fake_training.initialize.load_args_from_checkpoint is wrapped
    megatron_lm.disable()
    assert fake_training.checkpointing.load_args_from_checkpoint is stock
    assert fake_training.initialize.load_args_from_checkpoint is stock


def test_megatron_lm_validating_its_args_checks_the_patch_config_before_start_up(fake_training, capsys):
    """Megatron-LM builds the config at model construction, after the GPUs start; enable()
    has it built when Megatron-LM validates its args, so a refused patch value ends the run
    there: one error line naming the flag, exit status 2 (--yaml-cfg's validation too)."""
    stock = fake_training.arguments.validate_args
    megatron_lm.enable()
    assert fake_training.initialize.validate_args is fake_training.arguments.validate_args is not stock
    good = parsed_defaults(use_checkpoint_args=False, num_moe_experts=4, moe_grouped_gemm=True)
    assert fake_training.initialize.initialize_megatron(good) is good
    for yaml_cfg in (None, "recipe.yaml"):
        bad = parsed_defaults(use_checkpoint_args=False, moe_symmetric_exchange=True, yaml_cfg=yaml_cfg)
        with pytest.raises(SystemExit) as exited:
            fake_training.initialize.initialize_megatron(bad)
        assert exited.value.code == 2
        err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]  # not warnings
        assert len(err) == 1 and "--moe-symmetric-exchange" in err[0], err
        if yaml_cfg is None:
            assert fake_training.arguments.VALIDATED[-1] is bad  # Megatron-LM's own checks ran first
    megatron_lm.disable()
    assert fake_training.initialize.validate_args is fake_training.arguments.validate_args is stock
    fake_training.initialize.initialize_megatron(bad)  # unwrapped: nothing checked here any more


@pytest.mark.parametrize("scope", [["moe"], ["attn"], [], ["attn", "moe"], ["full_iteration"]])
def test_moe_graphs_at_ep_pass_megatron_lms_inference_padding_rule(fake_training, monkeypatch, scope):
    """Megatron-LM asserts an inference-only flag for local graphs at EP > 1; for the patch
    set's MoE graphs (scope moe, the whole layer or iteration) its own rule judges the config instead, and
    the user's value of the flag is what the run keeps. Other scopes meet Megatron-LM's
    assertion as before."""
    from megatron.core.transformer.enums import CudaGraphScope

    megatron_lm.enable()
    monkeypatch.setattr(megatron_lm, "_config_class_and_kwargs", lambda args: None)  # no config judged
    args = parsed_defaults(use_checkpoint_args=False, num_experts=8, expert_model_parallel_size=2,
                           cuda_graph_impl="local", cuda_graph_scope=[CudaGraphScope[s] for s in scope],
                           moe_pad_experts_for_cuda_graph_inference=False)
    if scope not in (["moe"], [], ["attn", "moe"], ["full_iteration"]):
        with pytest.raises(AssertionError, match="moe-pad-experts-for-cuda-graph-inference"):
            fake_training.initialize.initialize_megatron(args)
        return
    assert fake_training.initialize.initialize_megatron(args) is args
    assert args.moe_pad_experts_for_cuda_graph_inference is False
    args.moe_pad_experts_for_cuda_graph_inference = True  # given at EP 2: kept (issue 57: it was reset)
    fake_training.initialize.initialize_megatron(args)
    assert args.moe_pad_experts_for_cuda_graph_inference is True
    args.expert_model_parallel_size = 1
    fake_training.initialize.initialize_megatron(args)
    assert args.moe_pad_experts_for_cuda_graph_inference is True


def test_every_name_enable_rebinds_in_megatron_lm_is_in_the_registry(fake_training):
    """What enable() changes in Megatron-LM's modules is listed in the registry: apply()'s
    bindings (the config classes) or MEGATRON_LM_WRAPS, each with its reason."""
    from megatron.moe_patches.registry import MEGATRON_LM_WRAPS, SERIES

    modules = {name: module for name, module in sys.modules.items() if name.startswith("megatron.training.")}
    before = {(m, a): v for m, module in modules.items() for a, v in vars(module).items()}
    megatron_lm.enable()
    changed = {(m, a) for m, module in modules.items() for a, v in vars(module).items()
               if before.get((m, a), object()) is not v}
    listed = {(owner, wrap.name) for wrap in MEGATRON_LM_WRAPS for owner in wrap.owners}
    listed |= {(b.owner, b.attribute) for feature in SERIES for b in feature.bindings}
    assert changed and changed <= listed, changed - listed
    assert {("megatron.training.initialize", "validate_args"),
            ("megatron.training.checkpointing", "load_args_from_checkpoint")} <= changed


def test_batches_at_tp1_reach_the_gpu_without_the_broadcasts(fake_training, monkeypatch):
    """At TP 1 the wrapped get_batch_on_this_tp_rank returns Megatron-LM's batch (its keys in
    its order, absent ones None) moved to the GPU, without the stock function's broadcasts;
    at TP > 1 and with hybrid context parallelism the stock function runs. Wrapped where
    Megatron-LM defines it and in the __main__ module that imported it by name."""
    import types as types_module

    from megatron.core import parallel_state

    utils = fake_training.utils
    stock = utils.get_batch_on_this_tp_rank
    main = types_module.ModuleType("__main__")
    main.get_batch_on_this_tp_rank = stock  # pretrain_gpt.py's `from megatron.training.utils import ...`
    monkeypatch.setitem(sys.modules, "__main__", main)
    args = argparse.Namespace(hybrid_context_parallel=False)
    monkeypatch.setattr(fake_training, "get_args", lambda: args, raising=False)
    tp = {"size": 1}
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp["size"])
    moved = []
    monkeypatch.setattr(megatron_lm, "_to_gpu", lambda t: moved.append(t) or t * 10)

    megatron_lm.enable()
    wrapped = utils.get_batch_on_this_tp_rank
    assert wrapped is not stock and main.get_batch_on_this_tp_rank is wrapped
    data = {"tokens": torch.tensor([1, 2]), "labels": torch.tensor([3, 4]), "loss_mask": torch.tensor([1.0, 0.0]),
            "position_ids": torch.tensor([0, 1])}
    batch = main.get_batch_on_this_tp_rank(iter([data]), mtp_on_this_rank=False)
    assert list(batch) == list(megatron_lm.BATCH_KEYS) and utils.STOCK_BATCHES == []
    assert torch.equal(batch["tokens"], data["tokens"] * 10) and len(moved) == 4
    assert batch["attention_mask"] is None and batch["cu_seqlens"] is None
    tp["size"] = 2
    assert wrapped(iter(["x"]), mtp_on_this_rank=True) == {"stock": "x"} and utils.STOCK_BATCHES == [True]
    tp["size"], args.hybrid_context_parallel = 1, True
    assert wrapped(iter(["y"])) == {"stock": "y"}
    megatron_lm.disable()
    assert utils.get_batch_on_this_tp_rank is stock and main.get_batch_on_this_tp_rank is stock


def test_disable_reverts_only_what_enable_applied(fake_training):
    apply(["C0"])
    megatron_lm.enable()
    assert len(applied_ids()) > 1
    megatron_lm.disable()
    assert applied_ids() == {"C0"}


# --- Megatron-LM core_v0.16.1 itself ---------------------------------------------------------

real_megatron_lm = pytest.mark.skipif(
    not os.environ.get("MEGATRON_LM_PATH"),
    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout",
)



def test_the_triton_stand_in_serves_one_import_and_leaves_no_triton_behind():
    """megatron_lm_on_cpu's stand-in, run as the subprocesses below run it (no checkout needed):
    megatron-core's batch_invariant_kernels imports, its kernels refuse to launch, and nothing
    else finds a Triton afterwards (megatron-core, torch, our capability check)."""
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed here: the stand-in is not used")
    code = SUBPROCESS_PREAMBLE + textwrap.dedent("""
        import importlib.util, sys
        import megatron.core.utils, torch.utils._triton
        from megatron.core.transformer.custom_layers import batch_invariant_kernels
        from megatron.moe_patches import capabilities
        assert "triton" not in sys.modules and importlib.util.find_spec("triton") is None
        assert not megatron.core.utils.HAVE_TRITON and not torch.utils._triton.has_triton_package()
        assert not capabilities.triton_available()
        try:
            batch_invariant_kernels.matmul_kernel_persistent[(1,)]()
        except RuntimeError as error:
            print(error)
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "matmul_kernel_persistent" in out.stdout and "no Triton kernel runs here" in out.stdout


@pytest.fixture(scope="module")
def megatron_training():
    """Megatron-LM's ``megatron.training`` from the checkout (after site-packages on the path,
    as its ``megatron`` folder is another portion of the namespace package)."""
    path = os.environ["MEGATRON_LM_PATH"]
    sys.path.append(path)
    # Megatron-LM's training module configures the root logger when imported.
    root_handlers, root_level = logging.root.handlers[:], logging.root.level
    try:
        import_batch_invariant_kernels()  # megatron.training.initialize's import of Triton, on a CPU
        from megatron.training import arguments, checkpointing, initialize
    except ImportError as error:
        sys.path.remove(path)
        pytest.skip(f"Megatron-LM at {path} does not import here: {error}")
    yield types.SimpleNamespace(path=path, arguments=arguments, checkpointing=checkpointing,
                                initialize=initialize)
    logging.root.handlers[:], logging.root.level = root_handlers, root_level
    sys.path.remove(path)


def user_provider(parser):
    parser.add_argument("--user-flag", type=int, default=3, help="a flag of the user's provider")
    return parser


def megatron_parse_args(training, argv, monkeypatch, **kwargs):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return training.arguments.parse_args(**kwargs)


@real_megatron_lm
def test_megatron_lm_parses_every_patch_flag_with_its_default(megatron_training, monkeypatch):
    megatron_lm.enable()
    args = megatron_parse_args(megatron_training, ["--user-flag", "7"], monkeypatch,
                               extra_args_provider=user_provider)
    defaults = {f.name: f.default for f in PATCH_FIELDS}
    assert {name: getattr(args, name) for name in PATCH_FIELD_NAMES} == defaults
    assert args.user_flag == 7  # the provider pretrain_gpt.py passes keeps working beside them

    argv = [*[flag(n) for n in SWITCHES], *[a for n in SETTINGS for a in (flag(n), "8")]]
    args = megatron_parse_args(megatron_training, argv, monkeypatch, extra_args_provider=user_provider)
    assert {name: getattr(args, name) for name in PATCH_FIELD_NAMES} == saved_patch_args()


def patch_flags_help_missing_from(help_output):
    """The patch fields whose flag is not followed by its help text in ``help_output``."""
    text = " ".join(help_output.split())
    missing = []
    for field in PATCH_FIELDS:
        help_text = " ".join(field.metadata["help"].split())
        if not re.search(re.escape(flag(field.name)) + r"( [A-Z_]+)? " + re.escape(help_text), text):
            missing.append(field.name)
    return missing


@real_megatron_lm
@pytest.mark.parametrize("parse", [
    # pretrain_gpt.py's first parse (inprocess_restart), the one that answers --help
    dict(ignore_unknown_args=True),
    # initialize_megatron's, with the provider pretrain_gpt.py passes
    dict(extra_args_provider=user_provider),
])
def test_megatron_lm_help_shows_the_patch_flags_help(megatron_training, monkeypatch, capsys, parse):
    megatron_lm.enable()
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping inside a help text
    with pytest.raises(SystemExit) as exited:
        megatron_parse_args(megatron_training, ["--help"], monkeypatch, **parse)
    assert exited.value.code == 0
    assert patch_flags_help_missing_from(capsys.readouterr().out) == []


@real_megatron_lm
def test_pretrain_gpt_with_the_readme_lines_shows_the_patch_flags_help(megatron_training, tmp_path):
    """Megatron-LM's own pretrain_gpt.py, edited as README says, run with --help."""
    source = open(os.path.join(megatron_training.path, "pretrain_gpt.py")).read()
    assert source.count(MAIN_BLOCK) == 1
    edited = tmp_path / "pretrain_gpt.py"
    edited.write_text(README_IMPORT + source.replace(MAIN_BLOCK, MAIN_BLOCK + README_CALL))
    run = (SUBPROCESS_PREAMBLE + f"import runpy, sys; sys.path.append({megatron_training.path!r}); "
           f"sys.argv = [{str(edited)!r}, '--help']; runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", run], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "100000"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert patch_flags_help_missing_from(out.stdout) == []


@real_megatron_lm
def test_megatron_lm_builds_the_config_with_the_patch_fields(megatron_training, monkeypatch):
    megatron_lm.enable()
    argv = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "1", "--bf16", "--swiglu", "--num-experts", "4",
            "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--moe-single-grouped-weight", "--moe-device-tokens-per-expert",
            "--moe-mlp-glu-interleave-size", "16"]
    args = megatron_parse_args(megatron_training, argv, monkeypatch)
    # validate_args asks the GPU's compute capability for --moe-grouped-gemm: say Hopper.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    megatron_training.arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    config = megatron_training.arguments.core_transformer_config_from_args(args)
    assert (config.moe_single_grouped_weight, config.moe_device_tokens_per_expert,
            config.moe_mlp_glu_interleave_size) == (True, True, 16)


@real_megatron_lm
def test_megatron_lm_refuses_a_contradicting_patch_flag_when_it_validates_its_args(megatron_training, monkeypatch,
                                                                                  capsys):
    """Megatron-LM's own validate_args, reached through initialize's binding as
    initialize_megatron calls it: the exchange without device token counts is refused there,
    one error line, exit status 2 (before torch.distributed starts)."""
    megatron_lm.enable()
    argv = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "1", "--bf16", "--swiglu", "--num-experts", "4",
            "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--moe-symmetric-exchange"]
    args = megatron_parse_args(megatron_training, argv, monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    with pytest.raises(SystemExit) as exited:
        megatron_training.initialize.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    assert exited.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(err) == 1 and "--moe-device-tokens-per-expert" in err[0], err


@real_megatron_lm
def test_megatron_lm_use_checkpoint_args_restores_the_patch_flags(megatron_training, monkeypatch, tmp_path):
    # A checkpoint in Megatron-LM's legacy torch layout holding the saved args.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    rank_dir = tmp_path / "iter_0000005" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    saved = argparse.Namespace(num_layers=4, **saved_patch_args())
    torch.save({"args": saved, "iteration": 5, "checkpoint_version": 3.0}, rank_dir / "model_optim_rng.pt")

    megatron_lm.enable()
    argv = ["--load", str(tmp_path), "--use-checkpoint-args"]
    args = megatron_parse_args(megatron_training, argv, monkeypatch)

    class ArgsRestored(Exception):
        """Stops initialize_megatron where it has restored the args, before its GPU set-up."""

    def stop(restored_args, defaults):
        raise ArgsRestored(restored_args)

    monkeypatch.setattr(megatron_training.initialize, "validate_args", stop)
    with pytest.raises(ArgsRestored) as restored:
        megatron_training.initialize.initialize_megatron(parsed_args=args, allow_no_cuda=True)
    args = restored.value.args[0]
    assert args.num_layers == 4  # Megatron-LM's own restore ran too
    assert {name: getattr(args, name) for name in PATCH_FIELD_NAMES} == saved_patch_args()


def test_the_dataset_helpers_build_is_skipped_only_where_the_wheel_ships_them_built(monkeypatch):
    """megatron-core's wheel has the compiled helpers and no Makefile: Megatron-LM's `make`
    would fail and end the run. A source tree (Makefile there) or no compiled module: its build runs."""
    import sys
    import types

    from megatron.core.datasets import utils

    stock = utils.compile_helpers
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", types.ModuleType("helpers_cpp"))
    monkeypatch.setattr(megatron_lm.os.path, "exists", lambda path: False)
    megatron_lm._skip_dataset_helpers_build()
    try:
        assert utils.compile_helpers is not stock and utils.compile_helpers() is None
    finally:
        megatron_lm.disable()
    assert utils.compile_helpers is stock
    monkeypatch.setattr(megatron_lm.os.path, "exists", lambda path: path.endswith("Makefile"))
    megatron_lm._skip_dataset_helpers_build()
    assert utils.compile_helpers is stock


@pytest.mark.parametrize("level, barrier, spiky, refused", [
    (1, True, False, "--timing-log-level 0"), (2, True, False, "--timing-log-level 0"),
    (1, False, False, "--timing-log-level 0"),  # the timers synchronize the device even without the barrier
    (0, True, True, "drop --check-for-spiky-loss"), (0, True, False, None)])
def test_full_iteration_with_host_work_inside_is_refused_before_start_up(fake_training, capsys, monkeypatch, level,
                                                                         barrier, spiky, refused):
    """megatron-core's schedule starts its level-1 forward-backward timer inside the captured
    iteration, and its timers synchronize the device (the capture failed so on an H200); the
    spiky-loss check reads each loss on the host there. Either ends the run before start-up."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.enums import CudaGraphScope

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):  # megatron-core asks TE for them
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    megatron_lm.enable()
    try:
        args = parsed_defaults(use_checkpoint_args=False, num_moe_experts=4, moe_grouped_gemm=True,
                               moe_device_tokens_per_expert=True, moe_permute_fusion=True, bf16=True,
                               params_dtype=torch.bfloat16, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, cuda_graph_impl="local", cuda_graph_scope=[CudaGraphScope.full_iteration],
                               timing_log_level=level, barrier_with_L1_time=barrier, check_for_spiky_loss=spiky)
        if not refused:
            assert fake_training.initialize.initialize_megatron(args) is args
            return
        with pytest.raises(SystemExit) as exited:
            fake_training.initialize.initialize_megatron(args)
        assert exited.value.code == 2
        err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
        assert len(err) == 1 and refused in err[0] and "full_iteration" in err[0], err
    finally:
        megatron_lm.disable()
