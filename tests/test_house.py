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


def module_path(dotted: str) -> str | None:
    """The file of the package's module `dotted` names (or of the module a name is imported from)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        for suffix in (".py", "/__init__.py"):
            path = "/".join(parts[:end]) + suffix
            if (ROOT / path).exists():
                return path
    return None


def room_of_module(dotted: str) -> str | None:
    path = module_path(dotted)
    return None if path is None else room(path)


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module of the package (what a registry imports by name)."""
    path = dotted.replace(".", "/")
    return (re.fullmatch(r"keras_dist(\.\w+)+", dotted) is not None
            and ((ROOT / f"{path}.py").exists() or (ROOT / path / "__init__.py").exists()))


def imports(tree: ast.Module, type_checking: bool = False) -> list[tuple[str, int]]:
    """`(dotted name, line)` of what a module imports at run time, at its top or inside
    functions, and of the modules its registries load by name (`"keras_dist.x.y:Class"`);
    with `type_checking`, its imports for annotations too."""
    skipped = set() if type_checking else type_checking_nodes(tree)
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


def circles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Each circle of the graph `edges` ({node: {target: where}}): a strongly connected set of
    two nodes or more (Tarjan's algorithm), described by its edges."""
    order, low, stack, found, counter = {}, {}, [], [], itertools.count()

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
                found.append(sorted(members))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return [[f"{a} -> {b} ({edges[a][b]})" for a in circle for b in circle if b in edges.get(a, {})]
            for circle in found]


def test_the_rooms_import_each_other_without_a_circle_outside_type_checking():
    edges: dict[str, dict[str, str]] = {}
    for path, tree in modules().items():
        for dotted, line in imports(tree):
            target = room_of_module(dotted)
            if target and target != room(path):
                edges.setdefault(room(path), {}).setdefault(target, f"{path}:{line}")
    assert circles(edges) == []


def test_the_modules_of_a_folder_import_each_other_without_a_circle_annotations_included():
    # The rooms' test sees a folder as one: `fault_tolerance/atomic_writes.py` and `resume.py`
    # imported each other (one of them at run time, inside a function) unseen (issue 64).
    edges: dict[str, dict[str, str]] = {}
    for path, tree in modules().items():
        for dotted, line in imports(tree, type_checking=True):
            target = module_path(dotted)
            if target and target != path and room(target) == room(path) and room(path).endswith("/"):
                edges.setdefault(path, {}).setdefault(target, f"{path}:{line}")
    assert circles(edges) == []


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
    upward = [f"{path}:{line} imports {dotted}" for path, tree in modules().items()
              for dotted, line in imports(tree, type_checking=True)
              for target in [room_of_module(dotted)] if target and target != room(path) and row(target) >= row(room(path))]
    assert upward == [], "an import that does not go to a lower row of CONTRIBUTING's map"


# Where keras_dist may name Keras's private attributes and modules: its door to them (each
# function with a canary in tests/test_keras_internals.py), and the helper that replaces a
# method on one object, which takes the method's name as a string.
PRIVATE_KERAS_DOORS = {"keras_dist/keras_internals.py", "keras_dist/overrides.py"}
# Private names keras_dist reads on objects of other libraries, which the syntax tree does not
# tell from Keras's: (file, `object._name` as written there): whose it is.
NOT_KERAS = {
    ("keras_dist/strategies/torch_distributed.py", "g._version"):
        "a torch tensor's in-place version counter, which tells a gradient rewritten after its bucket began",
    ("keras_dist/strategies/torch_distributed.py", "grad._version"): "the same counter, read once the bucket is done",
    ("keras_dist/inputs/data_loader.py", "sampler._num_samples"):
        "torch's RandomSampler: None where no num_samples was given (its public num_samples always has one)",
    ("keras_dist/inputs/tf_data.py", "dataset._as_serialized_graph"):
        "tf.data's GraphDef of a dataset, into which keras_dist inserts its split",
    ("keras_dist/strategies/tf_strategy.py", "current._distribute_strategy"):
        "a tf.Variable's strategy: whether the variable is already the strategy's",
}
# Functions that name an attribute with a string, their object first.
NAMING_BUILTINS = {"getattr", "setattr", "hasattr", "delattr"}
NAMING_OBJECT_METHODS = {"__getattribute__", "__setattr__", "__delattr__"}  # as `object.__setattr__(obj, name, ...)`


def root_name(node: ast.expr) -> str | None:
    """`a` of `a.b.c`."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def string(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def attributes_dict_of(node: ast.expr) -> ast.expr | None:
    """`obj` where `node` is `vars(obj)` or `obj.__dict__`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    return node.value if isinstance(node, ast.Attribute) and node.attr == "__dict__" else None


def attribute_uses(node: ast.AST) -> list[tuple[ast.expr, str | None]]:
    """(object, name) of the attributes `node` reads or writes: `obj.name`, `getattr(obj, "name")`
    and the other naming functions, `vars(obj)["name"]`, `.get("name")`, `"name" in vars(obj)`."""
    if isinstance(node, ast.Attribute):
        return [(node.value, node.attr)]
    if isinstance(node, ast.Call) and len(node.args) >= 2 and (
            isinstance(node.func, ast.Name) and node.func.id in NAMING_BUILTINS
            or isinstance(node.func, ast.Attribute) and node.func.attr in NAMING_OBJECT_METHODS
            and root_name(node.func) == "object"):
        return [(node.args[0], string(node.args[1]))]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop") \
            and node.args and attributes_dict_of(node.func.value) is not None:
        return [(attributes_dict_of(node.func.value), string(node.args[0]))]
    if isinstance(node, ast.Subscript) and attributes_dict_of(node.value) is not None:
        return [(attributes_dict_of(node.value), string(node.slice))]
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
            and attributes_dict_of(node.comparators[0]) is not None:
        return [(attributes_dict_of(node.comparators[0]), string(node.left))]
    return []


def private_keras_uses(path: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of each `keras.src` a module imports or reaches, and each private name
    (`_name`, not `_keras_dist...`) it reads or writes on an object that is not its own:
    `self` and `cls`, its classes, names that its classes define (keras_dist's own
    attributes), the modules and names it imports from libraries other than Keras."""
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    own_names = {inner.name for node in classes for inner in node.body
                 if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own_names |= {target.attr for node in classes for target in ast.walk(node)
                  if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)
                  and isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")}
    own_roots = {node.name for node in classes}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            own_roots |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] != "keras"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] != "keras":
            own_roots |= {a.asname or a.name for a in node.names}

    def is_keras_private(obj: ast.expr, name: str | None) -> bool:
        if name is None or not name.startswith("_") or name.startswith(("__", "_keras_dist")) or name in own_names:
            return False
        # `self.model._name` is the model's: only `self` itself is the object's own.
        own = isinstance(obj, ast.Name) and obj.id in ("self", "cls") or root_name(obj) in own_roots
        return not own and (path, f"{ast.unparse(obj)}.{name}") not in NOT_KERAS

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("keras.src")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Attribute) and node.attr == "src" and isinstance(node.value, ast.Name) \
                and node.value.id == "keras" or string(node) and re.search(r"\bkeras\.src\b", string(node)):
            found.append((node.lineno, "keras.src"))  # a module imported by name (importlib) too
        else:
            found += [(node.lineno, f"{ast.unparse(obj)}.{name}") for obj, name in attribute_uses(node)
                      if is_keras_private(obj, name)]
    return sorted(found)


def test_private_keras_names_are_used_through_keras_internals_and_overrides_alone():
    # Anywhere else a private name has no canary: the Keras release that renames it breaks
    # keras_dist where it is used, and no test says what moved.
    uses = [f"{path}:{line}: {what}" for path, tree in modules().items() if path not in PRIVATE_KERAS_DOORS
            for line, what in private_keras_uses(path, tree)]
    assert uses == [], ("private Keras names outside keras_dist/keras_internals.py (add a function there, with its "
                        "canary in tests/test_keras_internals.py) and keras_dist.overrides (a method replaced on one "
                        "object):\n" + "\n".join(uses))


# Private names keras_dist passes as strings that are not Keras's: (file, name): whose it is.
NOT_KERAS_STRINGS = {
    ("keras_dist/strategies/parameter_server/loop.py", "_process_closure"):
        "the frame of TensorFlow's coordinator thread that runs a closure, which names the stopped worker",
    ("keras_dist/strategies/tf_strategy.py", "_distribute_strategy"): NOT_KERAS[
        ("keras_dist/strategies/tf_strategy.py", "current._distribute_strategy")],
}


def test_every_private_keras_name_given_as_a_string_has_a_canary():
    # Methods replaced by name (`overrides.override(obj, "_name", ...)`, `hasattr(obj, "_name")`)
    # slip past the attribute check above: a canary in tests/test_keras_internals.py names each.
    canaries = (ROOT / "tests" / "test_keras_internals.py").read_text()
    found = {(path, node.value, node.lineno) for path, tree in modules().items() if path not in PRIVATE_KERAS_DOORS
             for node in ast.walk(tree) if string(node) and re.fullmatch(r"_[a-z]\w*", node.value)
             and not node.value.startswith("_keras_dist")}
    missing = sorted(f"{path}:{line}: {name}" for path, name, line in found
                     if (path, name) not in NOT_KERAS_STRINGS and f'"{name}"' not in canaries)
    assert missing == [], "private Keras names with no canary in tests/test_keras_internals.py:\n" + "\n".join(missing)


def test_no_function_is_longer_than_sixty_lines():
    # Docstrings excluded: from the first statement after the docstring (else from the `def`)
    # to the end; a nested function counts in the function that holds it, and alone.
    too_long = []
    for path, tree in modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            documented = len(body) > 1 and isinstance(body[0], ast.Expr) and string(body[0].value) is not None
            start = body[1].lineno if documented else node.lineno
            if node.end_lineno - start + 1 > 60:
                too_long.append(f"{path}:{node.lineno}: {node.name} ({node.end_lineno - start + 1} lines)")
    assert too_long == [], "functions over 60 lines (split them):\n" + "\n".join(too_long)
