"""apply() with every new field at its default leaves a stock MoE layer bit-for-bit unchanged,
and against an upstream megatron-core that has the features natively it installs nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron.core.transformer.transformer_config as tc_module
from megatron.moe_patches import apply, revert
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.fields import PATCH_FIELD_NAMES
from megatron.moe_patches.testing.layer_harness import MoEShape, build_moe_layer, forward_backward, moe_config_kwargs

ROOT = Path(__file__).resolve().parents[2]
SMALL = MoEShape(hidden=512, moe_ffn=384, experts=16, topk=4)


def run_layer(config, tokens=1024):
    layer = build_moe_layer(config)
    generator = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(tokens, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    output, input_grad = forward_backward(layer, hidden, grad)
    params = {name: p.detach().clone() for name, p in layer.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return output, input_grad, params, grads


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.quick)])
def test_defaults_bitwise_identical_to_stock(single_gpu, dispatcher, precision):
    kwargs = moe_config_kwargs(SMALL, precision, moe_token_dispatcher_type=dispatcher)
    revert()
    stock = run_layer(tc_module.TransformerConfig(**kwargs))
    try:
        apply()
        config = tc_module.TransformerConfig(**kwargs)
        assert type(config) is PatchedTransformerConfig
        assert all(getattr(config, name) in (None, False) for name in PATCH_FIELD_NAMES)
        patched = run_layer(config)
    finally:
        revert()
    out, dx, params, grads = stock
    out_p, dx_p, params_p, grads_p = patched
    assert params.keys() == params_p.keys()
    for name in params:
        assert torch.equal(params[name], params_p[name]), f"init differs: {name}"
        assert torch.equal(grads[name], grads_p[name]), f"grad differs: {name}"
    assert torch.equal(out, out_p)
    assert torch.equal(dx, dx_p)
    assert out.abs().sum() > 0 and dx.abs().sum() > 0  # a real computation, not zeros


UPSTREAM = os.environ.get("MOE_PATCHES_UPSTREAM_SITE")


@pytest.mark.skipif(not UPSTREAM, reason="set MOE_PATCHES_UPSTREAM_SITE to a site dir holding upstream megatron-core 0.19.2")
def test_upstream_native_features_install_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([UPSTREAM, os.environ.get("PYTHONPATH", ""), str(ROOT)]))
    code = (
        "import json, megatron.core, megatron.core.transformer.transformer_config as t;"
        "before = t.TransformerConfig;"
        "from megatron.moe_patches import apply, capabilities;"
        "rows = apply();"
        "print(json.dumps({'version': str(capabilities.mcore_version()), 'file': megatron.core.__file__,"
        " 'unchanged': t.TransformerConfig is before, 'rows': {r.id: [r.state, r.reason] for r in rows}}))"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["file"].startswith(UPSTREAM) and not report["version"].startswith("0.16")
    for feature_id in ("F1", "F4", "F5", "F6"):
        assert report["rows"][feature_id][0] == "native", (feature_id, report["rows"][feature_id])
    assert not [fid for fid, (state, _) in report["rows"].items() if state == "applied"]
    assert report["unchanged"]
