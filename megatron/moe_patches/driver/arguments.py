"""pretrain_gpt.py's arguments: Megatron-LM flag spellings, recipes, checks, config mapping.

``parse_args`` = defaults < ``--yaml-cfg`` recipe < command line, then, before any
CUDA or NCCL work: ``check_load`` (what ``--load`` holds; ``--use-checkpoint-args``
takes the checkpoint's model args here), ``check_args`` (flag contradictions, sizes,
parallel sizes against ``WORLD_SIZE``) and ``validate_config`` (the full TransformerConfig
with the patch fields, built as ``training.setup`` builds it). Every refusal is one
``pretrain_gpt.py: error: ...`` line on stderr (more lines only where there are several
problems) naming the flags and the fix, with exit status 2 and no traceback.
``transformer_config_kwargs`` maps the args to megatron-core's TransformerConfig
(patched by ``apply()``, so the MoE patch fields are accepted; on a megatron-core the
patch set does not install into, its own class, with the kwargs
``compat.fit_config_kwargs`` fits to it). The training loop and ``main`` are in
``driver.training``, which imports this module (never the reverse).
"""

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch

from megatron.moe_patches.driver import checkpointing, compat
from megatron.moe_patches.driver.patch_args import add_moe_patch_args, config_kwargs_from_args
from megatron.moe_patches.driver.recipes import FIELD_ALIASES, RecipeError, apply_recipe, load_recipe


