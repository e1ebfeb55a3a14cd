"""How the tokens cross the expert-parallel ranks, and the dispatcher's options (F8, F12).

The exchange is the dispatcher's own (NCCL's all-to-all, all-gather, flex) unless
``moe_symmetric_exchange`` asks for the symmetric-memory one (F12) at EP > 1, this process
can run it and the experts take device token counts (``symmetric_exchange_blocker``); what
in the config contradicts that flag is a config error, found before any GPU work
(``exchange_config_errors``). At EP 1 the flag is accepted and exchanges nothing.

With the exchange come the dispatcher's options (``ExchangeChoice``): whether it hands the
experts device-resident token counts (F8: no host sync, graph-safe), whether it may skip
sorting the received chunks by local expert, the alignment it permutes into, which the
padding decided (``plan/padding.py``), and what HybridEP's buffer is built with (F2). A refused symmetric exchange keeps its reason, which
the CUDA-graph rule repeats (``plan/graphs.py``).
"""

import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import megatron.moe_patches.plan.backends as backends
from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.experts.padding import PaddingPlan
from megatron.moe_patches.fields import patch_option
from megatron.moe_patches.plan.sizes import ep_size, expert_tp_size

ALLTOALL, SYMMETRIC_MEMORY, ALLGATHER, FLEX = "alltoall", "symmetric_memory", "allgather", "flex"

EP1_NOTHING_TO_EXCHANGE = (
    "moe_symmetric_exchange (--moe-symmetric-exchange) has nothing to exchange at "
    "expert_model_parallel_size=1: every expert is local and the alltoall dispatcher already keeps "
    "the token counts on the GPU (--moe-device-tokens-per-expert); the symmetric exchange runs at EP > 1 only."
)


@dataclass(frozen=True, kw_only=True)  # many fields: each named where it is built
class ExchangeChoice:
    name: str  # ALLTOALL (NCCL's all-to-all) | SYMMETRIC_MEMORY | ALLGATHER | FLEX
    reason: Optional[str]  # why not SYMMETRIC_MEMORY where moe_symmetric_exchange asks for it
    device_counts: bool  # the dispatcher hands the experts device-resident token counts (F8)
    skips_chunk_sort: bool  # alltoall: received rows are already grouped by local expert
    pad_align: Optional[int]  # the dispatcher permutes into this alignment (F1), else None
    static_pad_rows: bool  # and into a static row count, counts on the device (one rank)
    contradictions: Tuple[str, ...]  # what in the config contradicts moe_symmetric_exchange
    quantized_rows: bool = False  # static_pad_rows: the permute writes the rows' FP8 copy too
    # SYMMETRIC_MEMORY: the experts read rows past their groups, so the owners' rows there are
    # zero (else left unwritten: a quarter of the bound's rows at EP 4 are real)
    zero_tail: bool = True
    # flex + HybridEP (F2): the buffer is built with the configured block counts, and its
    # dispatch / combine fuse the permute / unpermute, each where asked and deep_ep takes it
    hybridep_block_counts: bool = False
    hybridep_permute_fusion: bool = False


# F2's config fields -> the HybridEP buffer's constructor arguments
HYBRIDEP_BLOCK_FIELDS = {
    "moe_hybridep_num_blocks_permute": "num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute": "num_blocks_unpermute",
}
HYBRIDEP_BLOCKS_NOT_TAKEN = (
    "moe_hybridep_num_blocks_permute/_unpermute are set but the installed deep_ep's HybridEPBuffer does not "
    "take num_blocks_permute/num_blocks_unpermute; HybridEP chooses the block counts. Upgrade deep_ep to use them.")
HYBRIDEP_FUSION_NOT_TAKEN = (
    "moe_permute_fusion_into_hybridep is set but the installed deep_ep's HybridEP dispatch_with_permute/"
    "combine_with_unpermute take no fuse_permute_dispatch/fuse_unpermute_combine; permute and unpermute run "
    "unfused. Upgrade deep_ep to fuse them.")


def hybridep_choices(config, notes) -> Tuple[bool, bool]:
    """(block counts, permute fusion) for the HybridEP buffer: each where the config asks for
    it (config validation refuses them off HybridEP) and the installed deep_ep takes it; where
    it does not, a warning note and HybridEP's own behaviour."""
    if not (config.moe_token_dispatcher_type == FLEX and config.moe_flex_dispatcher_backend == "hybridep"):
        return False, False
    wants_blocks = any(patch_option(config, field) is not None for field in HYBRIDEP_BLOCK_FIELDS)
    wants_fusion = bool(patch_option(config, "moe_permute_fusion_into_hybridep"))
    if not (wants_blocks or wants_fusion):
        return False, False
    takes = cap.hybridep_options()
    for wanted, taken, refusal in ((wants_blocks, takes.block_counts, HYBRIDEP_BLOCKS_NOT_TAKEN),
                                   (wants_fusion, takes.permute_fusion, HYBRIDEP_FUSION_NOT_TAKEN)):
        if wanted and not taken:
            notes.append((logging.WARNING, refusal))
    return wants_blocks and takes.block_counts, wants_fusion and takes.permute_fusion


