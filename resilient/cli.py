"""``resilient`` command line.

- ``resilient config [PATH] [--set key=value ...]``: validate a configuration and print it with the
  timeouts derived from it (what the runtime will really use).
- ``resilient events PATH``: summarize a run's events.jsonl — each fault, who detected it, how long
  recovery took, steps re-run — as a table.
- ``resilient plan``: Young's and Daly's checkpoint intervals, goodput, and a Monte-Carlo check.
- ``resilient launch [torchrun flags] script.py ...``: torchrun plus heartbeats and fault causes.
- ``resilient checkpoints DIR [--verify]``: the committed checkpoints, and whether every file verifies.
- ``resilient report RUN_DIR``: goodput accounting by cause (table and PNG), from the event log.
- ``resilient status RUN_DIR [--follow]``: ranks, steps, step time, heartbeats, faults, goodput, live.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from resilient.argtypes import count as _count
from resilient.argtypes import nonnegative as _nonnegative
from resilient.argtypes import positive as _positive
from resilient.config import load_config
from resilient.errors import ConfigError
from resilient.events import Event, read_events

if TYPE_CHECKING:
    from resilient.checkpoint.manifest import Manifest
    from resilient.metrics.accounting import Accounting


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.path, **_parse_set(args.set))
    print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False).rstrip())
    print("# derived timeouts (seconds)")
    print(yaml.safe_dump({"timeouts": asdict(cfg.timeouts)}, sort_keys=False).rstrip())
    return 0


def summarize(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fault generation, computed from the event log alone."""
    from resilient.metrics.accounting import preemption

    rows = []
    # the launcher's agent replaced a dead rank whose survivors were in generation `join_generation`
    replaced = {e.get("join_generation"): e for e in events if e["event"] == Event.RANK_REPLACED}
    gens = sorted({e["generation"] for e in events if e["rank"] >= 0})
    for g in gens:
        faults = [
            e
            for e in events
            if e["generation"] == g
            and e["event"] == Event.FAULT_DETECTED
            and e["rank"] >= 0
            and not preemption(e)  # (run_preempted says it: no fault)
        ]
        if not faults:
            continue
        p = dict(faults[0])
        dead = replaced.get(g)
        if dead is not None and p["kind"] != "died":
            # a survivor's broken collective with it came first: the dead rank is the origin
            p.update(
                kind="died",
                origin_rank=dead["global_rank"],
                origin_step=dead.get("last_step", p["origin_step"]),
            )
            p["signature"] = dead.get("cause", p["signature"])
        nxt = [e for e in events if e["generation"] == g + 1]
        resumed = [e["ts"] for e in nxt if e["event"] == Event.STEP_RESUMED]
        every = [e for e in nxt if e["event"] == Event.STATE_RESTORED]
        restored = every[0] if every else {}
        # (a rank that faulted a step ahead of its peers re-ran one more: the most, as the report says)
        reruns = [e["steps_rerun"] for e in every if e.get("steps_rerun") is not None]
        failed = [e for e in events if e["generation"] == g and e["event"] == Event.RUN_FAILED]
        rows.append(
            {
                "generation": g,
                "kind": p["kind"],
                "origin_rank": p["origin_rank"],
                "step": p["origin_step"],
                "signature": p["signature"],
                "detect_s": p.get("origin_latency_s", 0.0),
                "recover_s": (max(resumed) - p["origin_ts"]) if resumed else None,
                "steps_rerun": max(reruns) if reruns else None,
                "source": restored.get("source"),
                "work_lost_s": restored.get("work_lost_s"),
                "outcome": failed[0]["error"] if failed else ("recovered" if resumed else "not recovered"),
            }
        )
    return rows


def cmd_events(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    path = Path(args.path)
    if path.is_dir():
        path = path / "events.jsonl"
    if not path.is_file():
        print(f"resilient events: no event log at {path}", file=sys.stderr)
        return 2
    events = read_events(path)
    if args.faults:
        from resilient.metrics.report import fault_blocks

        blocks = fault_blocks(events)
        print("\n\n".join(blocks) if blocks else f"{path}: no faults")
        return 0
    rows = summarize(events)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"{path} — {len(events)} events, {len(rows)} faults")
    for col in ("gen", "kind", "origin", "step", "detect", "recover", "re-run", "outcome"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            str(r["generation"]),
            r["kind"],
            f"rank {r['origin_rank']}",
            str(r["step"]),
            f"{r['detect_s']:.2f} s",
            "—" if r["recover_s"] is None else f"{r['recover_s']:.3f} s",
            ("—" if r["steps_rerun"] is None else str(r["steps_rerun"]))
            + ("" if r.get("source") is None else f" ({r['source']})"),
            r["outcome"][:60],
        )
    Console().print(t)
    return 0


