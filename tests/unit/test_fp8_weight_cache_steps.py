"""F10's FP8 weight copies after a step of megatron-core's own optimizer, on CPU.

megatron-core's mixed-precision optimizers step a torch optimizer over fp32 main copies and
then write the results into the bf16 model parameters through ``.data``: the parameters keep
their storage and their version counters do not move. The signal that the FP8 copies are stale
is the one megatron-core's TE layers use: its schedules mark each step's first micro-batch
(``MegatronModule.set_is_first_microbatch`` sets the FC modules' ``is_first_microbatch``).
These tests run megatron-core's ``Float16OptimizerWithFloat16Params.step()`` itself (its
constructor allocates CUDA tensors and accepts CUDA parameters only, so the test builds what it
builds: fp32 main copies inside the torch optimizer, the float16 groups) and megatron-core's
``set_is_first_microbatch``, and check that the copies the experts' GEMMs read, in the graph path
(``refresh_weight_caches``, what F11 calls before a replay) and the eager one (the cache a
forward's GEMM takes), are the new weights' quantization. The same through megatron-core's
schedule and a real CUDA optimizer (both megatron-core optimizers, from
``get_megatron_optimizer``): tests/gpu/test_fp8_weight_cache_steps.py.
"""

import torch
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from megatron.moe_patches.experts import fp8_grouped_mm as fp8
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.experts.grouped_mm import grouped_param, weight_params

from expert_shells import experts_shell

EXPERTS, OUT, IN = 3, 8, 16

BASE = dict(
    num_layers=1, hidden_size=IN, num_attention_heads=4, num_moe_experts=EXPERTS, moe_ffn_hidden_size=OUT // 2,
    moe_grouped_gemm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_device_tokens_per_expert=True,
)


def fp8_backend(**overrides):
    """The FP8 experts' backend over a CPU stand-in of the experts module."""
    config = PatchedTransformerConfig(**{**BASE, **overrides})
    config.fp8, config.fp8_recipe = "e4m3", "tensorwise"  # set late: megatron-core checks TE for FP8 at construction
    owner = experts_shell(fp8.FP8GroupedMMBackend, config, EXPERTS, (OUT, IN), (OUT, IN))
    return owner, fp8.FP8GroupedMMBackend(owner)


def megatron_bf16_optimizer(params, lr=0.05):
    """megatron-core's Float16OptimizerWithFloat16Params over bf16 ``params`` with fp32 main
    copies (Adam), built on the CPU as its constructor would build it on the GPU."""
    mains = []
    for param in params:
        main = param.detach().clone().float()
        param.main_param = main
        mains.append(main)
    optimizer = object.__new__(Float16OptimizerWithFloat16Params)
    MegatronOptimizer.__init__(optimizer, torch.optim.Adam(mains, lr=lr),
                               OptimizerConfig(optimizer="adam", lr=lr, bf16=True, clip_grad=0.0))
    optimizer.grad_scaler, optimizer._dummy_overflow_buf, optimizer._scale_one = None, None, torch.ones(1)
    optimizer.is_stub_optimizer = False
    optimizer.float16_groups, optimizer.fp32_from_float16_groups, optimizer.fp32_from_fp32_groups = [list(params)], [mains], [[]]
    return optimizer


def step_like_training(optimizer, params):
    """Gradients, then megatron-core's step; returns what the parameters' counters say about it."""
    generator = torch.Generator().manual_seed(1)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
    seen = [(p.data_ptr(), p._version) for p in params]
    before = [p.detach().clone() for p in params]
    success, _, _ = optimizer.step()
    assert success
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params))  # the step changed every weight
    return seen == [(p.data_ptr(), p._version) for p in params]


def current_fp8(linear):
    """The FP8 copies of ``linear``'s current weights, quantized afresh."""
    return fp8.quantize_weights(grouped_param(linear).detach())


def assert_cache_holds(cache, expected):
    w8_EOI, w8_EIO, scale_inv_E = expected
    assert torch.equal(cache.weights.scale_inv_E, scale_inv_E)
    assert torch.equal(cache.weights.w8_EOI.view(torch.uint8), w8_EOI.view(torch.uint8))
    assert torch.equal(cache.weights.w8_EIO.view(torch.uint8), w8_EIO.view(torch.uint8))


