"""pretrain_gpt.py's Megatron-LM flags --no-load-optim, --load-main-params-from-ckpt,
--overlap-moe-expert-parallel-comm and --delay-wgrad-compute: parsed into megatron-core
0.16.1's fields, their contradictions refused before start-up (exit status 2, one line
naming the flag and the fix), and the checkpoint load and forward step they change."""

import argparse

import pytest
import torch
from packaging.version import Version

from megatron.moe_patches import capabilities
from megatron.moe_patches.config import PatchedTransformerConfig
from megatron.moe_patches.driver import arguments, checkpointing, training
from megatron.moe_patches.driver.arguments import parse_args, transformer_config_kwargs

import checkpoint_files
from driver_model import REQUIRED, RUN

pytestmark = pytest.mark.usefixtures("one_rank")

MOE = [*RUN, "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4",
       "--swiglu", "--disable-bias-linear", "--num-experts", "8", "--moe-ffn-hidden-size", "512",
       "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--bf16"]
EP2 = ["--expert-model-parallel-size", "2"]
OVERLAP = [*MOE, *EP2, "--overlap-moe-expert-parallel-comm"]


@pytest.fixture
def checkpoint_dir(tmp_path):
    """A --load directory that holds a checkpoint (tracker and a complete iteration directory)."""
    return str(checkpoint_files.checkpoint_root(tmp_path, 4))


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")


# --- parse -> config fields ---------------------------------------------------------------


def test_overlap_flags_reach_the_transformer_config(two_ranks):
    args = parse_args([*OVERLAP, "--delay-wgrad-compute"])
    kwargs = transformer_config_kwargs(args)
    assert kwargs["overlap_moe_expert_parallel_comm"] is True and kwargs["delay_wgrad_compute"] is True
    config = PatchedTransformerConfig(**kwargs)
    assert config.overlap_moe_expert_parallel_comm and config.delay_wgrad_compute
    defaults = PatchedTransformerConfig(**transformer_config_kwargs(parse_args(MOE)))
    assert not defaults.overlap_moe_expert_parallel_comm and not defaults.delay_wgrad_compute


def test_flex_dispatcher_may_overlap_too(two_ranks):
    args = parse_args([*MOE[:-2], "flex", "--bf16", *EP2, "--overlap-moe-expert-parallel-comm"])
    assert transformer_config_kwargs(args)["overlap_moe_expert_parallel_comm"] is True


def test_load_flags_parse(checkpoint_dir):
    args = parse_args([*REQUIRED, "--bf16", "--use-distributed-optimizer", "--load", checkpoint_dir,
                       "--no-load-optim", "--load-main-params-from-ckpt"])
    assert args.no_load_optim and args.load_main_params_from_ckpt
    defaults = parse_args(REQUIRED)
    assert not defaults.no_load_optim and not defaults.load_main_params_from_ckpt
    assert parse_args([*REQUIRED, "--no-load-optim"]).no_load_optim  # as in Megatron-LM: harmless without --load


def test_router_padding_for_quantization_is_wired_and_refused_with_allgather(refused):
    args = parse_args([*MOE, "--fp8-format", "e4m3", "--moe-router-padding-for-quantization"])
    assert transformer_config_kwargs(args)["moe_router_padding_for_quantization"] is True
    assert refused([*MOE[:-2], "allgather", "--bf16", "--fp8-format", "e4m3",
                    "--moe-router-padding-for-quantization"]) == (
        "--moe-router-padding-for-quantization does not work with --moe-token-dispatcher-type allgather: "
        "use alltoall or flex")


# --- refusals before start-up -------------------------------------------------------------

MAIN_PARAMS = ["--load-main-params-from-ckpt"]


@pytest.mark.parametrize("argv, message", [
    (["--bf16", "--use-distributed-optimizer", "--load", "{ckpt}", *MAIN_PARAMS],
     "--load-main-params-from-ckpt needs --no-load-optim (with the optimizer states loaded, the main params "
     "come from them): add --no-load-optim or drop the flag"),
    (["--bf16", "--use-distributed-optimizer", "--no-load-optim", *MAIN_PARAMS],
     "--load-main-params-from-ckpt needs --load (the checkpoint directory)"),
    (["--use-distributed-optimizer", "--load", "{ckpt}", "--no-load-optim", *MAIN_PARAMS],
     "--load-main-params-from-ckpt needs --bf16 (only mixed precision keeps fp32 main params apart from the "
     "model's params): add --bf16 or drop the flag"),
    (["--bf16", "--load", "{ckpt}", "--no-load-optim", *MAIN_PARAMS],
     "--load-main-params-from-ckpt needs --use-distributed-optimizer (megatron-core's other mixed-precision "
     "optimizer cannot take main params from a state dict): add it or drop the flag"),
])
def test_main_params_from_checkpoint_combinations_are_refused(argv, message, checkpoint_dir, refused):
    assert refused([*REQUIRED, *(a.replace("{ckpt}", checkpoint_dir) for a in argv)]) == message


