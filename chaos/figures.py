"""The figures the README and docs/ quote, written from the committed results.

A quoted block sits between two comments, ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``;
``python -m chaos.figures`` rewrites every block from its result under ``benchmarks/results/``,
``python -m chaos.figures --check`` says which differ (tests/unit/test_figures.py runs it). A
block names its result and the stamp that made it; a result without a stamp says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# the README certificate table's classes, and what each fault is, in a few words
CERTIFICATE_ROWS = {
    "exception": "raised in the step",
    "hang": "`time.sleep(3600)`",
    "oom": "the allocator fails",
    "sigkill": "the signal (no standby yet)",
    "sigkill_warm": "the same, a standby parked",
    "corrupt_checkpoint": "64 bytes flipped, job killed",
    "link_drop": "veth link down 10 s",
    "nan": "a NaN in the gradient",
    "bitflip": "one bit of one weight",
}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def made_by(data: dict[str, Any]) -> str:
    """What made a result, in a few words, from its stamp."""
    st = data.get("stamp")
    if not st:
        return "unstamped: made before results were stamped"
    tree = "" if st.get("tree_clean") else ", uncommitted changes"
    load = f"load {st['load_before'][0]:.1f}-{st['load_after'][0]:.1f} on {st['cores']} cores"
    return f"{st['date'][:10]}, {st['commit']}{tree}, torch {st['torch']}, {load}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _slo(slo: dict[str, Any]) -> str:
    """A class's SLO in words: its bounds on detection and recovery, and what else it checks."""
    words = ["caught at its step"] if slo.get("detect_at_step") else []
    detect, recover = slo.get("detect_s"), slo.get("recover_s")
    if detect is not None and detect == recover:
        words.append(f"detect, recover ≤ {recover:g} s")
    else:
        words += [f"{w} ≤ {v:g} s" for w, v in (("detect", detect), ("recover", recover)) if v is not None]
    if slo.get("recover_after_restore_s") is not None:
        words.append(f"≤ {slo['recover_after_restore_s']:g} s after it returns")
    if slo.get("previous_checkpoint_loads"):
        words.append("the previous one loads")
    if slo.get("phase_cpu_p50_s"):
        words.append("each phase's CPU time")
    return "; ".join(words) or "bit-exact"


def certificate_table() -> str:
    """The README's certificate: its classes' detect, recover, SLO and steps lost."""
    name = "certificate_cpu.json"
    data = _load(name)
    rows = {r["class"]: r for r in data["classes"]}
    ran = [r for r in data["classes"] if not r.get("skipped")]
    passed = sum(not r["failed"] for r in ran)
    exact = sum(bool(r["bit_exact"]) for r in ran)
    trials = min((r["trials"] for r in ran), default=0)
    skipped = ", ".join(r["class"] for r in data["classes"] if r.get("skipped")) or "none"
    lines = [
        f"[`{name}`](benchmarks/results/{name}) ({made_by(data)}): {len(ran)} classes, "
        f"{trials}+ trials each, {passed} PASS, {exact} bit-exact (skipped: {skipped}); "
        f"{len(CERTIFICATE_ROWS)} of them:",
        "",
        "| class | the fault | detect p50 / p99 | recover p50 / p99 | SLO | steps lost (max) |",
        "|---|---|---|---|---|---|",
    ]
    for cls, fault in CERTIFICATE_ROWS.items():
        r = rows.get(cls)
        if r is None:
            lines.append(f"| {cls} | {fault} | not in this result | | | |")
            continue
        detect = f"{_s(r['detect_p50'])} / {_s(r['detect_p99'])} s"
        recover = f"{_s(r['recover_p50'])} / {_s(r['recover_p99'])} s"
        if r.get("recover_after_restore_p99") is not None:
            recover += f"; {_s(r['recover_after_restore_p99'])} s (p99) after it returned"
        lines.append(f"| {cls} | {fault} | {detect} | {recover} | {_slo(r['slo'])} | {r['steps_lost_max']} |")
    return "\n".join(lines)


# block name -> (the file it is in, its generator)
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "certificate": ("README.md", certificate_table),
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- figures:{name} -->\n)(.*?)(<!-- /figures:{name} -->)", re.S)


def render(text: str, name: str, body: str) -> str:
    """``text`` with block ``name`` holding ``body``; a file without the block is an error."""
    pattern = _pattern(name)
    if not pattern.search(text):
        raise ValueError(f"no block <!-- figures:{name} --> ... <!-- /figures:{name} -->")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def stale() -> list[str]:
    """The blocks whose text differs from their result's."""
    out = []
    for name, (doc, make) in BLOCKS.items():
        text = (ROOT / doc).read_text()
        if render(text, name, make()) != text:
            out.append(f"{doc}: {name}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="say which blocks differ; write nothing")
    args = p.parse_args(argv)
    if args.check:
        differ = stale()
        for d in differ:
            print(f"stale: {d} (python -m chaos.figures)")
        return 1 if differ else 0
    for name, (doc, make) in BLOCKS.items():
        path = ROOT / doc
        path.write_text(render(path.read_text(), name, make()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
