"""The pretraining loop behind pretrain_gpt.py, on megatron-core's public APIs.

GPTModel from the TE layer spec (MoE layers when --num-experts is set) with the patch
set applied, Megatron DDP, megatron-core's optimizer (distributed optimizer optional)
and LR schedule, ``get_forward_backward_func`` (so TP/PP/EP/DP all come from
megatron-core), mock or indexed GPT data, Megatron-style log lines and torch_dist
checkpoints. ``main(argv)`` is pretrain_gpt.py's entry point (also
``python -m megatron.moe_patches.driver.training``). Launch with ``torchrun``; a plain
``python`` run is one rank.
"""

import argparse
import logging
import math
import os
import sys
import time
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron.moe_patches.driver import checkpointing, compat, iteration_log
from megatron.moe_patches.driver.arguments import (
    RUN_LENGTHS,
    batch_calculator,
    check_args,
    counted_in,
    params_dtype,
    parse_and_judge,
    plan_lines,
    same_named,
    transformer_config_kwargs,
)
from megatron.moe_patches.driver.data_files import data_blend
from megatron.moe_patches.driver.parser import PROG
from megatron.moe_patches.preflight import Verdict

logger = logging.getLogger(__name__)


def _print_rank0(*parts) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def no_gpu_message(prog: str = PROG) -> str:
    """The stop line on a machine without a GPU, after the flags and the recipe passed their checks."""
    return (f"{prog} needs a CUDA GPU (Transformer Engine and NCCL); none is visible here. The configuration "
            "passed its checks; add --print-plan to see what this run would do on a GPU.")


def require_gpu(prog: str = PROG) -> None:
    """The GPU check: the first thing after the arguments are parsed and validated."""
    if not torch.cuda.is_available():
        raise SystemExit(no_gpu_message(prog))


def initialize(args: argparse.Namespace) -> None:
    require_gpu()
    if args.deterministic_mode:  # before CUDA and TE pick their kernels
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    torch.manual_seed(args.seed)
    # CUDA graphs need an RNG tracker whose states a graph can capture (dropout inside a
    # captured layer), as Megatron-LM sets it up.
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=args.cuda_graph_impl != "none")


def padded_vocab_size(args) -> int:
    multiple = 128 * args.tensor_model_parallel_size
    return -(-args.vocab_size // multiple) * multiple


def build_model(args, config):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.module import Float16Module

    spec_fn = (
        get_gpt_layer_with_transformer_engine_spec
        if args.transformer_impl == "transformer_engine"
        else get_gpt_layer_local_spec
    )
    spec = spec_fn(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
    ).cuda()
    module = Float16Module(config, gpt) if args.bf16 else gpt
    ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(args))
    return gpt, DistributedDataParallel(config, ddp_config, module)


def ddp_config_kwargs(args) -> dict:
    """DistributedDataParallelConfig's kwargs from the parsed args."""
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # TE then hands DDP the weights' grad hooks to run after the delayed wgrad GEMMs
        delay_wgrad_compute=args.delay_wgrad_compute,
        # Megatron-LM's --no-check-for-nan-in-loss-and-grad switches the gradients' check off
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
    )


# OptimizerConfig fields that take the flag of the same dest as it is.
SAME_NAMED_OPTIMIZER_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                               "bf16", "use_distributed_optimizer", "log_num_zeros_in_grad")


def build_optimizer(args, ddp_model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", params_dtype=params_dtype(args),
                        **same_named(args, SAME_NAMED_OPTIMIZER_FIELDS)),
        [ddp_model],
    )
    steps = lr_schedule_steps(args)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if steps["lr_warmup_steps"] else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        **steps,
    )
    return optimizer, scheduler