def _fault_table(rows: list[dict[str, Any]]) -> Any:
    """What each fault cost: detection, recovery, where the state came from, the steps re-run and
    the work they stood for, and whether the replay matched the run it replayed."""
    from rich.table import Table

    t = Table(title="what each fault cost")
    slurm = any(r.get("slurm") for r in rows)  # (a column only for runs under Slurm)
    for col in (
        "kind",
        "rank",
        *(["Slurm"] if slurm else []),
        "step",
        "detect s",
        "recover s",
        "state from",
        "re-run",
        "work lost s",
        "replay",
    ):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["kind"],
            str(r["rank"]),
            *([r.get("slurm") or "—"] if slurm else []),
            str(r["step"]),
            f"{r['detect_s']:.3f}",
            "—" if r["recover_s"] is None else f"{r['recover_s']:.3f}",
            r["source"] or "—",
            "—" if r["steps_rerun"] is None else str(r["steps_rerun"]),
            "—" if r["work_lost_s"] is None else f"{r['work_lost_s']:.3f}",
            r["replay"] or "—",
        )
    return t


def _log_or_exit(cmd: str, path: str) -> Path | None:
    from resilient.metrics.report import find_log

    log = find_log(path)
    if log is None:
        print(
            f"resilient {cmd}: no event log at {path} (a run directory, its events.jsonl, or the "
            "events directory holding runs)",
            file=sys.stderr,
        )
    return log


def cmd_report(args: argparse.Namespace) -> int:
    from resilient.metrics import account

    log = _log_or_exit("report", args.path)
    if log is None:
        return 2
    events = read_events(log)
    acc = account(events)
    if args.json:
        print(json.dumps(_report_json(log, events, acc), indent=2))
    else:
        _print_report(log, events, acc, faults=args.faults)
    if args.png == "":
        return 0
    return _write_report_png(acc, log, args.png, out=sys.stderr if args.json else sys.stdout)


# What --json gives of each fault besides its report row.
_INCIDENT_KEYS = (
    "kind",
    "rank",
    "step",
    "mode",
    "detect_s",
    "recover_s",
    "steps_rerun",
    "noticed_by",
    "signature",
)


def _report_json(log: Path, events: list[dict[str, Any]], acc: Accounting) -> dict[str, Any]:
    """The report as one JSON object: the accounting, and each fault's incident and report row."""
    from resilient.metrics.report import fault_rows, untracked_rows

    faults = [
        {**{k: getattr(i, k) for k in _INCIDENT_KEYS}, **row}
        for i, row in zip(acc.incidents, fault_rows(events, acc), strict=True)
    ]
    return {
        "log": str(log),
        "wall_s": acc.wall_s,
        "goodput": acc.goodput,
        "steps": acc.steps,
        "exact_steps": acc.exact_steps,
        "seconds": acc.seconds,
        "faults": faults,
        "untracked": untracked_rows(events),
    }


def _print_report(log: Path, events: list[dict[str, Any]], acc: Accounting, faults: bool) -> None:
    """The report as tables: wall time by cause, what each fault cost, the state a restart loses."""
    from rich.console import Console
    from rich.table import Table

    from resilient.metrics.report import fault_blocks, fault_rows, untracked_rows

    gp = "—" if acc.goodput is None else f"{acc.goodput:.2%}"
    t = Table(
        title=f"{log.parent.name}: {acc.wall_s:.1f} s, {acc.steps} steps, "
        f"{len(acc.incidents)} faults, goodput {gp}"
    )
    for col in ("cause", "seconds", "share"):
        t.add_column(col, justify="right" if col != "cause" else "left")
    for cause, sec, share in acc.table():
        t.add_row(cause, f"{sec:.3f}", f"{share:.2%}")
    Console().print(t)
    if acc.incidents:
        Console().print(_fault_table(fault_rows(events, acc)))
    _print_untracked(untracked_rows(events))
    if not acc.exact_steps:
        print("steps: from progress records (events.steps: true gives every step)")
    for block in fault_blocks(events, acc) if faults else []:
        print(block + "\n")


def _write_report_png(acc: Accounting, log: Path, png: str | None, out: TextIO) -> int:
    """The report's PNG at ``png`` (None: the run directory's goodput.png). Without matplotlib,
    only a PNG asked for by ``--png PATH`` fails the command: the default one is an extra."""
    from resilient.metrics.report import write_png

    path = Path(png) if png else log.parent / "goodput.png"
    try:
        write_png(acc, path, title=log.parent.name)
    except ImportError:
        if png is None:
            print("no goodput.png: the plot needs matplotlib (pip install 'resilient[metrics]')", file=out)
            return 0
        print(
            "resilient report: no PNG: matplotlib is not installed (pip install 'resilient[metrics]')",
            file=sys.stderr,
        )
        return 1
    except OSError as e:
        print(f"resilient report: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {path}", file=out)
    return 0


