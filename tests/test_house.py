"""The package's structure rules, read from the code's own imports (its syntax tree, aliases
resolved), not from its text: who touches the process environment, who reads the settings
from the process, that the rooms (files, folders as one) import each other without a
circle outside type checking, and in the order CONTRIBUTING's map draws."""

import ast
import itertools
import re
from pathlib import Path

from runner import ROOT

PACKAGE = ROOT / "keras_dist"
# The process environment's own names in `os`.
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`, which never run."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)}


def uses_of(tree: ast.Module, module: str, names: set[str]) -> list[int]:
    """Lines that reach `module`'s `names`: `module.name` (under any alias of `module`), or a
    name imported from it (under any alias)."""
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name == module}
    aliases |= {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names if f"{node.module}.{a.name}" == module}
    lines = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in names
             and isinstance(node.value, ast.Name) and node.value.id in aliases]
    lines += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == module
              and any(a.name in names for a in node.names)]
    return lines


def test_only_settings_environments_and_the_launchers_touch_the_process_environment():
    touching = {path for path, tree in modules().items() if uses_of(tree, "os", ENVIRONMENT_NAMES)}
    allowed = {"keras_dist/settings.py", "keras_dist/environments.py"}
    assert {p for p in touching if not p.startswith("keras_dist/launchers/")} <= allowed


def test_the_process_settings_are_read_by_the_runtime_start_up_the_tool_and_the_launchers_alone():
    # Everything else receives them (`Strategy.settings`, with the process environment in their
    # `variables`), so a test can hand in its own.
    readers = {path for path, tree in modules().items() if uses_of(tree, "keras_dist.settings", {"current"})}
    assert {p for p in readers if not p.startswith("keras_dist/launchers/")} == {
        "keras_dist/runtime.py", "keras_dist/startup.py", "keras_dist/cli.py", "keras_dist/console.py"}


def test_strategies_collectives_and_fault_tolerance_receive_their_settings():
    # From the runtime handed to `strategies.create` (`Strategy.settings`), never from the process.
    pulled = {path: lines for path, tree in modules().items()
              if path.startswith(("keras_dist/strategies/", "keras_dist/collectives/", "keras_dist/fault_tolerance/"))
              for lines in [uses_of(tree, "keras_dist.settings", {"current"})] if lines}
    assert pulled == {}


def room(path: str) -> str:
    """A file at the package's top, or the folder (one room) a file under it is in."""
    parts = Path(path).parts
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else path


def room_of_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        for suffix in (".py", "/__init__.py"):
            path = "/".join(parts[:end]) + suffix
            if (ROOT / path).exists():
                return room(path)
    return None


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module of the package (what a registry imports by name)."""
    path = dotted.replace(".", "/")
    return (re.fullmatch(r"keras_dist(\.\w+)+", dotted) is not None
            and ((ROOT / f"{path}.py").exists() or (ROOT / path / "__init__.py").exists()))


def imports(tree: ast.Module) -> list[tuple[str, int]]:
    """`(dotted name, line)` of what a module imports at run time, at its top or inside
    functions, and of the modules its registries load by name (`"keras_dist.x.y:Class"`)."""
    skipped = type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_dist"):
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("keras_dist")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_module(node.value.split(":")[0]):
            found.append((node.value.split(":")[0], node.lineno))
    return found


def test_the_rooms_import_each_other_without_a_circle_outside_type_checking():
    edges: dict[str, dict[str, str]] = {}
    for path, tree in modules().items():
        for dotted, line in imports(tree):
            target = room_of_module(dotted)
            if target and target != room(path):
                edges.setdefault(room(path), {}).setdefault(target, f"{path}:{line}")
    # A circle is a strongly connected set of two rooms or more (Tarjan's algorithm).
    order, low, stack, circles, counter = {}, {}, [], [], itertools.count()

    def visit(node):
        order[node] = low[node] = next(counter)
        stack.append(node)
        for target in edges.get(node, {}):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    described = [[f"{a} -> {b} ({edges[a][b]})" for a in circle for b in circle if b in edges.get(a, {})]
                 for circle in circles]
    assert described == []


def map_rows() -> list[list[str]]:
    """The rooms of each row of CONTRIBUTING's map, top row first (`keras_workarounds*.py` matched as a glob)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text[text.index("## Design: the map"):]
    block = block[block.index("```\n") + 4:]
    rows = []
    for line in block[:block.index("```")].splitlines():
        rows.append(list(itertools.takewhile(lambda word: word.endswith((".py", "/")), line.split())))
    return rows


def test_the_map_in_contributing_is_the_import_order():
    rows = map_rows()
    row_of = {name: len(rows) - number for number, names in enumerate(rows) for name in names}

    def row(room_path: str) -> int | None:
        name = room_path.removeprefix("keras_dist/")
        return row_of.get("keras_workarounds*.py" if name.startswith("keras_workarounds") else name)

    rooms = {room(path) for path in modules()}
    assert [r for r in sorted(rooms) if row(r) is None] == [], "rooms missing from CONTRIBUTING's map"
    upward = [f"{path}:{line} imports {dotted}" for path, tree in modules().items() for dotted, line in imports(tree)
              for target in [room_of_module(dotted)] if target and target != room(path) and row(target) >= row(room(path))]
    assert upward == [], "an import that does not go to a lower row of CONTRIBUTING's map"
