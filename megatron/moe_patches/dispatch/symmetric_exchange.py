"""F12: the expert-parallel exchange whose split sizes never leave the GPU.

megatron-core's alltoall dispatcher sends tokens with NCCL's ``all_to_all_single``, whose
split sizes are host lists: every MoE layer waits for the router's counts to reach the
host, and then sorts the received chunks by local expert. With ``moe_symmetric_exchange``
the ranks of one NVLink node write each other's memory instead (PyTorch symmetric memory,
mapped peer buffers): every rank stores its per-expert counts into every peer's buffer,
derives on the GPU where each of its rows lands, and one Triton kernel stores each row
straight into its owner's receive buffer, already grouped by local expert. The experts get
device offsets; the chunk sort and the host sync are gone.

Layouts. A sender's rows come from the dispatcher's permute, sorted by global expert
``g = owner * local_experts + e``. An owner's rows are expert-major: local expert ``e``,
then source rank ``s``, then the sender's order. Combine sends each owner row back to the
sender's position, so the sender's unpermute is megatron-core's.

The owners' row count depends on the routing, so the received tensors have a static bound,
``ep x tokens x min(top-k, local experts)`` rows (every token of every rank could pick this
rank's experts): no allocation depends on device data and nothing waits for the host (what
a CUDA graph needs: F11 captures the layer with this exchange inside).
Rows past the received ones (the "tail") are zero in every tensor this exchange hands the
experts (tokens, probs, output gradients); the grouped GEMMs stop at the last offset, and
the weighted GLU (``weighted_glu``) writes zeros there, so the tail never reaches a result.

Buffers: one symmetric buffer per (group, direction, rows, columns, dtype), shared by all
layers (``_BUFFERS``). Each exchange is barrier -> store rows into the peers' buffers ->
barrier -> hand out. The dispatched tokens and probs are copied out (the experts save them
for the backward, and the copy zeroes the tail); every other exchange hands out the buffer
itself (the output gradients' tail zeroed in place), read by the next operations on this
rank's stream (the experts' backward, the unpermute, the permute's backward, the routing
math), which therefore run before this rank's next exchange through that buffer, whose
first barrier every peer waits for before storing into it. Two exchanges must never run at
once, and nothing may read a handed-out buffer later (megatron-core's EP overlap, the only
way to delay the experts' weight gradients, does both: refused).

Every EP rank must hold the same number of tokens (megatron-core's micro-batches do), and
the EP group must be one node with peer access between its GPUs.
"""

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import torch

# Whether this exchange runs for a config (and why not) is the plan's to say
# (``plan.symmetric_exchange_blocker``, ``plan.exchange_config_errors``).

# --- where rows go --------------------------------------------------------------------------


class RowChunks(NamedTuple):
    """One direction's routing of rows, all on the device, in the order they are sent: chunk
    c holds the sender's rows ``src_C[c]`` onwards, ``ends_C[c] - ends_C[c-1]`` of them
    (``ends_C``: the inclusive scan of the chunk sizes in sending order), and goes to rank
    ``peer_C[c]``, starting at row ``dest_C[c]`` of that rank's buffer. Contiguous int64 (the
    kernel indexes them)."""

    ends_C: torch.Tensor
    src_C: torch.Tensor
    dest_C: torch.Tensor
    peer_C: torch.Tensor

    @classmethod
    def of(cls, ends_C, src_C, dest_C, peer_C) -> "RowChunks":
        return cls(*(t.to(torch.int64).contiguous() for t in (ends_C, src_C, dest_C, peer_C)))

    @classmethod
    def shifted(cls, sizes_C, dest_C, peer_C, rank: int, ep: int) -> "RowChunks":
        """Chunks that lie in the sender's rows back to back (sizes ``sizes_C``), sent peer by
        peer from the next rank on (rank + 1, rank + 2, ..., this rank last). Every sender
        starts on a different owner, so no owner's links take the stores of all senders at
        once while other owners' links idle (rows sorted by owner, which every sender would
        start from, do that at EP > 2)."""
        src_C = torch.cumsum(sizes_C, 0) - sizes_C
        order_C = torch.argsort((peer_C - rank - 1) % ep, stable=True)  # peer_C is fixed: a fixed order
        sizes_C = sizes_C[order_C]
        return cls.of(torch.cumsum(sizes_C, 0), src_C[order_C], dest_C[order_C], peer_C[order_C])


