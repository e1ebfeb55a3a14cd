"""torchrun worker for test_ddp_dp2_main_grads_match: DP=2, Megatron DDP with overlap_grad_reduce
and delayed wgrad, reduce-scatter (distributed optimizer) and all-reduce; main grads of the
op-fuser experts vs the unfused TE experts, different data on each rank."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(out_path):
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    from op_fuser_cases import ddp_main_grads, kwargs_for, max_rel_error

    results = []
    # The distributed optimizer reduce-scatters flat buffers: which elements a rank owns
    # depends on the memory layout, so the reduce-scatter cases keep FC1 concatenated and
    # the interleaved layout is checked under the all-reduce (every element reduced).
    for gaf in (True, False):
        for distributed_optimizer, interleave in ((True, None), (False, 32)):
            kwargs = kwargs_for("swiglu", bias=True, gradient_accumulation_fusion=gaf)
            common = dict(tokens=700, seed=40 + rank, distributed_optimizer=distributed_optimizer)
            _, reference, _ = ddp_main_grads(kwargs, False, **common)
            _, fused, used = ddp_main_grads(kwargs, True, interleave=interleave, **common)
            errors = max_rel_error(reference, fused)
            results.append(dict(rank=rank, gradient_accumulation_fusion=gaf, distributed_optimizer=distributed_optimizer,
                                interleave=interleave, used_pipeline=used, max_rel=max(errors.values()),
                                worst=max(errors, key=errors.get),
                                bitwise=all(torch.equal(reference[n], fused[n]) for n in reference)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
