"""F12: the expert-parallel exchange whose split sizes never leave the GPU.

megatron-core's alltoall dispatcher sends tokens with NCCL's ``all_to_all_single``, whose
split sizes are host lists: every MoE layer waits for the router's counts to reach the
host, sends one row per (token, expert) chosen, and sorts the received chunks by local
expert. With ``moe_symmetric_exchange`` the ranks of one NVLink node write each other's
memory instead (PyTorch symmetric memory, mapped peer buffers), and a token goes to each
rank once, however many of that rank's experts it picked:

- Dispatch: each token's row goes once to every owner of an expert it picked, with a row of
  routing metadata (its probs and picks for that owner's experts) to every owner. Each
  owner lays the received tokens out expert-major (local expert, then source rank, then the
  sender's token order: megatron-core's order after its chunk sort) by copying every token
  row to each of its experts' rows, on its own GPU.
- Combine: each owner sums a token's expert rows (fp32, in local-expert order) and sends one
  row back per token; the sender sums the rows of its token's owners (fp32, in rank order).
  This replaces megatron-core's unpermute (one sum over a token's rows) by a sum per owner
  and a sum of those: the same terms, another order, one more bf16 rounding.
- The backward of dispatch is a combine, that of combine a dispatch.

At EP 4 a Qwen3-like token (top-8 of 128 experts) has about 3.6 owners: 3.6 rows cross the
node, not 8. Slots: every rank's buffer has one row per (source rank, token), ``ep x
tokens`` rows, so no size depends on the routing and nothing waits for the host (what a
CUDA graph needs: F11 captures the layer with this exchange inside).

The owners' expert rows still depend on the routing, so they have a static bound,
``ep x tokens x min(top-k, local experts)`` rows (every token of every rank could pick this
rank's experts). Rows past the received ones (the "tail"): probs are zero there; token rows
and output gradients are zero only for experts that read them (``zero_tail``, the backend's
``reads_rows_past_groups``: FP8's quantization passes, biases' gradients), else unwritten (at
EP 4 about a quarter of a Qwen3-like bound is real). The grouped GEMMs stop at the last
offset and the weighted GLU (``weighted_glu``) reads the tail as zero and writes zeros there,
so the tail never reaches a result.

Buffers: one symmetric buffer per (group, direction, rows, columns, dtype), shared by all
layers (``_BUFFERS``). Each exchange is barrier -> stores into the peers' buffers -> barrier
-> this rank reads its buffer into new tensors; so every exchange's reads run on this
rank's stream before its next exchange's first barrier, which every peer waits for before
storing again. Two exchanges must never run at once (megatron-core's EP overlap would:
refused).

Every EP rank must hold the same number of tokens (megatron-core's micro-batches do), and
the EP group must be one node with peer access between its GPUs.
"""

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import torch

# Whether this exchange runs for a config (and why not) is the plan's to say
# (``plan.symmetric_exchange_blocker``, ``plan.exchange_config_errors``).

# --- where tokens go ------------------------------------------------------------------------


def owner_rows_bound(ep: int, tokens: int, topk: int, local_experts: int) -> int:
    """The most expert rows one rank can hold: each token of each rank picks at most
    min(top-k, local experts) of its experts."""
    return ep * tokens * min(topk, local_experts)


