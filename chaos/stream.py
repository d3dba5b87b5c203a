"""Many faults in one long job: an explicit schedule (``schedule:``, ``chaos run``), or a stream
drawn from an MTBF (``stream:``, ``chaos stream``: goodput under a fault every 60 s, and the soak,
hundreds of faults of every kind).

Every fault is placed by step (a time on the fault-free clock becomes the step the fault-free
run is at then): a wall-clock schedule denser than a relaunch starves the job (measured: a
SIGKILL every ~4 s kept relaunching it at step ~380 for 6 minutes). In-process faults are fired
by the runtime itself (``CHAOS_PLAN``, chaos/hooks.py); the harness does the rest to the rank's current
process when the event log shows the rank reached the step: SIGKILL/SIGSTOP, a kernel OOM-kill
(the process moved into a memory cgroup just before its in-process allocation), a slow disk (its
writes throttled), a dropped link (the rank runs behind a veth link of its own), a corrupt newest
checkpoint (the whole job killed, bytes flipped, the job started again on the same directory).
Each as its kind says (chaos/faults), in one job started by :func:`chaos.arranged.arranged_job`,
the same context a certificate's trial runs in; a fault this machine cannot do is left out and
named in ``skipped``, as is one that had nothing to act on in the script (chaos.inject.outcomes).

Reported: faults planned / injected (what fired, from ``injections.jsonl``) / detected /
recovered, per kind; goodput (productive step time over wall time from the job's start, as
``resilient report`` and the metrics endpoint count it);
committed checkpoints that no longer load (must be 0); the final state vs a fault-free run of the
same length (must be identical); and whether the harness had to kill a run that never ended
(must not).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from chaos.arranged import arranged_job
from chaos.certify import _finals, measure, reference, unloadable_checkpoints
from chaos.compare import assert_bit_exact
from chaos.faults import REGISTRY
from chaos.inject import outcomes
from chaos.job import checkpoints, events, fresh, jsonl, own_checkpoints
from chaos.schedule import Certification, Planned
from resilient.events import Event
from resilient.metrics import account


def plan(cert: Certification, step_s: float) -> tuple[list[Planned], int]:
    """The stream's faults (``at_s`` on the fault-free clock) and the job's length in steps."""
    st = cert.stream
    assert st is not None
    rng = random.Random(f"{cert.seed}/stream")
    link_rank = cert.job.nproc - 1  # one rank sits behind the veth link
    t, out = 0.0, []
    for _ in range(st.faults):
        t += rng.expovariate(1 / st.mtbf_s) if st.random else st.mtbf_s
        kind, rank = rng.choice(st.kinds), rng.randrange(cert.job.nproc)
        rank = link_rank if REGISTRY[kind].on_link else rank
        out.append(Planned(fault=kind, rank=rank, at_s=t, arg=st.args.get(kind), duration=st.duration_s))
    steps = int((t + st.mtbf_s / 2) / step_s) + 1  # half an interval of clean running at the end
    return out, steps


def at_step(faults: list[Planned], step_s: float) -> list[tuple[int, Planned]]:
    """(step, fault), in step order: ``at_s`` turned into the step the fault-free run is at then."""
    placed = [(f.step if f.step is not None else max(1, int((f.at_s or 0) / step_s)), f) for f in faults]
    return sorted(placed, key=lambda p: p[0])


def run_schedule(
    cert: Certification,
    out: Path,
    faults: list[Planned],
    steps: int | None = None,
    probe_step_s: float | None = None,
    refs: dict[str, tuple[list[dict[str, Any]], float]] | None = None,
) -> dict[str, Any]:
    """A fault-free reference and the faulted run of the same job, with ``faults`` placed by step
    (``refs``: references of jobs run before, by job, reused for the same job)."""
    out.mkdir(parents=True, exist_ok=True)
    if probe_step_s is None:
        _, probe_step_s = reference(cert, out / "probe")
    placed = at_step(faults, probe_step_s)
    steps = steps or cert.job.steps
    timeout = 3 * steps * probe_step_s + 30 * len(faults) + 120
    ck_every = cert.stream.checkpoint_every if cert.stream is not None else cert.job.checkpoint_every
    update = {
        **(cert.stream.job if cert.stream is not None else {}),
        "steps": steps,
        "checkpoint_every": ck_every,
        "timeout_s": timeout,
        "max_restarts": 10 * len(faults) + 3,
        "max_replacements": 10 * len(faults) + 3,
    }
    long = cert.model_copy(update={"job": type(cert.job).model_validate({**cert.job.model_dump(), **update})})
    key = long.job.model_dump_json()
    if refs is not None and key in refs:
        ref, ref_step_s = refs[key]
    else:
        ref, ref_step_s = reference(long, out / "reference")
        if refs is not None:
            refs[key] = (ref, ref_step_s)
    cwd = fresh(out / "run")
    rc: int | None = None
    with own_checkpoints(long, cwd):
        with arranged_job(long, cwd, placed, time.monotonic() + timeout) as arranged:
            runner = arranged.runner
            for step, f in arranged.placed:
                runner.fire(step, f)
            rc = runner.job.stop(max(1.0, runner.deadline - time.monotonic()))
        skipped = arranged.skipped + runner.skipped
        return _report(long, cwd, ref, ref_step_s, rc, rc is None, len(arranged.placed), skipped)


def _report(
    cert: Certification,
    cwd: Path,
    ref: list[dict[str, Any]],
    ref_step_s: float,
    rc: int | None,
    hung: bool,
    planned: int,
    skipped: list[str],
) -> dict[str, Any]:
    j = cert.job
    evs = events(cwd)
    injected, idle = outcomes(jsonl(cwd / "injections.jsonl"))  # (idle: nothing to act on, no fault)
    steps_ev = [e for e in evs if e["event"] == Event.STEP_COMPLETED]
    per_fault = [_fault(inj, injected, evs, steps_ev, j.nproc, ref_step_s) for inj in injected]
    corrupted = {i["step"] for i in injected if REGISTRY[i["kind"]].breaks_checkpoint}
    lost = unloadable_checkpoints(checkpoints(cert, cwd), j.nproc, skip=corrupted)
    finals = _finals(cwd, j.nproc)
    acc = account(evs)  # the same accounting as `resilient report` and the metrics endpoint
    return {
        "faults_planned": planned,
        "faults_injected": len(injected),
        "detected": sum(p["detected"] for p in per_fault),
        "undetected_alone": sum(not p["detected"] and not p["overlapped"] for p in per_fault),
        "undetected_overlapped": sum(not p["detected"] and p["overlapped"] for p in per_fault),
        "recovered": sum(p["recovered"] for p in per_fault),
        "finished": rc == 0,
        "harness_hangs": int(hung),
        "goodput": acc.goodput,
        "steps": j.steps,
        "lost_committed_checkpoints": lost,
        "bit_exact": rc == 0 and _bit_exact(ref, finals),
        "replays": replays(evs),
        "by_kind": _by_kind(per_fault),
        "wall_s": acc.wall_s,
        "skipped": [*skipped, *dict.fromkeys(map(str, idle))],
        "faults": per_fault,
        "accounting": {
            "seconds": {k: round(v, 4) for k, v in acc.seconds.items()},
            "wall_s": acc.wall_s,
            "goodput": acc.goodput,
            "unattributed_share": acc.seconds["other"] / acc.wall_s if acc.wall_s else None,
            "incidents": len(acc.incidents),
        },
    }


def _fault(
    inj: dict[str, Any],
    injected: list[dict[str, Any]],
    evs: list[dict[str, Any]],
    steps_ev: list[dict[str, Any]],
    nproc: int,
    ref_step_s: float,
) -> dict[str, Any]:
    """What became of one injected fault: seen (by its kind's evidence within 60 s), a step after
    it, whether another fault came near it, and how long detection and recovery took."""
    evidence = REGISTRY[inj["kind"]].evidence
    window = [e for e in evs if inj["ts"] <= e["ts"] < inj["ts"] + 60]
    # another fault while this one lasted (or within 5 s): its restart can mask this one (a slow
    # disk is only seen when a save waits on it; a relaunch replaces the throttled process)
    lasted = inj["ts"] + float(inj.get("duration_s") or 0) + 5
    m = measure(window, inj["ts"], nproc, ref_step_s, evidence.detection)
    if not evidence.restarts:  # (a slow disk) nothing restarts: there is no recovery to time
        m.pop("recover_s", None)
    return {
        "kind": inj["kind"],
        "rank": inj["rank"],
        "step": inj["step"],
        "detected": any(e["event"] in evidence.detection for e in window),
        "overlapped": any(o is not inj and inj["ts"] - 5 <= o["ts"] <= lasted for o in injected),
        "recovered": any(e["ts"] > inj["ts"] for e in steps_ev),
        "detect_s": m.get("detect_s"),
        "recover_s": m.get("recover_s"),
        "work_lost_s": m.get("work_lost_s"),
        "detected_by": m.get("detected_by"),
        **({"during": inj["during"]} if inj.get("during") else {}),
    }


def replays(evs: list[dict[str, Any]]) -> dict[str, int]:
    """The runtime's verdicts on its replays in a job, counted over the restores (one per
    generation, whichever rank said it first)."""
    said = {
        (e["generation"], e.get("pid")): e["event"].removeprefix("replay_")
        for e in evs
        if e["event"] in (Event.REPLAY_VERIFIED, Event.REPLAY_DIVERGED, Event.REPLAY_UNCHECKED)
    }
    by_gen: dict[Any, str] = {}
    for (gen, _pid), verdict in said.items():
        if by_gen.get(gen) != "diverged":  # (one rank's divergence is the restore's)
            by_gen[gen] = verdict
    out = {"verified": 0, "diverged": 0, "unchecked": 0}
    for verdict in by_gen.values():
        out[verdict] += 1
    return out


def _by_kind(per_fault: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Faults injected, detected and recovered, per kind."""
    out: dict[str, dict[str, int]] = {}
    for f in per_fault:
        k = out.setdefault(f["kind"], {"injected": 0, "detected": 0, "recovered": 0})
        k["injected"] += 1
        k["detected"] += f["detected"]
        k["recovered"] += f["recovered"]
    return out


