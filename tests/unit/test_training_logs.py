"""What each logged iteration reports, and where: the log line and TensorBoard scalars under
Megatron-LM's names. The numbers come from the loop on a GPU; these tests check the
arithmetic and the wiring on CPU."""

import argparse
import ast
import os
import types
from pathlib import Path

import pytest

from megatron.moe_patches.driver import arguments, training
from megatron.moe_patches.driver.arguments import parse_args

from driver_model import REQUIRED


def args(**overrides):
    namespace = argparse.Namespace(global_batch_size=16, seq_length=256, train_iters=100)
    vars(namespace).update(overrides)
    return namespace


def test_metrics_and_the_log_line(monkeypatch):
    monkeypatch.setattr(training, "model_flops_per_token", lambda a: 1e9)
    times = {"iteration": 0.5, "forward-backward": 0.4, "optimizer": 0.1}
    metrics = training.iteration_metrics(args(), 10, times, 1e-3, 2.5, 0.75, 2, 3 * 2**20, 5 * 2**20)
    assert metrics == {
        "lm loss": 2.5, "loss-scale": 1.0, "learning-rate": 1e-3, "grad-norm": 0.75, "iteration-time": 0.5,
        "throughput": 1e9 * 16 * 256 / 0.5 / 2 / 1e12, "tokens-per-sec": 16 * 256 / 0.5,
        "consumed-samples": 160, "batch-size": 16, "mem-allocated-bytes": 3 * 2**20, "mem-max-allocated-bytes": 5 * 2**20,
        "forward-backward-time": 0.4, "optimizer-time": 0.1,
    }
    line = training._log_line(args(), 10, metrics, started=0.0)
    for part in ("iteration       10/     100", "consumed samples:          160",
                 "elapsed time per iteration (ms): 500.0", "forward-backward (ms): 400.0", "optimizer (ms): 100.0",
                 "tokens/s: 8192", "learning rate: 1.000000E-03", "lm loss: 2.500000E+00", "grad norm: 0.750",
                 "mem (MiB): 3/5"):
        assert part in line, (part, line)


def test_no_phase_times_without_the_timing_level(monkeypatch):
    monkeypatch.setattr(training, "model_flops_per_token", lambda a: 1e9)
    metrics = training.iteration_metrics(args(), 1, {"iteration": 0.5}, 1e-3, 2.5, 0.75, 1, 0, 0)
    assert not [name for name in metrics if name.endswith("-time") and name != "iteration-time"]
    assert "(ms): " in training._log_line(args(), 1, metrics, 0.0) and "optimizer (ms)" not in training._log_line(
        args(), 1, metrics, 0.0)


def test_num_zeros_only_when_counted(monkeypatch):
    """--log-num-zeros-in-grad: the count is one metric, "num-zeros", that the log line prints
    as Megatron-LM's "num zeros" and TensorBoard gets under the same name as the rest."""
    monkeypatch.setattr(training, "model_flops_per_token", lambda a: 1e9)
    counted = training.iteration_metrics(args(), 3, {"iteration": 0.5}, 1e-3, 2.5, 0.75, 1, 0, 0, num_zeros=1234.0)
    assert counted["num-zeros"] == 1234.0
    line = training._log_line(args(), 3, counted, 0.0)
    assert "| grad norm: 0.750 | num zeros: 1234 | number of skipped iterations:" in line, line
    written = []
    writer = types.SimpleNamespace(add_scalar=lambda name, value, step: written.append((name, value, step)),
                                   flush=lambda: None)
    training.write_tensorboard(writer, counted, 3)
    assert ("num-zeros", 1234.0, 3) in written

    uncounted = training.iteration_metrics(args(), 3, {"iteration": 0.5}, 1e-3, 2.5, 0.75, 1, 0, 0)
    assert "num-zeros" not in uncounted
    assert "num zeros" not in training._log_line(args(), 3, uncounted, 0.0)


def test_log_num_zeros_in_grad_flag(one_rank):
    assert parse_args(REQUIRED).log_num_zeros_in_grad is False
    assert parse_args([*REQUIRED, "--log-num-zeros-in-grad"]).log_num_zeros_in_grad is True


@pytest.mark.parametrize("flag", [True, False])
def test_the_optimizer_counts_zeros_only_with_the_flag(flag, one_rank, monkeypatch):
    """megatron-core's optimizer counts the main grads' zeros in step() when its config says so."""
    import megatron.core.optimizer as optimizer_module
    import megatron.core.optimizer_param_scheduler as scheduler_module

    seen = []
    monkeypatch.setattr(optimizer_module, "get_megatron_optimizer", lambda config, models: seen.append(config))
    monkeypatch.setattr(scheduler_module, "OptimizerParamScheduler", lambda *a, **k: None)
    training.build_optimizer(parse_args([*REQUIRED, "--log-num-zeros-in-grad"] if flag else REQUIRED), ddp_model=None)
    assert seen[0].log_num_zeros_in_grad is flag


