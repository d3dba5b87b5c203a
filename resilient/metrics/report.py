"""``resilient report``, ``resilient status`` and the fault blocks of ``resilient events --faults``:
what the event log says about a run, for a person."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from resilient.detectors import REGISTRY as DETECTORS
from resilient.events import Event
from resilient.metrics.accounting import CAUSES, OTHER, Accounting, Incident, account
from resilient.metrics.phases import PHASES, Phases, fmt, of_incident

COLORS = {
    "productive": "#2ca02c",
    "rerun": "#ff7f0e",
    "rollback": "#e377c2",
    "checkpoint": "#9467bd",
    "startup": "#7f7f7f",
    "detection": "#d62728",
    "recovery": "#1f77b4",
    "replacement": "#17becf",
    "relaunch": "#8c564b",
    OTHER: "#dddddd",
}


def find_log(path: str | Path) -> Path | None:
    """``path`` as an event log: the file itself, ``<run dir>/events.jsonl``, or the newest run's
    log under an events directory (``resilient_runs``)."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / "events.jsonl").is_file():
        return p / "events.jsonl"
    logs = sorted(p.glob("*/events.jsonl"), key=lambda f: f.stat().st_mtime) if p.is_dir() else []
    return logs[-1] if logs else None


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def slurm_place(slurm: dict[str, Any] | None) -> str | None:
    """``job 812345.0 on n2`` (``, requeued 1x`` after a requeue): where Slurm ran the fault."""
    if not slurm or not slurm.get("job"):
        return None
    step = f".{slurm['step']}" if slurm.get("step") is not None else ""
    node = f" on {slurm['node']}" if slurm.get("node") else ""
    again = f", requeued {slurm['requeues']}x" if slurm.get("requeues") else ""
    return f"job {slurm['job']}{step}{node}{again}"


def fault_blocks(events: list[dict[str, Any]], acc: Accounting | None = None) -> list[str]:
    """One human-readable block per fault: where, what, who noticed, how it ended, and what the
    faulty rank (or the agent, for a silent one) saw: its traceback or every thread's stack."""
    acc = acc or account(events)
    reports = [e for e in events if e.get("event") == Event.FAULT_REPORT]
    out = []
    for n, inc in enumerate(acc.incidents, 1):
        where = (
            f"rank {inc.rank}"
            + (f" on {inc.host}" if inc.host else "")
            + (f", pid {inc.pid}" if inc.pid else "")
            + (f" (Slurm {place})" if (place := slurm_place(inc.slurm)) else "")
        )
        lines = [f"fault {n}: {inc.kind} on {where}, step {inc.step if inc.step is not None else '?'}"]
        lines.append(
            f"  happened   {_clock(inc.start)}; noticed by {inc.noticed_by} after {inc.detect_s:.3f} s"
        )
        if inc.end is not None:
            rerun = f"; {inc.steps_rerun} steps re-run" if inc.steps_rerun is not None else ""
            if inc.source is not None:  # (live: the faulted step alone; else the snapshot's steps since)
                lost = f", {inc.work_lost_s:.3f} s of work lost" if inc.work_lost_s is not None else ""
                rerun += f" (state from {inc.source}{lost})"
            lines.append(f"  recovered  {inc.mode.replace('_', '-')} in {inc.recover_s:.3f} s{rerun}")
        else:
            lines.append(f"  not recovered ({inc.mode})")
        later = min((i.start for i in acc.incidents if i.start > inc.start), default=float("inf"))
        replay = replay_of(events, inc.start, later)
        if replay is not None:
            lines.append(f"  replay     {replay}")
        phases = of_incident(inc)
        if phases is not None:
            lines.append(f"  phases     {fmt(phases)}; {_last_ranks(phases)}")
        lines.append(f"  cause      {inc.signature}")
        lines += _verdicts(inc, events, later)
        rep = _report_for(inc, reports)
        if rep is not None:
            pid = rep.get("pid")
            if rep.get("message"):
                lines.append(f"  message    {rep['message']}")
            if rep.get("where"):
                coll = " (in a collective)" if rep.get("in_collective") else ""
                lines.append(f"  main thread at {rep['where']}{coll}")
            if rep.get("collectives_issued") is not None and rep["collectives_issued"] >= 0:
                lines.append(f"  collectives issued on the group so far: {rep['collectives_issued']}")
            for key, title in (("traceback", "traceback"), ("stacks", "stacks of every thread")):
                if rep.get(key):
                    src = f", by {rep['source']}" if rep.get("source") else ""
                    lines.append(f"  {title} (pid {pid}{src}):")
                    lines += ["    " + ln for ln in str(rep[key]).rstrip().splitlines()]
        out.append("\n".join(lines))
    for e in events:  # a straggler is no fault of its own: reported, and maybe replaced
        if e.get("event") == Event.STRAGGLER_DETECTED:
            out.append(
                f"straggler: rank {e.get('rank')} on {e.get('host')}, {e.get('slowdown')}x its peers' work "
                f"per step for {e.get('for_s')} s, at {_clock(e['ts'])} (action: {e.get('action')})"
            )
    return out


