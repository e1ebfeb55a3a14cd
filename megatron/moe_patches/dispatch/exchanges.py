"""How the dispatchers' rows reach the ranks that own their experts and come back: one
object per exchange, chosen once when the dispatcher is built.

The alltoall dispatcher (``dispatchers.PatchedAlltoAllTokenDispatcher``) hands each of its
phases to its exchange, with itself as ``d``: the per-step state megatron-core's methods read
(split sizes, counts) stays on the dispatcher, under megatron-core's names, as the stock
methods and megatron-core's CUDA graph capture expect; what only an exchange of this package
reads (F12's routes) stays on the exchange. The stock methods the NCCL exchanges call are in
the registry (F1's ``relies_on``): apply() refuses F1 where megatron-core lacks one.

- ``NcclAllToAll``: megatron-core's own (NCCL ``all_to_all_single`` with host split sizes,
  its sync points, the receiver's chunk sort by local expert), run by its own methods.
- ``NcclAllToAllDeviceCounts`` (F8): the same, the experts' token counts left on the
  device (only the split sizes go to the host).
- ``NcclAllToAllOneSource`` (F8 at EP 1 without TP): one source rank, so the chunk sort by
  local expert is the identity; it is skipped both ways.
- ``SymmetricMemoryAllToAll`` (F12): ``symmetric_exchange.SymmetricExchange``, no split
  size on the host, each token sent once per owner, rows laid out grouped by local expert
  on the owner.

The allgather dispatcher's exchange is ``AllGather`` (megatron-core's gather and
reduce-scatter over TP x EP).

Each exchange declares what it does as class attributes; ``lands_grouped_by_local_expert``
and ``split_sizes_to_host`` are what its methods below implement, ``carries_padded_chunks``
whether F1's padded chunks may go through it.
"""

from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron.moe_patches.dispatch.symmetric_exchange import SymmetricExchange
from megatron.moe_patches.plan import SYMMETRIC_MEMORY

# The stock methods the NCCL exchanges run on the dispatcher (``d`` is always one of our
# subclasses; calling through the stock class keeps its overrides out of the way).
_ALLTOALL = MoEAlltoAllTokenDispatcher
_ALLGATHER = MoEAllGatherTokenDispatcher


class AlltoAllExchange:
    """The alltoall dispatcher's exchange: its phases, each given the dispatcher ``d``."""

    name: str
    split_sizes_to_host: bool  # the exchange needs its split sizes on the host (a sync)
    counts_to_host: bool  # the experts get host token counts
    lands_grouped_by_local_expert: bool  # received rows need no chunk sort
    carries_padded_chunks: bool  # F1's per-(rank, expert) padded chunks may go through it

    def preprocess(self, d, routing_map_TE):
        """The metadata for this routing; returns the local experts' token counts."""
        raise NotImplementedError

    def update_sync_point(self, d, point: str) -> None:
        raise NotImplementedError

    def dtoh_and_synchronize(self, d, point: str, tokens_per_expert):
        raise NotImplementedError

    def dispatch(self, d, x_RH, probs_R):
        raise NotImplementedError

    def dispatch_postprocess(self, d, x_RH, probs_R):
        """Received rows -> (rows grouped by local expert, the experts' counts, probs)."""
        raise NotImplementedError

    def combine_preprocess(self, d, y_RH):
        raise NotImplementedError

    def combine(self, d, y_RH, async_finish: bool, allocate_on_comm_stream: bool):
        raise NotImplementedError


class NcclAllToAll(AlltoAllExchange):
    """megatron-core's exchange, run by its own methods."""

    name = "NCCL all-to-all"
    split_sizes_to_host = True
    counts_to_host = True
    lands_grouped_by_local_expert = False
    carries_padded_chunks = True

    def preprocess(self, d, routing_map_TE):
        return _ALLTOALL.preprocess(d, routing_map_TE)

    def update_sync_point(self, d, point):
        _ALLTOALL._maybe_update_cuda_sync_point(d, point)

    def dtoh_and_synchronize(self, d, point, tokens_per_expert):
        return _ALLTOALL._maybe_dtoh_and_synchronize(d, point, tokens_per_expert)

    def dispatch(self, d, x_RH, probs_R):
        return _ALLTOALL.token_dispatch(d, x_RH, probs_R)

    def dispatch_postprocess(self, d, x_RH, probs_R):
        return _ALLTOALL.dispatch_postprocess(d, x_RH, probs_R)

    def combine_preprocess(self, d, y_RH):
        return _ALLTOALL.combine_preprocess(d, y_RH)

    def combine(self, d, y_RH, async_finish, allocate_on_comm_stream):
        return _ALLTOALL.token_combine(d, y_RH, async_finish, allocate_on_comm_stream)


