"""More of the step in CUDA graphs, in Megatron-LM's own loop (core_v0.16.1, its pretrain_gpt.py
as README edits it) and in this package's driver, on a tiny GPT-MoE with Megatron-LM's default
gradient-accumulation fusion (F13) and the sync-free MoE layer:

- each transformer layer whole (attention and MoE in one graph; no --cuda-graph-scope), with
  --cuda-graph-impl local and transformer_engine: every layer captured (the count the patch set
  prints), and the losses equal the eager run's at every iteration;
- --cuda-graph-scope full_iteration (megatron-core's capture of every micro-batch's forward and
  backward as one graph): captured, and the losses equal the eager run's;
- whole layers under --overlap-grad-reduce (DDP counts every gradient of a replayed layer).

Runs only where MEGATRON_LM_PATH names a Megatron-LM core_v0.16.1 checkout (the driver's runs
need it too: they are compared with the same eager losses). The runs start when collection ends
(``BACKGROUND``, tests/conftest.py), side by side, each at most once per session."""

import re

import pytest

from pretrain_runs import later_once
from test_megatron_lm_client import LAYERS, NO_FUSION, TINY, driver, megatron_lm, pytestmark  # noqa: F401

FAST = ["--moe-device-tokens-per-expert"]
NO_NAN_CHECK = ["--no-check-for-nan-in-loss-and-grad"]  # full_iteration needs it (Megatron-LM asserts it)
WARMUP = ["--cuda-graph-warmup-steps", "2"]
SCOPES = {
    "whole-layer-local": ["--cuda-graph-impl", "local", *WARMUP],
    "whole-layer-te": ["--cuda-graph-impl", "transformer_engine", *WARMUP],
    "attn-moe-local": ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "moe", *WARMUP],
    "full-iteration": ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", *WARMUP],
}
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def whole_layers_captured(output):
    return [int(n) for n in re.findall(r"moe_patches: captured (\d+) transformer layers", output)]


def driver_losses(*flags, iters=8):
    fused = [f for f in TINY if f != NO_FUSION]
    timeout = fused.index("--distributed-timeout-minutes")  # the driver keeps megatron-core's default
    output = driver(*fused[:timeout], *fused[timeout + 2:], "--train-iters", str(iters), *flags)
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(output)}, output


def run(loop, *flags):
    if loop == "megatron-lm":
        return megatron_lm(*flags, fusion=True)
    return driver_losses(*flags)


def shared(loop, *flags):
    """Future of ``run(loop, *flags)``, started once per session whichever test asks first (every
    scope compares with the same eager run)."""
    return later_once(run, loop, *flags)


EAGER = [*FAST, *NO_NAN_CHECK]
OVERLAP = ["--overlap-grad-reduce"]


def scope_runs(loop_scope):
    loop, scope = loop_scope
    return shared(loop, *EAGER), shared(loop, *EAGER, *SCOPES[scope])


def overlap_runs(loop):
    return shared(loop, *EAGER, *OVERLAP), shared(loop, *EAGER, *OVERLAP, *SCOPES["whole-layer-te"])


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("loop", ["megatron-lm", "driver"])
def test_more_of_the_step_in_graphs_equals_eager(loop, scope, background):
    (eager, _), (graphed, output) = (future.result() for future in background)
    check_graphed(scope, eager, graphed, output, loop)


@pytest.mark.parametrize("loop", ["megatron-lm", "driver"])
def test_whole_layers_with_overlapped_gradient_reduction_equal_eager(loop, background):
    """DDP's overlapped reduction counts every parameter's gradient (it asserts one arrives):
    the fused-wgrad linears inside a replayed layer hand it a placeholder, as in eager runs."""
    (eager, _), (graphed, output) = (future.result() for future in background)
    check_graphed("whole-layer-te", eager, graphed, output, loop)


FP8_WHOLE_LAYERS = {
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "blockwise-bf16-wgrad": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--no-fp8-wgrad"],
    "tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
}


def fp8_runs(precision_scope):
    precision, scope = precision_scope
    fp8 = FP8_WHOLE_LAYERS[precision]
    return (shared("megatron-lm", *EAGER), shared("megatron-lm", *EAGER, *fp8),
            shared("megatron-lm", *EAGER, *fp8, *SCOPES[scope]))


BACKGROUND = {  # each gives its test the Futures of its runs
    "test_more_of_the_step_in_graphs_equals_eager": (("loop", "scope"), scope_runs),
    "test_whole_layers_with_overlapped_gradient_reduction_equal_eager": ("loop", overlap_runs),
    "test_fp8_graphs_equal_eager_and_track_bf16": (("precision", "scope"), fp8_runs),
}


@pytest.mark.parametrize("scope", ["whole-layer-te", "full-iteration"])
@pytest.mark.parametrize("precision", list(FP8_WHOLE_LAYERS))
def test_fp8_graphs_equal_eager_and_track_bf16(precision, scope, background):
    """FP8 in whole-layer and full-iteration graphs, in Megatron-LM's loop with its default
    gradient-accumulation fusion: TE's attention linears and the FP8 experts quantize their
    weights inside the graph at each step's first micro-batch, the FP8 experts add their weight
    gradients into main_grad (F13, not DDP's hook). Graphed losses equal the eager run's at
    every iteration (stale FP8 weights would part them after the first optimizer step) and
    stay within 5 % of bf16's."""
    (bf16, _), (eager, eager_output), (graphed, output) = (future.result() for future in background)
    assert "run the TE backend" not in eager_output and "(not fused)" not in eager_output, eager_output[-3000:]
    check_graphed(scope, eager, graphed, output, "megatron-lm")
    for step in bf16:
        assert float(eager[step]) == pytest.approx(float(bf16[step]), rel=0.05)


def check_graphed(scope, eager, graphed, output, loop):
    print(f"{loop} {scope}: eager {eager}\ngraphed {graphed}\ncaptured {whole_layers_captured(output)}")
    if scope == "full-iteration":
        assert ("Capture CUDA graph for training" in output  # megatron-core's log line (Megatron-LM's loop)
                or "captured the whole training iteration as one CUDA graph" in output)
    else:
        assert whole_layers_captured(output) == [LAYERS]
    assert len(graphed) == 8 and graphed == eager  # the printed losses, every iteration
