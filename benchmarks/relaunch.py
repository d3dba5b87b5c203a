"""SIGKILL of a worker → first step completed after the relaunch, with a ~1 GB state, side by side:

- ours: `resilient launch`; the relaunched worker restores from the shared-memory snapshot the
  launcher kept (snapshot every 5 steps);
- peer: `torchrun --max-restarts 1`; the worker torch.save+fsyncs every 5 steps and torch.loads
  the file when it starts (the usual path);
- floor: `torchrun --max-restarts 1` with no state at all: the relaunched worker starts over at
  step 0. What every path pays (detection, process start, imports, the worker building its model
  and taking a warm-up step); each path's own restore cost is its time minus this floor.

Same worker (benchmarks/relaunch_worker.py), same kill point (attempt 0 after step 7), alternating
trials. Recovery = the driver's time of the first step the relaunched worker completes minus the
time it sent SIGKILL. A trial with no step within --timeout counts as never recovered.

    python benchmarks/relaunch.py [--trials 20] [--gb 1.0] [--cold]
"""

from __future__ import annotations

import argparse
import contextlib
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

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "benchmarks" / "relaunch_worker.py")
KILL_AFTER = 7
MODES = ("resilient", "torchrun", "floor")


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trial(mode: str, cwd: Path, gb: float, timeout: float, cold: bool = False) -> dict[str, Any]:
    cwd.mkdir(parents=True)
    progress = cwd / "progress.jsonl"
    common = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1"]
    work = [WORKER, "--gb", str(gb), "--progress", str(progress)]
    if mode == "resilient":
        cmd = [sys.executable, "-m", "resilient.cli", "launch", *common, *work, "--mode", "resilient"]
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
            done = [x for x in _lines(progress) if x["attempt"] == 0 and x["step"] >= KILL_AFTER]
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
            after = [x for x in _lines(progress) if x["attempt"] == 1]
            if after:
                out.update(recovered=True, recovery_s=after[0]["t"] - t_kill, resumed_at=after[0]["step"],
                           killed_after=victim["step"])  # fmt: skip
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
        "--cold",
        action="store_true",
        help="drop the page cache right after the kill (root): the checkpoint file must come from "
        "disk, as on a rebooted or replacement node (/dev/shm is not dropped: it is memory)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "relaunch.json")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        for t in range(args.trials):
            for mode in MODES:
                r = trial(mode, Path(d) / f"{mode}{t}", args.gb, args.timeout, args.cold)
                results.append(r)
                print(json.dumps(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    medians = {}
    for mode in MODES:
        rec = sorted(r["recovery_s"] for r in results if r["mode"] == mode and r["recovered"])
        n = sum(r["mode"] == mode for r in results)
        if not rec:
            print(f"{mode:10s} recovered 0/{n}")
            continue
        medians[mode] = statistics.median(rec)
        p99 = rec[min(len(rec) - 1, round(0.99 * (len(rec) - 1)))]
        print(f"{mode:10s} recovered {len(rec)}/{n}  median {medians[mode]:.2f} s  p99 {p99:.2f} s")
    if len(medians) == 3:
        print(f"torchrun / ours (medians): {medians['torchrun'] / medians['resilient']:.2f}x")
        ours, theirs = medians["resilient"] - medians["floor"], medians["torchrun"] - medians["floor"]
        print(f"restore cost above the floor (medians): ours {ours:.2f} s, torchrun {theirs:.2f} s")


if __name__ == "__main__":
    main()
