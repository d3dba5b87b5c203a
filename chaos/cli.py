"""``chaos`` command line: the recovery certificate, the injectors, fault plans.

chaos certify configs/chaos/cpu.yaml --out chaos_out [--classes sigkill,hang] [--trials N] [-- train.py ...]
chaos run configs/chaos/schedule.yaml --out chaos_run [-- train.py ...]
chaos stream configs/chaos/cpu.yaml --out chaos_stream [--faults N]
chaos soak configs/chaos/soak.yaml --out chaos_soak [--faults N] [--resume]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from chaos.faults import REGISTRY
from chaos.inject import Injector
from chaos.schedule import BadInput
from resilient.argtypes import count

# the subcommands that take a training command after ``--`` (instead of the config's ``job.command``)
_TAKE_COMMAND = ("certify", "run")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; ``command``: what follows the first ``--`` (the training script and its
    arguments), split off before parsing so that options may stand anywhere before it."""
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:
        at = words.index("--")
        words, command = words[:at], words[at + 1 :]
    p = argparse.ArgumentParser(prog="chaos", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("kinds", help="list the fault kinds: where each fires, what it needs, what it does")
    chk = sub.add_parser("check", help="parse a fault plan (kind@step[:rank][=arg][xN],...)")
    chk.add_argument("plan")
    after = "after the options, -- and a training script with its arguments replace the config's job.command"
    cert = sub.add_parser(
        "certify", help="run every fault class against its SLOs; exit 1 if any fails", epilog=after
    )
    cert.add_argument("config", type=Path)
    cert.add_argument("--out", type=Path, default=Path("chaos_out"))
    cert.add_argument("--classes", default="", help="comma-separated subset of the config's classes")
    cert.add_argument(
        "--trials", type=count(1, 10**4), default=None, help="override every class's trial count"
    )
    cert.add_argument(
        "--steps",
        type=count(4, 10**9),
        default=None,
        help="the job's length in steps, over the config's job.steps (your script's, with -- ...): "
        "a class's step given as '30%%' lands at that share of it",
    )
    run = sub.add_parser(
        "run", help="the config's `schedule:` of faults in one job, vs a fault-free run", epilog=after
    )
    run.add_argument("config", type=Path)
    run.add_argument("--out", type=Path, default=Path("chaos_run"))
    stream = sub.add_parser("stream", help="one long run with the config's stream of faults (goodput, soak)")
    stream.add_argument("config", type=Path)
    stream.add_argument("--out", type=Path, default=Path("chaos_stream"))
    stream.add_argument(
        "--faults", type=count(0, 10**5), default=None, help="override the stream's fault count"
    )
    soak = sub.add_parser("soak", help="many faults over the training stacks, many to a job (chaos/soak.py)")
    soak.add_argument("config", type=Path)
    soak.add_argument("--out", type=Path, default=Path("chaos_soak"))
    soak.add_argument(
        "--faults", type=count(1, 10**6), default=None, help="override the config's fault count"
    )
    soak.add_argument(
        "--resume", action="store_true", help="keep the jobs OUT/soak.json holds and go on after them"
    )
    args = p.parse_args(words)
    if command and args.cmd not in _TAKE_COMMAND:
        p.error(f"chaos {args.cmd} takes no training command after --: {' '.join(command)!r}")
    args.command = command
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if hasattr(args, "out"):
        # every job runs with its own directory as cwd: a relative --out would be resolved twice
        args.out = args.out.resolve()
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: every finally block runs, so the jobs,
    # network namespaces and cgroups a run made are removed
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        if args.cmd == "certify":
            return _certify(args)
        if args.cmd == "stream":
            return _stream(args)
        if args.cmd == "soak":
            return _soak(args)
        if args.cmd == "run":
            return _run(args)
        if args.cmd == "kinds":
            _kinds()
        else:
            try:
                faults = Injector.parse(args.plan).faults
            except ValueError as e:
                raise BadInput(f"argument plan: {e}") from None
            for f in faults:
                print(f)
    except BadInput as e:
        print(f"chaos {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _kinds() -> None:
    """One line per kind, its name first: ``chaos kinds | cut -d' ' -f1`` lists the names."""
    for name, k in REGISTRY.items():
        needs = f" (needs {', '.join(k.needs)})" if k.needs else ""
        print(f"{name:<19} {k.where.value:<18} {k.summary.replace('`', '')}{needs}")


def _with_command(cert: Any, command: list[str]) -> Any:
    """The training command after ``--`` replaces the config's, and runs where chaos was run (its
    relative paths as the user wrote them), not in the trial's directory."""
    if not command:
        return cert
    job = cert.job.model_copy(update={"command": list(command), "workdir": str(Path.cwd())})
    return cert.model_copy(update={"job": job})


def _certify(args: Any) -> int:
    from rich.console import Console

    from chaos import certify, report, schedule

    cert = schedule.load(args.config, steps=args.steps)
    cert = _with_command(cert, args.command)
    only = [c for c in args.classes.split(",") if c]
    unknown = [c for c in only if c not in cert.classes]
    if unknown:
        raise BadInput(f"--classes: {unknown} not in {args.config} (it has {sorted(cert.classes)})")
    if args.trials is not None:
        cert = cert.model_copy(update={"trials": args.trials})
        cert = cert.model_copy(
            update={"classes": {n: c.model_copy(update={"trials": None}) for n, c in cert.classes.items()}}
        )
    from chaos import results

    st = results.begin(trials=cert.trials, config=str(args.config), classes=only or sorted(cert.classes))
    trials = certify.certify(cert, args.out, only)
    rows = report.write(cert, trials, args.out, st, complete=not only or set(only) >= set(cert.classes))
    console = Console(width=max(120, Console().width))
    console.print(report.table(rows))
    for r in rows:
        for err in r["errors"]:
            console.print(f"[red]{r['class']}[/]: {err}")
    console.print(f"written: {args.out / 'certificate.json'}, {args.out / 'timeline.png'}")
    return 0 if all(not r["failed"] for r in rows) else 1


def _print_report(report: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    if report["faults"] and len(report["faults"]) <= 40:  # one row per fault (`chaos run`)
        tb = Table(title="faults")
        for col in ("kind", "rank", "step", "detected by", "detect s", "recover s"):
            tb.add_column(col)
        for f in report["faults"]:
            fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
            tb.add_row(
                f["kind"],
                str(f["rank"]),
                str(f["step"]),
                f["detected_by"] or "[red]not detected[/]",
                fmt(f["detect_s"]),
                fmt(f["recover_s"]),
            )
        console.print(tb)
    kinds = Table(title="per kind")
    for col in ("kind", "injected", "detected", "recovered"):
        kinds.add_column(col)
    for k, v in sorted(report["by_kind"].items()):
        kinds.add_row(k, str(v["injected"]), str(v["detected"]), str(v["recovered"]))
    console.print(kinds)
    tb = Table(title=title)
    tb.add_column("figure")
    tb.add_column("value")
    for k, v in report.items():
        if k not in ("faults", "by_kind", "accounting"):
            tb.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(tb)
    acc = report.get("accounting")
    if acc:  # resilient.metrics' accounting of the same log (`resilient report`)
        ta = Table(title=f"wall time by cause ({acc['wall_s']:.1f} s from the launch)")
        for col in ("cause", "seconds", "share"):
            ta.add_column(col)
        for cause, sec in acc["seconds"].items():
            ta.add_row(cause, f"{sec:.2f}", f"{sec / acc['wall_s']:.2%}" if acc["wall_s"] else "—")
        console.print(ta)


def _stream(args: Any) -> int:

    from chaos import schedule, stream

    cert = schedule.load(args.config)
    if cert.stream is None:
        raise BadInput(f"{args.config}: no `stream:` section")
    if args.faults is not None:
        cert = cert.model_copy(update={"stream": cert.stream.model_copy(update={"faults": args.faults})})
    from chaos import results

    stamp = results.begin(config=str(args.config), faults=args.faults)
    report = stream.run(cert, args.out)
    results.write(args.out / "stream.json", report, stamp)
    st = cert.stream
    assert st is not None
    how = " on average" if st.random else ""
    _print_report(report, f"fault stream: one fault every {st.mtbf_s:g} s{how}")
    return 0 if not report["failed"] else 1


def _soak(args: Any) -> int:
    import json

    from pydantic import ValidationError

    from chaos import soak

    try:
        spec = soak.load(args.config)
    except (OSError, ValidationError) as e:
        raise BadInput(f"{args.config}: {e}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    report = soak.run(spec, args.out, args.faults, args.resume)  # (soak.json written, stamped)
    soak.picture(report, args.out / "soak.png")
    brief = {k: v for k, v in report.items() if k != "per_job"}
    print(json.dumps(brief, indent=1))
    return 0 if not report["failed"] else 1


def _run(args: Any) -> int:

    from chaos import schedule, stream

    cert = schedule.load(args.config)
    if not cert.schedule:
        raise BadInput(f"{args.config}: no `schedule:` list of faults")
    cert = _with_command(cert, args.command)
    from chaos import results

    st = results.begin(config=str(args.config))
    report = stream.run_schedule(cert, args.out, list(cert.schedule))
    report["failed"] = stream.verdict(report, None, True)  # the final state must equal the reference
    results.write(args.out / "run.json", report, st)
    _print_report(report, f"chaos run: {len(cert.schedule)} faults")
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
