"""The status command: --json is one JSON document, its two usage errors exit 2 with the
message, and the states it prints are the ones README documents."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.moe_patches import capabilities
from megatron.moe_patches.__main__ import main
from megatron.moe_patches.registry import BY_ID, SERIES
from megatron.moe_patches.version import __version__

ROOT = Path(__file__).resolve().parents[2]
STATES = {"applied", "native", "skipped", "off"}


def run_status(*args):
    # No -W here: the command's own filter must keep megatron-core's notices out of stderr.
    return subprocess.run(
        [sys.executable, "-m", "megatron.moe_patches", "status", *args],
        capture_output=True, text=True, cwd=ROOT,
    )


@pytest.mark.parametrize("extra", [(), ("--apply",), ("--apply", "--features", "C0,F4")])
def test_json_is_one_document(extra):
    out = run_status("--json", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    document = json.loads(out.stdout)  # the whole output, not line by line
    assert set(document) == {"megatron_moe_patches", "megatron_core", "transformer_engine", "features"}
    assert document["megatron_moe_patches"] == __version__
    assert document["megatron_core"] == str(capabilities.mcore_version())
    te = capabilities.te_version()
    assert document["transformer_engine"] == (str(te) if te else None)
    rows = document["features"]
    assert [row["id"] for row in rows] == [feature.id for feature in SERIES]
    for row in rows:
        assert set(row) == {"id", "title", "state", "reason", "te_ok", "upstream"}
        assert row["state"] in STATES and row["upstream"] == list(BY_ID[row["id"]].upstream)
    if extra:
        assert rows[0]["state"] == "applied"
    assert "not installed. Falling back" not in out.stderr


def test_text_output_has_the_version_header():
    out = run_status()
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"megatron-moe-patches {__version__} | megatron-core {capabilities.mcore_version()} | Transformer Engine ")
    assert [line.split()[0] for line in lines[1:]] == [feature.id for feature in SERIES]
    assert {line.split()[1] for line in lines[1:]} <= STATES
    assert "not installed. Falling back" not in out.stderr


def test_features_without_apply_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--features", "C0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--features" in err and "--apply" in err


def test_unknown_feature_id_is_a_usage_error(capsys, reverted):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--apply", "--features", "C0,F99"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "F99" in err and ", ".join(BY_ID) in err and "Traceback" not in err
    from megatron.moe_patches import installer

    assert not installer._applied  # nothing applied before the error


def test_usage_errors_from_the_shell():
    for args, words in ((("--features", "F4"), ["--apply"]), (("--apply", "--features", "F99"), ["F99", "C0, F1"])):
        out = run_status(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stdout == "" and all(word in out.stderr for word in words)


def test_readme_documents_exactly_the_states():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.split(r"\n#{2,3} ", readme.split("### Status states", 1)[1])[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    assert documented == STATES
    # ... and they are the installer's states (FeatureStatus.state's comment lists them).
    installer_src = (ROOT / "megatron" / "moe_patches" / "installer.py").read_text()
    declared = re.search(r"state: str\s+#\s*(.+)", installer_src).group(1)
    assert {s.strip() for s in declared.split("|")} == STATES


# Runs the status command as a shell does, then reports whether it imported megatron-core.
IMPORTS = """
import runpy, sys
sys.argv = ["megatron-moe-patches", *sys.argv[1:]]
try:
    runpy.run_module("megatron.moe_patches", run_name="__main__")
except SystemExit:
    pass
print("megatron.core imported:", "megatron.core" in sys.modules)
"""


@pytest.mark.parametrize("args, imported", [(["status"], False), (["status", "--json"], False),
                                            (["--version"], False), (["status", "--apply"], True)])
def test_only_apply_imports_megatron_core(args, imported):
    """megatron-core's import takes seconds: the plain report reads its version from its files."""
    out = subprocess.run([sys.executable, "-c", IMPORTS, *args], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == f"megatron.core imported: {imported}"


def test_the_plain_report_equals_the_one_after_importing_megatron_core():
    """The states the plain report gives without megatron-core are the ones its probes give."""
    plain = json.loads(run_status("--json").stdout)
    code = ("import json, megatron.core.tensor_parallel.layers, megatron.core.transformer.transformer_config;"
            "from megatron.moe_patches.__main__ import main; main(['status', '--json'])")
    probed = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert probed.returncode == 0, probed.stderr[-3000:]
    assert plain == json.loads(probed.stdout)


@pytest.mark.parametrize("feature", [f for f in SERIES if hasattr(f.native, "probe")], ids=lambda f: f.id)
def test_native_without_the_import_agrees_with_the_probe(feature):
    """In the tested range no megatron-core has these features: the probes say so too."""
    assert capabilities.mcore_supported()
    assert feature.native.probe() is False and feature.native() is False


def test_the_version_read_from_files_is_the_imported_ones(monkeypatch):
    from megatron.core import package_info

    assert capabilities._version_on_path() == capabilities.Version(package_info.__version__)
    monkeypatch.delitem(sys.modules, "megatron.core")
    assert capabilities.mcore_version() == capabilities.Version(package_info.__version__)


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["status", "--apply"]])
def test_a_closed_pipe_ends_the_report_quietly(args):
    """``status | head -1``: the reader is gone before the report is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "megatron.moe_patches", *args], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    finally:
        os.close(write_end)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.strip().endswith(f" {__version__}")