class NcclAllToAllDeviceCounts(NcclAllToAll):
    """F8: ``tokens_per_expert`` stays on the GPU; the split sizes still go to the host."""

    counts_to_host = False

    def update_sync_point(self, d, point):
        # "before_finish" exists only to read tokens_per_expert on the host.
        if point != "before_finish":
            super().update_sync_point(d, point)

    def dtoh_and_synchronize(self, d, point, tokens_per_expert):
        super().dtoh_and_synchronize(d, point, None)  # split sizes still go to the host
        return tokens_per_expert


def _hand_out_grouped(d, x_RH, probs_R):
    """Received rows already grouped by local expert: the experts take them as they are."""
    if d.shared_experts is not None:
        d.shared_experts.linear_fc1_forward_and_act(x_RH)
    tokens_per_expert, d.tokens_per_expert = d.tokens_per_expert, None
    return x_RH, tokens_per_expert, probs_R


class NcclAllToAllOneSource(NcclAllToAllDeviceCounts):
    """F8 with one source rank and no TP: sorting chunks by local expert keeps them in place,
    yet the stock path copies all permuted tokens through the sort (both ways)."""

    lands_grouped_by_local_expert = True

    def dispatch_postprocess(self, d, x_RH, probs_R):
        return _hand_out_grouped(d, x_RH, probs_R)

    def combine_preprocess(self, d, y_RH):
        return y_RH


class SymmetricMemoryAllToAll(AlltoAllExchange):
    """F12: tokens through peer-mapped buffers (``symmetric_exchange.SymmetricExchange``), each
    once per owner; the split sizes never leave the GPU, each owner lays out its experts' rows
    (grouped by local expert) and counts them, and the combine returns one row per token. The
    dispatcher's permute step for it passes the tokens through (``permute_pad.TokenRows``)."""

    name = "symmetric memory"
    split_sizes_to_host = False
    counts_to_host = False
    lands_grouped_by_local_expert = True
    carries_padded_chunks = False

    def __init__(self, symmetric):
        self.symmetric = symmetric
        self.routes = None  # the current step's TokenRoutes (set by preprocess)

    def preprocess(self, d, routing_map_TE):
        # Dropless (exchange_config_errors): tokens x top-k rows, known on the host.
        d.num_out_tokens = routing_map_TE.size(0) * d.config.moe_router_topk
        self.routes = self.symmetric.routes(routing_map_TE)  # this layer's step, until its combine
        return None  # each owner counts its experts' rows from what the dispatch brings

    def update_sync_point(self, d, point):
        pass  # nothing goes to the host

    def dtoh_and_synchronize(self, d, point, tokens_per_expert):
        return tokens_per_expert

    def dispatch(self, d, x_TH, probs_TE):
        x_BH, probs_B = self.symmetric.dispatch(self.routes, x_TH, probs_TE)
        d.tokens_per_expert = self.routes.owner.tokens_per_local_expert  # megatron-core's name, read next
        return x_BH, probs_B

    def dispatch_postprocess(self, d, x_RH, probs_R):
        return _hand_out_grouped(d, x_RH, probs_R)

    def combine_preprocess(self, d, y_RH):
        return y_RH

    def combine(self, d, y_RH, async_finish, allocate_on_comm_stream):
        return self.symmetric.combine(self.routes, y_RH)


def alltoall_exchange(choice, ep_group, topk: int) -> AlltoAllExchange:
    """The alltoall dispatcher's exchange for the plan's ``choice``: the symmetric-memory one,
    else NCCL's, F8 keeping the counts on the device (and, with one source rank and no TP,
    skipping the identity chunk sort)."""
    if choice.name == SYMMETRIC_MEMORY:
        return SymmetricMemoryAllToAll(SymmetricExchange(ep_group, topk, zero_tail=choice.zero_tail))
    if not choice.device_counts:
        return NcclAllToAll()
    if choice.skips_chunk_sort:
        return NcclAllToAllOneSource()
    return NcclAllToAllDeviceCounts()


class AllGather:
    """The allgather dispatcher's exchange: megatron-core's gather over TP x EP and its
    reduce-scatter back (nothing moves at one rank)."""

    name = "all-gather"
    split_sizes_to_host = False  # equal chunks per rank

    def dispatch(self, d, x_TH, probs_TE):
        return _ALLGATHER.token_dispatch(d, x_TH, probs_TE)

    def combine(self, d, y_TH):
        return _ALLGATHER.token_combine(d, y_TH)
