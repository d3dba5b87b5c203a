"""The recovery certificate: every fault class, run for real on the bundled example, measured from
the event log, held against its SLOs.

Each trial is one job under ``resilient launch`` (so soft faults are recovered in-process and hard
ones by the launcher, as in production) with one fault, started through
:func:`chaos.arranged.arranged_job` (which arranges what the fault's kind needs: a veth link, a
memory cgroup, …). Where the fault fires, what proves it was detected and whether a recovery
follows are its kind's (chaos/faults, ``chaos kinds``):

- in-process kinds (exception, hang, oom, …) are fired at the start of the step by the harness's
  step hook (``CHAOS_PLAN``, chaos/hooks.py), so any wrapped script can be certified unchanged;
  the injector appends what it did, and when, to ``injections.jsonl``, and that a fault had nothing
  to act on in the script (a ``desync`` in a step that issues no collective): its trial is then
  SKIPPED with that reason, as one that needs a capability this machine lacks;
- harness kinds are done by this harness to the rank's process when the rank's ``step_completed``
  event shows it reached the step: SIGKILL, SIGSTOP; ``corrupt_checkpoint`` flips bytes in the
  newest committed checkpoint, kills the whole job and starts it again (fresh shared memory), so
  the restart has to read the disk and find the corruption.

Figures per trial, from ``events.jsonl`` (every rank and agent) and ``injections.jsonl``:
time to detect (injection → first detection event: ``fault_detected``, ``worker_died``,
``heartbeat_missed``, ``checkpoint_rejected``), time to recover (injection → every rank
completed a step in its new generation or process), steps lost (steps done again: those done
before the fault, or the first recovery's ``steps_rerun`` where more, for a fault found late), goodput
(the steps' worth of fault-free time / wall time from the first step to the end), bit-exact
(final state vs a fault-free run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chaos.arranged import Unavailable, arranged_job
from chaos.compare import assert_bit_exact
from chaos.faults import CRASH, REGISTRY
from chaos.hooks import first_divergence
from chaos.inject import NotActed, outcomes
from chaos.job import Job, checkpoints, events, fresh, jsonl, own_checkpoints
from chaos.runner import standby_at
from chaos.schedule import Certification, Planned
from resilient.events import Event
from resilient.metrics import account
from resilient.metrics.phases import incident_phases
from resilient.metrics.report import untracked_rows

DETECTION = CRASH.detection  # a kind's own: REGISTRY[kind].evidence.detection


@dataclass
class Trial:
    cls: str
    trial: int
    fault_step: int
    ok: bool = False  # the job finished (exit 0)
    exit_code: int | None = None  # the launcher's (None: killed at the timeout)
    ended_s: float | None = None  # fault → the launcher's exit
    end_reason: str | None = None  # the launcher's run_failed, where it gave up
    detect_s: float | None = None
    detect_step: int | None = None  # the step the detection event names
    recover_s: float | None = None
    steps_lost: int | None = None
    source: str | None = None  # where the restored state came from (state_restored): live | ring | shm
    work_lost_s: float | None = None  # the restored step's start to the fault, the costliest rank's
    goodput: float | None = None
    bit_exact: bool | None = None
    # where a trial is not bit-exact: the first step whose start differs from the fault-free run's,
    # the objects that differ and on which ranks (chaos.hooks.StepDigests)
    divergence: dict[str, Any] | None = None
    # the runtime's own check of its replays (runtime/steps/replay.py): verified | diverged |
    # unchecked, with what it said
    replay: str | None = None
    replay_note: str = ""
    previous_loaded: bool | None = None
    recover_after_restore_s: float | None = None  # link faults: link back → first step after
    detected_rank: int | None = None  # the rank the detection event names
    named_ranks: list[int] | None = None  # the ranks an attribution (sdc_detected) named corrupt
    rate_back_s: float | None = None  # detection → steps within 10 % of the fault-free step time
    standby: str | None = None  # parked | imported | none: the standby that waited when the harness fired
    restarts: int | None = None  # incarnations beyond the first, over every rank
    lost_checkpoints: int | None = None  # committed checkpoints that no longer load
    fired: int = 0
    second: str | None = None  # a compound class's second fault (kind@point:rank)...
    second_fired: bool | None = None  # ... and whether its rank's recovery reached it
    error: str = ""
    # a capability this machine lacks (never replaced by a pretend fault), or why the fault had
    # nothing to act on in the script (chaos.inject.outcomes)
    skipped: str = ""
    time_by_cause: dict[str, float] = field(default_factory=dict)  # resilient.metrics' accounting
    failed_slos: list[str] = field(default_factory=list)
    # an in-process recovery's phases (resilient/metrics/phases.py): seconds, and the rank that
    # ended each last; the agreement's parts on its last rank
    phases: dict[str, float | None] = field(default_factory=dict)
    phase_ranks: dict[str, int | None] = field(default_factory=dict)
    agree_parts: dict[str, float] = field(default_factory=dict)
    phase_cpu: dict[str, float | None] = field(default_factory=dict)  # the costliest rank's CPU s
    timeline: dict[str, Any] = field(default_factory=dict)


# ---- the figures -------------------------------------------------------------------------------------
def measure(
    evs: list[dict[str, Any]],
    injected_ts: float,
    nproc: int,
    ref_step_s: float,
    detection: tuple[str, ...] = DETECTION,
) -> dict[str, Any]:
    steps = [e for e in evs if e["event"] == Event.STEP_COMPLETED]
    detect = next((e for e in evs if e["event"] in detection and e["ts"] >= injected_ts), None)
    before: dict[int, tuple[int, int]] = {}
    last_done = -1
    for e in steps:
        if e["ts"] < injected_ts:
            before[e["rank"]] = (e["pid"], e["generation"])
            last_done = max(last_done, e["step"])
    first_after: dict[int, dict[str, Any]] = {}
    for e in steps:
        new_incarnation = (e["pid"], e["generation"]) != before.get(e["rank"])
        if e["ts"] >= injected_ts and e["rank"] not in first_after and new_incarnation:
            first_after[e["rank"]] = e
    out: dict[str, Any] = {"detect_ts": detect["ts"] if detect else None}
    if detect is not None:
        out["detect_s"] = detect["ts"] - injected_ts
        out["detected_by"] = f"{detect['event']} (rank {detect['rank']})"
        out["detect_step"] = detect.get("step")
        out["detected_rank"] = detect.get("global_rank", detect["rank"])
        out["rate_back_s"] = rate_back(steps, detect["ts"], ref_step_s)
    named = [e for e in evs if e["event"] == Event.SDC_DETECTED and e.get("ranks") and e["ts"] >= injected_ts]
    if named:
        out["named_ranks"] = sorted(named[0]["ranks"])
    if detect is not None and detect["event"] == Event.FAULT_DETECTED:  # (an in-process recovery's phases)
        got = incident_phases([e for e in evs if e["ts"] >= detect["ts"] - 1.0], injected_ts)
        if got is not None:
            out["phases"] = got
    first = first_recovery(evs, injected_ts)  # (its restores: what this fault cost)
    if len(first_after) == nproc:
        out["recover_s"] = max(e["ts"] for e in first_after.values()) - injected_ts
        # the steps done before the fault and again after it; a fault found late (a flipped bit,
        # a skipped all-reduce) re-runs the steps since too, which the runtime counts itself
        redone = last_done + 1 - min(e["step"] for e in first_after.values())
        rerun = [int(e["steps_rerun"]) for e in first if e.get("steps_rerun") is not None]
        out["steps_lost"] = max(0, redone, *rerun)
    if first:
        out["source"] = "+".join(sorted({str(e.get("source")) for e in first}))
        lost = [e["work_lost_s"] for e in first if e.get("work_lost_s") is not None]
        out["work_lost_s"] = max(lost) if lost else None
    return out


def first_recovery(evs: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """The ``state_restored`` events of the first recovery after ``since``: those of the first one's
    generation, one per rank, up to the first of another generation or a rank restored again (a
    restarted job's processes count their generations from 0 again, with other pids)."""
    out: list[dict[str, Any]] = []
    for e in evs:
        if e["event"] != Event.STATE_RESTORED or e["ts"] < since:
            continue
        if out and (e["generation"] != out[0]["generation"] or e["rank"] in {o["rank"] for o in out}):
            break
        out.append(e)
    return out


def rate_back(steps: list[dict[str, Any]], since: float, ref_step_s: float, n: int = 5) -> float | None:
    """Seconds from ``since`` until the job steps at most 10 % slower than fault-free again: the
    first step (completed by every rank) from which the median of the next ``n`` steps' times is
    within 1.1 × ``ref_step_s``; None if that never happens."""
    done: dict[int, float] = {}
    for e in steps:  # a step is done when its last rank completed it (the last time, after a replay)
        done[e["step"]] = max(done.get(e["step"], 0.0), e["ts"])
    order = sorted(done.items())
    times = [
        (s, t, t - order[i - 1][1]) for i, (s, t) in enumerate(order) if i > 0 and order[i - 1][0] == s - 1
    ]
    for i, (_, t, _) in enumerate(times):
        window = [d for _, _, d in times[i : i + n]]
        if t >= since and len(window) == n and statistics.median(window) <= 1.1 * ref_step_s:
            return max(0.0, t - since)
    return None


def _finals(cwd: Path, nproc: int) -> list[dict[str, Any]] | None:
    try:
        return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=True) for r in range(nproc)]
    except (OSError, RuntimeError):
        return None


