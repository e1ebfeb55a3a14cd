"""pretrain_gpt.py on a megatron-core where the patch set does not install (upstream 0.19.2,
whose TransformerConfig has most patch fields natively and no longer moe_use_legacy_grouped_gemm):
the probes in driver.compat, each answered from what the code offers, and what the driver
does with their answers. Stand-ins play the upstream side here (megatron-core 0.16.1); the
last tests run the driver on the real one where MOE_PATCHES_UPSTREAM_SITE names a site
directory holding it (Python >= 3.12)."""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

from megatron.moe_patches import capabilities, installer
from megatron.moe_patches.config import PatchedTransformerConfig, validate_moe_patch_config
from megatron.moe_patches.driver import checkpointing, compat
from megatron.moe_patches.experts.glu_interleave import to_concatenated, to_interleaved

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--yaml-cfg", "tiny-moe-stock", "--lr-decay-iters", "100"]
# Tests of this process's megatron-core as the patch set's base (0.16.1); run under upstream
# megatron-core, they have nothing to check.
on_patch_base = pytest.mark.skipif(not compat.patch_set_installs(),
                                   reason="checks the megatron-core the patch set installs into")
VERSION = capabilities.mcore_version()


# --- the installer's verdict ---------------------------------------------------------------


@on_patch_base
def test_c0_installs_here_before_and_after_apply(reverted):
    from megatron.moe_patches import apply

    assert installer.installs("C0") and installer.installs("F11")  # F11 through its prerequisites
    apply(["C0"])
    assert installer.installs("C0")


def test_c0_does_not_install_outside_the_tested_range(reverted, monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(capabilities, "mcore_version", lambda: Version("0.19.2"))
    assert not installer.installs("C0") and not installer.installs("F8")


def test_c0_does_not_install_where_it_is_native(reverted, monkeypatch):
    monkeypatch.setattr(capabilities, "mcore_has_fields", lambda *names, config_class=None: True)
    assert not installer.installs("C0")


@on_patch_base
def test_the_driver_uses_the_patched_config_where_the_patch_set_installs():
    assert compat.patch_set_installs()
    assert compat.config_class() is PatchedTransformerConfig
    kwargs = {"num_layers": 2, "moe_device_tokens_per_expert": True, "cuda_graph_scope": "full"}
    assert compat.fit_config_kwargs(kwargs) is kwargs  # megatron-core 0.16.1: nothing changes


# --- config kwargs for a megatron-core without the patch set -------------------------------

StockConfig = capabilities.mcore_attr("transformer.transformer_config", "TransformerConfig")


@dataclasses.dataclass
class UpstreamLikeConfig(StockConfig):
    """megatron-core's TransformerConfig with the patch fields upstream has natively (not F8's)
    and the renamed CUDA-graph scope field; the fixture below also hides moe_use_legacy_grouped_gemm."""

    use_transformer_engine_op_fuser: bool = False
    moe_mlp_glu_interleave_size: Optional[int] = None
    moe_single_grouped_weight: bool = False
    moe_single_grouped_bias: bool = False
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_permute_fusion_into_hybridep: bool = False
    cuda_graph_modules: Optional[str] = None
    moe_flex_dispatcher_num_sms: Optional[int] = None


@pytest.fixture
def upstream_like(monkeypatch):
    fields = {f.name for f in dataclasses.fields(UpstreamLikeConfig)} - {"moe_use_legacy_grouped_gemm"}
    monkeypatch.setattr(compat, "patch_set_installs", lambda: False)
    monkeypatch.setattr(compat, "config_class", lambda: UpstreamLikeConfig)
    monkeypatch.setattr(compat, "config_fields", lambda: frozenset(fields))


def tiny_kwargs(parsed, *extra):
    from megatron.moe_patches.driver.arguments import transformer_config_kwargs

    return transformer_config_kwargs(parsed([*TINY, *extra]))


def test_options_without_a_field_are_left_out_when_off(upstream_like, parsed):
    kwargs = tiny_kwargs(parsed, "--moe-single-grouped-weight")
    assert "moe_device_tokens_per_expert" not in kwargs  # off: nothing to pass
    assert "cuda_graph_scope" not in kwargs and kwargs["cuda_graph_modules"] == []  # renamed upstream; graphs off
    assert kwargs["moe_single_grouped_weight"] is True and kwargs["num_moe_experts"] == 8  # native fields pass
    assert kwargs["cuda_graph_impl"] == "none"


@pytest.mark.parametrize("apex_extension", [False, True])
def test_gradient_accumulation_fusion_is_off_where_only_apex_could_run_it(upstream_like, parsed, monkeypatch,
                                                                         apex_extension):
    # megatron-core's own ColumnParallelLinear raises at construction under the fusion without APEX.
    real_find_spec = compat.importlib.util.find_spec
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda name: (
        object() if apex_extension else None) if name == "fused_weight_gradient_mlp_cuda" else real_find_spec(name))
    assert tiny_kwargs(parsed)["gradient_accumulation_fusion"] is apex_extension
    assert tiny_kwargs(parsed, "--no-gradient-accumulation-fusion")["gradient_accumulation_fusion"] is False