def lr_schedule_steps(args) -> dict:
    """The scheduler's warmup, decay and weight-decay lengths. Its steps are samples (each
    iteration steps it by that iteration's global batch), so Megatron-LM gives it iteration
    settings times --global-batch-size and sample settings as they are."""
    unit = counted_in(args)
    run = RUN_LENGTHS[unit]
    per_unit = 1 if unit == "samples" else args.global_batch_size
    return dict(lr_warmup_steps=getattr(args, run.warmup) * per_unit,
                lr_decay_steps=getattr(args, run.decay) * per_unit,
                wd_incr_steps=getattr(args, run.length) * per_unit)


def evaluates(args) -> bool:
    """Megatron-LM evaluates with --eval-interval and --eval-iters above 0 (and a validation split)."""
    return bool(args.eval_interval and args.eval_iters)


def split_samples(args) -> list:
    """Samples to build of the train, validation and test splits, as Megatron-LM counts them:
    the run's; --eval-iters global batches per evaluation (every --eval-interval iterations
    and one at the end); --eval-iters global batches for the test at the end. None: not read."""
    train = args.train_samples or args.train_iters * args.global_batch_size
    if not evaluates(args):
        return [train, None, None]
    per_evaluation = args.eval_iters * args.global_batch_size
    return [train, (args.train_iters // args.eval_interval + 1) * per_evaluation, per_evaluation]


def build_datasets(args):
    """megatron-core's train, validation and test datasets (None for a split --split leaves empty)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    mock = not args.data_path
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if mock else data_blend(args.data_path),  # as validated
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=compat.null_tokenizer(args.vocab_size),  # ids < vocab_size; the last is EOD
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(MockGPTDataset if mock else GPTDataset, split_samples(args),
                                            lambda: True, config)
    return builder.build()


def micro_batches(dataset, first_sample, args, dp_rank):
    """Micro-batches in a fixed order: global batch g holds samples [g*GBS, (g+1)*GBS);
    within it, DP rank r reads its own micro-batch slots. Resuming at a sample index
    continues the same sequence."""
    step = args.micro_batch_size * args.data_parallel_size
    index = first_sample
    while True:
        start = index + dp_rank * args.micro_batch_size
        items = [dataset[i] for i in range(start, start + args.micro_batch_size)]
        yield {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
        index += step


def forward_step(data_iterator, model, return_schedule_plan=False, check_loss=False):
    batch = next(data_iterator)
    tokens = batch["tokens"].cuda(non_blocking=True)
    labels = batch["labels"].cuda(non_blocking=True)
    position_ids = batch["position_ids"].cuda(non_blocking=True)
    loss_mask = batch["loss_mask"].cuda(non_blocking=True).float()
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm: megatron-core's combined 1F1B runs the plan
        return model.build_schedule_plan(tokens, position_ids, None, labels=labels), partial(_loss, loss_mask, check_loss)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss, loss_mask, check_loss)


def _loss(loss_mask, check, per_token_loss):
    from megatron.core import parallel_state

    loss = torch.sum(per_token_loss.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    if check:  # Megatron-LM's check_for_nan_in_loss_and_grad: each rank's loss before the all-reduce
        check_loss_finite(loss)
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return loss, {"lm loss": reported / parallel_state.get_data_parallel_world_size()}


def check_loss_finite(loss) -> None:
    """Stop the run on a NaN or Inf loss, in Megatron-LM's words (its rerun machine, disabled)."""
    for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        if rejected(loss):
            raise RuntimeError(f"found {what} in local forward loss calculation")


def model_flops_per_token(args) -> float:
    """Forward and backward FLOPs per token as Megatron-LM's TFLOP/s counts them: each GEMM three
    times (forward, data and weight gradients); the projections sized by --kv-channels, causal
    attention as half of the scores; routed experts x top-k plus shared experts; the router and
    the norms left out."""
    h, s = args.hidden_size, args.seq_length
    head = args.kv_channels or h // args.num_attention_heads
    q = head * args.num_attention_heads
    kv = head * (args.num_query_groups if args.group_query_attention else args.num_attention_heads)
    # one token's multiply-adds in a layer: Q, K and V, the output projection, Q.K and P.V (causal half)
    attention = h * (q + 2 * kv) + q * h + q * s
    glu = 3 if args.swiglu else 2
    if args.num_experts:
        ffn = (args.moe_ffn_hidden_size or args.ffn_hidden_size) * args.moe_router_topk
        ffn += args.moe_shared_expert_intermediate_size or 0
    else:
        ffn = args.ffn_hidden_size
    return 2 * 3.0 * (args.num_layers * (attention + h * ffn * glu) + h * padded_vocab_size(args))


def iteration_metrics(args, iteration, times, lr, loss, grad_norm, world, mem_allocated, mem_max_allocated,
                      num_zeros=None, batch_size=None, consumed_samples=None, params_norm=None,
                      loss_scale=1.0, aux_losses=None, counts=None):
    """One logged iteration's numbers, under the names Megatron-LM gives them in TensorBoard.

    ``times``: seconds of the whole iteration (``"iteration"``) and, with --timing-log-level,
    of its phases (``"forward-backward"``, ``"optimizer"``). ``num_zeros``: the zero entries
    of the main grads (--log-num-zeros-in-grad), None when not counted. ``batch_size``: this
    iteration's global batch (--rampup-batch-size grows it; default --global-batch-size);
    ``consumed_samples``: the samples trained on so far (default: iterations x the batch).
    ``params_norm``: the parameters' L2 norm (--log-params-norm), None when not computed.
    ``loss_scale``: the optimizer's (1.0 in bf16 and fp32); ``aux_losses``: the MoE auxiliary
    losses by megatron-core's names, whole-model and per layer (``moe/<name>_layer_<i>``);
    ``counts``: the interval's skipped and nan iterations.
    The throughput (TFLOP/s per GPU, tokens/s) is left out where a recipe says
    ``log_throughput: false``, as Megatron-LM leaves it out without --log-throughput."""
    batch_size = batch_size or args.global_batch_size
    tokens = batch_size * args.seq_length
    elapsed = times["iteration"]
    metrics = {"lm loss": loss, **(aux_losses or {}), "loss-scale": loss_scale}
    metrics.update({
        "learning-rate": lr,
        "grad-norm": grad_norm,
        "iteration-time": elapsed,
        "consumed-samples": iteration * batch_size if consumed_samples is None else consumed_samples,
        "batch-size": batch_size,
        "mem-allocated-bytes": mem_allocated,
        "mem-max-allocated-bytes": mem_max_allocated,
    })
    if getattr(args, "log_throughput", True):  # True: parse_args's default here
        metrics["throughput"] = model_flops_per_token(args) * tokens / elapsed / world / 1e12
        metrics["tokens-per-sec"] = tokens / elapsed
    if num_zeros is not None:
        metrics["num-zeros"] = num_zeros
    if params_norm is not None:
        metrics["params-norm"] = params_norm
    metrics.update({f"{phase}-time": seconds for phase, seconds in times.items() if phase != "iteration"})
    metrics.update(counts or {})
    return metrics


def _number(value):
    """A logged optimizer scalar as a Python number. megatron-core 0.16.1 returns floats;
    0.19.2's optimizer step returns the grad norm as a one-element GPU tensor (its norm
    skips the host sync), and a learning rate may be a tensor there too."""
    return value.item() if torch.is_tensor(value) else value


def _log_line(args, iteration, metrics, started):
    """The iteration line (``iteration_log``: Megatron-LM's fields, then this driver's);
    driver.functional reads lm loss, num zeros, the iteration time and the memory back from it,
    so keep their labels and units in step with its parser."""
    return iteration_log.log_line(args, iteration, metrics, started, time.time())


def track_moe_losses(args, num_micro_batches: int) -> dict:
    """This iteration's MoE auxiliary losses, as Megatron-LM's loop collects them: megatron-core's
    ``track_moe_metrics`` reduces the routers' saved losses over the ranks (every rank calls it,
    every iteration), scales them per micro-batch, averages them over the MoE layers and clears
    them. With --moe-per-layer-logging it also gives each layer's value to its writer."""
    names = iteration_log.aux_loss_names(args)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    totals, recorder = {}, iteration_log.PerLayerRecorder()
    track_moe_metrics(loss_scale=1 / num_micro_batches, iteration=0, total_loss_dict=totals,
                      writer=recorder if args.moe_per_layer_logging else None,
                      per_layer_logging=args.moe_per_layer_logging, force_initialize=True, track_names=names,
                      num_layers=args.num_layers, moe_layer_freq=None, mtp_num_layers=None)
    return {**totals, **recorder.values}


def validation_lines(where: str, loss: float) -> list:
    """Megatron-LM's validation result: the loss and its perplexity (exp, capped at e**20) between
    two rules. ``where``: "iteration K", or "iteration K on validation set" / "on test set"."""
    text = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]


def evaluate(forward_backward, model, data, args) -> Optional[float]:
    """--eval-iters forward-only steps of one --global-batch-size each (the full batch, also during a
    ramp-up, as in Megatron-LM) with dropout off and no gradients: the mean lm loss of their
    micro-batches on the last pipeline stage, None on the others."""
    num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    model.eval()
    losses = []
    try:
        with torch.no_grad():
            for _ in range(args.eval_iters):
                losses += forward_backward(
                    forward_step_func=forward_step, data_iterator=data, model=[model],
                    num_microbatches=num_micro_batches, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=True,
                )
    finally:
        model.train()
    if not losses:
        return None
    return torch.stack([m["lm loss"].float() for m in losses]).mean().item()


def params_l2_norm(params, bf16: bool, tp_rank: int = 0, groups=None) -> float:
    """The L2 norm of the model's parameters as Megatron-LM's --log-params-norm computes it: each
    parameter once over the model-parallel ranks (a copy every TP rank holds counted on TP rank 0;
    the output layer's copy of a tied embedding, marked ``shared``, not at all), the fp32 main
    params where the bf16 optimizer keeps them. ``groups``: (data-parallel, model-parallel,
    expert model-parallel) process groups to reduce over, None on one rank: the distributed
    optimizer's main-param shards sum over data parallelism, dense params over TP x PP, expert
    params over expert TP x EP x PP."""
    parts = {"dense": [], "expert": [], "sharded": []}
    for param in params:
        if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        if getattr(param, "shared", False):
            continue
        kind = "dense" if getattr(param, "allreduce", True) else "expert"
        if not bf16:
            parts[kind].append(param.data)
        elif hasattr(param, "main_param"):
            if getattr(param, "main_param_sharded", False):
                if param.main_param is not None:  # ranks whose shard holds none of it have None
                    parts["sharded"].append(param.main_param)
            else:
                parts[kind].append(param.main_param)
        else:
            parts[kind].append(param.data.float())
    device = next((t.device for ts in parts.values() for t in ts), None)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    squares = {kind: torch.zeros((), dtype=torch.float32, device=device) for kind in parts}
    for kind, tensors in parts.items():
        if tensors:
            squares[kind] = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]).square().sum()
    if groups is not None:
        data_parallel, model_parallel, expert_model_parallel = groups
        dist.all_reduce(squares["sharded"], group=data_parallel)
        squares["dense"] += squares["sharded"]
        dist.all_reduce(squares["dense"], group=model_parallel)
        dist.all_reduce(squares["expert"], group=expert_model_parallel)
    else:
        squares["dense"] += squares["sharded"]
    return math.sqrt((squares["dense"] + squares["expert"]).item())


