"""Peers side by side, in one run: the same workload and the same faults under every system.

Workload: the bundled example's (examples/train_tiny.py: a tiny transformer LM, DDP over gloo,
2 ranks), the peers' own loops training the same model, data and optimizer in the same step
order (benchmarks/peers/tiny_workload.py). Phases, each a part of ``suite.json``:

- ``peers``: a fault's cost (detection, recovery and the work replayed) under resilient,
  torchrun + ``dcp.async_save``, NVRx's ``ft_launcher``, NVRx's in-process ``Wrapper`` and
  torchft with its Lighthouse, each set up as its own docs do (benchmarks/work_lost_peers.py says
  how, and what every figure is): steps padded to 100 ms, the fault at step 65 on the last rank,
  every side's hang timeout 5 s, ``--trials`` trials interleaved; medians and ranges. Then the
  exception at ``--scaling`` ranks, resilient and torchrun.
- ``goodput``: one seeded schedule of faults (exception, hang, SIGKILL in turn) in a 600-step
  run, resilient vs torchrun + ``dcp.async_save``. Goodput is productive step time over wall
  time from the job's launch (:func:`goodput`; the runtime's own accounting beside it).
- ``overhead``: the whole runtime at its defaults under ``resilient launch`` against the plain
  script under torchrun, interleaved pairs, a model whose step computes for ~100 ms: the wall
  time per step, and launch → first step.
- ``checkpoint``: time blocked and time to durable per save, 64 MB → 4 GB, vs torch.save,
  dcp.save, dcp.async_save and NVRx's async checkpoint, with the machine's copy and dd limits.
- ``planner``: the measured checkpoint and SIGKILL costs put into Daly's model at 1k–16k GPUs
  with published failure rates (Llama 3: 419 interruptions in 54 days on 16,384 GPUs; Meta's
  research clusters: MTTF 7.9 h for 1,024-GPU jobs).

    python benchmarks/suite.py [--trials 5] [--only peers goodput ...]

Writes benchmarks/results/suite.json (stamped; a run of some phases goes to suite.partial.json)
and suite.png; prints the table of ratios (peer / ours, > 1 means ours is ahead for times and
behind for goodput — the table says which per row).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import os
import random
import select
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

from chaos import results as stamp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
HANG_TIMEOUT = 2.0
CKPT_EVERY = 10
RESULTS = ROOT / "benchmarks" / "results"

# Published failure rates, as GPU-hours per interruption (a job on N GPUs: MTBF = this / N).
FAILURE_RATES = {
    "llama3": 54 * 24 * 16384 / 419,  # 419 unexpected interruptions, 54 days, 16,384 H100s
    "meta_rsc": 7.9 * 1024,  # MTTF 7.9 h for 1,024-GPU jobs (Kokolis et al. 2024)
}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _p99(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(raw))
    return out


# ---- one job ----------------------------------------------------------------------------------------
def command(
    engine: str,
    nproc: int,
    work: list[str],
    ckpt: Path | None,
    launch_args: tuple[str, ...] = (),
) -> list[str]:
    """The job's command line; ``ckpt`` None: the plain script keeps no checkpoints."""
    common = [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "10",  # torchrun relaunches for every fault of a schedule (5 in the goodput run)
        "--monitor-interval",
        "0.1",
    ]
    if engine == "resilient":
        return [sys.executable, "-m", "resilient.cli", "launch", *common, *launch_args, *work]
    run = [sys.executable, "-m", "torch.distributed.run", *common]
    if engine == "nvrx":
        return [*run, *work, "--engine", "nvrx"]
    if engine == "wrapped":  # the runtime under torchrun: no launcher, standby or mirror
        return [*run, *work]
    if ckpt is None:
        return [*run, *work, "--plain"]
    return [*run, *work, "--plain", "--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY)]


def _in_dir(cwd: Path) -> list[psutil.Process]:
    """Every process running in ``cwd`` (a job's: its launcher, workers, standbys, peers' helpers)."""
    return [
        p
        for p in psutil.process_iter(["pid", "cwd", "cmdline"])
        if p.info["cwd"] and Path(p.info["cwd"]) == cwd
    ]


def _kill_tree(cwd: Path, root_pid: int) -> None:
    """Every process of the job: the launcher's session, the workers (own sessions under elastic)
    and NVRx's monitor processes (setsid) — all of them run in the job's directory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(root_pid, signal.SIGKILL)
    for p in _in_dir(cwd):
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid():
                p.kill()
    for leftover in Path("/dev/shm").glob(f"resilient-*-{root_pid}"):
        shutil.rmtree(leftover, ignore_errors=True)


def job(
    engine: str,
    nproc: int,
    steps: int,
    *,
    plan: str = "",
    kills: tuple[int, ...] = (),
    step_ms: float = 50.0,
    extra: tuple[str, ...] = (),
    timeout: float = 240.0,
    launch_args: tuple[str, ...] = (),
    kill_signal: signal.Signals = signal.SIGKILL,
    script: str = EXAMPLE,
    wait_standby: bool = False,
    hang_timeout: float = HANG_TIMEOUT,
    plain_ckpt: bool = True,
    cpu: bool = False,
) -> dict[str, Any]:
    """Run the example (or ``script``, which takes the same options) once; send ``kill_signal``
    (SIGKILL) to rank 1 when it first completes each step in ``kills`` (with ``wait_standby``,
    once a standby of ``resilient launch`` also waits). Each kill records which standby waited
    then (``parked``, ``imported``, ``none``). ``cpu``: the CPU seconds of the job's processes
    by role, sampled twice a second (``cpu_s``)."""
    d = Path(tempfile.mkdtemp(prefix=f"suite-{engine}-", dir="/var/tmp"))
    progress, injections = d / "progress.jsonl", d / "injections.jsonl"
    work = [
        script,
        "--steps",
        str(steps),
        "--step-ms",
        str(step_ms),
        "--hang-timeout",
        str(hang_timeout),
        "--progress",
        str(progress),
        *extra,
    ]
    if plan:
        work += ["--fault", plan]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "CHAOS_INJECTIONS": str(injections),
        "PYTHONWARNINGS": "ignore::FutureWarning",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    t_start = time.time()
    with open(d / "launch.log", "w") as log:
        p = subprocess.Popen(
            command(engine, nproc, work, d / "ckpt" if plain_ckpt else None, launch_args),
            cwd=d,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    killed: list[dict[str, Any]] = []
    pending = sorted(kills)
    meter = CpuMeter(d, p.pid) if cpu else None
    try:
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            if meter is not None:
                meter.sample()
            if pending:
                hit = [x for x in _lines(progress) if x["rank"] == 1 and x["step"] >= pending[0]]
                standby = _standby_waiting(d)
                if hit and hit[-1]["step"] >= steps - 2:  # (a standby ready too late: the run is over)
                    pending.pop(0)
                    continue
                if hit and (standby != "none" or not wait_standby):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(hit[-1]["pid"], kill_signal)
                    fault = {"ts": time.time(), "kind": kill_signal.name.lower(), "step": pending.pop(0)}
                    killed.append({**fault, "rank": 1, "standby": standby})
            time.sleep(0.02)  # polling files other processes append to
        rc, timed_out = p.poll(), p.poll() is None
        ended = time.time()
    finally:
        _kill_tree(d, p.pid)
        p.wait()
    faults = sorted([{**x, "by": "injector"} for x in _lines(injections)] + killed, key=lambda f: f["ts"])
    out = {
        "engine": engine,
        "nproc": nproc,
        "steps": steps,
        "plan": plan,
        "kills": list(kills),
        "rc": rc,
        "timed_out": timed_out,
        "wall_s": time.time() - t_start,
        "launched": t_start,
        "ended": ended,
        "progress": _lines(progress),
        "faults": faults,
    }
    out["finished"] = rc == 0 and not timed_out and _done(out["progress"], nproc, steps)
    if meter is not None:
        out["cpu_s"] = meter.by_role({x["pid"] for x in out["progress"]})
    runs = list(d.glob("resilient_runs/*/events.jsonl"))
    if len(runs) == 1:  # (the runtime's own goodput accounting of the job)
        from resilient.metrics import account

        out["accounting_goodput"] = account(_lines(runs[0])).goodput
    if not out["finished"]:  # kept for inspection (launch.log, progress.jsonl, the checkpoints)
        out["log_tail"] = (d / "launch.log").read_text()[-3000:]
        out["dir"] = str(d)
    else:
        shutil.rmtree(d, ignore_errors=True)
    return out


class CpuMeter:
    """The CPU seconds of every process of a job (the launcher's session, its workers, standbys:
    all run in the job's directory), last seen at most ``every`` seconds before each ended."""

    def __init__(self, cwd: Path, root_pid: int, every: float = 0.5) -> None:
        self.cwd, self.root_pid, self.every = cwd, root_pid, every
        self._last = 0.0
        self.seen: dict[int, tuple[float, str]] = {}

    def sample(self) -> None:
        if time.monotonic() - self._last < self.every:
            return
        self._last = time.monotonic()
        for q in _in_dir(self.cwd):
            with contextlib.suppress(psutil.Error):
                t = q.cpu_times()
                self.seen[q.pid] = (t.user + t.system, " ".join(q.info["cmdline"] or ()))

    def by_role(self, workers: set[int]) -> dict[str, float]:
        """``launcher`` (the root process: resilient's agent or torchrun's), ``workers`` (the
        ranks, summed), ``standby`` (processes waiting to be a rank), ``other``."""
        out = {"launcher": 0.0, "workers": 0.0, "standby": 0.0, "other": 0.0}
        for pid, (cpu, cmdline) in self.seen.items():
            if pid == self.root_pid:
                role = "launcher"
            elif pid in workers:
                role = "workers"
            elif "resilient.runtime.standby" in cmdline:
                role = "standby"
            else:
                role = "other"
            out[role] += cpu
        return out


def _standby_waiting(d: Path) -> str:
    """The standby of ``resilient launch`` that waits now in run directory ``d``, by its agent's
    events: ``parked``, ``imported`` or ``none`` (one promoted since is not waiting)."""
    from resilient.events import Event

    waiting: dict[int, str] = {}
    for f in d.glob("resilient_runs/*/events.jsonl"):
        for e in _lines(f):
            if e.get("event") == Event.STANDBY_READY:
                waiting[e["standby_pid"]] = e.get("warmth", "imported")
            elif e.get("event") == Event.RANK_REPLACED and e.get("standby"):
                waiting.pop(e.get("new_pid", -1), None)
    return "parked" if "parked" in waiting.values() else next(iter(waiting.values()), "none")


def _done(progress: list[dict[str, Any]], nproc: int, steps: int) -> bool:
    return all(any(x["rank"] == r and x["step"] == steps - 1 for x in progress) for r in range(nproc))


def recoveries(run: dict[str, Any]) -> list[dict[str, float]]:
    """Per fault: seconds until every rank completed a step again (``recover_s``), until every rank
    was back at the step the fault interrupted (``catchup_s``: re-run steps included), and the
    steps completed before the fault that had to be run again (``lost``)."""
    out = []
    prog, n, nan = run["progress"], run["nproc"], float("nan")
    for f in run["faults"]:
        t = f["ts"]
        later = [x for x in prog if x["t"] > t]
        after = [
            min((x for x in later if x["rank"] == r), key=lambda x: x["t"], default=None) for r in range(n)
        ]
        if None in after:
            out.append({"recover_s": nan, "catchup_s": nan, "lost": nan, "kind": f["kind"]})
            continue
        before = max((x["step"] for x in prog if x["t"] <= t), default=-1)
        resumed = min(a["step"] for a in after)  # type: ignore[index]
        back = [
            min((x["t"] for x in later if x["rank"] == r and x["step"] >= before), default=nan)
            for r in range(n)
        ]
        out.append(
            {
                "recover_s": max(a["t"] for a in after) - t,  # type: ignore[index]
                "catchup_s": max(back) - t,
                "lost": before - resumed + 1,
                "kind": f["kind"],
            }
        )
    return out


def step_time(run: dict[str, Any]) -> float | None:
    """Median interval between consecutive steps of rank 0 within one process (no restart in it)."""
    xs = sorted((x for x in run["progress"] if x["rank"] == 0), key=lambda x: x["t"])
    gaps = [
        b["t"] - a["t"]
        for a, b in itertools.pairwise(xs)
        if b["step"] == a["step"] + 1 and a["pid"] == b["pid"]
    ]
    return _median(gaps[3:])


# ---- phases -----------------------------------------------------------------------------------------
# Every side's hang timeout, step time and fault step in the peers' table (benchmarks/work_lost_peers.py)
PEERS = ("resilient", "torchrun", "ft_launcher", "nvrx", "torchft")
FAULT_STEP, AFTER, STEP_MS, TIMEOUT, WAIT = 65, 20, 100.0, 5.0, 60.0


def phase_peers(
    trials: int, nprocs: list[int], systems: tuple[str, ...] = PEERS, faults: tuple[str, ...] = ()
) -> dict:
    """Seconds of training each fault costs every system (work_lost_peers.py's figures)."""
    from benchmarks import work_lost_peers as wlp
    from benchmarks.peers.work_lost_systems import Setup

    setup = Setup(0, "", FAULT_STEP, AFTER, STEP_MS, TIMEOUT, WAIT)
    report = wlp.run(list(systems), list(faults or wlp.FAULTS), nprocs, trials, setup)
    return {
        "config": report["config"],
        "cells": {f"{r['fault']}/{r['system']}/{r['nproc']}": r for r in report["results"]},
    }


def schedule(seed: int, steps: int, n: int) -> tuple[str, tuple[int, ...], list[tuple[int, str]]]:
    """``n`` faults, kinds in turn (exception, hang, sigkill), at seeded steps ≥ 40 apart."""
    rng = random.Random(seed)
    kinds = ["exception", "hang", "sigkill"]
    while True:
        at = sorted(rng.sample(range(30, steps - 30), n))
        if all(b - a >= 40 for a, b in itertools.pairwise(at)):
            break
    planned = [(s, kinds[i % 3]) for i, s in enumerate(at)]
    plan = ",".join(f"{k}@{s}:{1 if k == 'exception' else 0}" for s, k in planned if k != "sigkill")
    return plan, tuple(s for s, k in planned if k == "sigkill"), planned


def goodput(run: dict[str, Any]) -> dict[str, Any]:
    """The one goodput, from a job's progress lines: productive step time over wall time from the
    job's launch to its exit. A step is productive once, in the completion of it that the
    final state carries (its last), for the time since the same process completed the step before;
    where that time holds a fault, or the step is its process's first, it counts the run's median
    step instead (the retried step's own work, not the recovery it waited on)."""
    r0 = sorted((x for x in run["progress"] if x["rank"] == 0), key=lambda x: x["t"])
    if not r0:
        return {"goodput": None}
    faults = [f["ts"] for f in run["faults"]]
    prev: dict[int, dict[str, Any]] = {}
    last: dict[int, float | None] = {}
    clean: list[float] = []
    for x in r0:
        p = prev.get(x["pid"])
        gap = x["t"] - p["t"] if p is not None and p["step"] == x["step"] - 1 else None
        if gap is not None and any(p["t"] < f <= x["t"] for f in faults):  # type: ignore[index]
            gap = None
        if gap is not None:
            clean.append(gap)
        prev[x["pid"]], last[x["step"]] = x, gap
    step_s = statistics.median(clean) if clean else 0.0
    productive = sum(step_s if g is None else g for g in last.values())
    wall = run["ended"] - run["launched"]
    gp = productive / wall if wall > 0 else None
    return {"goodput": gp, "productive_s": productive, "wall_s": wall, "step_s": step_s}


def phase_goodput(seed: int, steps: int, n_faults: int) -> dict:
    """resilient vs torchrun + dcp.async_save under one seeded schedule of faults, 100 ms steps,
    the same hang timeout (the peers' table has the other systems: their drivers take one fault)."""
    plan, kills, planned = schedule(seed, steps, n_faults)
    res: dict[str, Any] = {"seed": seed, "steps": steps, "schedule": planned, "step_ms": STEP_MS}
    dcp_async = ("--plain-ckpt", "dcp-async", "--collective-timeout", str(TIMEOUT))
    extra = {"resilient": ("--pad-at", "forward"), "torchrun": ("--pad-at", "forward", *dcp_async)}
    for engine in ("resilient", "torchrun"):
        run = job(
            engine,
            2,
            steps,
            plan=plan,
            kills=kills,
            timeout=900,
            step_ms=STEP_MS,
            extra=extra[engine],
            hang_timeout=TIMEOUT,
        )
        rec = recoveries(run)
        res[engine] = {
            **(goodput(run) if run["finished"] else {"goodput": None}),
            "finished": run["finished"],
            "faults_seen": len(run["faults"]),
            "recover_s": [x["recover_s"] for x in rec],
            "steps_lost": sum(x["lost"] for x in rec if x["lost"] == x["lost"]),
        }
        if run.get("accounting_goodput") is not None:  # (the runtime's own accounting, a cross-check)
            res[engine]["accounting_goodput"] = run["accounting_goodput"]
        if not run["finished"]:
            res[engine]["log"] = run.get("log_tail", "")[-1500:]
        brief = {k: v for k, v in res[engine].items() if k != "log"}
        print(json.dumps({"phase": "goodput", "engine": engine, **brief}), flush=True)
    return res


def _wall_step(run: dict[str, Any]) -> float | None:
    """Rank 0's wall time per step, first step to last (every periodic cost in it)."""
    xs = sorted((x for x in run["progress"] if x["rank"] == 0), key=lambda x: x["t"])
    return (xs[-1]["t"] - xs[0]["t"]) / (xs[-1]["step"] - xs[0]["step"]) if len(xs) > 1 else None


def _per_step(run: dict[str, Any], key: str, half: bool = False) -> float | None:
    """Rank 0's ``key`` (``t``: wall, ``cpu``: its process's CPU time) per step, first step to
    last, or over the loop's second half (``half``: once the one-off work beside the ranks, the
    standby's imports, is over)."""
    xs = sorted((x for x in run["progress"] if x["rank"] == 0 and key in x), key=lambda x: x["t"])
    xs = xs[len(xs) // 2 :] if half else xs
    return (xs[-1][key] - xs[0][key]) / (xs[-1]["step"] - xs[0]["step"]) if len(xs) > 1 else None


def phase_overhead(pairs: int, steps: int = 300) -> dict:
    """The whole runtime at its defaults under ``resilient launch`` (guard, replica digests, live
    capture and its mirror, replay digest, snapshots, heartbeats) against the plain script under
    torchrun, no checkpoints on either side, a model whose step computes for ~100 ms (no padding);
    interleaved pairs, the order swapped each pair. Per run: the wall time per step over the whole
    loop and over its second half, rank 0's CPU time per step, the CPU seconds of the launcher,
    the ranks and the standby, and the time from launch to the first step."""
    wide = ("--dim", "224", "--seq", "64")
    sides = ("plain", "resilient")
    figures = ("wall", "steady", "cpu")
    per: dict[str, dict[str, list[float]]] = {f: {m: [] for m in sides} for f in figures}
    ratios: dict[str, list[float]] = {f: [] for f in figures}
    start: dict[str, list[float]] = {m: [] for m in sides}
    cpu_s: dict[str, list[dict[str, float]]] = {m: [] for m in sides}
    for i in range(pairs):
        got: dict[str, dict[str, float | None]] = {}
        for mode in sides if i % 2 == 0 else sides[::-1]:
            engine = "torchrun" if mode == "plain" else "resilient"
            r = job(engine, 2, steps, step_ms=0.0, extra=wide, plain_ckpt=False, cpu=True)
            if not r["finished"]:
                continue
            got[mode] = {
                "wall": _per_step(r, "t"),
                "steady": _per_step(r, "t", True),
                "cpu": _per_step(r, "cpu"),
            }
            for f in figures:
                if got[mode][f] is not None:
                    per[f][mode].append(got[mode][f])  # type: ignore[arg-type]
            start[mode].append(min(x["t"] for x in r["progress"]) - r["launched"])
            cpu_s[mode].append(r["cpu_s"])
        for f in figures:
            a, b = (got.get(m, {}).get(f) for m in sides)
            if a and b:
                ratios[f].append(100 * (b / a - 1))
        print(json.dumps({"phase": "overhead", "pair": i, **got}), flush=True)
    out: dict[str, Any] = {"pairs": pairs, "steps": steps, "model": list(wide)}
    for f, name in (("wall", ""), ("steady", "steady_"), ("cpu", "cpu_")):
        q = statistics.quantiles(ratios[f], n=4) if len(ratios[f]) >= 2 else [None, None, None]
        out[f"{name}step_ms"] = {m: (1e3 * statistics.median(v) if v else None) for m, v in per[f].items()}
        out[f"{name}overhead_pct"] = _median(ratios[f])
        out[f"{name}overhead_pct_iqr"] = [q[0], q[2]]
        out[f"{name}overhead_pct_pairs"] = ratios[f]
    out["startup_s"] = {m: _median(v) for m, v in start.items()}
    roles = ("launcher", "workers", "standby", "other")
    out["cpu_s"] = {m: {k: _median([c[k] for c in cs]) for k in roles} for m, cs in cpu_s.items()}
    return out


def phase_checkpoint(sizes: list[float], where: Path, repeat: int) -> dict:
    import torch.distributed as dist

    from benchmarks import checkpoint as ck

    try:
        from benchmarks.peers import nvrx_async_ckpt
    except Exception as e:  # the helper module may not import on this machine
        nvrx_async_ckpt, nvrx_err = None, f"{type(e).__name__}: {e}"
    where.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    for gb in sizes:
        model, opt = ck.make_model(gb)
        state = ck.state_of(model, opt)
        size = ck.nbytes(state)
        row: dict[str, Any] = {"bytes": size}
        row["copy_s"] = ck.copy_limit(state, repeat)
        row["dd_Bps"] = ck.dd_limit(size, where)
        row["torch_save_s"] = min(ck.torch_save(state, where) for _ in range(repeat))
        dcp = [ck.dcp_times(state, where) for _ in range(repeat)]
        row["dcp_save_s"] = min(x[0] for x in dcp)
        row["dcp_async_block_s"] = min(x[1] for x in dcp)
        row["dcp_async_total_s"] = min(x[2] for x in dcp)
        # DCP's 1-rank group ends before the fork below: a child inheriting a gloo group waits
        # forever in its first collective (the group's threads do not survive a fork; measured)
        if dist.is_initialized():
            dist.destroy_process_group()
        if nvrx_async_ckpt is not None:
            save = functools.partial(nvrx_async_ckpt.measure, state, where, repeat=repeat)
            row["nvrx_async"] = in_child(save, timeout=600)
        else:
            row["nvrx_async"] = {"error": nvrx_err}
        row.update(ck.ours(model, opt, where, repeat))
        row["persist_Bps"] = size / row["persist_s"]
        res[f"{gb:g}"] = row
        print(json.dumps({"phase": "checkpoint", "gb": gb, **row}, default=str), flush=True)
        del model, opt, state
        gc.collect()
    return res


def in_child(fn: Any, timeout: float) -> dict[str, Any]:
    """``fn()``'s JSON-able result, run in a forked child: a peer that hangs in its own teardown
    (NVRx's async caller joined a queue its dead worker never finished, in its __del__, after a
    1 GB save: measured) costs ``timeout`` and an error, not the run. Every process of the child
    is killed at the end."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result down the pipe, then out without Python's teardown
        os.close(r)
        try:
            out = fn()
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out, default=str))
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(r) as f:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([f], [], [], 1.0)
            if ready:
                chunk = f.read()
                chunks.append(chunk)
                break
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    text = "".join(chunks)
    if not text:
        return {"error": f"no result within {timeout:g} s (hung)"}
    out: dict[str, Any] = json.loads(text)
    return out


def _cell(results: dict[str, Any], fault: str, system: str, nproc: int = 2) -> dict[str, Any]:
    return ((results.get("peers") or {}).get("cells") or {}).get(f"{fault}/{system}/{nproc}") or {}


def _med(cell: dict[str, Any], figure: str) -> Any:
    return (cell.get("median") or {}).get(figure)


def phase_planner(measured: dict[str, Any]) -> dict:
    """Daly's model at 1k–16k GPUs with each side's measured cost of a hard fault (a SIGKILL's
    training lost: detection, recovery and the work replayed) and checkpoint blocking time (1 GB
    of state per GPU)."""
    from resilient.state import interval_planner as planner

    ckp = measured.get("checkpoint", {}).get("1", {})

    def lost(system: str) -> Any:
        return _med(_cell(measured, "sigkill", system), "training_lost_s")

    costs = {
        "resilient": (ckp.get("block_s"), lost("resilient")),
        "torchrun": (ckp.get("dcp_async_block_s"), lost("torchrun")),
    }
    gpus = [1024, 2048, 4096, 8192, 16384]
    out: dict[str, Any] = {
        "gpus": gpus,
        "costs": {k: {"delta_s": d, "restart_s": r} for k, (d, r) in costs.items()},
    }
    for src, gpu_h in FAILURE_RATES.items():
        for name, (delta, restart) in costs.items():
            if delta is None or restart is None:
                continue
            curve = []
            for n in gpus:
                mtbf = gpu_h * 3600 / n
                tau = planner.daly(delta, mtbf)
                curve.append(
                    {
                        "gpus": n,
                        "mtbf_h": mtbf / 3600,
                        "interval_s": tau,
                        "goodput": planner.goodput(tau, delta, restart, mtbf),
                    }
                )
            out[f"{src}/{name}"] = curve
        # the closed form checked once by Monte Carlo at the largest scale
        d, r = costs["resilient"]
        if d is not None and r is not None:
            mtbf = gpu_h * 3600 / gpus[-1]
            tau = planner.daly(d, mtbf)
            sim = planner.simulate(tau, d, r, mtbf, segments=200_000, seed=0)
            out[f"{src}/check"] = {"closed": planner.goodput(tau, d, r, mtbf), "simulated": sim.goodput}
    return out


# ---- report -----------------------------------------------------------------------------------------
PEER_FIGURES = (
    ("training lost per fault (s)", "training_lost_s"),
    ("fault → every rank stepping (s)", "recover_s"),
    ("steps run again", "steps_rerun"),
)


def why_not(cell: dict[str, Any]) -> str | None:
    """What a side did instead of recovering, in a few words (None: it recovered every trial)."""
    if "skipped" in cell:
        return f"not run: {cell['skipped']}"
    if cell.get("recovered") == cell.get("trials"):
        return None
    other = [o for o in cell.get("outcomes", []) if o != "recovered"]
    words = "; ".join(o.split(" (")[0] for o in other)
    return f"{cell.get('recovered')}/{cell.get('trials')} recovered: {words}"


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows: figure, ours, each peer, ratio peer/ours, and whether ours is ahead."""
    rows: list[dict[str, Any]] = []
    for fault in ("exception", "hang", "sigkill"):
        ours = _cell(results, fault, "resilient")
        for peer in PEERS[1:]:
            theirs = _cell(results, fault, peer)
            for label, figure in PEER_FIGURES:
                rows.append(
                    _row(
                        f"{fault}: {label}, median",
                        peer,
                        _med(ours, figure),
                        _med(theirs, figure),
                        lower_better=True,
                        note=why_not(theirs),
                        spread=(
                            (ours.get("range") or {}).get(figure),
                            (theirs.get("range") or {}).get(figure),
                        ),
                    )
                )
    gp = results.get("goodput", {})
    rows.append(
        _row(
            "goodput under the seeded schedule",
            "torchrun",
            (gp.get("resilient") or {}).get("goodput"),
            (gp.get("torchrun") or {}).get("goodput"),
            lower_better=False,
        )
    )
    ov = results.get("overhead", {})
    if ov:
        for label, key in (
            ("fault-free step, wall (ms)", "step_ms"),
            ("launch → first step (s)", "startup_s"),
        ):
            rows.append(
                _row(label, "plain", ov[key].get("resilient"), ov[key].get("plain"), lower_better=True)
            )
    for gb, row in results.get("checkpoint", {}).items():
        ours = row.get("block_s")
        for peer, key in (
            ("torch.save", "torch_save_s"),
            ("dcp.save", "dcp_save_s"),
            ("dcp.async_save", "dcp_async_block_s"),
        ):
            rows.append(
                _row(f"checkpoint {gb} GB: training blocked (s)", peer, ours, row.get(key), lower_better=True)
            )
        nv = row.get("nvrx_async", {})
        # NVRx's async save on CPU moves the caller's tensors to shared memory and writes from the
        # live tensors: not a snapshot. The caller must clone first for a consistent checkpoint.
        rows.append(
            _row(
                f"checkpoint {gb} GB: training blocked (s)",
                "nvrx async + clone",
                ours,
                nv.get("cloned_block_s"),
                lower_better=True,
                note=nv.get("error"),
            )
        )
        rows.append(
            _row(
                f"checkpoint {gb} GB: durable (s); peer = torch.save+fsync",
                "torch.save",
                row.get("persist_s"),
                row.get("torch_save_s"),
                lower_better=True,
            )
        )
    for n in results.get("scaling", []):
        ours = _cell(results, "exception", "resilient", n)
        theirs = _cell(results, "exception", "torchrun", n)
        figure = f"exception at {n} ranks: training lost (s), median"
        o, t = _med(ours, "training_lost_s"), _med(theirs, "training_lost_s")
        rows.append(_row(figure, "torchrun", o, t, lower_better=True, note=why_not(theirs)))
    return rows


def _row(
    figure: str,
    peer: str,
    ours: Any,
    theirs: Any,
    *,
    lower_better: bool,
    failed: Any = None,
    note: Any = None,
    spread: tuple[Any, Any] = (None, None),
) -> dict:
    ratio = (
        theirs / ours if isinstance(ours, int | float) and isinstance(theirs, int | float) and ours else None
    )
    ahead = None if ratio is None else ratio >= 1 if lower_better else ratio <= 1
    if ours == 0 and isinstance(theirs, int | float):  # e.g. no step run again: no ratio, still a verdict
        ahead = theirs >= 0 if lower_better else theirs <= 0
    return {
        "figure": figure,
        "peer": peer,
        "ours": ours,
        "theirs": theirs,
        "ours_range": spread[0],
        "theirs_range": spread[1],
        "ratio": ratio,
        "ahead": ahead,
        "peer_failed_trials": failed,
        "note": note,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="resilient vs peers (same machine, same run)")
    for c in ("figure", "peer", "ours", "peer's", "peer/ours", "ahead"):
        t.add_column(c)
    fmt = lambda v: "—" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in rows:
        theirs = fmt(r["theirs"]) if r["note"] is None else f"{fmt(r['theirs'])} ({str(r['note'])[:60]})"
        ahead = {True: "yes", False: "NO", None: "—"}[r["ahead"]]
        t.add_row(r["figure"], r["peer"], fmt(r["ours"]), theirs, fmt(r["ratio"]), ahead)
    Console(width=170).print(t)


COLORS = {
    "resilient": "tab:green",
    "torchrun": "tab:orange",
    "ft_launcher": "tab:cyan",
    "nvrx": "tab:blue",
    "torchft": "tab:red",
}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    kinds = ["exception", "hang", "sigkill"]
    width = 0.8 / len(PEERS)
    for i, sys_ in enumerate(PEERS):
        vals = [_med(_cell(results, k, sys_), "training_lost_s") or 0 for k in kinds]
        xs = [j + width * (i - (len(PEERS) - 1) / 2) for j in range(3)]
        ax[0, 0].bar(xs, vals, width, label=sys_, color=COLORS[sys_])
    ax[0, 0].set_xticks(range(3), kinds)
    ax[0, 0].set_ylabel("training lost per fault (s, median; 0: not recovered)")
    ax[0, 0].set_title("a fault's cost, 2 gloo ranks, 100 ms steps")
    ax[0, 0].legend(fontsize=8)
    ckp = results.get("checkpoint", {})
    if ckp:
        gbs = sorted(ckp, key=float)
        xs = [ckp[g]["bytes"] / 1e9 for g in gbs]
        series = {
            "resilient (blocked)": "block_s",
            "torch.save": "torch_save_s",
            "dcp.save": "dcp_save_s",
            "dcp.async_save (blocked)": "dcp_async_block_s",
            "copy limit": "copy_s",
        }
        for label, key in series.items():
            ax[0, 1].loglog(xs, [ckp[g].get(key) for g in gbs], "o-", label=label)
        nv = [ckp[g].get("nvrx_async", {}).get("cloned_block_s") for g in gbs]
        if any(v is not None for v in nv):
            ax[0, 1].loglog(xs, nv, "o-", label="NVRx async + clone (blocked)")
        ax[0, 1].set_xlabel("state (GB)")
        ax[0, 1].set_ylabel("s per save")
        ax[0, 1].set_title("checkpoint: time the training loop waits")
        ax[0, 1].legend(fontsize=8)
    ns = [2, *results.get("scaling", [])]
    for e in ("resilient", "torchrun"):
        ys = [_med(_cell(results, "exception", e, n), "training_lost_s") for n in ns]
        ax[1, 0].plot(ns, ys, "o-", label=e, color=COLORS[e])
    ax[1, 0].set_xlabel("ranks")
    ax[1, 0].set_ylabel("exception: training lost (s, median)")
    ax[1, 0].set_title("scaling (one 2-core host: ranks share cores)")
    ax[1, 0].legend()
    pl = results.get("planner", {})
    for key, curve in pl.items():
        if "/" in key and isinstance(curve, list):
            src, name = key.split("/")
            ax[1, 1].semilogx(
                [c["gpus"] for c in curve],
                [c["goodput"] for c in curve],
                "o-" if src == "llama3" else "s--",
                label=f"{name} ({src})",
                color=COLORS.get(name),
            )
    ax[1, 1].set_xlabel("GPUs")
    ax[1, 1].set_ylabel("expected goodput (Daly interval)")
    ax[1, 1].set_title("planner: measured costs at published failure rates")
    ax[1, 1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def from_log(log: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A run's results from the JSON lines it printed (every trial, every phase's figures), for a
    run that did not end itself: the same summaries, the planner and the table recomputed from
    them; what it never printed (the overhead phase's start-up times) is absent."""
    from benchmarks import work_lost_peers as wlp

    lines = []
    for raw in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            x = json.loads(raw)
            if isinstance(x, dict):
                lines.append(x)
    trials = [x for x in lines if "trial" in x and "system" in x]
    cells = {}
    for key in dict.fromkeys((x["fault"], x["system"], x["nproc"]) for x in trials):
        mine = [x for x in trials if (x["fault"], x["system"], x["nproc"]) == key]
        cells["/".join(map(str, key))] = {
            "system": key[1],
            "fault": key[0],
            "nproc": key[2],
            **wlp.summarize(mine),
            "runs": mine,
        }
    config = {
        "fault_step": FAULT_STEP,
        "after": AFTER,
        "step_ms": STEP_MS,
        "timeout": TIMEOUT,
        "wait": WAIT,
        "trials": args.trials,
        "ckpt_every_torchrun": CKPT_EVERY,
        "cpus": os.cpu_count(),
    }
    results: dict[str, Any] = {"peers": {"config": config, "cells": cells}}
    results["scaling"] = sorted({x["nproc"] for x in trials if x["nproc"] != 2})
    gp = {
        x["engine"]: {k: v for k, v in x.items() if k not in ("phase", "engine")}
        for x in lines
        if x.get("phase") == "goodput"
    }
    if gp:
        _, _, planned = schedule(args.seed, args.goodput_steps, args.faults)
        results["goodput"] = {
            "seed": args.seed,
            "steps": args.goodput_steps,
            "schedule": planned,
            "step_ms": STEP_MS,
            **gp,
        }
    pairs = [x for x in lines if x.get("phase") == "overhead"]
    if pairs:
        ratios = [
            100 * (x["resilient"] / x["plain"] - 1) for x in pairs if x.get("plain") and x.get("resilient")
        ]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [None, None, None]
        per = {m: [x[m] for x in pairs if x.get(m)] for m in ("plain", "resilient")}
        results["overhead"] = {
            "pairs": len(pairs),
            "step_ms": {m: 1e3 * statistics.median(v) for m, v in per.items() if v},
            "startup_s": {"plain": None, "resilient": None},  # (not printed by the run)
            "overhead_pct": _median(ratios),
            "overhead_pct_iqr": [q[0], q[2]],
            "overhead_pct_pairs": ratios,
        }
    ckp = {
        f"{x['gb']:g}": {k: v for k, v in x.items() if k not in ("phase", "gb")}
        for x in lines
        if x.get("phase") == "checkpoint"
    }
    if ckp:
        results["checkpoint"] = ckp
    results["planner"] = phase_planner(results)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    phases = ["peers", "goodput", "overhead", "checkpoint", "planner"]
    ap.add_argument("--only", nargs="+", choices=phases, default=phases)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.0625, 0.25, 1.0, 4.0], help="GB")
    ap.add_argument("--scaling", type=int, nargs="*", default=[4], help="ranks beyond 2 for the exception")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--goodput-steps", type=int, default=600)
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--overhead-pairs", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/suite-ckpt"), help="checkpoint disk")
    ap.add_argument("--out", type=Path, default=RESULTS / "suite.json")
    ap.add_argument("--from-log", type=Path, default=None, help="a run's printed lines: its results, partial")
    ap.add_argument("--log-note", default="", help="with --from-log: which run it was and why it did not end")
    args = ap.parse_args()
    if args.from_log is not None:
        st = stamp.begin(trials=args.trials, phases=args.only, from_log=args.log_note)
        results = from_log(args.from_log, args)
        results["rows"] = table(results)
        results["wall_s"] = None
        written = stamp.write(args.out, results, st, complete=False)
        plot(results, written.with_suffix(".png"))
        print_table(results["rows"])
        print(f"wrote {written} (partial: from {args.from_log})")
        return
    # a SIGTERM (a CI timeout, nox) unwinds through every trial's cleanup as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # one run, whole: a run of some phases (--only) never merges into, nor replaces, a whole one
    complete = set(args.only) == set(phases)
    st = stamp.begin(trials=args.trials, phases=args.only)
    results: dict[str, Any] = {}
    import torch

    results["machine"] = {
        "cpus": os.cpu_count(),
        "memory_gb": psutil.virtual_memory().total / 1e9,
        "torch": torch.__version__,
    }
    t0 = time.time()
    if "peers" in args.only:
        results["peers"] = phase_peers(args.trials, [2])
        if args.scaling:  # (the exception beyond 2 ranks: resilient and torchrun, fewer trials)
            more = phase_peers(
                max(1, args.trials - 2), args.scaling, ("resilient", "torchrun"), ("exception",)
            )
            results["peers"]["cells"].update(more["cells"])
            results["scaling"] = args.scaling
    if "goodput" in args.only:
        results["goodput"] = phase_goodput(args.seed, args.goodput_steps, args.faults)
    if "overhead" in args.only:
        results["overhead"] = phase_overhead(args.overhead_pairs)
    if "checkpoint" in args.only:
        results["checkpoint"] = phase_checkpoint(args.sizes, args.dir, repeat=2)
        shutil.rmtree(args.dir, ignore_errors=True)
    if "planner" in args.only:
        results["planner"] = phase_planner(results)
    results["rows"] = table(results)
    results["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = stamp.write(args.out, results, st, complete)
    plot(results, written.with_suffix(".png"))
    print_table(results["rows"])
    print(f"wrote {written} and {written.with_suffix('.png')} ({results['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