def untracked_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """State the function keeps that a restart loses (``untracked_state``), one row per value:
    its name, type, the line that fixes it and the ranks that reported it."""
    rows: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("event") != Event.UNTRACKED_STATE:
            continue
        for f in e.get("findings") or []:
            row = rows.setdefault(f["name"], {**f, "ranks": []})
            if e.get("rank") not in row["ranks"]:
                row["ranks"].append(e.get("rank"))
    return list(rows.values())


REPLAY_EVENTS = (Event.REPLAY_VERIFIED, Event.REPLAY_DIVERGED, Event.REPLAY_UNCHECKED)


def replay_of(events: list[dict[str, Any]], start: float, until: float = float("inf")) -> str | None:
    """What the replay after the fault at ``start`` (until the next one's) was found to be, by
    every rank (runtime/steps/replay.py): ``diverged at step N (model: 4 leaves)``, ``verified
    (N steps)``, ``unchecked: why``; None: no verdict (no restore, or a run from before them)."""
    said = [e for e in events if e.get("event") in REPLAY_EVENTS and start <= e["ts"] < until]
    diverged = [e for e in said if e["event"] == Event.REPLAY_DIVERGED]
    if diverged:
        e = min(diverged, key=lambda e: e["first_step"])
        what = ", ".join(f"{k}: {len(v)} leaves" for k, v in sorted(e["objects"].items()))
        return f"diverged at step {e['first_step']} ({what}; rank {e['rank']})"
    verified = [e for e in said if e["event"] == Event.REPLAY_VERIFIED]
    if verified:
        e = verified[0]
        cut = f"; the silent fault's window began at {e['reference_end']}" if "reference_end" in e else ""
        steps = f"{e['steps_checked']} steps, {e['first']}..{e['last']}"
        return f"verified ({steps}, on {len(verified)} ranks{cut})"
    return f"unchecked: {said[0]['why']}" if said else None


def fault_rows(events: list[dict[str, Any]], acc: Accounting | None = None) -> list[dict[str, Any]]:
    """One row per fault: what it cost (detection, recovery, the steps re-run and the work they
    stood for) and what the replay was found to be."""
    acc = acc or account(events)
    rows = []
    for inc in acc.incidents:
        later = min((i.start for i in acc.incidents if i.start > inc.start), default=float("inf"))
        rows.append(
            {
                "kind": inc.kind,
                "rank": inc.rank,
                "step": inc.step,
                "mode": inc.mode,
                "detect_s": inc.detect_s,
                "recover_s": inc.recover_s,
                "source": inc.source,
                "steps_rerun": inc.steps_rerun,
                "work_lost_s": inc.work_lost_s,
                "replay": replay_of(events, inc.start, later),
                "slurm": slurm_place(inc.slurm),
            }
        )
    return rows


def _last_ranks(p: Phases) -> str:
    """``ended last by rank 1 (rank 0: detect, agree)``: the rank the others waited for in most
    phases, and the phases another rank ended last."""
    by: dict[int, list[str]] = {}
    for name in PHASES:
        r = p.ranks.get(name)
        if r is not None:
            by.setdefault(r, []).append(name)
    if not by:
        return "ended last by no known rank"
    most = max(by, key=lambda r: (len(by[r]), -r))
    rest = "; ".join(f"rank {r}: {', '.join(by[r])}" for r in sorted(by) if r != most)
    return f"ended last by rank {most}" + (f" ({rest})" if rest else "")


