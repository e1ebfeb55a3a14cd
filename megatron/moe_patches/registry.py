"""The patch series, in order. Start here: every feature is one entry below.

Each entry names the module that implements it (``module``), the named bindings ``apply()``
sets for it (``bindings``: which megatron-core module or class attribute, to what, and why
megatron-core has no seam there; the whole list is short), its config fields, the upstream
pull requests it brings, what it needs from Transformer Engine (a capability probe, not a version guess), a
``native`` probe that recognises a megatron-core which already has it, its page
under ``patches/`` and the tests that prove it.

The patched classes: ``config`` (C0), ``dispatch.dispatchers`` (F1: one class per stock
dispatcher, built from an exchange and a permute step), ``grouped_experts`` (F3: the one
experts class; F4, F5, F8 and F10 are backends under ``experts/`` and options, so they require
F3 and bind nothing of their own), ``dispatch.hybridep_blocks`` (F2), ``checkpoint.grouped_keys``
(F6) and ``checkpoint.optimizer_state`` (F7). ``plan.plan_for(config)`` decides once per config
which backend runs, who pads, which exchange the dispatchers use and whether the layer can be
graphed. F11 captures the sync-free MoE layer in CUDA graphs (``graphs.layer_graphs``)
behind megatron-core's graph entry points (the TE graph helper, the layers' graph-manager
factory and ``create_cudagraphs``). F12 is an exchange of the alltoall dispatcher
(``dispatch.exchanges``, ``dispatch.symmetric_exchange``).
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from megatron.moe_patches import capabilities as cap


@dataclass(frozen=True)
class Binding:
    """One attribute ``apply()`` sets: ``owner`` ("pkg.module" or "pkg.module:Class") gets
    ``attribute`` = the object at ``patched`` ("pkg.module:name"); with ``factory`` that
    object is called with (owner, stock object) and returns the patched one. ``optional``:
    a Megatron-LM module, bound only where it is imported. ``reason``: why no seam of
    megatron-core reaches there."""

    owner: str
    attribute: str
    patched: str
    reason: str
    optional: bool = False
    factory: bool = False
    absent_in_stock: bool = False  # megatron-core leaves the name undefined here; revert() deletes it


def _never_upstream() -> bool:
    """For features this project adds: no megatron-core release ships them."""
    return False


@dataclass(frozen=True)
class Feature:
    id: str
    title: str
    changes: str
    upstream: Tuple[str, ...]
    te_requirement: str
    page: str
    test: str  # comma-separated paths under tests/
    module: str
    native: Callable[[], bool] = _never_upstream
    fields: Tuple[str, ...] = ()
    te_probe: Optional[Callable[[], bool]] = None
    bindings: Tuple[Binding, ...] = ()
    requires: Tuple[str, ...] = ("C0",)
    # megatron-core's methods the feature's code calls or overrides by name ("pkg.module:Class.name"):
    # where one is missing (renamed upstream), an override would silently stop applying, so
    # apply() skips the feature and says which.
    relies_on: Tuple[str, ...] = ()


def _f6_native() -> bool:
    grouped_linear = cap.mcore_attr("extensions.transformer_engine", "TEGroupedLinear")
    if grouped_linear is None:
        # Without TE the TE extension classes are not defined; upstream ships the key
        # conversion together with the single grouped weight field.
        return cap.mcore_has_fields("moe_single_grouped_weight")
    return hasattr(grouped_linear, "_split_grouped_checkpoint_tensor")


_PATCH_FIELDS = (
    "use_transformer_engine_op_fuser",
    "moe_mlp_glu_interleave_size",
    "moe_single_grouped_weight",
    "moe_single_grouped_bias",
    "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute",
    "moe_permute_fusion_into_hybridep",
    "moe_device_tokens_per_expert",
    "moe_symmetric_exchange",
)


# --- what apply() binds, feature by feature (the only names it sets) ---------------------

_CONFIG = "megatron.moe_patches.config:"
_NO_CONFIG_SEAM = ("megatron-core builds no config class of its own choosing: its users and Megatron-LM's "
                   "argument parsing construct the config by these names (Megatron-LM's pretrain_gpt.py passes "
                   "core_transformer_config_from_args no config_class)")


def _config_bindings() -> Tuple[Binding, ...]:
    owners = (("megatron.core.transformer.transformer_config", False), ("megatron.core.transformer", False),
              ("megatron.training.arguments", True), ("megatron.training.yaml_arguments", True))
    return tuple(Binding(owner, name, _CONFIG + f"Patched{name}", _NO_CONFIG_SEAM, optional=optional)
                 for owner, optional in owners for name in ("TransformerConfig", "MLATransformerConfig"))


_MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
_DISPATCHERS = "megatron.moe_patches.dispatch.dispatchers:"
_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_PICKS_DISPATCHER = ("MoELayer.__init__ picks its dispatcher class by this name; a MoELayer subclass in the layer "
                     "spec would fail TransformerLayer's `submodules.mlp.module in (MoELayer, ...)` test")
_SPEC_PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
_EXPERTS_SPEC = ("the experts' layer spec: TESpecProvider.grouped_mlp_modules, which every GPT/Mamba MoE spec asks "
                 "for the experts, returns the class of this name")
_GRAPH_ENTRY = "megatron.moe_patches.graphs.layer_graphs:"
_LAYERS = "megatron.core.tensor_parallel.layers"
_MAIN_GRAD = "megatron.moe_patches.kernels.main_grad_accumulation:"

SERIES: Tuple[Feature, ...] = (
    Feature(
        id="C0",
        title="Config fields and flags",
        changes="TransformerConfig/MLATransformerConfig subclasses with the patch fields and their "
        "validation; apply() rebinds the stock class names to them.",
        fields=_PATCH_FIELDS,
        upstream=("NVIDIA/Megatron-LM#4636", "NVIDIA/Megatron-LM#4073", "ROCm/Megatron-LM (seed 004)"),
        te_requirement="none",
        native=cap.lands_after_tested_range(lambda: cap.mcore_has_fields(*_PATCH_FIELDS)),
        page="patches/C0-config-fields.md",
        test="tests/unit/test_config.py, tests/gpu/test_foundation.py, tests/unit/test_upstream_native.py",
        module="megatron.moe_patches.config",
        bindings=_config_bindings(),
        requires=(),
    ),
    Feature(
        id="F1",
        title="Fused permute+pad / unpermute+unpad",
        changes="Dispatchers permute straight into the quantization-aligned expert layout with TE's "
        "moe_permute_and_pad_with_probs and restore with moe_unpermute(pad_offsets=...).",
        upstream=("NVIDIA/Megatron-LM#2763", "NVIDIA/TransformerEngine#1921"),
        te_requirement="moe_permute_and_pad_with_probs and moe_unpermute(pad_offsets=)",
        te_probe=cap.te_fused_permute_pad,
        native=cap.lands_after_tested_range(lambda: cap.accepts_parameter(
            cap.mcore_attr("transformer.moe.moe_utils", "unpermute"), "pad_offsets"
        )),
        page="patches/F1-fused-permute-pad.md",
        test="tests/gpu/test_fused_permute_pad.py, tests/unit/test_fused_permute_pad.py, tests/unit/test_dispatch_strategies.py",
        module="megatron.moe_patches.dispatch.permute_pad",
        bindings=(
            Binding(_MOE_LAYER, "MoEAllGatherTokenDispatcher", _DISPATCHERS + "PatchedAllGatherTokenDispatcher",
                    _PICKS_DISPATCHER),
            Binding(_MOE_LAYER, "MoEAlltoAllTokenDispatcher", _DISPATCHERS + "PatchedAlltoAllTokenDispatcher",
                    _PICKS_DISPATCHER),
        ),
        relies_on=tuple(
            f"{_TOKEN_DISPATCHER}:{cls}.{name}" for cls, names in (
                ("MoEAlltoAllTokenDispatcher", ("dispatch_preprocess", "preprocess", "_maybe_update_cuda_sync_point",
                                                "_maybe_dtoh_and_synchronize", "token_dispatch", "dispatch_postprocess",
                                                "combine_preprocess", "token_combine", "combine_postprocess")),
                ("MoEAllGatherTokenDispatcher", ("token_dispatch", "dispatch_postprocess", "combine_preprocess",
                                                 "token_combine")),
            ) for name in names),
    ),
    Feature(
        id="F2",
        title="HybridEP permute/unpermute fusion and block counts",
        changes="moe_permute_fusion_into_hybridep fuses permute/unpermute into HybridEP's "
        "dispatch/combine; moe_hybridep_num_blocks_permute/_unpermute set their thread blocks; "
        "each passed when the installed deep_ep accepts it (the plan decides: ExchangeChoice.hybridep_*).",
        fields=(
            "moe_permute_fusion_into_hybridep",
            "moe_hybridep_num_blocks_permute",
            "moe_hybridep_num_blocks_unpermute",
        ),
        upstream=("NVIDIA/Megatron-LM#4073", "NVIDIA/Megatron-LM#4089"),
        te_requirement="none (deep_ep HybridEPBuffer(num_blocks_permute=...), "
        "dispatch_with_permute(fuse_permute_dispatch=...))",
        native=cap.lands_after_tested_range(
            lambda: cap.mcore_has_fields("moe_hybridep_num_blocks_permute", "moe_permute_fusion_into_hybridep")),
        page="patches/F2-hybridep-blocks.md",
        test="tests/unit/test_hybridep_blocks.py, tests/unit/test_decided_at_construction.py",
        module="megatron.moe_patches.dispatch.hybridep_blocks",
        bindings=(
            Binding("megatron.core.transformer.moe.token_dispatcher", "_HybridEPManager",
                    "megatron.moe_patches.dispatch.hybridep_blocks:HybridEPBlocksManager",
                    "MoEFlexTokenDispatcher constructs its HybridEP manager by this name"),
        ),
        # the manager creates the buffer megatron-core's fused_a2a would create lazily, in its place
        relies_on=(f"{_TOKEN_DISPATCHER}:_HybridEPManager.dispatch",
                   "megatron.core.transformer.moe.fused_a2a:_hybrid_ep_buffer"),
    ),
    Feature(
        id="F3",
        title="Skip routed expert padding",
        changes="The plan decides once per config who pads the routed tokens (plan_for(config).padding): "
        "the one experts class skips its own quantization padding when the router or the dispatcher "
        "already padded on device.",
        upstream=("NVIDIA/Megatron-LM#4071", "NVIDIA/Megatron-LM#4636"),
        te_requirement="none",
        native=cap.lands_after_tested_range(
            lambda: cap.mcore_attr("transformer.moe.moe_utils", "skip_routed_expert_padding") is not None),
        page="patches/F3-skip-routed-padding.md",
        test="tests/unit/test_padding_decision.py, tests/unit/test_plan.py, tests/gpu/test_fused_permute_pad.py",
        module="megatron.moe_patches.grouped_experts",
        bindings=(
            Binding(_SPEC_PROVIDER, "TEGroupedMLP", "megatron.moe_patches.grouped_experts:PatchedTEGroupedMLP",
                    _EXPERTS_SPEC),
        ),
        requires=("C0", "F1"),
    ),
    Feature(
        id="F4",
        title="Op-fuser grouped MLP",
        changes="TEGroupedMLP runs FC1 -> scaled GLU -> FC2 as one te.pytorch.ops pipeline on the "
        "module's own parameters; GLU interleave; prob-scaled grouped bias; fused backward_dw().",
        fields=("use_transformer_engine_op_fuser", "moe_mlp_glu_interleave_size"),
        upstream=(
            "NVIDIA/Megatron-LM#3890",
            "NVIDIA/Megatron-LM#4095",
            "NVIDIA/Megatron-LM#4219",
            "NVIDIA/Megatron-LM#4311",
            "NVIDIA/Megatron-LM#4636",
        ),
        te_requirement="te.pytorch.ops GroupedLinear + ScaledSwiGLU (TE >= 2.14)",
        te_probe=cap.te_op_fuser_grouped_mlp,
        native=cap.lands_after_tested_range(lambda: cap.mcore_has_fields(
            "use_transformer_engine_op_fuser", "moe_mlp_glu_interleave_size"
        )),
        page="patches/F4-op-fuser-grouped-mlp.md",
        test="tests/gpu/test_op_fuser_grouped_mlp.py, tests/unit/test_op_fuser_grouped_mlp.py",
        module="megatron.moe_patches.experts.op_fuser",
        requires=("C0", "F3"),
    ),
    Feature(
        id="F5",
        title="Single grouped expert parameters",
        changes="Expert weights stored as one [num_experts, out, in] parameter per FC (grouped_mm "
        "backend); refused by name where the chosen backend cannot hold them.",
        fields=("moe_single_grouped_weight", "moe_single_grouped_bias"),
        upstream=("NVIDIA/Megatron-LM#3890", "NVIDIA/Megatron-LM#4219"),
        te_requirement="none with the grouped_mm backend (the op fuser's grouped-tensor path needs "
        "cuBLASLt >= 13.4 on Hopper and is refused)",
        native=cap.lands_after_tested_range(
            lambda: cap.mcore_has_fields("moe_single_grouped_weight", "moe_single_grouped_bias")),
        page="patches/F5-single-grouped-params.md",
        test="tests/unit/test_single_grouped_params.py, tests/unit/test_grouped_layout_read_once.py, "
        "tests/gpu/test_device_splits.py, "
        "tests/gpu/test_grouped_checkpoint_round_trips.py",
        module="megatron.moe_patches.experts.grouped_params",
        requires=("C0", "F3", "F6"),
    ),
    Feature(
        id="F6",
        title="Grouped checkpoint compatibility",
        changes="load_state_dict pre-hook converting weight0..N-1 <-> grouped weight; sharded "
        "checkpoints keep per-expert keys.",
        upstream=("NVIDIA/Megatron-LM#3890", "NVIDIA/Megatron-LM#4636"),
        te_requirement="none beyond F5",
        native=cap.lands_after_tested_range(_f6_native),
        page="patches/F6-grouped-checkpoint-keys.md",
        test="tests/unit/test_grouped_checkpoint_keys.py, tests/unit/test_checkpoint_coverage.py, "
        "tests/gpu/test_grouped_checkpoint_round_trips.py, tests/gpu/test_device_splits.py",
        module="megatron.moe_patches.checkpoint.grouped_keys",
        bindings=tuple(
            Binding(_SPEC_PROVIDER, name, "megatron.moe_patches.checkpoint.grouped_keys:with_key_conversion",
                    "the experts' layer spec: TESpecProvider.grouped_mlp_modules names the experts' FC classes "
                    "by these names", factory=True)
            for name in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")
        ),
    ),
    Feature(
        id="F7",
        title="DistributedOptimizer grouped tensors",
        changes="Optimizers map a grouped param to its per-expert checkpoint entries (one factory), "
        "so main params and Adam states save and load per expert, across grouped/indexed layouts; "
        "main params reload from a state dict in either layout; the distributed optimizer records "
        "its expert layout beside its bucket-format (dp_reshardable) states and refuses a load into "
        "another layout by name.",
        upstream=("NVIDIA/Megatron-LM#3890", "NVIDIA/Megatron-LM#4324"),
        te_requirement="none beyond F5",
        native=cap.lands_after_tested_range(lambda: cap.mcore_attr(
            "optimizer.distrib_optimizer", "DistributedOptimizer._is_grouped_quantized_tensor"
        ) is not None),
        page="patches/F7-distopt-grouped.md",
        test="tests/unit/test_grouped_optimizer_state.py, tests/unit/test_optimizer_bucket_layout.py, "
        "tests/gpu/test_grouped_checkpoint_round_trips.py, tests/gpu/test_megatron_lm_client.py",
        module="megatron.moe_patches.checkpoint.optimizer_state",
        bindings=(
            Binding("megatron.core.optimizer", "DistributedOptimizer",
                    "megatron.moe_patches.checkpoint.optimizer_state:GroupedParamDistributedOptimizer",
                    "get_megatron_optimizer constructs the distributed optimizer by this name"),
            Binding("megatron.core.optimizer.optimizer", "get_param_id_to_sharded_param_map",
                    "megatron.moe_patches.checkpoint.optimizer_state:param_id_to_sharded_param_map",
                    "the Float16/FP32 optimizers' sharded_state_dict call it by this name"),
        ),
    ),
    Feature(
        id="F8",
        title="Device-resident tokens_per_expert",
        changes="tokens_per_expert stays on the GPU from routing to the expert GEMMs for backends "
        "that take device splits; one host copy for the others. Its grouped_mm backend runs the "
        "prob-weighted GLU as one Triton pass each way (weighted_glu).",
        fields=("moe_device_tokens_per_expert",),
        upstream=("ROCm/Megatron-LM (seed 004: GPU m_splits for grouped GEMM)",),
        te_requirement="GroupedLinear.forward(m_splits_tensor=) where present; else own backend",
        te_probe=cap.te_grouped_linear_device_splits,
        native=cap.lands_after_tested_range(lambda: cap.mcore_has_fields("moe_device_tokens_per_expert")),
        page="patches/F8-device-tokens-per-expert.md",
        test="tests/gpu/test_device_splits.py, tests/gpu/test_weighted_glu.py, tests/unit/test_expert_backends.py",
        module="megatron.moe_patches.experts.grouped_mm",
        requires=("C0", "F3"),
    ),
    Feature(
        id="F10",
        title="FP8 grouped-GEMM experts",
        changes="With device splits and FP8 tensorwise, the experts run torch._scaled_grouped_mm over all "
        "local experts (per-expert E4M3 scales, Triton quantization, amaxes of FC2's input and FC1's "
        "output gradient gathered by the weighted GLU's kernels, weights quantized once per "
        "optimizer step, FP8 wgrad unless --no-fp8-wgrad), sync-free and without padding; with FP8 "
        "blockwise (TE's Float8BlockScaling: 1x128 / 128x128 power-of-two scales) the Triton grouped "
        "GEMMs of kernels/fp8_grouped_gemm.py with single-pass quantizers (experts/fp8_blockwise.py); "
        "where DeepGEMM is installed, blockwise fprop/dgrad on its grouped GEMM (kernels/deep_gemm_grouped.py) "
        "with the dispatcher padding each expert's rows to 128 into a static row count "
        "(dispatch/permute_pad.py StaticPaddedPermute, one rank); with --no-fp8-wgrad the permute and the "
        "unpermute's backward (kernels/permute_quantize.py) and the weighted GLU (kernels/weighted_glu.py) write "
        "the GEMMs' 1x128 FP8 rows beside the bf16 ones.",
        upstream=("none: this project's backend (the FP8 counterpart of F8's grouped_mm)",),
        te_requirement="none (torch._scaled_grouped_mm on sm90, Triton); blockwise on DeepGEMM: TE's permute "
        "kernel with pad offsets (TE >= 2.14)",
        page="patches/F10-fp8-grouped-mm.md",
        test="tests/unit/test_fp8_grouped_mm.py, tests/unit/test_fp8_blockwise.py, tests/unit/test_aligned_groups.py, "
        "tests/gpu/test_fp8_grouped_mm.py, tests/gpu/test_fp8_blockwise.py",
        module="megatron.moe_patches.experts.fp8_grouped_mm",
        requires=("C0", "F3", "F8"),
    ),
    Feature(
        id="F11",
        title="CUDA-graph-safe dropless MoE layer",
        changes="cuda_graph_scope=moe accepted for dropless MoE where graph_blocker allows it (EP 1 or "
        "EP > 1 through F12's exchange, alltoall/allgather, grouped_mm or fp8_grouped_mm experts); the "
        "layer's forward and backward captured as CUDA graphs with gradients of parameter aliases "
        "(LayerGraphs); without a scope (or attn moe) each transformer layer is captured whole the "
        "same way, and full_iteration (megatron-core's own capture) holds the sync-free layer where "
        "full_iteration_blocker allows it. apply() installs the capture behind megatron-core's graph entry points "
        "(TECudaGraphHelper for --cuda-graph-impl transformer_engine; the layers' "
        "create_mcore_cudagraph_manager and create_cudagraphs() for local), so Megatron-LM's "
        "training loop and this package's driver capture the same way.",
        upstream=("NVIDIA/Megatron-LM#4071 (seed 002)", "NVIDIA/Megatron-LM#2690 (paged stashing, named by seed 002)"),
        te_requirement="none (torch CUDA graphs; the sync-free path of F8/F10)",
        page="patches/F11-moe-cuda-graph.md",
        test="tests/unit/test_moe_cuda_graph.py, tests/unit/test_moe_graph_entry_points.py, "
        "tests/gpu/test_moe_cuda_graph.py, tests/gpu/test_symmetric_exchange.py, tests/gpu/test_megatron_lm_client.py, "
        "tests/gpu/test_layer_and_iteration_graphs.py",
        module="megatron.moe_patches.graphs.layer_graphs",
        bindings=(
            Binding("megatron.core.transformer.cuda_graphs", "TECudaGraphHelper", _GRAPH_ENTRY + "DroplessMoEGraphHelper",
                    "--cuda-graph-impl transformer_engine: Megatron-LM's training loop builds its graph helper by "
                    "this name"),
            Binding("megatron.training.training", "TECudaGraphHelper", _GRAPH_ENTRY + "DroplessMoEGraphHelper",
                    "Megatron-LM's training loop imported the graph helper by name", optional=True),
            Binding("megatron.core.pipeline_parallel.schedules", "create_cudagraphs", _GRAPH_ENTRY + "create_cudagraphs",
                    "--cuda-graph-impl local: the schedules capture every graph through this name after the "
                    "warm-up steps"),
            *(Binding(f"megatron.core.transformer.transformer_layer:{cls}", "create_mcore_cudagraph_manager",
                      _GRAPH_ENTRY + "manager_factory", "--cuda-graph-impl local: each layer makes its graph "
                      "manager in this method", factory=True)
              for cls in ("TransformerLayer", "MoETransformerLayer")),
        ),
        requires=("C0", "F3", "F8"),
    ),
    Feature(
        id="F12",
        title="Sync-free expert-parallel exchange",
        changes="With moe_symmetric_exchange the alltoall dispatcher sends each token once to every rank "
        "owning an expert it picked, through peer-mapped symmetric memory (one Triton store kernel, "
        "routing metadata sent beside the tokens); each owner lays out its experts' rows on the GPU and "
        "returns one summed row per token: no host sync, no permute, no chunk sort, no unpermute.",
        fields=("moe_symmetric_exchange",),
        upstream=("none: this project's exchange (megatron-core 0.16.1's alltoall dispatcher, "
                  "NCCL all_to_all_single with host split sizes, is what it replaces)",),
        te_requirement="none (torch symmetric memory, Triton; grouped_mm / fp8_grouped_mm experts)",
        page="patches/F12-symmetric-exchange.md",
        test="tests/unit/test_symmetric_exchange.py, tests/gpu/test_symmetric_exchange.py",
        module="megatron.moe_patches.dispatch.symmetric_exchange",
        requires=("C0", "F1", "F8"),
    ),
    Feature(
        id="F13",
        title="Gradient accumulation into main grads without APEX",
        changes="gradient_accumulation_fusion (Megatron-LM's default) runs without APEX: megatron-core's non-TE "
        "linear layers get the two wgrad-accumulate functions they take from APEX (torch addmm with an fp32 "
        "output into main_grad), and the grouped_mm experts add their weight gradients into main_grad in one "
        "Triton grouped GEMM (kernels/main_grad_accumulation.py); TE's modules keep their own fused path.",
        upstream=("none: APEX's fused_weight_gradient_mlp_cuda is what megatron-core 0.16.1 asks for",),
        te_requirement="none (cuBLAS through torch.addmm; Triton for the experts)",
        native=cap.apex_wgrad_fusion,
        page="patches/F13-wgrad-into-main-grad.md",
        test="tests/unit/test_main_grad_accumulation.py, tests/gpu/test_main_grad_accumulation.py, "
        "tests/gpu/test_megatron_lm_client.py",
        module="megatron.moe_patches.kernels.main_grad_accumulation",
        bindings=(
            Binding(_LAYERS, "fused_weight_gradient_mlp_cuda", _MAIN_GRAD + "APEX_WGRAD",
                    "the layers' backward calls APEX's extension by this module-level name (set only where APEX "
                    "imports)", absent_in_stock=True),
            Binding(_LAYERS, "_grad_accum_fusion_available", _MAIN_GRAD + "FUSION_AVAILABLE",
                    "ColumnParallelLinear/RowParallelLinear refuse gradient_accumulation_fusion when this is False"),
        ),
        requires=(),
    ),
)

BY_ID = {feature.id: feature for feature in SERIES}


def get(feature_id: str) -> Feature:
    try:
        return BY_ID[feature_id]
    except KeyError:
        raise KeyError(f"unknown patch {feature_id!r}; the series is {', '.join(BY_ID)}") from None


# --- what megatron_lm.enable() changes in Megatron-LM's loop (apply() binds nothing there) -------


@dataclass(frozen=True)
class LoopWrap:
    """A function of Megatron-LM's training package that ``megatron_lm.enable()`` replaces by a
    wrapper (or a stand-in) for the run: ``owners`` lists the module that defines it first,
    then the modules that imported it by name and call it through that name; ``optional``: a
    Megatron-LM version may lack it; ``reason``: why, and why no seam of Megatron-LM reaches
    there."""

    name: str
    owners: Tuple[str, ...]
    reason: str
    optional: bool = False


MEGATRON_LM_WRAPS: Tuple[LoopWrap, ...] = (
    LoopWrap("load_args_from_checkpoint", ("megatron.training.checkpointing", "megatron.training.initialize"),
             "--use-checkpoint-args restores a fixed list of Megatron-LM's args; the wrapper restores the patch "
             "args from the checkpoint's saved args too, by Megatron-LM's rule"),
    LoopWrap("validate_args", ("megatron.training.arguments", "megatron.training.initialize"),
             "Megatron-LM builds the config (whose checks hold the patch set's rules) only at model construction, "
             "after the GPUs start; the wrapper builds it when the args are validated, so a refused value is one "
             "error line before start-up, and judges the --load checkpoint from its files there too (a missing or "
             "incomplete iteration, optimizer states of another expert layout: failures after start-up in "
             "Megatron-LM). Megatron-LM's rule that local graphs at EP > 1 need an inference-only flag is left to "
             "the patch set's own rule for its MoE graphs"),
    LoopWrap("validate_yaml", ("megatron.training.yaml_arguments", "megatron.training.initialize"),
             "validate_args' twin for --yaml-cfg runs", optional=True),
    LoopWrap("get_batch_on_this_tp_rank", ("megatron.training.utils", "__main__"),
             "each micro-batch's batch is broadcast within the tensor-parallel group, and the packed-sequence "
             "length first becomes a device tensor from a host int (the host waits for the GPU twice per "
             "micro-batch) even at TP 1, where the group is this rank alone: at TP 1 the wrapper moves the same "
             "tensors to the GPU without the waits. pretrain_gpt.py imports it by name before enable() runs, "
             "hence its __main__ module", optional=True),
    LoopWrap("compile_helpers", ("megatron.core.datasets.utils",),
             "start-up builds megatron-core's dataset helpers with make in megatron-core's folder; the wheel ships "
             "them built but without the Makefile, so where they import the build is skipped (a stand-in)",
             optional=True),
)