class OwnerRows(NamedTuple):
    """This rank's expert rows, from the metadata every source sent it. Slot ``s * tokens + t``
    is token t of source rank s; L = local experts, K = min(top-k, L), B = the bound.

    ``rows_SK``: the expert rows slot s was copied to, ascending (local-expert order), -1
    past its picks; ``slot_B1``: the slot each expert row was copied from (-1 past the rows
    received); ``probs_B``: each row's prob (0 in the tail);
    ``picked_SL`` and ``rows_SL``: the picks and their rows by local expert (-1: none)."""

    rows_SK: torch.Tensor
    slot_B1: torch.Tensor
    probs_B: torch.Tensor
    picked_SL: torch.Tensor
    rows_SL: torch.Tensor
    tokens_per_local_expert: torch.Tensor

    @classmethod
    def of(cls, probs_SL: torch.Tensor, picked_SL: torch.Tensor, topk: int, bound: int) -> "OwnerRows":
        slots, local = picked_SL.shape
        counts_L = picked_SL.sum(dim=0)
        # Expert-major: within expert l, slots in order (source rank, then token). One scan
        # over the picks in that order numbers the rows (torch's scan along the slots of
        # [slots, L] runs L sequential scans: milliseconds).
        picked_LS = picked_SL.t().contiguous()
        rows_LS = torch.cumsum(picked_LS.view(-1), 0).view(local, slots) - 1
        rows_SL = torch.where(picked_LS, rows_LS, -1).t()
        # K smallest rows per slot: its picks in local-expert order, then -1s (sorted as the
        # largest int64, put back as -1).
        none = torch.iinfo(torch.int64).max
        rows_SK = torch.sort(torch.where(picked_SL, rows_SL, none), dim=1).values[:, :min(topk, local)]
        rows_SK = torch.where(rows_SK == none, -1, rows_SK)
        # Each expert row's slot and prob; unpicked (slot, expert) pairs land on row ``bound``,
        # dropped. The tail keeps slot -1 and prob 0.
        landing = torch.where(picked_SL, rows_SL, bound).flatten()
        slot_ids = torch.arange(slots, device=picked_SL.device).view(-1, 1).expand(slots, local).flatten()
        slot_B = torch.full((bound + 1,), -1, dtype=torch.int64, device=picked_SL.device)
        slot_B.scatter_(0, landing, slot_ids)
        probs_B = torch.zeros(bound + 1, dtype=probs_SL.dtype, device=probs_SL.device)
        probs_B.scatter_(0, landing, probs_SL.flatten())
        return cls(rows_SK.contiguous(), slot_B[:bound].view(bound, 1), probs_B[:bound], picked_SL, rows_SL,
                   counts_L)


class TokenRoutes:
    """One dispatch's routes. The sender's side, from its routing map: ``to_owners_X1``
    (slot ``p * tokens + t`` -> token t's row where t picked an expert of rank p, else -1)
    and ``from_owners_TP`` (token t's returned row from rank p, ``p * tokens + t``, or -1).
    The owner's side (``owner``) comes with the dispatch's metadata."""

    def __init__(self, routing_TE: torch.Tensor, ep: int, topk: int):
        tokens, experts = routing_TE.shape
        self.tokens, self.ep, self.topk, self.local = tokens, ep, topk, experts // ep
        device = routing_TE.device
        self.routing_TE = routing_TE
        picks_TP = routing_TE.reshape(tokens, ep, self.local).any(dim=2)
        token_T = torch.arange(tokens, device=device)
        self.to_owners_X1 = torch.where(picks_TP.t(), token_T, -1).reshape(ep * tokens, 1).contiguous()
        slot_TP = torch.arange(ep, device=device) * tokens + token_T.view(-1, 1)
        self.from_owners_TP = torch.where(picks_TP, slot_TP, -1).contiguous()
        self.rows_bound = owner_rows_bound(ep, tokens, topk, self.local)
        self.owner: Optional[OwnerRows] = None

    def metadata(self, probs_TE: torch.Tensor) -> torch.Tensor:
        """[ep x tokens, 2L] fp32, row ``p * tokens + t``: token t's probs for rank p's experts,
        then its picks (1.0 / 0.0)."""
        shape = (self.tokens, self.ep, self.local)
        meta_TP2L = torch.cat([probs_TE.float().reshape(shape), self.routing_TE.reshape(shape).float()], dim=2)
        return meta_TP2L.transpose(0, 1).reshape(self.ep * self.tokens, 2 * self.local)

    def receive_metadata(self, meta_S2L: torch.Tensor) -> OwnerRows:
        self.owner = OwnerRows.of(meta_S2L[:, :self.local], meta_S2L[:, self.local:] > 0.5, self.topk,
                                  self.rows_bound)
        return self.owner


# --- the exchange ---------------------------------------------------------------------------


class _Peers(NamedTuple):
    local: torch.Tensor  # this rank's buffer
    bases: torch.Tensor  # [ep] int64: every rank's buffer address, mapped here
    handle: object  # torch's symmetric-memory handle (its barrier)


# Every exchange of a process group (one per MoE layer) uses the same buffers: exchanges run
# one at a time, and each reads its buffers into new tensors before the next one's first barrier.
_BUFFERS: Dict[Tuple, _Peers] = {}


