"""The parts of an output tile that the grouped-GEMM kernels share, as Triton functions the
kernels call (Triton inlines them).

``parts()`` compiles them on first use (Triton is imported only there) and gives:

- ``bounds(m0, n0, m_end, n_end, BM, BN)``: the row and column indices of the [BM, BN] tile
  at (m0, n0), and whether each lies before ``m_end`` / ``n_end``.
- ``dot_step(acc, a, b, scale_rows, scale_cols, SCALED, FAST_ACCUM)``: ``acc`` plus
  ``a . b^T`` for one K block; times ``scale_rows * scale_cols`` (in that order, as
  broadcast) where SCALED, accumulated inside the dot where FAST_ACCUM.
- ``add_into(ptr, at, inside, acc)``: the fp32 values at ``ptr + at`` (where ``inside``) plus
  ``acc``, stored back: one read and one write of the output, in the epilogue.
"""

import functools
import types


@functools.lru_cache(maxsize=None)
def parts() -> types.SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def bounds(m0, n0, m_end, n_end, BM: tl.constexpr, BN: tl.constexpr):
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        return rows, cols, rows < m_end, cols < n_end

    @triton.jit
    def dot_step(acc, a, b, scale_rows, scale_cols, SCALED: tl.constexpr, FAST_ACCUM: tl.constexpr):
        if SCALED:
            acc += tl.dot(a, b.T) * scale_rows * scale_cols
        elif FAST_ACCUM:
            acc = tl.dot(a, b.T, acc)
        else:
            acc += tl.dot(a, b.T)
        return acc

    @triton.jit
    def add_into(ptr, at, inside, acc):
        tl.store(ptr + at, tl.load(ptr + at, mask=inside, other=0.0) + acc, mask=inside)

    return types.SimpleNamespace(bounds=bounds, dot_step=dot_step, add_into=add_into)