def _add_standard_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=2, help="Number of transformer layers.")
    model.add_argument("--hidden-size", type=int, default=512, help="Transformer hidden size (model width).")
    model.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Hidden size of the MLP's first projection (default: 4 x --hidden-size).")
    model.add_argument("--num-attention-heads", type=int, default=8, help="Number of attention heads.")
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="Number of key/value groups for grouped-query attention "
                       "(default: one per attention head, i.e. multi-head attention).")
    model.add_argument("--kv-channels", type=int, default=None,
                       help="Projection size of each attention head "
                       "(default: --hidden-size / --num-attention-heads).")
    model.add_argument("--seq-length", type=int, default=512, help="Length of each training sample, in tokens.")
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Longest sequence the position embeddings cover, in tokens (default: --seq-length).")
    model.add_argument("--vocab-size", type=int, default=32000,
                       help="Vocabulary size of the null tokenizer; the embedding table is padded to a "
                       "multiple of 128 x --tensor-model-parallel-size.")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                       help="Normalization layer type.")
    model.add_argument("--swiglu", action="store_true",
                       help="Use the SwiGLU gated activation in the MLPs instead of GeLU.")
    model.add_argument("--disable-bias-linear", action="store_true",
                       help="Leave out the biases of the linear layers.")
    model.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                       help="Position embedding type: learned absolute embeddings or rotary (RoPE).")
    model.add_argument("--rotary-base", type=int, default=10000,
                       help="Base period of the rotary position embeddings (--position-embedding-type rope).")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Give the output layer its own weights instead of sharing the input embedding's.")
    model.add_argument("--qk-layernorm", action="store_true",
                       help="Normalize the queries and keys before computing the attention scores.")
    model.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the normal distribution the weights are initialized from.")
    model.add_argument("--hidden-dropout", type=float, default=0.1,
                       help="Dropout probability on the outputs of the attention and MLP blocks.")
    model.add_argument("--attention-dropout", type=float, default=0.1,
                       help="Dropout probability on the attention probabilities.")
    model.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                       help="Transformer layer implementation: Transformer Engine's or megatron-core's own.")

    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--num-experts", type=int, default=None,
                     help="Number of experts in each MoE layer (default: a dense model, no experts).")
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                     help="Hidden size of each expert's MLP (default: --ffn-hidden-size).")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="Number of experts each token is routed to.")
    moe.add_argument("--moe-grouped-gemm", action="store_true",
                     help="Compute a rank's experts with grouped GEMMs instead of one GEMM per expert.")
    moe.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather",
                     help="How tokens are sent to their experts' ranks: all-gather, all-to-all, or the flex "
                     "dispatcher (DeepEP or HybridEP).")
    moe.add_argument("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep"], default="deepep",
                     help="Communication backend of the flex dispatcher (--moe-token-dispatcher-type flex).")
    moe.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                     default="aux_loss",
                     help="Router load balancing: auxiliary loss per batch or per sequence, Sinkhorn, or none.")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                     help="Scaling coefficient of the load-balancing auxiliary loss.")
    moe.add_argument("--moe-permute-fusion", action="store_true",
                     help="Use Transformer Engine's fused kernels to permute and unpermute the tokens.")
    moe.add_argument("--moe-router-pre-softmax", action="store_true",
                     help="Take the softmax over all router logits before the top-k selection "
                     "(without it: over the top-k logits after it).")
    moe.add_argument("--moe-router-padding-for-quantization", action="store_true",
                     help="Pad each expert's token count to the alignment the FP8 GEMMs need "
                     "(needs --fp8-format).")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                     help="Total hidden size of the shared experts, which process every token "
                     "(default: no shared experts).")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1,
                          help="Tensor model parallel size: ranks each layer's weights are split across.")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                          help="Pipeline model parallel size: stages the layers are split into.")
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1,
                          help="Expert model parallel size: ranks the experts are distributed across.")
    parallel.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                          help="Tensor parallel size inside each expert (default: --tensor-model-parallel-size).")
    parallel.add_argument("--sequence-parallel", action="store_true",
                          help="Split the work outside the tensor-parallel layers (norms, dropout) along the "
                          "sequence across the tensor-parallel ranks.")
    parallel.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                          help="Hide the expert-parallel all-to-all behind the computation of another "
                          "micro-batch (megatron-core's combined 1F1B schedule); needs "
                          "--expert-model-parallel-size > 1, --moe-token-dispatcher-type alltoall or flex, "
                          "--bf16 and --pipeline-model-parallel-size 1.")
    parallel.add_argument("--delay-wgrad-compute", action="store_true",
                          help="Compute the weight gradients apart from the input gradients, so that they "
                          "overlap the all-to-all too; needs --overlap-moe-expert-parallel-comm and "
                          "--transformer-impl transformer_engine.")

    graphs = parser.add_argument_group("CUDA graphs")
    graphs.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], default="none",
                        help="Capture parts of each layer as CUDA graphs. With --cuda-graph-scope moe and "
                        "dropless MoE this driver captures each MoE layer's forward and backward itself "
                        "(F11: needs --moe-device-tokens-per-expert, EP 1, alltoall or allgather).")
    graphs.add_argument("--cuda-graph-scope", nargs="+", default=None,
                        help="What to capture: moe (the whole MoE layer), or megatron-core's attn, mlp, "
                        "moe_router, moe_preprocess (default: the whole layer).")
    graphs.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                        help="Training steps run eagerly before the capture.")

    precision = parser.add_argument_group("precision")
    precision.add_argument("--bf16", action="store_true", help="Train in bfloat16 mixed precision.")
    precision.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                           help="Run the GEMMs in FP8: e4m3 throughout, or hybrid (e4m3 forward, e5m2 "
                           "backward); needs --bf16 (default: no FP8).")
    precision.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise"], default="delayed",
                           help="FP8 scaling recipe (with --fp8-format).")
    precision.add_argument("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                           help="Compute weight gradients in bf16, not FP8 (with --fp8-format).")

    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=1,
                       help="Samples per micro-batch on each data-parallel rank.")
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="Samples per optimizer step over all data-parallel ranks; a multiple of "
                       "--micro-batch-size x data-parallel size, reached by gradient accumulation "
                       "(default: --micro-batch-size x data-parallel size).")
    train.add_argument("--train-iters", type=int, default=100, help="Number of training iterations (optimizer steps).")
    train.add_argument("--lr", type=float, default=1e-4, help="Peak learning rate, reached after the warmup.")
    train.add_argument("--min-lr", type=float, default=0.0, help="Learning rate the decay ends at.")
    train.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine",
                       help="Learning rate decay after the warmup.")
    train.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Iterations of linear learning rate warmup from 0 to --lr.")
    train.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations the learning rate decays over, warmup included (default: --train-iters).")
    train.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient.")
    train.add_argument("--clip-grad", type=float, default=1.0,
                       help="Clip the gradients to this global L2 norm.")
    train.add_argument("--adam-beta1", type=float, default=0.9,
                       help="Adam's decay rate of the first moment (gradient mean).")
    train.add_argument("--adam-beta2", type=float, default=0.999,
                       help="Adam's decay rate of the second moment (squared gradient mean).")
    train.add_argument("--adam-eps", type=float, default=1e-8,
                       help="Term added to Adam's denominator for numerical stability.")
    train.add_argument("--seed", type=int, default=1234,
                       help="Random seed of the weight initialization, dropout and the data order.")
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard the optimizer states across the data-parallel ranks.")
    train.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with the backward pass.")
    train.add_argument("--deterministic-mode", action="store_true",
                       help="Use deterministic kernels only, so that runs and resumed runs reproduce exactly.")

    data = parser.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true",
                      help="Train on synthetic data (also what happens without --data-path).")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="Megatron indexed dataset prefixes: 'prefix ...' or 'weight prefix weight prefix ...' "
                      "to blend several (default: synthetic data).")
    data.add_argument("--split", default="969,30,1",
                      help="Comma-separated weights of the train, validation and test splits of the data.")
    data.add_argument("--data-cache-path", default=None,
                      help="Directory for the dataset index caches (default: beside the dataset files).")

    log = parser.add_argument_group("logging and checkpoints")
    log.add_argument("--log-interval", type=int, default=1,
                     help="Print the loss, learning rate and timing every this many iterations.")
    log.add_argument("--tensorboard-dir", default=None,
                     help="Write the logged metrics (loss, learning rate, grad norm, iteration time, "
                     "throughput, memory) as TensorBoard scalars into this directory; needs the "
                     "tensorboard package (default: no TensorBoard).")
    log.add_argument("--timing-log-level", type=int, choices=[0, 1], default=0,
                     help="1: also time the forward-backward and optimizer phases of each iteration "
                     "(adds a GPU sync between them).")
    log.add_argument("--log-num-zeros-in-grad", action="store_true",
                     help="Count the zero entries of the gradients (the optimizer's main grads, before "
                     "its step) and log them each logged iteration as 'num zeros' and the TensorBoard "
                     "scalar num-zeros (adds a GPU sync).")
    log.add_argument("--save", default=None,
                     help="Directory to save checkpoints to; one is always saved at the end "
                     "(default: no checkpoints).")
    log.add_argument("--load", default=None,
                     help="Checkpoint directory to resume from (default: train from scratch).")
    log.add_argument("--no-load-optim", action="store_true",
                     help="With --load: load the model weights and the iteration only; the optimizer "
                     "states and the learning-rate schedule start afresh, and the fp32 main params are "
                     "copied from the loaded weights.")
    log.add_argument("--load-main-params-from-ckpt", action="store_true",
                     help="With --no-load-optim: take the fp32 main params from the checkpoint's model "
                     "tensors (megatron-core's reload_model_params(state_dict)) rather than from the "
                     "model's bf16 params; needs --load, --bf16 and --use-distributed-optimizer.")
    log.add_argument("--save-interval", type=int, default=None,
                     help="Save a checkpoint every this many iterations; needs --save "
                     "(default: only at the end).")
    log.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                     help="Save distributed-optimizer states per parameter (loads across DP/EP sizes "
                     "and expert layouts) instead of per-DP-rank buffers.")
    log.add_argument("--use-checkpoint-args", action="store_true",
                     help="Take the model-defining args and the MoE patch flags from the --load checkpoint.")
    log.add_argument("--exit-on-missing-checkpoint", action="store_true",
                     help="With --load: stop (exit status 2) when there is no checkpoint to load, "
                     "instead of warning and training from scratch.")
    log.add_argument("--yaml-cfg", default=None,
                     help="Recipe file or built-in recipe name whose values become the defaults (flags on "
                     "the command line win): flat 'flag: value' or Megatron's nested form.")


