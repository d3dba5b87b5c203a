"""The certificate's figures, from its trials: a row per class (medians and tails, the verdicts on
the class's medians), the tables ``chaos certify`` prints, the timeline plot, certificate.json."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from chaos.certify import Trial
from chaos.schedule import Certification
from resilient.metrics.phases import PHASES


def _pct(xs: list[float | None], q: float) -> float | None:
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return None
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))]


def summarize(cert: Certification, trials: list[Trial]) -> list[dict[str, Any]]:
    rows = []
    for name, c in cert.classes.items():
        ts = [t for t in trials if t.cls == name]
        if not ts:
            continue
        skipped = [t.skipped for t in ts if t.skipped]
        ts = [t for t in ts if not t.skipped]
        if not ts:
            rows.append({"class": name, "trials": 0, "skipped": skipped[0], "failed": [], "errors": []})
            continue
        detect, recover = [t.detect_s for t in ts], [t.recover_s for t in ts]
        phased = [t for t in ts if t.phases]
        phases = {q: {p: _pct([t.phases.get(p) for t in phased], v) for p in PHASES} for q, v in _QS}
        cpu = {q: {p: _pct([t.phase_cpu.get(p) for t in phased], v) for p in PHASES} for q, v in _QS}
        failed = sorted({f for t in ts for f in t.failed_slos}) + _class_verdicts(c.slo, recover, phases, cpu)
        rows.append(
            {
                "class": name,
                "trials": len(ts),
                "finished": sum(t.ok for t in ts),
                "detect_p50": _pct(detect, 0.5),
                "detect_p99": _pct(detect, 0.99),
                "recover_p50": _pct(recover, 0.5),
                "recover_p99": _pct(recover, 0.99),
                "recover_after_restore_p99": _pct([t.recover_after_restore_s for t in ts], 0.99),
                "steps_lost_max": max((t.steps_lost for t in ts if t.steps_lost is not None), default=None),
                "work_lost_max_s": max(
                    (t.work_lost_s for t in ts if t.work_lost_s is not None), default=None
                ),
                "sources": sorted({t.source for t in ts if t.source is not None}),
                "goodput_min": min((t.goodput for t in ts if t.goodput is not None), default=None),
                "bit_exact": all(t.bit_exact for t in ts),
                # where not: the first step and objects that differ, per trial that differed
                "divergences": [t.divergence for t in ts if t.divergence is not None],
                "replay": sorted({t.replay for t in ts if t.replay is not None}),
                "replay_notes": sorted({f"{t.replay}: {t.replay_note}" for t in ts if t.replay is not None}),
                "slo": c.slo.model_dump(exclude_none=True),
                "failed": failed,
                "errors": [t.error for t in ts if t.error],
                # (the median of each phase over the trials that recovered in-process)
                "phases_trials": len(phased),
                "phases_p50": phases["p50"],
                "phases_p99": phases["p99"],
                "phases_cpu_p50": cpu["p50"],
                "phases_cpu_p99": cpu["p99"],
                # a hard fault's replacement with a standby waiting or not: both figures, not a blend
                "recover_p50_by_standby": {
                    w: _pct([t.recover_s for t in ts if t.standby == w], 0.5)
                    for w in sorted({t.standby for t in ts if t.standby is not None})
                },
            }
        )
    return rows


_QS = (("p50", 0.5), ("p99", 0.99))


def _class_verdicts(
    slo: Any,
    recover: list[float | None],
    phases: dict[str, dict[str, float | None]],
    cpu: dict[str, dict[str, float | None]],
) -> list[str]:
    """The SLOs on a class's medians: the recovery's, each budgeted phase's wall time
    (``phase:<name>``) and CPU time (``cpu:<name>``); a phase with no figure fails its budget, as a
    trial with no figure fails its SLO."""
    failed = []
    p50 = _pct(recover, 0.5)
    if slo.recover_p50_s is not None and (p50 is None or p50 > slo.recover_p50_s):
        failed.append("recover_p50_s")
    for tag, budgets, got in (("phase", slo.phase_p50_s, phases), ("cpu", slo.phase_cpu_p50_s, cpu)):
        for name, budget in budgets.items():
            value = got["p50"].get(name)
            if value is None or value > budget:
                failed.append(f"{tag}:{name}")
    return failed


def phase_table(rows: list[dict[str, Any]]) -> Any:
    """The recovery's phases per class, p50/p99 in ms, each against its budget (``≤``): wall time
    (the last rank to end each), then CPU time (the rank where it cost most)."""
    from rich.table import Table

    tb = Table(
        title="recovery phases, ms p50/p99: wall (the last rank to end each: they add up to the "
        "recovery), then cpu (the rank where it cost most)"
    )
    tb.add_column("class")
    for p in PHASES:
        tb.add_column(p, justify="right")
    for r in rows:
        if r.get("phases_trials"):
            name = f"{r['class']} ({r['phases_trials']})"
            tb.add_row(name, *(_phase_cell(r, p, "phases", "phase_p50_s") for p in PHASES))
            tb.add_row("  cpu", *(_phase_cell(r, p, "phases_cpu", "phase_cpu_p50_s") for p in PHASES))
    return tb


def _phase_cell(row: dict[str, Any], phase: str, figures: str, slo: str) -> str:
    a, b = row.get(f"{figures}_p50", {}).get(phase), row.get(f"{figures}_p99", {}).get(phase)
    if a is None:
        return "—"
    text = f"{1e3 * a:.1f}/{1e3 * b:.1f}" if b is not None else f"{1e3 * a:.1f}"
    budget = row["slo"].get(slo, {}).get(phase)
    if budget is not None:
        text += f"\n{'[green]' if a <= budget else '[red]'}≤{1e3 * budget:g}[/]"
    return text


def table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    def f(x: float | None, slo: float | None = None) -> str:
        if x is None:
            return "—"
        return f"{x:.2f}" + (f" ≤{slo:g}" if slo is not None else "")

    tb = Table(title="resilient recovery certificate")
    for col in (
        "class",
        "trials",
        "detect p50/p99 s",
        "recover p50/p99 s",
        "steps lost",
        "goodput",
        "bit-exact",
        "replay verified",
        "SLO",
    ):
        tb.add_column(col)
    for r in rows:
        if r.get("skipped"):
            tb.add_row(r["class"], "0", "—", "—", "—", "—", "—", "—", f"[yellow]SKIPPED[/] {r['skipped']}")
            continue
        slo = r["slo"]
        tb.add_row(
            r["class"],
            f"{r['finished']}/{r['trials']}",
            f"{f(r['detect_p50'])}/{f(r['detect_p99'], slo.get('detect_s'))}",
            f"{f(r['recover_p50'], slo.get('recover_p50_s'))}/{f(r['recover_p99'], slo.get('recover_s'))}"
            + (
                ""
                if r.get("recover_after_restore_p99") is None
                else f"\n{f(r['recover_after_restore_p99'], slo.get('recover_after_restore_s'))}"
                " after the link"
            )
            + "".join(f"\n{f(p50)} standby {w}" for w, p50 in r.get("recover_p50_by_standby", {}).items()),
            ("—" if r["steps_lost_max"] is None else str(r["steps_lost_max"]))
            + "".join(f" {s}" for s in r.get("sources", []))
            + ("" if r.get("work_lost_max_s") is None else f"\n{r['work_lost_max_s']:.2f} s of work"),
            "—" if r["goodput_min"] is None else f"{r['goodput_min']:.0%}",
            "✓" if r["bit_exact"] else "✗" + "".join(_divergence(d) for d in r.get("divergences", [])[:2]),
            _replay_cell(r.get("replay", [])),
            "[green]PASS[/]" if not r["failed"] else f"[red]FAIL[/] {','.join(r['failed'])}",
        )
    if not any(r.get("phases_trials") for r in rows):
        return tb
    from rich.console import Group

    return Group(tb, phase_table(rows))  # (the phases under the verdicts: what to look at when one fails)


def _divergence(d: dict[str, Any]) -> str:
    """Where a trial left the fault-free run: what the runtime found untracked first, then the
    objects that differ at the first divergent step."""
    untracked = "".join(f"\nuntracked: {name}" for name in d.get("untracked", [])[:3])
    return f"{untracked}\nfrom step {d['step']}: {', '.join(d['objects'])}"


def _replay_cell(said: list[str]) -> str:
    """``✓`` every replay compared equal; ``✗`` one diverged; ``—`` nothing replayed (a live resume)
    or nothing kept to compare with."""
    if "diverged" in said:
        return "[red]✗[/]"
    if "verified" in said:
        return "✓" + (" (some —)" if "unchecked" in said else "")
    return "—"


def timeline_png(trials: list[Trial], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in trials if t.timeline and t.trial == 0]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.2 * len(shown)), squeeze=False)
    for ax, t in zip(axes[:, 0], shown, strict=True):
        steps = t.timeline["steps"]
        t0 = min(s[0] for s in steps)
        for rank in sorted({s[1] for s in steps}):
            pts = [(s[0] - t0, s[2]) for s in steps if s[1] == rank]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, label=f"rank {rank}")
        ax.axvline(t.timeline["injected"] - t0, color="red", lw=1, label="fault")
        if t.timeline.get("detected"):
            ax.axvline(t.timeline["detected"] - t0, color="orange", lw=1, label="detected")
        if t.timeline.get("restored"):
            ax.axvspan(
                t.timeline["injected"] - t0,
                t.timeline["restored"] - t0,
                color="red",
                alpha=0.1,
                label=t.timeline.get("lasting", "fault lasts"),
            )
        if t.recover_s is not None:
            ax.axvline(t.timeline["injected"] - t0 + t.recover_s, color="green", lw=1, label="recovered")
        exact = "bit-exact" if t.bit_exact else "NOT bit-exact"
        recover = "no restart" if t.restarts == 0 else f"recover {t.recover_s or float('nan'):.2f} s"
        ax.set_title(f"{t.cls}: detect {t.detect_s or float('nan'):.2f} s, {recover}, {exact}", fontsize=9)
        ax.set_ylabel("step")
        ax.legend(fontsize=6, loc="lower right")
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    cert: Certification,
    trials: list[Trial],
    out: Path,
    st: dict[str, Any] | None = None,
    complete: bool = True,
) -> list[dict[str, Any]]:
    """``certificate.json`` (stamped: ``st`` from :func:`chaos.results.begin`, taken before the
    trials; ``complete`` False for a subset of the config's classes) and ``timeline.png``."""
    from chaos import results

    rows = summarize(cert, trials)
    data = {
        "classes": rows,
        "trials": [{k: v for k, v in asdict(t).items() if k != "timeline"} for t in trials],
        "job": cert.job.model_dump(),
        "seed": cert.seed,
        "passed": all(not r["failed"] for r in rows),
    }
    results.write(out / "certificate.json", data, st or results.begin(), complete)
    timeline_png(trials, out / "timeline.png")
    return rows