def _verdicts(inc: Incident, events: list[dict[str, Any]], until: float) -> list[str]:
    """What a fault that raised nothing led to, up to the next fault (``until``): who the
    replicas' digests named, a spike applied or a batch skipped on replay (each verdict once)."""
    seen: set[str] = set()
    out = []
    for e in events:
        if not (inc.start - 1.0 <= e.get("ts", 0) < until):
            continue
        ev = e.get("event")
        if ev == Event.SDC_DETECTED:
            ranks = e.get("ranks") or []
            who = f"rank {', '.join(map(str, ranks))} corrupt" if ranks else "no rank named yet"
            line = f"  replicas   {who} ({e.get('how')}; after step {e.get('step')})"
        elif ev in (Event.SPIKE_ACCEPTED, Event.BATCH_SKIPPED) and inc.kind in DETECTORS.evidenced_by(ev):
            what = "applied: it came back on replay" if ev == Event.SPIKE_ACCEPTED else "its batch skipped"
            line = f"  on replay  step {e.get('step')} {what}"
        else:
            continue
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def _report_for(inc: Incident, reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fault report of the incident's rank, written while it lasted."""
    end = inc.end if inc.end is not None else float("inf")
    for r in reports:
        rank = r.get("global_rank", r.get("rank"))
        if rank == inc.rank and inc.start - 1.0 <= r["ts"] <= end:
            return r
    return None


def write_png(acc: Accounting, path: Path, title: str = "") -> None:
    """A stacked bar per slice of the run's wall time: how each slice was spent, by cause."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = 60
    wall = max(acc.wall_s, 1e-9)
    width = wall / bins
    shares = {c: [0.0] * bins for c in (*CAUSES, OTHER)}
    for a, b, cause in acc.segments:
        i = int((a - acc.start) / width)
        while a < b and i < bins:
            edge = acc.start + (i + 1) * width
            part = min(b, edge) - a
            shares[cause][i] += part / width
            a, i = min(b, edge), i + 1
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = [(i + 0.5) * width for i in range(bins)]
    bottom = [0.0] * bins
    for c in (
        "productive",
        "rerun",
        "rollback",
        "checkpoint",
        "startup",
        "detection",
        "recovery",
        "replacement",
        "relaunch",
        OTHER,
    ):
        if any(shares[c]):
            ax.bar(
                xs,
                shares[c],
                width=width,
                bottom=bottom,
                color=COLORS[c],
                label=f"{c} {acc.seconds[c]:.1f} s",
            )
            bottom = [x + y for x, y in zip(bottom, shares[c], strict=True)]
    for inc in acc.incidents:
        ax.axvline(inc.start - acc.start, color="black", lw=0.6, ls=":")
    gp = f"goodput {acc.goodput:.1%}" if acc.goodput is not None else ""
    ax.set_title(f"{title} {gp} over {wall:.0f} s, {len(acc.incidents)} faults".strip())
    ax.set_xlabel("seconds since the launch")
    ax.set_ylabel("share of each slice")
    ax.set_ylim(0, 1)
    ax.set_xlim(0, wall)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def status_table(events: list[dict[str, Any]], beats: dict[int, tuple[float, int, int]], title: str) -> Any:
    """The rich renderable of ``resilient status``: the run, then one row per rank."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from resilient.metrics.model import build_model

    m = build_model(events, "", now=time.time())
    acc = m.accounting
    assert acc is not None
    ranks: dict[int, dict[str, Any]] = {}
    for e in events:
        r = e.get("rank", -1)
        if not isinstance(r, int) or r < 0:
            continue
        row = ranks.setdefault(r, {})
        row.update(host=e.get("host", "?"), pid=e.get("pid"), seen=e["ts"], generation=e.get("generation"))
    now = time.time()
    gp = f"{acc.goodput:.1%}" if acc.goodput is not None else "—"
    head = Text(
        f"{title}\nstate {m.state}   wall {acc.wall_s:.0f} s   faults {len(acc.incidents)}   goodput {gp}   "
        + "   ".join(f"{c} {acc.seconds[c]:.1f}s" for c in CAUSES if acc.seconds[c] > 0)
    )
    t = Table()
    for col in ("rank", "host", "pid", "gen", "step", "step time", "last record", "heartbeat"):
        t.add_column(col)
    for r, row in sorted(ranks.items()):
        step, _ts = m.steps.get(r, (None, None))
        beat = beats.get(r)
        if beat is not None and (step is None or beat[1] >= step):
            step = beat[1]
        st = m.step_s.get(r)
        t.add_row(
            str(r),
            str(row["host"]),
            str(row["pid"]),
            str(row["generation"]),
            "—" if step is None else str(step),
            "—" if st is None else f"{1e3 * st:.1f} ms",
            f"{now - row['seen']:.1f} s ago",
            "—" if beat is None else f"{beat[0]:.1f} s",
        )
    last = acc.incidents[-1] if acc.incidents else None
    fault = (
        f"last fault: {last.kind} on rank {last.rank} at step {last.step}, {last.mode}"
        + (f" in {last.recover_s:.2f} s" if last.recover_s is not None else " (recovering)")
        if last
        else "no faults"
    )
    waiting = sorted(m.standbys.values())
    kinds = ", ".join(f"{waiting.count(w)} {w}" for w in sorted(set(waiting)))
    standby = f"standbys waiting: {len(waiting)} ({kinds})" if waiting else "standbys waiting: none"
    if m.standby_fallbacks:
        standby += f"; {m.standby_fallbacks} could not park in the script (standby_fallback)"
    return Group(head, t, Text(f"{fault}\n{standby}"))


def heartbeats(run_id: str) -> dict[int, tuple[float, int, int]]:
    """This node's heartbeats of ``run_id`` (under ``resilient launch``): local rank -> (age, step, gen)."""
    from resilient.contract import heartbeat_dirs, read_beats

    out: dict[int, tuple[float, int, int]] = {}
    for d in heartbeat_dirs(run_id):
        out.update({r: (b.age_s, b.step, b.generation) for r, b in read_beats(d).items()})
    return out
