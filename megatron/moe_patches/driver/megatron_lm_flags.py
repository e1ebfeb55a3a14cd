"""Megatron-LM 0.16.1's command-line flags, and what this driver does with each.

``FLAGS`` has one row for every flag that Megatron-LM core_v0.16.1's
``megatron/training/arguments.py`` defines, in that file's order: the option strings, the
dest (the name Megatron-LM's YAML configs use), Megatron-LM's default and how argparse
reads the flag, then its status here:

- supported (no ``refused``): ``arguments.py`` defines the flag with Megatron-LM's default
  (``runs_as`` where this driver's default differs: it logs the throughput unless told not
  to) and the driver does what Megatron-LM does with it. ``refused_values`` names the values
  of a supported flag that this driver does not offer, each with the reason; ``only_with``
  the setting without which Megatron-LM reads none of its values (--save-interval without
  --save): a value given without it is accepted with a one-line note saying so.
- refused: ``add_refused_flags`` gives the parser the flag with Megatron-LM's syntax, so a
  launch script's command line parses as it does there, and ``all_refusals`` turns a
  value other than the one this driver runs with (``runs_as``: Megatron-LM's default
  unless the row says otherwise) into an error naming the flag and ``refused``: why, and
  what to use instead. A refused flag is never accepted and then ignored: the one value
  it is accepted with is what the driver does anyway. ``also_accepts`` names other values
  that change nothing either (W&B's empty project), and ``only_with`` the setting without
  which Megatron-LM reads none of its values (the TensorBoard switches without
  --tensorboard-dir), ``unread_with`` a (dest, value) with which it reads none of them
  (--no-position-embedding with --position-embedding-type rope): without the one or with
  the other, every value is accepted.
- no effect (``no_effect``): every value is accepted, as none changes this driver's run
  (``--num-workers``); a value other than ``runs_as`` gets a one-line note saying why.

A row whose ``runs_as`` differs from Megatron-LM's default records where this driver's
behaviour differs from Megatron-LM's defaults (its fusions, for example): the flag that
asks for this driver's behaviour is accepted, the default is refused where a recipe sets it.
"""

import argparse
import dataclasses
import os
import signal
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union


class _Marker:
    def __init__(self, meaning: str):
        self.meaning = meaning

    def __repr__(self) -> str:
        return self.meaning


# runs_as values: Megatron-LM's default (most rows), or no value at all (the flag is
# refused whenever it is given).
MEGATRON_LM_DEFAULT = _Marker("Megatron-LM's default")
NOT_OFFERED = _Marker("no value")


@dataclasses.dataclass(frozen=True)
class FromEnv:
    """A default Megatron-LM reads from the launcher's environment when it builds its parser."""

    variable: str
    fallback: int

    def value(self) -> int:
        try:
            return int(os.environ.get(self.variable, self.fallback))
        except ValueError:  # a bad launcher variable is reported where the driver reads it
            return self.fallback


# megatron-core's AttnBackend members (megatron.core.transformer.enums), by name in its order:
# written out so that the parser, --help and the argument errors need no megatron-core, whose
# import takes seconds (tests/unit/test_fast_commands.py compares them with the enum).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


@dataclasses.dataclass(frozen=True)
class AttnBackendName:
    """An AttnBackend member by name, megatron-core not imported yet: ``value()`` imports it and
    gives the member. Printed as the member prints (``--help`` shows the default so)."""

    member: str

    def value(self):
        from megatron.core.transformer.enums import AttnBackend

        return AttnBackend[self.member]

    def __str__(self) -> str:
        return f"AttnBackend.{self.member}"