class ExchangePlan:
    """Both directions' routing for one dispatch, from the EP group's per-expert counts.

    ``counts_SE[s, g]``: rows rank s sends to global expert g. Owner p's buffer is
    expert-major: ``starts[p][e, s]`` = rows of p's local experts before e, plus rows of
    expert e from ranks before s.
    """

    def __init__(self, counts_SE: torch.Tensor, rank: int, rows_sent: int, rows_bound: int):
        ep, experts = counts_SE.shape
        local = experts // ep
        device = counts_SE.device
        # [owner p, (local expert e, source s)]: what each owner receives, in its layout.
        received_PX = counts_SE.view(ep, ep, local).permute(1, 2, 0).reshape(ep, local * ep)
        starts_PX = torch.cumsum(received_PX, dim=1) - received_PX
        # Dispatch: this rank's chunks are its global experts g = p * local + e.
        self.to_owners = RowChunks.shifted(
            sizes_C=counts_SE[rank],
            dest_C=starts_PX.view(ep, local, ep)[:, :, rank].reshape(experts),
            peer_C=torch.arange(experts, device=device) // local,
            rank=rank, ep=ep,
        )
        # Combine: this rank's chunks are (e, s); each goes back to where s sent it from.
        sent_starts_SE = torch.cumsum(counts_SE, dim=1) - counts_SE
        self.to_sources = RowChunks.shifted(
            sizes_C=received_PX[rank],
            dest_C=sent_starts_SE[:, rank * local:(rank + 1) * local].t().reshape(local * ep),
            peer_C=torch.arange(local * ep, device=device) % ep,
            rank=rank, ep=ep,
        )
        self.rows_used = self.to_sources.ends_C[-1:]  # the rows this rank receives
        self.tokens_per_local_expert = received_PX[rank].view(local, ep).sum(dim=1)
        self.rows_sent = rows_sent  # the sender's rows: tokens x top-k
        self.rows_bound = rows_bound  # the owners' (received) tensors' row count


def owner_rows_bound(ep: int, tokens: int, topk: int, local_experts: int) -> int:
    """The most rows one rank can receive: each token of each rank sends at most
    min(top-k, local experts) rows to one rank."""
    return ep * tokens * min(topk, local_experts)


# --- the exchange ---------------------------------------------------------------------------


class _Peers(NamedTuple):
    local: torch.Tensor  # this rank's buffer
    bases: torch.Tensor  # [ep] int64: every rank's buffer address, mapped here
    handle: object  # torch's symmetric-memory handle (its barrier)


# Every exchange of a process group (one per MoE layer) uses the same buffers: exchanges run
# one at a time, and each copies its result out before the next one's first barrier.
_BUFFERS: Dict[Tuple, _Peers] = {}


class SymmetricExchange:
    """Rows to their owners and back through peer-mapped buffers (see the module text)."""

    def __init__(self, ep_group, topk: int):
        self.group = ep_group
        self.topk = topk
        self._counts_route: Optional[RowChunks] = None

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def plan(self, counts_E: torch.Tensor, tokens: int) -> ExchangePlan:
        """Gather every rank's per-expert counts (on the device) and route."""
        local = counts_E.numel() // self.size
        bound = owner_rows_bound(self.size, tokens, self.topk, local)
        return ExchangePlan(self.gather_counts(counts_E), self.rank, tokens * self.topk, bound)

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """[ep, experts]: row s is rank s's ``counts_E``. The same stores as the rows (one
        copy of this rank's row per peer, landing at row ``rank``), not NCCL: a CUDA graph
        that captured an NCCL collective keeps its communicator from being destroyed."""
        copies_PE = counts_E.to(torch.int64).expand(self.size, -1)
        (counts_SE,) = self._send(self._count_chunks(counts_E.device), self.size, "counts", [copies_PE])
        return counts_SE

    def _count_chunks(self, device) -> RowChunks:
        if self._counts_route is None:  # made once, in the first (eager) call
            peers = torch.arange(self.size, device=device)
            self._counts_route = RowChunks.of(ends_C=peers + 1, src_C=peers, dest_C=torch.full_like(peers, self.rank),
                                              peer_C=peers)
        return self._counts_route

    def dispatch(self, plan: ExchangePlan, x_RH: torch.Tensor, probs_R: torch.Tensor):
        """Sender rows (sorted by global expert) -> [bound, H] owner rows and probs."""
        return _ToOwners.apply(self, plan, x_RH, probs_R)

    def combine(self, plan: ExchangePlan, y_BH: torch.Tensor) -> torch.Tensor:
        """Owner rows -> the sender's [tokens x top-k, H] rows, in its dispatch order."""
        return _ToSources.apply(self, plan, y_BH)

    # The two directions; each backward is the other.

    def send_to_owners(self, plan: ExchangePlan, *tensors, keep: bool):
        """The owners' [bound, ...] tensors, rows past the received ones zero. ``keep``: copies
        (the experts save the tokens for the backward); otherwise the buffers themselves."""
        received = self._send(plan.to_owners, plan.rows_bound, "owners", tensors)
        if keep:
            return [copy_rows_zero_tail(r, plan.rows_used) for r in received]
        return [zero_rows_from(r, plan.rows_used) for r in received]

    def send_to_sources(self, plan: ExchangePlan, *tensors):
        return self._send(plan.to_sources, plan.rows_sent, "sources", tensors)

    def _send(self, chunks: RowChunks, rows_out: int, direction: str, tensors):
        """Each tensor's rows to their places in the peers' ``rows_out``-row buffers; returns
        this rank's buffers (valid until this direction's next exchange)."""
        tensors = [t.contiguous() for t in tensors]
        peers = [self._peers(direction, rows_out, t) for t in tensors]
        peers[0].handle.barrier(channel=0)  # every rank is done with what its buffers held
        for t, p in zip(tensors, peers):
            push_rows(t, chunks, p.bases)
        peers[0].handle.barrier(channel=0)  # every row has landed
        return [p.local.detach() for p in peers]  # a new tensor object on the same storage

    def _peers(self, direction: str, rows: int, like: torch.Tensor) -> _Peers:
        shape = (rows, *like.shape[1:])
        # An explicit device index: symmetric memory keys its state by device.
        device = torch.device("cuda", torch.cuda.current_device())
        key = (self.group.group_name, device.index, direction, shape, like.dtype)
        if key not in _BUFFERS:
            _BUFFERS[key] = _allocate(self.group.group_name, shape, like.dtype, device)
        return _BUFFERS[key]


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