class DriverHelpFormatter(argparse.HelpFormatter):
    """``--help`` ends each flag's help with ``(default: VALUE)`` where the default is a value.

    Switches (``store_true``) and flags whose default is None (unset) print none: their
    help says what happens without them.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "%(default)" in help_text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return help_text
        return f"{help_text} (default: %(default)s)"


class DriverArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``prog: error: message`` on stderr, exit status 2.

    argparse would print the usage of every flag (some 70 lines) above the message first;
    ``--help`` still lists them.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = DriverArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT/MoE pretraining on megatron-core with the MoE patch set applied.",
        formatter_class=DriverHelpFormatter,
        allow_abbrev=False,
    )
    _add_standard_args(parser)
    return add_moe_patch_args(parser)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size_from_env() -> int:
    """The number of ranks the launcher starts (torchrun sets WORLD_SIZE; a plain run is 1)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(value)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(f"WORLD_SIZE={value!r} (set by the launcher) is not a positive integer")
    return world


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate pretrain_gpt.py's arguments; exits with status 2 on bad input.

    Everything here runs before any CUDA or NCCL work, so no bad input reaches a GPU.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.yaml_cfg:
        try:
            recipe = load_recipe(first.yaml_cfg)
            apply_recipe(parser, recipe, getattr(recipe, "path", None) or first.yaml_cfg)
        except RecipeError as err:
            parser.error(str(err))
        except OSError as err:  # a --yaml-cfg that names no file and no built-in recipe
            message = str(err)
            parser.error(message if message.startswith("--yaml-cfg") else f"--yaml-cfg {first.yaml_cfg}: {message}")
    args = parser.parse_args(argv)  # unknown flags: argparse names them and exits

    def warn(message: str) -> None:
        if _rank() == 0:
            print(f"{parser.prog}: warning: {message}", file=sys.stderr, flush=True)

    try:
        world_size = world_size_from_env()
        check_load(args, warn)
        check_args(args, world_size=world_size)
        validate_config(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def check_load(args: argparse.Namespace, warn: Callable[[str], None] = print) -> Optional[str]:
    """What ``--load`` holds, decided before start-up (Megatron-LM's rules).

    No checkpoint there (no such directory, an empty one, no tracker file): one warning
    and training starts from scratch, or an error with ``--exit-on-missing-checkpoint``
    and with ``--use-checkpoint-args``. A ``--load`` that is a file, or a tracker that does
    not name a saved iteration, is an error naming the file. With ``--use-checkpoint-args``
    the checkpoint's model args are taken here. Returns the checkpoint directory or None.
    """
    if not args.load:
        for flag, dest in (("--use-checkpoint-args", "use_checkpoint_args"),
                           ("--exit-on-missing-checkpoint", "exit_on_missing_checkpoint")):
            if getattr(args, dest, False):
                raise ValueError(f"{flag} needs --load (the checkpoint directory)")
        return None
    path, missing = checkpointing.find_checkpoint(args.load)
    if path is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise ValueError(
                f"--load {args.load}: {missing}, and --exit-on-missing-checkpoint is set: point --load at a "
                "checkpoint directory, or drop --exit-on-missing-checkpoint to train from scratch"
            )
        if args.use_checkpoint_args:
            raise ValueError(
                f"--use-checkpoint-args: --load {args.load} has no checkpoint to take the args from ({missing}); "
                "point --load at a checkpoint directory or drop --use-checkpoint-args"
            )
        warn(f"--load {args.load}: {missing}; training starts from scratch "
             "(--exit-on-missing-checkpoint makes this an error)")
        return None
    if args.use_checkpoint_args:
        taken = checkpointing.restore_args(args, checkpointing.saved_args(args.load))
        if _rank() == 0:
            print(f"--use-checkpoint-args: took {sorted(taken)} from {path}", flush=True)
    return path


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# Sizes and counts: at least 1 (0 would divide by zero or build nothing).
AT_LEAST_ONE = (
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size",
    "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "expert_model_parallel_size", "moe_router_topk", "log_interval", "rotary_base",
)
AT_LEAST_ONE_IF_SET = (
    "ffn_hidden_size", "num_query_groups", "kv_channels", "max_position_embeddings", "num_experts",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "expert_tensor_parallel_size",
    "global_batch_size", "lr_decay_iters", "save_interval",
)
NOT_NEGATIVE = ("lr_warmup_iters", "lr", "min_lr", "weight_decay", "clip_grad", "moe_aux_loss_coeff")
FRACTIONS = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2")  # [0, 1)
POSITIVE_FLOATS = ("init_method_std", "adam_eps")
# Flags that only mean something for an MoE model (--num-experts).
MOE_ONLY = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_padding_for_quantization",
            "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "overlap_moe_expert_parallel_comm")


def _check_ranges(args: argparse.Namespace) -> None:
    for name in AT_LEAST_ONE + AT_LEAST_ONE_IF_SET:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(name)} {value}: must be at least 1")
    for name in NOT_NEGATIVE + FRACTIONS + POSITIVE_FLOATS:
        value = getattr(args, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_flag(name)} {value}: must be a finite number")
    for name in NOT_NEGATIVE:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"{_flag(name)} {value}: must not be negative")
    for name in FRACTIONS:
        value = getattr(args, name, None)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"{_flag(name)} {value}: must be at least 0 and below 1")
    for name in POSITIVE_FLOATS:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ValueError(f"{_flag(name)} {value}: must be above 0")


