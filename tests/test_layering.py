"""The layering rule (docs/style.md 13): the face (drafthead/*.py, drafthead/commands) imports the
rest; `train` imports `inference` and `heads`; `inference` imports `heads`; `heads` imports
`ground`; `ground`, the floor every layer stands on, imports only itself; and no module imports
itself back through a circle. Inside `inference` and `train`, each room (a folder: one concern)
imports only the rooms below it (ROOMS). Checked on every import statement, lazy ones inside
functions included."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# each layer and the drafthead subpackages it may import (the face, drafthead/, may import all)
MAY_IMPORT = {
    "ground": {"ground"},
    "heads": {"ground", "heads"},
    "inference": {"ground", "heads", "inference"},
    "train": {"ground", "heads", "inference", "train"},
}
# where each installed subpackage lives in the checkout (pyproject.toml's package-dir)
SOURCE = {"ground": ROOT / "ground", "heads": ROOT / "heads", "inference": ROOT / "inference", "train": ROOT / "train"}
# each layer's rooms and the rooms each may import. inference: the CPU kernels know no engine; the
# engine knows no drafter, backend or benchmark (it meets drafters through engine/drafter.py's
# interface). train: data sources and formats at the bottom, then capture, then regeneration and
# the training loop, then the served head's adapting loop on top.
ROOMS = {
    "inference": {
        "kernels": {"kernels"},
        "servers": {"servers"},
        "engine": {"engine", "kernels"},
        "drafters": {"drafters", "engine", "kernels"},
        "llamacpp": {"llamacpp", "engine", "kernels", "servers"},
        "vllm": {"vllm", "engine", "kernels", "servers"},
        "bench": {"bench", "engine", "kernels"},
        "serve": {"serve", "engine"},
    },
    "train": {
        "data": {"data"},
        "capture": {"capture", "data"},
        "regeneration": {"regeneration", "capture", "data"},
        "loop": {"loop", "capture", "data"},
        "adapt": {"adapt", "loop", "capture", "data"},
    },
}


def imported_names(path: Path, package: str) -> set[tuple[str, int]]:
    """(dotted drafthead name, line) for every import in the file: `from x import y` yields both
    x and x.y, since y may be a module; `package` is the file's own dotted package (e.g.
    drafthead.heads.formats), for resolving relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {(name, node.lineno) for name in names if name.split(".")[0] == "drafthead"}
    return found


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (drafthead.heads.io -> heads/io.py)."""
    roots = {"drafthead": ROOT / "drafthead", **{f"drafthead.{k}": v for k, v in SOURCE.items()}}
    modules = {}
    for dotted, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([dotted, *parts])] = path
    return modules


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (names that are attributes, not modules, dropped)."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        graph[name] = {imp for imp, _ in imported_names(path, package_of(name, path)) if imp in modules and imp != name}
    return graph


def forbidden_imports(prefix: str, forbidden) -> list[str]:
    """'file:line imports name' for each import, in the modules whose dotted name starts with
    `prefix`, of a drafthead name (split on dots) that `forbidden` says no to."""
    bad = []
    for name, path in module_files().items():
        if name.startswith(prefix):
            bad += [
                f"{path.relative_to(ROOT)}:{line} imports {imp}"
                for imp, line in imported_names(path, package_of(name, path))
                if forbidden(imp.split("."))
            ]
    return sorted(bad)


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_layer_imports_only_what_it_may(layer):
    assert sorted(SOURCE[layer].rglob("*.py")), layer
    bad = forbidden_imports(f"drafthead.{layer}", lambda parts: len(parts) == 1 or parts[1] not in MAY_IMPORT[layer])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("layer, room", [(layer, room) for layer, rooms in ROOMS.items() for room in sorted(rooms)])
def test_a_room_imports_only_the_rooms_below_it(layer, room):
    assert (SOURCE[layer] / room / "__init__.py").exists(), room
    may = ROOMS[layer][room]
    bad = forbidden_imports(f"drafthead.{layer}.{room}.", lambda parts: parts[1:2] == [layer] and (len(parts) == 2 or parts[2] not in may))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(ROOMS))
def test_every_module_of_a_layer_with_rooms_lives_in_a_room(layer):
    loose = [n for n in module_files() if n.startswith(f"drafthead.{layer}.") and n.split(".")[2] not in ROOMS[layer]]
    assert not loose, loose


def test_every_package_folder_is_listed_in_pyproject():
    # a package missing from pyproject's list is missing from the wheel (scripts/ci/check_wheel.sh)
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"drafthead": ROOT / "drafthead", **{f"drafthead.{k}": v for k, v in SOURCE.items()}}
    found = {".".join([dotted, *init.parent.relative_to(folder).parts]) for dotted, folder in roots.items() for init in folder.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_a_circle():
    # a package's __init__ re-exporting its modules is not a circle of concepts: skip edges into
    # a package's own __init__ from inside that package
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in import_graph().items()}
    assert not cycles(graph), cycles(graph)


def test_the_checker_sees_relative_lazy_and_top_level_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from ...train import run\nfrom .. import inference\nfrom drafthead import __version__\n")
    found = {name for name, _ in imported_names(sample, "drafthead.heads.formats")}
    assert {"drafthead.train", "drafthead.train.run", "drafthead.heads.inference", "drafthead.__version__"} <= found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