def _params_norm(gpt, args) -> float:
    from megatron.core import parallel_state

    groups = (parallel_state.get_data_parallel_group(), parallel_state.get_model_parallel_group(),
              parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return params_l2_norm(gpt.parameters(), args.bf16, parallel_state.get_tensor_model_parallel_rank(), groups)


def write_tensorboard(writer, metrics, iteration) -> None:
    """Every metric as a scalar at ``iteration`` (Megatron-LM's names: "lm loss", ...); the
    interval's skipped and nan counts are the line's only."""
    for name, value in iteration_log.tensorboard_metrics(metrics).items():
        writer.add_scalar(name, value, iteration)
    writer.flush()


def setup(args: argparse.Namespace, verdict: Optional[Verdict] = None):
    """Process groups, the patch set, model and optimizer for ``args`` (from ``parse_args``,
    which validated them and took ``--use-checkpoint-args`` before start-up):
    (unwrapped GPTModel, DDP model, optimizer, LR scheduler). ``verdict``: the preflight's on
    these args (``parse_and_judge``), whose config is used where it was judged in full."""
    initialize(args)
    world = dist.get_world_size()
    if world != args.data_parallel_size * args.tensor_model_parallel_size * args.pipeline_model_parallel_size:
        check_args(args, world_size=world)  # launched with another world than WORLD_SIZE said: judged again

    import megatron.core.transformer.transformer_config as tc_module
    from megatron.core.distributed import finalize_model_grads

    from megatron.moe_patches import apply

    for row in apply():
        _print_rank0(f"moe_patches: {row.line()}")
    if not compat.patch_set_installs():
        from megatron.moe_patches.capabilities import mcore_version

        _print_rank0(f"moe_patches: nothing installed; training on megatron-core {mcore_version()}'s own classes")
    config = judged_config(verdict, tc_module.TransformerConfig)
    if config is None:
        config = tc_module.TransformerConfig(**transformer_config_kwargs(args))
    if args.gradient_accumulation_fusion and not config.gradient_accumulation_fusion:  # compat.fit_config_kwargs
        _print_rank0("moe_patches: gradient accumulation fusion off: without the patch set megatron-core "
                     "runs it with APEX's fused_weight_gradient_mlp_cuda, which is not installed "
                     "(DDP adds the weight gradients instead)")
    gpt, model = build_model(args, config)
    optimizer, scheduler = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    params = sum(p.numel() for p in gpt.parameters())
    _print_rank0(f"model: {params / 1e6:.1f} M parameters on this rank | world size {dist.get_world_size()}")
    moe = describe_moe_layers(gpt)
    if moe:
        _print_rank0(f"moe_patches: {moe}")
    return gpt, model, optimizer, scheduler


def judged_config(verdict: Optional[Verdict], config_class):
    """The preflight's config where it is the one to train with: of ``config_class`` (what
    ``apply()`` bound) and judged in full before start-up (no check left to this machine,
    ``Verdict.deferred``); its build's warnings are said now. Else None: build it here."""
    if verdict is None or type(verdict.config) is not config_class or verdict.deferred:
        return None
    verdict.say_config_warnings()
    return verdict.config


def describe_moe_layers(gpt) -> str:
    """One line: what the MoE layers run (expert backend, expert-parallel exchange), or ''."""
    from megatron.moe_patches.dispatch.exchanges import SymmetricMemoryAllToAll
    from megatron.moe_patches.graphs.layer_graphs import moe_layers

    layers = moe_layers(gpt)
    if not layers:
        return ""
    layer = layers[0]
    backend = getattr(getattr(layer.experts, "backend", None), "name", type(layer.experts).__name__)
    dispatcher = layer.token_dispatcher
    ep_size = getattr(dispatcher, "ep_size", 1)
    if isinstance(getattr(dispatcher, "exchange", None), SymmetricMemoryAllToAll):
        exchange = "symmetric memory (F12, no host sync)"
    else:
        exchange = f"{type(dispatcher).__name__}'s own" if ep_size > 1 else "none (EP 1)"
    return f"{len(layers)} MoE layers | experts: {backend} | EP {ep_size} exchange: {exchange}"


def whole_iteration_graph(forward_backward, args):
    """--cuda-graph-scope full_iteration: megatron-core's capture of every micro-batch's forward
    and backward as one graph (after --cuda-graph-warmup-steps steps), as Megatron-LM's loop
    wraps its training steps; evaluation runs eagerly."""
    from megatron.moe_patches.graph_scopes import GraphScope, graph_scope

    if graph_scope(args) is not GraphScope.FULL_ITERATION:
        return forward_backward
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)


