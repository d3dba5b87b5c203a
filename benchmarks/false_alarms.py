"""No stall without a fault: a fault-free 3-rank job, run again and again, never takes the hang path.

Each run is ``resilient launch --standalone --nproc-per-node 3`` of the DDP tutorial's loop
(``examples/train_ddp_epochs.py``: DataLoader + DistributedSampler, dropout, ~5 ms steps, a
checkpoint every 10 steps) with ``hang_timeout`` 5 s, in a directory of its own. Nothing is
injected. From each run's event log: any ``fault_detected`` (a false alarm: the job rolled back),
any ``peer_wait`` (a step check that waited ≥ 1 s on a peer: a stall short of a hang), the
longest gap between two checkpoints of one rank (10 steps apart), the steps every rank finished,
and the exit code.

``--names torch`` runs the same jobs with torch's reverse lookups of socket addresses left on
(``RESILIENT_STORE_NAME_LOOKUPS=1``): the stalls of docs/control-plane.md#no-stall-without-a-fault.

    python benchmarks/false_alarms.py [--runs 50] [--names numeric|torch] [--epochs 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def one_run(i: int, args: argparse.Namespace) -> dict[str, Any]:
    from resilient.events import Event

    with tempfile.TemporaryDirectory(prefix=f"false-alarms-{i}-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.names == "torch":
            env["RESILIENT_STORE_NAME_LOOKUPS"] = "1"
        cmd = [sys.executable, "-m", "resilient.cli", "launch", "--standalone", "--nproc-per-node", "3",
               str(ROOT / "examples" / "train_ddp_epochs.py"), "--epochs", str(args.epochs),
               "--size", str(args.size), "--batch", "8", "--hang-timeout", "5",
               "--ckpt-dir", "ck"]  # fmt: skip
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - t0
        logs = list(Path(tmp, "resilient_runs").glob("*/events.jsonl"))
        evs = [json.loads(line) for f in logs for line in f.read_text().splitlines() if line.strip()]
    saves: dict[int, list[float]] = {}  # (a checkpoint every 10 steps: a stall shows as a gap)
    for e in evs:
        if e.get("event") == Event.CHECKPOINT_SAVED and e.get("rank", -1) >= 0:
            saves.setdefault(e["rank"], []).append(e["ts"])
    gaps = [b - a for ts in saves.values() for a, b in itertools.pairwise(ts)]
    done = [e.get("steps_completed", 0) for e in evs if e.get("event") == Event.RUN_FINISHED]
    faults = [e for e in evs if e.get("event") == Event.FAULT_DETECTED]
    waits = [e for e in evs if e.get("event") == Event.PEER_WAIT]
    return {
        "run": i, "rc": p.returncode, "wall_s": round(wall, 2),
        "steps": min(done) if len(done) == 3 else 0,
        "fault_detected": len(faults), "peer_wait": len(waits),
        "max_gap_s": round(max(gaps, default=0.0), 3),
        "faults": [f.get("local") or f.get("message") for f in faults][:3],
        "stderr": p.stderr[-800:] if p.returncode else "",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--names", choices=("numeric", "torch"), default="numeric")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--size", type=int, default=3072, help="samples (3 ranks × batch 8: 128 steps an epoch)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "false_alarms.json")
    args = ap.parse_args()
    from chaos import results

    st = results.begin(trials=args.runs)
    rows = []
    for i in range(args.runs):
        r = one_run(i, args)
        rows.append(r)
        print(f"run {i:3d}: rc={r['rc']} steps={r['steps']} wall={r['wall_s']:.1f}s "
              f"max_gap={r['max_gap_s']:.3f}s fault_detected={r['fault_detected']} "
              f"peer_wait={r['peer_wait']} {r['faults'] or ''}", flush=True)  # fmt: skip
    alarms = sum(r["fault_detected"] > 0 for r in rows)
    failed = sum(r["rc"] != 0 or r["steps"] == 0 for r in rows)
    gaps = [r["max_gap_s"] for r in rows]
    print(f"\nnames={args.names}: {len(rows)} runs, {alarms} with a fault_detected, "
          f"{sum(r['peer_wait'] > 0 for r in rows)} with a peer_wait, {failed} not exiting 0; "
          f"longest gap between checkpoints per run: median {statistics.median(gaps):.3f} s, "
          f"max {max(gaps):.3f} s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, st)
    sys.exit(1 if alarms or failed else 0)


if __name__ == "__main__":
    main()
