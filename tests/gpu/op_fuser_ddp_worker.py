"""torchrun worker for test_ddp_dp2_main_grads_match: DP=2, Megatron DDP with overlap_grad_reduce
and delayed wgrad, reduce-scatter (distributed optimizer) and all-reduce; main grads of the
op-fuser experts vs the unfused TE experts, different data on each rank."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_checks import finish_worker, max_rel_error, start_worker  # noqa: E402  (this folder: sys.path[0])


def main(out_path):
    rank = start_worker()
    from op_fuser_cases import ddp_main_grads, kwargs_for

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
    finish_worker(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
