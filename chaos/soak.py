"""The soak (``chaos soak``, ``nox -s soak``): a seeded random schedule of many faults — soft, hard,
silent and compound — over the training stacks of ``examples/``, many faults per job.

The faults are dealt over the stacks in turn, ``per_job`` to a job; each job is one
:func:`chaos.stream.run_schedule` (the harness's faults on the stack's own script under
``resilient launch``), placed by step ``steps_per_fault`` apart (± 2) and compared bit for bit
with a fault-free run of the same job (one per stack and length, reused). A share of the faults
carries a second one (``compound``): fired by a rank at a point of its first recovery to reach it
in that job (chaos/inject.py ``kind@point:rank``), which need not be the recovery of the fault it
was dealt with; the report counts the second faults that fired.

Reported (``soak.json`` and ``soak.png``): faults fired and recovered, per kind; jobs that ended
bit-exact; the restores whose replay the runtime verified, found diverged, or could not check;
work lost per fault (its restored step's start to the fault, the costliest rank's: p50 / p99 /
max); the longest recovery; committed checkpoints that no longer load (must be 0).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from chaos import results, schedule
from chaos.schedule import BadInput, During, KindName, Planned, _Model


class Stack(_Model):
    config: str = Field(..., description="the stack's certificate config (its job: nproc, timeouts, command)")
    command: list[str] | None = Field(
        None, description="its script at a length: {steps} and {epochs} filled in (None: the bundled example)"
    )
    steps_per_epoch: int = Field(16, ge=1, description="{epochs}: the job's steps / this, rounded up")
    runtime: dict[str, Any] = Field(default_factory=dict, description="the bundled example's runtime config")
    kinds: list[KindName] = Field(..., min_length=1)


class Soak(_Model):
    seed: int = 0
    faults: int = Field(1000, ge=1, description="in all, dealt over the stacks in turn")
    per_job: int = Field(20, ge=1)
    steps_per_fault: int = Field(12, ge=6)
    compound: float = Field(0.1, ge=0, le=1, description="the share of faults that carry a second one")
    seconds: list[During] = Field(
        default_factory=list, description="the second faults drawn from (rank: any)"
    )
    checkpoint_every: int = Field(5, ge=1)
    stacks: dict[str, Stack]


def load(path: Path) -> Soak:
    return Soak.model_validate(yaml.safe_load(path.read_text()))


def job_of(soak: Soak, stack: Stack, steps: int) -> schedule.Certification:
    """The stack's certificate config with its job ``steps`` long (its command filled in)."""
    cert = schedule.load(stack.config)
    update: dict[str, Any] = {"steps": steps, "checkpoint_every": soak.checkpoint_every}
    if stack.runtime:
        update["runtime"] = {**cert.job.runtime, **stack.runtime}
    if stack.command is not None:
        epochs = -(-steps // stack.steps_per_epoch)
        update["command"] = [w.format(steps=steps, epochs=epochs) for w in stack.command]
    job = type(cert.job).model_validate({**cert.job.model_dump(), **update})
    return cert.model_copy(update={"job": job, "classes": {}, "stream": None})  # (its own cadence)


def deal(soak: Soak, stack: Stack, nproc: int, n: int, rng: random.Random) -> list[Planned]:
    """``n`` faults for one job, each at its own step, the compound ones with a second fault (one
    of each kind, point and rank per job: each fires once per job)."""
    out, used = [], set()
    for i in range(n):
        kind, rank = rng.choice(stack.kinds), rng.randrange(nproc)
        step = (i + 1) * soak.steps_per_fault + rng.randint(-2, 2)
        second = None
        if soak.seconds and rng.random() < soak.compound:
            pick = rng.choice(soak.seconds).model_copy(update={"rank": rng.randrange(nproc)})
            if (key := pick.spec()) not in used:
                used.add(key)
                second = pick
        out.append(Planned(fault=kind, rank=rank, step=step, during=second))
    return out


def run(soak: Soak, out: Path, faults: int | None = None, resume: bool = False) -> dict[str, Any]:
    """The soak; after each job its figures so far are written to ``out/soak.json`` (a soak
    stopped early keeps them, ``"complete": false``). ``resume`` keeps those jobs and goes on
    with the job after them, dealt as the uninterrupted soak would have dealt it."""

    from chaos.stream import run_schedule, verdict

    total = faults or soak.faults
    rng = random.Random(f"{soak.seed}/soak")
    refs: dict[str, tuple[list[dict[str, Any]], float]] = {}
    jobs, wall_before, stamp_before = _resumed(soak, out, rng) if resume else ([], 0.0, None)
    st = results.begin(faults=total, resumed_from=stamp_before)
    names = list(soak.stacks)
    dealt, t0 = sum(j["faults_planned"] for j in jobs), time.monotonic() - wall_before
    so_far: dict[str, Any] = {}
    while dealt < total:
        name = names[len(jobs) % len(names)]
        stack = soak.stacks[name]
        n = min(soak.per_job, total - dealt)
        steps = (n + 1) * soak.steps_per_fault + 4
        cert = job_of(soak, stack, steps)
        where = out / f"{len(jobs):04d}-{name}"
        planned = deal(soak, stack, cert.job.nproc, n, rng)
        report = run_schedule(cert, where, planned, steps, probe_step_s=cert.job.step_ms / 1e3, refs=refs)
        report["failed"] = verdict(report, None, True) + (
            ["replays"] if report["replays"]["diverged"] else []
        )
        report["stack"], report["planned"] = name, [f.spec(f.step or 0) for f in planned]
        jobs.append(report)
        dealt += n
        print(
            f"soak: job {len(jobs)} ({name}): {report['faults_injected']} fired, failed {report['failed']}",
            flush=True,
        )
        so_far = {**summary(jobs, time.monotonic() - t0), "complete": dealt >= total}
        so_far["failed"] = failed(so_far)
        results.write(out / "soak.json", so_far, st, complete=dealt >= total)
    return so_far


def _resumed(
    soak: Soak, out: Path, rng: random.Random
) -> tuple[list[dict[str, Any]], float, dict[str, Any] | None]:
    """The jobs a stopped soak wrote, its wall time and stamp, with ``rng`` advanced past their
    deals so the next job gets the faults it would have got."""
    import json

    path = out / "soak.json"
    if not path.exists():
        return [], 0.0, None
    before = json.loads(path.read_text())
    jobs: list[dict[str, Any]] = before["per_job"]
    for job in jobs:
        stack = soak.stacks[job["stack"]]
        cert = job_of(soak, stack, (job["faults_planned"] + 1) * soak.steps_per_fault + 4)
        again = [f.spec(f.step or 0) for f in deal(soak, stack, cert.job.nproc, job["faults_planned"], rng)]
        if again != job["planned"]:
            raise BadInput(
                f"{path}: job {job['stack']} was dealt {job['planned']}, this config deals {again}"
            )
    return jobs, float(before["wall_s"]), before.get("stamp")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(jobs: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    faults = [f for j in jobs for f in j["faults"]]
    lost = [f["work_lost_s"] for f in faults if f.get("work_lost_s") is not None]
    recover = [f["recover_s"] for f in faults if f.get("recover_s") is not None]
    by_kind: dict[str, dict[str, int]] = {}
    for j in jobs:
        for k, v in j["by_kind"].items():
            row = by_kind.setdefault(k, {"injected": 0, "detected": 0, "recovered": 0})
            for key in row:
                row[key] += v[key]
    replays = {k: sum(j["replays"][k] for j in jobs) for k in ("verified", "diverged", "unchecked")}
    return {
        "faults_planned": sum(j["faults_planned"] for j in jobs),
        "faults_fired": len(faults),
        "second_faults_fired": sum(1 for f in faults if f.get("during")),
        "recovered": sum(f["recovered"] for f in faults),
        "jobs": len(jobs),
        "jobs_bit_exact": sum(bool(j["bit_exact"]) for j in jobs),
        "jobs_failed": [{"stack": j["stack"], "failed": j["failed"]} for j in jobs if j["failed"]],
        "replays": replays,
        "work_lost_s": {"p50": _pct(lost, 0.5), "p99": _pct(lost, 0.99), "max": max(lost, default=None)},
        "longest_recovery_s": max(recover, default=None),
        "recover_p50_s": statistics.median(recover) if recover else None,
        "lost_committed_checkpoints": sum(j["lost_committed_checkpoints"] for j in jobs),
        "harness_hangs": sum(j["harness_hangs"] for j in jobs),
        "by_kind": by_kind,
        "by_stack": {
            s: sum(j["faults_injected"] for j in jobs if j["stack"] == s) for s in {j["stack"] for j in jobs}
        },
        "wall_s": wall_s,
        "per_job": jobs,
    }


def failed(report: dict[str, Any]) -> list[str]:
    out = []
    if report["jobs_failed"]:
        out.append("jobs")
    if report["lost_committed_checkpoints"]:
        out.append("checkpoints")
    if report["replays"]["diverged"]:
        out.append("replays")
    if report["recovered"] < report["faults_fired"]:
        out.append("recovered")
    return out


def picture(report: dict[str, Any], path: Path) -> None:
    """Work lost and recovery time per fault, by kind (a strip per kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [f for j in report["per_job"] for f in j["faults"]]
    kinds = sorted({f["kind"] for f in faults})
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(kinds) + 2), sharey=True)
    for ax, key, label in ((axes[0], "recover_s", "recovery, s"), (axes[1], "work_lost_s", "work lost, s")):
        for y, k in enumerate(kinds):
            xs = [f[key] for f in faults if f["kind"] == k and f.get(key) is not None]
            ax.scatter(xs, [y] * len(xs), s=8, alpha=0.5)
        ax.set_xlabel(label)
        ax.set_yticks(range(len(kinds)), kinds)
        ax.grid(axis="x", alpha=0.3)
    fired, exact = report["faults_fired"], f"{report['jobs_bit_exact']}/{report['jobs']}"
    lost = report["lost_committed_checkpoints"]
    fig.suptitle(f"soak: {fired} faults, jobs bit-exact {exact}, checkpoints lost {lost}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
