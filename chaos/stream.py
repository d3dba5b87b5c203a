"""One long job with a stream of faults (``stream:`` in a certificate config): goodput under a
fault every ``mtbf_s`` seconds, and the soak (hundreds of faults of every kind in one run).

Every fault is placed by step (the fault-free step time turns a fault time into a step):
in-process ones are fired by the runtime, SIGKILL/SIGSTOP are sent by this harness to the rank's
current process once the event log shows it reached the step. Reported: faults injected,
detected, recovered, goodput, committed checkpoints that no longer load (must be 0), final
state vs a fault-free run of the same length (must be identical), and whether the harness had
to kill a run that never ended (must not).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from chaos.certify import (
    DETECTION,
    Job,
    _finals,
    _jsonl,
    _record_injection,
    events,
    reference,
    unloadable_checkpoints,
)
from chaos.compare import assert_bit_exact
from chaos.schedule import EXTERNAL, Certification


def plan(cert: Certification, step_s: float) -> tuple[list[tuple[float, Any, int]], int]:
    """[(seconds after the first step, kind, rank)] and the job's length in steps."""
    st = cert.stream
    assert st is not None
    rng = random.Random(f"{cert.seed}/stream")
    t, out = 0.0, []
    for _ in range(st.faults):
        t += rng.expovariate(1 / st.mtbf_s) if st.random else st.mtbf_s
        out.append((t, rng.choice(st.kinds), rng.randrange(cert.job.nproc)))
    steps = int((t + st.mtbf_s / 2) / step_s) + 1  # half an interval of clean running at the end
    return out, steps


def at_step(faults: list[tuple[float, Any, int]], step_s: float) -> list[tuple[int, Any, int]]:
    """The faults with their times turned into the step the fault-free run is at then."""
    return [(max(1, int(t / step_s)), k, r) for t, k, r in faults]


def run(cert: Certification, out: Path) -> dict[str, Any]:
    st = cert.stream
    assert st is not None
    out.mkdir(parents=True, exist_ok=True)
    _, probe_step_s = reference(cert, out / "probe")  # the step time, to place faults by step
    faults, steps = plan(cert, probe_step_s)
    timeout = 3 * steps * probe_step_s + 30 * len(faults) + 120
    update = {"steps": steps, "checkpoint_every": st.checkpoint_every, "timeout_s": timeout,
              "max_restarts": 10 * len(faults)}  # fmt: skip
    job_cfg = cert.job.model_copy(update=update)
    long = cert.model_copy(update={"job": job_cfg})
    ref, ref_step_s = reference(long, out / "reference")
    in_process = ",".join(f"{k}@{s}:{r}" for s, k, r in at_step(faults, probe_step_s) if k not in EXTERNAL)
    cwd = out / "stream"
    job = Job(long, cwd, in_process, attempt=None)
    deadline = time.monotonic() + job_cfg.timeout_s
    hung = False
    try:
        # Every fault is placed by training progress (its time on the fault-free clock turned into
        # a step): a wall-clock schedule denser than a relaunch starves the job (measured: a
        # SIGKILL every ~4 s kept relaunching it at step ~380 for 6 minutes).
        for step, kind, rank in sorted(at_step(faults, probe_step_s)):
            if kind not in EXTERNAL:
                continue
            hit = None
            while hit is None and time.monotonic() < deadline and job.p.poll() is None:
                done = [e for e in events(cwd) if e["event"] == "step_completed" and e["rank"] == rank]
                hit = done[-1] if done and max(e["step"] for e in done) >= step - 1 else None
                if hit is None:
                    time.sleep(0.05)
            if hit is None:
                break
            try:
                os.kill(int(hit["pid"]), getattr(signal, kind.upper()))
                _record_injection(cwd, kind, rank, hit["step"] + 1, pid=hit["pid"])
            except ProcessLookupError:
                pass  # gone already (another fault's relaunch): not injected, not counted
        rc = job.stop(max(1.0, deadline - time.monotonic()))
        hung = rc is None
    finally:
        job.kill()
    evs = events(cwd)
    injected = _jsonl(cwd / "injections.jsonl")
    steps_ev = [e for e in evs if e["event"] == "step_completed"]
    detections = [e["ts"] for e in evs if e["event"] in DETECTION]
    detected = sum(any(0 <= ts - i["ts"] < 60 for ts in detections) for i in injected)
    recovered = sum(any(e["ts"] > i["ts"] for e in steps_ev) for i in injected)
    distinct = len({e["step"] for e in steps_ev})
    end = max((e["ts"] for e in evs if e["event"] in ("run_finished", "step_completed")), default=0.0)
    wall = end - steps_ev[0]["ts"] + ref_step_s if steps_ev else 0.0
    lost = unloadable_checkpoints(cwd / long.job.checkpoint_dir, long.job.nproc)
    finals = _finals(cwd, long.job.nproc)
    exact = False
    if finals is not None and rc == 0:
        try:
            assert_bit_exact(ref, finals)
            exact = True
        except AssertionError:
            exact = False
    report: dict[str, Any] = {
        "faults_planned": len(faults), "faults_injected": len(injected), "detected": detected,
        "recovered": recovered, "finished": rc == 0, "harness_hangs": int(hung),
        "goodput": distinct * ref_step_s / wall if wall > 0 else None, "steps": steps,
        "lost_committed_checkpoints": lost, "bit_exact": exact,
        "by_kind": {k: sum(i["kind"] == k for i in injected) for k in sorted({i["kind"] for i in injected})},
        "mtbf_s": st.mtbf_s, "wall_s": wall,
    }  # fmt: skip
    failed = []
    if not report["finished"] or hung:
        failed.append("finished")
    if st.slo.goodput_min is not None and (report["goodput"] or 0) < st.slo.goodput_min:
        failed.append("goodput")
    if st.slo.bit_exact and not exact:
        failed.append("bit_exact")
    if lost:
        failed.append("lost_committed_checkpoints")
    if recovered < len(injected):
        failed.append("recovered")
    report["failed"] = failed
    return report