def say_once_captured(forward_backward, steps_run: int) -> None:
    """One line once the whole iteration is a graph (megatron-core's wrapper captures it at the
    step after its warm-up steps)."""
    graphs = getattr(type(forward_backward), "cuda_graph", None)
    if graphs is not None and graphs.get("training") is not None and not getattr(forward_backward, "said", False):
        forward_backward.said = True
        _print_rank0(f"moe_patches: captured the whole training iteration as one CUDA graph at step {steps_run} "
                     "(--cuda-graph-scope full_iteration)")


def moe_graph_helper(model, gpt, optimizer, args):
    """--cuda-graph-impl transformer_engine: megatron-core's TE graph helper, built and called
    as Megatron-LM's training loop does (apply() installs the MoE capture behind it, F11).
    --cuda-graph-impl local needs nothing here: megatron-core's schedules call
    create_cudagraphs() after every forward-backward, and the capture happens there."""
    from megatron.core.transformer import cuda_graphs

    if args.cuda_graph_impl != "transformer_engine":
        return None
    return cuda_graphs.TECudaGraphHelper(model=[model], config=gpt.config, seq_length=args.seq_length,
                                         micro_batch_size=args.micro_batch_size, optimizers=[optimizer])


def warn_if_graphs_never_replay(captures, checked: set) -> None:
    """One warning for layer graphs (F11) that did not replay in the whole step after their capture."""
    for graphs in captures:
        if id(graphs) not in checked:
            checked.add(id(graphs))
            if not graphs.replays:
                logger.warning("moe_patches: the captured layer graphs did not replay in the step after "
                               "the capture (every call ran eagerly: another input shape or a padding mask)")