@pytest.mark.parametrize("backend, sms", [(None, 20), ("deepep", 20), ("hybridep", 16)])
def test_flex_dispatcher_sm_counts_pass_as_the_chosen_backends(upstream_like, parsed, backend, sms):
    # Newer megatron-core refuses the two deprecated per-backend counts when they differ (20, 16).
    extra = ["--moe-flex-dispatcher-backend", backend] if backend else []
    kwargs = tiny_kwargs(parsed, *extra)
    assert "moe_deepep_num_sms" not in kwargs and "moe_hybridep_num_sms" not in kwargs
    assert kwargs["moe_flex_dispatcher_num_sms"] == sms


@pytest.mark.parametrize("extra, expected", [
    (["--moe-device-tokens-per-expert"],
     f"--moe-device-tokens-per-expert: megatron-core {VERSION}, where the MoE patch set does not install (it installs "
     "into megatron-core >= 0.16.1, < 0.17), has no moe_device_tokens_per_expert config field; drop it, or train "
     "on a megatron-core the patch set installs into"),
    (["--moe-device-tokens-per-expert", "--cuda-graph-impl", "local", "--cuda-graph-scope", "moe"],
     "--cuda-graph-impl local: this pretrain_gpt.py captures MoE layers as CUDA graphs with the MoE patch set "
     f"(F11), and this is megatron-core {VERSION}, where the MoE patch set does not install (it installs into "
     "megatron-core >= 0.16.1, < 0.17): drop --cuda-graph-impl and --cuda-graph-scope"),
])
def test_options_the_patch_set_provides_are_refused_by_flag(upstream_like, refused, extra, expected):
    assert refused([*TINY, *extra]) == expected


def test_a_refusal_names_every_such_flag(upstream_like):
    with pytest.raises(ValueError, match=r"^--moe-device-tokens-per-expert, --some-later-option: .*has no "
                       r"moe_device_tokens_per_expert/some_later_option config field; drop them,"):
        compat.fit_config_kwargs({"num_layers": 2, "moe_device_tokens_per_expert": True, "some_later_option": 0})


# --- the patch validation on a config without moe_use_legacy_grouped_gemm -------------------


class WithoutLegacyField:
    """A config's values on an object whose class has no moe_use_legacy_grouped_gemm (not
    even as a class default), as upstream megatron-core's TransformerConfig."""

    def __init__(self, config, **changes):
        self.__dict__.update({k: v for k, v in vars(config).items() if k != "moe_use_legacy_grouped_gemm"}, **changes)


def real_config(**fields):
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,
                moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
                add_bias_linear=False)
    return PatchedTransformerConfig(**{**base, **fields})


def test_patch_validation_reads_a_config_without_the_legacy_field():
    config = WithoutLegacyField(real_config())
    assert not hasattr(config, "moe_use_legacy_grouped_gemm")
    validate_moe_patch_config(config)  # valid: passes
    with pytest.raises(ValueError) as refused:
        validate_moe_patch_config(WithoutLegacyField(real_config(), moe_single_grouped_weight=True,
                                                     transformer_impl="local"))
    message = str(refused.value)
    assert "transformer_impl='transformer_engine'." in message and "legacy" not in message


@pytest.mark.skipif(not hasattr(PatchedTransformerConfig, "moe_use_legacy_grouped_gemm"),
                    reason="this megatron-core has no moe_use_legacy_grouped_gemm")
def test_the_legacy_field_is_still_named_where_megatron_core_has_it():
    config = real_config()
    config.moe_single_grouped_weight, config.transformer_impl = True, "local"
    with pytest.raises(ValueError, match="transformer_impl='transformer_engine' and moe_use_legacy_grouped_gemm=False"):
        validate_moe_patch_config(config)


def test_the_padding_plan_reads_a_config_without_the_legacy_field():
    from megatron.moe_patches.plan import fused_permute_pad_blocker

    config = WithoutLegacyField(real_config(), moe_permute_fusion=True)
    assert fused_permute_pad_blocker(config) is None
    assert "TE grouped experts" in fused_permute_pad_blocker(WithoutLegacyField(config, moe_grouped_gemm=False))