# ---- certify -------------------------------------------------------------------------------------------
def reference(cert: Certification, cwd: Path) -> tuple[list[dict[str, Any]], float]:
    """A fault-free run of the same job: its final state and median step time."""
    with own_checkpoints(cert, fresh(cwd)):
        job = Job(cert, cwd)
        rc = job.stop(cert.job.timeout_s)
    finals = _finals(cwd, cert.job.nproc)
    if rc != 0 or finals is None:
        raise SystemExit(f"the fault-free reference run failed (rc={rc}); see {cwd / 'launch.log'}")
    durations = [e["step_s"] for e in events(cwd) if e["event"] == Event.STEP_COMPLETED and e.get("step_s")]
    return finals, statistics.median(durations) if durations else cert.job.step_ms / 1e3


def replay_verdict(evs: list[dict[str, Any]]) -> tuple[str | None, str]:
    """What the runtime said of its replays in a job: ``diverged`` (any rank), else ``verified``,
    else ``unchecked`` (and why), else None (no restore)."""
    said = [
        e for e in evs if e["event"] in (Event.REPLAY_VERIFIED, Event.REPLAY_DIVERGED, Event.REPLAY_UNCHECKED)
    ]
    diverged = [e for e in said if e["event"] == Event.REPLAY_DIVERGED]
    if diverged:
        e = min(diverged, key=lambda e: e["first_step"])
        return "diverged", f"step {e['first_step']}: {', '.join(sorted(e['objects']))} (rank {e['rank']})"
    verified = [e for e in said if e["event"] == Event.REPLAY_VERIFIED]
    if verified:
        cut = [e["reference_end"] for e in verified if "reference_end" in e]
        up_to = f", up to step {min(cut)}, where the silent fault's window began" if cut else ""
        return "verified", f"{max(e['steps_checked'] for e in verified)} steps{up_to}"
    if said:
        return "unchecked", said[0]["why"]
    return None, ""