def _bit_exact(ref: list[dict[str, Any]], finals: list[dict[str, Any]] | None) -> bool:
    """The final state the job dumped (None: it dumped none) is the fault-free reference's, bit
    for bit."""
    if finals is None:
        return False
    try:
        assert_bit_exact(ref, finals)
    except AssertionError:
        return False
    return True


def verdict(report: dict[str, Any], slo_goodput: float | None, slo_exact: bool) -> list[str]:
    failed = []
    if not report["finished"] or report["harness_hangs"]:
        failed.append("finished")
    if slo_goodput is not None and (report["goodput"] or 0) < slo_goodput:
        failed.append("goodput")
    if slo_exact and not report["bit_exact"]:
        failed.append("bit_exact")
    if report["lost_committed_checkpoints"]:
        failed.append("lost_committed_checkpoints")
    if report["recovered"] < report["faults_injected"]:
        failed.append("recovered")
    if report["undetected_alone"]:  # a fault with no other near it must be seen
        failed.append("detected")
    return failed


def run(cert: Certification, out: Path) -> dict[str, Any]:
    """``chaos stream``: the config's stream of faults in one long job."""
    st = cert.stream
    assert st is not None
    out.mkdir(parents=True, exist_ok=True)
    _, probe_step_s = reference(cert, out / "probe")  # the step time, to place faults by step
    faults, steps = plan(cert, probe_step_s)
    report = run_schedule(cert, out, faults, steps, probe_step_s)
    report["mtbf_s"] = st.mtbf_s
    report["failed"] = verdict(report, st.slo.goodput_min, st.slo.bit_exact)
    # one job, start to end: the accounting must explain its wall time (a `chaos run` schedule
    # may stop and start the job, and the time between has no cause)
    if (report["accounting"]["unattributed_share"] or 0.0) > 0.01:
        report["failed"].append("accounting")
    return report
