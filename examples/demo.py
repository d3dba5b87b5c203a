"""The main job: the bundled example under injected faults, checked against a fault-free run.

Runs examples/train_tiny.py on 2 gloo ranks under torchrun twice — once fault-free, once with a
real exception, a real `time.sleep(3600)` hang and a real allocation failure injected — then
prints, from the runs' event logs, what was detected, how long recovery took, and whether the
final parameters and optimizer state equal the fault-free run's bit for bit.

    python examples/demo.py [--nproc 2] [--steps 48]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from chaos.compare import assert_bit_exact
from resilient.cli import summarize
from resilient.events import read_events

HERE = Path(__file__).resolve().parent
console = Console(width=120)


def torchrun(workdir: Path, run_id: str, nproc: int, *args: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / "train_tiny.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_RUN_ID": run_id}
    t0 = time.monotonic()
    with open(workdir / f"{run_id}.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600
        ).returncode
    if rc != 0:
        console.print((workdir / f"{run_id}.log").read_text()[-4000:])
        raise SystemExit(f"{run_id} run failed with exit code {rc}")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--hang-timeout", type=float, default=2.0)
    args = ap.parse_args()
    s = args.steps
    plan = f"exception@{s // 4}:1,hang@{s // 2}:0,oom@{3 * s // 4}:{args.nproc - 1}"
    common = ["--steps", str(s), "--hang-timeout", str(args.hang_timeout)]
    with tempfile.TemporaryDirectory(prefix="resilient-demo-") as d:
        work = Path(d)
        console.print(f"[bold]fault-free reference[/]: {args.nproc} ranks, {s} steps")
        t_ref = torchrun(work, "reference", args.nproc, *common, "--out", "ref")
        console.print(f"[bold]with faults[/]: {plan}")
        t_hit = torchrun(work, "faulted", args.nproc, *common, "--out", "hit", "--fault", plan)
        events = read_events(work / "resilient_runs" / "faulted" / "events.jsonl")

        table = Table(title="faults injected → detected → recovered (from the event log)")
        for col in (
            "gen",
            "fault",
            "origin",
            "step",
            "detected after",
            "recovered in",
            "steps re-run",
            "processes",
        ):
            table.add_column(col)
        alive = len({(e["rank"], e["pid"]) for e in events}) == args.nproc
        for row in summarize(events):
            table.add_row(
                str(row["generation"]),
                row["kind"],
                f"rank {row['origin_rank']}",
                str(row["step"]),
                f"{row['detect_s']:.2f} s" if row["detect_s"] else "at once (raised)",
                "—" if row["recover_s"] is None else f"{row['recover_s']:.3f} s",
                str(row["steps_rerun"]),
                "all alive" if alive else "some replaced",
            )
        console.print(table)

        n = 0
        ok = True
        for r in range(args.nproc):
            a = torch.load(work / "ref" / f"rank{r}.pt", weights_only=True)
            b = torch.load(work / "hit" / f"rank{r}.pt", weights_only=True)
            try:
                n += assert_bit_exact(a["model"], b["model"]) + assert_bit_exact(
                    a["optimizer"], b["optimizer"]
                )
            except AssertionError:
                ok = False
        verdict = "[green]✓ identical[/]" if ok else "[red]✗ DIFFERENT[/]"
        console.print(
            f"final parameters + optimizer state vs fault-free run: {verdict} ({n} tensors, bit for bit)"
        )
        console.print(
            f"wall time: reference {t_ref:.1f} s, with faults {t_hit:.1f} s; events: "
            f"{len(events)} records in resilient_runs/faulted/events.jsonl"
        )
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
