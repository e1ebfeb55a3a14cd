"""No test module makes a temporary folder or file when it is imported: collection alone
(every pytest run, GPU tests skipped or not) would leave one behind each time."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MAKERS = {"mkdtemp", "mkstemp", "TemporaryDirectory", "NamedTemporaryFile", "TemporaryFile"}


def calls_at_import(tree: ast.Module):
    """The calls a module makes when imported: those outside its functions' and classes' bodies."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def temp_makers(source: str):
    for call in calls_at_import(ast.parse(source)):
        name = getattr(call.func, "attr", None) or getattr(call.func, "id", None)
        if name in MAKERS:
            yield f"line {call.lineno}: {name}"


def test_the_finder_finds_an_import_time_folder():
    assert list(temp_makers("import tempfile\nWORK = tempfile.mkdtemp()\n")) == ["line 2: mkdtemp"]
    assert list(temp_makers("import tempfile\ndef work():\n    return tempfile.mkdtemp()\n")) == []


def test_no_test_module_makes_a_temp_folder_when_imported():
    modules = sorted(TESTS.rglob("*.py"))
    found = {str(path.relative_to(TESTS)): list(temp_makers(path.read_text())) for path in modules}
    assert len(modules) > 50 and {path: made for path, made in found.items() if made} == {}