# --- the mock data's tokenizer --------------------------------------------------------------


@on_patch_base
def test_the_null_tokenizer_has_the_same_ids_on_0161():
    tokenizer = compat.null_tokenizer(4096)
    assert (tokenizer.vocab_size, tokenizer.eod) == (4096, 4095)


def test_a_null_tokenizer_that_counts_its_ids_gets_the_count(monkeypatch):
    from megatron.core.tokenizers.text.libraries import null_tokenizer

    class CountingNullTokenizer:  # upstream's: NullTokenizer(vocab_size, eod_id=None, pad_id=-1)
        def __init__(self, vocab_size, eod_id=None, pad_id=-1):
            self.vocab_size, self.eod = vocab_size, vocab_size - 1 if eod_id is None else eod_id

    monkeypatch.setattr(null_tokenizer, "NullTokenizer", CountingNullTokenizer)
    tokenizer = compat.null_tokenizer(4096)
    assert (tokenizer.vocab_size, tokenizer.eod) == (4096, 4095)


# --- checkpoints ----------------------------------------------------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "upstream_0192_ckpt"


@on_patch_base
def test_megatron_core_0161_is_given_the_common_state_strategy():
    assert compat.load_takes_common_strategy()


def test_a_load_that_reads_both_forms_itself_gets_no_strategy(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root / "iter_0000007")
    (root / checkpointing.TRACKER).write_text("7")
    calls = []
    monkeypatch.setattr(compat, "load_takes_common_strategy", lambda: False)
    monkeypatch.setattr(checkpointing, "check_checkpoint_covers", lambda state, path: None)
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, path, **kw: calls.append(kw) or {"model": {}})
    model = types.SimpleNamespace(sharded_state_dict=lambda: {}, load_state_dict=lambda state: None)
    args = argparse.Namespace(no_load_optim=True, bf16=False)
    assert checkpointing.load(str(root), model, None, None, args) == 7
    assert calls == [{}]


# Expert FC1 of two experts, 6 gate + 6 linear rows, kept interleaved in blocks of 3 by
# megatron-core's own grouped experts (upstream), whose sharded state dict holds them as kept.
E, ROWS, H, BLOCK = 2, 12, 3, 3
PREFIX = "decoder.layers.0.mlp.experts.linear_fc1."


def concatenated(expert):
    return torch.arange(ROWS, dtype=torch.float32)[:, None] * 10 + torch.arange(H) + 1000 * expert


class UpstreamExperts(torch.nn.Module):
    def __init__(self, block=BLOCK):
        super().__init__()
        self.config = types.SimpleNamespace(num_moe_experts=E, moe_grouped_gemm=True, gated_linear_unit=True,
                                            transformer_impl="transformer_engine", moe_mlp_glu_interleave_size=block)
        for e in range(E):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(torch.zeros(ROWS, H)))

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        return {f"weight{e}": apply_swiglu_sharded_factory(
            ShardedTensor.from_rank_offsets(PREFIX + "weight", getattr(self, f"weight{e}"), (0, e, E), replica_id=0,
                                            prepend_axis_num=1), ((0, e, E),))
                for e in range(E)}


def test_only_megatron_cores_own_interleaving_experts_need_converting(monkeypatch):
    model = UpstreamExperts()
    monkeypatch.setattr(compat, "patch_set_installs", lambda: True)
    assert compat.memory_glu_interleave(model.config) is None  # the patch set installs: its experts convert
    monkeypatch.setattr(compat, "patch_set_installs", lambda: False)
    assert compat.memory_glu_interleave(model.config) == BLOCK
    for change in ({"gated_linear_unit": False}, {"moe_grouped_gemm": False}, {"transformer_impl": "local"},
                   {"moe_mlp_glu_interleave_size": None}, {"num_moe_experts": None}):
        assert compat.memory_glu_interleave(types.SimpleNamespace(**{**vars(model.config), **change})) is None
    assert compat.memory_glu_interleave(None) is None


def test_interleaving_upstream_experts_save_fc1_concatenated(monkeypatch):
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    monkeypatch.setattr(compat, "patch_set_installs", lambda: False)
    model = UpstreamExperts()
    with torch.no_grad():
        for e in range(E):
            getattr(model, f"weight{e}").copy_(to_interleaved(concatenated(e), BLOCK))
    state = checkpointing._model_state(model, argparse.Namespace(), loading=False)
    sharded, _ = save_preprocess({"model": state}, validate_access_integrity=False)
    for e in range(E):
        gate, linear = (sharded["model"][f"weight{e}"][half] for half in (0, 1))  # megatron-core's SwiGLU split
        assert torch.equal(torch.cat([gate.data, linear.data]), concatenated(e))


