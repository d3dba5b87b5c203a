"""Peer benchmark: NVIDIA Resiliency Extension (NVRx) ``ft_launcher`` relaunch on CPU/gloo.

What it measures
----------------
``ft_launcher`` (NVRx 0.4.1's torchrun-derived launcher with per-rank heartbeat monitors) starts
``nproc`` local ranks (``--standalone``, ``--max-restarts 2``). Each rank runs the worker in this
file (``--worker``; the launcher passes its alias ``--as-worker`` because ft_launcher's own
argparse rejects ``--worker`` as an ambiguous prefix of ``--workers-stop-timeout``): gloo process
group from the launcher's env vars, ``RankMonitorClient`` (``init_workload_monitoring`` after the
PG is up, ``send_heartbeat`` after every step), a tiny DDP model (Linear 32->8, SGD), 40 steps of
~50 ms (compute plus sleep padding). Rank 0 torch.saves and fsyncs a checkpoint every 5 steps; a
worker that finds the checkpoint resumes from it. Every completed step appends ``{"t", "step",
"rank", "pid", "attempt"}`` to a progress file (``attempt`` = ``TORCHELASTIC_RESTART_COUNT``).

Two fault kinds, one per trial, each trial a fresh launcher:

- ``sigkill``: once rank ``nproc-1`` has logged step 7 of attempt 0, the driver os.kill()s it
  with SIGKILL. The peers fail in gloo ("Connection reset by peer"); the launcher's monitor loop
  (0.1 s) sees the dead worker, stops the others (SIGTERM) and restarts the whole group
  (attempt 1), which resumes from the step-5 checkpoint.
- ``hang``: rank ``nproc-1`` calls time.sleep(3600) at the start of step 10 of attempt 0 (after
  logging a ``hang`` record); the other ranks then block in DDP's all-reduce. No process dies:
  the rank monitors notice the missing heartbeats (``rank_heartbeat_timeout``), SIGKILL their
  ranks and the launcher restarts the group.

``recover_s`` per trial = the earliest ``t`` of a step completed by attempt 1 (any rank) minus the
driver's time.time() right before the SIGKILL (sigkill) or the hung rank's ``hang`` record (hang).
Same host, same clock. It includes detection, stopping the group, re-rendezvous, starting new
interpreters (import torch), gloo/DDP setup, the checkpoint load and one step. For hangs,
``detect_s`` = time until the hung rank's pid is gone (driver polls every 20 ms). A trial that
does not reach a completed attempt-1 step and a clean launcher exit with all ranks at step 39
within ``timeout`` counts as ``failed``.

Usage: python benchmarks/peers/nvrx_ft_launcher.py --kind sigkill --trials 3 [--nproc 2]
Prints one JSON line on stdout; launcher logs stay in a temp dir that is deleted afterwards.
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

import psutil

STEPS = 40
STEP_S = 0.05
CKPT_EVERY = 5
KILL_AFTER = 7
HANG_AT = 10

# ft_launcher / rank-monitor knobs. NVRx defaults: initial heartbeat timeout 1 h, heartbeat
# timeout 45 min, workload_check_interval 5 s, workers_stop_timeout 30 s, monitor_interval 0.1 s.
CONFIG: dict[str, Any] = {
    "monitor_interval": 0.1,  # launcher polls worker processes (also its CLI default)
    "workers_stop_timeout": 5,  # SIGTERM -> SIGKILL when the launcher stops a group to restart it
    "ft_initial_rank_heartbeat_timeout": 30.0,  # init_workload_monitoring -> first heartbeat
    "ft_rank_heartbeat_timeout": 3.0,  # a rank silent this long is SIGKILLed by its monitor (hang)
    "ft_workload_check_interval": 0.5,  # how often a rank monitor checks the timeouts
    "ft_enable_nic_monitor": "false",  # no NICs/GPUs to watch on this CPU host
    "max_restarts": 2,
}


def _worker(progress: str, ckpt: str, hang: bool) -> None:
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    from torch.nn.parallel import DistributedDataParallel as DDP

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]

    def log(rec: dict[str, Any]) -> None:
        fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    for s in range(start, STEPS):
        t0 = time.time()
        if hang and attempt == 0 and rank == world - 1 and s == HANG_AT:
            log({"t": time.time(), "event": "hang", "rank": rank, "pid": os.getpid(), "attempt": attempt})
            time.sleep(3600)
        g = torch.Generator().manual_seed(1000 * rank + s)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(max(0.0, STEP_S - (time.time() - t0)))
        client.send_heartbeat()
        if rank == 0 and (s + 1) % CKPT_EVERY == 0:
            tmp = ckpt + ".tmp"
            with open(tmp, "wb") as f:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": s + 1}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, ckpt)
        log({"t": time.time(), "step": s, "rank": rank, "pid": os.getpid(), "attempt": attempt})
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for x in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(x))
    return out


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(proc: subprocess.Popen[bytes], workdir: Path) -> None:
    """SIGKILL the launcher, its rank monitors and its workers (which run in their own sessions)."""
    procs = []
    with contextlib.suppress(psutil.Error):
        procs = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    # Workers orphaned earlier still name this trial's unique workdir on their command line.
    for p in psutil.process_iter(["cmdline"]):
        if str(workdir) in " ".join(p.info["cmdline"] or []):
            procs.append(p)
    for p in procs:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    psutil.wait_procs(procs, timeout=10)


def _command(workdir: Path, nproc: int, hang: bool) -> list[str]:
    c = CONFIG
    return [
        sys.executable,
        "-m",
        "nvidia_resiliency_ext.fault_tolerance.launcher",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(c["max_restarts"]),
        "--monitor-interval",
        str(c["monitor_interval"]),
        "--workers-stop-timeout",
        str(c["workers_stop_timeout"]),
        "--ft-initial-rank-heartbeat-timeout",
        str(c["ft_initial_rank_heartbeat_timeout"]),
        "--ft-rank-heartbeat-timeout",
        str(c["ft_rank_heartbeat_timeout"]),
        "--ft-workload-check-interval",
        str(c["ft_workload_check_interval"]),
        "--ft-enable-nic-monitor",
        c["ft_enable_nic_monitor"],
        os.path.abspath(__file__),
        "--as-worker",  # not "--worker": ft_launcher's argparse rejects it as an ambiguous prefix
        "--progress",
        str(workdir / "progress.jsonl"),
        "--ckpt",
        str(workdir / "ck.pt"),
        *(["--hang"] if hang else []),
    ]


def trial(kind: str, nproc: int = 2, timeout: float = 120.0) -> dict[str, Any]:
    """One launcher run with one fault; returns recover_s (None if it never recovered) and details."""
    if kind not in ("sigkill", "hang"):
        raise ValueError(f"kind must be 'sigkill' or 'hang', not {kind!r}")
    workdir = Path(tempfile.mkdtemp(prefix="nvrx_ft_"))
    progress = workdir / "progress.jsonl"
    # TMPDIR keeps the launcher's IPC sockets and torchelastic log dir inside workdir.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(workdir)}
    res: dict[str, Any] = {"kind": kind, "recover_s": None, "detect_s": None, "rc": None}
    victim = nproc - 1
    proc = None
    try:
        with open(workdir / "launcher.log", "w") as log:
            proc = subprocess.Popen(
                _command(workdir, nproc, kind == "hang"),
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.time() + timeout
            t_fault: float | None = None
            fault_pid = -1
            while time.time() < deadline and proc.poll() is None:
                recs = _lines(progress)
                if t_fault is None:
                    if kind == "sigkill":
                        want = {"attempt": 0, "rank": victim, "step": KILL_AFTER}
                        hit = [r for r in recs if all(r.get(k) == v for k, v in want.items())]
                        if hit:
                            fault_pid = hit[0]["pid"]
                            t_fault = time.time()
                            os.kill(fault_pid, signal.SIGKILL)
                    else:
                        hit = [r for r in recs if r.get("event") == "hang"]
                        if hit:
                            fault_pid, t_fault = hit[0]["pid"], hit[0]["t"]
                elif kind == "hang" and res["detect_s"] is None and not _pid_alive(fault_pid):
                    # the hung rank's monitor SIGKILLs it once its heartbeat timeout elapses
                    res["detect_s"] = round(time.time() - t_fault, 3)
                if t_fault is not None:
                    after = [r["t"] for r in recs if r.get("attempt", 0) >= 1 and "step" in r]
                    if after:
                        res["recover_s"] = round(min(after) - t_fault, 3)
                        break
                time.sleep(0.02)
            if res["recover_s"] is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    res["rc"] = proc.wait(timeout=max(1.0, deadline - time.time()))
            else:
                res["rc"] = proc.poll()
        recs = _lines(progress)
        last = {r["rank"]: r["step"] for r in recs if "step" in r}
        res["finished"] = res["rc"] == 0 and all(last.get(r) == STEPS - 1 for r in range(nproc))
        res["resumed_from"] = min((r["step"] for r in recs if r.get("attempt", 0) >= 1), default=None)
        steps = sorted(r["t"] for r in recs if r.get("rank") == 0 and r.get("attempt") == 0)
        if len(steps) > 2:
            gaps = [b - a for a, b in itertools.pairwise(steps[1:])]  # step 0 excluded
            res["step_ms"] = round(1000 * statistics.median(gaps), 1)
        if not res["finished"] or res["recover_s"] is None:
            res["log_tail"] = (workdir / "launcher.log").read_text()[-3000:]
    finally:
        if proc is not None:
            _kill_all(proc, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def trials(kind: str, n: int, nproc: int = 2) -> dict[str, Any]:
    """Run ``n`` fresh launcher trials of fault ``kind`` ("sigkill" or "hang") with ``nproc`` ranks.

    Returns ``{"recover_s": [seconds per recovered trial], "failed": count, "config": CONFIG, ...}``.
    """
    recover: list[float] = []
    detect: list[float] = []
    failed = 0
    per_trial = []
    for _ in range(n):
        r = trial(kind, nproc)
        print(json.dumps(r), file=sys.stderr, flush=True)
        per_trial.append(r)
        if r["recover_s"] is None or not r["finished"]:
            failed += 1
            continue
        recover.append(r["recover_s"])
        if r["detect_s"] is not None:
            detect.append(r["detect_s"])
    out: dict[str, Any] = {
        "peer": "nvrx-ft_launcher",
        "kind": kind,
        "nproc": nproc,
        "recover_s": recover,
        "median_s": round(statistics.median(recover), 3) if recover else None,
        "failed": failed,
        "config": dict(CONFIG),
        "step_ms": [r.get("step_ms") for r in per_trial],
    }
    if kind == "hang":
        out["detect_s"] = detect
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("sigkill", "hang"), default="sigkill")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--worker", "--as-worker", action="store_true", help="internal: run as a rank under ft_launcher"
    )
    ap.add_argument("--progress")
    ap.add_argument("--ckpt")
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args()
    if args.worker:
        _worker(args.progress, args.ckpt, args.hang)
        return
    print(json.dumps(trials(args.kind, args.trials, args.nproc)), flush=True)


if __name__ == "__main__":
    main()
