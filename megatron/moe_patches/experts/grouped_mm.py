"""F8: tokens_per_expert stays on the GPU from routing to the expert GEMMs.

With ``moe_device_tokens_per_expert`` (or ``NVTE_USE_GROUPED_GEMM_TRITON=1``):

- the alltoall dispatcher (``dispatchers.PatchedAlltoAllTokenDispatcher``, option
  ``device_splits``) no longer copies ``tokens_per_expert`` to the host and drops the
  host sync that existed only for that copy: with EP = 1 the dispatcher never waits for
  the GPU; with EP > 1 it keeps the one sync the all-to-all's split sizes need
  (``before_ep_alltoall``);
- the experts run this module's ``GroupedMMBackend`` where the plan lets it (``plan/backends.py``): FC1
  and FC2 as one ``torch._grouped_mm`` each over all local experts, with device offsets
  (no host sync), and megatron-core's fused router-prob-weighted SwiGLU / quick-GEGLU
  between them; expert biases as the TE experts apply them (FC2's scaled by the router
  prob). bf16 only. It reads the experts' existing ``linear_fc{1,2}.weight{i}`` / ``bias{i}``
  parameters, so state dicts stay those of stock TE experts, and stacks them into one
  [E, out, in] copy every forward (one warning says so); with ``moe_single_grouped_weight`` /
  ``_bias`` FC1 and FC2 are built holding one [E, ...] parameter each instead (F5) and the
  backend reads it without a copy.
  Elsewhere the TE backend copies the counts to the host once.

The allgather dispatcher keeps its host counts. Upstream: ROCm/Megatron-LM (seed 004,
"GPU m_splits"); TE's module GroupedLinear takes device splits there through
``m_splits_tensor``, which NVIDIA's TE (2.20.2) lacks: ``capabilities.
te_grouped_linear_device_splits`` reports it.
"""

import functools
import logging
from typing import Optional

import torch

from megatron.moe_patches.experts.backend import BF16, ExpertBackend
from megatron.moe_patches.fields import log_once
from megatron.moe_patches.kernels.main_grad_accumulation import MainGradTable, grouped_wgrad_into_main_grad
from megatron.moe_patches.kernels.weighted_glu import ExpertAmax, GLUSpec, glu_spec, weighted_glu

logger = logging.getLogger(__name__)

STACKED_WEIGHTS = (
    "grouped_mm experts: the expert weights are per-expert parameters (linear_fc{1,2}.weight{i}), so "
    "every forward stacks them into one [E, out, in] copy; --moe-single-grouped-weight holds one "
    "[E, out, in] parameter per FC and needs no copy."
)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's
    backward rejects stride-0 gradients such as the one ``output.sum()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def expert_of_row(offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[rows] index of the expert each row belongs to, from the groups' end offsets (on the
    device, no host sync). Rows past the last group (unused) count as the last expert's."""
    rows_T = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows_T, right=True).clamp_(max=offsets_E.numel() - 1)


