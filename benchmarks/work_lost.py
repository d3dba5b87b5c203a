"""What one soft fault costs a run, all of it: detection + recovery + the work replayed, with live
resume (runtime/steps/live.py) and without it (the ring: ``snapshot.live: false``), side by side
in one run, on the bundled example (DDP over gloo, steps padded to ``--step-ms``).

Per trial, from the event log (``events.steps: true``): the fault's detection (the origin's
latency), the recovery (the fault to every rank's first step after it), the steps re-run, and the
*training lost*: from the moment the faulted step first began (its predecessor completed) to the
moment every rank begins it again (live: the restore; the ring: the replayed predecessor
completed). That last figure is what a fault costs the run; the first two are parts of it.

    python benchmarks/work_lost.py [--trials 2] [--nproc 2 4] [--step-ms 25] [--fault-step 90]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import results  # noqa: E402
from chaos.harness import run_ranks  # noqa: E402
from resilient.events import Event  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_tiny.py")


def lost(evs: list[dict[str, Any]], nproc: int) -> dict[str, Any]:
    """The figures of the run's first fault (see the module docstring)."""
    primary = next(e for e in evs if e["event"] == Event.FAULT_DETECTED)
    gen, f = primary["generation"], primary["origin_step"]
    done = [e for e in evs if e["event"] == Event.STEP_COMPLETED]
    began = max(e["ts"] for e in done if e["generation"] == gen and e["step"] == f - 1)
    restored = [e for e in evs if e["event"] == Event.STATE_RESTORED and e["generation"] == gen + 1]
    again = []
    for r in range(nproc):
        mine = next(e for e in restored if e["rank"] == r)
        if mine["step"] >= f:
            again.append(mine["ts"])
        else:
            again.append(
                min(
                    e["ts"]
                    for e in done
                    if e["generation"] == gen + 1 and e["rank"] == r and e["step"] == f - 1
                )
            )
    resumed = [e["ts"] for e in evs if e["event"] == Event.STEP_RESUMED and e["generation"] == gen + 1]
    return {
        "detect_s": primary.get("origin_latency_s", 0.0),
        "recover_s": max(resumed) - primary["origin_ts"],
        "steps_rerun": max(e["steps_rerun"] for e in restored),
        "source": "+".join(sorted({e["source"] for e in restored})),
        "training_lost_s": max(again) - began,
    }


def trials(mode: str, fault: str, nproc: int, n: int, step_ms: float, fault_step: int) -> dict[str, Any]:
    rows = []
    for t in range(n):
        with tempfile.TemporaryDirectory() as d:
            cfg = Path(d) / "cfg.yaml"
            cfg.write_text(json.dumps({"snapshot": {"live": mode == "live"}, "events": {"steps": True},
                                       "hang_timeout": 3}))  # fmt: skip
            rank = 0 if fault == "hang" else nproc - 1
            res = run_ranks(
                [EXAMPLE, "--steps", str(fault_step + 30), "--step-ms", str(step_ms), "--config", str(cfg),
                 "--fault", f"{fault}@{fault_step}:{rank}"],
                nproc, cwd=Path(d), run_id=f"{mode}{fault}{nproc}{t}", timeout=300,
            )  # fmt: skip
            if not res.ok:
                raise SystemExit(res.describe())
            rows.append(lost(res.events, nproc))
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in ("detect_s", "recover_s", "steps_rerun", "training_lost_s")
    }
    return {"mode": mode, "fault": fault, "nproc": nproc, **med, "source": rows[0]["source"], "trials": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--fault-step", type=int, default=90)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "work_lost.json")
    a = ap.parse_args()
    st = results.begin(trials=a.trials)
    rows = []
    head = ("fault", "ranks", "state", "detect s", "recover s", "re-run", "lost s")
    print(f"{head[0]:10s} {head[1]:>5s} {head[2]:5s} " + " ".join(f"{h:>9s}" for h in head[3:]))
    for fault in ("exception", "hang"):
        for nproc in a.nproc:
            for mode in ("live", "ring"):  # (side by side: the same machine, minutes apart)
                r = trials(mode, fault, nproc, a.trials, a.step_ms, a.fault_step)
                rows.append(r)
                print(f"{fault:10s} {nproc:5d} {r['source']:5s} {r['detect_s']:9.3f} {r['recover_s']:9.3f} "
                      f"{r['steps_rerun']:9.0f} {r['training_lost_s']:9.3f}", flush=True)  # fmt: skip
    results.write(a.out, {"step_ms": a.step_ms, "fault_step": a.fault_step, "results": rows}, st)


if __name__ == "__main__":
    main()