def _print_untracked(rows: list[dict[str, Any]]) -> None:
    """The ``untracked_state`` findings: what a restart of this run loses, and the line to add."""
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="state a restart loses (found in the first steps; docs/recovery.md)")
    for col in ("value", "type", "ranks", "the line that keeps it"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["type"], ",".join(str(x) for x in r["ranks"]), r["fix"])
    Console().print(t)


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from resilient.metrics.exporter import LogTail
    from resilient.metrics.report import heartbeats, status_table

    log = _log_or_exit("status", args.path)
    if log is None:
        return 2
    run_id = log.parent.name
    tail = LogTail(log)
    events = tail.poll()
    title = f"run {run_id} ({log})"
    if not args.follow:
        Console().print(status_table(events, heartbeats(run_id), title))
        return 0
    with (
        contextlib.suppress(KeyboardInterrupt),
        Live(status_table(events, heartbeats(run_id), title)) as live,
    ):
        while not _over(events):
            time.sleep(args.interval)
            events += tail.poll()
            live.update(status_table(events, heartbeats(run_id), title))
    return 0


def _over(events: list[dict[str, Any]]) -> bool:
    """Every rank that started has finished, or the launcher gave up."""
    started = {e["rank"] for e in events if e.get("event") == Event.RUN_STARTED}
    ended = {e["rank"] for e in events if e.get("event") in (Event.RUN_FINISHED, Event.RUN_PREEMPTED)}
    failed = any(e.get("event") == Event.RUN_FAILED for e in events)
    return failed or (bool(started) and started <= ended)


def cmd_plan(args: argparse.Namespace) -> int:
    from resilient.state import interval_planner as planner

    if (args.mtbf_h is None) == (args.gpus is None) or (args.gpus is None) != (args.gpu_mtbf_h is None):
        print("resilient plan: error: give --mtbf-h, or --gpus with --gpu-mtbf-h", file=sys.stderr)
        return 2
    mtbf = (
        args.mtbf_h * 3600.0
        if args.mtbf_h is not None
        else planner.mtbf_from_gpus(args.gpus, args.gpu_mtbf_h)
    )
    d, r = args.write_s, args.restart_s
    rows = [("Young", planner.young(d, mtbf)), ("Daly", planner.daly(d, mtbf))]
    print(f"MTBF {mtbf / 3600:.3f} h ({mtbf:.0f} s), checkpoint write {d:g} s, restart {r:g} s")
    for name, tau in rows:
        print(f"  {name:5s} interval {tau:10.1f} s   expected goodput {planner.goodput(tau, d, r, mtbf):.4f}")
    tau = rows[1][1]
    sim = planner.simulate(tau, d, r, mtbf, segments=args.segments, seed=args.seed)
    closed = planner.goodput(tau, d, r, mtbf)
    rel = abs(sim.goodput - closed) / closed
    print(
        f"  Monte-Carlo at Daly's interval: goodput {sim.goodput:.4f} over {sim.segments} segments, "
        f"{sim.failures} failures; |sim - closed form| = {100 * rel:.2f}% (tolerance {args.tolerance:g}%)"
    )
    return 0 if 100 * rel <= args.tolerance else 1


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """Every ``step-*`` entry under a directory, committed or not; with --verify, every file's
    size and xxh3. An entry that is not a valid checkpoint is listed with why (exit 1)."""
    from rich.console import Console
    from rich.table import Table

    from resilient.checkpoint.manifest import tmp_dirs

    root = Path(args.path)
    if not root.is_dir():
        print(f"resilient checkpoints: error: {root} is not a directory", file=sys.stderr)
        return 2
    t = Table(title=f"checkpoints in {root}")
    for col in ("directory", "world", "files", "own bytes", "sharded", "created", "verified"):
        t.add_column(col)
    why: list[str] = []  # each entry that is not a valid checkpoint, in full under the table
    uncommitted = {path.name for _step, _token, path in tmp_dirs(root)}
    for entry in sorted(p for p in root.iterdir() if p.name.startswith("step-")):
        cells, reason = _checkpoint_row(root, entry, uncommitted, verify=args.verify)
        t.add_row(entry.name, *cells)
        if reason is not None:
            why.append(f"{entry.name}: {reason}")
    Console(width=160).print(t)
    for line in why:
        print(line)
    return 1 if why else 0


_REJECTED = "✗ (below)"  # the verdict cell of an entry whose reason follows the table


