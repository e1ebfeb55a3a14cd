"""Weight gradients added into Megatron's fp32 ``main_grad`` by the GEMM that computes them.

Megatron's DDP keeps one fp32 ``main_grad`` per parameter and, unless the weight-gradient
GEMM adds into it itself (``gradient_accumulation_fusion``), every micro-batch writes a bf16
``param.grad`` that a backward hook then adds: a bf16 write, its read, and a read and write
of the fp32 gradient, plus one hook per parameter. Fused, the GEMM reads and writes the fp32
gradient once and nothing else.

Two entry points:

- ``grouped_wgrad_into_main_grad``: the experts' grouped weight gradient,
  ``main_grad[e] += dy_TO[rows of e]^T @ x_TI[rows of e]`` for every local expert in one
  Triton kernel (fp32 accumulation; the old fp32 value is read and added once, in the
  epilogue), with the experts' rows as device offsets (no host sync, graph-safe). The
  targets are given as a device table of fp32 [O, I] addresses (``MainGradTable``), so the
  per-expert parameters' ``main_grad`` views need not be adjacent in DDP's buffer.
- ``APEX_WGRAD``: what megatron-core's non-TE linear layers take from APEX's
  ``fused_weight_gradient_mlp_cuda`` (``wgrad_gemm_accum_fp32`` and ``_fp16``), written on
  torch's ``addmm`` with an fp32 output (cuBLAS adds into C). apply() binds it where
  megatron-core looks for it when APEX is absent (registry entry F13).

Off CUDA or without Triton the twins compute the same sums in fp32 with PyTorch.
"""

import functools
import types
from typing import Dict, NamedTuple, Sequence, Tuple

import torch

from megatron.moe_patches.kernels import gemm_tile

# --- megatron-core's two APEX functions -----------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32 [out, in]) += grad_output^T @ total_input (bf16/fp16 [..., out] and [..., in])."""
    x_TI, dy_TO = _rows(total_input), _rows(grad_output)
    if main_grad.is_cuda:
        # cuBLAS reads C in fp32 and adds the product in the epilogue (beta = 1)
        torch.addmm(main_grad, dy_TO.t(), x_TI, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(dy_TO.t().float() @ x_TI.float())


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (bf16/fp16 [out, in]) += grad_output^T @ total_input, in main_grad's dtype."""
    main_grad.addmm_(_rows(grad_output).t().to(main_grad.dtype), _rows(total_input).to(main_grad.dtype))


# Bound as ``megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda``.
APEX_WGRAD = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                   wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)


class _FusionAvailable:
    """What ``layers._grad_accum_fusion_available`` holds while F13 is applied (the layers'
    constructor refuses the flag where it is falsy): true, and an object of its own, so that
    ``capabilities.stock`` tells it from megatron-core's own value."""

    def __bool__(self):
        return True

    def __repr__(self):
        return "True (moe_patches F13)"


FUSION_AVAILABLE = _FusionAvailable()


# --- the experts' grouped weight gradient ---------------------------------------------------


class MainGradTable:
    """The fp32 ``main_grad`` of each expert's [O, I] weight, as a device table of addresses.

    Built once per set of addresses (DDP's buffer does not move during training), so the
    backward copies nothing to the GPU after the first step and can be captured in a graph."""

    def __init__(self, triton: bool):
        self._tables: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.triton = triton  # the kernel (the plan's ``triton_kernels``), or the PyTorch twin

    def of(self, main_grads_E: Sequence[torch.Tensor]) -> torch.Tensor:
        addresses = tuple(g.data_ptr() for g in main_grads_E)
        table = self._tables.get(addresses)
        if table is None:
            if main_grads_E[0].is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the experts' main_grad moved after the CUDA-graph warm-up: the captured "
                                   "weight-gradient kernel would add into freed memory")
            table = torch.tensor(addresses, dtype=torch.int64).to(main_grads_E[0].device)
            self._tables = {addresses: table}  # one set at a time: DDP's buffer is the only owner
        return table


