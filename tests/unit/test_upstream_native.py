"""The installer against upstream megatron-core (0.19.2, which has F1-F7 natively): apply()
installs nothing there. Needs no GPU; runs where MOE_PATCHES_UPSTREAM_SITE names a site
directory holding that megatron-core (it needs Python >= 3.12)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

UPSTREAM = os.environ.get("MOE_PATCHES_UPSTREAM_SITE")


def _why_skip():
    if not UPSTREAM:
        return "set MOE_PATCHES_UPSTREAM_SITE to a site dir holding upstream megatron-core 0.19.2"
    if not Path(UPSTREAM, "megatron", "core").is_dir():
        return f"MOE_PATCHES_UPSTREAM_SITE={UPSTREAM} holds no megatron/core (install upstream megatron-core there)"
    return None


@pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")
def test_upstream_native_features_install_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([UPSTREAM, os.environ.get("PYTHONPATH", ""), str(ROOT)]))
    code = (
        "import json, megatron.core, megatron.core.transformer.transformer_config as t;"
        "before = t.TransformerConfig;"
        "from megatron.moe_patches import apply, capabilities;"
        "rows = apply();"
        "print(json.dumps({'version': str(capabilities.mcore_version()), 'file': megatron.core.__file__,"
        " 'unchanged': t.TransformerConfig is before, 'rows': {r.id: [r.state, r.reason] for r in rows}}))"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["file"].startswith(UPSTREAM) and not report["version"].startswith("0.16")
    for feature_id in ("F1", "F4", "F5", "F6"):
        assert report["rows"][feature_id][0] == "native", (feature_id, report["rows"][feature_id])
    assert not [fid for fid, (state, _) in report["rows"].items() if state == "applied"]
    assert report["unchanged"]