def save_checkpoint(args, iteration, gpt, optimizer, scheduler) -> None:
    """Save (crash-safe, ``checkpointing.save``) and say so, once the tracker names it."""
    path = checkpointing.save(args.save, iteration, gpt, optimizer, scheduler, args)
    _print_rank0(f"saved checkpoint {path} at iteration {iteration}")


def pretrain(args: argparse.Namespace, verdict: Optional[Verdict] = None) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.moe_patches.graphs.layer_graphs import active_captures

    gpt, model, optimizer, scheduler = setup(args, verdict)
    iteration = resume(args, gpt, optimizer, scheduler)
    train_set, valid_set, test_set = build_datasets(args)
    dp_rank = parallel_state.get_data_parallel_rank()
    data = micro_batches(train_set, args.consumed_train_samples, args, dp_rank)
    valid_data = micro_batches(valid_set, args.consumed_valid_samples, args, dp_rank) if valid_set is not None else None
    logs = (parallel_state.is_pipeline_last_stage() and dp_rank == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)
    calculator = batch_calculator(args, rank=dist.get_rank())  # megatron-core's, as Megatron-LM's loop uses it
    calculator.update(args.consumed_train_samples, consistency_check=True)
    num_micro_batches = calculator.get()
    forward_backward = get_forward_backward_func()
    train_forward_backward = whole_iteration_graph(forward_backward, args)
    started, last_saved, tensorboard = time.time(), None, None
    steps_run, graph_helper, graphs_checked = 0, moe_graph_helper(model, gpt, optimizer, args), set()
    interval = iteration_log.IntervalTotals()

    def validate(where: str, data_iterator) -> None:
        loss = evaluate(forward_backward, model, data_iterator, args)
        if logs:
            print("\n".join(validation_lines(where, loss)), flush=True)
            if tensorboard is not None:
                tensorboard.add_scalar("lm loss validation", loss, iteration)
                tensorboard.add_scalar("lm loss validation vs samples", loss, args.consumed_train_samples)
                tensorboard.flush()

    while iteration < args.train_iters:
        calculator.update(args.consumed_train_samples, consistency_check=True)
        if calculator.get() != num_micro_batches:  # a ramp-up step: Megatron-LM saves before it
            if args.save and last_saved != iteration:
                save_checkpoint(args, iteration, gpt, optimizer, scheduler)
                last_saved = iteration
            num_micro_batches = calculator.get()
        batch_size = calculator.get_current_global_batch_size()
        if graph_helper is not None and not graph_helper.graphs_created() and steps_run == args.cuda_graph_warmup_steps:
            graph_helper.create_cudagraphs()
        captured_before_step = active_captures()
        steps_run += 1
        torch.cuda.synchronize()
        tick = time.time()
        times = {}
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = train_forward_backward(
            forward_step_func=partial(forward_step, check_loss=args.check_for_nan_in_loss_and_grad),
            data_iterator=data,
            model=[model],
            num_microbatches=num_micro_batches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        if args.timing_log_level:  # a sync between the phases: only when asked for
            torch.cuda.synchronize()
            times["forward-backward"] = time.time() - tick
        # With --log-num-zeros-in-grad megatron-core counts the zeros of the main grads here,
        # after backward and clipping, before the update (Megatron-LM's num-zeros).
        warn_if_graphs_never_replay(captured_before_step, graphs_checked)
        say_once_captured(train_forward_backward, steps_run)
        update_successful, grad_norm, num_zeros = optimizer.step()
        if update_successful:  # as Megatron-LM: a skipped update leaves the schedule where it is
            scheduler.step(increment=batch_size)  # the scheduler counts samples
        iteration += 1
        args.consumed_train_samples += batch_size
        torch.cuda.synchronize()
        times["iteration"] = time.time() - tick
        if args.timing_log_level:
            times["optimizer"] = times["iteration"] - times["forward-backward"]
        interval.add(step_losses(losses, args, num_micro_batches), times, skipped=not update_successful)
        if iteration % args.log_interval == 0:
            # every rank takes part in its reductions; only logged iterations show it
            params_norm = _params_norm(gpt, args) if args.log_params_norm else None
            averaged = interval.averages()
            if logs:
                metrics = logged_metrics(args, iteration, averaged, optimizer, grad_norm, num_zeros, batch_size,
                                         params_norm)
                tensorboard = log_iteration(args, iteration, metrics, started, tensorboard)
        if valid_data is not None and evaluates_after(args, iteration):
            validate(f"iteration {iteration}", valid_data)
            args.consumed_valid_samples += args.eval_iters * args.global_batch_size
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, gpt, optimizer, scheduler)
            last_saved = iteration
    if args.save and last_saved != iteration:
        save_checkpoint(args, iteration, gpt, optimizer, scheduler)
    if valid_data is not None and evaluates(args):  # Megatron-LM's evaluation after training
        validate(f"iteration {iteration} on validation set", valid_data)
        if test_set is not None:
            validate(f"iteration {iteration} on test set", micro_batches(test_set, 0, args, dp_rank))
    finish(iteration, started, tensorboard)