def _check_targets(x_TI, dy_TO, main_grads_E):
    O, I = dy_TO.shape[1], x_TI.shape[1]
    for e, g in enumerate(main_grads_E):
        if g.dtype != torch.float32 or tuple(g.shape) != (O, I) or not g.is_contiguous():
            raise ValueError(f"expert {e}'s main_grad must be a contiguous float32 [{O}, {I}] tensor, "
                             f"got {tuple(g.shape)} {g.dtype}")


def grouped_wgrad_into_main_grad_reference(x_TI: torch.Tensor, dy_TO: torch.Tensor, offsets_E: torch.Tensor,
                                           main_grads_E: Sequence[torch.Tensor]) -> None:
    """The PyTorch twin: each expert's rows' product in fp32, added to its main_grad."""
    _check_targets(x_TI, dy_TO, main_grads_E)
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        main_grads_E[e].add_(dy_TO[start:end].float().t() @ x_TI[start:end].float())
        start = end


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    tile = gemm_tile.parts()
    bounds, add_into = tile.bounds, tile.add_into

    @triton.jit
    def grouped_wgrad_accumulate_kernel(dy_ptr, x_ptr, ends_ptr, table_ptr, O, I,
                                        BO: tl.constexpr, BI: tl.constexpr, BT: tl.constexpr):
        # one program: one [BO, BI] tile of one expert's gradient, summed over its rows
        e = tl.program_id(1)
        i_tiles = tl.cdiv(I, BI)
        o0 = (tl.program_id(0) // i_tiles) * BO
        i0 = (tl.program_id(0) % i_tiles) * BI
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        if end > start:  # an expert without rows keeps its main_grad as it is
            o, i, o_in, i_in = bounds(o0, i0, O, I, BO, BI)
            acc = tl.zeros((BO, BI), dtype=tl.float32)
            for t0 in range(start, end, BT):
                t = t0 + tl.arange(0, BT)
                t_in = t < end
                dy = tl.load(dy_ptr + t.to(tl.int64)[:, None] * O + o[None, :],
                             mask=t_in[:, None] & o_in[None, :], other=0.0)
                x = tl.load(x_ptr + t.to(tl.int64)[:, None] * I + i[None, :],
                            mask=t_in[:, None] & i_in[None, :], other=0.0)
                acc = tl.dot(tl.trans(dy), x, acc)
            grad_ptr = tl.load(table_ptr + e).to(tl.pointer_type(tl.float32))
            add_into(grad_ptr, o.to(tl.int64)[:, None] * I + i[None, :], o_in[:, None] & i_in[None, :], acc)

    return grouped_wgrad_accumulate_kernel


class Tiles(NamedTuple):
    o: int
    i: int
    t: int
    warps: int
    stages: int


# The contraction runs over one expert's rows (a few hundred for fine-grained experts), so the
# fp32 read-modify-write of the output dominates: large output tiles, one pass each.
TILES = Tiles(o=128, i=128, t=64, warps=8, stages=3)


def grouped_wgrad_into_main_grad(x_TI: torch.Tensor, dy_TO: torch.Tensor, offsets_E: torch.Tensor,
                                 main_grads_E: Sequence[torch.Tensor], table: MainGradTable,
                                 tiles: Tiles = TILES) -> None:
    """main_grads_E[e] += dy_TO[rows of e]^T @ x_TI[rows of e] (fp32), rows of e =
    [offsets_E[e-1], offsets_E[e]) (int32 cumulative ends on the device); rows past the last
    end are ignored. x_TI [T, I] and dy_TO [T, O] are bf16 or fp16."""
    if not (x_TI.is_cuda and table.triton):
        grouped_wgrad_into_main_grad_reference(x_TI, dy_TO, offsets_E, main_grads_E)
        return
    _check_targets(x_TI, dy_TO, main_grads_E)
    O, I = dy_TO.shape[1], x_TI.shape[1]
    E = offsets_E.numel()
    if E == 0 or O == 0 or I == 0:
        return
    grid = (-(-O // tiles.o) * -(-I // tiles.i), E)
    _kernel()[grid](dy_TO.contiguous(), x_TI.contiguous(), offsets_E, table.of(main_grads_E), O, I,
                    BO=tiles.o, BI=tiles.i, BT=tiles.t, num_warps=tiles.warps, num_stages=tiles.stages)