def _run_trial(
    cert: Certification,
    name: str,
    trial: int,
    cwd: Path,
    ref: list[dict[str, Any]],
    ref_step_s: float,
    ref_dir: Path | None = None,
) -> Trial:
    cert = cert.for_class(name)
    j = cert.job
    kind = REGISTRY[cert.classes[name].fault]
    t = Trial(name, trial, cert.trial_step(name, trial))
    ran, restored, ended = _run_job(cert, name, t, cwd)
    if not ran:
        return t
    injections, idle = outcomes(jsonl(cwd / "injections.jsonl"))
    t.fired = len(injections)
    during = cert.classes[name].during
    if during is not None:
        t.second = during.spec()
        t.second_fired = any(i.get("during") == during.phase for i in injections)
    evs = events(cwd)
    if not injections:
        unacted(t, idle)
        return t
    inj = injections[0]
    t.ended_s = ended - inj["ts"]
    t.end_reason = next((e["error"] for e in evs if e["event"] == Event.RUN_FAILED and e["rank"] == -1), None)
    t.standby = inj.get("standby")
    if t.standby is None and kind.kills and any(e["rank"] == -1 for e in evs):  # (under the launcher)
        t.standby = standby_at(evs, inj["ts"])
    m = measure(evs, inj["ts"], j.nproc, ref_step_s, kind.evidence.detection)
    _take_measures(t, m)
    acc = account(evs)  # (as `resilient report`)
    t.time_by_cause = {k: round(v, 4) for k, v in acc.seconds.items()}
    t.goodput = acc.goodput  # the one goodput: productive step time / wall time from the job's start
    if restored is not None and t.recover_s is not None:
        t.recover_after_restore_s = inj["ts"] + t.recover_s - restored
    done = [e for e in evs if e["event"] == Event.STEP_COMPLETED]
    t.restarts = len({(e["rank"], e["pid"], e["generation"]) for e in done}) - len({e["rank"] for e in done})
    corrupted = {i["step"] for i in injections if REGISTRY[i["kind"]].breaks_checkpoint}  # by design
    t.lost_checkpoints = unloadable_checkpoints(checkpoints(cert, cwd), j.nproc, skip=corrupted)
    if kind.breaks_checkpoint:
        loaded = [e for e in evs if e["event"] == Event.CHECKPOINT_LOADED]
        t.previous_loaded = bool(loaded) and all(e["step"] < inj["step"] for e in loaded)
    _compare(t, ref, cwd, j.nproc, ref_dir, evs)
    t.replay, t.replay_note = replay_verdict(evs)
    t.timeline = {
        "injected": inj["ts"],
        "detected": m.get("detect_ts"),
        "restored": restored,
        "lasting": kind.lasting,
        "steps": [(e["ts"], e["rank"], e["step"]) for e in evs if e["event"] == Event.STEP_COMPLETED],
    }
    t.failed_slos = _check(t, cert)
    return t


