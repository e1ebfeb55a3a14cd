import pytest
import torch

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.moe_patches import expert_backends as eb
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.device_splits import DeviceSplitsAlltoAllTokenDispatcher

BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_device_tokens_per_expert=True,
)


def cfg(**overrides):
    late = {k: overrides.pop(k) for k in ("fp8",) if k in overrides}
    config = PatchedTransformerConfig(**{**BASE, **overrides})
    for name, value in late.items():
        setattr(config, name, value)
    return config


SELECTION = [
    (dict(), eb.GROUPED_MM, None),
    (dict(activation_func=quick_gelu), eb.GROUPED_MM, None),
    (dict(moe_device_tokens_per_expert=False), eb.TE, None),
    (dict(fp8="e4m3"), eb.TE, "bf16 only"),
    (dict(params_dtype=torch.float32, bf16=False), eb.TE, "bf16 parameters"),
    (dict(add_bias_linear=True), eb.TE, "no expert biases"),
    (dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu), eb.TE, "SwiGLU and quick-GEGLU"),
    (dict(activation_func=torch.nn.functional.gelu), eb.TE, "SwiGLU and quick-GEGLU"),
    (dict(expert_tensor_parallel_size=2), eb.TE, "expert tensor parallelism"),
    (dict(use_transformer_engine_op_fuser=True), eb.TE, "op fuser"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), eb.TE, "recompute"),
]


@pytest.mark.parametrize("overrides, backend, reason", SELECTION)
def test_backend_selection(overrides, backend, reason):
    chosen, why = eb.select_expert_backend(cfg(**overrides))
    assert chosen == backend
    if reason is None:
        assert why is None
    else:
        assert reason in why


def test_host_copy_happens_in_one_place(monkeypatch):
    class DeviceCounts:  # stands in for a CUDA tensor on a CPU machine
        is_cuda = True

        def cpu(self):
            return torch.tensor([1, 2])

    monkeypatch.setattr(eb, "_host_copies", 0)
    host = torch.tensor([3, 4])
    assert eb.host_tokens_per_expert(host) is host and eb._host_copies == 0
    assert eb.host_tokens_per_expert(DeviceCounts()).tolist() == [1, 2]
    assert eb._host_copies == 1


def make_weights(num, out, inp, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(out, inp, generator=generator)) for _ in range(num)]


def test_block_keeps_parameter_identity_and_aliases_storage():
    weights = make_weights(4, 6, 5)
    ids, values = [id(w) for w in weights], [w.detach().clone() for w in weights]
    block = eb.gather_into_one_block(weights)
    assert [id(w) for w in weights] == ids
    assert all(torch.equal(w, v) for w, v in zip(weights, values))
    weights[2].data.mul_(2)  # an optimizer's in-place update reaches the block
    assert torch.equal(block[2], values[2] * 2)
    view = eb.grouped_weight(block, weights)
    assert view.data_ptr() == block.data_ptr()  # no copy


def test_block_view_routes_gradients_to_each_expert():
    weights = make_weights(3, 4, 2)
    block = eb.gather_into_one_block(weights)
    upstream = torch.randn(3, 4, 2)
    (eb.grouped_weight(block, weights) * upstream).sum().backward()
    for i, w in enumerate(weights):
        assert torch.equal(w.grad, upstream[i])


def test_moved_parameter_falls_back_to_a_stacked_copy():
    weights = make_weights(3, 4, 2)
    block = eb.gather_into_one_block(weights)
    weights[1].data = weights[1].data.clone()  # e.g. DDP re-homed it
    weights[1].data.add_(1)
    grouped = eb.grouped_weight(block, weights)
    assert grouped.data_ptr() != block.data_ptr()
    assert torch.equal(grouped[1], weights[1].detach())
    grouped.sum().backward()
    assert all(torch.equal(w.grad, torch.ones_like(w)) for w in weights)


def test_grouped_mm_mlp_matches_per_expert_loop():
    torch.manual_seed(0)
    counts = torch.tensor([3, 5, 1, 7])
    tokens, hidden, ffn = int(counts.sum()), 16, 8
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    probs = torch.rand(tokens)
    w1 = torch.randn(4, 2 * ffn, hidden, dtype=torch.bfloat16) / 4
    w2 = torch.randn(4, hidden, ffn, dtype=torch.bfloat16) / 4
    out = eb.grouped_mm_mlp(x, counts, probs, w1, w2, cfg()).float()
    expected, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = x[start:start + c].float() @ w1[e].float().T
        gate, lin = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * lin * probs[start:start + c, None]
        expected.append(a @ w2[e].float().T)
        start += c
    torch.testing.assert_close(out, torch.cat(expected), rtol=3e-2, atol=3e-2)  # bf16 GEMMs


def test_dispatcher_drops_only_the_host_count_sync():
    dispatcher = object.__new__(DeviceSplitsAlltoAllTokenDispatcher)
    dispatcher.device_splits = True
    dispatcher.cuda_sync_point_priority = {
        "before_permutation_1": 0, "before_ep_alltoall": 1, "before_permutation_2": 2,
        "before_finish": 3, "no_sync": 4,
    }
    dispatcher.cuda_sync_point = "no_sync"
    dispatcher._maybe_update_cuda_sync_point("before_finish")
    assert dispatcher.cuda_sync_point == "no_sync"  # EP=1: nothing else needs the host
    dispatcher._maybe_update_cuda_sync_point("before_ep_alltoall")
    assert dispatcher.cuda_sync_point == "before_ep_alltoall"  # EP>1: split sizes do
    dispatcher.device_splits = False
    dispatcher.cuda_sync_point = "no_sync"
    dispatcher._maybe_update_cuda_sync_point("before_finish")
    assert dispatcher.cuda_sync_point == "before_finish"
