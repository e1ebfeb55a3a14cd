"""Values as given, judged before start-up by one rule per kind: a path flag never takes an empty
value (an unset shell variable), and every float the driver passes on has a domain, refused in
the name of the flag the user set."""

import pytest

from megatron.moe_patches.driver import arguments, given_values, launcher_env

from driver_model import REQUIRED

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--save", ""], "--save '': an empty path (an unset shell variable?): give the path, or drop the flag"),
    (["--load", "  "], "--load '  ': an empty path (an unset shell variable?): give the path, or drop the flag"),
    (["--tensorboard-dir", ""], "--tensorboard-dir '': an empty path"),
    (["--data-cache-path", ""], "--data-cache-path '': an empty path"),
    (["--data-path"], "--data-path with no value: an empty path (an unset shell variable?): give the dataset "
     "prefixes, or drop the flag"),
    (["--data-path", "", "prefix"], "--data-path ['', 'prefix']: an empty path"),
])
def test_an_empty_path_is_refused_by_its_flag(argv, message, refused):
    assert refused([*REQUIRED, *argv]).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--lr-warmup-fraction", "nan"], "--lr-warmup-fraction nan: must be a finite number"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5: must be at least 0 and below 1"),
    (["--norm-epsilon=-1e-5"], "--norm-epsilon -1e-05: must be above 0"),
    (["--norm-epsilon", "inf"], "--norm-epsilon inf: must be a finite number"),
    (["--embedding-init-method-std", "0"], "--embedding-init-method-std 0.0: must be above 0"),
    ([*MOE, "--moe-z-loss-coeff", "nan"], "--moe-z-loss-coeff nan: must be a finite number"),
    ([*MOE, "--moe-z-loss-coeff", "-1"], "--moe-z-loss-coeff -1.0: must not be negative"),
    ([*MOE, "--moe-expert-capacity-factor", "-2"], "--moe-expert-capacity-factor -2.0: must be above 0"),
    ([*MOE, "--moe-router-topk-scaling-factor", "nan"], "--moe-router-topk-scaling-factor nan: must be a finite"),
    ([*MOE, "--moe-input-jitter-eps", "0"], "--moe-input-jitter-eps 0.0: must be above 0"),
    ([*MOE, "--moe-router-bias-update-rate", "-0.1"], "--moe-router-bias-update-rate -0.1: must not be negative"),
])
def test_a_float_outside_its_domain_is_refused_by_its_flag(argv, message, refused):
    assert refused([*REQUIRED, *argv]).startswith(message)


def test_every_float_flag_of_the_driver_has_a_domain():
    parser = arguments.build_parser()
    from megatron.moe_patches.driver import megatron_lm_flags

    refused_dests = {row.dest for row in megatron_lm_flags.FLAGS if row.refused or row.no_effect}
    domains = set(given_values.NOT_NEGATIVE + given_values.FRACTIONS + given_values.POSITIVE_FLOATS + given_values.UP_TO_ONE)
    floats = {a.dest for a in parser._actions if a.type is float and a.dest not in refused_dests}
    assert floats and not floats - domains, sorted(floats - domains)


def test_values_inside_their_domains_pass(refused):
    args = arguments.parse_args([*REQUIRED, *MOE, "--lr-warmup-fraction", "0.5", "--norm-epsilon", "1e-6",
                                 "--moe-z-loss-coeff", "0", "--moe-expert-capacity-factor", "1.5",
                                 "--moe-token-dispatcher-type", "alltoall"])
    assert args.layernorm_epsilon == 1e-6 and args.moe_expert_capacity_factor == 1.5


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize("argv, message", [
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "129"],
     "--ffn-hidden-size 129 must be divisible by --tensor-model-parallel-size 2"),
    ([*MOE, "--moe-ffn-hidden-size", "63", "--expert-tensor-parallel-size", "2"],
     "--moe-ffn-hidden-size 63 must be divisible by --expert-tensor-parallel-size 2"),
    ([*MOE, "--tensor-model-parallel-size", "2", "--ffn-hidden-size", "128", "--moe-ffn-hidden-size", "65"],
     "--moe-ffn-hidden-size 65 must be divisible by --expert-tensor-parallel-size (the TP size by default) 2"),
])
def test_a_size_its_parallel_size_does_not_divide_is_refused(argv, message, two_ranks, refused):
    assert refused([*REQUIRED, *argv]).startswith(message)


SYMMETRIC = [*MOE, "--moe-token-dispatcher-type", "alltoall", "--moe-device-tokens-per-expert", "--moe-permute-fusion",
             "--moe-symmetric-exchange", "--expert-model-parallel-size", "4"]


def test_the_symmetric_exchange_refuses_an_expert_group_across_nodes(monkeypatch, refused):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 nodes of 2 GPUs: an EP-4 group spans two
    assert refused([*REQUIRED, *SYMMETRIC, "--micro-batch-size", "1"]).startswith(
        "--moe-symmetric-exchange with --expert-model-parallel-size 4 (x expert TP 1) needs each expert-parallel "
        "group on one node, but the launcher starts 2 ranks per node (LOCAL_WORLD_SIZE)")


def test_the_symmetric_exchange_within_a_node_passes_that_check(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = arguments.build_parser().parse_args([*REQUIRED, *SYMMETRIC])
    launcher_env._check_symmetric_exchange_node(args, 8)  # no refusal