def _run_job(cert: Certification, name: str, t: Trial, cwd: Path) -> tuple[bool, float | None, float]:
    """The trial's job with its class's one fault, until it ends: whether it ran (not: the fault
    was skipped, ``t.skipped`` says why), when the harness restored what the fault broke (None:
    nothing to restore) and when the job ended. ``t.ok`` and ``t.error`` say how it ended."""
    c, j = cert.classes[name], cert.job
    fault = Planned(fault=c.fault, rank=c.rank, step=t.fault_step, arg=c.arg, duration=c.duration)
    fault = fault.model_copy(update={"at": c.at, "microbatch": c.microbatch})
    rc: int | None = None
    restored: float | None = None
    deadline = time.monotonic() + j.timeout_s
    try:
        with arranged_job(
            cert,
            cwd,
            [(t.fault_step, fault)],
            deadline,
            attempt=None if c.during else "0",  # (a compound's second fault may strike a relaunch)
            partial=False,
            at_points=[c.during.spec()] if c.during else [],
        ) as arranged:
            runner = arranged.runner
            restored = runner.fire(t.fault_step, fault)
            if runner.skipped:
                t.skipped = "; ".join(runner.skipped)
                return False, restored, time.time()
            rc = runner.job.stop(max(1.0, runner.deadline - time.monotonic()))
            ended = time.time()
    except Unavailable as e:  # a capability this machine lacks: skipped, never faked
        t.skipped = str(e)
        return False, restored, time.time()
    t.ok, t.exit_code = rc == 0, rc
    if rc is None:
        t.error = f"did not finish within {j.timeout_s:g} s"
    elif rc != 0:
        t.error = f"launcher exited {rc}"
    return True, restored, ended


def _take_measures(t: Trial, m: dict[str, Any]) -> None:
    """What :func:`measure` found of the trial's fault, onto the trial."""
    t.detect_s, t.recover_s = m.get("detect_s"), m.get("recover_s")
    t.detect_step = m.get("detect_step")
    t.detected_rank, t.rate_back_s = m.get("detected_rank"), m.get("rate_back_s")
    t.named_ranks = m.get("named_ranks")
    t.steps_lost = m.get("steps_lost")
    t.source, t.work_lost_s = m.get("source"), m.get("work_lost_s")
    if (ph := m.get("phases")) is not None:
        t.phases, t.phase_ranks, t.agree_parts, t.phase_cpu = ph.seconds, ph.ranks, ph.agree_parts, ph.cpu


def _compare(
    t: Trial,
    ref: list[dict[str, Any]],
    cwd: Path,
    nproc: int,
    ref_dir: Path | None,
    evs: list[dict[str, Any]],
) -> None:
    """The trial's final state against the fault-free run's; where they differ, the first step
    whose start differs, with what the runtime found untracked named first."""
    finals = _finals(cwd, nproc)
    if finals is not None and t.ok:
        try:
            assert_bit_exact(ref, finals)
            t.bit_exact = True
        except AssertionError:
            t.bit_exact = False
    if t.bit_exact is False and ref_dir is not None:
        t.divergence = first_divergence(ref_dir / "digests", cwd / "digests")
        if t.divergence is not None:
            t.divergence["untracked"] = [r["name"] for r in untracked_rows(evs)]


def unacted(t: Trial, idle: list[NotActed]) -> None:
    """A trial whose fault never acted: SKIPPED, naming why, where the fault said it had nothing
    to act on in the script (a kind that cannot fire there is no detector's failure), and the job
    finished without it; else an error (the rank never reached the step, or the job failed)."""
    why = "; ".join(dict.fromkeys(str(n) for n in idle))
    if idle and t.ok:
        t.skipped = why
    elif idle:
        t.error = f"{t.error} ({why})"
    else:
        t.error = t.error or f"the fault never fired (the rank never reached step {t.fault_step}?)"


