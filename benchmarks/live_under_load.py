"""The README's first example, run as written, again and again beside a busy loop on every core:
how often a soft fault still resumes live (0 steps re-run), and what it costs when it does not.

Each trial is a fresh ``resilient launch --standalone --nproc-per-node 2 --fault exception@12:1
examples/train_tiny.py --steps 40`` in a directory of its own; its event log says where the
restore came from (``restore_agreed``: ``live``, or the snapshot and each rank's
``live_refused``), how many steps were re-run, and the recovery's figures. The busy loops (one
per core, ``--hogs``) run through every trial; their load average is recorded before and after.

    python benchmarks/live_under_load.py [--trials 10] [--hogs 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [
    "--standalone",
    "--nproc-per-node",
    "2",
    "--fault",
    "exception@12:1",
    "examples/train_tiny.py",
    "--steps",
    "40",
]


def _hogs(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` busy loops (each one core's worth of work), ended by the caller."""
    loop = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]


def trial(where: Path) -> dict[str, object]:
    """One run of the README's example in ``where``: its exit code and what its events say."""
    from resilient.events import read_events

    (where / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    rc = subprocess.run(
        [sys.executable, "-m", "resilient.cli", "launch", *COMMAND],
        cwd=where,
        env=env,
        capture_output=True,
        timeout=300,
    ).returncode
    wall = time.monotonic() - t0
    (log,) = (where / "resilient_runs").glob("*/events.jsonl")
    evs = list(read_events(log))
    agreed = [e for e in evs if e["event"] == "restore_agreed"]
    restored = [e for e in evs if e["event"] == "state_restored"]
    return {
        "rc": rc,
        "wall_s": wall,
        "sources": sorted({str(e.get("source")) for e in agreed}),
        "restored_step": sorted({e["step"] for e in restored}),
        "steps_rerun": max((int(e.get("steps_rerun") or 0) for e in restored), default=None),
        "recovery_s": max((float(e["duration_s"]) for e in agreed if "duration_s" in e), default=None),
        "live_refused": next((e["live_refused"] for e in agreed if e.get("live_refused")), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "live_under_load.json")
    a = ap.parse_args()
    from chaos import results

    st = results.begin(trials=a.trials)
    load_before = os.getloadavg()
    hogs = _hogs(a.hogs)
    trials = []
    try:
        time.sleep(2)  # (the loops reach full speed before the first trial: a fixed warm-up, not an event)
        for k in range(a.trials):
            with tempfile.TemporaryDirectory(prefix="live-load-") as d:
                t = trial(Path(d))
            print(f"trial {k + 1}: {t}", flush=True)
            trials.append(t)
    finally:
        load_during = os.getloadavg()
        for h in hogs:
            h.kill()
            h.wait()
    live = sum(t["rc"] == 0 and t["sources"] == ["live"] and t["steps_rerun"] == 0 for t in trials)
    report = {
        "command": "resilient launch " + " ".join(COMMAND),
        "live": live,
        "trials": len(trials),
        "finished": sum(t["rc"] == 0 for t in trials),
        "hogs": a.hogs,
        "load_before": load_before,
        "load_during": load_during,
        "per_trial": trials,
    }
    results.write(a.out, report, st)
    print(
        f"live {live}/{len(trials)} beside {a.hogs} busy loops (load {load_during[0]:.1f}); written: {a.out}"
    )


if __name__ == "__main__":
    main()
