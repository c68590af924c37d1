"""The package's rooms (README "Layout"): no import circle between torch_mpmd's
modules, no private name imported or read across subpackages (``obj._name``
where ``_name`` belongs to another room), every module says what it is in its
first line, no module over 800 lines.

Read from the source with ast (nothing imported), so a lazy import inside a
function counts like one at the top; imports under ``if TYPE_CHECKING:`` do
not (they never run).
"""

from __future__ import annotations

import ast
import pathlib
import re

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


MAX_LINES = 800

# Private names of torch (and Python) that torch_mpmd reads on torch's own
# objects; a room of ours that happens to define one too does not own it.
TORCH_PRIVATE = {
    "_modules": "nn.Module's submodule table (a Pipeline mirrors the module's tree)",
    "_parameters": "nn.Module's parameter table (the same)",
    "_buffers": "nn.Module's buffer table (the same)",
    "_non_persistent_buffers_set": "nn.Module's non-persistent buffer names (state dicts)",
    "_local_tensor": "a DTensor's local shard, without the autograd of to_local()",
    "_orig_mod": "the module a torch.compile OptimizedModule wraps",
    "_torchdynamo_orig_callable": "the function a torch.compile'd function wraps",
    "_backward_hooks": "a tensor's gradient hooks (the compile door runs them later)",
    "_post_accumulate_grad_hooks": "the same, after accumulation",
    "_pytree": "torch.utils._pytree, torch's tree flattening",
}


def _defined_private_names(text: str) -> set[str]:
    """The private names a module's source defines: functions, classes,
    methods, and what it assigns (``self._x = ...``, ``obj._x = ...``, class
    fields)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)
                    elif isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(text: str) -> list[tuple[int, str, str]]:
    """(line, the expression, its private attribute) for every ``x._name``
    in the source whose object is not ``self``, ``cls``, ``super()`` or one
    of torch's own modules (``torch._dynamo``)."""
    reads = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        obj = node.value
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            continue
        if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and \
                obj.func.id == "super":
            continue
        if _root_name(obj) == "torch":
            continue
        reads.append((node.lineno, ast.unparse(node), name))
    return reads


def _crossings(sources: dict[str, str]) -> list[str]:
    """Reads of ``obj._name`` where only other rooms define ``_name``."""
    owners: dict[str, set[str]] = {}
    for m, text in sources.items():
        for name in _defined_private_names(text):
            owners.setdefault(name, set()).add(_room(m))
    found = []
    for m, text in sources.items():
        for line, expr, name in _private_reads(text):
            rooms = owners.get(name, set())
            if name in TORCH_PRIVATE or not rooms or _room(m) in rooms:
                continue  # torch's own, none of ours, or this room's
            found.append(f"{m}:{line}: {expr} ({name} belongs to {', '.join(sorted(rooms))})")
    return found


def test_no_private_attribute_of_another_room_is_read():
    """``obj._name`` where only other rooms define ``_name``: the object is
    another room's, and its private state is that room's to change."""
    crossings = _crossings({m: path.read_text() for m, path in MODULES.items()})
    assert not crossings, "\n".join(crossings)