def _checkpoint_row(
    root: Path, entry: Path, uncommitted: set[str], verify: bool
) -> tuple[list[str], str | None]:
    """One ``step-*`` entry's cells after its name, and why it is not a valid checkpoint (None: it
    is, or it is a save in progress or a quarantined one, which its verdict cell says)."""
    from resilient.checkpoint.manifest import MANIFEST, read_manifest, step_name
    from resilient.errors import CheckpointError

    name = entry.name
    if name in uncommitted:
        return [""] * 5 + ["uncommitted: a save in progress, or left by a writer that died"], None
    if ".rejected-" in name:
        return [""] * 5 + ["quarantined: it failed verification at a load"], None
    try:
        step = int(name.removeprefix("step-"))
    except ValueError:
        step = -1
    if not entry.is_dir() or step < 0 or name != step_name(step):
        return [""] * 5 + [_REJECTED], "not a checkpoint directory name: resume ignores it"
    try:
        m = read_manifest(entry / MANIFEST)
        if m.step != step:
            raise CheckpointError(f"{entry / MANIFEST}: says step {m.step}")
    except CheckpointError as e:
        return ["?"] * 5 + [_REJECTED], str(e)
    verdict, reason = _verify_checkpoint(root, m) if verify else ("—", None)
    own = sum(f.size for f in m.files() if f.path.startswith(name + "/"))
    return [
        str(m.world_size),
        str(len(m.files())),
        f"{own:,}",
        "yes" if m.sharded_files() else "no",
        _created(m.created),
        verdict,
    ], reason


def _verify_checkpoint(root: Path, m: Manifest) -> tuple[str, str | None]:
    """Every file of ``m`` against its size and xxh3: the verdict cell, and the first mismatch."""
    from resilient.checkpoint.reader import verify_file
    from resilient.errors import CheckpointError

    try:
        for f in m.files():
            verify_file(root, f)
    except CheckpointError as e:
        return _REJECTED, str(e)
    return "✓", None


def _created(stamp: float) -> str:
    """A manifest's creation time, or the raw value where it is no time this machine can show."""
    try:
        return datetime.datetime.fromtimestamp(stamp).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return f"? ({stamp!r})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # torchrun's own parser, extended (resilient/launcher/cli.py)
        from resilient.launcher.cli import main as launch

        return launch(argv[1:])
    p = argparse.ArgumentParser(
        prog="resilient", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="validate a config and print it with derived timeouts")
    c.add_argument("path", nargs="?", default=None)
    c.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. restart.max_recoveries=3"
    )
    c.set_defaults(fn=cmd_config)
    e = sub.add_parser("events", help="summarize a run's events.jsonl")
    e.add_argument("path", help="events.jsonl or the run directory holding it")
    e.add_argument("--json", action="store_true")
    e.add_argument("--faults", action="store_true", help="one block per fault: where, who noticed, stacks")
    e.set_defaults(fn=cmd_events)
    rp = sub.add_parser("report", help="goodput accounting by cause, from the event log (table and PNG)")
    rp.add_argument("path", help="a run directory, its events.jsonl, or the events directory (newest run)")
    rp.add_argument(
        "--png", default=None, help="where the PNG goes (default RUN_DIR/goodput.png; '' for none)"
    )
    rp.add_argument("--json", action="store_true")
    rp.add_argument("--faults", action="store_true", help="also print each fault's block")
    rp.set_defaults(fn=cmd_report)
    stp = sub.add_parser("status", help="a run's ranks, steps, heartbeats, faults and goodput")
    stp.add_argument("path", help="a run directory, its events.jsonl, or the events directory (newest run)")
    stp.add_argument("--follow", "-f", action="store_true", help="refresh until the run ends (Ctrl-C)")
    stp.add_argument("--interval", type=_positive, default=1.0, help="seconds between refreshes")
    stp.set_defaults(fn=cmd_status)
    pl = sub.add_parser("plan", help="optimal checkpoint interval (Young, Daly) and expected goodput")
    pl.add_argument("--mtbf-h", type=_positive, default=None, help="job mean time between failures, hours")
    pl.add_argument("--gpus", type=_count(1, 10**9), default=None, help="or: number of GPUs ...")
    pl.add_argument("--gpu-mtbf-h", type=_positive, default=None, help="... and one GPU's MTBF, hours")
    pl.add_argument("--write-s", type=_positive, required=True, help="checkpoint write (blocking) time, s")
    pl.add_argument("--restart-s", type=_nonnegative, required=True, help="restart time after a failure, s")
    pl.add_argument("--segments", type=_count(1, 10**7), default=20_000)
    pl.add_argument("--seed", type=_count(0, 2**32 - 1), default=0)
    pl.add_argument("--tolerance", type=_nonnegative, default=2.0, help="allowed simulation error, percent")
    pl.set_defaults(fn=cmd_plan)
    ck = sub.add_parser("checkpoints", help="list committed checkpoints; --verify checks every checksum")
    ck.add_argument("path", help="the checkpoint directory (checkpoint.dir)")
    ck.add_argument("--verify", action="store_true", help="read every file and check its xxh3")
    ck.set_defaults(fn=cmd_checkpoints)
    args = p.parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