def exchange_config_errors(config) -> list:
    """What in ``config`` contradicts ``moe_symmetric_exchange`` (static: checked at config
    validation, before any GPU work)."""
    if not patch_option(config, "moe_symmetric_exchange"):
        return []
    flag = "moe_symmetric_exchange=True (--moe-symmetric-exchange)"
    errors = []
    if config.moe_token_dispatcher_type != "alltoall":
        errors.append(f"{flag} replaces the alltoall dispatcher's exchange: set "
                      f"moe_token_dispatcher_type='alltoall', not {config.moe_token_dispatcher_type!r}.")
    if not patch_option(config, "moe_device_tokens_per_expert"):
        errors.append(f"{flag} hands the experts device token counts: also set "
                      "moe_device_tokens_per_expert=True (--moe-device-tokens-per-expert).")
    if expert_tp_size(config) > 1:
        errors.append(f"{flag} needs expert_tensor_parallel_size=1 (it does not split tokens over TP ranks).")
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        errors.append(f"{flag} is for dropless MoE: unset moe_expert_capacity_factor and "
                      "moe_pad_expert_input_to_capacity.")
    if config.moe_router_padding_for_quantization:
        errors.append(f"{flag} needs tokens x top-k rows per rank: unset moe_router_padding_for_quantization.")
    if config.overlap_moe_expert_parallel_comm:
        errors.append(f"{flag} runs one exchange at a time through shared buffers: unset "
                      "overlap_moe_expert_parallel_comm (--overlap-moe-expert-parallel-comm).")
    return errors


def symmetric_exchange_blocker(config, backend, padding: PaddingPlan) -> Optional[str]:
    """Why this process cannot run the symmetric exchange for ``config`` (EP > 1) with these
    experts (the rest of the rules after ``exchange_config_errors``), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not cap.triton_available():
        return "Triton is not installed"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return f"torch {torch.__version__} has no symmetric memory"
    if padding.dispatcher_pads:
        return "the dispatcher pads each expert's rows for quantization (F1), which this exchange does not"
    if not backend.takes_device_counts:
        takers = " or ".join(b.name for b in backends.BACKENDS if b.takes_device_counts)
        return f"the experts run the {backend.name} backend, which needs host split sizes ({takers} needed)"
    return None


def choose_exchange(config, backend, padding: PaddingPlan, notes) -> ExchangeChoice:
    """The exchange and the dispatcher's options for ``config`` with these experts and this
    padding; a refused or pointless symmetric exchange goes into ``notes``."""
    dispatcher = config.moe_token_dispatcher_type
    device_tokens = bool(patch_option(config, "moe_device_tokens_per_expert"))
    one_rank = ep_size(config) == 1 and expert_tp_size(config) == 1
    pad_align = padding.align if padding.dispatcher_pads else None
    reason, name = None, dispatcher
    if patch_option(config, "moe_symmetric_exchange") and ep_size(config) == 1:
        # Accepted (one recipe serves EP 1 and 2; a checkpoint may restore it into an EP 1
        # run) and said to exchange nothing; the machine is not asked.
        reason = "expert parallelism is 1 (nothing to exchange)"
        if dispatcher == ALLTOALL:
            notes.append((logging.WARNING, EP1_NOTHING_TO_EXCHANGE))
    elif patch_option(config, "moe_symmetric_exchange"):
        reason = symmetric_exchange_blocker(config, backend, padding)
        if dispatcher == ALLTOALL and reason is not None:
            notes.append((logging.WARNING, "moe_symmetric_exchange: the expert-parallel exchange stays "
                                           f"NCCL's all-to-all because {reason}"))
        elif dispatcher == ALLTOALL:
            name = SYMMETRIC_MEMORY
            notes.append((logging.INFO, f"moe_symmetric_exchange: EP={ep_size(config)} tokens go through "
                                        "symmetric memory"))
    if dispatcher == ALLGATHER:
        # Counts stay on the device only where the permuted row count is tokens x top-k.
        device_counts = (device_tokens and (pad_align is None or padding.static_rows) and one_rank
                         and config.moe_permute_fusion and config.moe_expert_capacity_factor is None
                         and not config.moe_router_padding_for_quantization)
    else:
        device_counts = device_tokens and dispatcher == ALLTOALL
    # One source rank, no TP: sorting chunks by local expert keeps them in place; the
    # symmetric exchange lands rows sorted by local expert already.
    skips_chunk_sort = dispatcher == ALLTOALL and ((device_tokens and one_rank) or name == SYMMETRIC_MEMORY)
    hybridep_blocks, hybridep_fusion = hybridep_choices(config, notes)
    return ExchangeChoice(
        name=name,
        reason=reason,
        device_counts=bool(device_counts),
        skips_chunk_sort=skips_chunk_sort,
        pad_align=pad_align,
        static_pad_rows=padding.static_rows,
        contradictions=tuple(exchange_config_errors(config)),
        quantized_rows=padding.quantized_rows,
        zero_tail=name != SYMMETRIC_MEMORY or backend.reads_rows_past_groups(config),
        hybridep_block_counts=hybridep_blocks,
        hybridep_permute_fusion=hybridep_fusion,
    )