def test_tensorboard_gets_every_metric_at_its_iteration():
    written = []
    writer = types.SimpleNamespace(add_scalar=lambda name, value, step: written.append((name, value, step)),
                                   flush=lambda: written.append("flush"))
    training.write_tensorboard(writer, {"lm loss": 2.5, "learning-rate": 1e-3}, 7)
    assert written == [("lm loss", 2.5, 7), ("learning-rate", 1e-3, 7), "flush"]


def test_tensorboard_dir_needs_tensorboard(monkeypatch, tmp_path, refused):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(arguments, "_tensorboard_installed", lambda: False)
    assert refused([*REQUIRED, "--tensorboard-dir", str(tmp_path)]).startswith(
        "--tensorboard-dir needs the tensorboard package")
    monkeypatch.setattr(arguments, "_tensorboard_installed", lambda: True)
    assert parse_args([*REQUIRED, "--tensorboard-dir", str(tmp_path), "--timing-log-level", "1"]).timing_log_level == 1


@pytest.mark.parametrize("level", ["2", "x"])
def test_timing_level_choices(level, refused):
    assert "--timing-log-level" in refused([*REQUIRED, "--timing-log-level", level])


def flops_args(**overrides):
    values = dict(hidden_size=64, seq_length=16, num_layers=2, num_attention_heads=4, kv_channels=32,
                  group_query_attention=True, num_query_groups=2, swiglu=True, num_experts=8, moe_ffn_hidden_size=48,
                  ffn_hidden_size=256, moe_router_topk=2, moe_shared_expert_intermediate_size=None, vocab_size=100,
                  tensor_model_parallel_size=1)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("overrides, per_layer", [
    # Q 128 wide, K and V 64 each (2 groups of 32): 64*(128+128) + 128*64 + 128*16 = 26624 in attention;
    # 8 of 8 experts' SwiGLU, top-2 of 48: 64*3*96 = 18432
    ({}, 26624 + 18432),
    # a shared expert of 32 adds 64*3*32 = 6144
    ({"moe_shared_expert_intermediate_size": 32}, 26624 + 18432 + 6144),
    # multi-head: K and V 128 each: 64*(128+256) + 8192 + 2048 = 34816; dense GELU MLP 2*64*256 = 32768
    ({"group_query_attention": False, "num_experts": None, "swiglu": False}, 34816 + 32768),
])
def test_flops_per_token_as_megatron_lm_counts_them(overrides, per_layer):
    """Megatron-LM's num_floating_point_operations divided by the tokens, worked by hand: the
    query is kv_channels x heads wide (not the hidden size), causal attention counts half the
    scores, the router is not counted; the vocabulary (100) pads to 128: 64*128 = 8192."""
    assert training.model_flops_per_token(flops_args(**overrides)) == 6 * (2 * per_layer + 8192)


MEGATRON_LM_TRAINING = Path(os.environ.get("MEGATRON_LM_PATH") or ".") / "megatron" / "training" / "training.py"


def megatron_lms_count():
    """Megatron-LM's own num_floating_point_operations, read from its training.py and run alone
    (importing that module needs its GPU stack); the linear-attention variants are off here."""
    tree = ast.parse(MEGATRON_LM_TRAINING.read_text())
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "num_floating_point_operations")
    scope = {"is_linear_attention_variant": lambda variant: False}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(MEGATRON_LM_TRAINING), "exec"), scope)
    return scope["num_floating_point_operations"]


@pytest.mark.skipif(not MEGATRON_LM_TRAINING.is_file(),
                    reason="needs MEGATRON_LM_PATH naming a Megatron-LM core_v0.16.1 checkout")
@pytest.mark.parametrize("flags", [
    # the Qwen3-30B-A3B-shaped slice of benchmarks/moe_model.py
    ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "32", "--group-query-attention",
     "--num-query-groups", "4", "--kv-channels", "128", "--seq-length", "4096", "--max-position-embeddings", "4096",
     "--swiglu", "--num-experts", "128", "--moe-ffn-hidden-size", "768", "--moe-router-topk", "8"],
    # shared experts, multi-head attention, no --kv-channels
    ["--num-experts", "8", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "1024", "--swiglu"],
    # a dense GPT with GELU, a vocabulary that pads (32001 to 32128)
    ["--vocab-size", "32001"],
])
def test_flops_per_token_equal_megatron_lms_count(flags):
    args = parse_args(REQUIRED + flags)
    megatron_lm_args = argparse.Namespace(**vars(args))
    vars(megatron_lm_args).update(
        is_hybrid_model=False, moe_layer_freq=1, mtp_num_layers=None, multi_latent_attention=False,
        attention_output_gate=False, experimental_attention_variant=None,
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        padded_vocab_size=-(-args.vocab_size // 128) * 128)  # Megatron-LM's padding to 128 x TP (1 here)
    batch = 3
    expected = megatron_lms_count()(megatron_lm_args, batch) / (batch * args.seq_length)
    assert training.model_flops_per_token(args) == pytest.approx(expected, rel=1e-12)