def _allocate(group_name: str, shape, dtype, device) -> _Peers:
    """A symmetric buffer every rank of the group maps (a collective: all ranks call it)."""
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(shape, dtype=dtype, device=device)
    # torch's allocator (2.11 and earlier) zeroes the new block, barrier signal pad included,
    # with a memset the host does not wait for. A peer that maps the buffer and signals before
    # that memset has run loses its signal, and the barrier waiting for it never ends. The
    # rendezvous is what hands the buffer to the peers: finish the memset before it.
    torch.cuda.synchronize(device)
    try:
        _register_group(symm_mem, group_name)
        handle = symm_mem.rendezvous(local, group_name)
    except Exception as error:
        raise RuntimeError(
            "moe_symmetric_exchange: the expert-parallel ranks could not map each other's "
            f"memory ({error}); they must share one NVLink node. Drop --moe-symmetric-exchange "
            "to exchange tokens with NCCL."
        ) from error
    return _Peers(local, torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device), handle)


def _register_group(symm_mem, group_name: str) -> None:
    """Older torch needs the group registered for symmetric memory first (newer torch
    deprecates the call: nothing to do there)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)


class SymmetricExchange:
    """Tokens to the owners of their experts and back, through peer-mapped buffers (see the
    module text)."""

    def __init__(self, ep_group, topk: int, zero_tail: bool = True):
        self.group = ep_group
        self.topk = topk
        self.zero_tail = zero_tail  # write zeros past the received rows (for experts that read them)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def routes(self, routing_TE: torch.Tensor) -> TokenRoutes:
        return TokenRoutes(routing_TE, self.size, self.topk)

    def dispatch(self, routes: TokenRoutes, x_TH: torch.Tensor, probs_TE: torch.Tensor):
        """Tokens [T, H] and probs [T, E] -> the owners' [bound, H] expert rows and probs;
        fills ``routes.owner`` (the experts' counts: ``routes.owner.tokens_per_local_expert``)."""
        return _Dispatch.apply(self, routes, x_TH, probs_TE)

    def combine(self, routes: TokenRoutes, y_BH: torch.Tensor) -> torch.Tensor:
        """The owners' expert rows -> each token's sum of them, [T, H], on its sender."""
        return _Combine.apply(self, routes, y_BH)

    # The two moves; each direction's backward is the other.

    def spread(self, routes: TokenRoutes, x_TH: torch.Tensor, meta: Optional[torch.Tensor] = None):
        """Token rows to their owners (and, given, every slot's metadata row); returns the
        owners' expert rows [bound, H] (a new tensor; its tail zero with ``zero_tail``, else
        unwritten) and the received metadata."""
        x_TH = x_TH.contiguous()
        rows = self._peers("owners", self.size * routes.tokens, x_TH)
        sent = [(x_TH, routes.to_owners_X1, rows)]
        if meta is not None:
            meta_peers = self._peers("owners-meta", meta.shape[0], meta)
            sent.append((meta, _all_slots(meta.shape[0], meta.device), meta_peers))
        self._stores(routes, sent)
        received = meta_peers.local.detach() if meta is not None else None  # read before the next exchange
        owner = routes.owner if meta is None else routes.receive_metadata(received)
        x_BH = x_TH.new_empty(routes.rows_bound, *x_TH.shape[1:])
        sum_rows(rows.local, owner.slot_B1, x_BH, zero_empty=self.zero_tail)
        return x_BH, owner

    def gather(self, routes: TokenRoutes, y_BH: torch.Tensor, meta: Optional[torch.Tensor] = None):
        """Each slot's expert rows summed, back to the slot's source, then each token's rows
        from its owners summed: [T, H]; ``meta`` [slots, M]: one row per slot sent back as is,
        returned as [ep x tokens, M] (row ``p * tokens + t`` from rank p)."""
        y_BH = y_BH.contiguous()
        rows = self._peers("sources", self.size * routes.tokens, y_BH)
        sent = [(y_BH, routes.owner.rows_SK, rows)]
        if meta is not None:
            meta_peers = self._peers("sources-meta", meta.shape[0], meta)
            sent.append((meta, _all_slots(meta.shape[0], meta.device), meta_peers))
        self._stores(routes, sent)
        out_TH = torch.zeros(routes.tokens, y_BH.shape[1], dtype=y_BH.dtype, device=y_BH.device)
        sum_rows(rows.local, routes.from_owners_TP, out_TH)
        return out_TH, (meta_peers.local.clone() if meta is not None else None)

    def _stores(self, routes: TokenRoutes, sent) -> None:
        """barrier -> every (rows, slot index, peers) store -> barrier."""
        sent[0][2].handle.barrier(channel=0)  # every rank is done with what its buffers held
        for src, index, peers in sent:
            push_slots(src, index, peers.bases, rank=self.rank, ep=self.size, tokens=routes.tokens)
        sent[0][2].handle.barrier(channel=0)  # every row has landed

    def _peers(self, direction: str, rows: int, like: torch.Tensor) -> _Peers:
        shape = (rows, *like.shape[1:])
        # An explicit device index: symmetric memory keys its state by device.
        device = torch.device("cuda", torch.cuda.current_device())
        key = (self.group.group_name, device.index, direction, shape, like.dtype)
        if key not in _BUFFERS:
            _BUFFERS[key] = _allocate(self.group.group_name, shape, like.dtype, device)
        return _BUFFERS[key]


def _all_slots(slots: int, device) -> torch.Tensor:
    """The slot index that sends every slot's own row."""
    return torch.arange(slots, device=device).view(-1, 1)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, routes, x_TH, probs_TE):
        ctx.exchange, ctx.routes, ctx.probs_dtype = exchange, routes, probs_TE.dtype
        x_BH, owner = exchange.spread(routes, x_TH, meta=routes.metadata(probs_TE))
        return x_BH, owner.probs_B.to(probs_TE.dtype)

    @staticmethod
    def backward(ctx, dx_BH, dprobs_B):
        routes, owner = ctx.routes, ctx.routes.owner
        if dprobs_B is None:
            dprobs_B = torch.zeros(dx_BH.shape[0], dtype=torch.float32, device=dx_BH.device)
        # Each slot's probs' gradients by local expert (0 where not picked), back to its source.
        dprobs_SL = torch.where(owner.picked_SL, dprobs_B.float()[owner.rows_SL.clamp(min=0)], 0.0)
        dx_TH, dprobs_XL = ctx.exchange.gather(routes, dx_BH, meta=dprobs_SL)
        # Row p * tokens + t holds token t's gradients for rank p's experts.
        dprobs_TE = dprobs_XL.view(routes.ep, routes.tokens, routes.local).transpose(0, 1)
        return None, None, dx_TH, dprobs_TE.reshape(routes.tokens, -1).to(ctx.probs_dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, routes, y_BH):
        ctx.exchange, ctx.routes = exchange, routes
        out_TH, _ = exchange.gather(routes, y_BH)
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):
        dy_BH, _ = ctx.exchange.spread(ctx.routes, dout_TH)
        return None, None, dy_BH


