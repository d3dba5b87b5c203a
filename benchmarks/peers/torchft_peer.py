"""torchft 0.2.0 as a peer: SIGKILL of one replica group's worker → both groups committing again.

torchft keeps the surviving replica groups training and lets the dead group re-join and heal from
a survivor; a dead rank costs its whole replica group. Set-up (all local, gloo): the Lighthouse
(``torchft_lighthouse``, the binary in torchft's wheel), two replica groups of one rank, each a
``torchrun --max-restarts 3`` of benchmarks/peers/torchft_worker.py. Group 1's worker is SIGKILLed
after it commits step ``kill_at``; torchrun relaunches it, it re-joins the quorum and heals.

Measured from the committed-step lines (same host clock): ``recover_s`` = kill → both groups have
committed a step again; ``survivor_s`` = kill → the survivor's first commit after it; the killed
group's step when killed and the step it healed to (a survivor's: nothing is re-run, but the
group is absent from every step in between).

    python benchmarks/peers/torchft_peer.py [--trials 5]

Needs ``pip install --no-deps torchft==0.2.0`` plus its small dependencies (``nox -s bench``
installs them); without torchft it says so and exits 0.
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

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("torchft_worker.py"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for x in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(x))
    return out


def available() -> str | None:
    """None if torchft and its Lighthouse can run here, else why not."""
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return f"torchft is not installed ({e})"
    if shutil.which("torchft_lighthouse") is None:
        return "torchft_lighthouse is not on PATH"
    return None


def trial(
    kill_at: int = 60, steps: int = 120, step_ms: float = 50.0, timeout: float = 120.0
) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="torchft-", dir="/var/tmp"))
    progress = d / "progress.jsonl"
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
           "PYTHONWARNINGS": "ignore::FutureWarning"}  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    log = open(d / "log.txt", "w")  # noqa: SIM115 - closed below
    out: dict[str, Any] = {"engine": "torchft", "recovered": False}
    try:
        procs.append(subprocess.Popen(
            ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
             "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip
        for group in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                 "--max-restarts", "3", "--monitor-interval", "0.1", "--master-port", str(_free_port()),
                 WORKER, "--steps", str(steps), "--step-ms", str(step_ms), "--progress", str(progress)],
                env={**env, "REPLICA_GROUP_ID": str(group)}, cwd=d, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + timeout
        victim = None
        while victim is None and time.monotonic() < deadline:  # polls a file the workers append to
            hit = [x for x in _lines(progress) if x["replica"] == "1" and x["step"] >= kill_at]
            victim = hit[0] if hit else None
            time.sleep(0.01)
        if victim is None:
            out["error"] = "never reached the kill point"
            return out
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        while time.monotonic() < deadline:
            after = [x for x in _lines(progress) if x["t"] > t_kill]
            surv = [x for x in after if x["replica"] == "0"]
            back = [x for x in after if x["replica"] == "1" and x["pid"] != victim["pid"]]
            if surv and back:
                out.update(
                    recovered=True,
                    recover_s=max(surv[0]["t"], back[0]["t"]) - t_kill,
                    survivor_s=surv[0]["t"] - t_kill,
                    killed_at=victim["step"],
                    healed_to=back[0]["step"],
                )
                break
            time.sleep(0.01)
        return out
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for x in _lines(progress):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(x["pid"], signal.SIGKILL)
        for p in procs:
            p.wait()
        log.close()
        if out.get("recovered"):
            shutil.rmtree(d, ignore_errors=True)
        else:
            out["dir"] = str(d)


def run(trials: int) -> dict[str, Any]:
    why = available()
    if why is not None:
        return {"skipped": why}
    rs = [trial() for _ in range(trials)]
    ok = sorted(r["recover_s"] for r in rs if r["recovered"])
    return {
        "samples": rs,
        "recovered": len(ok),
        "trials": trials,
        "median_s": statistics.median(ok) if ok else None,
        "survivor_median_s": statistics.median(r["survivor_s"] for r in rs if r["recovered"]) if ok else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"torchft peer skipped: {why}")
        return
    for _ in range(args.trials):
        print(json.dumps(trial()), flush=True)


if __name__ == "__main__":
    main()
