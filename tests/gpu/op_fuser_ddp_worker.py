"""torchrun worker for test_ddp_dp2_reduce_scatter_main_grads_match: DP=2, Megatron DDP with
the distributed optimizer's reduce-scatter, overlap_grad_reduce and delayed wgrad; main grads
of the op-fuser experts vs the unfused TE experts, different data on each rank."""

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
    for gaf in (True, False):
        kwargs = kwargs_for("swiglu", bias=True, gradient_accumulation_fusion=gaf)
        _, reference, _ = ddp_main_grads(kwargs, False, 700, seed=40 + rank, distributed_optimizer=True)
        _, fused, used = ddp_main_grads(kwargs, True, 700, seed=40 + rank, distributed_optimizer=True,
                                        interleave=32)
        errors = max_rel_error(reference, fused)
        results.append(dict(rank=rank, gradient_accumulation_fusion=gaf, used_pipeline=used,
                            max_rel=max(errors.values()),
                            bitwise=all(torch.equal(reference[n], fused[n]) for n in reference)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