def test_the_private_attribute_check_sees_a_crossing():
    """The check itself, on two small modules of two rooms."""
    sources = {
        "torch_mpmd.parallel.lockstep": "def _first_line(t):\n    return t\n",
        "torch_mpmd.runtime.rank": ("from torch_mpmd.parallel import lockstep\n"
                                    "class R:\n    def f(self, e):\n"
                                    "        self._own = 1\n"
                                    "        return lockstep._first_line(e), self._own, "
                                    "e._modules, torch._dynamo\n"),
    }
    assert _crossings(sources) == [
        "torch_mpmd.runtime.rank:5: lockstep._first_line (_first_line belongs to parallel)"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_says_what_it_is_and_stays_small(module):
    text = MODULES[module].read_text()
    doc = ast.get_docstring(ast.parse(text))
    assert doc and doc.splitlines()[0].strip(), f"{module} has no first line saying what it is"
    assert text.count("\n") <= MAX_LINES, f"{module} has {text.count(chr(10))} lines"


def test_the_public_trace_module_is_the_whole_face_of_runtime_trace():
    import torch_mpmd.runtime.trace as inner
    import torch_mpmd.trace as face

    assert set(face.__all__) == set(inner.__all__)
    assert all(getattr(face, name) is getattr(inner, name) for name in inner.__all__)


# ------------------------------------------------------------------ what comments cite
REPO = PACKAGE.parent
SOURCES = sorted([*PACKAGE.rglob("*.py"), *(REPO / "csrc").rglob("*.cpp"),
                  *(REPO / "csrc").rglob("*.h")])
# Headers and files of other projects that comments may name.
EXTERNAL = ("torch/", "ATen/", "c10/", "fmt/", "pybind11/", "gtest/", "nccl")


def _flat(path: pathlib.Path) -> str:
    """The source as one line of words: comment markers, line breaks and C++
    string-literal joins removed, so a citation broken over lines is whole."""
    text = path.read_text()
    text = re.sub(r'"\s*\n\s*"', "", text)              # "...abc " "def..." across lines
    text = re.sub(r"\s*\n\s*(?:#|//+|\*)?\s*", " ", text)
    return text


def _note_definitions() -> dict[str, set[str]]:
    defs: dict[str, set[str]] = {}
    for path in SOURCES:
        for m in re.finditer(r"NOTE \[([^\]]+)\]:", _flat(path)):
            defs.setdefault(m.group(1), set()).add(str(path.relative_to(REPO)))
    return defs


def test_every_note_cited_is_defined_where_the_citation_says():
    """``NOTE [Title]`` must be defined somewhere (``NOTE [Title]:``), and
    ``NOTE [Title] in some/file.py`` in that file."""
    defs = _note_definitions()
    bad = []
    for path in SOURCES:
        for m in re.finditer(r"NOTE \[([^\]]+)\](?!:)(?:,? in ([\w/.]+\.(?:py|cpp|h)))?",
                             _flat(path)):
            title, where = m.group(1), m.group(2)
            here = str(path.relative_to(REPO))
            if title not in defs:
                bad.append(f"{here}: NOTE [{title}] is defined nowhere")
            elif where and not any(d.endswith(where) for d in defs[title]):
                bad.append(f"{here}: NOTE [{title}] in {where}, but it is in "
                           f"{', '.join(sorted(defs[title]))}")
    assert not bad, "\n".join(bad)


def test_every_file_a_comment_names_exists():
    """Paths (``torch_mpmd/runtime/step.py``, ``csrc/core/action.h``) and file
    names (``step.py``) in the package's sources name files of the repository."""
    tracked = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
               if p.is_file() and ".git" not in p.parts]
    names = {pathlib.PurePath(t).name for t in tracked}
    bad = set()
    for path in SOURCES:
        for m in re.finditer(r"(?<![\w.])([\w/]*\w\.(?:py|cpp|h))\b", _flat(path)):
            cited = m.group(1)
            if cited.startswith(EXTERNAL) or cited.startswith("_"):
                continue
            if "/" in cited:
                ok = any(t.endswith(cited) for t in tracked)
            else:
                ok = cited in names
            if not ok:
                bad.add(f"{path.relative_to(REPO)}: {cited}")
    assert not bad, "\n".join(sorted(bad))


def test_comments_say_what_they_mean_not_a_tracker_number():
    """The package explains itself: "issue 21" means nothing to a reader
    without the tracker (tests and BENCHMARKS.md may cite issues)."""
    cited = [f"{path.relative_to(REPO)}: {m.group(0)}" for path in SOURCES
             for m in re.finditer(r"\b[Ii]ssues? #?\d+", _flat(path))]
    assert not cited, "\n".join(cited)
