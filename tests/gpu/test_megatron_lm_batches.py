"""Megatron-LM's batches at TP 1 after ``megatron_lm.enable()``: the wrapped
``get_batch_on_this_tp_rank`` returns the same tensors, keys and order as Megatron-LM's own,
on the GPU, without the host waits Megatron-LM's broadcasts take (run in a child process:
it sets Megatron-LM's global args and a one-rank process group). Runs only where
MEGATRON_LM_PATH names a Megatron-LM core_v0.16.1 checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.moe_patches.driver.functional import free_port

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
pytestmark = [
    pytest.mark.skipif(not CHECKOUT or not Path(CHECKOUT, "pretrain_gpt.py").exists(),
                       reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

CHILD = r"""
import argparse, json, sys
import torch
sys.path.append(sys.argv[1])
from megatron.moe_patches.testing.layer_harness import init_single_gpu
init_single_gpu()
from megatron.training import global_vars, utils
from megatron.moe_patches import megatron_lm
from gpu_checks import host_syncs_during

global_vars.set_args(argparse.Namespace(hybrid_context_parallel=False, pipeline_model_parallel_size=1,
                                        micro_batch_size=2, seq_length=8))
stock = utils.get_batch_on_this_tp_rank
megatron_lm.enable()
wrapped = utils.get_batch_on_this_tp_rank

def data(packed):
    g = torch.Generator().manual_seed(7)
    d = {"tokens": torch.randint(0, 100, (2, 8), generator=g), "labels": torch.randint(0, 100, (2, 8), generator=g),
         "loss_mask": torch.rand(2, 8, generator=g), "position_ids": torch.arange(8).repeat(2, 1),
         "attention_mask": torch.rand(2, 1, 8, 8, generator=g) > 0.5}
    if packed:
        d["cu_seqlens"] = torch.tensor([[0, 3, 8]], dtype=torch.int32)
        d["max_seqlen"] = torch.tensor([5], dtype=torch.int32)
    return d

results = []
for packed in (False, True):
    a, b = stock(iter([data(packed)])), wrapped(iter([data(packed)]))
    same = list(a) == list(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.is_cuda and y.is_cuda
                                       and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(a.values(), b.values()))
    results.append(dict(packed=packed, same=same, keys=list(b),
                        stock_syncs=len(host_syncs_during(lambda: stock(iter([data(packed)])))),
                        wrapped_syncs=len(host_syncs_during(lambda: wrapped(iter([data(packed)])))),
                        wrapped=wrapped is not stock))
megatron_lm.disable()
print("RESULTS " + json.dumps(results))
"""


def test_tp1_batches_equal_megatron_lms_without_host_waits():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
               MASTER_PORT=str(free_port()))  # this process may hold init_single_gpu's default port
    run = subprocess.run([sys.executable, "-c", CHILD, CHECKOUT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    print(results)
    assert len(results) == 2
    for result in results:
        assert result["same"] and result["wrapped"], result
        assert result["wrapped_syncs"] == 0, result
        assert result["stock_syncs"] > 0, result  # what the wrapper takes away
