"""Every feature in Megatron-LM's own training loop (core_v0.16.1): its pretrain_gpt.py with the
lines README adds (megatron.moe_patches.testing.megatron_lm_pretrain), a tiny GPT-MoE on mock data.

- CUDA graphs of the MoE layers (F11) under --cuda-graph-impl local and transformer_engine:
  every MoE layer is captured (the count the patch set prints) and the losses equal the eager
  run's, bf16 and FP8 (the replays compute what the eager layers compute, bit for bit).
- Resumes that change the experts' parameter layout: refused by name with Megatron-LM's
  default optimizer format (dp_reshardable), exact with --dist-ckpt-optim-fully-reshardable.
- --use-checkpoint-args restores the patch flags.
- Megatron-LM's default --gradient-accumulation-fusion trains without APEX (F13): TE experts
  and the fast path, eager and graphed (graphed equals eager bitwise), tracking the unfused run.
- The expert exchange (F12) at EP 2 and 4, graphed, equal to eager and tracking EP 1.
- The driver's sample-based schedule, batch-size ramp-up and evaluation follow Megatron-LM's
  on the same flags.

Runs only where MEGATRON_LM_PATH names a Megatron-LM core_v0.16.1 checkout. Each run is a
process of a tiny model, which leaves most of a GPU idle: the runs without paths start when
collection ends (``BACKGROUND``, tests/conftest.py), side by side in pretrain_runs' process
slots, each at most once per session whichever test asks for it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_runs import later_once, process_slot  # tests/gpu is on sys.path (conftest.py)

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(
    not CHECKOUT or not Path(CHECKOUT, "pretrain_gpt.py").exists(),
    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout",
)

LAYERS = 2
TINY = [
    "--num-layers", str(LAYERS), "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--bf16",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "20",
    "--hidden-dropout", "0", "--attention-dropout", "0",  # the local graphs' RNG tracker draws other numbers
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--split", "100,0,0",
    "--no-gradient-accumulation-fusion", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000", "--seed", "1234",
    "--deterministic-mode", "--distributed-timeout-minutes", "5",
]
FAST = ["--moe-device-tokens-per-expert"]
FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
FP8_BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
RESUME = ["--override-opt_param-scheduler"]  # the resumed runs train longer than the saving one


def graphs(impl):
    return ["--cuda-graph-impl", impl, "--cuda-graph-scope", "moe", "--cuda-graph-warmup-steps", "2"]


NO_FUSION = "--no-gradient-accumulation-fusion"


def megatron_lm(*flags, iters=8, expect_failure=False, stock=False, fusion=False, gpus=1):
    """One torchrun of Megatron-LM's pretrain_gpt.py (edited as README says, or as shipped with
    ``stock``) on ``gpus`` ranks; (losses by iteration, output). ``fusion``: Megatron-LM's default
    gradient-accumulation fusion (F13), which the other runs turn off."""
    base = [flag for flag in TINY if flag != NO_FUSION] if fusion else TINY
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-port", str(_port()),
           "-m", "megatron.moe_patches.testing.megatron_lm_pretrain", *base, "--train-iters", str(iters), *flags]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")
    env.setdefault("NCCL_ALGO", "Ring")  # --deterministic-mode asks for a fixed NCCL algorithm
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), CHECKOUT]))
    if stock:
        env["MEGATRON_LM_AS_SHIPPED"] = "1"
    with process_slot:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    output = run.stdout + run.stderr
    if expect_failure:
        assert run.returncode != 0, output[-3000:]
        return {}, output
    assert run.returncode == 0, output[-6000:]
    losses = {int(m.group(1)): m.group(2)
              for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", run.stdout)}
    assert losses and max(losses) == iters, output[-3000:]
    return losses, output


def _megatron_lm_with(options, *flags):
    return megatron_lm(*flags, **dict(options))


def shared(*flags, **options):
    """Future of ``megatron_lm(*flags, **options)``, started once per session whichever test asks
    first: a run without paths is the same run wherever it is asked for."""
    return later_once(_megatron_lm_with, tuple(sorted(options.items())), *flags)


def _port():
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def captured_layers(output):
    counts = [int(n) for n in re.findall(r"moe_patches: captured (\d+) MoE layers as CUDA graphs", output)]
    return counts


def graphed_training_runs(impl_precision):
    impl, precision = impl_precision
    extra = FAST + (FP8 if precision == "fp8" else [])
    return shared(*extra), shared(*extra, *graphs(impl))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_graphed_training_captures_every_moe_layer_and_equals_eager(impl, precision, background):
    (eager, _), (graphed, output) = (run.result() for run in background)
    print(f"{impl} {precision}: captured {captured_layers(output)} of {LAYERS} MoE layers; "
          f"eager {eager}; graphed {graphed}")
    assert captured_layers(output) == [LAYERS]
    assert graphed == eager  # the printed losses, every iteration (replays are bitwise eager)


WGRAD = {"fp8-wgrad": [], "bf16-wgrad": ["--no-fp8-wgrad"]}


def blockwise_runs(wgrad):
    flags = [*FAST, *FP8_BLOCKWISE, *WGRAD[wgrad]]
    return shared(*FAST), shared(*flags), shared(*flags, *graphs("local"))


BACKGROUND = {  # each gives its test the Futures of its runs
    "test_graphed_training_captures_every_moe_layer_and_equals_eager": (("impl", "precision"), graphed_training_runs),
    "test_blockwise_fp8_trains_on_the_fast_path_and_tracks_bf16": ("wgrad", blockwise_runs),
}


@pytest.mark.parametrize("wgrad", list(WGRAD))
def test_blockwise_fp8_trains_on_the_fast_path_and_tracks_bf16(wgrad, background):
    """--fp8-recipe blockwise under Megatron-LM's loop: the FP8 grouped-GEMM experts run (no
    fallback to TE's experts is logged), graphed training equals eager, and the loss curve
    tracks bf16's within 5 %; with --no-fp8-wgrad too (where DeepGEMM is installed the
    dispatcher then writes the experts' FP8 rows as it permutes)."""
    (bf16, _), (eager, eager_output), (graphed, output) = (run.result() for run in background)
    assert "run the TE backend" not in eager_output, eager_output[-3000:]
    print(f"blockwise {wgrad}: eager {eager}; graphed {graphed}; bf16 {bf16}")
    assert captured_layers(output) == [LAYERS]
    assert graphed == eager
    assert sorted(eager) == sorted(bf16)
    for step in bf16:
        assert float(eager[step]) == pytest.approx(float(bf16[step]), rel=0.05)


