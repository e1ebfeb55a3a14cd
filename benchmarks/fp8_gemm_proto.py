"""Prototype: FP8 grouped GEMM in Triton (persistent, TMA, tiles over expert segments) vs
torch._scaled_grouped_mm and bf16 torch._grouped_mm, fprop form y_TN = x_TK @ w_ENK[e]^T."""

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_fp8_nt(a_ptr, b_ptr, c_ptr, ends_ptr, tile_ends_ptr, sa_ptr, sb_ptr, T, N, K,
                    E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    NUM_SMS: tl.constexpr, ROWWISE_A: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    total = tl.load(tile_ends_ptr + E - 1) * n_tiles
    for t in range(pid, total, NUM_SMS):
        mt = t // n_tiles
        nt = t % n_tiles
        lo = 0
        hi = E - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(tile_ends_ptr + mid) > mt:
                hi = mid
            else:
                lo = mid + 1
        e = lo
        tiles_before = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        m0 = start + (mt - tiles_before) * BM
        n0 = nt * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([m0, k])
            b = b_desc.load([e * N + n0, k])
            acc = tl.dot(a, b.T, acc)
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        if ROWWISE_A:
            sa = tl.load(sa_ptr + rows, mask=rows < end, other=0.0)[:, None]
        else:
            sa = tl.load(sa_ptr + e)
        sb = tl.load(sb_ptr + e)
        out = (acc * sa * sb).to(tl.bfloat16)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], out, mask=mask)


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def grouped_fp8_nt(a_TK, b_ENK, ends_E, sa, sb, BM=128, BN=128, BK=128, stages=4, warps=8):
    triton.set_allocator(_alloc)
    T, K = a_TK.shape
    E, N, _ = b_ENK.shape
    counts = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    tile_ends = torch.cumsum((counts + BM - 1) // BM, 0).to(torch.int32)
    c = torch.empty(T, N, device=a_TK.device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _grouped_fp8_nt[(sms,)](a_TK, b_ENK, c, ends_E, tile_ends, sa, sb, T, N, K, E=E, BM=BM, BN=BN, BK=BK,
                            NUM_SMS=sms, ROWWISE_A=sa.numel() == T, num_stages=stages, num_warps=warps)
    return c


def ends_for(tokens, experts, align=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(experts, generator=g) + 0.5
    counts = torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=g).bincount(minlength=experts)
    counts = (counts + align - 1) // align * align
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), int(counts.sum())


def timeit(fn, iters=20):
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


SHAPES = {  # name: (routed rows, experts, K, N)
    "qwen3-fc1": (32768 * 8, 128, 2048, 1536), "qwen3-fc2": (32768 * 8, 128, 768, 2048),
    "deepseek-fc1": (32768 * 6, 64, 2048, 2816), "deepseek-fc2": (32768 * 6, 64, 1408, 2048),
    "mixtral-fc1": (32768 * 2, 8, 4096, 28672), "mixtral-fc2": (32768 * 2, 8, 14336, 4096),
}


def main():
    configs = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 64, 5, 4)]
    for name, (rows, E, K, N) in SHAPES.items():
        ends, T = ends_for(rows, E)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn)
        sa_T = torch.ones(T, device="cuda")
        sb_EN = torch.ones(E, N, device="cuda")
        sb_E = torch.ones(E, device="cuda")
        flops = 2.0 * T * K * N
        ref = torch._grouped_mm(x8.to(torch.bfloat16), w8.to(torch.bfloat16).transpose(1, 2), offs=ends)
        line = {"shape": name, "rows": T, "E": E, "K": K, "N": N}
        bf16_ms = timeit(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=ends))
        line["bf16_grouped_mm"] = {"ms": round(bf16_ms, 3), "tflops": round(flops / bf16_ms / 1e9, 1)}
        try:
            scaled = lambda: torch._scaled_grouped_mm(x8, w8.transpose(1, 2), sa_T, sb_EN, offs=ends,
                                                      out_dtype=torch.bfloat16, use_fast_accum=True)
            err = (scaled().float() - ref.float()).abs().max().item()
            ms = timeit(scaled)
            line["scaled_grouped_mm"] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "max_abs": err}
        except Exception as exc:  # noqa: BLE001 - a prototype's table says what failed
            line["scaled_grouped_mm"] = {"error": str(exc)[:300]}
        best = None
        for cfg in configs:
            try:
                fn = lambda: grouped_fp8_nt(x8, w8, ends, sa_T, sb_E, *cfg)
                out = fn()
                err = (out.float() - ref.float()).abs().max().item()
                ms = timeit(fn)
                entry = {"cfg": cfg, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "max_abs": err}
            except Exception as exc:  # noqa: BLE001
                entry = {"cfg": cfg, "error": str(exc)[-400:]}
            line.setdefault("triton", []).append(entry)
            if "ms" in entry and (best is None or entry["ms"] < best["ms"]):
                best = entry
        line["triton_best"] = best
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
