"""The command-line filter hides exactly megatron-core's TE/Apex fallback warnings, and
importing the package as a library installs no filter."""

import subprocess
import sys
import warnings

import pytest

from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
APEX = "Apex is not installed. Falling back to Torch Norm"


def shown(message, category=UserWarning, module="megatron.core.optimizer"):
    """Whether ``message`` raised from ``module`` gets through once the filter is in."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_megatron_core_import_warnings()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return bool(caught)


@pytest.mark.parametrize("message, module", [
    (TE_APEX, "megatron.core.optimizer"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of "
     "multi_tensor_applier and multi_tensor_scale", "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
    (APEX, "megatron.core.models.gpt.gpt_layer_specs"),
])
def test_megatron_core_fallback_warnings_are_hidden(message, module):
    assert not shown(message, module=module)


@pytest.mark.parametrize("message, category, module", [
    (TE_APEX, UserWarning, "my_training_script"),  # the same words from someone else
    (APEX, UserWarning, "megatron.corex"),
    (TE_APEX, DeprecationWarning, "megatron.core.optimizer"),  # another category
    ("Transformer Engine is not installed.", UserWarning, "megatron.core.extensions.transformer_engine"),
    ("The following imports from `dynamic_context.py` will be removed", UserWarning, "megatron.core.inference"),
    ("Apex is not installed but fused kernels were requested", UserWarning, "megatron.core.fusions"),
])
def test_other_warnings_still_show(message, category, module):
    assert shown(message, category, module)


def _stderr_of(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


IMPORT_MCORE = "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"


def test_real_megatron_core_import_is_quiet_only_with_the_filter():
    loud = _stderr_of(f"import megatron.moe_patches; {IMPORT_MCORE}")  # a library user
    if "not installed. Falling back" not in loud:
        pytest.skip("this megatron-core environment has TE and Apex: nothing to filter")
    quiet = _stderr_of(
        f"from megatron.moe_patches.entry_points import quiet_megatron_core_import_warnings as q; q(); {IMPORT_MCORE}"
    )
    assert "not installed. Falling back" not in quiet


def test_importing_the_package_installs_no_filter():
    code = (
        "import warnings;"
        "import megatron.moe_patches, megatron.moe_patches.installer, megatron.moe_patches.driver.arguments;"
        "import megatron.moe_patches.entry_points as cli, megatron.moe_patches.driver.cli;"
        "from megatron.moe_patches import status; status();"
        "ours = [f for f in warnings.filters if f[1] is not None and f[1].pattern == cli.MEGATRON_CORE_FALLBACK_MESSAGE];"
        "assert not ours, ours"
    )
    _stderr_of(code)