def resume(args, gpt, optimizer, scheduler) -> int:
    """Load the checkpoint --load holds, where it holds one, and set the samples read so far;
    returns the iteration to go on from (0 from scratch)."""
    iteration, saved = 0, {}
    found = checkpointing.find_checkpoint(args.load)[0] if args.load else None
    if found is not None:
        iteration = checkpointing.load(args.load, gpt, optimizer, scheduler, args)
        saved = checkpointing.read_common_state(found)["args"]
        saved = vars(saved) if isinstance(saved, argparse.Namespace) else saved
        _print_rank0(f"loaded checkpoint {found} at iteration {iteration}")
    elif args.load and args.exit_on_missing_checkpoint:  # parse_args stops this earlier
        raise SystemExit(f"--load {args.load}: no checkpoint there, and --exit-on-missing-checkpoint is set")
    # The samples read so far, saved in the args as Megatron-LM saves them; a checkpoint without
    # them was trained at a fixed batch.
    args.consumed_train_samples = saved.get("consumed_train_samples") or iteration * args.global_batch_size
    args.consumed_valid_samples = saved.get("consumed_valid_samples") or first_validation_sample(args, iteration)
    return iteration


def step_losses(losses, args, num_micro_batches) -> dict:
    """One step's losses: the LM loss over its micro-batches, then the MoE losses (every rank,
    every iteration: they reduce across ranks)."""
    found = {"lm loss": torch.stack([m["lm loss"] for m in losses]).mean()} if losses else {}
    found.update(track_moe_losses(args, num_micro_batches))
    return found


