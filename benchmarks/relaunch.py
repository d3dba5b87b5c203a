"""SIGKILL of a worker → first step completed after it came back, with a ~1 GB state, side by side:

- replace: `resilient launch` (``--replace rank --standby 1``, the default): a warm standby, parked
  in the worker's ``resilient.wrap`` call with its model already built (the worker builds it at its
  top level, which needs no rank), takes the dead rank's place and restores the shared-memory
  snapshot its predecessor left;
- ours: `resilient launch --replace group`; the relaunched worker restores from the shared-memory
  snapshot the launcher kept (snapshot every 5 steps);
- peer: `torchrun --max-restarts 1`; the worker torch.save+fsyncs every 5 steps and torch.loads
  the file when it starts (the usual path);
- floor: `torchrun --max-restarts 1` with no state at all: the relaunched worker starts over at
  step 0. What every path pays (detection, process start, imports, the worker building its model
  and taking a warm-up step); each path's own restore cost is its time minus this floor.

Same worker (benchmarks/relaunch_worker.py), same kill point (the first process, after step
--kill-after), alternating trials. Recovery = the driver's time of the first step a new process
completes minus the time it sent SIGKILL; ``restore_s`` = that first step's time minus the time the
new process had built its model, minus a steady step: what bringing the state back costs. A trial
with no step within --timeout counts as never recovered.

    python benchmarks/relaunch.py [--trials 20] [--gb 1.0] [--cold]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos import results

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "benchmarks" / "relaunch_worker.py")
MODES = ("replace", "resilient", "torchrun", "floor")


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trial(
    mode: str, cwd: Path, gb: float, timeout: float, kill_after: int, cold: bool = False
) -> dict[str, Any]:
    cwd.mkdir(parents=True)
    progress = cwd / "progress.jsonl"
    common = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1"]
    work = [WORKER, "--gb", str(gb), "--progress", str(progress)]
    if mode in ("resilient", "replace"):
        how = ["--replace", "group"] if mode == "resilient" else ["--replace", "rank", "--standby", "1"]
        cmd = [sys.executable, "-m", "resilient.cli", "launch", *common, *how, *work, "--mode", "resilient"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *common, *work, "--mode", "plain"]
        if mode == "torchrun":
            cmd += ["--ckpt", str(cwd / "ck.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(cwd / "launch.log", "w") as log:
        p = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    out: dict[str, Any] = {"mode": mode, "recovered": False}
    try:
        deadline = time.monotonic() + timeout
        victim = None
        while time.monotonic() < deadline and victim is None:  # polls a file another process appends
            lines = _lines(progress)
            first = lines[0]["pid"] if lines else None
            done = [x for x in lines if x["pid"] == first and x.get("step", -1) >= kill_after]
            victim = done[0] if done else None
            time.sleep(0.01)
        if victim is None:
            out["error"] = "never reached the kill point"
            return out
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        if cold:  # the relaunch finds nothing in the page cache (a rebooted or replacement node)
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = _lines(progress)
            after = [x for x in lines if x["pid"] != victim["pid"] and "step" in x]
            if after:
                built = [x["t"] for x in lines if x["pid"] == after[0]["pid"] and x.get("built")]
                mine = sorted(x["t"] for x in lines if x["pid"] == victim["pid"] and "step" in x)
                step_s = statistics.median(b - a for a, b in itertools.pairwise(mine))
                # (a parked standby built its model before the kill: the restore counts from the kill)
                ready = max(built[0], t_kill) if built else None
                out.update(recovered=True, recovery_s=after[0]["t"] - t_kill, resumed_at=after[0]["step"],
                           killed_after=victim["step"], step_s=step_s,
                           built_before_kill=bool(built) and built[0] < t_kill,
                           restore_s=after[0]["t"] - ready - step_s if ready else None)  # fmt: skip
                break
            time.sleep(0.01)
        return out  # measured: the rest of the run does not matter (the job is killed below)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        for x in _lines(progress):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(x["pid"], signal.SIGKILL)
        p.wait()
        # a SIGKILLed launcher leaves its shared-memory snapshots (2 GB here) and heartbeat files
        for leftover in Path("/dev/shm").glob(f"resilient-*-{p.pid}"):
            shutil.rmtree(leftover, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--kill-after",
        type=int,
        default=15,
        help="the step after which the first process is killed (late enough for the standby to be warm)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache right after the kill (root): the checkpoint file must come from "
        "disk, as on a rebooted or replacement node (/dev/shm is not dropped: it is memory)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "relaunch.json")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    st = results.begin(trials=args.trials)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        for t in range(args.trials):
            for mode in modes:
                r = trial(mode, Path(d) / f"{mode}{t}", args.gb, args.timeout, args.kill_after, args.cold)
                rows.append(r)
                print(json.dumps(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, rows, st)
    medians = {}
    for mode in modes:
        rec = sorted(r["recovery_s"] for r in rows if r["mode"] == mode and r["recovered"])
        n = sum(r["mode"] == mode for r in rows)
        if not rec:
            print(f"{mode:10s} recovered 0/{n}")
            continue
        medians[mode] = statistics.median(rec)
        p99 = rec[min(len(rec) - 1, round(0.99 * (len(rec) - 1)))]
        print(f"{mode:10s} recovered {len(rec)}/{n}  median {medians[mode]:.2f} s  p99 {p99:.2f} s")
    if "torchrun" in medians:
        for ours in [m for m in ("replace", "resilient") if m in medians]:
            print(f"torchrun / {ours} (medians): {medians['torchrun'] / medians[ours]:.2f}x")
    if medians:
        for mode in modes:
            rs = [r["restore_s"] for r in rows if r["mode"] == mode and r.get("restore_s") is not None]
            if rs:
                print(f"{mode:10s} restore after its model was built (median): {statistics.median(rs):.2f} s")


if __name__ == "__main__":
    main()