# --- kernels ---------------------------------------------------------------------------------


# The store kernel's tile: rows per program and warps (on H200s over NVLink, 1-8 rows and 4-16
# warps were within 10 % of each other, 8 x 8 the steadiest); columns go BLOCK at a time.
# benchmarks/exchange_stores.py measures them.
PUSH_ROWS_PER_PROGRAM = 8
PUSH_WARPS = 8


def push_slots(src_RC: torch.Tensor, index_XK: torch.Tensor, bases_P: torch.Tensor, *, rank: int, ep: int,
               tokens: int, rows_per_program: int = PUSH_ROWS_PER_PROGRAM, num_warps: int = PUSH_WARPS,
               programs: Optional[int] = None) -> None:
    """For each slot x = p * tokens + t (p < ep): the sum (fp32, in k order, cast back) of the
    rows ``index_XK[x, k]`` >= 0 of ``src_RC``, stored at row ``rank * tokens + t`` of rank p's
    buffer (address ``bases_P[p]``); slots with no index >= 0 store nothing. Rank p's slots go
    out in the order p = rank + 1, rank + 2, ..., rank (every sender starts on a different
    rank, so no rank's links take every sender's stores at once). ``programs``: at most this
    many programs, each looping over tiles (fewer SMs); by default one per tile."""
    _push(src_RC, index_XK, bases_P, None, rank, ep, tokens, rows_per_program, num_warps, programs)


