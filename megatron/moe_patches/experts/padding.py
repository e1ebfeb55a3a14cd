"""F3: pad each expert's tokens for quantized GEMMs exactly once, in the right place.

The plan (``plan.plan_for(config).padding``) decides, from the config, the experts' backend
and what Transformer Engine offers, how many rows each expert's token count must be a
multiple of and which stage pads:

- ``router``: megatron-core's router already pads (``moe_router_padding_for_quantization``);
- ``hybridep``: HybridEP (flex dispatcher, hybridep backend) pads on device;
- ``permute``: our dispatchers permute straight into the padded layout (F1, fused
  permute+pad), where TE has the kernel and the dispatcher is alltoall/allgather; with
  ``static_rows`` into a static row count with the counts on the device (one rank:
  graph-safe), for experts that take any rows but whose kernels need aligned groups
  (``ExpertBackend.aligned_groups``), and with ``quantized_rows`` writing the rows' FP8
  copy in the same pass for experts that read it (``ExpertBackend.quantized_rows``);
- ``experts``: the experts pad themselves (TE's Fp8Padding), as stock megatron-core does;
- ``nobody``: bf16 needs no alignment, nor a backend that takes any row count.

The dispatchers (``dispatch/dispatchers.py``) and the experts (``grouped_experts.py``) both read
the plan at construction, so the stage that pads and the stage that must not always agree;
the experts skip their own padding whenever an earlier stage aligned the tokens
(``PaddingPlan.earlier_stage_pads``, upstream's ``skip_routed_expert_padding``). Padding
twice costs a copy of the activations and a host round trip, and the host-side variant is
not CUDA-graph safe. Upstream: NVIDIA/Megatron-LM#4071.
"""

from dataclasses import dataclass
from typing import Optional

NOBODY, ROUTER, HYBRIDEP, PERMUTE, EXPERTS = "nobody", "router", "hybridep", "permute", "experts"

TE_KERNEL_NEEDED = (
    "Transformer Engine with moe_permute_and_pad_with_probs and moe_unpermute(pad_offsets=) (TE >= 2.14)"
)


@dataclass(frozen=True)
class PaddingPlan:
    align: Optional[int]  # rows each expert's token count must be a multiple of; None: no padding
    padded_by: str  # NOBODY | ROUTER | HYBRIDEP | PERMUTE | EXPERTS
    reason: Optional[str] = None  # EXPERTS: why the dispatcher does not pad instead (F1), else None
    static_rows: bool = False  # PERMUTE: a static row count, counts on the device (one rank)
    quantized_rows: bool = False  # static_rows: the permute writes the rows' 1x128 FP8 copy too
    aligned_kernels: Optional[str] = None  # static_rows: the experts' kernels the alignment is for (DeepGEMM's)

    @property
    def dispatcher_pads(self) -> bool:
        """Our dispatchers permute into the padded layout (F1)."""
        return self.padded_by == PERMUTE

    @property
    def experts_pad(self) -> bool:
        return self.padded_by == EXPERTS

    @property
    def earlier_stage_pads(self) -> bool:
        """The routed experts must leave their input unpadded: an earlier stage aligned it."""
        return self.align is not None and not self.experts_pad