def run_trial(
    cert: Certification,
    name: str,
    trial: int,
    cwd: Path,
    ref: list[dict[str, Any]],
    ref_step_s: float,
    ref_dir: Path | None = None,
) -> Trial:
    with own_checkpoints(cert, fresh(cwd)):
        t = _run_trial(cert, name, trial, cwd, ref, ref_step_s, ref_dir)
    expected = t.exit_code is not None and t.exit_code == cert.classes[name].slo.ends_with
    if t.error and not t.skipped and not t.failed_slos and not expected:  # no figures: a failure too
        t.failed_slos = ["ran"]
    return t


def unloadable_checkpoints(root: Path, nproc: int, skip: Collection[int] = ()) -> int:
    """Committed checkpoints (still listed) that do not load on every rank."""
    from resilient.checkpoint.manifest import committed_steps
    from resilient.checkpoint.reader import load_step
    from resilient.errors import CheckpointError

    if not root.exists():
        return 0
    bad = 0
    for step in committed_steps(root):
        if step in skip:
            continue
        try:
            for r in range(nproc):
                load_step(root, step, r, nproc)
        except CheckpointError:
            bad += 1
    return bad


def _check(t: Trial, cert: Certification) -> list[str]:
    s = cert.classes[t.cls].slo
    failed = []
    if s.ends_with is not None:  # (a documented end: that exit, said why, within its bound)
        if t.exit_code != s.ends_with or not t.end_reason:
            failed.append("ends_with")
        if s.ends_within_s is not None and (t.ended_s is None or t.ended_s > s.ends_within_s):
            failed.append("ends_within_s")
    elif not t.ok:
        failed.append("finished")
    if s.detect_s is not None and (t.detect_s is None or t.detect_s > s.detect_s):
        failed.append("detect_s")
    if s.recover_s is not None and (t.recover_s is None or t.recover_s > s.recover_s):
        failed.append("recover_s")
    if s.detect_at_step and t.detect_step != t.fault_step:
        failed.append("detect_at_step")
    if s.steps_lost_max is not None and (t.steps_lost is None or t.steps_lost > s.steps_lost_max):
        failed.append("steps_lost")
    if s.goodput_min is not None and (t.goodput is None or t.goodput < s.goodput_min):
        failed.append("goodput")
    if s.bit_exact and t.bit_exact is not True:
        failed.append("bit_exact")
    if s.restarts_max is not None and (t.restarts is None or t.restarts > s.restarts_max):
        failed.append("restarts")
    if s.checkpoints_load and t.lost_checkpoints:
        failed.append("checkpoints_load")
    limit = s.recover_after_restore_s
    if limit is not None and (t.recover_after_restore_s is None or t.recover_after_restore_s > limit):
        failed.append("recover_after_restore_s")
    if s.previous_checkpoint_loads and not t.previous_loaded:
        failed.append("previous_checkpoint_loads")
    if s.detect_rank and t.detected_rank != cert.classes[t.cls].rank:
        failed.append("detect_rank")
    if s.names_rank and t.named_ranks != [cert.classes[t.cls].rank]:
        failed.append("names_rank")
    if s.rate_back_s is not None and (t.rate_back_s is None or t.rate_back_s > s.rate_back_s):
        failed.append("rate_back_s")
    if s.standby_ready and t.standby in (None, "none"):
        failed.append("standby_ready")
    if s.replay_verified and t.replay != "verified":
        failed.append("replay_verified")
    if t.second is not None and not t.second_fired:  # (a compound class that was not one)
        failed.append("second_fault")
    return failed


def certify(cert: Certification, out: Path, only: list[str] | None = None) -> list[Trial]:
    from rich.progress import Progress

    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in cert.classes if not only or n in only]
    total = sum(cert.trials_of(n) for n in names) + 1
    trials: list[Trial] = []
    with Progress(transient=True) as bar:
        task = bar.add_task("reference run", total=total)
        refs = {cert.job.model_dump_json(): (*reference(cert, out / "reference"), out / "reference")}
        bar.advance(task)
        for name in names:
            job = cert.for_class(name).job.model_dump_json()  # a class with a job of its own: its reference
            if job not in refs:
                where = out / f"reference-{name}"
                refs[job] = (*reference(cert.for_class(name), where), where)
            ref, ref_step_s, ref_dir = refs[job]
            for k in range(cert.trials_of(name)):
                bar.update(task, description=f"{name} trial {k + 1}/{cert.trials_of(name)}")
                trials.append(run_trial(cert, name, k, out / f"{name}-{k}", ref, ref_step_s, ref_dir))
                bar.advance(task)
    return trials
