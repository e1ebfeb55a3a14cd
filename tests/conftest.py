import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

GPU_DIRS = ("tests/gpu/", "tests/functional/")


def _gpu_unavailable() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (see README, 'Running the GPU tests')"
    from megatron.moe_patches import capabilities

    if capabilities.te_version() is None:
        return "needs Transformer Engine (pip install -e '.[te]')"
    return ""


def pytest_collection_modifyitems(config, items):
    """GPU and functional tests skip themselves, with the reason, where they cannot run."""
    reason = _gpu_unavailable()
    if reason:
        for item in items:
            if any(d in str(item.fspath).replace("\\", "/") for d in GPU_DIRS):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def host_copies(monkeypatch):
    """The experts' copies of token counts to the host, as a list: a counting stand-in wraps
    ``host_tokens_per_expert`` where the backends call it."""
    from megatron.moe_patches.experts import backend, op_fuser

    copies = []
    real = backend.host_tokens_per_expert

    def counting(tokens_per_expert_E):
        if tokens_per_expert_E.is_cuda:
            copies.append(tokens_per_expert_E)
        return real(tokens_per_expert_E)

    monkeypatch.setattr(backend, "host_tokens_per_expert", counting)
    monkeypatch.setattr(op_fuser, "host_tokens_per_expert", counting)
    return copies



@pytest.fixture
def quantizations(monkeypatch):
    """How often each FP8 weight cache built during the test quantized its weights
    (``counts[cache]``): a counting stand-in wraps the quantize each cache is built with."""
    import collections

    from megatron.moe_patches.experts import fp8_grouped_mm

    counts = collections.Counter()
    build = fp8_grouped_mm.FP8WeightCache.__init__

    def counting_build(cache, *args, **kwargs):
        build(cache, *args, **kwargs)
        quantize = cache._quantize

        def counted(*q_args):
            counts[cache] += 1
            return quantize(*q_args)

        cache._quantize = counted

    monkeypatch.setattr(fp8_grouped_mm.FP8WeightCache, "__init__", counting_build)
    return counts

# Many test subprocesses (pretrain_gpt.py runs, workers) run side by side; each would start one
# OpenMP thread per core for its little CPU work. Share the cores out instead (children inherit
# it; torchrun sets 1 for its workers anyway). A value the user set wins.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 6)))

# Tests whose work is a subprocess of its own (pretrain_gpt.py runs, CUDA-graph cases) start
# it when collection ends, so it runs on the GPU while pytest works through the tests before
# it. A test module opts in with ``BACKGROUND = {test name: (parameter, function(value))}``
# (a tuple of parameter names gives the function a tuple of values); such a test takes the
# ``background`` fixture: the function's result for its own value. A function that chains
# several runs returns a Future of its own threads' work instead of holding a pool thread.
_started = {}


def _background_key(item):
    jobs = getattr(item.module, "BACKGROUND", {})
    if item.originalname not in jobs or not hasattr(item, "callspec"):
        return None, None
    name, function = jobs[item.originalname]
    params = item.callspec.params
    value = tuple(params[n] for n in name) if isinstance(name, tuple) else params[name]
    return (item.module.__name__, item.originalname, value), function


def _skipped(item):
    """Skipped at collection: a skip marker, or a skipif whose condition is already True."""
    return item.get_closest_marker("skip") is not None or any(
        marker.args and marker.args[0] is True for marker in item.iter_markers("skipif"))


def pytest_collection_finish(session):
    jobs = {}
    for item in session.items:
        key, function = _background_key(item)
        if key is not None and not _skipped(item):
            jobs[key] = function
    if not jobs:
        return
    pool = ThreadPoolExecutor(int(os.environ.get("MOE_PATCHES_GPU_PARALLEL", "6")))
    _started.update({key: pool.submit(function, key[-1]) for key, function in jobs.items()})
    pool.shutdown(wait=False)


@pytest.fixture
def background(request):
    """This test's started job's result (see BACKGROUND); its failure fails this test only."""
    result = _started[_background_key(request.node)[0]].result()
    return result.result() if isinstance(result, Future) else result


@pytest.fixture
def reverted():
    """Leave megatron-core unpatched after the test, whatever it applied."""
    from megatron.moe_patches import revert

    revert()
    yield
    revert()


# Stock TransformerConfig validation asks TE about these at construction; a CPU machine
# has no TE, so MoE config tests set them right after construction instead.
TE_CHECKED_FIELDS = ("moe_permute_fusion", "fp8", "fp8_recipe", "moe_router_padding_for_quantization")
MOE_BASE = dict(
    num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
    moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
)


@pytest.fixture
def moe_config():
    """Factory: a PatchedTransformerConfig for a small TE-grouped MoE (permute fusion on)."""
    from megatron.moe_patches.config import PatchedTransformerConfig

    def build(**overrides):
        overrides.setdefault("moe_permute_fusion", True)
        late = {k: overrides.pop(k) for k in TE_CHECKED_FIELDS if k in overrides}
        config = PatchedTransformerConfig(**{**MOE_BASE, **overrides})
        for name, value in late.items():
            setattr(config, name, value)
        return config

    return build
