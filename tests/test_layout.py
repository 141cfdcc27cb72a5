"""The shape of the package: one-way imports, a pure planning floor, short modules, no private
names taken across modules, no submodule hiding an exported name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "remat"
MAX_LINES = 400  # tinygrad-style budget: a module longer than this is two modules


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The module that defines ``name`` (a module, or a name inside one)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every remat import in ``module``,
    at any depth (inside functions and ``if TYPE_CHECKING:`` too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "remat"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] == "remat":
                out += [(base, a.name, node.lineno) for a in node.names]
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        deps = set()
        for base, name, _ in _imports(module):
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base
            deps.add(_owner(target))
        deps -= {module, "remat"}  # the root only re-exports, lazily
        graph[module] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# The floors, lowest first: a module imports only from its own floor and those below it.
FLOORS = [
    ("remat.errors", "remat.files", "remat.units", "remat.record_json", "remat.vocabulary", "remat.crossing", "remat.records", "remat.devices",
     "remat.models"),
    ("remat.plan",),
    ("remat.manual",),
    ("remat.measure",),
    ("remat.applier",),
    ("remat.distributed", "remat.verify_steps", "remat.verifier"),
    ("remat.autoplan",),
    ("remat.report", "remat.gradnorm"),
    ("remat.train", "remat.demo", "remat.demo_results"),
    ("remat.cli", "remat.__main__"),
]


def _floor(module: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} has no floor in tests/test_layout.py: FLOORS; give it one")


def test_imports_only_go_down_the_floors() -> None:
    graph = _graph()
    upward = [
        f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})"
        for m in sorted(graph) if m != "remat"
        for d in sorted(graph[m])
        if _floor(d) > _floor(m)
    ]
    assert not upward, "\n".join(upward)


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _below(package: str, graph: dict[str, set[str]]) -> set[str]:
    """Every remat module that ``package`` and its modules import, transitively."""
    seen = {m for m in MODULES if m == package or m.startswith(package + ".")}
    todo = list(seen)
    while todo:
        for d in graph[todo.pop()]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def _third_party(module: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {"remat"}


def test_the_planning_floor_imports_no_torch() -> None:
    reached = _below("remat.plan", _graph())
    assert "remat.plan.solver" in reached and "remat.records" in reached
    users = {m: _third_party(m) & {"torch"} for m in reached}
    assert not any(users.values()), {m: u for m, u in users.items() if u}


def test_the_planning_floor_runs_with_torch_blocked() -> None:
    planning = sorted(m for m in MODULES if m.startswith("remat.plan"))
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import {', '.join(planning)}\n"
        "from remat.records import Profile, Plan\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_torch_blocker_would_notice() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import remat.measure.step\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "torch is blocked" in out.stderr


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_fits_the_line_budget(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines; split it (at most {MAX_LINES})"


def _private_crossings(module: str) -> list[str]:
    """``from remat.x import _y`` (or a private module) from another module, and ``alias._y`` on
    a remat module imported under ``alias``."""
    found = []
    aliases: set[str] = set()
    for base, name, line in _imports(module):
        if name is None:
            continue
        full = f"{base}.{name}"
        if full in MODULES:  # a module imported by name
            aliases.add(name)
        owner = _owner(full)
        if name.startswith("_") and not name.startswith("__") and owner != module:
            found.append(f"{module}:{line} takes {full}")
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.asname and f"{node.module}.{a.name}" in MODULES:
                    aliases.add(a.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{module}:{node.lineno} takes {node.value.id}.{node.attr}")
    for part in module.split(".")[1:]:
        if part.startswith("_") and not part.startswith("__"):
            found.append(f"{module} is a private module")
    return found


def test_no_module_takes_another_modules_private_names() -> None:
    found = [c for m in MODULES for c in _private_crossings(m)]
    assert not found, "\n".join(found)


def _exports(package: str) -> list[str]:
    tree = ast.parse(MODULES[package].read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
                and any(getattr(t, "id", "") == "__all__" for t in node.targets)):
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def test_no_submodule_is_named_after_an_exported_name() -> None:
    import remat

    assert "solve" in remat.__all__ and "apply" in remat.__all__
    packages = [m for m, p in MODULES.items() if p.name == "__init__.py"]
    clashes = []
    for package in packages:
        names = remat.__all__ if package == "remat" else _exports(package)
        clashes += [f"{package}.{n}" for n in names if f"{package}.{n}" in MODULES]
    assert not clashes, f"these submodules would replace the exported names once imported: {clashes}"