def sum_rows(src_RC: torch.Tensor, index_TK: torch.Tensor, out_TC: torch.Tensor, zero_empty: bool = False) -> None:
    """``out_TC[t]`` = the sum (fp32, in k order, cast back) of the rows ``index_TK[t, k]`` >= 0
    of ``src_RC``; rows of ``out_TC`` with no index >= 0 are zeroed with ``zero_empty``, else
    left as they are."""
    _push(src_RC, index_TK, None, out_TC, 0, 1, out_TC.shape[0], PUSH_ROWS_PER_PROGRAM, PUSH_WARPS, None,
          zero_empty)


def _push(src_RC, index_XK, bases_P, out_TC, rank, ep, tokens, rows_per_program, num_warps, programs,
          zero_empty=False):
    cols = src_RC[0].numel() if src_RC.shape[0] else 0
    if not tokens or not cols:
        return
    assert index_XK.dtype == torch.int64 and index_XK.is_contiguous() and index_XK.shape[0] == ep * tokens
    tile_rows = min(triton_next_pow2(rows_per_program), triton_next_pow2(tokens))
    block = max(1, min(4096 // tile_rows, triton_next_pow2(cols)))
    row_bytes = cols * src_RC.element_size()
    tiles = ep * -(-tokens // tile_rows)
    local = out_TC is not None
    _triton_kernels()[0][(min(tiles, programs or tiles),)](
        src_RC, index_XK, bases_P if not local else index_XK, out_TC if local else src_RC,
        rank, ep, tokens, cols, row_bytes, K=index_XK.shape[1], LOCAL=local, ALIGNED=row_bytes % 16 == 0,
        ZERO_EMPTY=zero_empty, ROWS=tile_rows, BLOCK=block, num_warps=num_warps if tile_rows * block >= 1024 else 1)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def push_slots_kernel(src_ptr, index_ptr, bases_ptr, out_ptr, rank, ep, tokens, cols, row_bytes,
                          K: tl.constexpr, LOCAL: tl.constexpr, ALIGNED: tl.constexpr, ZERO_EMPTY: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # Tiles in peer order (rank + 1 first, this rank last), taken from both ends in turn:
        # the stores into this rank's own buffer run beside the NVLink ones, not after them.
        tiles_per_peer = tl.cdiv(tokens, ROWS)
        tiles = tiles_per_peer * ep
        for turn in range(tl.program_id(0), tiles, tl.num_programs(0)):
            tile = tl.where(turn % 2 == 0, turn // 2, tiles - 1 - turn // 2)
            peer = (rank + 1 + tile // tiles_per_peer) % ep
            t_R = (tile % tiles_per_peer) * ROWS + tl.arange(0, ROWS)
            inside_R = t_R < tokens
            slot_R = (peer * tokens + t_R).to(tl.int64)
            if LOCAL:
                out_R = out_ptr + t_R.to(tl.int64) * cols
            else:
                # The peer's row addresses as integers: their alignment (16 B rows) lets the
                # stores over NVLink go out 16 B at a time.
                address_R = tl.load(bases_ptr + peer) + (rank * tokens + t_R).to(tl.int64) * row_bytes
                if ALIGNED:
                    address_R = tl.multiple_of(address_R, 16)
                out_R = address_R.to(tl.pointer_type(src_ptr.dtype.element_ty))
            for col0 in range(0, cols, BLOCK):
                col = col0 + tl.arange(0, BLOCK)
                in_col = col < cols
                acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
                sent_R = tl.zeros((ROWS,), dtype=tl.int32)
                for k in tl.static_range(K):
                    row_R = tl.load(index_ptr + slot_R * K + k, mask=inside_R, other=-1)
                    valid_R = row_R >= 0
                    values = tl.load(src_ptr + row_R[:, None] * cols + col[None, :],
                                     mask=valid_R[:, None] & in_col[None, :], other=0.0)
                    acc += values.to(tl.float32)
                    sent_R = tl.maximum(sent_R, valid_R.to(tl.int32))
                if ZERO_EMPTY:
                    sent_R = tl.where(inside_R, 1, sent_R)
                tl.store(out_R[:, None] + col[None, :], acc.to(src_ptr.dtype.element_ty),
                         mask=(sent_R > 0)[:, None] & in_col[None, :])

    return (push_slots_kernel,)
