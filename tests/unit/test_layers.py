"""The rules docs/architecture.md states about the house, held by the code: which rooms may import
which (every import, at the top or inside a function), and no function past ~60 lines nor class
past ~300 (a module is as long as its one job needs: a line cap on modules only taught packing)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION = 60
MAX_CLASS = 300
# Functions and classes past the bounds when the bounds came in, at their length then: each may
# only shrink, and leaves this list once it is within its bound (the recovery core's untangling).
OVER: dict[str, int] = {}

# (files under this path, modules they must never import, why)
RULES = [
    ("resilient/", ("chaos",), "the library never imports its harness"),
    ("resilient/runtime/", ("resilient.launcher",), "the runtime never imports the launcher"),
    ("resilient/integrations/", ("resilient.launcher",), "the integrations never import the launcher"),
    (
        "resilient/launcher/",
        ("resilient.runtime",),
        "the launcher never imports the runtime: what both share is the contract",
    ),
    ("resilient/metrics/", ("resilient.launcher", "resilient.runtime"), "metrics read the event log only"),
    (
        "resilient/detectors/",
        ("resilient.runtime", "resilient.config", "resilient.launcher", "resilient.integrations"),
        "detectors are below the config (which takes their sections) and the runtime (which hooks them)",
    ),
    (
        "resilient/state/",
        ("resilient.runtime", "resilient.launcher", "resilient.checkpoint"),
        "state is a floor",
    ),
    ("resilient/health.py", ("resilient.runtime", "resilient.launcher"), "health checks are a floor"),
]


# The runtime's rooms, floors from the top (docs/architecture.md#the-rooms): a room imports only
# rooms on floors below its own, type-only imports included; its modules form no cycle.
RUNTIME_FLOORS = [
    ("wrapper",),  # the front door: resilient.wrap
    ("standby",),  # a parked standby's own side, which the front door hands a promotion to
    ("engine",),  # what runs the function once per generation
    ("recovery",),  # between two generations
    ("leave",),  # how a rank leaves its step
    ("steps",),  # the step loop
    ("keeping",),  # where state goes besides the ring, and where a new process takes it from
    ("run",),  # what a run and its generations hold: session, wiring, generation, schedule
    ("coordination",),  # the store protocol, node stores, the generation's group
    ("faults",),  # what a fault is: records, stacks, exits
    ("hooks", "context"),  # the ground: what a training function and a hook meet
]


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _files(prefix: str) -> list[Path]:
    at = ROOT / prefix
    return [at] if at.is_file() else sorted(at.rglob("*.py"))


@pytest.mark.parametrize(("prefix", "never", "why"), RULES, ids=[r[0] for r in RULES])
def test_no_room_imports_what_it_must_not(prefix: str, never: tuple[str, ...], why: str) -> None:
    broken = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _files(prefix)
        for line, mod in imports(p)
        if any(mod == n or mod.startswith(n + ".") for n in never)
    ]
    assert not broken, f"{why}: " + "; ".join(broken)


def _lengths() -> dict[str, int]:
    """Every function's and class's length in lines, by ``path:name``, where past its bound."""
    out = {}
    for top in ("resilient", "chaos"):
        for p in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    bound = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > bound:
                        out[f"{p.relative_to(ROOT)}:{node.name}"] = n
    return out


def test_no_function_or_class_of_the_library_or_the_harness_is_past_its_bound() -> None:
    found = _lengths()
    long = [f"{k}: {n} lines" for k, n in found.items() if n > OVER.get(k, 0)]
    assert not long, (
        f"functions stay within {MAX_FUNCTION} lines and classes within {MAX_CLASS}: split by job "
        "(never pack lines): " + "; ".join(long)
    )
    done = sorted(set(OVER) - set(found))
    assert not done, f"within the bound now: remove from OVER: {done}"


def _room(module: str) -> str | None:
    """The runtime room ``module`` is in (``resilient.runtime.steps.loop`` -> ``steps``)."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["resilient", "runtime"] else None


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_the_runtimes_rooms_point_one_way_down() -> None:
    floor = {room: i for i, rooms in enumerate(RUNTIME_FLOORS) for room in rooms}
    files = sorted((ROOT / "resilient" / "runtime").rglob("*.py"))
    unplaced = sorted({r for p in files if (r := _room(_module(p))) is not None and r not in floor})
    assert not unplaced, (
        f"rooms on no floor (add them to RUNTIME_FLOORS and docs/architecture.md): {unplaced}"
    )
    up = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in files
        if (src := _room(_module(p))) is not None
        for line, mod in imports(p)
        if (dst := _room(mod)) is not None and dst != src and floor[dst] <= floor[src]
    ]
    assert not up, "an import points up or sideways inside the runtime: " + "; ".join(up)


def test_no_modules_of_the_library_import_each_other_in_a_circle() -> None:
    files = {_module(p): p for p in sorted((ROOT / "resilient").rglob("*.py"))}
    graph = {mod: {m for m in _imported(p, files) if m != mod} for mod, p in files.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (type-only imports too): " + "; ".join(" -> ".join(c) for c in cycles)


def _imported(path: Path, files: dict[str, Path]) -> set[str]:
    """The modules of ``files`` that ``path`` imports: ``from pkg import mod`` names ``pkg.mod``
    where that is a module (not ``pkg``, whose ``__init__`` may import ``mod`` back)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(files)
            out |= subs if len(subs) == len(node.names) else {node.module, *subs}
    return out & set(files)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
