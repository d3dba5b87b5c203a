"""docs/chaos.md's table of fault kinds, generated from the registry (:data:`chaos.faults.REGISTRY`).

``python -m chaos.reference`` rewrites the table between its two markers in docs/chaos.md (the
rest of the page is written by hand); ``--check`` exits 1 when the page is stale. A unit test
(tests/unit/test_fault_kinds.py) fails when the page and the registry disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chaos.faults import CRASH, REGISTRY, SLOW_STORAGE, FaultKind, Where

COMMAND = "python -m chaos.reference"
DOC = Path(__file__).resolve().parents[1] / "docs" / "chaos.md"
BEGIN = f"<!-- fault kinds: generated from chaos/faults by `{COMMAND}`; do not edit by hand -->"
END = "<!-- end of the generated fault kinds -->"

_WHERE = {
    Where.STEP: "in the step",
    Where.BEFORE_COLLECTIVE: "before the step's collective",
    Where.HARNESS: "by the harness",
}


def _fires(k: FaultKind) -> str:
    where = _WHERE[k.where]
    if k.in_process and k.harness_lead is not None:
        where += f" (moved by the harness {k.harness_lead} steps before)"
    return where


def _arg(k: FaultKind) -> str:
    if not k.arg:
        return "—"
    return k.arg + (f" ({k.default_arg:g})" if k.default_arg is not None else "")


def _slo(k: FaultKind) -> str:
    if not k.default_slo:
        return "—"
    return ", ".join(f"`{key}: {_yaml(v)}`" for key, v in k.default_slo.items())


def _yaml(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def table() -> str:
    """The markdown table of every registered kind, with its legend."""
    cols = (
        "kind",
        "fires",
        "the fault",
        "needs (SKIPPED without)",
        "`=arg` (default)",
        "detected by",
        "default SLO",
        "stream",
    )
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, k in REGISTRY.items():
        rows.append(
            f"| {name} | {_fires(k)} | {k.summary} | {', '.join(k.needs) or '—'} | {_arg(k)} | "
            f"{k.evidence.name} | {_slo(k)} | {'✓' if k.streams else '—'} |"
        )
    crash = ", ".join(f"`{e.value}`" for e in CRASH.detection)
    slow = ", ".join(f"`{e.value}`" for e in SLOW_STORAGE.detection)
    legend = (
        f"Detected by *{CRASH.name}*: the first of {crash} after the injection; recovered once every "
        f"rank completed a step in a new generation or process. *{SLOW_STORAGE.name}*: {slow}; it is "
        "no crash, nothing restarts (no recovery time). A class without `slo:` gets its kind's "
        "default SLO; `=arg`'s default is what `certify`, `run` and `stream` write into a plan. "
        "`stream`: the kind can be one of many faults in one job (`stream:`, `schedule:`)."
    )
    return "\n".join(rows) + "\n\n" + legend + "\n"


def render(doc: str) -> str:
    """``doc`` with the text between the markers replaced by :func:`table`."""
    try:
        head, rest = doc.split(BEGIN + "\n", 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"the markers of the generated table are missing ({BEGIN} ... {END})") from None
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/chaos.md is stale; write nothing")
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    current = args.doc.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print(f"{args.doc}: the fault kinds table is stale; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if fresh != current:
        args.doc.write_text(fresh)
        print(f"{args.doc}: fault kinds table rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
