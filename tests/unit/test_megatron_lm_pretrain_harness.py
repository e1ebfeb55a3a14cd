"""The harness that runs Megatron-LM's pretrain_gpt.py as README edits it runs the file as the
process's ``__main__`` module, as ``python pretrain_gpt.py`` does: what enable() rebinds in
``sys.modules["__main__"]`` is what the file's own functions look up."""

import sys

from megatron.moe_patches.testing import megatron_lm_pretrain

SCRIPT = '''import sys
def lookup():
    return get_batch
get_batch = "stock"
if __name__ == "__main__":
    sys.modules["__main__"].get_batch = "rebound"  # what enable() does to a name imported by name
    RESULT.append(lookup())
'''


def test_the_edited_file_runs_as_the_main_module(tmp_path, monkeypatch):
    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    monkeypatch.setenv("MEGATRON_LM_AS_SHIPPED", "1")
    monkeypatch.setattr(megatron_lm_pretrain, "_stock_run_on_the_wheel", lambda: None)
    monkeypatch.setattr(sys, "argv", ["harness"])
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])  # restored afterwards
    monkeypatch.setattr(sys, "path", list(sys.path))
    result = []
    import builtins
    monkeypatch.setattr(builtins, "RESULT", result, raising=False)
    megatron_lm_pretrain.main()
    assert result == ["rebound"]
    assert sys.modules["__main__"].__file__ == str(tmp_path / "pretrain_gpt.py")