class RowGroups:
    """The experts' rows grouped by expert: device end offsets and, computed on first use
    (biases, per-expert FP8 scales), the expert of each row."""

    def __init__(self, tokens_per_expert_E: torch.Tensor, num_rows: int, device):
        # Counts from a dispatcher that keeps them on the host (allgather) go up once.
        self.offsets_E = torch.cumsum(tokens_per_expert_E.to(device, non_blocking=True), dim=0, dtype=torch.int32)
        self.num_rows = num_rows
        self._derived = {}

    def derived(self, key, build):
        """``build(self)``, computed once per forward: what several FCs derive from the groups."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]

    @property
    def expert_T(self) -> torch.Tensor:
        return self.derived("expert_T", lambda groups: expert_of_row(groups.offsets_E, groups.num_rows))


def grouped_param(linear, name: str = "weight") -> torch.Tensor:
    """All experts' ``name`` (weight or bias) of ``linear`` as one differentiable [E, ...] tensor:
    the grouped parameter itself (moe_single_grouped_weight/_bias: the FC's ``grouped_names``),
    else a stacked copy of the per-expert parameters whose gradient flows back to each of them."""
    if name in linear.grouped_names:
        return getattr(linear, name)
    return torch.stack([getattr(linear, f"{name}{i}") for i in range(linear.num_gemms)])


def weight_params(linear):
    """The parameters an FC's [E, out, in] weight is assembled from."""
    if "weight" in linear.grouped_names:
        return [linear.weight]
    return [getattr(linear, f"weight{i}") for i in range(linear.num_gemms)]


class GroupedGemmLinear:
    """FC1's and FC2's class step under the grouped_mm backends (``ExpertBackend.linear_step``):
    the module keeps TE's parameters (per expert, or grouped: F5) and its forward is one grouped
    GEMM over all local experts. The backend calls the module, so torch runs its forward
    pre-hooks before the parameters are read: Megatron's DDP waits there for their all-gather
    under --overlap-param-gather."""

    grouped_names = frozenset()  # per expert; GroupedAtBirth's layouts override it (F5)

    def forward(self, x_TI, gemm):
        """(gemm(x_TI, w_EOI), b_EO or None): ``gemm`` is the backend's grouped GEMM, for this
        forward's row groups; the bias is applied by the caller (FC2's is scaled by the prob)."""
        return gemm(self, x_TI, grouped_param(self)), grouped_param(self, "bias") if self.use_bias else None


def bf16_grouped_gemm(groups: RowGroups):
    """(linear, x_TI, w_EOI) -> x_TI @ w_EOI[expert(row)]^T as one torch._grouped_mm."""
    return lambda linear, x_TI, w_EOI: torch._grouped_mm(x_TI, w_EOI.transpose(1, 2), offs=groups.offsets_E)


class MainGradTarget:
    """Where one FC's weight gradient goes under gradient_accumulation_fusion: the fp32
    ``main_grad`` that Megatron's DDP gives each of its weight parameters (per expert, or one
    [E, out, in] grouped parameter: ``grouped``). It keeps the real parameters: under a CUDA-graph
    capture the module computes with aliases of them, which carry no main_grad."""

    def __init__(self, params, grouped: bool, triton: bool):
        self.params = list(params)
        self.grouped = grouped
        self.table = MainGradTable(triton)

    @classmethod
    def of(cls, linear, triton: bool) -> "MainGradTarget":
        """The target of FC ``linear``'s weights, in the layout it was built with."""
        return cls(weight_params(linear), "weight" in linear.grouped_names, triton)

    def main_grads_E(self):
        grads = []
        for p in self.params:
            main_grad = getattr(p, "main_grad", None)
            if main_grad is None:
                raise RuntimeError(
                    "gradient_accumulation_fusion adds the experts' weight gradients into main_grad, which "
                    "Megatron's DistributedDataParallel gives each parameter; this model has none: wrap it in "
                    "DistributedDataParallel or turn the fusion off (--no-gradient-accumulation-fusion).")
            grads.extend(main_grad.unbind(0) if self.grouped else (main_grad,))
        return grads

    def grouped_main_grad(self):
        """The one fp32 [E, out, in] main_grad where the FC holds a single grouped weight (a GEMM
        can add into it in place), else None."""
        return getattr(self.params[0], "main_grad", None) if self.grouped else None

    def accumulate(self, x_TI, dy_TO, offsets_E) -> None:
        """main_grad += the bf16 rows' weight gradient, in one GEMM (F13's kernel)."""
        grouped_wgrad_into_main_grad(x_TI, dy_TO, offsets_E, self.main_grads_E(), self.table)
        self.mark_added()

    def add(self, dw_EOI: torch.Tensor) -> None:
        """main_grad += a weight gradient computed apart (one fused add over the experts)."""
        torch._foreach_add_(self.main_grads_E(), list(dw_EOI.unbind(0)))
        self.mark_added()

    def mark_added(self) -> None:
        for p in self.params:
            p.grad_added_to_main_grad = True  # DDP's hook then skips the placeholder gradient


def bf16_wgrad(x_TI, dy_TO, offsets_E, w_EOI, target: Optional[MainGradTarget]) -> torch.Tensor:
    """The weight gradient a grouped linear's backward returns, from bf16 rows: computed
    (one torch._grouped_mm), or added into ``target``'s main_grad and a placeholder returned."""
    if target is None:
        return torch._grouped_mm(dy_TO.t(), x_TI, offs=offsets_E)
    target.accumulate(x_TI, dy_TO, offsets_E)
    return _placeholder_grad(w_EOI)


def computed_wgrad(compute, w_EOI, target: Optional[MainGradTarget]) -> torch.Tensor:
    """The weight gradient a grouped linear's backward returns where its own GEMM computes it
    (FP8 wgrad): ``compute(out_dtype, accumulate_into)`` -> [E, out, in]. Without ``target``, in
    the weights' dtype; with it, added into main_grad (in place by the GEMM where main_grad is
    one grouped tensor and the GEMM takes it, else in fp32 and added) and a placeholder returned."""
    if target is None:
        return compute(w_EOI.dtype, None)
    into = target.grouped_main_grad()
    dw_EOI = compute(torch.float32, into)
    if dw_EOI is into:
        target.mark_added()
    else:
        target.add(dw_EOI)
    return _placeholder_grad(w_EOI)


def _placeholder_grad(w_EOI: torch.Tensor) -> torch.Tensor:
    """The weight's autograd gradient once its value went into main_grad: never written nor read
    (DDP's hook sees grad_added_to_main_grad), but not None, so the hook still runs on the backward
    thread and tells DDP the gradient is ready. One buffer per shape is shared by every layer."""
    key = (tuple(w_EOI.shape), w_EOI.dtype, w_EOI.device)
    buffer = _PLACEHOLDERS.get(key)
    if buffer is None:
        buffer = _PLACEHOLDERS[key] = torch.empty(key[0], dtype=key[1], device=key[2])
    return buffer


_PLACEHOLDERS = {}


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """y_TO = x_TI @ w_EOI[expert(row)]^T (one torch._grouped_mm); the backward adds the weight
    gradient into the weights' main_grad (``MainGradTarget``) instead of returning it."""

    @staticmethod
    def forward(ctx, x_TI, w_EOI, offsets_E, target: MainGradTarget):
        ctx.save_for_backward(x_TI, w_EOI, offsets_E)
        ctx.target = target
        return torch._grouped_mm(x_TI, w_EOI.transpose(1, 2), offs=offsets_E)

    @staticmethod
    def backward(ctx, dy_TO):
        x_TI, w_EOI, offsets_E = ctx.saved_tensors
        dy_TO = dy_TO.contiguous()
        dx_TI = torch._grouped_mm(dy_TO, w_EOI, offs=offsets_E) if ctx.needs_input_grad[0] else None
        dw_EOI = bf16_wgrad(x_TI, dy_TO, offsets_E, w_EOI, ctx.target) if ctx.needs_input_grad[1] else None
        return dx_TI, dw_EOI, None, None


def grouped_gemm_into_main_grad(groups: RowGroups, targets):
    """(linear, x_TI, w_EOI) -> y_TO as ``bf16_grouped_gemm``, with the weight gradient added
    into ``targets[linear]``'s main_grad."""
    return lambda linear, x_TI, w_EOI: _GroupedLinearIntoMainGrad.apply(x_TI, w_EOI, groups.offsets_E,
                                                                        targets[linear])


def grouped_mm_mlp(x_TH, groups: RowGroups, probs_T, fc1, fc2, glu: GLUSpec,
                   glu_amax: Optional[ExpertAmax] = None, glu_quantized_rows: bool = False, *,
                   glu_triton: bool) -> torch.Tensor:
    """FC1 (+ bias) -> prob-weighted GLU -> FC2 (+ bias x prob) over all local experts with
    device offsets: the TE experts' math (FC2's bias is scaled by the router prob, as
    megatron-core's TEGroupedMLP applies it). ``fc1``/``fc2`` map [rows, in] rows grouped by
    ``groups`` to ([rows, out], the [E, out] bias or None) (bf16 or FP8 grouped GEMMs);
    ``glu_amax``: where the GLU writes the per-expert amaxes the FP8 GEMMs scale by;
    ``glu_quantized_rows``: the GLU writes the 1x128 FP8 rows FC2 and FC1's dgrad read;
    ``glu_triton``: whether the GLU may run its Triton kernels (``weighted_glu``'s ``triton``)."""
    h_TF2, b1_EO = fc1(x_TH)
    # Biases are gathered per row in fp32: the add rounds once (as TE's GEMM epilogue does)
    # and each expert's bias gradient sums its rows in fp32 before the one cast back.
    if b1_EO is not None:
        h_TF2 = (h_TF2 + b1_EO.float()[groups.expert_T]).to(h_TF2.dtype)
    # Rows past the last group (F12's bound) stay zero from here on.
    a_TF = weighted_glu(h_TF2, probs_T, glu, rows_used=groups.offsets_E[-1:], amax=glu_amax,
                        quantized_rows=glu_quantized_rows, triton=glu_triton)
    out_TH, b2_EO = fc2(a_TF.to(x_TH.dtype))
    out_TH = _ContiguousGrad.apply(out_TH)
    if b2_EO is not None:
        out_TH = (out_TH + b2_EO.float()[groups.expert_T] * probs_T.unsqueeze(-1)).to(x_TH.dtype)
    return out_TH


class GroupedMMBackend(ExpertBackend):
    """Sync-free experts: one torch._grouped_mm per FC over all local experts (bf16).

    Subclasses that compute in another precision override the precision declarations,
    ``unavailable`` and ``gemm`` (``fp8_grouped_mm.FP8GroupedMMBackend``)."""

    name = "grouped_mm"
    requested_by = "moe_device_tokens_per_expert"
    precisions = (BF16,)
    precision_note = "FP8 tensorwise and blockwise run the fp8_grouped_mm backend"
    fp8_params = False
    params_dtypes = (torch.bfloat16,)
    activations = ("swiglu", "quick_geglu")
    expert_tp = False
    probs_on_input = False
    delayed_wgrad = False  # TE's delayed wgrad step would find nothing to compute
    activation_offloading = False
    activation_recompute = False
    holds_single_grouped_params = True
    takes_device_counts = True
    runs_package_kernels = True
    linear_step = GroupedGemmLinear
    glu_quantized_rows = False  # whether the GLU writes 1x128 FP8 rows for the GEMMs around it

    @classmethod
    def reads_rows_past_groups(cls, config) -> bool:
        # The GEMMs stop at the last offset and the weighted GLU reads rows past it as zero;
        # the biases' gradients sum every row (the tail counts as the last expert's).
        return bool(config.add_bias_linear)

    @classmethod
    def unavailable(cls, config) -> Optional[str]:
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
            return "it needs a Hopper (sm90) or newer GPU"
        return None

    def __init__(self, experts):
        super().__init__(experts)  # FC1 and FC2 come in the layout the config asks for (F5)
        config = experts.config
        if "weight" not in experts.linear_fc1.grouped_names:
            log_once(logger, logging.WARNING, STACKED_WEIGHTS)
        self._glu = glu_spec(config)
        self._glu_triton = experts.triton_kernels  # the plan's: the GLU's Triton kernels or megatron-core's
        # F13: under gradient_accumulation_fusion the wgrad GEMM adds into main_grad
        self.main_grad_targets = None
        if experts.wgrad_into_main_grad:
            self.main_grad_targets = {fc: MainGradTarget.of(fc, experts.triton_kernels)
                                      for fc in (experts.linear_fc1, experts.linear_fc2)}

    def gemm(self, groups: RowGroups):
        """The grouped GEMM (linear, x_TI, w_EOI) -> y_TO over this forward's ``groups``."""
        if self.main_grad_targets is not None:
            return grouped_gemm_into_main_grad(groups, self.main_grad_targets)
        return bf16_grouped_gemm(groups)

    def glu_amax(self, groups: RowGroups) -> Optional[ExpertAmax]:
        """Where the GLU writes per-expert amaxes for the GEMMs after it: none in bf16."""
        return None

    def forward(self, experts, x_TH, tokens_per_expert_E, probs_T):
        groups = RowGroups(tokens_per_expert_E, x_TH.shape[0], x_TH.device)
        gemm = self.gemm(groups)
        fc1 = functools.partial(experts.linear_fc1, gemm=gemm)
        fc2 = functools.partial(experts.linear_fc2, gemm=gemm)
        return grouped_mm_mlp(x_TH, groups, probs_T, fc1, fc2, self._glu, self.glu_amax(groups),
                              self.glu_quantized_rows, glu_triton=self._glu_triton), None
