import pytest
import torch

from megatron.moe_patches.experts.glu_interleave import interleave_parameters, to_concatenated, to_interleaved


def test_interleaved_row_order_is_blocks_of_gate_then_linear():
    gate, linear = torch.arange(0, 6), torch.arange(100, 106)
    rows = torch.cat([gate, linear])
    assert to_interleaved(rows, 2).tolist() == [0, 1, 100, 101, 2, 3, 102, 103, 4, 5, 104, 105]
    assert to_interleaved(rows, 3).tolist() == [0, 1, 2, 100, 101, 102, 3, 4, 5, 103, 104, 105]
    # Size F: one block of each, the concatenated layout itself.
    assert torch.equal(to_interleaved(rows, 6), rows)


@pytest.mark.parametrize("shape, dim, size", [((12, 5), 0, 2), ((12,), 0, 1), ((3, 24, 4), 1, 4), ((2, 7, 16), -1, 8)])
def test_conversions_are_exact_inverses(shape, dim, size):
    t = torch.randn(shape, dtype=torch.bfloat16)
    inter = to_interleaved(t, size, dim)
    assert not torch.equal(inter, t) or t.shape[dim] == 2 * size
    assert torch.equal(to_concatenated(inter, size, dim), t)
    assert torch.equal(to_interleaved(to_concatenated(t, size, dim), size, dim), t)


def test_size_must_divide_half_the_rows():
    with pytest.raises(ValueError, match="does not divide"):
        to_interleaved(torch.zeros(12, 3), 4)


class TwoExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(2):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(8, 3)))
            self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.randn(8)))


def test_parameters_interleaved_in_memory_checkpoints_concatenated():
    module = TwoExperts()
    original = {k: v.clone() for k, v in module.state_dict().items()}
    params = dict(module.named_parameters())
    storage = {n: p.data_ptr() for n, p in params.items()}
    interleave_parameters(module, 2)
    assert all(p is params[n] for n, p in module.named_parameters())  # same Parameter objects
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == storage  # reordered in place
    assert torch.equal(module.weight0.detach(), to_interleaved(original["weight0"], 2))
    saved = module.state_dict()
    assert all(torch.equal(saved[k], original[k]) for k in original)

    # A checkpoint from an uninterleaved model loads into the interleaved layout...
    other = TwoExperts()
    module.load_state_dict(other.state_dict())
    assert torch.equal(module.bias1.detach(), to_interleaved(other.bias1.detach(), 2))
    # ...and the interleaved model's checkpoint loads into an uninterleaved one unchanged.
    fresh = TwoExperts()
    fresh.load_state_dict(module.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], other.state_dict()[k]) for k in original)


def test_sharded_entry_saves_concatenated_for_params_and_optimizer_states():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from megatron.moe_patches.experts.glu_interleave import concatenated_factory

    param = torch.nn.Parameter(to_interleaved(torch.randn(8, 3), 2))
    for stock in (ShardedTensor.from_rank_offsets("fc1.weight", param),
                  apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1.weight", param), ())):
        factory = concatenated_factory(stock, 2)
        assert factory.data is param  # optimizers find the parameter by identity
        state = torch.randn(8, 3)  # e.g. exp_avg, interleaved in memory like the parameter
        built = factory.build_fn("optimizer.state.exp_avg.fc1.weight", state, 0, None)
        parts = built if isinstance(built, list) else [built]
        saved = torch.cat([p.data for p in parts])
        assert torch.equal(saved, to_concatenated(state, 2))
        loaded = [p.data for p in parts] if isinstance(built, list) else built.data
        assert torch.equal(factory.merge_fn(loaded), state)


def test_distributed_load_path_interleaves_exactly_once():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.moe_patches.experts.glu_interleave import concatenated_factory

    module = TwoExperts()
    standard = {k: v.clone() for k, v in module.state_dict().items()}
    interleave_parameters(module, 2)
    live = dict(module.state_dict(keep_vars=True))  # what sharded_state_dict wraps
    assert all(live[k] is p for k, p in module.named_parameters())
    # Save: the factory writes the concatenated layout; load: merge, then load_state_dict.
    on_disk, loaded = {}, {}
    for key, param in live.items():
        factory = concatenated_factory(ShardedTensor.from_rank_offsets(key, param), 2)
        on_disk[key] = factory.build_fn(key, param.detach(), 0, None).data
        loaded[key] = factory.merge_fn(on_disk[key].clone())
    assert all(torch.equal(on_disk[k], standard[k]) for k in standard)
    fresh = TwoExperts()
    interleave_parameters(fresh, 2)
    fresh.load_state_dict(loaded)
    assert all(torch.equal(p, dict(module.named_parameters())[n]) for n, p in fresh.named_parameters())
