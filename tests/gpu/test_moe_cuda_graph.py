"""F11 on the GPU: the dropless MoE layer captured as CUDA graphs (forward + backward)
replays exactly what the eager layer computes, for new inputs too, and under FP8 after an
optimizer step (the weight copies refreshed outside the graphs, not in every replay).

Each case runs in its own process: a failed capture leaves the CUDA RNG in capture state,
which would poison every later case of the session."""

import json
import re
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CASES = {
    # name: (dispatcher, precision, experts, topk, tokens, extra config fields)
    "alltoall-bf16-top8": ("alltoall", "bf16", 64, 8, 512, {}),
    "alltoall-bf16-top2-grouped": ("alltoall", "bf16", 32, 2, 400, {"moe_single_grouped_weight": True}),
    "alltoall-bf16-top1-idle-experts": ("alltoall", "bf16", 128, 1, 200, {}),
    "allgather-bf16-top8": ("allgather", "bf16", 64, 8, 512, {}),
    "allgather-bf16-top1-idle-experts": ("allgather", "bf16", 128, 1, 200, {}),
    "alltoall-bf16-top2-aux-loss": ("alltoall", "bf16", 32, 2, 400,
                                    {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}),
    "alltoall-fp8-top8": ("alltoall", "fp8", 64, 8, 512, {}),
    "allgather-fp8-top2": ("allgather", "fp8", 32, 2, 400, {}),
    "alltoall-fp8-top1-idle-experts": ("alltoall", "fp8", 128, 1, 200, {}),
    "alltoall-fp8-blockwise-top8": ("alltoall", "fp8-blockwise", 64, 8, 512,
                                    {"moe_ffn_hidden_size": 256, "ffn_hidden_size": 256}),  # whole 128x128 tiles
}
QUICK = "alltoall-bf16-top8"
WEIGHT_QUANTIZATION = re.compile("quantize_both_layouts|weight_tiles")  # the recipes' weight kernels


def worker(case, out_path):
    """Eager step on input A; capture; replay A and a new input B (other routing) and
    compare each with the eager layer on the same input, bitwise."""
    import torch

    from megatron.moe_patches import apply
    from megatron.moe_patches.graphs.layer_graphs import LayerGraphs
    from megatron.moe_patches.testing.layer_harness import build_moe_layer, fp8_context, init_single_gpu

    sys.path.insert(0, str(HERE))
    from gpu_checks import compare, small_moe_kwargs

    init_single_gpu()
    apply()
    import megatron.core.transformer.transformer_config as tc

    dispatcher, precision, experts, topk, tokens, extra = CASES[case]
    config = tc.TransformerConfig(**small_moe_kwargs(
        experts, topk, precision=precision, moe_token_dispatcher_type=dispatcher,
        moe_device_tokens_per_expert=True, cuda_graph_impl="local", cuda_graph_scope="moe", **extra))
    layer = build_moe_layer(config)
    if extra.get("moe_router_load_balancing_type") == "aux_loss":
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device="cuda"))
    generator = torch.Generator(device="cuda").manual_seed(7)

    def inputs(scale):
        x = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
        return x * scale, torch.randn_like(x)

    def step(x, g):
        layer.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_(True)
        with fp8_context(config):
            out, _ = layer(x)
        out.backward(g)
        result = {"output": out.detach().clone(), "input_grad": x.grad.clone()}
        result.update({f"grad:{n}": p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
        return result

    a, b = inputs(1.0), inputs(3.0)  # B routes differently
    eager_a, eager_b = step(*a), step(*b)
    graphs = LayerGraphs([layer], a[0], context=lambda: fp8_context(config)).install()
    replay_a, replay_b, replay_a2 = step(*a), step(*b), step(*a)
    graphs.uninstall()
    eager_b2 = step(*b)  # the eager layer is unchanged by the capture
    after_step = {}
    if precision.startswith("fp8"):
        # An optimizer step between replays: the FP8 weight copies are requantized once,
        # before the next replay and outside the graphs; later replays requantize nothing.
        torch.optim.SGD(layer.parameters(), lr=0.5).step()  # with eager_b2's gradients
        graphs.install()
        replay_c = step(*a)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(*a)
            torch.cuda.synchronize()
        graphs.uninstall()
        eager_c = step(*a)
        after_step = {
            "replay_after_step": compare(eager_c, replay_c),
            "weights_changed": not torch.equal(eager_c["output"], eager_a["output"]),
            "weight_quantizations_in_replay": sum(
                e.count for e in prof.key_averages() if WEIGHT_QUANTIZATION.search(e.key)),
            "kernels_in_replay": sum(e.count for e in prof.key_averages()
                                     if str(getattr(e, "device_type", "")).endswith("CUDA")),
        }
    idle = int((torch.zeros(experts, device="cuda").index_add_(
        0, torch.topk(a[0].view(tokens, -1).float() @ layer.router.weight.float().t(), topk).indices.flatten(),
        torch.ones(tokens * topk, device="cuda")) == 0).sum().item())
    report = {
        "case": case,
        "backend": layer.experts.backend.name,
        "dispatcher": type(layer.token_dispatcher).__name__,
        "idle_experts_a": idle,
        "routing_differs": not torch.equal(eager_a["output"], eager_b["output"]),
        "replay_a": compare(eager_a, replay_a),
        "replay_b": compare(eager_b, replay_b),
        "replay_a_again": compare(eager_a, replay_a2),
        "eager_after_capture": compare(eager_b, eager_b2),
        "param_grads": sum(k.startswith("grad:") for k in eager_a),
        **after_step,
    }
    Path(out_path).write_text(json.dumps(report))


def run(case):
    """The case in a process of its own -> its report."""
    out = Path(tempfile.mkdtemp(prefix=f"graph-{case}-")) / "report.json"
    proc = subprocess.run([sys.executable, __file__, case, str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MASTER_PORT=str(29600 + list(CASES).index(case))))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


BACKGROUND = {"test_replay_is_bitwise_eager": ("case", run)}  # started when collection ends (tests/conftest.py)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == QUICK else c for c in CASES])
def test_replay_is_bitwise_eager(case, background):
    report = background
    print(json.dumps(report))
    assert report["backend"] == ("fp8_grouped_mm" if "fp8" in case else "grouped_mm")
    assert report["param_grads"] > 0 and report["routing_differs"]
    for key in ("replay_a", "replay_b", "replay_a_again", "eager_after_capture"):
        assert report[key]["bitwise"], (key, report[key])
    if "idle-experts" in case:
        assert report["idle_experts_a"] > 0
    if "fp8" in case:
        assert report["weights_changed"] and report["replay_after_step"]["bitwise"], report
        assert report["kernels_in_replay"] > 0 and report["weight_quantizations_in_replay"] == 0, report


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