class _ToOwners(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, plan, x_RH, probs_R):
        ctx.exchange, ctx.plan = exchange, plan
        x_BH, probs_B = exchange.send_to_owners(plan, x_RH, probs_R, keep=True)
        return x_BH, probs_B

    @staticmethod
    def backward(ctx, dx_BH, dprobs_B):
        if dprobs_B is None:
            dprobs_B = torch.zeros(dx_BH.shape[0], dtype=torch.float32, device=dx_BH.device)
        dx_RH, dprobs_R = ctx.exchange.send_to_sources(ctx.plan, dx_BH, dprobs_B)
        return None, None, dx_RH, dprobs_R


class _ToSources(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange, plan, y_BH):
        ctx.exchange, ctx.plan = exchange, plan
        (y_RH,) = exchange.send_to_sources(plan, y_BH)
        return y_RH

    @staticmethod
    def backward(ctx, dy_RH):
        (dy_BH,) = ctx.exchange.send_to_owners(ctx.plan, dy_RH, keep=False)  # read once, by the experts' backward
        return None, None, dy_BH


# --- kernels ---------------------------------------------------------------------------------


# The store kernel's tile: rows per program and warps (on H200s over NVLink, 1-8 rows and 4-16
# warps were within 10 % of each other, 8 x 8 the steadiest, 16 rows slower); columns go BLOCK
# at a time. benchmarks/exchange_stores.py measures them.
PUSH_ROWS_PER_PROGRAM = 8
PUSH_WARPS = 8


