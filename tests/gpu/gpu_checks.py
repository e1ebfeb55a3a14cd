"""What the GPU tests and their torchrun workers share: the error measure, and the
two-GPU plumbing (launch a worker, start its process group, gather its results)."""

import json
import os
import subprocess
from pathlib import Path

import torch


def max_rel_error(reference, candidate):
    """Per tensor name: max |difference| relative to the reference tensor's largest magnitude."""
    worst = {}
    for name in reference:
        a, b = reference[name].float(), candidate[name].float()
        worst[name] = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
    return worst


E4M3_ROUNDOFF = 2.0**-4  # u of E4M3
TE_GRAD_ROUNDOFF = {"e4m3": 2.0**-4, "hybrid": 2.0**-3}  # TE's gradient format: E4M3 / E5M2


def check_fp8_experts_against_stock(kwargs, tokens, case):
    """Stock TE FP8 experts, the patched FP8 experts and the bf16 grouped_mm ones, each built
    from ``kwargs`` (seeded: identical weights and inputs), one forward and backward each.
    The patched output must be within E4M3's u of stock's largest magnitude, each gradient
    within u plus TE's gradient roundoff, and the patched error against bf16 no larger than
    stock's (1.25x, plus a bf16 ulp). Returns the patched layer."""
    import megatron.core.transformer.transformer_config as tc_module
    from megatron.moe_patches import apply, revert

    bf16_kwargs = {**kwargs, "fp8": None, "fp8_recipe": "delayed"}
    revert()
    _, stock = run_layer(tc_module.TransformerConfig(**kwargs), tokens)
    try:
        apply()
        layer, ours = run_layer(tc_module.TransformerConfig(**kwargs, moe_device_tokens_per_expert=True), tokens)
        reference_layer, reference = run_layer(
            tc_module.TransformerConfig(**bf16_kwargs, moe_device_tokens_per_expert=True), tokens)
    finally:
        revert()
    assert layer.experts.backend.name == "fp8_grouped_mm"
    assert reference_layer.experts.backend.name == "grouped_mm"
    vs_stock = max_rel_error(stock, ours)
    ours_vs_bf16, stock_vs_bf16 = max_rel_error(reference, ours), max_rel_error(reference, stock)
    print(json.dumps({"case": case, "max_rel_vs_stock": {k: round(v, 5) for k, v in vs_stock.items()},
                      "ours_vs_bf16": max(ours_vs_bf16.values()), "stock_vs_bf16": max(stock_vs_bf16.values())}))
    assert stock["output"].abs().sum() > 0
    for name, error in vs_stock.items():
        allowed = E4M3_ROUNDOFF if name == "output" else E4M3_ROUNDOFF + TE_GRAD_ROUNDOFF[kwargs["fp8"]]
        assert error <= allowed, (name, error, allowed)
        assert ours_vs_bf16[name] <= 1.25 * stock_vs_bf16[name] + 2.0**-8, (name, ours_vs_bf16[name], stock_vs_bf16[name])
    return layer


def small_moe_kwargs(experts, topk, activation="swiglu", precision="bf16", **overrides) -> dict:
    """TransformerConfig kwargs of the GPU tests' small MoE layer (hidden 256, FFN 192):
    SwiGLU or quick-GEGLU with megatron-core's fused prob-weighted activation."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.moe_patches.testing.layer_harness import MoEShape, moe_config_kwargs

    shape = MoEShape(hidden=256, moe_ffn=192, experts=experts, topk=topk)
    extra = dict(bias_activation_fusion=True)
    if activation == "quick_geglu":
        extra.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    return moe_config_kwargs(shape, precision, **extra, **overrides)


def compare(stock, patched, names=None):
    """Summary of stock vs patched tensors (all, or ``names``): count, bitwise flag, max abs
    error, max error relative to the tensor's largest magnitude, and which tensors differ."""
    names = list(names if names is not None else stock)
    differ, max_abs, max_rel = [], 0.0, 0.0
    for name in names:
        a, b = stock[name].float(), patched[name].float()
        diff = (a - b).abs().max().item()
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(a.abs().max().item(), 1e-30))
        if not torch.equal(stock[name], patched[name]):
            differ.append(name)
    return dict(tensors=len(names), bitwise=not differ, max_abs=max_abs, max_rel=max_rel, differ=differ[:8])


def run_layer(config, tokens, seed=5, routing_fn=None):
    """Build the MoE layer of ``config`` (seeded; ``routing_fn`` replaces the router's
    forward), run one forward and backward on seeded input and output grad; return
    (layer, {"output", "input_grad", "grad:<param>": ...})."""
    from megatron.moe_patches.testing.layer_harness import build_moe_layer, forward_backward

    layer = build_moe_layer(config)
    if routing_fn is not None:
        layer.router.forward = routing_fn
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    output, input_grad = forward_backward(layer, hidden, grad)
    tensors = {"output": output, "input_grad": input_grad}
    tensors.update({f"grad:{n}": p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None})
    return layer, tensors


def host_syncs_during(fn) -> list:
    """Run ``fn()`` with torch's sync debug mode on; return where it synchronized with the host."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch also emits a notice that the debug mode "is a prototype": not a sync
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
             if "synchronizing" in str(w.message) and "prototype" not in str(w.message)]
    print(json.dumps({"host_syncs": len(syncs), "where": syncs[:10]}))
    return syncs


def run_two_gpu_worker(worker: str, tmp_path, gpus: int = 2) -> list:
    """Run ``tests/gpu/<worker>`` on ``gpus`` GPUs (2 unless told); return the results every
    rank gathered."""
    out = Path(tmp_path) / f"{Path(worker).stem}.json"
    cmd = ["torchrun", "--nproc-per-node", str(gpus), str(Path(__file__).resolve().parent / worker), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = json.loads(out.read_text())
    print(json.dumps(results))
    return results


def start_worker(expert_model_parallel_size: int = 1) -> int:
    """In a torchrun worker: process group, megatron-core parallel state, seeds; the rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=expert_model_parallel_size)
    model_parallel_cuda_manual_seed(1234)
    return dist.get_rank()


def finish_worker(results: list, out_path) -> None:
    """Gather every rank's results into ``out_path`` (written by rank 0) and shut down."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))
    dist.barrier()
    dist.destroy_process_group()
