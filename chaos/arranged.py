"""One chaos job with what its planned faults need: the one context ``certify`` (a fault per job)
and ``run`` / ``stream`` (many) start a job through.

:func:`arranged_job` asks each planned kind to arrange what it needs (a veth link for the rank
behind it, a memory cgroup, …: :meth:`FaultKind.arrange`), writes the in-process faults into the
job's plan, starts the :class:`~chaos.runner.Runner`, and on the way out kills the job (the one
running then: a fault may have restarted it) and removes everything arranged, in reverse order,
even when the run failed or was interrupted.

A fault whose capability this machine lacks is never replaced by a pretend one: with
``partial=False`` (a certificate's trial) :class:`Unavailable` is raised before anything starts;
otherwise (a long run) those faults are left out and named in ``skipped``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from chaos.faults import REGISTRY, Arrangement
from chaos.runner import Runner
from chaos.schedule import Certification, Planned


class Unavailable(Exception):
    """A planned fault needs a capability this machine lacks; the message says which and why."""


@dataclass(frozen=True)
class ArrangedJob:
    runner: Runner  # the running job and the harness's faults on it
    placed: list[tuple[int, Planned]]  # (step, fault): the faults arranged, in step order
    skipped: list[str]  # "kind: why" for the faults left out


@contextmanager
def arranged_job(
    cert: Certification,
    cwd: Path,
    placed: Sequence[tuple[int, Planned]],
    deadline: float,
    *,
    attempt: str | None = None,
    partial: bool = True,
    at_points: Sequence[str] = (),
) -> Iterator[ArrangedJob]:
    """Arrange what ``placed`` needs, start the job in ``cwd`` with its in-process faults planned
    (``attempt``: only in that launch attempt) and ``at_points`` (faults at a recovery's points,
    chaos/inject.py), yield it; kill it and undo the arrangement after."""
    with ExitStack() as stack:
        setup = Arrangement(stack)
        unavailable: dict[str, str] = {}  # kind → why
        for name in dict.fromkeys(f.fault for _, f in placed):
            why = REGISTRY[name].arrange(setup, [f for _, f in placed if f.fault == name])
            if why is not None and not partial:
                raise Unavailable(why)
            if why is not None:
                unavailable[name] = why
        runnable = [(s, f) for s, f in placed if f.fault not in unavailable]
        seconds = [f.during.spec() for _, f in runnable if f.during is not None]  # (a harness kind's too)
        firsts = [f.spec(s) for s, f in runnable if REGISTRY[f.fault].in_process]
        plan = ",".join([*firsts, *seconds, *at_points])
        runner = Runner(cert, cwd, plan, deadline, arrangement=setup, attempt=attempt)
        stack.callback(lambda: runner.job.kill())  # (late-bound: the job running at the end)
        skipped = list(dict.fromkeys(f"{REGISTRY[n].label()}: {why}" for n, why in unavailable.items()))
        yield ArrangedJob(runner, runnable, skipped)
