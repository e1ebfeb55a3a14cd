"""Megatron-LM core_v0.16.1's source (``MEGATRON_LM_PATH``) imported on a CPU machine.

Its ``megatron.training`` imports ``initialize``, which imports megatron-core's
``batch_invariant_kernels`` for ``--batch-invariant-mode``; that module's first lines are
``import triton`` and ``import triton.language as tl``, and Triton has no CPU build.
``import_batch_invariant_kernels()`` imports that one megatron-core module with a CPU stand-in
for ``triton`` in ``sys.modules`` during its import only, and takes the stand-in out again:
nothing else sees a Triton (megatron-core's ``HAVE_TRITON`` checks, torch's, and
``capabilities.triton_available()`` answer as before), and the module's kernels, decorated by
the stand-in's ``jit``, raise if launched. It stands in for an import, never for a kernel: the
tests that use it run Megatron-LM's argument parsing, config building and checkpoint-args
reading, none of which launches a kernel (``--batch-invariant-mode`` is refused by our table).

Where Triton is installed this does nothing but the plain import. Only the tests of Megatron-LM
itself use it (test_megatron_lm_integration.py in process, it and test_megatron_lm_flags.py in
the subprocesses they start, through ``SUBPROCESS_PREAMBLE``); the package's own tests never do.
"""

import functools
import importlib
import importlib.util
import sys
import types
from pathlib import Path

MODULE = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
STAND_IN = "a CPU stand-in for `import triton` only (tests/unit/megatron_lm_on_cpu.py): no Triton kernel runs here"

# Python source that a subprocess of these tests runs first (before Megatron-LM is imported).
SUBPROCESS_PREAMBLE = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
                       "import megatron_lm_on_cpu; megatron_lm_on_cpu.import_batch_invariant_kernels(); "
                       "sys.path.pop(0)\n")


class _Kernel:
    """What the stand-in's ``triton.jit`` makes of a kernel: launching it (``kernel[grid](...)``)
    or calling it raises."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"Triton kernel {self.__name__}: {STAND_IN}")

    __call__ = __getitem__ = _refuse


def _jit(fn=None, **options):
    # @triton.jit and @triton.jit(launch_metadata=...), the two forms the module uses
    return _Kernel(fn) if fn is not None else _Kernel


class _Constexpr:
    """``tl.constexpr``: the module uses it in kernel parameters' annotations only."""


def _stand_in():
    triton = types.ModuleType("triton", STAND_IN)
    language = types.ModuleType("triton.language", STAND_IN)
    triton.jit, triton.language, language.constexpr = _jit, language, _Constexpr
    return {"triton": triton, "triton.language": language}


def import_batch_invariant_kernels():
    """Import megatron-core's batch_invariant_kernels (see the module's docstring); returns it."""
    if MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return importlib.import_module(MODULE)
    # Its packages first, without the stand-in: importing them imports more of megatron-core,
    # which must find no Triton.
    importlib.import_module(MODULE.rpartition(".")[0])
    stand_in = _stand_in()
    sys.modules.update(stand_in)
    try:
        return importlib.import_module(MODULE)
    finally:
        for name in stand_in:
            del sys.modules[name]
