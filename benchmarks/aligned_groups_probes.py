"""Two probes for 128-row expert groups on one GPU (what DeepGEMM's grouped GEMM needs):

- ``permute``: Transformer Engine's permute kernel writing each expert's rows from a 128-row
  boundary with a static row count (tokens x top-k + experts x 127; the last expert's group
  takes the slack) and device-side pad offsets. It times the permute against the unpadded one
  and the zero fill of the padded buffer, captures permute + unpermute in a CUDA graph, replays
  it with another routing, and compares the rows and probs with TE's eager
  ``moe_permute_and_pad_with_probs`` (bitwise) and checks that the tail rows are zero.
  Needs Transformer Engine.
- ``deepgemm``: DeepGEMM's blockwise grouped fprop (device-side ends, "psum" layout) captured
  in a CUDA graph and replayed with other ends, against its eager call (bitwise) and the
  package's PyTorch twin of the recipe. Needs DeepGEMM.

    python3 benchmarks/aligned_groups_probes.py permute --out results.jsonl
    python3 benchmarks/aligned_groups_probes.py deepgemm --out results.jsonl

Nothing here is a test: no timing decides an outcome.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALIGN = 128


def mean_ms(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def routing(T, E, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=gen) + torch.linspace(0, 2, E, device="cuda")
    top = logits.topk(k, dim=1)
    map_TE = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, top.indices, True)
    probs_TE = torch.zeros(T, E, device="cuda").scatter_(1, top.indices, top.values.softmax(-1))
    return map_TE, probs_TE


def padded_counts(counts_E, rows):
    """Each expert's rows rounded up to ALIGN, the last expert taking the slack up to ``rows``
    (a static row count whatever the routing)."""
    padded_E = (counts_E + ALIGN - 1) // ALIGN * ALIGN
    padded_E[-1] += rows - padded_E.sum()
    return padded_E


def padded_layout(map_TE, rows):
    """``padded_counts`` of the routing map, and the rows each expert's group is shifted by
    (the permute's pad offsets)."""
    counts_E = map_TE.sum(0)
    padded_E = padded_counts(counts_E, rows)
    pads_E = padded_E - counts_E
    return padded_E, torch.cumsum(pads_E, 0) - pads_E


def probe_permute():
    from transformer_engine.pytorch import permutation as te_perm

    permute = torch.ops.te_moe.permute_mask_map_fwd
    for T, H, E, k in ((32768, 2048, 128, 8), (8192, 2048, 128, 8), (32768, 2048, 64, 6)):
        R, P = T * k, T * k + E * (ALIGN - 1)
        x_TH = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        map_TE, probs_TE = routing(T, E, k, 0)
        line = {"probe": "te_permute_padded_static_rows", "device": torch.cuda.get_device_name(),
                "T": T, "H": H, "E": E, "k": k, "rows": R, "padded_rows_bound": P}
        line["plain_ms"] = mean_ms(lambda: permute(x_TH, map_TE, R, probs_TE, None))
        _, offsets_E = padded_layout(map_TE, P)
        line["padded_static_ms"] = mean_ms(lambda: permute(x_TH, map_TE, P, probs_TE, offsets_E))
        line["zeros_alloc_ms"] = mean_ms(lambda: torch.zeros(P, H, device="cuda", dtype=torch.bfloat16))
        s_x, s_map, s_probs = x_TH.clone(), map_TE.clone(), probs_TE.clone()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and load every kernel before the capture
                for _ in range(2):
                    _, offs = padded_layout(s_map, P)
                    out, row_map, _ = permute(s_x, s_map, P, s_probs, offs)
                    te_perm.moe_unpermute(out, row_map, restore_shape=s_x.shape, pad_offsets=offs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                padded_E, offs = padded_layout(s_map, P)
                out, row_map, probs_R = permute(s_x, s_map, P, s_probs, offs)
                te_perm.moe_unpermute(out, row_map, restore_shape=s_x.shape, pad_offsets=offs)
            map2, probs2 = routing(T, E, k, 1)
            x2 = x_TH.flip(0).contiguous()
            s_x.copy_(x2)
            s_map.copy_(map2)
            s_probs.copy_(probs2)
            graph.replay()
            torch.cuda.synchronize()
            ref, ref_probs, _, _, ref_padded = te_perm.moe_permute_and_pad_with_probs(
                x2, probs2, map2, map2.sum(0), ALIGN)
            n = ref.shape[0]
            line["graph_replay_matches_eager_rows"] = bool(torch.equal(out[:n], ref))
            line["graph_replay_probs_match"] = bool(torch.equal(probs_R[:n], ref_probs))
            line["tail_rows_zero"] = bool((out[n:] == 0).all())
            line["padded_counts_match_except_last"] = bool(torch.equal(padded_E[:-1], ref_padded[:-1]))
            line["graph_ms"] = mean_ms(graph.replay)
        except Exception as exc:  # noqa: BLE001 - the line says what failed
            line["graph_error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        yield line


def probe_deepgemm():
    import deep_gemm

    from megatron.moe_patches.kernels import fp8_grouped_gemm as g
    from megatron.moe_patches.kernels import fp8_scaling as fs

    E, K, N, R = 128, 2048, 1536, 65536
    P = R + E * (ALIGN - 1)

    def ends_for(seed):
        gen = torch.Generator().manual_seed(seed)
        counts_E = torch.multinomial(torch.rand(E, generator=gen) + 0.5, R, replacement=True,
                                     generator=gen).bincount(minlength=E)
        return torch.cumsum(padded_counts(counts_E, P), 0).to(torch.int32).cuda()

    x_PK = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
    w_ENK = (torch.randn(E, N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    a8, sa = fs.quantize_1x128(x_PK)
    b8, sb = fs.quantize_128x128(w_ENK)
    sa_mn = deep_gemm.get_mn_major_tma_aligned_tensor(sa)
    ends_E = ends_for(0)
    y_PN = torch.empty(P, N, device="cuda", dtype=torch.bfloat16)

    def run():
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a8, sa_mn), (b8, sb), y_PN, ends_E, use_psum_layout=True)

    line = {"probe": "deepgemm_fprop_cuda_graph", "device": torch.cuda.get_device_name(),
            "E": E, "K": K, "N": N, "rows": P}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ends_E.copy_(ends_for(1))
        y_PN.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = y_PN.clone()
        want = g.fp8_grouped_nt_reference(a8, b8, ends_E, sa, sb, "blockwise")
        run()
        torch.cuda.synchronize()
        line["replay_equals_eager"] = bool(torch.equal(replayed, y_PN))
        err = (replayed.float() - want.float()).abs().max().item()
        line["replay_vs_reference_max_rel"] = err / want.float().abs().max().item()
    except Exception as exc:  # noqa: BLE001 - the line says what failed
        line["error"] = f"{type(exc).__name__}: {str(exc)[-500:]}"
    yield line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=("permute", "deepgemm"))
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    for line in (probe_permute() if args.probe == "permute" else probe_deepgemm()):
        text = json.dumps(line)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
