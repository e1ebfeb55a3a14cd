"""One preflight for both loops (``preflight.judge``): the config is built once before start-up
in each loop, and the same inputs are refused by this package's driver and by Megatron-LM's own
loop (``megatron_lm.enable()``'s check where Megatron-LM validates its args) with the same words.

The table runs the same command line through both loops: the driver's ``parse_args``, and
Megatron-LM core_v0.16.1's own parser and ``validate_args`` (``MEGATRON_LM_PATH``; skipped
without it)."""

import argparse

import pytest
import torch

from megatron.moe_patches import megatron_lm
from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_KEY
from megatron.moe_patches.config import PatchedTransformerConfig

import checkpoint_files
from fake_megatron_lm import MEGATRON_LM_MODULES, fake_training, nothing_enabled  # noqa: F401  (autouse)
from test_all_refusals import errors as driver_refusals  # the driver's error lines for a refused argv
from test_megatron_lm_integration import megatron_parse_args, megatron_training, real_megatron_lm  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_rank")


@pytest.fixture
def builds(monkeypatch):
    """The number of TransformerConfig builds so far (the patched class's ``__post_init__`` runs)."""
    counted = []
    stock = PatchedTransformerConfig.__post_init__

    def counting(self):
        counted.append(type(self))
        return stock(self)

    monkeypatch.setattr(PatchedTransformerConfig, "__post_init__", counting)
    return counted


# --- (a) the config is built once before start-up -----------------------------------------------


@pytest.mark.parametrize("print_plan", [False, True])
def test_the_driver_builds_the_config_once_before_start_up(builds, monkeypatch, capsys, reverted, print_plan):
    """pretrain_gpt.py up to start-up: the flags' checks, the plan it prints, then ``pretrain``
    (stopped here: start-up is where the GPUs come in)."""
    from megatron.moe_patches.driver import training

    monkeypatch.setattr(training, "require_gpu", lambda prog: None)
    monkeypatch.setattr(training, "pretrain", lambda *args: print("start-up"))
    argv = ["--yaml-cfg", "tiny-moe", *(["--print-plan"] if print_plan else [])]
    assert training.main(argv, prog="pretrain_gpt.py") == 0
    out = capsys.readouterr().out
    assert "expert backend: grouped_mm" in out and ("start-up" in out) is not print_plan
    assert len(builds) == 1, builds


def test_megatron_lms_loop_builds_the_config_once_before_start_up(builds, monkeypatch):
    """Megatron-LM validating its args after ``enable()`` (a stand-in of its modules)."""
    package = fake_training(monkeypatch, MEGATRON_LM_MODULES)
    megatron_lm.enable()
    try:
        args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                                  moe_grouped_gemm=True, use_checkpoint_args=False)
        assert package.initialize.initialize_megatron(args) is args
    finally:
        megatron_lm.disable()
    assert len(builds) == 1, builds


@real_megatron_lm
def test_megatron_lm_itself_builds_the_config_once_before_start_up(builds, megatron_training, monkeypatch):
    megatron_lm.enable()
    args = megatron_parse_args(megatron_training, [*MODEL, "--moe-grouped-gemm"], monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # validate_args asks: Hopper
    megatron_training.initialize.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    assert len(builds) == 1, builds


# --- (b) the same refusals in both loops --------------------------------------------------------

# A small MoE model both loops take as it is (each names the run's length, rate and vocabulary).
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1", "--bf16",
         "--vocab-size", "1024", "--train-iters", "100", "--lr", "1e-4", "--num-experts", "4",
         "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
GROUPED = ["--moe-grouped-gemm", "--moe-device-tokens-per-expert"]
SYNC_FREE = [*GROUPED, "--moe-permute-fusion"]  # what a graph of the MoE layer needs
MOE_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe"]
WHOLE_ITERATION = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
                   "--no-check-for-nan-in-loss-and-grad"]
SHAPE = dict(num_layers=2, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4, num_experts=4)


def other_shape(root, megatron):
    """A checkpoint of a model with another hidden size (Megatron-LM saves a Namespace, the driver a dict)."""
    saved = argparse.Namespace(**SHAPE) if megatron else dict(SHAPE)
    return ["--load", str(checkpoint_files.checkpoint_root(root, common={"iteration": 4, "args": saved}))]


def grouped_optimizer_states(root, megatron):
    """Flat optimizer states saved with single grouped expert weights (this run has per-expert ones)."""
    state = {"optimizer": {"param_groups": []}, "param_state_sharding_type": "dp_reshardable",
             LAYOUT_KEY: {"moe_single_grouped_weight": True}}
    return ["--load", str(checkpoint_files.checkpoint_root(root, common={"iteration": 4, "args": {}, "optimizer": state}))]


def no_checkpoint(root, megatron):
    root.mkdir()
    return ["--load", str(root), "--exit-on-missing-checkpoint"]


def missing_iteration(root, megatron):
    root = checkpoint_files.checkpoint_root(root, iteration=4)
    (root / "latest_checkpointed_iteration.txt").write_text("8")
    return ["--load", str(root)]


