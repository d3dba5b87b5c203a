"""The rules docs/architecture.md states about the house, held by the code: which rooms may import
which (every import, at the top or inside a function), and no module past 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450

# (files under this path, modules they must never import, why)
RULES = [
    ("resilient/", ("chaos",), "the library never imports its harness"),
    ("resilient/runtime/", ("resilient.launcher",), "the runtime never imports the launcher"),
    ("resilient/integrations/", ("resilient.launcher",), "the integrations never import the launcher"),
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


def test_no_module_of_the_library_or_the_harness_is_past_450_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for top in ("resilient", "chaos")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "split these into modules of one concern each: " + "; ".join(long)
