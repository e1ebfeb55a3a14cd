"""Megatron-LM's own pretrain_gpt.py (from the checkout MEGATRON_LM_PATH names) with the lines
README's "Training with Megatron-LM's own pretrain_gpt.py" tells a user to add, run as the
user would run the edited file: ``python -m megatron.moe_patches.testing.megatron_lm_pretrain <flags>``
(``MEGATRON_LM_AS_SHIPPED=1``: the file unedited, for stock runs to compare with)."""

import os
import sys
import types

EDIT_FROM = 'if __name__ == "__main__":\n'
EDIT_TO = EDIT_FROM + "    megatron_lm.enable()\n"
IMPORT = "from megatron.moe_patches import megatron_lm\n"


def edited_source(path: str) -> str:
    source = open(path).read()
    if source.count(EDIT_FROM) != 1:
        raise SystemExit(f"{path}: the line README edits is not there once: {EDIT_FROM}")
    return IMPORT + source.replace(EDIT_FROM, EDIT_TO)


def _stock_run_on_the_wheel():
    """An as-shipped run has no enable(), which skips Megatron-LM's build of the dataset helpers
    that megatron-core's wheel ships compiled (without their Makefile): skip it here alike."""
    from megatron.core.datasets import utils

    if not os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile")):
        utils.compile_helpers = lambda: None


def main() -> None:
    """Run pretrain_gpt.py of MEGATRON_LM_PATH with this process's sys.argv[1:] as its flags."""
    checkout = os.environ["MEGATRON_LM_PATH"]
    sys.path.insert(0, checkout)
    path = os.path.join(checkout, "pretrain_gpt.py")
    sys.argv[0] = path
    as_shipped = os.environ.get("MEGATRON_LM_AS_SHIPPED") == "1"
    if as_shipped:
        _stock_run_on_the_wheel()
    source = open(path).read() if as_shipped else edited_source(path)
    # The file runs as the process's __main__ module, as `python pretrain_gpt.py` runs it:
    # enable() rebinds the names pretrain_gpt.py imported into sys.modules["__main__"].
    script = types.ModuleType("__main__")
    script.__file__ = path
    sys.modules["__main__"] = script
    exec(compile(source, path, "exec"), script.__dict__)


if __name__ == "__main__":
    main()