@pytest.mark.parametrize("world, argv, message", [
    (1, ["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm needs --num-experts"),
    (1, [*MOE, "--overlap-moe-expert-parallel-comm"],
     "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1 (it hides the expert-parallel "
     "all-to-all): raise the EP size or drop the flag"),
    (2, [*MOE[:-2], "allgather", "--bf16", *EP2, "--overlap-moe-expert-parallel-comm"],
     "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall or flex, not allgather"),
    (2, [*MOE[:-1], *EP2, "--overlap-moe-expert-parallel-comm"],
     "--overlap-moe-expert-parallel-comm needs --bf16 (megatron-core overlaps bf16/fp16 models only): add --bf16"),
    (4, [*OVERLAP, "--pipeline-model-parallel-size", "2"],
     "--overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size > 1 needs virtual pipeline stages, "
     "which pretrain_gpt.py does not offer: use --pipeline-model-parallel-size 1"),
    (2, [*MOE, *EP2, "--delay-wgrad-compute"],
     "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core computes the delayed weight "
     "gradients in its overlapped schedule): add --overlap-moe-expert-parallel-comm"),
    (1, ["--delay-wgrad-compute"],
     "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core computes the delayed weight "
     "gradients in its overlapped schedule): add --overlap-moe-expert-parallel-comm"),
    (2, [*OVERLAP, "--delay-wgrad-compute", "--transformer-impl", "local"],
     "--delay-wgrad-compute needs --transformer-impl transformer_engine (megatron-core's own layers compute "
     "weight gradients at once)"),
])
def test_overlap_combinations_are_refused(world, argv, message, monkeypatch, refused):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert refused([*REQUIRED, *argv]) == message


def test_overlap_needs_torch_2_6(two_ranks, monkeypatch, refused):
    monkeypatch.setattr(arguments, "_torch_version", lambda: (2, 5))
    assert refused(OVERLAP) == (
        f"--overlap-moe-expert-parallel-comm needs torch >= 2.6 (the all-to-all overlap hangs on older versions); "
        f"this is torch {torch.__version__}: upgrade torch or drop the flag")


@pytest.mark.parametrize("te, extra, message", [
    ("2.6.0", ["--no-gradient-accumulation-fusion"], "--delay-wgrad-compute with --no-gradient-accumulation-fusion "
     "needs Transformer Engine >= 2.7.0; this is 2.6.0: upgrade TE or drop one of the flags"),
    ("2.7.1", ["--overlap-grad-reduce"], "--delay-wgrad-compute with --overlap-grad-reduce needs Transformer "
     "Engine >= 2.8.0; this is 2.7.1: upgrade TE or drop --overlap-grad-reduce"),
])
def test_delay_wgrad_compute_needs_a_recent_te(te, extra, message, two_ranks, monkeypatch, refused):
    monkeypatch.setattr(capabilities, "te_version", lambda: Version(te))
    assert refused([*OVERLAP, "--delay-wgrad-compute", *extra]) == message


def test_delay_wgrad_compute_passes_with_te_2_8(two_ranks, monkeypatch):
    monkeypatch.setattr(capabilities, "te_version", lambda: Version("2.8.0"))
    args = arguments.build_parser().parse_args([*OVERLAP, "--delay-wgrad-compute", "--overlap-grad-reduce"])
    arguments.check_args(args, world_size=2)  # no refusal


# --- the checkpoint load with and without the optimizer states ------------------------------


class _Recorder:
    def __init__(self, **attrs):
        self.calls = []
        self.__dict__.update(attrs)

    def sharded_state_dict(self, *args, **kwargs):
        return {"w": "model-entry"}

    def load_state_dict(self, state):
        self.calls.append(("load_state_dict", state))

    def reload_model_params(self, state_dict=None):
        self.calls.append(("reload_model_params", state_dict))


@pytest.fixture
def fake_load(tmp_path, monkeypatch):
    """checkpointing.load against a stand-in dist_checkpointing; returns (run, loads): run(**args)
    loads with those args and returns (model, optimizer, scheduler); loads: the states read."""
    from megatron.core import dist_checkpointing

    checkpoint_files.checkpoint_root(tmp_path, 7)
    # Saved in another optimizer layout: only a load of the optimizer states must mind it.
    common = {"args": {"moe_single_grouped_weight": True, "use_distributed_optimizer": True}, "iteration": 7, "opt_param_scheduler": {"num_steps": 70}}
    loads = []
    monkeypatch.setattr(checkpointing, "read_common_state", lambda path: common)
    monkeypatch.setattr(dist_checkpointing, "load",
                        lambda state, path, **kw: loads.append(state) or {k: {"w": torch.ones(1)} for k in state})
    monkeypatch.setattr(checkpointing, "check_checkpoint_covers", lambda state, path: None)
    monkeypatch.setattr(checkpointing, "fit_optimizer_state", lambda optimizer, loaded: loaded)
    monkeypatch.setattr(checkpointing, "_state", lambda model, optimizer, *rest, loading: {
        "model": model.sharded_state_dict(), "optimizer": {"o": "optimizer-entry"}})

    def run(optimizer=None, **flags):
        args = argparse.Namespace(**{"bf16": True, "moe_single_grouped_weight": False, **flags})
        model, scheduler = _Recorder(), _Recorder()
        optimizer = optimizer or _Recorder()
        assert checkpointing.load(str(tmp_path), model, optimizer, scheduler, args) == 7
        return model, optimizer, scheduler

    return run, loads


def test_no_load_optim_reads_the_model_only_and_refills_main_params_from_it(fake_load):
    run, loads = fake_load
    model, optimizer, scheduler = run(no_load_optim=True)
    assert list(loads[-1]) == ["model"]  # no optimizer states read
    assert model.calls == [("load_state_dict", {"w": torch.ones(1)})]
    assert optimizer.calls == [("reload_model_params", None)]  # from the loaded model params
    assert scheduler.calls == []  # the learning-rate schedule starts afresh (Megatron-LM)


def test_main_params_from_the_checkpoint_reach_every_optimizer_of_a_chain(fake_load):
    run, loads = fake_load
    dense, expert = _Recorder(), _Recorder()
    _, chain, _ = run(optimizer=_Recorder(chained_optimizers=[dense, expert]), no_load_optim=True,
                      load_main_params_from_ckpt=True)
    for part in (dense, expert):
        ((name, state),) = part.calls
        assert name == "reload_model_params" and list(state) == ["model"]
        assert torch.equal(state["model"]["w"], torch.ones(1))
    assert chain.calls == []  # not through the chain, which would hand it to the first only


def test_without_no_load_optim_the_optimizer_and_schedule_load_as_before(fake_load):
    run, loads = fake_load
    with pytest.raises(ValueError, match="another expert parameter layout"):
        run()  # the optimizer states' layout is still checked
    _, optimizer, scheduler = run(moe_single_grouped_weight=True)
    assert list(loads[-1]) == ["model", "optimizer"]
    assert [name for name, _ in optimizer.calls] == ["load_state_dict"]
    assert scheduler.calls == [("load_state_dict", {"num_steps": 70})]


def test_fp32_training_has_no_main_params_to_refill(fake_load):
    run, _ = fake_load
    _, optimizer, _ = run(no_load_optim=True, bf16=False)
    assert optimizer.calls == []


# --- the forward step of megatron-core's combined 1F1B schedule ------------------------------


def test_forward_step_builds_a_schedule_plan_when_asked(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    batch = {"tokens": torch.tensor([[1, 2]]), "labels": torch.tensor([[2, 3]]),
             "position_ids": torch.tensor([[0, 1]]), "loss_mask": torch.tensor([[1, 1]])}

    class Model:
        def build_schedule_plan(self, tokens, position_ids, attention_mask, labels=None):
            self.plan_inputs = (tokens, position_ids, attention_mask, labels)
            return "plan"

        def __call__(self, tokens, position_ids, attention_mask, labels=None):
            return "output"

    model = Model()
    plan, loss = training.forward_step(iter([batch]), model, return_schedule_plan=True)
    assert plan == "plan" and loss.func is training._loss
    tokens, position_ids, mask, labels = model.plan_inputs
    assert torch.equal(tokens, batch["tokens"]) and mask is None and torch.equal(labels, batch["labels"])
    output, _ = training.forward_step(iter([batch]), model)
    assert output == "output"


def test_delay_wgrad_compute_reaches_megatron_ddp(monkeypatch, two_ranks):
    """build_model hands --delay-wgrad-compute to DistributedDataParallelConfig: TE then gives
    DDP the weights' grad hooks to run after the delayed weight-gradient GEMMs."""
    import megatron.core.distributed as mcore_distributed
    import megatron.core.models.gpt as mcore_gpt
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.parallel_state as parallel_state
    import megatron.core.transformer.module as mcore_module

    class Built:
        def __init__(self, *args, **kwargs):
            pass

        def cuda(self):
            return self

    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", lambda: True)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda: True)
    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kwargs: None)
    monkeypatch.setattr(mcore_gpt, "GPTModel", Built)
    monkeypatch.setattr(mcore_module, "Float16Module", lambda config, module: module)
    monkeypatch.setattr(mcore_distributed, "DistributedDataParallel", lambda config, ddp_config, module: ddp_config)
    for flags, expected in (([], False), (["--delay-wgrad-compute"], True)):
        args = parse_args([*OVERLAP, *flags])
        _, ddp_config = training.build_model(args, config=None)
        assert ddp_config.delay_wgrad_compute is expected