def log_iteration(args, iteration, metrics, started, tensorboard):
    """Print a logged iteration's line and write its metrics to TensorBoard; returns the writer,
    made at the first write on the one rank that logs, as Megatron-LM does."""
    print(_log_line(args, iteration, metrics, started), flush=True)
    if args.tensorboard_dir:
        if tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
        write_tensorboard(tensorboard, metrics, iteration)
    return tensorboard


def finish(iteration: int, started: float, tensorboard) -> None:
    """Close the TensorBoard writer, say how the run went, and leave the process group."""
    if tensorboard is not None:
        tensorboard.close()
    _print_rank0(f"training done: {iteration} iterations in {time.time() - started:.1f} s")
    dist.barrier()
    dist.destroy_process_group()


def logged_metrics(args, iteration, averaged, optimizer, grad_norm, num_zeros, batch_size, params_norm) -> dict:
    """A logged iteration's metrics: ``averaged`` (``IntervalTotals.averages()``: the interval's
    losses and times, skipped and nan counts), the optimizer's numbers of this step, memory."""
    losses = dict(averaged["losses"])
    loss = losses.pop("lm loss", float("nan"))  # none when every update of the interval was skipped
    return iteration_metrics(
        args, iteration, averaged["times"], _number(optimizer.param_groups[0]["lr"]), loss,
        _number(grad_norm) or 0.0, dist.get_world_size(), torch.cuda.memory_allocated(),
        torch.cuda.max_memory_allocated(),
        _number(num_zeros) if args.log_num_zeros_in_grad else None,  # without it: 0 or None
        batch_size=batch_size, consumed_samples=args.consumed_train_samples, params_norm=params_norm,
        loss_scale=_number(optimizer.get_loss_scale()), aux_losses=losses, counts=averaged["counts"],
    )


