"""What the buddy copy costs a fault-free FSDP2 job: step time with ``snapshot.buddy`` on and off,
side by side in one run, and the bytes each rank sends per copy.

Per run: one c10d rendezvous on 127.0.0.1, two `resilient launch` agents of one rank each (two
nodes, no spare) run examples/train_fsdp2.py (FSDP2, gloo; ``--dim``/``--layers`` set its size)
for ``--steps`` steps, a snapshot mirrored every step (``--interval 1``: what a job that wants a
lost node to re-run at most one step sets), or at the interval ``snapshot.interval: auto`` plans
within ``--max-overhead`` (it measures the copy as if it were on the critical path). Runs
alternate ABBA (on, off, off, on) so that a slow minute of the machine hits both alike. A run's
step time is the wall time between its ``step_completed`` events of step ``--warmup`` and of the
last step, over the steps between (snapshots, mirrors and waits included), the slower rank's.
The copy's own figures come from each rank's ``run_finished`` ``buddy``: copies sent, bytes per
copy, seconds per copy in the sender thread, and the mirror's waits for it (the part on the
step's critical path).

    python benchmarks/buddy_overhead.py [--pairs 3] [--dim 256] [--layers 4] [--steps 80]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lost_node import RDZV_FAST, Node  # noqa: E402

from chaos import results  # noqa: E402
from chaos.harness import free_port  # noqa: E402
from resilient.events import Event  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_fsdp2.py")


def run(buddy: bool, cwd: Path, args: argparse.Namespace) -> dict[str, Any]:
    cwd.mkdir(parents=True)
    cfg = cwd / "cfg.yaml"
    interval = int(args.interval) if args.interval.isdigit() else args.interval
    snapshot = {"interval": interval, "buddy": buddy, "max_overhead": args.max_overhead}
    sections = {"events": {"steps": True}, "snapshot": snapshot}
    cfg.write_text(yaml.safe_dump(sections))
    argv = [
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"),
        *("--rdzv-id", f"buddy{os.getpid()}{cwd.name}", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--monitor-interval", "0.2", "--rdzv-conf", RDZV_FAST, "--standby", "0"),
        *(EXAMPLE, "--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers)),
        *("--config", str(cfg)),
    ]
    nodes = [Node(cwd / f"node{i}", argv) for i in range(2)]
    deadline = time.monotonic() + args.timeout
    try:
        for n in nodes:
            n.p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for n in nodes:
            if n.p.poll() is None:
                n.kill("buddy")
    events = [e for n in nodes for e in n.events()]
    per_rank = []
    for rank in (0, 1):
        ts = {
            e["step"]: e["ts"]
            for e in events
            if e["event"] == Event.STEP_COMPLETED and e["rank"] == rank and e["step"] >= args.warmup
        }
        per_rank.append((ts[max(ts)] - ts[min(ts)]) / (max(ts) - min(ts)))
    finished = [e for e in events if e["event"] == Event.RUN_FINISHED]
    codes = [n.p.returncode for n in nodes]
    if codes != [0, 0] or len(finished) != 2:
        raise RuntimeError(f"{cwd.name}: agents exited {codes}, {len(finished)} ranks finished")
    return {
        "buddy": buddy,
        "step_s": max(per_rank),
        "copies": [e.get("buddy") for e in sorted(finished, key=lambda e: e["rank"])],
        "mirror_interval": finished[0].get("mirror_interval"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="ABBA pairs (each: two runs on, two off)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--interval", default="1", help="snapshot.interval: N, or auto (the planner's)")
    ap.add_argument("--max-overhead", type=float, default=0.002, help="snapshot.max_overhead (auto's budget)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "buddy_overhead.json")
    args = ap.parse_args()
    st = results.begin(pairs=args.pairs)
    load0 = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        for p in range(args.pairs):
            for i, on in enumerate((True, False, False, True)):
                r = run(on, Path(d) / f"p{p}-{i}-{'on' if on else 'off'}", args)
                runs.append(r)
                print(json.dumps(r), flush=True)
    ratios = []
    for p in range(args.pairs):
        quad = runs[4 * p : 4 * p + 4]
        on = statistics.mean(r["step_s"] for r in quad if r["buddy"])
        off = statistics.mean(r["step_s"] for r in quad if not r["buddy"])
        ratios.append(on / off - 1.0)
    copies = [c for r in runs if r["buddy"] for c in r["copies"] if c]
    summary = {
        "args": vars(args) | {"out": args.out.name},
        "load_before": load0,
        "load_after": os.getloadavg()[0],
        "step_s_on": statistics.median(r["step_s"] for r in runs if r["buddy"]),
        "step_s_off": statistics.median(r["step_s"] for r in runs if not r["buddy"]),
        "overhead_by_pair": ratios,
        "overhead_median": statistics.median(ratios),
        "bytes_per_copy": statistics.median([c["bytes_per_copy"] for c in copies] or [0]),
        "copies_per_run": statistics.median([c["sent"] for c in copies] or [0]),
        "send_s_per_copy": statistics.median([c["send_s_per_copy"] or 0.0 for c in copies] or [0.0]),
        "waited_s_per_run": statistics.median([c["waited_s"] for c in copies] or [0.0]),
        "mirror_interval_on": sorted({r["mirror_interval"] for r in runs if r["buddy"]}),
        "mirror_interval_off": sorted({r["mirror_interval"] for r in runs if not r["buddy"]}),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, summary, st)
    by_pair = ", ".join(f"{100 * x:+.2f}%" for x in ratios)
    on_ms, off_ms = summary["step_s_on"] * 1e3, summary["step_s_off"] * 1e3
    print(
        f"step on {on_ms:.1f} ms, off {off_ms:.1f} ms: overhead {100 * summary['overhead_median']:+.2f}% "
        f"(by pair: {by_pair}); {summary['bytes_per_copy'] / 1e6:.2f} MB a copy per rank, "
        f"{summary['send_s_per_copy'] * 1e3:.1f} ms to send it, mirror waited "
        f"{summary['waited_s_per_run'] * 1e3:.1f} ms a run; mirror interval on "
        f"{summary['mirror_interval_on']}, off {summary['mirror_interval_off']}; load {load0:.2f} -> "
        f"{summary['load_after']:.2f}"
    )


if __name__ == "__main__":
    main()
