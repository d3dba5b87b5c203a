"""What ``resilient launch`` does when workers die or go silent: a pure policy.

The agent (:mod:`resilient.launcher.agent`) observes; this module decides. Given the deaths of one
monitor round (exit code or signal, whether a missed heartbeat got the worker killed, its last
beat, its unhealthy mark) and the history the policy keeps (where ranks died, when restarts
happened, how often this node failed a health check), :meth:`LaunchPolicy.decide` answers:

=========  ===================================================================  ===========
action     when                                                                 launcher
=========  ===================================================================  ===========
REPLACE    ``--replace rank`` and every death of the round can be replaced alone  goes on
           (``--max-replacements`` within ``--replacement-window``)
RESTART    otherwise, while ``--max-restarts`` (within ``--restart-window``) lasts  goes on
GIVE_UP    a worker exited 3; the same rank died at the same place                exit 3
           ``--max-repeats`` times in a row; the restart budget is spent
REQUEUE    a worker exited 76 (preempted, its final checkpoint written)           exit 76
EXCLUDE    this node failed health checks ``--max-health-failures`` times         exit 75
=========  ===================================================================  ===========

A rank is replaced alone unless it exited with a verdict (3, 76), asked for the group (75),
failed a health check, died before its first step, or its replacement would overrun the replacement budget
or complete a repeat; the first such reason is the decision's ``not_alone``. The group then
decides in this order: a worker's verdict, the repeat rule, exclusion, the budget. REPLACE and
RESTART keep the policy open; GIVE_UP, REQUEUE and EXCLUDE are final, and every later round gets
the same decision.

No torch, no I/O: the clock comes in (``time.monotonic`` by default), so tests never sleep.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from resilient.contract import Beat
from resilient.errors import ConfigError, ExitCode
from resilient.restarts import RestartWindow, repeats


class Replace(str, enum.Enum):
    """``--replace``: what a death while training costs."""

    RANK = "rank"  # the dead rank alone; its survivors recover in their processes
    GROUP = "group"  # every worker of the node, as torchrun


class Action(str, enum.Enum):
    """What the agent does about one round's deaths."""

    REPLACE = "replace"  # a new process in each dead rank's place; the survivors stay
    RESTART = "restart"  # the whole group is stopped and started again
    GIVE_UP = "give_up"  # stop: exit 3 (FATAL), no restart can help, do not requeue
    REQUEUE = "requeue"  # stop: exit 76, preempted with a final checkpoint
    EXCLUDE = "exclude"  # stop: exit 75, this node leaves and the job goes on without it


class GiveUp(str, enum.Enum):
    """Why the launcher gives up."""

    WORKER = "worker"  # a worker exited 3: the runtime gave up itself
    REPEATS = "repeats"  # the same rank died at the same place max_repeats times in a row
    BUDGET = "budget"  # max_restarts group restarts happened (within the window)


_STOPS = {
    Action.GIVE_UP: ExitCode.FATAL,
    Action.REQUEUE: ExitCode.REQUEUE,
    Action.EXCLUDE: ExitCode.HARD_FAULT,
}
_VERDICTS = {int(ExitCode.FATAL): Action.GIVE_UP, int(ExitCode.REQUEUE): Action.REQUEUE}


@dataclass(frozen=True)
class Death:
    """One worker the agent found dead (or killed after a missed heartbeat)."""

    global_rank: int
    exitcode: int  # negative: killed by signal -exitcode
    beat: Beat | None = None  # its last heartbeat (step, generation); None: it never beat
    missed_heartbeat: bool = False
    unhealthy: bool = False  # it left the mark of a failed health check

    @property
    def stepping(self) -> bool:
        """It had begun its first step (a replacement has a snapshot to restore and a generation
        to join)."""
        return self.beat is not None and self.beat.step >= 0

    @property
    def where(self) -> str | None:
        """Where it died, for the repeat rule: ``step N``; before the first step the same exit code
        each time is the same failure (an import error, a bad argument), ``start-up (exit code N)``;
        after its run was over, ``exit (exit code N)``; None for a signal or 75 before the first
        step, which come from outside and may pass."""
        if self.beat is not None and self.beat.exiting:
            return f"exit (exit code {self.exitcode})"
        if self.stepping and self.beat is not None:
            return f"step {self.beat.step}"
        if self.exitcode > 0 and self.exitcode != int(ExitCode.HARD_FAULT):
            return f"start-up (exit code {self.exitcode})"
        return None


