"""The package's shape: no import cycles (module-level or inside functions), patch modules
never import the pretraining driver, and only the installer knows what is applied."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron" / "moe_patches"
PREFIX = "megatron.moe_patches"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules) -> set:
    """This package's modules that ``path`` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` imports pkg.mod when that is a module.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph():
    modules = own_modules()
    graph = {}
    for name, path in modules.items():
        edges = imports_of(path, modules) - {name}
        # Importing a.b.c runs a and a.b first: the package __init__ files do not count as
        # an edge back unless they are imported by name.
        graph[name] = {e for e in edges if e != PREFIX or name == PREFIX}
    return graph


def find_cycle(graph):
    WHITE, GREY, BLACK = 0, 1, 2
    color = {node: WHITE for node in graph}
    stack = []

    def visit(node):
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20 and f"{PREFIX}.experts" in graph[f"{PREFIX}.installer"] | set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_patch_modules_never_import_the_driver():
    graph = import_graph()
    driver = f"{PREFIX}.driver"
    for name, edges in graph.items():
        if name.startswith(driver) or name.startswith(f"{PREFIX}.testing"):
            continue
        assert not {e for e in edges if e.startswith(driver)}, f"{name} imports the driver"


def test_only_the_installer_knows_what_is_applied():
    allowed = {f"{PREFIX}", f"{PREFIX}.installer", f"{PREFIX}.registry", f"{PREFIX}.__main__"}
    for name, path in own_modules().items():
        if name in allowed:
            continue
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        } | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "is_applied" not in used and "_applied" not in used, name


# Subpackages are one room each: their modules import each other freely; between rooms and the
# top-level modules, imports must run one way, in at most MAX_LAYERS layers from pretrain_gpt.py.
ROOMS = ("experts", "dispatch", "kernels", "graphs", "checkpoint", "driver", "testing", "plan")
MAX_LAYERS = 8


def room_of(module: str) -> str:
    parts = module[len(PREFIX) + 1:].split(".") if module != PREFIX else [""]
    return parts[0] if parts[0] in ROOMS else module[len(PREFIX) + 1:] or "__init__"


def room_graph():
    graph = {}
    for name, edges in import_graph().items():
        room = room_of(name)
        graph.setdefault(room, set()).update(room_of(e) for e in edges if room_of(e) != room)
    entry = PACKAGE.parent.parent / "pretrain_gpt.py"
    graph["pretrain_gpt.py"] = {room_of(m) for m in imports_of(entry, own_modules())}
    return graph


def layers_below(graph, room, seen=()):
    return 1 + max((layers_below(graph, nxt, seen + (room,)) for nxt in graph[room]), default=0)


def test_rooms_import_one_way():
    cycle = find_cycle(room_graph())
    assert cycle is None, " -> ".join(cycle)


def test_layer_counter_counts_a_planted_chain():
    assert layers_below({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == 3


def test_at_most_eight_layers_from_pretrain_gpt_down():
    graph = room_graph()
    assert layers_below(graph, "pretrain_gpt.py") <= MAX_LAYERS