@pytest.mark.parametrize("ep", [2, 4])
def test_the_expert_exchange_trains_graphed_at_ep_and_tracks_ep1(ep):
    """--moe-symmetric-exchange (F12) at EP 2 / 4 in Megatron-LM's loop, the MoE layers graphed
    (F11): every layer is captured, the replays equal the eager run, and the losses follow the
    EP 1 run of the same data-parallel job (other reduction order: within 2 %)."""
    import torch

    if torch.cuda.device_count() < ep:
        pytest.skip(f"EP={ep} needs {ep} GPUs")
    exchange = [*FAST, "--moe-symmetric-exchange", "--expert-model-parallel-size", str(ep)]
    ep1, _ = megatron_lm(*FAST, gpus=ep)
    eager, output = megatron_lm(*exchange, gpus=ep)
    graphed, output = megatron_lm(*exchange, *graphs("local"), gpus=ep)
    print(f"EP {ep}: captured {captured_layers(output)}; EP 1 {ep1}; eager {eager}; graphed {graphed}")
    assert set(captured_layers(output)) == {LAYERS}  # every rank prints its count
    assert graphed == eager
    assert sorted(eager) == sorted(ep1)
    for step in ep1:
        assert float(eager[step]) == pytest.approx(float(ep1[step]), rel=0.02)


def test_the_series_at_its_defaults_trains_as_stock_megatron_lm():
    (patched, _), (stock, _) = (run.result() for run in (shared(), shared(stock=True)))
    assert patched == stock


@pytest.mark.parametrize("fully_reshardable", [False, True])
def test_a_resume_into_the_grouped_layout(tmp_path, fully_reshardable):
    ckpt = tmp_path / "ckpt"
    fmt = ["--dist-ckpt-optim-fully-reshardable"] if fully_reshardable else []
    saved, _ = megatron_lm(*FAST, *fmt, "--save", str(ckpt), "--save-interval", "4", iters=4)
    same, _ = megatron_lm(*FAST, *fmt, *RESUME, "--load", str(ckpt), iters=8)
    if not fully_reshardable:
        _, output = megatron_lm(*FAST, *RESUME, "--moe-single-grouped-weight", "--load", str(ckpt), iters=8,
                                expect_failure=True)
        assert "another expert parameter layout: --moe-single-grouped-weight False (checkpoint) vs True (now)" in output
        return
    grouped, _ = megatron_lm(*FAST, *fmt, *RESUME, "--moe-single-grouped-weight", "--load", str(ckpt), iters=8)
    print(f"resumed per-expert {same}, grouped {grouped}")
    assert sorted(grouped) == sorted(same) == [5, 6, 7, 8]
    for step in same:  # the same states in another layout: the same training (other GEMM order)
        assert float(grouped[step]) == pytest.approx(float(same[step]), rel=0.02)


def test_use_checkpoint_args_restores_the_patch_flags(tmp_path):
    ckpt = tmp_path / "ckpt"
    megatron_lm(*FAST, "--moe-single-grouped-weight", "--save", str(ckpt), "--save-interval", "4", iters=4)
    _, output = megatron_lm(*RESUME, "--load", str(ckpt), "--use-checkpoint-args", iters=6)
    assert "moe_single_grouped_weight = True from the checkpoint's args" in output
    assert "moe_device_tokens_per_expert = True from the checkpoint's args" in output


