"""F12's store kernel alone, on every rank of a torchrun job (one NVLink node):

    torchrun --nproc-per-node 2 benchmarks/exchange_stores.py --out results.jsonl

Each rank routes ``--tokens`` tokens x top-k over ``--experts`` experts at random and stores
its rows into the owners' symmetric buffers with ``push_rows`` for several tiles (rows per
program x warps), the routing of a Qwen3-like dispatch by default, both ways (to the owners,
back to the sources), with the chunks in the plan's order (each sender starts at the next
rank) and in the sender's row order, then with fewer programs than tiles (what the stores
reach on fewer SMs). Rank 0 prints one JSON line per case and rank: the median ms of one
store pass, the bytes that went to other ranks per ms (GB/s), and whether the buffers hold
the same bits as in the direction's first case. A last line
per rank times torch's own copy of the same byte count into a peer's mapped buffer (one
contiguous block), the ceiling for stores over NVLink on this machine.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from megatron.moe_patches.dispatch.symmetric_exchange import RowChunks, SymmetricExchange, push_rows  # noqa: E402
from megatron.moe_patches.testing.layer_harness import init_expert_parallel  # noqa: E402

TILES = ((2, 8), (4, 8), (8, 8), (8, 16))
PROGRAMS = (16, 32, 66, 132, 264, 528)  # the default tile (8 rows x 8 warps)


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


def _by_sender_row(chunks: RowChunks):
    """The same chunks in the order of the sender's rows."""
    order_C = torch.argsort(chunks.src_C, stable=True)
    sizes_C = torch.diff(chunks.ends_C, prepend=chunks.ends_C.new_zeros(1))[order_C]
    return torch.cumsum(sizes_C, 0), chunks.src_C[order_C], chunks.dest_C[order_C], chunks.peer_C[order_C]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="rank 0 also appends the JSON lines to this file")
    args = parser.parse_args(argv)

    init_expert_parallel()
    rank, ep = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator(device="cuda").manual_seed(rank)
    scores_TE = torch.rand(args.tokens, args.experts, device="cuda", generator=generator)
    routing_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, scores_TE.topk(args.topk, 1).indices, True)
    exchange = SymmetricExchange(dist.group.WORLD, args.topk)
    plan = exchange.plan(routing_TE.sum(0), args.tokens)
    x_RH = torch.randn(args.tokens * args.topk, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    y_BH = torch.randn(plan.rows_bound, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    # Each direction: its rows, its peers' buffers, and its chunks in the plan's (shifted) order
    # and sorted by the sender's row (by owner, for dispatch: every sender starts at rank 0).
    directions = {
        "to owners": (x_RH, exchange._peers("owners", plan.rows_bound, x_RH), plan.to_owners),
        "to sources": (y_BH, exchange._peers("sources", plan.rows_sent, y_BH), plan.to_sources),
    }
    rows = []
    for direction, (rows_XH, peers, shifted) in directions.items():
        by_row = RowChunks.of(*_by_sender_row(shifted))
        sizes_C = torch.diff(shifted.ends_C, prepend=shifted.ends_C.new_zeros(1))
        peer_bytes = int(sizes_C[shifted.peer_C != rank].sum()) * args.hidden * rows_XH.element_size()
        barrier = lambda: peers.handle.barrier(channel=0)  # noqa: E731
        first = None
        for order, chunks in (("shifted", shifted), ("by sender row", by_row)):
            for rows_per_program, warps in TILES:
                step = lambda: push_rows(rows_XH, chunks, peers.bases, rows_per_program, warps)  # noqa: E731
                timed(step, barrier, 3)  # compile and warm up
                ms = timed(step, barrier, args.iters)
                held = peers.local.clone()
                first = held if first is None else first
                rows.append(dict(rank=rank, ep=ep, kernel="push_rows", direction=direction, order=order,
                                 rows_per_program=rows_per_program, warps=warps, ms=round(ms, 3),
                                 gb_per_s_to_peers=round(peer_bytes / ms / 1e6), same_bits=torch.equal(held, first)))
        # Fewer programs (SMs), each looping over tiles: what the stores reach beside a GEMM.
        for programs in PROGRAMS:
            step = lambda: push_rows(rows_XH, shifted, peers.bases, programs=programs)  # noqa: E731
            timed(step, barrier, 3)
            ms = timed(step, barrier, args.iters)
            rows.append(dict(rank=rank, ep=ep, kernel="push_rows", direction=direction, order="shifted",
                             programs=programs, ms=round(ms, 3), gb_per_s_to_peers=round(peer_bytes / ms / 1e6),
                             same_bits=torch.equal(peers.local, first)))
    x_RH, peers, chunks = directions["to owners"]
    sizes_C = torch.diff(chunks.ends_C, prepend=chunks.ends_C.new_zeros(1))
    peer_rows = int(sizes_C[chunks.peer_C != rank].sum())
    peer_bytes = peer_rows * args.hidden * x_RH.element_size()
    barrier = lambda: peers.handle.barrier(channel=0)  # noqa: E731
    peer_view = peers.handle.get_buffer((rank + 1) % ep, tuple(peers.local.shape), peers.local.dtype)
    ms = timed(lambda: peer_view[:peer_rows].copy_(x_RH[:peer_rows]), barrier, args.iters)
    rows.append(dict(rank=rank, ep=ep, kernel="torch copy_ into a peer buffer", ms=round(ms, 3),
                     gb_per_s_to_peers=round(peer_bytes / ms / 1e6)))
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


if __name__ == "__main__":
    main()
