"""Facts the docs state twice, or state about the code, agree: the quick GPU run's time in
pytest.ini and README, C0's page against the patch fields, the license in LICENSE,
setup.py and README, and README's module table against the package's modules."""

import configparser
import re
from pathlib import Path

from megatron.moe_patches.driver.patch_args import CHECKPOINT_RESTORED_ARGS, flag_name
from megatron.moe_patches.fields import PATCH_FIELDS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
NUMBERS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten",
           11: "eleven", 12: "twelve"}


def test_quick_marker_time_is_the_same_in_pytest_ini_and_readme():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini", encoding="utf-8")
    marker = next(line for line in ini["pytest"]["markers"].splitlines() if line.strip().startswith("quick:"))
    ini_time = re.search(r"about ([^,;]+? minutes?)", marker).group(1)
    line = next(line for line in README.splitlines() if "-m quick" in line and "#" in line)
    readme_time = re.search(r"about ([^,;]+? minutes?)", line).group(1)
    assert ini_time == readme_time


def test_c0_page_counts_and_names_the_patch_fields():
    page = (ROOT / "patches" / "C0-config-fields.md").read_text(encoding="utf-8")
    fields, bools = len(PATCH_FIELDS), sum(restored.force for restored in CHECKPOINT_RESTORED_ARGS)
    assert f"The {NUMBERS[fields]} patch fields" in page
    assert f"all {NUMBERS[fields]} are taken from the checkpoint; the {NUMBERS[bools]} bools always override" in page
    assert f"already has all {NUMBERS[fields]} fields" in page
    other_counts = {word for number, word in NUMBERS.items() if number not in (fields, bools)}
    assert not [word for word in re.findall(r"\b[a-z]+\b", page) if word in other_counts]
    assert [f.name for f in PATCH_FIELDS if f"`{flag_name(f.name)}`" not in page] == []


def test_license_file_setup_metadata_and_readme_agree():
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in license_text
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert 'license="Apache-2.0"' in setup
    # The SPDX expression alone: a license classifier beside it is a setuptools deprecation warning.
    assert "License :: OSI Approved" not in setup
    assert "Apache License 2.0" in README.split("## License", 1)[-1]



def module_table():
    """README's table of how the patch modules fit together: {name in the first column: the
    role column}, one entry per name (a row may name several)."""
    section = README.split("How the patch modules fit together", 1)[1]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| module |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first, role = line.strip().strip("|").split(" | ", 1)
        for name in re.findall(r"`([^`]+)`", first):
            assert name not in rows, f"README's module table lists {name} twice"
            rows[name] = role
    return rows


def test_readme_module_table_names_every_module_once():
    package = ROOT / "megatron" / "moe_patches"
    rows = module_table()
    missing, twice = [], []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a folder's __init__ is the folder's row
        if len(rel.parts) == 1:
            if rel.name != "__init__.py" and rel.name not in rows:
                missing.append(str(rel))
            continue
        folder = f"{rel.parts[0]}/"
        named = re.findall(rf"`{re.escape('/'.join(rel.parts[1:]))}`", rows.get(folder, ""))
        (missing if not named else twice if len(named) > 1 else []).append(str(rel))
    stale = [f"{folder}{name}" for folder, role in rows.items() if folder.endswith("/")
             for name in re.findall(r"`([\w/]+\.py)`", role) if not (package / folder / name).is_file()]
    stale += [name for name in rows if name.endswith(".py") and not (package / name).is_file()]
    assert (missing, twice, stale) == ([], [], []), f"not in the table: {missing}; twice: {twice}; no such module: {stale}"
