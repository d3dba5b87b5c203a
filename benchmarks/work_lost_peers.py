"""Seconds of training one fault costs — detection, recovery and the work replayed, all of it —
under resilient and its peers, side by side in one run.

Workload: examples/train_tiny.py's (a tiny transformer LM, DDP over gloo, ``--steps`` bounded,
each step padded to ``--step-ms`` *before* the backward, where a real step spends its time). The
peers' own loops train the same model, data and optimizer in the same step order
(benchmarks/peers/tiny_workload.py). Systems:

- **resilient**: ``resilient launch --standby 1`` on the example (live resume, the default);
  ``--hang-timeout`` and ``--heartbeat-timeout`` = ``--timeout``. A SIGKILL waits for the standby
  to be up (as in replace.py): a long run's is long warm, but on loaded cores a short run's may
  still be importing at step f; the kill then lands in a later step, and the table says which.
- **torchrun**: ``torchrun --max-restarts 3`` on the example without the runtime (``--plain
  --plain-ckpt dcp-async``): ``dcp.async_save`` of the model, optimizer, schedule, data position
  and RNG every 10 steps, on a gloo group of its own (DCP's tutorial setup); a relaunched job
  loads the newest complete checkpoint. Its gloo timeout (``--collective-timeout``) =
  ``--timeout``: a hang is seen when the survivors' all-reduce times out.
- **ft_launcher**: NVRx 0.4.1's launcher at its defaults but the rank heartbeat timeout
  (``--timeout``) and the NIC monitor (off: no NICs here), on the same workload with a rank
  monitor client and a heartbeat per step (benchmarks/peers/ft_launcher_tiny_worker.py, as NVRx's
  fault-tolerance docs set one up); in-job restart of the whole group from the newest checkpoint
  (the same ``dcp.async_save`` every 10 steps: NVRx's own async checkpoint needs CUDA).
- **nvrx**: NVRx 0.4.1's in-process ``Wrapper`` at its defaults but the hang timeouts (soft and
  heartbeat = ``--timeout``, hard twice that) (benchmarks/peers/nvrx_tiny_worker.py; ranks
  started by this driver, state kept in memory across restarts). Nothing relaunches a dead
  process: NVRx's default rank assignment restarts the survivors as a smaller world. Its stock
  abort cannot wake a gloo collective (torch 2.13): a peer blocked on the faulted rank waits out
  the group timeout (``--timeout``) unless that rank's sockets close first.
- **torchft**: torchft 0.2.0 (benchmarks/peers/torchft_tiny_worker.py): every rank is its own
  replica group (the semantics of N-rank DDP: each rank holds the whole model and all-reduces
  with every other), each group a ``torchrun --max-restarts 3``, under one Lighthouse
  (``--min_replicas 1 --join_timeout_ms 10000``); process-group timeout = ``--timeout``. A
  relaunched group heals from a survivor at the survivor's step. A hung group still heartbeats:
  the Lighthouse keeps counting it as healthy, and a quorum needs half of the healthy groups.

Faults, all on rank N-1 (rank 0 hosts NVRx's stores), at step ``--fault-step``: ``exception`` and
``hang`` (``time.sleep(3600)``) fire at the start of the step (chaos's injector, the same code in
every system); ``sigkill``: the driver kills rank N-1's process half a step after it completed the
step before. The default fault step (65) sits mid-way between torchrun's checkpoints: it re-runs
the half interval a periodic checkpoint re-runs on average.

Figures per trial, from the per-step progress lines of every rank (same host clock). With f the
fault step, m = ``--after``, k the last step every rank had completed when the fault hit (f−1, or
earlier when a peer was still finishing its step) and T(s) the time every rank had completed s:

- ``training_lost_s`` = t(every rank has completed a step ≥ f+m after the fault) − T(k)
  − (f+m−k) × the median fault-free step (T(s) − T(s−1) over the m+1 steps up to k, in the same
  run): the wall time the fault added. ``None`` when not every rank came back within ``--wait``
  s. A drift of the step time between before and after the fault counts m+1 times: on loaded
  cores it can read below the detection time, or below 0.
- ``survivors_lost_s``: the same figure over the ranks whose process lived through the fault
  (torchft's other groups train on while the faulted one is relaunched; ``None`` when every
  process was relaunched, as under torchrun).
- ``detect_s``: fault → the system acted on it. resilient: its first ``fault_detected``,
  ``worker_died`` or ``heartbeat_missed`` event; nvrx: the first rank's Wrapper abort; torchrun
  and ft_launcher: the first relaunched worker started; torchft: the Lighthouse's first quorum change or a
  survivor's first step that did not commit.
- ``recover_s``: fault → every rank completed a step again.
- ``steps_rerun``: steps completed before the fault that were run again; ``steps_skipped``: steps
  a healed torchft group was absent from (it took a survivor's state at a later step).
- ``startup_s``: the job's launch → its first step (a relaunch pays about as much again).

Each job is stopped once its figure is in (or ``--wait`` s after the fault); every process of it
(the launchers, workers, standbys, NVRx's monitors, the Lighthouse) is killed, also on failure.

    python benchmarks/work_lost_peers.py [--trials 5] [--nproc 2 4] [--faults exception hang sigkill]
        [--systems resilient torchrun ft_launcher nvrx torchft] [--step-ms 100] [--fault-step 65] [--after 20]

Writes benchmarks/results/work_lost_peers.json (every trial's figures and the medians) and prints
the table.
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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.work_lost_systems import CKPT_EVERY, SYSTEMS, Observed, Setup, System  # noqa: E402
from benchmarks.suite import _kill_tree, _standby_waiting  # noqa: E402
from chaos import results  # noqa: E402

FAULTS = ("exception", "hang", "sigkill")
FIGURES = (
    "training_lost_s",
    "survivors_lost_s",
    "detect_s",
    "recover_s",
    "steps_rerun",
    "steps_skipped",
    "startup_s",
)


class _Tail:
    """The JSON lines appended to a file so far, reading only what is new at each call (the driver
    polls often and must not load the cores its workers share)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, []  # type: ignore[var-annotated]

    def __call__(self) -> list[dict[str, Any]]:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # (a line being written now waits for the next call)
            self.offset += end
            for raw in chunk[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.lines.append(json.loads(raw))
        return self.lines


# ---- the figures ------------------------------------------------------------------------------------
def figures(lines: list[dict[str, Any]], fault_ts: float, s: Setup) -> dict[str, Any]:
    """A trial's figures from its progress lines (the module docstring defines them)."""
    f, steps = s.fault_step, sorted((x for x in lines if "step" in x), key=lambda x: x["t"])
    # a rank's first completion of a step before f, up to a step's time after the fault, is work
    # done before it (a peer writes its line of the step a moment after the faulted rank moved
    # on); any later completion of such a step is a re-run
    tol = s.step_ms / 1e3
    done: dict[int, dict[int, float]] = {}
    pre: set[int] = set()
    for x in steps:
        if x["step"] < f and x["t"] <= fault_ts + tol and x["rank"] not in done.setdefault(x["step"], {}):
            done[x["step"]][x["rank"]] = x["t"]
            pre.add(id(x))
    at = {k: max(v.values()) for k, v in done.items() if len(v) == s.nproc}
    if not at or max(at) < f - 1 - s.after:
        return {"error": f"the ranks had not all completed a step after {f - 2 - s.after} when the fault hit"}
    last = max(at)  # the last step every rank had completed: f-1, or earlier if a peer was mid-step
    # the fault-free step: the m+1 steps before the fault, as many as the figure counts after it
    # (the run's first steps share the cores with a standby still importing)
    window = range(max(1, last - s.after), last + 1)
    step_s = statistics.median(at[k] - at[k - 1] for k in window if k in at and k - 1 in at)
    later = [x for x in steps if x["t"] > fault_ts and id(x) not in pre]
    first = {r: next((x for x in later if x["rank"] == r), None) for r in range(s.nproc)}
    back = {r: next((x["t"] for x in later if x["rank"] == r and x["step"] >= f + s.after), None)
            for r in range(s.nproc)}  # fmt: skip
    stepped = {r: x for r, x in first.items() if x is not None}
    mine_last = {r: max(k for k, v in done.items() if r in v) for r in range(s.nproc)}
    pid_at_fault = {x["rank"]: x["pid"] for x in steps if id(x) in pre}
    lived = sorted({x["rank"] for x in later if x["pid"] == pid_at_fault.get(x["rank"])})

    def lost(ranks: list[int]) -> float | None:
        ts = [t for r in ranks if (t := back[r]) is not None]
        ok = ranks and len(ts) == len(ranks)
        return max(ts) - at[last] - (f + s.after - last) * step_s if ok else None

    return {
        "step_s": step_s,
        "last_step_done": last,
        "training_lost_s": lost(list(range(s.nproc))),
        "survivors_lost_s": lost(lived),
        "survivors": lived,
        "never_back": [r for r in range(s.nproc) if back[r] is None],
        "recover_s": max(x["t"] for x in stepped.values()) - fault_ts if len(stepped) == s.nproc else None,
        "steps_rerun": max((max(0, mine_last[r] + 1 - x["step"]) for r, x in stepped.items()), default=None),
        "steps_skipped": max((max(0, x["step"] - f) for x in stepped.values()), default=None),
        "world_after": min((x.get("world", s.nproc) for x in later), default=None),
    }


# ---- one trial --------------------------------------------------------------------------------------
def trial(system: System, s: Setup, keep: bool = False, startup: float = 180.0) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix=f"wlp-{system.name}-{s.fault}{s.nproc}-", dir="/var/tmp"))
    progress, injections = d / "progress.jsonl", d / "injections.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CHAOS_INJECTIONS": str(injections),
           "PYTHONWARNINGS": "ignore::FutureWarning", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    out: dict[str, Any] = {"system": system.name, "fault": s.fault, "nproc": s.nproc}
    started: dict[int, float] = {}  # pid → process start (a relaunch's time is read while it lives)
    procs: list[subprocess.Popen[bytes]] = []
    log = open(d / "log.txt", "w")  # noqa: SIM115 (closed in finally)
    t_start = time.time()
    try:
        procs = system.start(s, d, env, log)
        fault_ts, deadline = None, time.monotonic() + startup
        read, injected, seen = _Tail(progress), _Tail(injections), 0
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            lines = read()
            new, seen = lines[seen:], len(lines)
            for pid in {x["pid"] for x in new} - started.keys():
                with contextlib.suppress(psutil.Error):
                    started[pid] = psutil.Process(pid).create_time()
            if fault_ts is None:
                fault_ts = _fault(system, s, d, lines, injected(), out)
                if fault_ts is not None:
                    deadline = time.monotonic() + s.wait
                    s = replace(s, fault_step=out["fault_step"])
            elif _measured(lines, fault_ts, s):
                break
            time.sleep(0.01)  # polling a file other processes append to
        lines = read()
        if fault_ts is None:
            out["outcome"] = "never reached the fault"
        else:
            out["fault_ts"] = fault_ts
            out["startup_s"] = min(x["t"] for x in lines if "step" in x) - t_start  # (a relaunch pays it)
            out.update(figures(lines, fault_ts, s))
            det = system.detected(Observed(d, lines, fault_ts, started))
            out["detect_s"] = None if det is None else det - fault_ts
            out["outcome"] = _outcome(out, procs, s)
    finally:
        for p in procs:
            _kill_tree(d, p.pid)
        for p in procs:
            p.wait()
        log.close()
    if keep or out.get("training_lost_s") is None:
        out["dir"] = str(d)  # kept for inspection: log.txt, progress.jsonl, the events
        out["log_tail"] = (d / "log.txt").read_text(errors="replace")[-1500:]
    else:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _fault(
    system: System,
    s: Setup,
    d: Path,
    lines: list[dict[str, Any]],
    injected: list[dict[str, Any]],
    out: dict[str, Any],
) -> float | None:
    """The fault's time once it happened (the injector's record), or the kill, once it is due:
    half a step into the victim's step after f-1 (or after a later one, if the system was not
    ready then); ``out["fault_step"]`` is the step it hit."""
    if s.fault != "sigkill":
        out["fault_step"] = s.fault_step
        return next((x["ts"] for x in injected), None)
    mine = [x for x in lines if x.get("rank") == s.victim and x.get("step", -1) >= s.fault_step - 1]
    if not mine or not system.ready(d):
        return None
    hit = mine[-1]  # (its next step is under way: the kill lands in it)
    time.sleep(max(0.0, hit["t"] + s.step_ms / 2e3 - time.time()))
    if (d / "resilient_runs").exists():
        out["standby"] = _standby_waiting(d)
    out["fault_step"] = hit["step"] + 1
    ts = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(hit["pid"], signal.SIGKILL)
    return ts


