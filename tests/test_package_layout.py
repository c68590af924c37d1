"""The package's rooms (README "Layout"): no import circle between torch_mpmd's
modules, no private name imported across subpackages, every module says what
it is in its first line, no module over 1,500 lines.

Read from the source with ast (nothing imported), so a lazy import inside a
function counts like one at the top; imports under ``if TYPE_CHECKING:`` do
not (they never run).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torch_mpmd"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    """torch_mpmd.runtime.step -> runtime; a top-level module is a room of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every torch_mpmd import that runs."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, str | None]] = []
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, None) for a in node.names if a.name.startswith("torch_mpmd"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("torch_mpmd"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub, None) if sub in MODULES else (base, alias.name))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _ in _imports(m):
            if target in MODULES and target != m:
                edges[m].add(target)
    return edges


def test_no_import_circle():
    edges = _edges()
    # The package's own __init__ imports submodules lazily for its public
    # names; every module imports the package first, so it is no circle.
    edges = {m: {t for t in ts if t != "torch_mpmd"} for m, ts in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                walk(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# The compiled extensions are the C++ core every room may use.
EXTENSIONS = {"torch_mpmd._C", "torch_mpmd._runtime"}


def _private(target: str, name: str | None) -> bool:
    full = f"{target}.{name}" if name else target
    if full in EXTENSIONS or target in EXTENSIONS:
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in full.split(".")[1:])


def test_no_private_name_crosses_a_room():
    crossings = [f"{m} imports {target}{'.' + name if name else ''}"
                 for m in MODULES for target, name in _imports(m)
                 if _private(target, name) and _room(target) != _room(m)]
    assert not crossings, "\n".join(crossings)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_says_what_it_is_and_stays_small(module):
    text = MODULES[module].read_text()
    doc = ast.get_docstring(ast.parse(text))
    assert doc and doc.splitlines()[0].strip(), f"{module} has no first line saying what it is"
    assert text.count("\n") <= 1500, f"{module} has {text.count(chr(10))} lines"


def test_the_public_trace_module_is_the_whole_face_of_runtime_trace():
    import torch_mpmd.runtime.trace as inner
    import torch_mpmd.trace as face

    assert set(face.__all__) == set(inner.__all__)
    assert all(getattr(face, name) is getattr(inner, name) for name in inner.__all__)
