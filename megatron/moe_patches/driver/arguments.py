"""pretrain_gpt.py's arguments: Megatron-LM flag spellings, recipes, checks, config mapping.

``parse_args`` = defaults < ``--yaml-cfg`` recipe < command line, then
``check_args`` rejects contradictions with a message naming the flags and the fix.
``transformer_config_kwargs`` maps the args to megatron-core's TransformerConfig
(patched by ``apply()``, so the MoE patch fields are accepted). The training loop and
``main`` are in ``driver.training``, which imports this module (never the reverse).
"""

import argparse
import os
import sys
from typing import List, Optional

import torch

from megatron.moe_patches.driver.patch_args import add_moe_patch_args, config_kwargs_from_args
from megatron.moe_patches.driver.recipes import RecipeError, apply_recipe, load_recipe


def _add_standard_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=512)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    model.add_argument("--num-attention-heads", type=int, default=8)
    model.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention")
    model.add_argument("--kv-channels", type=int, default=None)
    model.add_argument("--seq-length", type=int, default=512)
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    model.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of the null tokenizer")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    model.add_argument("--rotary-base", type=int, default=10000)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--qk-layernorm", action="store_true")
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine")

    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--num-experts", type=int, default=None)
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    moe.add_argument("--moe-router-topk", type=int, default=2)
    moe.add_argument("--moe-grouped-gemm", action="store_true")
    moe.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    moe.add_argument("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep"], default="deepep")
    moe.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], default="aux_loss")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    moe.add_argument("--moe-permute-fusion", action="store_true")
    moe.add_argument("--moe-router-pre-softmax", action="store_true")
    moe.add_argument("--moe-router-padding-for-quantization", action="store_true")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    parallel.add_argument("--sequence-parallel", action="store_true")

    precision = parser.add_argument_group("precision")
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None)
    precision.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise"], default="delayed")

    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=1)
    train.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    train.add_argument("--train-iters", type=int, default=100)
    train.add_argument("--lr", type=float, default=1e-4)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--use-distributed-optimizer", action="store_true")
    train.add_argument("--overlap-grad-reduce", action="store_true")
    train.add_argument("--deterministic-mode", action="store_true", help="deterministic kernels (exact resume)")

    data = parser.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true", help="synthetic data (the default without --data-path)")
    data.add_argument("--data-path", nargs="*", default=None, help="Megatron indexed dataset prefixes [weight prefix ...]")
    data.add_argument("--split", default="969,30,1")
    data.add_argument("--data-cache-path", default=None)

    log = parser.add_argument_group("logging and checkpoints")
    log.add_argument("--log-interval", type=int, default=1)
    log.add_argument("--save", default=None)
    log.add_argument("--load", default=None)
    log.add_argument("--save-interval", type=int, default=None)
    log.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                     help="save distributed-optimizer states per parameter (loads across DP/EP sizes "
                     "and expert layouts) instead of per-DP-rank buffers")
    log.add_argument("--use-checkpoint-args", action="store_true")
    log.add_argument("--yaml-cfg", default=None, help="recipe: flat 'flag: value' or Megatron's nested form")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT/MoE pretraining on megatron-core with the MoE patch set applied.",
        allow_abbrev=False,
    )
    _add_standard_args(parser)
    return add_moe_patch_args(parser)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.yaml_cfg:
        try:
            apply_recipe(parser, load_recipe(first.yaml_cfg), first.yaml_cfg)
        except (RecipeError, OSError) as err:
            parser.error(str(err))
    args = parser.parse_args(argv)  # unknown flags: argparse names them and exits
    try:
        check_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # torchrun sets it
    except ValueError as err:
        parser.error(str(err))
    return args


def check_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Fill derived defaults and reject contradictions (ValueError naming the flags)."""
    if args.fp8_format and not args.bf16:
        raise ValueError("--fp8-format needs --bf16 (FP8 GEMMs on bf16 parameters)")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path contradict each other: choose one")
    if args.use_checkpoint_args and not args.load:
        raise ValueError("--use-checkpoint-args needs --load")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save")
    if args.num_experts is None:
        moe_only = [f for f in ("moe_grouped_gemm", "moe_permute_fusion") if getattr(args, f)]
        if moe_only:
            raise ValueError(f"--{moe_only[0].replace('_', '-')} needs --num-experts")
    if args.pipeline_model_parallel_size > 1 and args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError("--num-layers must be divisible by --pipeline-model-parallel-size")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters "
            f"{args.lr_decay_iters} (which defaults to --train-iters): shorten the warmup or "
            "set --lr-decay-iters"
        )
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of TP x PP = {model_parallel}")
    data_parallel = world_size // model_parallel
    args.data_parallel_size = data_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel
    if args.global_batch_size % (args.micro_batch_size * data_parallel):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of "
            f"--micro-batch-size x data-parallel size = {args.micro_batch_size * data_parallel}"
        )


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """TransformerConfig constructor kwargs from the parsed args."""
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        qk_layernorm=args.qk_layernorm,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        transformer_impl=args.transformer_impl,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        deterministic_mode=args.deterministic_mode,
    )
    if args.fp8_format:
        kwargs.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.num_experts is not None:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_permute_fusion=args.moe_permute_fusion,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_padding_for_quantization=args.moe_router_padding_for_quantization,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        )
    kwargs.update(config_kwargs_from_args(args))
    return kwargs