def _measured(lines: list[dict[str, Any]], fault_ts: float, s: Setup) -> bool:
    """Every rank is back at step f+m, or every rank of a smaller world is and nothing will bring
    the others back (NVRx restarts its survivors as a smaller world; nothing relaunches the rest)."""
    after = [x for x in lines if "step" in x and x["t"] > fault_ts]
    back = {x["rank"] for x in after if x["step"] >= s.fault_step + s.after}
    world = min((x.get("world", s.nproc) for x in after), default=s.nproc)
    return len(back) == s.nproc or (world < s.nproc and len(back) >= world)


def _outcome(out: dict[str, Any], procs: list[subprocess.Popen[bytes]], s: Setup) -> str:
    if "error" in out:
        return out["error"]
    if out["training_lost_s"] is not None:
        return "recovered"
    gone = ", ".join(map(str, out["never_back"]))
    if out.get("world_after") is not None and out["world_after"] < s.nproc:
        return f"continued as {out['world_after']} rank(s) without rank {gone} (nothing replaces it)"
    why = "the job ended" if all(p.poll() is not None for p in procs) else f"not within {s.wait:g} s"
    if out["survivors_lost_s"] is not None:
        return f"rank {gone} never came back ({why}); the others trained on"
    if out["steps_rerun"] is None:
        return f"training stopped: no rank completed a step after the fault ({why})"
    return f"not recovered ({why})"


