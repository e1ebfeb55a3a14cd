"""F12's store kernel alone, on every rank of a torchrun job (one NVLink node):

    torchrun --nproc-per-node 4 benchmarks/exchange_stores.py --out results.jsonl

Each rank routes ``--tokens`` tokens to top-k of ``--experts`` experts at random (a
Qwen3-like dispatch by default), runs one real dispatch to learn the owners' rows, then times
``push_slots`` alone both ways: the dispatch's token rows to their owners (each token once
per owner) and the combine's per-owner sums back to the sources, for several tiles (rows
per program x warps) and program caps (what the stores reach on fewer SMs). Rank 0 prints
one JSON line per case and rank: the median ms of one store pass, the bytes that went to
other ranks per ms (GB/s), the rows a row-per-(token, expert) exchange would have sent to
other ranks, and whether the buffers hold the same bits as in the direction's first case.
A line per rank times torch's own copy of the dispatch's byte count into the next
rank's mapped buffer (one contiguous block, every rank at once), the ceiling for stores
over NVLink on this machine.

The last lines per rank ask what an overlap of the exchange with the expert GEMMs can win
(issue #45): the owners' FC1 grouped GEMM alone (``--ffn`` per expert, gated), the dispatch's
move alone, and both at once on two streams, for two movers: the store kernel (SMs) and
copy engines (``copy_`` of this rank's whole token block into each peer's slots: no SMs, and
the rows no expert of that peer picked cross too). ``overlap`` is (GEMM + move) / together:
2 when the move hides entirely behind the GEMM, 1 when they run one after the other.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from megatron.moe_patches.dispatch.symmetric_exchange import SymmetricExchange, push_slots  # noqa: E402
from megatron.moe_patches.testing.layer_harness import init_expert_parallel  # noqa: E402

TILES = ((4, 8), (8, 8), (8, 16), (16, 8))
PROGRAMS = (32, 66, 132, 264)  # the default tile (8 rows x 8 warps)


def timed(step, barrier, iters: int) -> float:
    """Median ms of ``step`` between two barriers (every rank stores at once, as in a layer)."""
    times = []
    for _ in range(iters):
        barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        barrier()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768, help="each expert's FFN size (FC1 is gated: 2x this)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--overlap-only", action="store_true",
                        help="time only the GEMM, the moves and the two at once (not every tile and program cap)")
    parser.add_argument("--out", default=None, help="rank 0 also appends the JSON lines to this file")
    args = parser.parse_args(argv)

    init_expert_parallel()
    rank, ep = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator(device="cuda").manual_seed(rank)
    scores_TE = torch.rand(args.tokens, args.experts, device="cuda", generator=generator)
    routing_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, scores_TE.topk(args.topk, 1).indices, True)
    exchange = SymmetricExchange(dist.group.WORLD, args.topk)
    routes = exchange.routes(routing_TE)
    x_TH = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    exchange.dispatch(routes, x_TH, scores_TE * routing_TE)  # the owners' rows (routes.owner)
    y_BH = torch.randn(routes.rows_bound, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    row_bytes = args.hidden * x_TH.element_size()
    slots_P = lambda index_XK: (index_XK >= 0).any(dim=1).view(ep, args.tokens).sum(dim=1)  # noqa: E731
    rows_per_expert_to_peers = int(routing_TE.view(args.tokens, ep, -1)[:, [p for p in range(ep) if p != rank]].sum())
    directions = {  # rows, slot index, the buffers' direction and rows
        "to owners": (x_TH, routes.to_owners_X1, "owners", ep * args.tokens),
        "to sources": (y_BH, routes.owner.rows_SK, "sources", ep * args.tokens),
    }
    rows = []
    for direction, (src, index, buffer_name, buffer_rows) in ({} if args.overlap_only else directions).items():
        peers = exchange._peers(buffer_name, buffer_rows, src)
        sent_P = slots_P(index)
        peer_bytes = int(sent_P.sum() - sent_P[rank]) * row_bytes
        barrier = lambda: peers.handle.barrier(channel=0)  # noqa: E731
        first = None
        cases = [dict(rows_per_program=r, num_warps=w) for r, w in TILES] + [dict(programs=n) for n in PROGRAMS]
        for case in cases:
            step = lambda: push_slots(src, index, peers.bases, rank=rank, ep=ep, tokens=args.tokens, **case)  # noqa: E731
            timed(step, barrier, 3)  # compile and warm up
            ms = timed(step, barrier, args.iters)
            held = peers.local.clone()
            first = held if first is None else first
            rows.append(dict(rank=rank, ep=ep, kernel="push_slots", direction=direction, **case, ms=round(ms, 3),
                             gb_per_s_to_peers=round(peer_bytes / ms / 1e6), rows_to_peers=peer_bytes // row_bytes,
                             rows_per_expert_to_peers=rows_per_expert_to_peers, same_bits=torch.equal(held, first)))
    peers = exchange._peers("owners", ep * args.tokens, x_TH)
    dispatch_rows = int(slots_P(routes.to_owners_X1).sum() - slots_P(routes.to_owners_X1)[rank])
    block = torch.randn(dispatch_rows, args.hidden, device="cuda", dtype=torch.bfloat16)
    peer_view = peers.handle.get_buffer((rank + 1) % ep, tuple(peers.local.shape), peers.local.dtype)
    ms = timed(lambda: peer_view[:dispatch_rows].copy_(block), lambda: peers.handle.barrier(channel=0), args.iters)
    rows.append(dict(rank=rank, ep=ep, kernel="torch copy_ into a peer buffer", ms=round(ms, 3),
                     gb_per_s_to_peers=round(dispatch_rows * row_bytes / ms / 1e6), rows_to_peers=dispatch_rows))
    rows += overlap_rows(args, exchange, routes, x_TH, peers, rank, ep)
    device = torch.cuda.get_device_name()
    gathered = [None] * ep
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        sink = open(args.out, "a") if args.out else None
        for row in (r for per_rank in gathered for r in per_rank):
            line = json.dumps(dict(row, tokens=args.tokens, topk=args.topk, experts=args.experts,
                                   hidden=args.hidden, device=device))
            print(line, flush=True)
            if sink:
                sink.write(line + "\n")
        if sink:
            sink.close()
    dist.barrier()
    dist.destroy_process_group()


def overlap_rows(args, exchange, routes, x_TH, peers, rank: int, ep: int) -> list:
    """The owners' FC1 GEMM, the dispatch's move (stores or copy engines) and both at once."""
    local = args.experts // ep
    w_LOI = torch.randn(local, 2 * args.ffn, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    x_BH = torch.randn(routes.rows_bound, args.hidden, device="cuda", dtype=torch.bfloat16)
    offsets_L = torch.cumsum(routes.owner.tokens_per_local_expert, 0, dtype=torch.int32)
    views = [peers.handle.get_buffer(p, tuple(peers.local.shape), peers.local.dtype) for p in range(ep)]
    block = slice(rank * args.tokens, (rank + 1) * args.tokens)
    side = torch.cuda.Stream()

    def gemm():
        torch._grouped_mm(x_BH, w_LOI.transpose(1, 2), offs=offsets_L)

    movers = {
        "stores": lambda: push_slots(x_TH, routes.to_owners_X1, peers.bases, rank=rank, ep=ep, tokens=args.tokens),
        "copy engines": lambda: [views[(rank + 1 + i) % ep][block].copy_(x_TH) for i in range(ep)],
    }

    def together(move):
        def step():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                move()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return step

    barrier = lambda: peers.handle.barrier(channel=0)  # noqa: E731
    timed(gemm, barrier, 3)
    gemm_ms = timed(gemm, barrier, args.iters)
    rows = [dict(rank=rank, ep=ep, kernel="FC1 grouped GEMM alone", ms=round(gemm_ms, 3),
                 rows=int(offsets_L[-1]))]
    for name, move in movers.items():
        timed(move, barrier, 3)
        move_ms = timed(move, barrier, args.iters)
        timed(together(move), barrier, 3)
        both_ms = timed(together(move), barrier, args.iters)
        rows.append(dict(rank=rank, ep=ep, kernel=f"dispatch by {name} beside FC1", move_ms=round(move_ms, 3),
                         gemm_ms=round(gemm_ms, 3), together_ms=round(both_ms, 3),
                         overlap=round((move_ms + gemm_ms) / both_ms, 3)))
    return rows


if __name__ == "__main__":
    main()