@dataclass(frozen=True)
class Decision:
    action: Action
    ranks: tuple[int, ...] = ()  # REPLACE: the ranks replaced; GIVE_UP/REQUEUE: whose death decided
    not_alone: str | None = None  # (--replace rank) why the group restarts or stops instead
    give_up: GiveUp | None = None
    cause: str = ""  # why the launcher stops, in a sentence

    @property
    def final(self) -> bool:
        return self.action in _STOPS

    @property
    def exitcode(self) -> int | None:
        """The code the launcher ends with after this decision (None: it goes on)."""
        code = _STOPS.get(self.action)
        return None if code is None else int(code)


@dataclass(frozen=True)
class LaunchConfig:
    """The launcher's budgets and restart schedule, and their defaults, once (``resilient launch
    --help`` shows them). Two budgets: a dead rank replaced alone draws on ``max_replacements``
    (within ``replacement_window_s``), a restart of the whole group on ``max_restarts`` (torchrun's
    flag; within ``restart_window_s``). The runtime's in-process recoveries have their own
    (``restart.*`` of the config: ``RestartConfig``)."""

    replace: Replace = Replace.RANK
    # negative: none; torchrun's 0 would end a job meant to outlive its faults at the first death
    # that cannot be replaced alone
    max_restarts: int = 3
    # None: --max-restarts counts over the whole job, as torchrun's does (the runtime's
    # restart.window_s makes its cheap in-process recoveries a rate instead)
    restart_window_s: float | None = None
    max_repeats: int = 3
    max_health_failures: int = 2
    max_replacements: int = 10  # negative: none
    replacement_window_s: float | None = 3600.0  # None: over the whole job
    # A group relaunch starts every worker again (imports, a rendezvous round, a checkpoint read):
    # the 2nd in a row waits 1 s, each next one twice as long up to 30 s, where restart.backoff_*
    # paces in-process recoveries, which cost milliseconds, from 0.1 s up to 10 s.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "replace", Replace(self.replace))
        for name in ("max_repeats", "max_health_failures"):
            if getattr(self, name) < 1:
                raise ConfigError(f"launch policy: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("restart_window_s", "replacement_window_s"):
            window = getattr(self, name)
            if window is not None and not window > 0:
                raise ConfigError(f"launch policy: {name} must be > 0, got {window}")


@dataclass
class History:
    """What the policy remembers between rounds."""

    restarts: RestartWindow  # group restarts
    replacements: RestartWindow  # ranks replaced alone
    deaths: list[tuple[int, str]] = field(default_factory=list)  # (global rank, where)
    health_failures: int = 0  # rounds in which this node reported a failed health check
    final: Decision | None = None


class LaunchPolicy:
    """Decides, round by round, what the deaths of workers cost; see the module's table."""

    def __init__(self, cfg: LaunchConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.history = History(
            RestartWindow(cfg.max_restarts, cfg.restart_window_s),
            RestartWindow(cfg.max_replacements, cfg.replacement_window_s),
        )

    @property
    def restarts_left(self) -> int:
        """Group restarts the budget allows now."""
        return self.history.restarts.left(self._clock())

    @property
    def replacements_left(self) -> int:
        """Ranks the budget allows to replace alone now."""
        return self.history.replacements.left(self._clock())

    def budgets(self) -> dict[str, Any]:
        """The launcher's two budgets and what is left of each (events and metrics)."""
        cfg = self.cfg
        return {
            "max_restarts": cfg.max_restarts,
            "restart_window_s": cfg.restart_window_s,
            "restarts_left": self.restarts_left,
            "max_replacements": cfg.max_replacements,
            "replacement_window_s": cfg.replacement_window_s,
            "replacements_left": self.replacements_left,
        }

    def decide(
        self, deaths: Sequence[Death], *, node_unhealthy: bool = False, can_replace: bool = True
    ) -> Decision:
        """The decision for the deaths of one monitor round, recorded in the history.

        ``node_unhealthy``: a worker of this node that is not among ``deaths`` (yet) marked a failed
        health check; with a dead one's mark, the round counts once toward exclusion.
        ``can_replace``: False when the agent can no longer replace a rank alone (torch has
        stopped the group already, or the workers are not subprocesses): the group decides.
        """
        if not deaths:
            raise ValueError("a decision needs at least one death")
        if self.history.final is not None:
            return self.history.final
        now = self._clock()
        not_alone = None
        if self.cfg.replace is Replace.RANK and can_replace:
            refused = self._refused_alone(deaths, now)
            if refused is None:
                for d in deaths:
                    self.history.deaths.append((d.global_rank, d.where or ""))
                    self.history.replacements.admit(now)
                return Decision(Action.REPLACE, ranks=tuple(d.global_rank for d in deaths))
            rank, why = refused
            not_alone = f"rank {rank} not replaced alone: {why}"
        decision = self._group(deaths, now, node_unhealthy or any(d.unhealthy for d in deaths), not_alone)
        if decision.final:
            self.history.final = decision
        return decision

    # ---- one rank alone -------------------------------------------------------------------------
    def _refused_alone(self, deaths: Sequence[Death], now: float) -> tuple[int, str] | None:
        """(rank, why) for the first death of the round that cannot be replaced alone; None if all
        can, each counting against the budget and the repeat rule as if the ones before it were."""
        left = self.history.replacements.left(now)
        trail = list(self.history.deaths)
        for i, d in enumerate(deaths):
            why = self._why_not_alone(d, left - i, trail)
            if why:
                return d.global_rank, why
            trail.append((d.global_rank, d.where or ""))
        return None

    def _why_not_alone(self, d: Death, left: int, trail: list[tuple[int, str]]) -> str:
        if d.exitcode in _VERDICTS:
            return f"its exit code {d.exitcode} is a verdict"
        if d.exitcode == int(ExitCode.HARD_FAULT):
            return "it asked for a restart of the group (exit code 75)"
        if d.unhealthy:
            return "it failed a health check"
        if d.beat is not None and d.beat.exiting:
            return "it died after its run was over (while exiting)"
        if not d.stepping:
            return "it died before its first step"
        if left <= 0:
            span = self.cfg.replacement_window_s
            within = f" within {span:g} s" if span is not None else ""
            return f"the replacement budget is spent ({max(0, self.cfg.max_replacements)}{within})"
        if repeats([*trail, (d.global_rank, d.where or "")]) >= self.cfg.max_repeats:
            return "the fault repeats"
        return ""

    # ---- the whole group ------------------------------------------------------------------------
    def _group(self, deaths: Sequence[Death], now: float, unhealthy: bool, not_alone: str | None) -> Decision:
        h = self.history
        if unhealthy:
            h.health_failures += 1
        for d in sorted(deaths, key=lambda d: d.global_rank):
            if d.where is not None:
                h.deaths.append((d.global_rank, d.where))
        verdict = next((d for d in deaths if d.exitcode in _VERDICTS), None)
        if verdict is not None:
            action = _VERDICTS[verdict.exitcode]
            code = ExitCode(verdict.exitcode)
            return Decision(
                action,
                ranks=(verdict.global_rank,),
                not_alone=not_alone,
                give_up=GiveUp.WORKER if action is Action.GIVE_UP else None,
                cause=f"rank {verdict.global_rank} exited with {int(code)} ({code.name})",
            )
        if h.deaths and repeats(h.deaths) >= self.cfg.max_repeats:
            rank, where = h.deaths[-1]
            cause = f"rank {rank} died at {where} {self.cfg.max_repeats} times in a row: the fault repeats"
            return Decision(
                Action.GIVE_UP, ranks=(rank,), not_alone=not_alone, give_up=GiveUp.REPEATS, cause=cause
            )
        if unhealthy and h.health_failures >= self.cfg.max_health_failures:
            cause = f"this node failed health checks {h.health_failures} times"
            return Decision(Action.EXCLUDE, not_alone=not_alone, cause=cause)
        if not h.restarts.admit(now):
            window = self.cfg.restart_window_s
            within = f" within {window:g} s" if window is not None else ""
            cause = f"restarts exhausted: {max(0, self.cfg.max_restarts)} group restarts{within}"
            return Decision(Action.GIVE_UP, not_alone=not_alone, give_up=GiveUp.BUDGET, cause=cause)
        return Decision(Action.RESTART, not_alone=not_alone)