# ---- the run ----------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median and its range (min, max) over the trials that have it."""
    med: dict[str, Any] = {}
    spread: dict[str, Any] = {}
    for k in FIGURES:
        xs = [r[k] for r in runs if r.get(k) is not None]
        med[k] = statistics.median(xs) if xs else None
        spread[k] = [min(xs), max(xs)] if xs else None
    outcomes = sorted({r["outcome"] for r in runs})
    ok = sum(r["outcome"] == "recovered" for r in runs)
    steps = sorted({r["fault_step"] for r in runs if "fault_step" in r})
    return {
        "recovered": ok,
        "trials": len(runs),
        "median": med,
        "range": spread,
        "outcomes": outcomes,
        "fault_steps": steps,
    }


def _fmt(v: Any, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


COLUMNS = (("lost s", "training_lost_s"), ("survivors s", "survivors_lost_s"), ("detect s", "detect_s"),
           ("recover s", "recover_s"), ("re-run", "steps_rerun"), ("startup s", "startup_s"))  # fmt: skip
HEAD = f"{'system':10s} {'fault':9s} {'ranks':>5s} " + " ".join(f"{c:>{len(c) + 1}s}" for c, _ in COLUMNS)
HEAD += f" {'ok':>5s}  outcome / note"


def row(system: str, fault: str, nproc: int, r: dict[str, Any], planned: int) -> str:
    head = f"{system:10s} {fault:9s} {nproc:5d}"
    if "skipped" in r:
        return f"{head} {'':>{len(HEAD) - len(head) - 20}s}  skipped: {r['skipped']}"
    m = r["median"]
    note = "; ".join(r["outcomes"])
    if r["fault_steps"] and r["fault_steps"] != [planned]:
        hit = "/".join(map(str, r["fault_steps"]))
        note += f"; killed in step {hit} (its standby was not up at {planned})"
    if m["steps_skipped"]:
        note += f"; healed group skipped {m['steps_skipped']:g} steps"
    cells = " ".join(f"{_fmt(m[k], 0 if k == 'steps_rerun' else 2):>{len(c) + 1}s}" for c, k in COLUMNS)
    return f"{head} {cells} {r['recovered']:>3d}/{r['trials']:<1d}  {note}"


def run(
    systems: list[str], faults: list[str], nprocs: list[int], trials: int, setup: Setup, keep: bool = False
) -> dict[str, Any]:
    """Every system through every fault, ``trials`` times, interleaved trial by trial (the same
    machine load, minutes apart): the config, every trial's figures and each cell's summary."""
    skipped = {n: why for n in systems if (why := SYSTEMS[n].available())}
    t0 = time.time()
    runs: list[dict[str, Any]] = []
    for t in range(trials):
        for nproc in nprocs:
            for fault in faults:
                s = replace(setup, nproc=nproc, fault=fault)
                for name in (n for n in systems if n not in skipped):
                    try:
                        r = {"trial": t, **trial(SYSTEMS[name], s, keep)}
                    except Exception as e:  # (one trial's harness failure is a row, not the run's end)
                        r = {"trial": t, "system": name, "fault": fault, "nproc": nproc,
                             "outcome": f"harness error: {type(e).__name__}: {e}"}  # fmt: skip
                    runs.append(r)
                    brief = {k: v for k, v in r.items() if k not in ("log_tail", "fault_ts")}
                    print(json.dumps(brief, default=str), flush=True)
    rows = []
    for nproc in nprocs:
        for fault in faults:
            for name in systems:
                mine = [r for r in runs if (r["system"], r["fault"], r["nproc"]) == (name, fault, nproc)]
                summary = {"skipped": skipped[name]} if name in skipped else summarize(mine)
                rows.append({"system": name, "fault": fault, "nproc": nproc, **summary, "runs": mine})
    config = {**asdict(setup), "trials": trials, "ckpt_every_torchrun": CKPT_EVERY, "cpus": os.cpu_count()}
    for k in ("nproc", "fault"):
        config.pop(k)
    return {"config": config, "wall_s": time.time() - t0, "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--fault-step", type=int, default=65)
    ap.add_argument("--after", type=int, default=20, help="m: the figure ends when every rank is at step f+m")
    ap.add_argument("--timeout", type=float, default=5.0, help="each system's hang/collective timeout, s")
    ap.add_argument("--wait", type=float, default=60.0, help="give up this long after a trial's fault, s")
    ap.add_argument("--keep", action="store_true", help="keep every trial's directory (logs, progress lines)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "work_lost_peers.json")
    a = ap.parse_args()
    # a SIGTERM (a CI timeout, nox) unwinds through every trial's cleanup as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    st = results.begin(trials=a.trials)
    setup = Setup(0, "", a.fault_step, a.after, a.step_ms, a.timeout, a.wait)
    report = run(a.systems, a.faults, a.nproc, a.trials, setup, a.keep)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(a.out, report, st)
    print(f"\nseconds of training lost per fault (median of {a.trials}; fault at step {a.fault_step}, "
          f"steps padded to {a.step_ms:g} ms, timeouts {a.timeout:g} s)")  # fmt: skip
    print(HEAD)
    for r in report["results"]:
        print(row(r["system"], r["fault"], r["nproc"], r, a.fault_step))
    print(f"wrote {a.out} ({report['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