def _backend_name(name: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
    return name


def attention_backend(name: str):
    """``--attention-backend`` values: megatron-core's AttnBackend members by name."""
    return AttnBackendName(_backend_name(name)).value()


def attention_backend_name(name: str) -> AttnBackendName:
    """``--attention-backend`` values as ``arguments.parse_args`` reads the command line and the
    recipe: the name, checked; ``resolve_names`` makes it the member once argparse has done."""
    return AttnBackendName(_backend_name(name))


# The same type to a recipe's error ("cannot read 'x' as attention_backend").
attention_backend_name.__name__ = attention_backend.__name__


def resolve_names(args: argparse.Namespace) -> None:
    """Turn the ``AttnBackendName`` values ``args`` holds into megatron-core's members (imports it)."""
    for dest, value in list(vars(args).items()):
        if isinstance(value, AttnBackendName):
            setattr(args, dest, value.value())


def signal_by_name(name: str) -> signal.Signals:
    """``--exit-signal`` values: signal names (SIGTERM, ...)."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (a signal name such as SIGTERM)") from None


def number_or_text(text: str) -> Union[int, str]:
    """``--moe-layer-freq``: an integer, or Megatron-LM's list expression kept as text."""
    try:
        return int(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class MegatronLMFlag:
    names: Tuple[str, ...]  # option strings; messages use the first
    dest: str
    default: Any  # Megatron-LM 0.16.1's (a FromEnv where it reads the environment; an AttnBackendName)
    action: str  # argparse action: store, store_true, store_false or boolean_optional
    type: Optional[Callable] = None
    nargs: Optional[Union[int, str]] = None
    refused: Optional[str] = None  # None: supported
    runs_as: Any = MEGATRON_LM_DEFAULT  # refused flags: the one value this driver runs with
    refused_values: Mapping[Any, str] = dataclasses.field(default_factory=dict)  # supported flags
    also_accepts: Tuple[Any, ...] = ()  # refused flags: other values that change nothing either
    only_with: Optional[str] = None  # the dest without which Megatron-LM reads no value of it
    unread_with: Optional[Tuple[str, Any]] = None  # (dest, value) with which Megatron-LM reads no value of it
    no_effect: Optional[str] = None  # every value accepted: why none changes this driver's run

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def megatron_lm_default(self) -> Any:
        return self.default.value() if isinstance(self.default, (FromEnv, AttnBackendName)) else self.default

    @property
    def accepted(self) -> Any:
        """The value this driver runs with (refused flags); NOT_OFFERED where it has none."""
        if self.runs_as is MEGATRON_LM_DEFAULT:
            return self.megatron_lm_default
        return self.runs_as.value() if isinstance(self.runs_as, FromEnv) else self.runs_as

    @property
    def parser_default(self) -> Any:
        return self.megatron_lm_default if self.accepted is NOT_OFFERED else self.accepted


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def on(*names: str, dest: Optional[str] = None, default: Any = False, **status) -> MegatronLMFlag:
    """A switch that sets its dest to True."""
    return MegatronLMFlag(names, dest or _dest(names[0]), default, "store_true", **status)


def off(*names: str, dest: str, **status) -> MegatronLMFlag:
    """A switch that sets its dest (True by default) to False: Megatron-LM's ``--no-...``."""
    return MegatronLMFlag(names, dest, True, "store_false", **status)


def both(*names: str, default: Any, **status) -> MegatronLMFlag:
    """``--x`` / ``--no-x`` (argparse's BooleanOptionalAction)."""
    return MegatronLMFlag(names, _dest(names[0]), default, "boolean_optional", **status)


def opt(*spec, dest: Optional[str] = None, nargs=None, **status) -> MegatronLMFlag:
    """A flag that takes values: ``opt(name, [alias, ...], type, default, ...)``."""
    names = tuple(part for part in spec if isinstance(part, str) and part.startswith("--"))
    value_type, default = spec[len(names):]
    return MegatronLMFlag(names, dest or _dest(names[0]), default, "store", value_type, nargs, **status)


# --- why a flag is refused ---------------------------------------------------------------
ACTIVATION = "this driver builds GeLU or SwiGLU (--swiglu) MLPs only"
ALWAYS_LOGGED = "this driver always writes it and cannot leave it out: set it true, or drop the setting"
ATTENTION_VARIANT = "this driver builds standard dot-product self-attention only"
AUTORESUME = "ADLR autoresume is not run by this driver"
BATCH_INVARIANT = "batch-invariant kernels are not offered by this driver (--deterministic-mode reproduces runs)"
BATCH_ROUNDING = ("this driver keeps every global batch size (of --rampup-batch-size too) a multiple of "
                  "--micro-batch-size x data-parallel size, and refuses one that is not before start-up")
CHECKPOINT_ARGS = ("--use-checkpoint-args takes every model arg from the checkpoint; the parallel sizes alone are not "
                   "offered")
CHECKPOINT_EXTRAS = ("this driver saves persistent torch_dist checkpoints to --save every --save-interval iterations "
                     "and at the end, and keeps them all")
CHECKPOINT_FORMAT = "this driver saves and loads torch_dist checkpoints only"
CHECKPOINT_STRATEGY = ("this driver saves and loads checkpoints with megatron-core's default torch_dist strategies "
                       "(synchronous, not fully parallel)")
CONFIG_LOGGER = "this driver does not dump the model config"
CONTEXT_PARALLEL = "context parallelism is not offered by this driver (it does not split sequences across ranks)"
DATA_LOADER = ("this driver reads its samples in the training process (no DataLoader workers) from megatron-core's "
               "datasets as built by default")
DATA_SOURCES = "this driver reads --data-path (or mock data) only"
DDP_TUNING = "this driver builds megatron-core's DDP with its default buckets and reductions"
DEPRECATED_BATCH_SIZE = "deprecated in Megatron-LM: use --micro-batch-size"
DEPRECATED_DEEPEP = ("deprecated in Megatron-LM: use --moe-token-dispatcher-type flex "
                     "--moe-flex-dispatcher-backend deepep")
DEPRECATED_DIST_CKPT = "deprecated in Megatron-LM: use --ckpt-format"
DEPRECATED_ENABLE_CUDA_GRAPH = "deprecated in Megatron-LM: use --cuda-graph-impl local"
DEPRECATED_EXTERNAL_CUDA_GRAPH = "deprecated in Megatron-LM: use --cuda-graph-impl transformer_engine"
DEPRECATED_FLASH_ATTN = "deprecated in Megatron-LM: use --attention-backend flash"
DEPRECATED_MCORE_MODELS = "deprecated in Megatron-LM, whose models are megatron-core's by default: drop it"
DEPRECATED_MODEL_PARALLEL_SIZE = "deprecated in Megatron-LM: use --tensor-model-parallel-size"
DEPRECATED_PADDING_FOR_FP8 = "deprecated in Megatron-LM: use --moe-router-padding-for-quantization"
DEPRECATED_ROTARY = "deprecated in Megatron-LM: use --position-embedding-type rope"
DEPRECATED_WARMUP = "deprecated in Megatron-LM: use --lr-warmup-fraction or --lr-warmup-iters"
EARLY_EXIT = ("this driver runs --train-iters iterations (or --train-samples samples); it has no other exit "
              "condition and no signal handler")
ENCODER_DECODER = "this driver builds decoder-only GPT models: use --num-layers and --seq-length"
EP_OVERLAP_TUNING = "this driver runs megatron-core's combined 1F1B schedule with its default memory handling"
EVALUATION = ("this driver evaluates --eval-iters batches of the validation split every --eval-interval iterations "
              "and at the end, and trains first; use Megatron-LM's pretrain_gpt.py for other evaluations")
VALIDATION_PPL = "this driver writes the validation loss to TensorBoard (lm loss validation), not its perplexity"
EXPERIMENTAL = "Megatron-LM's experimental features are not offered by this driver"
FINETUNE = ("this driver resumes from --load as saved (--no-load-optim loads the model and iteration only); "
            "fine-tuning from a pretrained checkpoint is not offered")
FIM = "fill-in-the-middle data is not offered by this driver"
FP16 = "fp16 training (with loss scaling) is not offered by this driver: use --bf16"
FP32_GRADIENTS = "this driver accumulates and all-reduces gradients in fp32 (as Megatron-LM does with --bf16)"
FP32_GRADIENTS_ALWAYS = ("this driver accumulates and all-reduces gradients in fp32 whatever it says (Megatron-LM "
                         "forces it on with --bf16; fp32 parameters have fp32 gradients)")
FP4 = "FP4 training is not offered by this driver"
FP8_INTERVAL = "deprecated: Transformer Engine 1.8 and later ignore it"
FP8_LAYER_CHOICE = "this driver runs every layer in FP8 when --fp8-format is given"
FP8_PARAMS = "FP8 parameters are not offered: with --fp8-format this driver keeps bf16 parameters"
FSDP = ("FSDP is not offered: this driver trains with megatron-core's DDP (--use-distributed-optimizer shards the "
        "optimizer)")
FUSIONS = ("this driver builds megatron-core's TransformerConfig with this fusion off (megatron-core's default; in "
           "Megatron-LM the flag's --no- form asks for that)")
GPT_MODEL_ROPE = "this driver builds RoPE without scaling or interpolation"
GRADIENT_DUMPS = "this driver does not save gradients"
HETEROGENEOUS = "heterogeneous layer configurations are not built by this driver"
INFERENCE = "an inference setting: this driver only trains"
INITIALIZATION = "this driver initializes the weights on the GPU with megatron-core's normal init (--init-method-std)"
KITCHEN = "NVIDIA Kitchen quantization is not offered by this driver"
LAUNCHER_RANK = "this driver takes the local rank from LOCAL_RANK, which the launcher sets"
LAYER_SPEC = "this driver builds megatron-core's GPT layer spec (Transformer Engine or local, by --transformer-impl)"
LEGACY_GROUPED_GEMM = "the legacy GroupedMLP is not built by this driver: --moe-grouped-gemm uses Transformer Engine's"
LEGACY_MODELS = "only Megatron-LM's legacy models read it; this driver builds megatron-core's GPTModel"
LEGACY_POSITION_EMBEDDING = ("deprecated in Megatron-LM, which takes it with --position-embedding-type rope only (a "
                             "model without learned position embeddings): use --position-embedding-type")
LOGGED_EXTRAS = ("this driver does not log it; each logged iteration shows the loss, learning rate, grad norm, "
                 "throughput, memory and progress")
LOOP_EXTRAS = "a feature of Megatron-LM's training loop that this driver does not have"
LR_SCHEDULE = ("this driver warms the learning rate up from 0 and, on --load, checks the saved schedule against the "
               "flags (Megatron-LM's defaults)")
MAMBA = "Mamba and hybrid models are not built by this driver (GPT only)"
MLA = "multi-latent attention is not built by this driver"
MOE_LATENT = "latent MoE is not built by this driver"
MOE_LAYER_FREQ = "this driver makes every layer an MoE layer (with --num-experts)"
MOE_LOGGING = "this driver does not log the MoE auxiliary losses"
MROPE = "multimodal RoPE is not built by this driver"
MTP = "multi-token prediction is not built by this driver"
NAN_CHECK = "this driver does not check the loss and the gradients for NaN or Inf"
NCCL_TUNING = "this driver creates its NCCL communicators with their defaults"
NO_LOSS_SCALE = "this driver has no loss scale to log (bf16 and fp32 train without one)"
NO_WORKERS = ("this driver reads its samples in the training process (no DataLoader workers); the number of "
              "workers changes no sample")
NO_RNG_STATE = "this driver's checkpoints hold no RNG states: it neither saves nor loads them (what the flag asks for)"
NOT_GPT = "a setting of a model other than GPT (BERT, T5, retrieval, vision, SFT); this driver pretrains GPT models"
OBJECT_STORAGE = "this driver reads local files only, without the multi-storage client (what --disable-msc asks for)"
OFFLOADING = "activation and weight offloading are not offered by this driver"
ONE_LOGGER = "Megatron-LM's one-logger telemetry is not run by this driver (what --no-one-logger asks for)"
ONE_LOGGER_NOT_RUN = ("this driver does not run Megatron-LM's one-logger telemetry (Megatron-LM runs it only where "
                      "its one_logger package is installed): drop it, or give --no-one-logger")
OPTIMIZER = "this driver trains with megatron-core's Adam (decoupled weight decay) only"
OPTIMIZER_OFFLOAD = "optimizer CPU offloading is not offered by this driver"
PARAM_GATHER_OVERLAP = "this driver does not overlap the distributed optimizer's parameter all-gather"
PARAM_GROUPS = ("this driver uses megatron-core's default parameter groups: one learning rate, no weight decay on "
                "biases and norms")
PER_TOKEN_LOSS = "this driver averages the loss over each micro-batch's tokens"
PIPELINE_TUNING = "this driver runs megatron-core's default pipeline-parallel communication"
PRECISION_AWARE_OPTIMIZER = ("the precision-aware optimizer is not offered: this driver keeps fp32 main params, "
                             "main grads and Adam states")
PROCESS_GROUPS = "this driver creates megatron-core's process groups with their defaults (NCCL, gloo groups, timeouts)"
PROFILING = "this driver runs no profiler: run it under nsys or the PyTorch profiler"
QK_CLIP = "QK-clip needs Megatron-LM's optimizer-step hook, which this driver does not run"
QUANTIZATION_RECIPES = ("custom quantization recipes are not offered: use --fp8-format with --fp8-recipe tensorwise, "
                        "delayed, mxfp8 or blockwise")
RELATIVE_POSITIONS = "relative position embeddings (T5) are not built by this driver"
REMOVED_CHECKPOINT_ACTIVATIONS = "removed from Megatron-LM: use --recompute-activations or --recompute-granularity"
REMOVED_EXTENDED_TP = "Megatron-LM 0.16.1 no longer offers it: use --expert-tensor-parallel-size"
RERUN_MACHINE = "Megatron-LM's rerun state machine (result validation, error injection) is not run by this driver"
RESTARTS = "in-process restarts and fault tolerance are not run by this driver"
RL = "reinforcement learning is Megatron-LM's, not this driver's"
RNG_TRACKERS = "this driver uses megatron-core's default CUDA RNG tracker"
ROUTING_REPLAY = "MoE routing replay is not offered by this driver"
SAMPLE_MASKS = ("this driver builds GPT samples with megatron-core's defaults: no position or attention-mask resets, "
                "the loss on every token, no attention mask")
SAVES_OPTIMIZER = "this driver always saves the optimizer states"
STANDALONE_EMBEDDING_STAGE = ("an older Megatron-LM's embedding-only first pipeline stage: Megatron-LM 0.16.1 has no such "
                              "flag (its YAML reader keeps the key unread) and this driver splits the layers evenly "
                              "over --pipeline-model-parallel-size stages: drop it")
SLIDING_WINDOW = "sliding-window attention is not built by this driver"
STRAGGLERS = "straggler detection is not run by this driver"
STREAM_PRIORITIES = "this driver leaves the CUDA streams' priorities at their defaults"
TENSORBOARD_INTERVAL = "this driver writes its TensorBoard scalars every --log-interval iterations"
TENSORBOARD_WRITER = "this driver flushes its TensorBoard writer after each logged iteration"
TIMERS = ("this driver times each iteration after a device synchronize (--timing-log-level 1 adds the "
          "forward-backward and optimizer phases)")
TOKENIZERS = ("this driver loads no text tokenizer: it trains on token ids (mock data, or indexed datasets tokenized "
              "beforehand); give --vocab-size, with --tokenizer-type NullTokenizer as Megatron-LM counts it")
TORCH_BACKEND = "this driver leaves PyTorch's matmul and JIT settings at their defaults"
TP_OVERLAP = "TP communication overlap (Transformer Engine userbuffers) is not set up by this driver"
TP_OVERLAP_ONLY = "read only with TP communication overlap (--tp-comm-overlap), which this driver does not set up"
UPCYCLING = "upcycling a dense checkpoint to MoE is not offered by this driver"
VIRTUAL_PIPELINE = ("this driver splits the layers evenly over --pipeline-model-parallel-size stages, without "
                    "virtual or uneven stages")
VOCAB_PADDING = ("this driver pads the vocabulary to a multiple of 128 x --tensor-model-parallel-size (Megatron-LM's "
                 "default)")
WANDB = "Weights & Biases logging is not offered by this driver: use --tensorboard-dir"
WEIGHT_DECAY_SCHEDULE = "this driver keeps the weight decay constant (--weight-decay)"
WSD = "the WSD schedule is not offered: use --lr-decay-style constant, linear, cosine or inverse-square-root"
NO_POSITION_EMBEDDING = "this driver builds learned_absolute or rope position embeddings"
TIMING_LEVEL_2 = ("this driver times each iteration and, at level 1, its forward-backward and optimizer "
                  "phases")

# Megatron-LM's choices for the supported flags that offer them; arguments.py takes these.
NULL_TOKENIZER = "NullTokenizer"
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "MultimodalTokenizer", NULL_TOKENIZER, "NullMultimodalTokenizer", "SFTTokenizer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "mrope", "relative", "none")
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
TIMING_LOG_LEVELS = (0, 1, 2)
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")

# --- the table: every flag of Megatron-LM 0.16.1's arguments.py, in its order -------------

FLAGS: Tuple[MegatronLMFlag, ...] = (
    opt("--tensor-model-parallel-size", int, 1),
    opt("--pipeline-model-parallel-comm-backend", str, None, refused=PIPELINE_TUNING),
    opt("--pipeline-model-parallel-size", int, 1),
    on("--sequence-parallel"),
    opt("--context-parallel-size", int, 1, refused=CONTEXT_PARALLEL),
    opt("--hierarchical-context-parallel-sizes", int, None, nargs="+", refused=CONTEXT_PARALLEL),
    opt("--max-seqlen-per-dp-cp-rank", int, None, refused=CONTEXT_PARALLEL),
    on("--hybrid-context-parallel", refused=CONTEXT_PARALLEL),
    opt("--expert-model-parallel-size", int, 1),
    opt("--expert-tensor-parallel-size", int, None),
    on("--moe-extended-tp", refused=REMOVED_EXTENDED_TP),
    off("--no-initialization", dest="perform_initialization", refused=INITIALIZATION),
    on("--use-cpu-initialization", default=None, refused=INITIALIZATION),
    on("--fp16", refused=FP16),
    on("--bf16"),
    on("--deterministic-mode"),
    off("--no-async-tensor-model-parallel-allreduce", "--disable-async-tensor-model-parallel-allreduce",
        dest="async_tensor_model_parallel_allreduce", refused=TP_OVERLAP),
    on("--tp-comm-overlap", refused=TP_OVERLAP),
    off("--no-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-wgrad", dest="tp_comm_bulk_wgrad", refused=TP_OVERLAP),
    off("--no-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-dgrad", dest="tp_comm_bulk_dgrad", refused=TP_OVERLAP),
    off("--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag", dest="tp_comm_overlap_ag", refused=TP_OVERLAP),
    off("--no-tp-comm-overlap-rs", "--disable-tp-comm-overlap-rs", dest="tp_comm_overlap_rs", refused=TP_OVERLAP),
    on("--tp-comm-overlap-rs-dgrad", refused=TP_OVERLAP),
    off("--no-tp-comm-split-ag", "--disable-tp-comm-split-ag", dest="tp_comm_split_ag", refused=TP_OVERLAP),
    off("--no-tp-comm-split-rs", "--disable-tp-comm-split-rs", dest="tp_comm_split_rs", refused=TP_OVERLAP),
    on("--cross-entropy-loss-fusion"),
    opt("--cross-entropy-fusion-impl", str, "native"),
    opt("--tp-comm-bootstrap-backend", str, "nccl", refused=TP_OVERLAP),
    on("--overlap-moe-expert-parallel-comm"),
    on("--delay-wgrad-compute"),
    on("--ep-overlap-early-attn-memory-release", refused=EP_OVERLAP_TUNING),
    on("--use-ring-exchange-p2p", refused=PIPELINE_TUNING),
    on("--defer-embedding-wgrad-compute", refused=PIPELINE_TUNING),
    opt("--wgrad-deferral-limit", int, 0, refused=PIPELINE_TUNING),
    on("--overlap-p2p-communication-warmup-flush", dest="overlap_p2p_comm_warmup_flush", refused=VIRTUAL_PIPELINE),
    opt("--microbatch-group-size-per-virtual-pipeline-stage",
        int, None, dest="microbatch_group_size_per_vp_stage", refused=VIRTUAL_PIPELINE),
    on("--mtp-standalone", refused=MTP),
    opt("--cpu-offloading-num-layers", int, 0, refused=OFFLOADING),
    opt("--num-layers", int, None),
    opt("--mtp-num-layers", int, None, refused=MTP),
    opt("--mtp-loss-scaling-factor", float, 0.1, refused=MTP),
    on("--account-for-embedding-in-pipeline-split", refused=VIRTUAL_PIPELINE),
    on("--account-for-loss-in-pipeline-split", refused=VIRTUAL_PIPELINE),
    opt("--hidden-size", int, None),
    opt("--num-attention-heads", int, None),
    opt("--attention-backend", attention_backend, AttnBackendName("auto")),
    opt("--softmax-type", str, "vanilla", refused=ATTENTION_VARIANT),
    opt("--num-query-groups", int, 1),
    opt("--ffn-hidden-size", int, None),
    opt("--kv-channels", int, None),
    opt("--hidden-dropout", float, 0.1),
    opt("--attention-dropout", float, 0.1),
    on("--fp32-residual-connection"),
    on("--apply-residual-connection-post-layernorm"),
    opt("--norm-epsilon", float, 1e-05, dest="layernorm_epsilon"),
    on("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma"),
    off("--disable-bias-linear", dest="add_bias_linear"),
    on("--add-qkv-bias"),
    opt("--glu-linear-offset", float, 0.0, refused=ACTIVATION),
    opt("--activation-func-clamp-value", float, None, refused=ACTIVATION),
    on("--rotary-interleaved"),
    opt("--normalization", str, "LayerNorm"),
    on("--qk-layernorm"),
    on("--qk-l2-norm", refused=ATTENTION_VARIANT),
    on("--qk-clip", refused=QK_CLIP),
    opt("--qk-clip-alpha", float, 0.5, refused=QK_CLIP),
    opt("--qk-clip-threshold", float, 100, refused=QK_CLIP),
    on("--attention-output-gate", refused=ATTENTION_VARIANT),
    on("--calculate-per-token-loss", refused=PER_TOKEN_LOSS),
    on("--multi-latent-attention", refused=MLA),
    opt("--experimental-attention-variant", str, None, refused=ATTENTION_VARIANT),
    opt("--dsa-indexer-n-heads", int, None, refused=ATTENTION_VARIANT),
    opt("--dsa-indexer-head-dim", int, None, refused=ATTENTION_VARIANT),
    opt("--dsa-indexer-topk", int, None, refused=ATTENTION_VARIANT),
    opt("--dsa-indexer-loss-coeff", float, None, refused=ATTENTION_VARIANT),
    on("--dsa-indexer-use-sparse-loss", refused=ATTENTION_VARIANT),
    opt("--linear-conv-kernel-dim", int, 4, refused=ATTENTION_VARIANT),
    opt("--linear-key-head-dim", int, 128, refused=ATTENTION_VARIANT),
    opt("--linear-value-head-dim", int, 128, refused=ATTENTION_VARIANT),
    opt("--linear-num-key-heads", int, 16, refused=ATTENTION_VARIANT),
    opt("--linear-num-value-heads", int, 32, refused=ATTENTION_VARIANT),
    opt("--init-method-std", float, 0.02),
    opt("--embedding-init-method-std", float, None),
    on("--init-model-with-meta-device", refused=INITIALIZATION),
    on("--apply-query-key-layer-scaling", refused=FP16),
    on("--disable-bf16-reduced-precision-matmul", refused=TORCH_BACKEND),
    on("--use-fused-weighted-squared-relu", refused=ACTIVATION),
    opt("--recompute-granularity", str, None),
    opt("--recompute-method", str, None),
    opt("--recompute-num-layers", int, None),
    on("--distribute-saved-activations"),
    opt("--recompute-modules", str, None, nargs="+"),
    opt("--fp8-format", str, None, dest="fp8"),
    opt("--fp8-recipe", str, "delayed", refused_values={"custom": QUANTIZATION_RECIPES}),
    opt("--fp8-quantizer-factory", str, None, refused=QUANTIZATION_RECIPES),
    opt("--fp8-margin", int, 0),
    opt("--fp8-interval", int, 1, refused=FP8_INTERVAL),
    opt("--fp8-amax-history-len", int, 1),
    opt("--fp8-amax-compute-algo", str, "most_recent"),
    off("--no-fp8-wgrad", "--disable-fp8-wgrad", dest="fp8_wgrad"),
    on("--first-last-layers-bf16", refused=FP8_LAYER_CHOICE),
    opt("--num-layers-at-start-in-bf16", int, 1, refused=FP8_LAYER_CHOICE),
    opt("--num-layers-at-end-in-bf16", int, 1, refused=FP8_LAYER_CHOICE),
    on("--use-kitchen-attention", refused=KITCHEN),
    opt("--kitchen-attention-backend", str, "sdpa", refused=KITCHEN),
    opt("--fp4-format", str, None, dest="fp4", refused=FP4),
    opt("--fp4-recipe", str, "nvfp4", refused=FP4),
    on("--fp4-param-gather", dest="fp4_param", refused=FP4),
    opt("--fp4-quantizer-factory", str, None, refused=FP4),
    opt("--moe-shared-expert-intermediate-size", int, None),
    on("--moe-shared-expert-gate"),
    on("--moe-shared-expert-overlap"),
    opt("--moe-ffn-hidden-size", int, None),
    opt("--moe-router-topk", int, 2),
    on("--moe-enable-routing-replay", refused=ROUTING_REPLAY),
    on("--moe-router-padding-for-quantization"),
    on("--moe-router-padding-for-fp8", refused=DEPRECATED_PADDING_FOR_FP8),
    opt("--moe-router-num-groups", int, None),
    opt("--moe-router-group-topk", int, None),
    on("--moe-router-pre-softmax"),
    opt("--moe-router-topk-scaling-factor", float, None),
    opt("--moe-router-score-function", str, "softmax"),
    opt("--moe-router-dtype", str, None),
    on("--moe-router-enable-expert-bias"),
    opt("--moe-router-bias-update-rate", float, 0.001),
    on("--moe-router-force-load-balancing"),
    on("--moe-grouped-gemm"),
    on("--moe-use-legacy-grouped-gemm", refused=LEGACY_GROUPED_GEMM),
    opt("--moe-z-loss-coeff", float, None),
    opt("--moe-input-jitter-eps", float, None),
    opt("--moe-token-dispatcher-type", str, "allgather"),
    on("--moe-enable-deepep", refused=DEPRECATED_DEEPEP),
    opt("--moe-flex-dispatcher-backend", str, "deepep"),
    on("--moe-per-layer-logging", refused=MOE_LOGGING),
    opt("--moe-expert-capacity-factor", float, None),
    on("--moe-pad-expert-input-to-capacity"),
    opt("--moe-token-drop-policy", str, "probs"),
    on("--moe-layer-recompute"),
    on("--moe-permute-fusion"),
    on("--moe-router-fusion"),
    on("--moe-apply-probs-on-input"),
    opt("--moe-latent-size", int, None, refused=MOE_LATENT),
    opt("--moe-deepep-num-sms", int, 20),
    opt("--moe-hybridep-num-sms", int, 16),
    on("--enable-cuda-graph", refused=DEPRECATED_ENABLE_CUDA_GRAPH),
    opt("--cuda-graph-warmup-steps", int, 3),
    on("--external-cuda-graph", refused=DEPRECATED_EXTERNAL_CUDA_GRAPH),
    opt("--cuda-graph-impl", str, "none"),
    off("--no-clone-scatter-output-in-embedding", "--disable-clone-scatter-output-in-embedding",
        dest="clone_scatter_output_in_embedding"),
    opt("--config-logger-dir", str, "", refused=CONFIG_LOGGER),
    on("--flash-decode", refused=INFERENCE),
    on("--batch-invariant-mode", refused=BATCH_INVARIANT),
    on("--use-te-activation-func", refused=ACTIVATION),
    opt("--symmetric-ar-type", str, None, refused=INFERENCE),
    on("--inference-fuse-tp-communication", refused=INFERENCE),
    opt("--mrope-section", int, None, nargs="+", refused=MROPE),
    on("--is-hybrid-model", refused=MAMBA),
    opt("--mamba-state-dim", int, 128, refused=MAMBA),
    opt("--mamba-head-dim", int, 64, refused=MAMBA),
    opt("--mamba-num-groups", int, 8, refused=MAMBA),
    opt("--mamba-num-heads", int, None, refused=MAMBA),
    off("--disable-mamba-mem-eff-path", dest="use_mamba_mem_eff_path", refused=MAMBA),
    opt("--mlp-chunks-for-prefill", int, 1, refused=INFERENCE),
    opt("--transformer-impl", str, "transformer_engine", refused_values={"inference_optimized": INFERENCE}),
    on("--fine-grained-activation-offloading", refused=OFFLOADING),
    opt("--offload-modules", str, [], nargs="+", refused=OFFLOADING),
    opt("--min-offloaded-tensor-size", int, 1048576, refused=OFFLOADING),
    opt("--encoder-num-layers", int, None, refused=ENCODER_DECODER),
    opt("--decoder-num-layers", int, None, refused=ENCODER_DECODER),
    on("--group-query-attention"),
    opt("--window-size", str, None, refused=SLIDING_WINDOW),
    opt("--window-attn-skip-freq", str, None, refused=SLIDING_WINDOW),
    opt("--max-position-embeddings", int, None),
    opt("--position-embedding-type", str, "learned_absolute",
        refused_values={"mrope": MROPE, "relative": RELATIVE_POSITIONS, "none": NO_POSITION_EMBEDDING}),
    opt("--relative-attention-num-buckets", int, 32, refused=RELATIVE_POSITIONS),
    opt("--relative-attention-max-distance", int, 128, refused=RELATIVE_POSITIONS),
    on("--use-rotary-position-embeddings", refused=DEPRECATED_ROTARY),
    opt("--rotary-base", int, 10000),
    opt("--rotary-percent", float, 1.0),
    opt("--rotary-seq-len-interpolation-factor", int, None, refused=GPT_MODEL_ROPE),
    on("--use-rope-scaling", refused=GPT_MODEL_ROPE),
    opt("--rope-scaling-factor", float, 8.0, refused=GPT_MODEL_ROPE),
    opt("--no-rope-freq", str, None, refused=GPT_MODEL_ROPE),
    off("--no-position-embedding", dest="add_position_embedding", refused=LEGACY_POSITION_EMBEDDING,
        unread_with=("position_embedding_type", "rope")),
    opt("--make-vocab-size-divisible-by", int, 128, refused=VOCAB_PADDING),
    on("--openai-gelu", refused=ACTIVATION),
    on("--squared-relu", refused=ACTIVATION),
    on("--swiglu"),
    on("--quick-geglu", refused=ACTIVATION),
    opt("--onnx-safe", str, None, refused=LEGACY_MODELS),
    off("--bert-no-binary-head", dest="bert_binary_head", refused=NOT_GPT),
    on("--untie-embeddings-and-output-weights"),
    opt("--weight-decay", float, 0.01),
    on("--apply-wd-to-qk-layernorm", refused=PARAM_GROUPS),
    opt("--clip-grad", float, 1.0),
    opt("--adam-beta1", float, 0.9),
    opt("--adam-beta2", float, 0.999),
    opt("--adam-eps", float, 1e-08),
    opt("--sgd-momentum", float, 0.9, refused=OPTIMIZER),
    opt("--muon-momentum", float, 0.9, refused=OPTIMIZER),
    off("--muon-no-split-qkv", dest="muon_split_qkv", refused=OPTIMIZER),
    on("--muon-use-nesterov", refused=OPTIMIZER),
    opt("--muon-scale-mode", str, "spectral", refused=OPTIMIZER),
    opt("--muon-fp32-matmul-prec", str, "medium", refused=OPTIMIZER),
    opt("--muon-num-ns-steps", int, 5, refused=OPTIMIZER),
    opt("--muon-tp-mode", str, "blockwise", refused=OPTIMIZER),
    opt("--muon-extra-scale-factor", float, 1.0, refused=OPTIMIZER),
    opt("--no-weight-decay-cond-type", str, None, refused=PARAM_GROUPS),
    on("--profile", refused=PROFILING),
    opt("--profile-step-start", int, 10, refused=PROFILING),
    opt("--profile-step-end", int, 12, refused=PROFILING),
    on("--use-pytorch-profiler", refused=PROFILING),
    opt("--profile-ranks", int, [0], nargs="+", refused=PROFILING),
    on("--record-memory-history", refused=PROFILING),
    opt("--memory-snapshot-path", str, "snapshot.pickle", refused=PROFILING),
    opt("--micro-batch-size", int, None),
    opt("--global-batch-size", int, None),
    opt("--rampup-batch-size", int, None, nargs=3),
    on("--decrease-batch-size-if-needed", refused=BATCH_ROUNDING),
    opt("--empty-unused-memory-level", int, 0, refused=LOOP_EXTRAS),
    opt("--check-weight-hash-across-dp-replicas-interval", int, None, refused=LOOP_EXTRAS),
    opt("--train-sync-interval", int, None, refused=LOOP_EXTRAS),
    opt("--train-iters", int, None),
    opt("--train-samples", int, None),
    opt("--exit-interval", int, None, refused=EARLY_EXIT),
    opt("--exit-duration-in-mins", int, None, refused=EARLY_EXIT),
    on("--exit-signal-handler", refused=EARLY_EXIT),
    opt("--exit-signal", signal_by_name, signal.SIGTERM, refused=EARLY_EXIT),
    on("--exit-signal-handler-for-dataloader", refused=EARLY_EXIT),
    on("--manual-gc", refused=LOOP_EXTRAS),
    opt("--manual-gc-interval", int, 0, refused=LOOP_EXTRAS),
    off("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval", refused=LOOP_EXTRAS),
    opt("--iterations-to-skip", int, [], nargs="+", refused=LOOP_EXTRAS),
    opt("--batch-size", int, None, refused=DEPRECATED_BATCH_SIZE),
    on("--recompute-activations"),
    off("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad"),
    on("--check-for-large-grads", refused=NAN_CHECK),
    opt("--result-rejected-tracker-filename", str, None, refused=RERUN_MACHINE),
    off("--disable-gloo-process-groups", dest="enable_gloo_process_groups", refused=PROCESS_GROUPS),
    opt("--tp-comm-overlap-cfg", str, None, refused=TP_OVERLAP),
    on("--checkpoint-activations", refused=REMOVED_CHECKPOINT_ACTIVATIONS),
    off("--no-masked-softmax-fusion", dest="masked_softmax_fusion"),
    off("--no-bias-gelu-fusion", dest="bias_gelu_fusion"),
    off("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion"),
    off("--no-bias-dropout-fusion", dest="bias_dropout_fusion"),
    off("--no-rope-fusion", dest="apply_rope_fusion"),
    opt("--rope-type", str, None, refused=MLA),
    on("--use-flash-attn", refused=DEPRECATED_FLASH_ATTN),
    opt("--optimizer", str, "adam", refused=OPTIMIZER),
    on("--optimizer-cpu-offload", refused=OPTIMIZER_OFFLOAD),
    opt("--optimizer-offload-fraction", float, 1.0, refused=OPTIMIZER_OFFLOAD),
    on("--use-torch-optimizer-for-cpu-offload", refused=OPTIMIZER_OFFLOAD),
    on("--overlap-cpu-optimizer-d2h-h2d", refused=OPTIMIZER_OFFLOAD),
    opt("--dump-param-to-param-group-map", str, None, refused=PARAM_GROUPS),
    off("--no-pin-cpu-grads", dest="pin_cpu_grads", refused=OPTIMIZER_OFFLOAD),
    off("--no-pin-cpu-params", dest="pin_cpu_params", refused=OPTIMIZER_OFFLOAD),
    opt("--dataloader-type", str, None, refused=DATA_LOADER),
    on("--no-persist-layer-norm", refused=FUSIONS, runs_as=True),
    off("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion"),
    on("--use-mcore-models", dest="deprecated_use_mcore_models", refused=DEPRECATED_MCORE_MODELS),
    on("--use-legacy-models", refused=LEGACY_MODELS),
    opt("--high-priority-stream-groups", str, [], nargs="*", refused=STREAM_PRIORITIES),
    on("--disable-jit-fuser", refused=TORCH_BACKEND),
    on("--perform-rl-step", refused=RL),
    opt("--rl-prompts-per-eval", int, 32, refused=RL),
    opt("--grpo-prompts-per-step", int, 32, refused=RL),
    opt("--grpo-group-size", int, 2, refused=RL),
    opt("--grpo-iterations", int, 2, refused=RL),
    opt("--grpo-clamp-eps-lower", float, 0.01, refused=RL),
    opt("--grpo-clamp-eps-upper", float, 0.01, refused=RL),
    opt("--grpo-kl-beta", float, 0.001, refused=RL),
    opt("--grpo-entropy-term-weight", float, 0.0, refused=RL),
    on("--grpo-filter-groups-with-same-reward", refused=RL),
    opt("--langrl-inference-server-type", str, "inplace_megatron", refused=RL),
    opt("--langrl-inference-server-conversation-template", str, None, refused=RL),
    both("--langrl-external-server", "--no-langrl-external-server", default=False, refused=RL),
    opt("--langrl-env-config", str, None, refused=RL),
    opt("--rl-default-temperature", float, 1.0, refused=RL),
    opt("--rl-default-top-p", float, 0, refused=RL),
    opt("--rl-default-top-k", int, -1, refused=RL),
    on("--rl-offload-optimizer-during-inference", refused=RL),
    both("--rl-offload-kv-cache-during-training", "--no-rl-offload-kv-cache-during-training",
         default=False, refused=RL),
    both("--rl-remove-kv-cache-during-training", "--no-rl-remove-kv-cache-during-training", default=False, refused=RL),
    both("--rl-reset-cuda-graphs", "--no-rl-reset-cuda-graphs", default=False, refused=RL),
    both("--rl-partial-rollouts", "--no-rl-partial-rollouts", default=False, refused=RL),
    both("--rl-inference-logprobs-is-correction", "--no-rl-inference-logprobs-is-correction",
         default=False, refused=RL),
    opt("--rl-importance-sampling-truncation-coef", float, None, refused=RL),
    both("--rl-use-sequence-packing", "--no-rl-use-sequence-packing", default=False, refused=RL),
    opt("--rl-sequence-packing-max-sequences-per-bin", int, 50, refused=RL),
    opt("--rl-sequence-packing-algo", str, "fifo", refused=RL),
    both("--rl-training-cuda-graphs", "--no-rl-training-cuda-graphs", default=False, refused=RL),
    opt("--rl-inference-tensor-model-parallel-size", int, None, refused=RL),
    opt("--rl-inference-pipeline-model-parallel-size", int, None, refused=RL),
    opt("--rl-inference-expert-model-parallel-size", int, None, refused=RL),
    opt("--rl-inference-expert-tensor-model-parallel-size", int, None, refused=RL),
    opt("--rl-inference-model-unified-memory-level", int, 0, refused=RL),
    both("--rl-offload-inference-model-weights-when-idle", "--no-rl-offload-inference-model-weights-when-idle",
         default=False, refused=RL),
    opt("--refit-method", str, "gloo", refused=RL),
    both("--rl-verify-model-weights-swap", "--no-rl-verify-model-weights-swap", default=False, refused=RL),
    opt("--rl-parallel-generation-tasks", int, 512, refused=RL),
    both("--rl-skip-bos-token", "--no-rl-skip-bos-token", default=False, refused=RL),
    opt("--seed", int, 1234),
    on("--te-rng-tracker", refused=RNG_TRACKERS),
    on("--inference-rng-tracker", refused=RNG_TRACKERS),
    on("--data-parallel-random-init", refused=INITIALIZATION),
    on("--init-method-xavier-uniform", refused=INITIALIZATION),
    opt("--lr-decay-style", str, "linear", refused_values={"WSD": WSD}),
    opt("--lr-wsd-decay-style", str, "exponential", refused=WSD),
    opt("--lr-decay-iters", int, None),
    opt("--lr-decay-samples", int, None),
    opt("--lr-wsd-decay-iters", int, None, refused=WSD),
    opt("--lr-wsd-decay-samples", int, None, refused=WSD),
    opt("--lr-warmup-fraction", float, None),
    opt("--lr-warmup-iters", int, 0),
    opt("--lr-warmup-samples", int, 0),
    opt("--lr-warmup-init", float, 0.0, refused=LR_SCHEDULE),
    on("--override-opt_param-scheduler", "--override-opt-param-scheduler", refused=LR_SCHEDULE),
    on("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", refused=LR_SCHEDULE),
    opt("--start-weight-decay", float, None, refused=WEIGHT_DECAY_SCHEDULE),
    opt("--end-weight-decay", float, None, refused=WEIGHT_DECAY_SCHEDULE),
    opt("--weight-decay-incr-style", str, "constant", refused=WEIGHT_DECAY_SCHEDULE),
    opt("--lr", float, None),
    opt("--warmup", int, None, refused=DEPRECATED_WARMUP),
    opt("--min-lr", float, 0.0),
    opt("--decoupled-lr", float, None, refused=PARAM_GROUPS),
    opt("--decoupled-min-lr", float, None, refused=PARAM_GROUPS),
    opt("--save", str, None),
    opt("--save-interval", "--persistent-save-interval", int, None, only_with="save"),
    opt("--save-wgrads-interval", int, None, refused=GRADIENT_DUMPS),
    opt("--save-dgrads-interval", int, None, refused=GRADIENT_DUMPS),
    opt("--save-retain-interval", int, None, refused=CHECKPOINT_EXTRAS),
    opt("--load", str, None),
    on("--load-main-params-from-ckpt"),
    opt("--non-persistent-save-interval", int, None, refused=CHECKPOINT_EXTRAS),
    opt("--non-persistent-ckpt-type", str, None, refused=CHECKPOINT_EXTRAS),
    opt("--non-persistent-global-ckpt-dir", str, None, refused=CHECKPOINT_EXTRAS),
    opt("--non-persistent-local-ckpt-dir", str, None, refused=CHECKPOINT_EXTRAS),
    opt("--non-persistent-local-ckpt-algo", str, "fully_parallel", refused=CHECKPOINT_EXTRAS),
    on("--finetune", refused=FINETUNE),
    opt("--pretrained-checkpoint", str, None, refused=FINETUNE),
    opt("--ckpt-step", int, None, refused=CHECKPOINT_EXTRAS),
    on("--use-checkpoint-args"),
    on("--use-mp-args-from-checkpoint-args", refused=CHECKPOINT_ARGS),
    off("--no-use-tokenizer-model-from-checkpoint-args", "--disable-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args", refused=TOKENIZERS),
    on("--exit-on-missing-checkpoint", only_with="load"),
    opt("--ckpt-format", str, "torch_dist", refused=CHECKPOINT_FORMAT),
    on("--auto-detect-ckpt-format", refused=CHECKPOINT_FORMAT),
    opt("--ckpt-convert-format", str, None, refused=CHECKPOINT_FORMAT),
    opt("--ckpt-convert-save", str, None, refused=CHECKPOINT_FORMAT),
    on("--ckpt-convert-update-legacy-dist-opt-format", refused=CHECKPOINT_FORMAT),
    off("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
        dest="ckpt_fully_parallel_save", refused=CHECKPOINT_STRATEGY, runs_as=False),
    on("--async-save", refused=CHECKPOINT_STRATEGY),
    on("--use-persistent-ckpt-worker", refused=CHECKPOINT_STRATEGY),
    on("--ckpt-fully-parallel-load", refused=CHECKPOINT_STRATEGY),
    on("--ckpt-assume-constant-structure", refused=CHECKPOINT_STRATEGY),
    off("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load",
        dest="strict_fsdp_dtensor_load", refused=FSDP),
    opt("--dist-ckpt-strictness", str, "assume_ok_unexpected", refused=CHECKPOINT_STRATEGY),
    on("--dist-ckpt-save-pre-mcore-014", refused=CHECKPOINT_FORMAT),
    on("--dist-ckpt-optim-fully-reshardable"),
    on("--distrib-optim-fully-reshardable-mem-efficient", refused=CHECKPOINT_STRATEGY),
    on("--replication", refused=CHECKPOINT_EXTRAS),
    opt("--replication-jump", int, None, refused=CHECKPOINT_EXTRAS),
    opt("--replication-factor", int, 2, refused=CHECKPOINT_EXTRAS),
    on("--no-save-optim", default=None, refused=SAVES_OPTIMIZER),
    on("--no-save-rng", default=None, refused=NO_RNG_STATE, runs_as=True),
    on("--no-load-optim", default=None),
    on("--no-load-rng", default=None, refused=NO_RNG_STATE, runs_as=True),
    on("--use-dist-ckpt", dest="use_dist_ckpt_deprecated", refused=DEPRECATED_DIST_CKPT),
    opt("--dist-ckpt-format", str, None, dest="dist_ckpt_format_deprecated", refused=DEPRECATED_DIST_CKPT),
    on("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated", refused=DEPRECATED_DIST_CKPT),
    on("--grad-reduce-in-bf16", refused=FP32_GRADIENTS, runs_as=False),
    opt("--loss-scale", float, None, refused=FP16),
    opt("--initial-loss-scale", float, 4294967296, refused=FP16),
    opt("--min-loss-scale", float, 1.0, refused=FP16),
    opt("--loss-scale-window", float, 1000, refused=FP16),
    opt("--hysteresis", int, 2, refused=FP16),
    on("--attention-softmax-in-fp32"),
    on("--accumulate-allreduce-grads-in-fp32", no_effect=FP32_GRADIENTS_ALWAYS, runs_as=True),
    on("--fp16-lm-cross-entropy", refused=FP16),
    on("--reuse-grad-buf-for-mxfp8-param-ag", refused=FP8_PARAMS),
    opt("--decoder-first-pipeline-num-layers", int, None, refused=VIRTUAL_PIPELINE),
    opt("--decoder-last-pipeline-num-layers", int, None, refused=VIRTUAL_PIPELINE),
    opt("--pipeline-model-parallel-layout", str, None, refused=VIRTUAL_PIPELINE),
    opt("--model-parallel-size", int, None, refused=DEPRECATED_MODEL_PARALLEL_SIZE),
    opt("--num-layers-per-virtual-pipeline-stage", int, None, refused=VIRTUAL_PIPELINE),
    opt("--num-virtual-stages-per-pipeline-rank", int, None, refused=VIRTUAL_PIPELINE),
    off("--no-overlap-p2p-communication", dest="overlap_p2p_comm", refused=VIRTUAL_PIPELINE, runs_as=False),
    opt("--distributed-backend", str, "nccl", refused=PROCESS_GROUPS),
    opt("--distributed-timeout-minutes", int, 10, refused=PROCESS_GROUPS),
    opt("--distributed-timeout-seconds-after-init", int, None, refused=PROCESS_GROUPS),
    on("--overlap-grad-reduce"),
    off("--no-align-grad-reduce", dest="align_grad_reduce", refused=DDP_TUNING),
    opt("--ddp-num-buckets", int, None, refused=DDP_TUNING),
    opt("--ddp-bucket-size", int, None, refused=DDP_TUNING),
    on("--ddp-pad-buckets-for-high-nccl-busbw", refused=DDP_TUNING),
    on("--ddp-reduce-scatter-with-fp32-accumulation", refused=DDP_TUNING),
    on("--ddp-average-in-collective", refused=DDP_TUNING),
    on("--overlap-param-gather", refused=PARAM_GATHER_OVERLAP),
    on("--overlap-param-gather-with-optimizer-step", refused=PARAM_GATHER_OVERLAP),
    off("--no-align-param-gather", dest="align_param_gather", refused=PARAM_GATHER_OVERLAP,
        only_with="overlap_param_gather"),
    off("--no-scatter-gather-tensors-in-pipeline", dest="scatter_gather_tensors_in_pipeline", refused=LEGACY_MODELS),
    opt("--local-rank", int, 0, refused=LAUNCHER_RANK, runs_as=FromEnv("LOCAL_RANK", 0)),
    opt("--lazy-mpu-init", str, None, refused=PROCESS_GROUPS),
    on("--use-distributed-optimizer"),
    on("--use-nccl-ub", dest="nccl_ub", refused=NCCL_TUNING),
    on("--disable-symmetric-registration", refused=NCCL_TUNING),
    on("--fsdp-manual-registration", refused=FSDP),
    on("--use-sharp", refused=NCCL_TUNING),
    opt("--sharp-enabled-group", str, None, refused=NCCL_TUNING),
    on("--create-all-gather-group", refused=NCCL_TUNING),
    on("--use-megatron-fsdp", refused=FSDP),
    opt("--data-parallel-sharding-strategy", str, "no_shard", refused=FSDP),
    opt("--outer-dp-sharding-strategy", str, "no_shard", refused=FSDP),
    off("--no-gradient-reduce-div-fusion", dest="gradient_reduce_div_fusion", refused=FSDP),
    on("--fsdp-double-buffer", refused=FSDP),
    opt("--suggested-communication-unit-size", int, None, refused=FSDP),
    on("--keep-fp8-transpose-cache", refused=FSDP),
    on("--enable-full-sharding-in-hsdp", refused=FSDP),
    opt("--num-distributed-optimizer-instances", int, 1, refused=DDP_TUNING),
    on("--use-torch-fsdp2", refused=FSDP),
    off("--torch-fsdp2-no-reshard-after-forward", dest="torch_fsdp2_reshard_after_forward", refused=FSDP),
    opt("--cp-comm-type", str, ["p2p"], nargs="+", refused=CONTEXT_PARALLEL),
    opt("--nccl-communicator-config-path", str, None, refused=NCCL_TUNING),
    on("--use-tp-pp-dp-mapping", refused=PROCESS_GROUPS),
    on("--fake-process-group", refused=PROCESS_GROUPS),
    opt("--eval-iters", int, 100),
    opt("--eval-interval", int, None),
    on("--skip-train", refused=EVALUATION),
    on("--test-mode", refused=EVALUATION),
    on("--full-validation", refused=EVALUATION),
    on("--multiple-validation-sets", refused=EVALUATION),
    opt("--data-path", str, None, nargs="*"),
    opt("--phase-transition-iterations", str, None, refused=DATA_SOURCES),
    opt("--split", str, None),
    opt("--train-data-path", str, None, nargs="*", refused=DATA_SOURCES),
    opt("--valid-data-path", str, None, nargs="*", refused=DATA_SOURCES),
    opt("--test-data-path", str, None, nargs="*", refused=DATA_SOURCES),
    opt("--data-args-path", str, None, refused=DATA_SOURCES),
    opt("--per-split-data-args-path", str, None, refused=DATA_SOURCES),
    opt("--per-dataset-sequences-path", str, None, refused=DATA_SOURCES),
    on("--dataloader-fast-cache-load", refused=DATA_LOADER),
    on("--dataloader-defer-npy-index-mmap", refused=DATA_LOADER),
    opt("--data-cache-path", str, None),
    off("--no-mmap-bin-files", dest="mmap_bin_files", refused=DATA_LOADER),
    on("--mock-data"),
    opt("--seq-length", int, None),
    opt("--encoder-seq-length", int, None, refused=ENCODER_DECODER),
    opt("--decoder-seq-length", int, None, refused=ENCODER_DECODER),
    opt("--sample-rate", float, 1.0, refused=NOT_GPT),
    opt("--mask-prob", float, 0.15, refused=NOT_GPT),
    opt("--short-seq-prob", float, 0.1, refused=NOT_GPT),
    opt("--num-workers", int, 2, no_effect=NO_WORKERS, runs_as=0),
    on("--reset-position-ids", refused=SAMPLE_MASKS),
    on("--reset-attention-mask", refused=SAMPLE_MASKS),
    on("--eod-mask-loss", refused=SAMPLE_MASKS),
    off("--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask_in_dataloader", refused=SAMPLE_MASKS, runs_as=False),
    opt("--num-dataset-builder-threads", int, 1, refused=DATA_LOADER),
    opt("--object-storage-cache-path", str, None, refused=DATA_SOURCES),
    opt("--mid-level-dataset-surplus", float, 0.005, refused=DATA_LOADER),
    on("--allow-ambiguous-pad-tokens", refused=SAMPLE_MASKS),
    on("--fim-data", refused=FIM),
    opt("--fim-rate", float, 0.5, refused=FIM),
    opt("--fim-spm-rate", float, 0.5, refused=FIM),
    opt("--fim-split-sample", str, None, refused=FIM),
    opt("--fim-fragment-rate", float, None, refused=FIM),
    opt("--fim-no-prefix", str, None, refused=FIM),
    opt("--fim-prefix-token", str, "<fim_prefix>", refused=FIM),
    opt("--fim-middle-token", str, "<fim_middle>", refused=FIM),
    opt("--fim-suffix-token", str, "<fim_suffix>", refused=FIM),
    opt("--fim-pad-token", str, "<fim_pad>", refused=FIM),
    opt("--fim-eod-token", str, "<|endoftext|>", refused=FIM),
    opt("--vocab-size", int, None),
    opt("--padded-vocab-size", int, None, refused=VOCAB_PADDING),
    opt("--vocab-file", str, None, refused=TOKENIZERS),
    opt("--merge-file", str, None, refused=TOKENIZERS),
    opt("--vocab-extra-ids", int, 0, refused=TOKENIZERS),
    opt("--tokenizer-type", str, None,
        refused_values={name: TOKENIZERS for name in TOKENIZER_TYPES if name != NULL_TOKENIZER}),
    opt("--tokenizer-model", str, None, refused=TOKENIZERS),
    opt("--tokenizer-metadata", str, None, refused=TOKENIZERS),
    opt("--tokenizer-special-tokens", str, None, nargs="+", refused=TOKENIZERS),
    on("--legacy-tokenizer", refused=TOKENIZERS),
    opt("--tiktoken-pattern", str, None, refused=TOKENIZERS),
    opt("--tiktoken-num-special-tokens", int, 1000, refused=TOKENIZERS),
    opt("--tiktoken-special-tokens", str, None, nargs="+", refused=TOKENIZERS),
    on("--tokenizer-sentencepiece-legacy", refused=TOKENIZERS),
    on("--tokenizer-hf-use-fast", refused=TOKENIZERS),
    on("--tokenizer-hf-include-special-tokens", refused=TOKENIZERS),
    on("--trust-remote-code", refused=TOKENIZERS),
    on("--adlr-autoresume", refused=AUTORESUME),
    opt("--adlr-autoresume-interval", int, 1000, refused=AUTORESUME),
    opt("--ict-head-size", int, None, refused=NOT_GPT),
    opt("--biencoder-projection-dim", int, 0, refused=NOT_GPT),
    on("--biencoder-shared-query-context-model", refused=NOT_GPT),
    opt("--ict-load", str, None, refused=NOT_GPT),
    opt("--bert-load", str, None, refused=NOT_GPT),
    opt("--titles-data-path", str, None, refused=NOT_GPT),
    opt("--query-in-block-prob", float, 0.1, refused=NOT_GPT),
    on("--use-one-sent-docs", refused=NOT_GPT),
    opt("--evidence-data-path", str, None, refused=NOT_GPT),
    opt("--retriever-report-topk-accuracies", int, [], nargs="+", refused=NOT_GPT),
    on("--retriever-score-scaling", refused=NOT_GPT),
    opt("--block-data-path", str, None, refused=NOT_GPT),
    opt("--embedding-path", str, None, refused=NOT_GPT),
    opt("--indexer-batch-size", int, 128, refused=NOT_GPT),
    opt("--indexer-log-interval", int, 1000, refused=NOT_GPT),
    opt("--num-classes", int, 1000, refused=NOT_GPT),
    opt("--img-h", int, 224, refused=NOT_GPT),
    opt("--img-w", int, 224, refused=NOT_GPT),
    opt("--num-channels", int, 3, refused=NOT_GPT),
    opt("--patch-dim", int, 16, refused=NOT_GPT),
    opt("--classes-fraction", float, 1.0, refused=NOT_GPT),
    opt("--data-per-class-fraction", float, 1.0, refused=NOT_GPT),
    off("--no-data-sharding", dest="data_sharding", refused=NOT_GPT),
    opt("--head-lr-mult", float, 1.0, refused=NOT_GPT),
    on("--vision-pretraining", refused=NOT_GPT),
    opt("--vision-pretraining-type", str, "classify", refused=NOT_GPT),
    opt("--vision-backbone-type", str, "vit", refused=NOT_GPT),
    opt("--swin-backbone-type", str, "tiny", refused=NOT_GPT),
    opt("--mask-type", str, "random", refused=NOT_GPT),
    opt("--mask-factor", float, 1.0, refused=NOT_GPT),
    opt("--iter-per-epoch", int, 1250, refused=NOT_GPT),
    opt("--dino-local-img-size", int, 96, refused=NOT_GPT),
    opt("--dino-local-crops-number", int, 10, refused=NOT_GPT),
    opt("--dino-head-hidden-size", int, 2048, refused=NOT_GPT),
    opt("--dino-bottleneck-size", int, 256, refused=NOT_GPT),
    opt("--dino-freeze-last-layer", float, 1, refused=NOT_GPT),
    on("--dino-norm-last-layer", refused=NOT_GPT),
    opt("--dino-warmup-teacher-temp", float, 0.04, refused=NOT_GPT),
    opt("--dino-teacher-temp", float, 0.07, refused=NOT_GPT),
    opt("--dino-warmup-teacher-temp-epochs", int, 30, refused=NOT_GPT),
    opt("--num-experts", int, None),
    opt("--moe-layer-freq", number_or_text, 1, refused=MOE_LAYER_FREQ),
    on("--moe-use-upcycling", refused=UPCYCLING),
    opt("--moe-router-load-balancing-type", str, "aux_loss", nargs="+"),
    opt("--moe-aux-loss-coeff", float, 0.0, nargs="+"),
    opt("--moe-upcycling-granularity", int, 1, refused=UPCYCLING),
    on("--moe-pad-experts-for-cuda-graph-inference", refused=INFERENCE),
    opt("--q-lora-rank", int, None, refused=MLA),
    opt("--kv-lora-rank", int, 32, refused=MLA),
    opt("--qk-head-dim", int, 128, refused=MLA),
    opt("--qk-pos-emb-head-dim", int, 64, refused=MLA),
    opt("--v-head-dim", int, 128, refused=MLA),
    opt("--rotary-scaling-factor", float, 1.0, refused=MLA),
    opt("--mscale", float, 1.0, refused=MLA),
    opt("--mscale-all-dim", float, 0.0, refused=MLA),
    on("--cache-mla-latents", refused=MLA),
    opt("--linear-attention-freq", str, None, refused=ATTENTION_VARIANT),
    opt("--heterogeneous-layers-config-path", str, None, refused=HETEROGENEOUS),
    opt("--heterogeneous-layers-config-encoded-json", str, None, refused=HETEROGENEOUS),
    opt("--log-interval", int, 100),
    on("--log-params-norm"),
    on("--log-throughput", runs_as=True),
    on("--log-progress", refused=LOGGED_EXTRAS),
    opt("--timing-log-level", int, 0, refused_values={2: TIMING_LEVEL_2}),
    opt("--timing-log-option", str, "minmax", refused=TIMERS),
    opt("--tensorboard-dir", str, None),
    opt("--tensorboard-log-interval", int, 1, refused=TENSORBOARD_INTERVAL, runs_as=NOT_OFFERED, only_with="tensorboard_dir"),
    opt("--tensorboard-queue-size", int, 1000, refused=TENSORBOARD_WRITER, only_with="tensorboard_dir"),
    on("--log-timers-to-tensorboard", refused=ALWAYS_LOGGED, runs_as=True, only_with="tensorboard_dir"),
    off("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard", refused=NO_LOSS_SCALE, runs_as=False, only_with="tensorboard_dir"),
    on("--log-validation-ppl-to-tensorboard", refused=VALIDATION_PPL, only_with="tensorboard_dir"),
    on("--log-memory-to-tensorboard", refused=ALWAYS_LOGGED, runs_as=True, only_with="tensorboard_dir"),
    opt("--log-memory-interval", int, None, refused=LOGGED_EXTRAS),
    on("--log-device-memory-used", refused=LOGGED_EXTRAS),
    on("--log-num-zeros-in-grad"),
    on("--log-max-attention-logit", refused=LOGGED_EXTRAS),
    off("--no-barrier-with-level-1-timing", dest="barrier_with_L1_time", refused=TIMERS),
    on("--log-world-size-to-tensorboard", refused=LOGGED_EXTRAS, only_with="tensorboard_dir"),
    opt("--wandb-project", str, None, refused=WANDB, also_accepts=("",)),  # '': Megatron-LM's "no W&B"
    opt("--wandb-exp-name", str, None, refused=WANDB, only_with="wandb_project"),
    opt("--wandb-save-dir", str, None, refused=WANDB, only_with="wandb_project"),
    opt("--wandb-entity", str, None, refused=WANDB, only_with="wandb_project"),
    opt("--logging-level", int, None, refused=LOGGED_EXTRAS),
    on("--log-energy", refused=LOGGED_EXTRAS),
    on("--log-straggler", refused=STRAGGLERS),
    opt("--straggler-ctrlr-port", int, 65535, refused=STRAGGLERS),
    opt("--straggler-minmax-count", int, 1, refused=STRAGGLERS),
    on("--disable-straggler-on-startup", refused=STRAGGLERS),
    on("--run-workload-inspector-server", refused=STRAGGLERS),
    opt("--inference-batch-times-seqlen-threshold", int, -1, refused=INFERENCE),
    opt("--max-tokens-to-oom", int, 12000, refused=INFERENCE),
    on("--output-bert-embeddings", refused=NOT_GPT),
    opt("--bert-embedder-type", str, "megatron", refused=NOT_GPT),
    opt("--cuda-graph-scope", str, [], nargs="+"),
    on("--use-legacy-static-engine", refused=INFERENCE),
    opt("--inference-max-requests", int, 8, dest="inference_max_batch_size", refused=INFERENCE),
    opt("--inference-max-seq-length", int, 2560, refused=INFERENCE),
    # shares its dest with --inference-max-requests, whose default Megatron-LM's namespace holds
    opt("--inference-max-batch-size", int, None, refused=INFERENCE, runs_as=8),
    on("--inference-dynamic-batching", refused=INFERENCE),
    opt("--inference-dynamic-batching-buffer-size-gb", float, 40.0, refused=INFERENCE),
    opt("--inference-dynamic-batching-paused-buffer-size-gb", float, None, refused=INFERENCE),
    opt("--inference-dynamic-batching-block-size", int, 256, refused=INFERENCE),
    opt("--inference-dynamic-batching-max-requests", int, None, refused=INFERENCE),
    opt("--inference-dynamic-batching-max-tokens", int, None, refused=INFERENCE),
    opt("--inference-dynamic-batching-num-cuda-graphs", int, 16, refused=INFERENCE),
    on("--inference-dynamic-batching-track-paused-request-events", refused=INFERENCE),
    on("--decode-only-cuda-graphs", refused=INFERENCE),
    opt("--inference-dynamic-batching-unified-memory-level", int, 0, refused=INFERENCE),
    on("--nccl-all-reduce-for-prefill", refused=INFERENCE),
    off("--enable-chunked-prefill", dest="disable_chunked_prefill", refused=INFERENCE),
    on("--disable-chunked-prefill", refused=INFERENCE, runs_as=True),
    opt("--inference-dynamic-batching-cuda-graph-max-tokens", int, 16384, refused=INFERENCE),
    opt("--inference-dynamic-batching-cuda-graph-mixed-prefill-count", int, 16, refused=INFERENCE),
    opt("--inference-logging-step-interval", int, 0, refused=INFERENCE),
    both("--inference-wandb-logging", "--no-inference-wandb-logging", default=False, refused=INFERENCE),
    opt("--inference-coordinator-port", int, 12346, refused=INFERENCE),
    on("--fp8-param-gather", refused=FP8_PARAMS),
    opt("--te-precision-config-file", str, None, refused=QUANTIZATION_RECIPES),
    on("--enable-experimental", refused=EXPERIMENTAL),
    opt("--spec", str, None, nargs="*", refused=LAYER_SPEC),
    opt("--hybrid-attention-ratio", float, 0.0, refused=MAMBA),
    opt("--hybrid-mlp-ratio", float, 0.0, refused=MAMBA),
    opt("--hybrid-override-pattern", str, None, refused=MAMBA),
    opt("--yaml-cfg", str, None),
    on("--use-precision-aware-optimizer", refused=PRECISION_AWARE_OPTIMIZER),
    opt("--main-grads-dtype", str, "fp32", refused=PRECISION_AWARE_OPTIMIZER),
    opt("--main-params-dtype", str, "fp32", refused=PRECISION_AWARE_OPTIMIZER),
    opt("--exp-avg-dtype", str, "fp32", refused=PRECISION_AWARE_OPTIMIZER),
    opt("--exp-avg-sq-dtype", str, "fp32", refused=PRECISION_AWARE_OPTIMIZER),
    off("--no-one-logger", dest="enable_one_logger", no_effect=ONE_LOGGER_NOT_RUN, runs_as=False),
    opt("--one-logger-project", str, "megatron-lm", refused=ONE_LOGGER),
    opt("--one-logger-run-name", str, None, refused=ONE_LOGGER),
    on("--one-logger-async", refused=ONE_LOGGER),
    opt("--app-tag-run-name", str, None, refused=ONE_LOGGER),
    opt("--app-tag-run-version", str, "0.0.0", refused=ONE_LOGGER),
    on("--inprocess-restart", refused=RESTARTS),
    opt("--inprocess-max-iterations", int, None, refused=RESTARTS),
    opt("--inprocess-monitor-thread-interval", float, 1.0, refused=RESTARTS),
    opt("--inprocess-monitor-process-interval", float, 1.0, refused=RESTARTS),
    opt("--inprocess-progress-watchdog-interval", float, 1.0, refused=RESTARTS),
    opt("--inprocess-heartbeat-interval", float, 30, refused=RESTARTS),
    opt("--inprocess-soft-timeout", float, 60, refused=RESTARTS),
    opt("--inprocess-hard-timeout", float, 90, refused=RESTARTS),
    opt("--inprocess-heartbeat-timeout", float, 60, refused=RESTARTS),
    opt("--inprocess-barrier-timeout", float, 120, refused=RESTARTS),
    opt("--inprocess-completion-timeout", float, 120, refused=RESTARTS),
    opt("--inprocess-last-call-wait", float, 1, refused=RESTARTS),
    opt("--inprocess-termination-grace-time", float, 1, refused=RESTARTS),
    opt("--inprocess-granularity", str, "node", refused=RESTARTS),
    opt("--inprocess-active-world-size", int, 1, refused=RESTARTS, runs_as=FromEnv("WORLD_SIZE", 1)),
    on("--inprocess-empty-cuda-cache", refused=RESTARTS),
    on("--enable-ft-package", refused=RESTARTS),
    on("--calc-ft-timeouts", refused=RESTARTS),
    opt("--ft-num-warmup-iters", int, 5, refused=RESTARTS),
    opt("--error-injection-rate", int, 0, refused=RERUN_MACHINE),
    opt("--error-injection-type", str, "transient_error", refused=RERUN_MACHINE),
    opt("--rerun-mode", str, "validate_results", refused=RERUN_MACHINE, runs_as="disabled"),
    on("--check-for-spiky-loss", refused=RERUN_MACHINE),
    off("--disable-msc", dest="enable_msc", refused=OBJECT_STORAGE, runs_as=False),
    on("--sft", refused=NOT_GPT),
    opt("--sft-tokenizer-prompt-format", str, "nemotron-h-aligned", refused=NOT_GPT),
)

# megatron-core config fields that Megatron-LM's YAML sections may set but no flag sets, whose
# every value changes nothing on this driver's runs: field -> why (a recipe's value is accepted).
NO_EFFECT_FIELDS: Dict[str, str] = {
    "tp_comm_atomic_ag": TP_OVERLAP_ONLY,
    "tp_comm_atomic_rs": TP_OVERLAP_ONLY,
}

# Top-level keys of Megatron-LM's example configs that no flag of Megatron-LM 0.16.1 defines (its
# YAML reader sets every key as an attribute, read or not): key -> (the value that asks for
# nothing, accepted with a note; why any other is refused).
UNFLAGGED_KEYS: Dict[str, Tuple[Any, str]] = {
    "standalone_embedding_stage": (False, STANDALONE_EMBEDDING_STAGE),
}

_BY_DEST: Dict[str, List[MegatronLMFlag]] = {}
for _row in FLAGS:
    _BY_DEST.setdefault(_row.dest, []).append(_row)
BY_NAME: Dict[str, MegatronLMFlag] = {name: row for row in FLAGS for name in row.names}


def supported_flags() -> List[MegatronLMFlag]:
    return [row for row in FLAGS if row.refused is None and row.no_effect is None]


def refused_flags() -> List[MegatronLMFlag]:
    return [row for row in FLAGS if row.refused is not None]


def no_effect_flags() -> List[MegatronLMFlag]:
    return [row for row in FLAGS if row.no_effect is not None]


def _unread_flags() -> List[MegatronLMFlag]:
    """The flags this driver takes without reading them: refused ones and ones that change nothing."""
    return [row for row in FLAGS if row.refused is not None or row.no_effect is not None]


def _argparse_kwargs(row: MegatronLMFlag) -> dict:
    kwargs = dict(dest=row.dest, default=row.parser_default, help=argparse.SUPPRESS)
    if row.action == "boolean_optional":
        return dict(kwargs, action=argparse.BooleanOptionalAction)
    if row.action != "store":
        return dict(kwargs, action=row.action)
    return dict(kwargs, type=row.type, nargs=row.nargs)


def add_refused_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` every refused flag, and every flag that changes nothing here, with
    Megatron-LM's syntax (left out of ``--help``; the table says why). Its default is the
    value this driver runs with."""
    for row in _unread_flags():
        # argparse makes the --no- spelling of a BooleanOptionalAction from the first name
        names = row.names[:1] if row.action == "boolean_optional" else row.names
        parser.add_argument(*names, **_argparse_kwargs(row))
    return parser


def _unread_because(row: MegatronLMFlag, args: argparse.Namespace) -> Optional[str]:
    """Where Megatron-LM reads no value of ``row``'s flag on this run (``only_with``,
    ``unread_with``): the setting that makes it so, in words; else None."""
    if row.only_with is not None and not getattr(args, row.only_with, None):
        return f"without {_BY_DEST[row.only_with][0].name}"
    if row.unread_with is not None and getattr(args, row.unread_with[0], None) == row.unread_with[1]:
        return f"with {_BY_DEST[row.unread_with[0]][0].name} {row.unread_with[1]}"
    return None


def _refusal(row: MegatronLMFlag, value: Any) -> Optional[Tuple[str, str]]:
    """(the refused value as shown, or "" for the flag itself; why) where this driver does
    not run ``value`` for ``row``'s flag, else None."""
    if row.no_effect is not None or value in row.also_accepts:
        return None
    if row.refused is not None:
        accepted = row.accepted
        return ("", row.refused) if accepted is NOT_OFFERED or value != accepted else None
    for item in value if isinstance(value, list) else [value]:
        if item in row.refused_values:
            return (f" {item}", row.refused_values[item])
    return None


def all_refusals(args: argparse.Namespace, given: Iterable[Tuple[str, str]]) -> List[str]:
    """The error for each of the ``given`` settings (dest, how the user gave it: the flag, or
    a recipe's file, line and key) that this driver refuses, in the order given; a dest given
    more than once (on the command line and in the recipe) is judged once, where it comes first
    (the value ``args`` holds is the command line's)."""
    errors, judged = [], set()
    for dest, label in given:
        if dest in judged:
            continue
        judged.add(dest)
        for row in _BY_DEST.get(dest, ()):
            if _unread_because(row, args):
                continue  # Megatron-LM reads no value of it on this run
            refused = _refusal(row, getattr(args, dest))
            if refused:
                shown, why = refused
                errors.append(f"{label}{shown}: {why}")
                break
    return errors


def no_effect_notes(args: argparse.Namespace, given: Iterable[Tuple[str, str]]) -> List[str]:
    """One line for each of the ``given`` settings of a flag that changes nothing here (a
    ``no_effect`` flag; a supported one that Megatron-LM does not read on this run), where its
    value differs from what this driver does anyway: the value, and why it changes nothing."""
    notes, judged = [], set()
    for dest, label in given:
        for row in _BY_DEST.get(dest, ()) if dest not in judged else ():
            value = getattr(args, dest)
            if row.refused is not None or (row.no_effect is None and row.only_with is None) or value == row.accepted:
                continue  # row.accepted last: --attention-backend's imports megatron-core
            if row.no_effect is not None:
                notes.append(f"{label} {value}: changes nothing here: {row.no_effect}")
            elif _unread_because(row, args):  # a supported flag without the setting it needs
                flag = _BY_DEST[row.only_with][0].name
                notes.append(f"{label} {value}: changes nothing without {flag}, as in Megatron-LM: drop it, or "
                             f"give {flag}")
        judged.add(dest)
    return notes


def first_refusal(args: argparse.Namespace, given: Iterable[Tuple[str, str]]) -> Optional[str]:
    """The first of ``all_refusals``, else None."""
    refusals = all_refusals(args, given)
    return refusals[0] if refusals else None


def drop_refused(args: argparse.Namespace) -> None:
    """Take the refused flags out of ``args`` once they passed ``all_refusals``: each holds
    the value this driver runs with anyway, and the args (saved in checkpoints) keep to the
    settings the driver reads. So are the flags that change nothing here."""
    for row in _unread_flags():
        args.__dict__.pop(row.dest, None)
