"""``pretrain_gpt.py ... --print-plan``: the plan of the config the run builds, on this
machine (CPU here: no Hopper GPU, no TE), each decision with its reason, and no training; a
bad flag is refused as without it."""

import pytest

from megatron.moe_patches.driver.training import main

RUN = ["--yaml-cfg", "qwen3-30b-a3b-proxy", "--train-iters", "20"]


def plan_lines(capsys, *flags):
    assert main([*flags, "--print-plan"], prog="pretrain_gpt.py") == 0  # a CPU machine: no GPU asked for
    return capsys.readouterr().out.splitlines()


def test_the_proxy_recipes_plan(capsys, reverted):
    lines = plan_lines(capsys, *RUN, "--cuda-graph-impl", "local", "--cuda-graph-scope", "moe")
    assert lines[0].startswith("expert backend: ")
    assert "exchange: alltoall; token counts on the device; rows arrive grouped by local expert" in lines
    assert "CUDA graph of the MoE layer: can be captured" in lines
    assert "parallel sizes: EP 1, expert TP 1" in lines


def test_what_blocks_a_graph_and_the_preferred_backends_is_named(capsys, reverted):
    lines = plan_lines(capsys, "--yaml-cfg", "tiny-moe-stock", "--train-iters", "20")  # counts to the host
    assert lines[0] == "expert backend: te"
    assert "  not grouped_mm: moe_device_tokens_per_expert is off" in lines
    assert "exchange: alltoall; token counts on the host" in lines
    assert ("CUDA graph of the MoE layer: no: the MoE layer copies token counts to the host: set "
            "--moe-device-tokens-per-expert") in lines


def test_a_model_without_experts_has_nothing_to_plan(capsys, reverted):
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1",
             "--train-iters", "4", "--lr", "1e-3", "--mock-data"]
    assert plan_lines(capsys, *flags) == ["no MoE layer (--num-experts is not set): nothing to plan"]


def test_a_bad_flag_is_refused_as_pretrain_gpt_refuses_it(capsys, reverted):
    with pytest.raises(SystemExit) as exited:
        main([*RUN, "--moe-router-topk", "0", "--print-plan"], prog="pretrain_gpt.py")
    assert exited.value.code == 2
    assert "pretrain_gpt.py: error: --moe-router-topk" in capsys.readouterr().err


def test_readmes_first_command_runs_the_fast_path(capsys, reverted):
    """tiny-moe (README's quick start): the grouped backend on device token counts, whole layers
    as CUDA graphs, weight gradients into main_grad; tiny-moe-stock is the stock path."""
    lines = plan_lines(capsys, "--yaml-cfg", "tiny-moe")
    assert lines[0] == "expert backend: grouped_mm"
    assert "exchange: alltoall; token counts on the device; rows arrive grouped by local expert" in lines
    assert "CUDA graph of the transformer layer: can be captured" in lines
    assert "single grouped parameters: can be held" in lines
    assert "weight gradients into main_grad in the GEMM: yes" in lines
    assert plan_lines(capsys, "--yaml-cfg", "tiny-moe-stock")[0] == "expert backend: te"


def test_training_prints_the_plan_first(capsys, reverted, monkeypatch):
    from megatron.moe_patches.driver import training

    monkeypatch.setattr(training, "require_gpu", lambda prog: None)
    monkeypatch.setattr(training, "pretrain", lambda args, verdict: print("training"))
    assert main(["--yaml-cfg", "tiny-moe"], prog="pretrain_gpt.py") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "moe_patches plan: expert backend: grouped_mm" and out[-1] == "training"