@pytest.mark.parametrize("saved_block", [None, 2])  # this driver's (concatenated), Megatron-LM's (interleaved)
def test_interleaving_upstream_experts_load_either_layout(tmp_path, one_rank_group, monkeypatch, saved_block):
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(compat, "patch_set_installs", lambda: False)
    path = tmp_path / "iter_0000004"
    rows = [to_interleaved(concatenated(e), saved_block) if saved_block else concatenated(e) for e in range(E)]
    dcp.save({PREFIX + "weight": torch.stack(rows)}, checkpoint_id=str(path), no_dist=True)
    layout = ({"glu_layout": "interleaved", "glu_interleave_size": saved_block} if saved_block
              else {"glu_layout": "concatenated"})
    torch.save({"iteration": 4, "args": {}, checkpointing.GLU_LAYOUT_KEY: layout}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"}))
    (tmp_path / checkpointing.TRACKER).write_text("4")
    model = UpstreamExperts()
    args = argparse.Namespace(no_load_optim=True, bf16=False)
    assert checkpointing.load(str(tmp_path), model, None, None, args) == 4
    for e in range(E):  # as the experts keep them: interleaved in blocks of 3
        assert torch.equal(getattr(model, f"weight{e}").detach(), to_interleaved(concatenated(e), BLOCK))
        assert torch.equal(to_concatenated(getattr(model, f"weight{e}").detach(), BLOCK), concatenated(e))


# --- the real upstream megatron-core --------------------------------------------------------

UPSTREAM = os.environ.get("MOE_PATCHES_UPSTREAM_SITE")
needs_upstream = pytest.mark.skipif(
    not UPSTREAM, reason="set MOE_PATCHES_UPSTREAM_SITE to a site dir holding upstream megatron-core 0.19.2")


def upstream_run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([UPSTREAM, str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@needs_upstream
def test_pretrain_gets_to_the_gpu_on_upstream():
    """Arguments, recipe, checks and the full TransformerConfig pass on upstream; without a GPU
    the run stops where training needs one."""
    run = upstream_run("pretrain_gpt.py", *TINY, "--train-iters", "5")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "pretrain_gpt.py needs a CUDA GPU" in run.stderr, run.stderr[-3000:]


@needs_upstream
def test_upstream_refuses_what_only_the_patch_set_provides():
    run = upstream_run("pretrain_gpt.py", *TINY, "--moe-device-tokens-per-expert")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "pretrain_gpt.py: error: --moe-device-tokens-per-expert: megatron-core 0.19" in run.stderr


@needs_upstream
def test_the_patched_config_builds_on_upstream():
    """PatchedTransformerConfig (the upstream fields win where both define one) constructs and
    validates on a TransformerConfig without moe_use_legacy_grouped_gemm."""
    code = (
        "import dataclasses, json, megatron.core as m;"
        "from megatron.moe_patches.config import PatchedTransformerConfig as P;"
        "from megatron.moe_patches.driver import compat;"
        "c = P(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_ffn_hidden_size=64,"
        " moe_grouped_gemm=True, moe_token_dispatcher_type='alltoall');"
        "print(json.dumps({'version': m.__version__, 'legacy': hasattr(c, 'moe_use_legacy_grouped_gemm'),"
        " 'installs': compat.patch_set_installs(), 'stock': compat.config_class().__module__,"
        " 'tokenizer_eod_id': compat._tokenizer_takes_eod_id(), 'common': compat.load_takes_common_strategy()}))"
    )
    run = upstream_run("-c", code)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert not report["version"].startswith("0.16") and not report["legacy"], report
    assert report == {**report, "installs": False, "stock": "megatron.core.transformer.transformer_config",
                      "tokenizer_eod_id": True, "common": False}


def test_logged_optimizer_scalars_become_numbers():
    """megatron-core 0.19.2's optimizer step returns the grad norm as a one-element GPU tensor,
    which the log line cannot format; 0.16.1's floats pass unchanged."""
    from megatron.moe_patches.driver.training import _number

    assert _number(torch.tensor([0.75])) == 0.75 and type(_number(torch.tensor([0.75]))) is float
    assert _number(0.5) == 0.5 and _number(None) is None and _number(1234) == 1234