def evaluates_after(args, iteration: int) -> bool:
    """Whether Megatron-LM's loop evaluates after training ``iteration``: every --eval-interval."""
    return evaluates(args) and iteration % args.eval_interval == 0


def first_validation_sample(args, iteration: int) -> int:
    """Where a run resumed at ``iteration`` continues reading the validation split: after the
    --eval-iters global batches of each evaluation so far (Megatron-LM's count)."""
    if not evaluates(args):
        return 0
    return iteration // args.eval_interval * args.eval_iters * args.global_batch_size


def main(argv=None, prog: str = PROG) -> int:
    """pretrain_gpt.py: parse and validate the flags (``--help`` needs no GPU), check for a
    GPU, then train. ``prog``: the command the user ran (its usage and error lines name it)."""
    args, verdict = parse_and_judge(argv, prog=prog)
    if args.print_plan:
        for line in plan_lines(verdict):
            print(line)
        return 0
    require_gpu(prog)
    if int(os.environ.get("RANK", "0")) == 0:  # the plan's decisions first, as --print-plan prints them
        for line in plan_lines(verdict):
            print(f"moe_patches plan: {line}", flush=True)
    pretrain(args, verdict)
    return 0


if __name__ == "__main__":  # dist_checkpointing re-imports __main__ in worker processes
    sys.exit(main(prog="python -m megatron.moe_patches.driver.training"))