def test_gradient_accumulation_fusion_trains_without_apex():
    runs = (shared(*FAST), shared(*FAST, fusion=True), shared(*FAST, *graphs("transformer_engine"), fusion=True),
            shared(fusion=True))  # the last: the series at its defaults, TE's own fusion
    (unfused, _), (fused, fused_output), (graphed, output), (te_experts, _) = (run.result() for run in runs)
    assert "fused_weight_gradient_mlp_cuda" not in fused_output
    print(f"fusion: unfused {unfused}; fused {fused}; graphed {graphed}; TE experts {te_experts}")
    assert captured_layers(output) == [LAYERS]
    assert graphed == fused  # replays add into main_grad what the eager backward adds
    for step in unfused:
        # fused sums each micro-batch's weight gradient in fp32, unfused rounds it to bf16 first
        assert float(fused[step]) == pytest.approx(float(unfused[step]), rel=1e-2)
        assert float(te_experts[step]) == pytest.approx(float(unfused[step]), rel=5e-2)


# A sample-based run with a batch-size ramp-up and evaluation, as Megatron-LM's own example
# configures them: 48 samples, the global batch 2 -> 4 -> 6 -> 8 over the first 24 samples.
SAMPLES = ["--train-samples", "48", "--rampup-batch-size", "2", "2", "24", "--lr-warmup-samples", "8",
           "--lr-decay-samples", "40", "--eval-interval", "3", "--eval-iters", "2", "--split", "80,20,0"]
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?"
                            r"learning rate: ([0-9.E+-]+) \| global batch size:\s+(\d+) \| lm loss: ([0-9.E+-]+)")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: ([0-9.E+-]+)")


def schedule(output):
    """(iteration, consumed samples, learning rate, global batch size) per logged iteration, and
    (iteration, which split, loss) per validation line."""
    steps = [m.groups()[:4] for m in ITERATION_LINE.finditer(output)]
    evals = [(int(m.group(1)), (m.group(2) or "").strip(), float(m.group(3))) for m in VALIDATION_LINE.finditer(output)]
    return steps, evals


def driver(*flags):
    """This package's pretrain_gpt.py on the same flags as ``megatron_lm`` (its Megatron-LM names)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(_port()),
           str(Path(__file__).resolve().parents[2] / "pretrain_gpt.py"), *flags]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")
    with process_slot:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run.stdout


def test_samples_rampup_and_evaluation_follow_megatron_lms_loop():
    """The driver's sample-based schedule, ramp-up and evaluation against Megatron-LM's on the same
    flags: the same iterations, consumed samples, learning rates and global batch sizes, and
    validation at the same iterations (and at the end); the losses of both loops are finite and
    close (the two loops build the same model from the same seed)."""
    base = [flag for i, flag in enumerate(TINY) if flag not in ("--lr-warmup-iters", "--lr-decay-iters", "--split",
                                                               "--eval-iters", "--eval-interval")
            and TINY[i - 1] not in ("--lr-warmup-iters", "--lr-decay-iters", "--split", "--eval-iters",
                                    "--eval-interval")]
    flags = [*base, *FAST, *SAMPLES]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(_port()),
           "-m", "megatron.moe_patches.testing.megatron_lm_pretrain", *flags]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", NCCL_ALGO="Ring")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), CHECKOUT]))
    with process_slot:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    theirs, their_evals = schedule(run.stdout)
    # the driver keeps megatron-core's process-group defaults (it refuses a timeout flag by name)
    timeout = flags.index("--distributed-timeout-minutes")
    ours, our_evals = schedule(driver(*flags[:timeout], *flags[timeout + 2:]))
    print(f"Megatron-LM {theirs} {their_evals}\ndriver {ours} {our_evals}")
    # iteration, consumed samples and global batch size as printed; the learning rate within the
    # last printed digit (the two loops round the schedule's float math apart)
    assert [(s[0], s[1], s[3]) for s in ours] == [(s[0], s[1], s[3]) for s in theirs] and len(theirs) > 5
    assert [float(s[2]) for s in ours] == pytest.approx([float(s[2]) for s in theirs], rel=1e-6)
    assert [int(s[3]) for s in theirs][0] == 2 and int(theirs[-1][3]) == 8  # the ramp, as asked
    assert [(i, split) for i, split, _ in our_evals] == [(i, split) for i, split, _ in their_evals]
    assert any(split == "" for _, split, _ in their_evals) and any(split for _, split, _ in their_evals)
    for (_, _, mine), (_, _, megatron) in zip(our_evals, their_evals):
        assert mine == pytest.approx(megatron, rel=0.05)