def test_the_steps_first_micro_batch_refreshes_the_copies_a_graph_replays(quantizations):
    owner, backend = fp8_backend()
    linears = (owner.linear_fc1, owner.linear_fc2)
    backend.refresh_weight_caches()  # the warm-up before a capture quantizes once
    caches = [backend._caches[linear] for linear in linears]
    held = [(c.weights.w8_EOI, c.weights.w8_EIO, c.weights.scale_inv_E) for c in caches]
    old = [c.weights.w8_EOI.clone() for c in caches]
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [1, 1]  # nothing changed: no requantization

    params = list(owner.parameters())
    assert step_like_training(megatron_bf16_optimizer(params), params)  # invisible to the counters
    owner.set_is_first_microbatch()  # megatron-core's schedule, at the next step's first micro-batch
    backend.refresh_weight_caches()  # what F11 runs before the next replay
    assert [quantizations[c] for c in caches] == [2, 2]
    for cache, linear, tensors, before in zip(caches, linears, held, old):
        assert_cache_holds(cache, current_fp8(linear))
        assert not torch.equal(cache.weights.w8_EOI.view(torch.uint8), before.view(torch.uint8))
        # in place: the graph's GEMMs read these very tensors
        assert all(a is b for a, b in zip(tensors, (cache.weights.w8_EOI, cache.weights.w8_EIO, cache.weights.scale_inv_E)))
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [2, 2]  # once per step, not per micro-batch


def test_the_steps_first_micro_batch_refreshes_the_copies_of_a_grouped_weight_in_eager_forwards(quantizations):
    owner, backend = fp8_backend(moe_single_grouped_weight=True)
    fc2 = owner.linear_fc2
    assert tuple(fc2.weight.shape) == (EXPERTS, OUT, IN)  # one [E, out, in] parameter
    cache = backend._caches[fc2]
    cache.get(fc2, grouped_param(fc2))  # a forward's FC2 GEMM: quantizes on first use
    before = cache.weights.w8_EOI.clone()
    cache.get(fc2, grouped_param(fc2))  # the next micro-batch
    assert quantizations[cache] == 1 and fc2.is_first_microbatch is False

    params = list(owner.parameters())
    assert step_like_training(megatron_bf16_optimizer(params), params)
    owner.set_is_first_microbatch()
    cache.get(fc2, grouped_param(fc2))
    assert quantizations[cache] == 2
    assert_cache_holds(cache, current_fp8(fc2))
    assert not torch.equal(cache.weights.w8_EOI.view(torch.uint8), before.view(torch.uint8))


def test_a_step_that_changes_nothing_the_counters_see_needs_the_schedules_mark():
    """Why the step's first micro-batch is the signal: a cache keyed on storage and version
    counters only would keep the first step's copies after megatron-core's step."""
    owner, backend = fp8_backend()
    backend.refresh_weight_caches()
    fc1 = owner.linear_fc1
    cache = backend._caches[fc1]
    keyed_by_counters = [(p.data_ptr(), p._version) for p in weight_params(fc1)]
    params = list(owner.parameters())
    step_like_training(megatron_bf16_optimizer(params), params)
    assert keyed_by_counters == [(p.data_ptr(), p._version) for p in weight_params(fc1)]
    assert not cache.stale(fc1)
    owner.set_is_first_microbatch()
    assert cache.stale(fc1)


def test_disabled_parameter_transpose_caches_requantize_every_forward(quantizations):
    """megatron-core's disable_parameter_transpose_cache config field: its TE layers then
    requantize their weights at every forward; so do these."""
    owner, backend = fp8_backend()
    for linear in (owner.linear_fc1, owner.linear_fc2):
        linear.disable_parameter_transpose_cache = True  # megatron-core's TE wrapper copies the config's
    backend.refresh_weight_caches()
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in backend._caches.values()] == [2, 2]


def test_a_weight_written_in_place_refreshes_its_own_fc_only(quantizations):
    """A write that the parameter's counter sees (a checkpoint load's copy_) makes that FC's
    copies stale and leaves the untouched FC's copies alone: no step, no requantization."""
    owner, backend = fp8_backend()
    backend.refresh_weight_caches()
    caches = [backend._caches[owner.linear_fc1], backend._caches[owner.linear_fc2]]
    untouched = caches[1].weights.w8_EOI.clone()
    with torch.no_grad():
        owner.linear_fc1.weight2.mul_(-2)
    backend.refresh_weight_caches()
    assert [quantizations[c] for c in caches] == [2, 1]
    assert_cache_holds(caches[0], current_fp8(owner.linear_fc1))
    assert torch.equal(caches[1].weights.w8_EOI.view(torch.uint8), untouched.view(torch.uint8))