# (id, the flags after MODEL or a function (folder, for Megatron-LM) -> them, what both refusals say).
# The checkpoint's refusals are the same line in both loops (one rule, one text) but for the model
# shape's, which each loop words its own way (it names the flag and both values in either).
REFUSED = [
    ("single-grouped-weight-without-grouped-gemm", ["--moe-single-grouped-weight"],
     "moe_single_grouped_weight=True needs TE grouped experts"),
    ("symmetric-exchange-without-device-counts", ["--moe-grouped-gemm", "--moe-symmetric-exchange"],
     "--moe-device-tokens-per-expert"),
    ("device-counts-without-grouped-experts", ["--moe-device-tokens-per-expert"],
     "moe_device_tokens_per_expert=True applies to grouped experts only"),
    ("glu-interleave-without-glu", [*GROUPED, "--moe-mlp-glu-interleave-size", "16"],
     "moe_mlp_glu_interleave_size applies to gated (GLU) MoE experts only"),
    ("glu-interleave-not-dividing", [*GROUPED, "--swiglu", "--moe-mlp-glu-interleave-size", "48"],
     "moe_mlp_glu_interleave_size=48 must divide the per-partition MoE FFN size 128"),
    ("hybridep-fusion-without-hybridep", ["--moe-permute-fusion-into-hybridep"],
     "moe_permute_fusion_into_hybridep=True only applies to the HybridEP dispatcher"),
    ("hybridep-blocks-without-hybridep", ["--moe-hybridep-num-blocks-permute", "4"],
     "moe_hybridep_num_blocks_permute only applies to the HybridEP dispatcher"),
    ("force-load-balancing-in-moe-graphs", [*SYNC_FREE, "--moe-router-force-load-balancing", *MOE_GRAPHS],
     "--moe-router-force-load-balancing draws random numbers inside the layer"),
    ("moe-graphs-with-host-counts", ["--moe-grouped-gemm", *MOE_GRAPHS],
     "cuda_graph_scope=moe for dropless MoE needs the graph-safe MoE layer (F11)"),
    ("force-load-balancing-in-the-whole-iteration", [*SYNC_FREE, "--moe-router-force-load-balancing", *WHOLE_ITERATION],
     "cuda_graph_scope=full_iteration replays every micro-batch's forward and backward"),
    ("load-of-another-model-shape", other_shape, "--hidden-size 128"),
    ("load-of-optimizer-states-in-another-layout", grouped_optimizer_states,
     "distributed-optimizer states are flat buffers in another expert parameter layout"),
    ("load-without-a-checkpoint-under-exit-on-missing", no_checkpoint,
     "the directory is empty, and --exit-on-missing-checkpoint is set"),
    ("load-naming-a-missing-iteration", missing_iteration, "the checkpoint tracker"),
]


def megatron_lm_refusals(training, argv, monkeypatch, capsys):
    """Megatron-LM's error lines for ``argv``: its parser, then its validate_args as
    initialize_megatron calls it (``enable()``'s check runs once its own checks pass)."""
    args = megatron_parse_args(training, argv, monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        training.initialize.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    assert exited.value.code == 2, argv
    return [line.split(": error: ", 1)[1] for line in capsys.readouterr().err.splitlines() if ": error: " in line]


@pytest.fixture
def fused_permute_kernels(monkeypatch):
    """megatron-core asks TE for its fused permute kernels when it checks --moe-permute-fusion:
    stand-ins here (no TE on a CPU machine; no kernel runs)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)


@real_megatron_lm
@pytest.mark.usefixtures("fused_permute_kernels")
@pytest.mark.parametrize("given, said", [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED])
def test_both_loops_refuse_the_same_inputs_with_the_same_words(megatron_training, monkeypatch, capsys, tmp_path,
                                                               given, said):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # validate_args asks: Hopper
    if given is other_shape:  # each loop saves its own kind of args
        driver_flags, loop_flags = given(tmp_path / "driver", False), given(tmp_path / "loop", True)
    else:  # the same command line, the same checkpoint
        driver_flags = loop_flags = given(tmp_path / "ckpt", False) if callable(given) else given
    driver = driver_refusals([*MODEL, *driver_flags], capsys)
    assert len(driver) == 1 and said in driver[0], driver
    megatron_lm.enable()
    loop = megatron_lm_refusals(megatron_training, [*MODEL, *loop_flags], monkeypatch, capsys)
    assert len(loop) == 1 and said in loop[0], loop
    if callable(given) and given is not other_shape:
        assert loop == driver


@real_megatron_lm
def test_both_loops_take_the_model_the_table_changes(megatron_training, monkeypatch, parsed):
    """The table's refusals are the rows' own: the model alone passes both loops."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert parsed([*MODEL, *GROUPED]).num_experts == 4
    megatron_lm.enable()
    args = megatron_parse_args(megatron_training, [*MODEL, *GROUPED], monkeypatch)
    megatron_training.initialize.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # no SystemExit