def _tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Fill derived defaults and reject contradictions (ValueError naming the flags and the fix).

    ``world_size``: the ranks the run has (``WORLD_SIZE``); the parallel sizes must fit it.
    """
    _check_ranges(args)
    if args.fp8_format and not args.bf16:
        raise ValueError("--fp8-format needs --bf16 (FP8 GEMMs on bf16 parameters)")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path contradict each other: choose one")
    if args.use_checkpoint_args and not args.load:
        raise ValueError("--use-checkpoint-args needs --load")
    if args.tensorboard_dir and not _tensorboard_installed():
        raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                         "(or this package's 'tensorboard' extra), or drop --tensorboard-dir")
    if getattr(args, "exit_on_missing_checkpoint", False) and not args.load:
        raise ValueError("--exit-on-missing-checkpoint needs --load (the checkpoint directory)")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save")
    if args.cuda_graph_impl != "none" and (args.cuda_graph_scope or []) != ["moe"]:
        scope = " ".join(args.cuda_graph_scope or ["(the whole layer)"])
        raise ValueError(f"--cuda-graph-impl {args.cuda_graph_impl} --cuda-graph-scope {scope}: this "
                         "pretrain_gpt.py captures the moe scope only (each dropless MoE layer, forward and "
                         "backward); use --cuda-graph-scope moe, or Megatron-LM's training loop for "
                         "megatron-core's other graph scopes")
    if args.cuda_graph_scope and args.cuda_graph_impl == "none":
        raise ValueError("--cuda-graph-scope needs --cuda-graph-impl local or transformer_engine")
    if args.num_experts is None:
        moe_only = [f for f in MOE_ONLY if getattr(args, f) not in (None, False)]
        if moe_only:
            raise ValueError(f"{_flag(moe_only[0])} needs --num-experts")
        if args.expert_model_parallel_size > 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts (an MoE model)")
    else:
        if args.num_experts % args.expert_model_parallel_size:
            raise ValueError(
                f"--num-experts {args.num_experts} must be divisible by --expert-model-parallel-size "
                f"{args.expert_model_parallel_size} (each expert-parallel rank holds the same number of "
                "experts): choose an EP size that divides the number of experts"
            )
        if args.moe_router_topk > args.num_experts:
            raise ValueError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    if args.moe_router_padding_for_quantization:
        if not args.fp8_format:
            raise ValueError("--moe-router-padding-for-quantization needs --fp8-format (it pads for FP8 GEMMs)")
        if args.moe_token_dispatcher_type == "allgather":
            raise ValueError("--moe-router-padding-for-quantization does not work with --moe-token-dispatcher-type "
                             "allgather: use alltoall or flex")
    _check_main_params_load(args)
    _check_expert_parallel_overlap(args)
    if args.pipeline_model_parallel_size > 1 and args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError("--num-layers must be divisible by --pipeline-model-parallel-size")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups is not None:
        groups = args.num_query_groups
        if args.num_attention_heads % groups:
            raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads}")
        if groups % tp and tp % groups:
            raise ValueError(f"--num-query-groups {groups} must be a multiple or a divisor of "
                             f"--tensor-model-parallel-size {tp}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                         f"{args.num_attention_heads} (or set --kv-channels)")
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.expert_model_parallel_size > 1 and tp > 1 and not args.sequence_parallel:
        raise ValueError("--expert-model-parallel-size > 1 with --tensor-model-parallel-size > 1 needs "
                         "--sequence-parallel")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                         f"{args.seq_length}: raise it (or use --position-embedding-type rope)")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:  # megatron-core's scheduler: warmup < decay
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters "
            f"{args.lr_decay_iters} (which defaults to --train-iters): shorten the warmup or "
            "set --lr-decay-iters"
        )
    _check_parallel_sizes(args, world_size)
    model_parallel = tp * args.pipeline_model_parallel_size
    data_parallel = world_size // model_parallel
    args.data_parallel_size = data_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel
    if args.global_batch_size % (args.micro_batch_size * data_parallel):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of "
            f"--micro-batch-size x data-parallel size = {args.micro_batch_size * data_parallel}"
        )


def _check_main_params_load(args: argparse.Namespace) -> None:
    if not getattr(args, "load_main_params_from_ckpt", False):
        return
    flag = "--load-main-params-from-ckpt"
    if not args.no_load_optim:  # Megatron-LM's rule: loaded optimizer states hold their own main params
        raise ValueError(f"{flag} needs --no-load-optim (with the optimizer states loaded, the main params come "
                         "from them): add --no-load-optim or drop the flag")
    if not args.load:
        raise ValueError(f"{flag} needs --load (the checkpoint directory)")
    if not args.bf16:
        raise ValueError(f"{flag} needs --bf16 (only mixed precision keeps fp32 main params apart from the model's "
                         "params): add --bf16 or drop the flag")
    if not args.use_distributed_optimizer:
        raise ValueError(f"{flag} needs --use-distributed-optimizer (megatron-core's other mixed-precision "
                         "optimizer cannot take main params from a state dict): add it or drop the flag")


# megatron-core's TransformerConfig asserts: the all-to-all overlap hangs on older torch.
OVERLAP_MIN_TORCH = (2, 6)
# Megatron-LM's floors for --delay-wgrad-compute: TE without gradient-accumulation fusion
# (this driver never fuses it), and TE with --overlap-grad-reduce.
DELAY_WGRAD_MIN_TE = "2.7.0"
DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE = "2.8.0"


def _torch_version() -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def _check_expert_parallel_overlap(args: argparse.Namespace) -> None:
    """megatron-core 0.16.1's requirements of overlap_moe_expert_parallel_comm and
    delay_wgrad_compute (TransformerConfig.__post_init__), as flags, plus what this driver
    does not offer (virtual pipeline stages)."""
    overlap = "--overlap-moe-expert-parallel-comm"
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        if args.expert_model_parallel_size < 2:
            raise ValueError(f"{overlap} needs --expert-model-parallel-size > 1 (it hides the expert-parallel "
                             "all-to-all): raise the EP size or drop the flag")
        if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
            raise ValueError(f"{overlap} needs --moe-token-dispatcher-type alltoall or flex, not "
                             f"{args.moe_token_dispatcher_type}")
        if not args.bf16:
            raise ValueError(f"{overlap} needs --bf16 (megatron-core overlaps bf16/fp16 models only): add --bf16")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError(f"{overlap} with --pipeline-model-parallel-size > 1 needs virtual pipeline stages, "
                             "which pretrain_gpt.py does not offer: use --pipeline-model-parallel-size 1")
        if _torch_version() < OVERLAP_MIN_TORCH:
            raise ValueError(f"{overlap} needs torch >= 2.6 (the all-to-all overlap hangs on older versions); "
                             f"this is torch {torch.__version__}: upgrade torch or drop the flag")
    if getattr(args, "delay_wgrad_compute", False):
        delay = "--delay-wgrad-compute"
        if not args.overlap_moe_expert_parallel_comm:
            raise ValueError(f"{delay} needs {overlap} (megatron-core computes the delayed weight gradients in "
                             f"its overlapped schedule): add {overlap}")
        if args.transformer_impl != "transformer_engine":
            raise ValueError(f"{delay} needs --transformer-impl transformer_engine (megatron-core's own layers "
                             "compute weight gradients at once)")
        from megatron.moe_patches import capabilities
        from packaging.version import Version

        te = capabilities.te_version()  # None where TE cannot be imported: checked on the GPU machine
        if te is not None and te < Version(DELAY_WGRAD_MIN_TE):
            raise ValueError(f"{delay} needs Transformer Engine >= {DELAY_WGRAD_MIN_TE} (this driver does not fuse "
                             f"gradient accumulation); this is {te}: upgrade TE or drop the flag")
        if te is not None and args.overlap_grad_reduce and te < Version(DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE):
            raise ValueError(f"{delay} with --overlap-grad-reduce needs Transformer Engine >= "
                             f"{DELAY_WGRAD_OVERLAP_GRAD_REDUCE_MIN_TE}; this is {te}: upgrade TE or drop "
                             "--overlap-grad-reduce")


def _check_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    """megatron-core's process grids: TP x PP x DP and ETP x EP x PP x expert-DP both tile the world."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # megatron-core's default: the TP size
    grids = [
        (tp * pp, f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"),
        (etp * ep * pp, f"--expert-tensor-parallel-size {etp}"
         f"{'' if args.expert_tensor_parallel_size else ' (the TP size by default)'} x "
         f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}"),
    ]
    for ranks, product in grids:
        if ranks > world_size:
            raise ValueError(
                f"{product} = {ranks} ranks, more than the world size {world_size} (WORLD_SIZE, the ranks "
                f"launched): launch at least {ranks} ranks or lower the sizes"
            )
        if world_size % ranks:
            raise ValueError(
                f"{product} = {ranks} does not divide the world size {world_size} (WORLD_SIZE, the ranks "
                f"launched): launch a multiple of {ranks} ranks or change the sizes"
            )


# --- the full TransformerConfig, before start-up ---------------------------------------

PATCH_ERROR_PREFIX = "Invalid MoE patch configuration"

# Fields whose stock TransformerConfig checks ask Transformer Engine itself rather than
# judge the flags: without TE they fail for every value. Where TE cannot be imported
# (a CPU machine), validate_config builds the config without them, then runs the patch
# set's checks (which need no TE) with them set, and leaves megatron-core's TE checks to
# setup() on the GPU machine, where TE is installed and they run in full.
TE_PROBED_FIELDS = {
    "moe_permute_fusion": "megatron-core imports TE's fused permute kernels to check it",
    "fp8": "megatron-core checks TE's version for FP8 MoE training",
    "fp8_recipe": "read only together with fp8",
    "moe_router_padding_for_quantization": "megatron-core checks it against fp8 (check_args checks it instead)",
}
# The same where megatron-core has the patch set's fields natively (and the patch set does
# not install): its own checks of these ask TE's version.
NATIVE_TE_PROBED_FIELDS = {
    "moe_single_grouped_weight": "megatron-core checks TE's version for single grouped weights",
    "moe_single_grouped_bias": "megatron-core checks TE's version for single grouped biases",
}

# Config field -> the flag's dest, where they differ.
_CONFIG_FIELD_DESTS = {
    **{field: dest for field, (dest, _) in FIELD_ALIASES.items()},
    "activation_func": "swiglu",
    "params_dtype": "bf16",
    "pipeline_dtype": "bf16",
}


@functools.lru_cache(maxsize=None)
def _dest_flags() -> Dict[str, str]:
    return {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}


def flags_named_in(text: str) -> List[str]:
    """The flags behind the config field names a message mentions, in order."""
    flags = []
    for word in re.findall(r"[A-Za-z][A-Za-z0-9_]*", text):
        if "_" not in word and word not in _CONFIG_FIELD_DESTS:
            continue  # plain words ("load", "seed") are not field names here
        flag = _dest_flags().get(_CONFIG_FIELD_DESTS.get(word, word))
        if flag and flag not in flags and flag not in text:
            flags.append(flag)
    return flags


def _with_flags(text: str) -> str:
    flags = flags_named_in(text)
    return f"{text} [{', '.join(flags)}]" if flags else text


def config_error_message(err: Exception) -> str:
    """A config construction error as pretrain_gpt.py reports it: the first line says the
    first problem and names its flags."""
    text = str(err).strip()
    if text.startswith(PATCH_ERROR_PREFIX):
        problems = [" ".join(p.split()) for p in re.split(r"\n\s*- ", text)[1:]] or [text]
        lines = [f"{PATCH_ERROR_PREFIX}: {_with_flags(problems[0])}"]
        lines += [f"  - {_with_flags(problem)}" for problem in problems[1:]]
        return "\n".join(lines)
    text = " ".join(text.split()) or f"{type(err).__name__} without a message"
    return f"megatron-core's TransformerConfig refuses these arguments: {_with_flags(text)}"


def _patch_refusal(kwargs: dict) -> Optional[ValueError]:
    """The patch set's own refusal of these config kwargs, judged without megatron-core's
    checks (whose bare asserts would otherwise speak first), or None."""
    from megatron.moe_patches.config import PatchedTransformerConfig, validate_moe_patch_config

    config = object.__new__(PatchedTransformerConfig)  # the fields, none of the checks
    for field in dataclasses.fields(PatchedTransformerConfig):
        if field.name in kwargs:
            value = kwargs[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        setattr(config, field.name, value)
    if config.expert_tensor_parallel_size is None:  # megatron-core's defaults the checks read
        config.expert_tensor_parallel_size = config.tensor_model_parallel_size
    if config.num_moe_experts is not None and config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    try:
        validate_moe_patch_config(config)
    except ValueError as err:
        return err
    except Exception:  # a value the checks cannot read before megatron-core's normalisation
        return None
    return None


def validate_config(args: argparse.Namespace, te_available: Optional[bool] = None) -> List[str]:
    """Build the TransformerConfig ``training.setup`` builds (patch fields included) and
    turn its refusals into a ValueError naming the flags. For combinations the patch set
    knows, its message wins over megatron-core's asserts.

    Returns the fields whose megatron-core checks were left to ``setup()`` because they ask
    Transformer Engine and it is not importable here (see ``TE_PROBED_FIELDS``); with TE
    (``te_available`` None: probe it) every check runs now.
    """
    from megatron.moe_patches import capabilities
    from megatron.moe_patches.config import validate_moe_patch_config

    kwargs = transformer_config_kwargs(args)
    config_class = compat.config_class()  # megatron-core's own where the patch set does not install
    patched = compat.patch_set_installs()
    if torch.cuda.is_available():  # config checks may ask the GPU: this rank's, not GPU 0 for all
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if te_available is None:
        te_available = capabilities.te_version() is not None
    probed = TE_PROBED_FIELDS if patched else {**TE_PROBED_FIELDS, **NATIVE_TE_PROBED_FIELDS}
    deferred = [] if te_available else [n for n in probed if kwargs.get(n) not in (None, False)]
    if "moe_permute_fusion" in deferred and kwargs.get("cuda_graph_impl") not in (None, "none"):
        deferred.append("cuda_graph_impl")  # the MoE graph rule reads moe_permute_fusion
    late = {name: kwargs.pop(name) for name in deferred}
    try:
        with warnings.catch_warnings():  # setup() builds it again; its warnings show there once
            warnings.simplefilter("ignore")
            config = config_class(**kwargs)
    except (ValueError, AssertionError, ImportError) as err:  # ImportError: a TE without the asked kernels
        refusal = _patch_refusal({**kwargs, **late}) if patched else None
        raise ValueError(config_error_message(refusal or err)) from None
    if late and patched:  # the patch set's checks need no TE: run them with the real values
        for name, value in late.items():
            setattr(config, name, value)
        try:
            validate_moe_patch_config(config)
        except ValueError as err:
            raise ValueError(config_error_message(err)) from None
    return deferred


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
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=args.delay_wgrad_compute,
        cuda_graph_impl=args.cuda_graph_impl,
        cuda_graph_scope=args.cuda_graph_scope or "full",
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
    )
    if args.fp8_format:
        kwargs.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_wgrad=args.fp8_wgrad)
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
    return compat.fit_config_kwargs(kwargs)
