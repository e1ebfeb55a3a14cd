"""Megatron-LM 0.16.1's command-line flags, and what this driver does with each.

``FLAGS`` has one row for every flag that Megatron-LM core_v0.16.1's
``megatron/training/arguments.py`` defines, in that file's order, read from the data file
``megatron_lm_flags.jsonl`` beside this module (one JSON object a flag): the option strings, the
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
import json
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
# megatron_lm_flags.jsonl, one JSON object a flag, with the fields of MegatronLMFlag: "flag"
# (the first name) and "aliases"; "action" where not "store"; "type" by name (_TYPES);
# "default" where not the action's own (None, false for store_true, true for store_false; a
# boolean_optional row always gives it); "dest" where not the first name's; the status
# fields, each reason by its name above; "comment": a note for the reader, not read.
# Special values are objects: {"env": VARIABLE, "fallback": n} (FromEnv),
# {"attention_backend": member} (AttnBackendName), {"signal": name} (signal.Signals),
# {"not_offered": true} (NOT_OFFERED).

_TYPES = {kind.__name__: kind for kind in (int, float, str, attention_backend, signal_by_name, number_or_text)}
_ACTION_DEFAULTS = {"store": None, "store_true": False, "store_false": True, "boolean_optional": None}
_LIST_FIELDS = ("aliases", "also_accepts", "unread_with")
_ROW_KEYS = {"flag", "aliases", "action", "type", "default", "nargs", "dest", "refused", "runs_as",
             "refused_values", "also_accepts", "only_with", "unread_with", "no_effect", "comment"}


def _special(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if value.keys() == {"env", "fallback"}:
        return FromEnv(value["env"], value["fallback"])
    if value.keys() == {"attention_backend"}:
        return AttnBackendName(value["attention_backend"])
    if value.keys() == {"signal"}:
        return signal.Signals[value["signal"]]
    if value == {"not_offered": True}:
        return NOT_OFFERED
    raise ValueError(f"unknown special value {value}")


def _reason(name: str) -> str:
    why = globals().get(name)
    if not (name.isupper() and isinstance(why, str)):
        raise ValueError(f"no reason named {name}")
    return why


def _flag_row(spec: dict) -> MegatronLMFlag:
    if not isinstance(spec, dict):
        raise ValueError(f"a row is a JSON object, not {spec!r}")
    unknown = spec.keys() - _ROW_KEYS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    not_lists = [field for field in _LIST_FIELDS if not isinstance(spec.get(field, []), list)]
    if not_lists or not isinstance(spec.get("refused_values", {}), dict):
        raise ValueError(f"{', '.join(not_lists) or 'refused_values'}: a list each (refused_values: an object)")
    action = spec.get("action", "store")
    if action not in _ACTION_DEFAULTS or (action == "boolean_optional" and "default" not in spec):
        raise ValueError(f"action {action!r}: one of {sorted(_ACTION_DEFAULTS)} (boolean_optional with a default)")
    names = (spec["flag"], *spec.get("aliases", ()))
    value_type = _TYPES[spec["type"]] if "type" in spec else None
    # JSON's keys are text: a numeric flag's refused values are read back as numbers
    key_type = value_type if value_type in (int, float) else str
    return MegatronLMFlag(
        names, spec.get("dest", names[0].lstrip("-").replace("-", "_")),
        _special(spec.get("default", _ACTION_DEFAULTS[action])), action, value_type, spec.get("nargs"),
        refused=_reason(spec["refused"]) if "refused" in spec else None,
        runs_as=_special(spec.get("runs_as", MEGATRON_LM_DEFAULT)),
        refused_values={key_type(value): _reason(why) for value, why in spec.get("refused_values", {}).items()},
        also_accepts=tuple(spec.get("also_accepts", ())),
        only_with=spec.get("only_with"),
        unread_with=tuple(spec["unread_with"]) if "unread_with" in spec else None,
        no_effect=_reason(spec["no_effect"]) if "no_effect" in spec else None)


def _read_table(path: str) -> Tuple[MegatronLMFlag, ...]:
    rows = []
    with open(path, encoding="utf-8") as table:
        for number, line in enumerate(table, 1):
            try:
                rows.append(_flag_row(json.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return tuple(rows)


FLAGS: Tuple[MegatronLMFlag, ...] = _read_table(os.path.join(os.path.dirname(__file__), "megatron_lm_flags.jsonl"))

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
