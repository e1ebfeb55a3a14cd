"""Which CUDA graph scopes the patch set captures, decided in one place for the plan and both
training loops; imports nothing of megatron-core (the driver's argument checks read it).

``graph_scope`` reads megatron-core's ``cuda_graph_impl`` and ``cuda_graph_scope`` from a config
or a loop's args; ``CAPTURED_SCOPES`` is the allow-list of scope names; ``full_iteration_loop_refusal``
says what a training loop may not run inside megatron-core's ``full_iteration`` graph, from the
``LoopTraits`` each loop reads from its own args.
"""

import enum
from typing import List, NamedTuple, Optional

FULL_ITERATION = "full_iteration"


class GraphScope(enum.Enum):
    """What the patch set captures as CUDA graphs for a config (``MoEPlan.graph_scope``)."""

    NONE = "none"  # no graphs, or megatron-core's own (dense layers, drop-and-pad MoE)
    MOE_LAYER = "MoE layer"  # F11: each dropless MoE layer
    WHOLE_LAYER = "transformer layer"  # F11: each transformer layer, attention and MoE in one graph
    FULL_ITERATION = "whole iteration"  # megatron-core's graph of every micro-batch's step

    @property
    def by_layer(self) -> bool:
        """Whether F11 captures layers (dropless MoE layers, or the transformer layers around them)."""
        return self in (GraphScope.MOE_LAYER, GraphScope.WHOLE_LAYER)


# The graph-scope allow-list: the sets of megatron-core's cuda_graph_scope names the patch set
# captures, and what each captures. Other scopes beside moe would capture the MoE layers again.
CAPTURED_SCOPES = {
    frozenset({"moe"}): GraphScope.MOE_LAYER,
    frozenset(): GraphScope.WHOLE_LAYER,
    frozenset({"attn", "moe"}): GraphScope.WHOLE_LAYER,
    frozenset({FULL_ITERATION}): GraphScope.FULL_ITERATION,
}


def graph_scope(settings) -> GraphScope:
    """What the patch set captures for a config, or for a loop's args (the same field names, the
    experts counted in ``num_experts``). F11 takes in dropless MoE layers (megatron-core 0.16.1
    graphs only drop-and-pad ones) under the ``moe`` scope or the whole layer (no scope); other
    names beside ``moe`` still give the MoE layer, and the config's rules refuse them by name."""
    names = frozenset(scope_names(getattr(settings, "cuda_graph_scope", None)))
    impl = getattr(settings, "cuda_graph_impl", "none")
    if impl in ("local", "transformer_engine") and _dropless_moe(settings) and ("moe" in names or not names):
        whole = CAPTURED_SCOPES.get(names) is GraphScope.WHOLE_LAYER
        return GraphScope.WHOLE_LAYER if whole else GraphScope.MOE_LAYER
    if impl == "local" and FULL_ITERATION in names:
        return GraphScope.FULL_ITERATION
    return GraphScope.NONE


def _dropless_moe(settings) -> bool:
    experts = getattr(settings, "num_moe_experts", getattr(settings, "num_experts", None))
    drop_and_pad = (getattr(settings, "moe_expert_capacity_factor", None) is not None
                    and getattr(settings, "moe_pad_expert_input_to_capacity", False))
    return experts is not None and not drop_and_pad


def holds_moe_layers(names: List[str]) -> bool:
    """Whether graphs of these scopes hold the MoE layers: the moe scope, the whole layer (no
    scope) or the whole iteration."""
    return "moe" in names or not names or FULL_ITERATION in names


def scope_names(scope) -> List[str]:
    """megatron-core's cuda_graph_scope (a string, a CudaGraphScope, or a list of either)
    as a list of scope names."""
    if scope is None:
        return []
    items = scope.split(",") if isinstance(scope, str) else scope if isinstance(scope, (list, tuple)) else [scope]
    return [getattr(item, "name", item) for item in items]


class LoopTraits(NamedTuple):
    """What a training loop runs inside the step megatron-core's ``full_iteration`` graph
    captures; each loop reads its own from its args (the others stay False/0)."""

    host_nan_check: bool = False  # reads each loss on the host for NaN (this package's driver)
    batch_rampup: bool = False  # changes the number of micro-batches (this package's driver)
    timing_level: int = 0  # megatron-core's schedule times the forward-backward at level >= 1 (Megatron-LM)
    spiky_loss_check: bool = False  # reads each loss on the host (Megatron-LM)


def full_iteration_loop_refusal(traits: LoopTraits) -> Optional[str]:
    """What in a training loop's captured step a ``full_iteration`` graph cannot hold, or None.
    With timing at level 1 or more megatron-core's schedule starts and stops its forward-backward
    timer inside the captured function, and its timers synchronize the device, which a capture
    refuses (measured on an H200: "operation not permitted when stream is capturing")."""
    if traits.host_nan_check:
        return ("--cuda-graph-scope full_iteration needs --no-check-for-nan-in-loss-and-grad: the "
                "check reads each loss on the host, which a replayed iteration cannot")
    if traits.batch_rampup:
        return ("--cuda-graph-scope full_iteration with --rampup-batch-size: the captured iteration "
                "has a fixed number of micro-batches, and the ramp-up changes it")
    if traits.timing_level >= 1:
        return (f"--cuda-graph-scope full_iteration with --timing-log-level {traits.timing_level}: megatron-core's "
                "schedule times the forward-backward inside the captured iteration, and its timers synchronize the "
                "device, which a CUDA graph cannot hold; use --timing-log-level 0")
    if traits.spiky_loss_check:
        return ("--cuda-graph-scope full_iteration with --check-for-spiky-loss: the check reads each loss on the host "
                "inside the captured iteration; drop --check-for-spiky-loss")
    return None