def push_rows(x_RC: torch.Tensor, chunks: RowChunks, bases_P: torch.Tensor,
              rows_per_program: int = PUSH_ROWS_PER_PROGRAM, num_warps: int = PUSH_WARPS,
              programs: Optional[int] = None) -> None:
    """Store the rows of each chunk c of ``x_RC`` (a 1-D tensor is one column), from row
    ``src[c]`` on, at rows ``dest[c]`` on of rank ``peer[c]``'s buffer (address
    ``bases_P[peer]``). Rows in no chunk are not sent. ``programs``: at most this many
    programs, each taking every ``programs``-th tile (fewer SMs, e.g. beside a GEMM); by
    default one program per tile of ``x_RC``."""
    rows = x_RC.shape[0]
    cols = x_RC[0].numel() if rows else 0
    if not rows or not cols:
        return
    kernel = _triton_kernels()[0]
    chunks_count = chunks.ends_C.numel()
    tile_rows = min(triton_next_pow2(rows_per_program), triton_next_pow2(rows))
    block = max(1, min(4096 // tile_rows, triton_next_pow2(cols)))
    row_bytes = cols * x_RC.element_size()
    tiles = -(-rows // tile_rows)
    kernel[(min(tiles, programs or tiles),)](
        x_RC, chunks.ends_C, chunks.src_C, chunks.dest_C, chunks.peer_C, bases_P, cols, row_bytes,
        ALIGNED=row_bytes % 16 == 0, CHUNKS=chunks_count, CHUNKS_P2=triton_next_pow2(chunks_count),
        ROWS=tile_rows, BLOCK=block, num_warps=num_warps if tile_rows * block >= 1024 else 1)


def copy_rows_zero_tail(buffer_BC: torch.Tensor, rows_used: torch.Tensor) -> torch.Tensor:
    """A copy of ``buffer_BC`` with the rows from ``rows_used`` (a 1-element device tensor) on
    zeroed: the rows past the received ones are whatever an earlier exchange left."""
    out = torch.empty_like(buffer_BC)
    _rows_from(buffer_BC, out, rows_used, copy=True)
    return out


def zero_rows_from(buffer_BC: torch.Tensor, rows_used: torch.Tensor) -> torch.Tensor:
    """``buffer_BC`` with the rows from ``rows_used`` on zeroed in place (the others kept)."""
    _rows_from(buffer_BC, buffer_BC, rows_used, copy=False)
    return buffer_BC


def _rows_from(src_BC, out_BC, rows_used, copy: bool) -> None:
    rows = src_BC.shape[0]
    cols = src_BC[0].numel() if rows else 0
    if rows and cols:
        block = min(4096, triton_next_pow2(cols))
        _triton_kernels()[1][(rows,)](src_BC, out_BC, rows_used, cols, COPY=copy, BLOCK=block,
                                      num_warps=4 if block >= 1024 else 1)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def push_rows_kernel(x_ptr, ends_ptr, src_ptr, dest_ptr, peer_ptr, bases_ptr, cols, row_bytes,
                         ALIGNED: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        # Tiles of the rows sent (row_R counts along the sending order), as many as the chunks
        # hold (the tensor's rows may be a bound). Programs take them from both ends in turn:
        # this rank's own rows come last, so its stores into its own buffer run beside the
        # NVLink ones, not after them.
        c_C = tl.arange(0, CHUNKS_P2)
        ends_C = tl.load(ends_ptr + c_C, mask=c_C < CHUNKS, other=0)
        rows_sent = tl.load(ends_ptr + CHUNKS - 1)
        tiles = (rows_sent + ROWS - 1) // ROWS
        for turn in range(tl.program_id(0), tiles, tl.num_programs(0)):
            tile = tl.where(turn % 2 == 0, turn // 2, tiles - 1 - turn // 2)
            row_R = tile * ROWS + tl.arange(0, ROWS)
            sent_R = row_R < rows_sent
            # a row's chunk = how many chunks end at or before it (ends are inclusive scans)
            chunk_R = tl.sum(((ends_C[None, :] <= row_R[:, None]) & (c_C[None, :] < CHUNKS)).to(tl.int32), axis=1)
            start_R = tl.load(ends_ptr + chunk_R - 1, mask=sent_R & (chunk_R > 0), other=0)
            dest_R = tl.load(dest_ptr + chunk_R, mask=sent_R, other=0) + row_R - start_R
            src_R = tl.load(src_ptr + chunk_R, mask=sent_R, other=0) + row_R - start_R
            peer_R = tl.load(peer_ptr + chunk_R, mask=sent_R, other=0)
            # The peers' row addresses as integers: their alignment (16 B rows) lets the stores
            # over NVLink go out 16 B at a time.
            address_R = tl.load(bases_ptr + peer_R, mask=sent_R, other=0) + dest_R.to(tl.int64) * row_bytes
            if ALIGNED:
                address_R = tl.multiple_of(address_R, 16)
            out_R = address_R.to(tl.pointer_type(x_ptr.dtype.element_ty))
            for col0 in range(0, cols, BLOCK):
                col = col0 + tl.arange(0, BLOCK)
                mask = sent_R[:, None] & (col[None, :] < cols)
                values = tl.load(x_ptr + src_R[:, None].to(tl.int64) * cols + col[None, :], mask=mask)
                tl.store(out_R[:, None] + col[None, :], values, mask=mask)

    @triton.jit
    def copy_zero_tail_kernel(src_ptr, out_ptr, used_ptr, cols, COPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        keep = row < tl.load(used_ptr)
        if COPY or not keep:  # in place, the kept rows are already there
            for col0 in range(0, cols, BLOCK):
                col = col0 + tl.arange(0, BLOCK)
                inside = col < cols
                at = row.to(tl.int64) * cols + col
                values = tl.load(src_ptr + at, mask=inside & keep, other=0)
                tl.store(out_ptr + at, values, mask=inside)

    return push_rows_kernel, copy_zero_tail_kernel
