"""The launcher's decisions: replace a rank alone, restart the group, give up, requeue, exclude.

Every death is described as the agent sees it (exit code or signal, a missed heartbeat, the last
beat, the unhealthy mark); time is a fake clock the test moves, so nothing here sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest

from resilient.contract import Beat
from resilient.errors import ConfigError, ExitCode
from resilient.launcher.policy import Action, Death, Decision, GiveUp, LaunchConfig, LaunchPolicy, Replace

T0 = 5_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def policy(clock: Clock | None = None, **cfg: Any) -> LaunchPolicy:
    return LaunchPolicy(LaunchConfig(**cfg), clock=clock or Clock())


def at(step: int, generation: int = 0) -> Beat:
    return Beat(age_s=0.1, step=step, generation=generation)


def killed(rank: int, step: int | None = 10, **kw: Any) -> Death:
    """``rank`` killed by SIGKILL, at ``step`` (None: it never beat)."""
    return Death(rank, -9, None if step is None else at(step), **kw)


def test_a_death_in_training_is_replaced_alone_and_costs_one_replacement() -> None:
    p = policy(max_restarts=3, max_replacements=4)
    d = p.decide([killed(1, step=12)])
    assert d == Decision(Action.REPLACE, ranks=(1,))
    assert not d.final and d.exitcode is None
    assert (p.replacements_left, p.restarts_left) == (3, 3)  # the group's budget is untouched
    assert p.history.deaths == [(1, "step 12")]


@pytest.mark.parametrize("beat", [None, at(-1)], ids=["never-beat", "before-step-0"])
def test_a_death_before_the_first_step_restarts_the_group(beat: Beat | None) -> None:
    p = policy()
    d = p.decide([Death(1, -9, beat)])
    assert d.action is Action.RESTART
    assert d.not_alone == "rank 1 not replaced alone: it died before its first step"
    assert p.restarts_left == 2


def test_exit_75_asks_for_the_group() -> None:
    d = policy().decide([Death(0, int(ExitCode.HARD_FAULT), at(7))])
    assert d.action is Action.RESTART
    assert d.not_alone == "rank 0 not replaced alone: it asked for a restart of the group (exit code 75)"


@pytest.mark.parametrize("replace", ["rank", "group"])
@pytest.mark.parametrize(
    ("code", "action", "give_up"),
    [(ExitCode.FATAL, Action.GIVE_UP, GiveUp.WORKER), (ExitCode.REQUEUE, Action.REQUEUE, None)],
)
def test_exit_3_and_76_are_verdicts_that_end_the_launch(
    replace: str, code: ExitCode, action: Action, give_up: GiveUp | None
) -> None:
    p = policy(replace=replace, max_restarts=5)
    d = p.decide([Death(1, int(code), at(4))])
    assert (d.action, d.give_up, d.exitcode, d.final) == (action, give_up, int(code), True)
    assert d.cause == f"rank 1 exited with {int(code)} ({code.name})"
    if replace == "rank":
        assert d.not_alone == f"rank 1 not replaced alone: its exit code {int(code)} is a verdict"
    else:
        assert d.not_alone is None
    assert p.restarts_left == 5  # a verdict is not a restart
    assert p.decide([killed(0)]) is d  # final: the launch is over whatever comes next


def test_preemption_of_every_rank_in_one_round_requeues() -> None:
    p = policy()
    d = p.decide([Death(0, 76, at(30)), Death(1, 76, at(30))])
    assert d.action is Action.REQUEUE and d.exitcode == 76 and d.ranks == (0,)


def test_a_failed_health_check_restarts_the_group_and_repeated_ones_exclude_the_node() -> None:
    p = policy(max_health_failures=2, max_restarts=10)
    d = p.decide([Death(0, 75, at(3), unhealthy=True)])
    assert d.action is Action.RESTART and p.history.health_failures == 1
    # an exit code 1 with the mark: the mark is why it is not replaced alone
    d = p.decide([Death(0, 1, at(9), unhealthy=True)])
    assert d.not_alone == "rank 0 not replaced alone: it failed a health check"
    assert (d.action, d.exitcode, d.final) == (Action.EXCLUDE, 75, True)
    assert d.cause == "this node failed health checks 2 times"


def test_a_survivors_mark_counts_toward_exclusion_and_rounds_without_marks_do_not() -> None:
    p = policy(replace="group", max_health_failures=2, max_restarts=10)
    assert p.decide([killed(0)], node_unhealthy=True).action is Action.RESTART
    assert p.decide([killed(0, step=20)]).action is Action.RESTART  # no mark: not a health failure
    assert p.history.health_failures == 1
    assert p.decide([killed(1, step=30)], node_unhealthy=True).action is Action.EXCLUDE


@pytest.mark.parametrize("replace", ["rank", "group"])
def test_the_same_rank_dying_at_the_same_step_max_repeats_times_gives_up(replace: str) -> None:
    p = policy(replace=replace, max_repeats=3, max_restarts=10)
    first = [p.decide([killed(1, step=10, missed_heartbeat=True)]) for _ in range(2)]
    assert [d.action for d in first] == [Action.REPLACE if replace == "rank" else Action.RESTART] * 2
    d = p.decide([killed(1, step=10, missed_heartbeat=True)])
    assert (d.action, d.give_up, d.exitcode, d.ranks) == (Action.GIVE_UP, GiveUp.REPEATS, 3, (1,))
    assert d.cause == "rank 1 died at step 10 3 times in a row: the fault repeats"
    if replace == "rank":
        assert d.not_alone == "rank 1 not replaced alone: the fault repeats"


@pytest.mark.parametrize(
    "between",
    [killed(1, step=11), killed(0, step=10)],
    ids=["progress-was-made", "another-rank-died"],
)
def test_anything_in_between_starts_the_repeat_count_again(between: Death) -> None:
    p = policy(max_repeats=3, max_restarts=20)
    for death in [killed(1), killed(1), between, killed(1), killed(1)]:
        assert p.decide([death]).action is Action.REPLACE
    assert p.decide([killed(1)]).give_up is GiveUp.REPEATS


def test_the_same_exit_code_at_start_up_repeats_but_a_signal_there_never_does() -> None:
    p = policy(max_repeats=3, max_restarts=20)
    assert [p.decide([Death(0, 1)]).action for _ in range(2)] == [Action.RESTART] * 2
    d = p.decide([Death(0, 1)])
    assert d.give_up is GiveUp.REPEATS
    assert d.cause == "rank 0 died at start-up (exit code 1) 3 times in a row: the fault repeats"
    q = policy(max_repeats=3, max_restarts=20)  # killed or 75 before the first step: from outside
    assert {q.decide([d]).action for d in [Death(0, -9), Death(0, 75)] * 3} == {Action.RESTART}


def test_two_ranks_dying_while_training_in_one_round_are_both_replaced() -> None:
    p = policy(max_replacements=3)
    d = p.decide([killed(0, step=8), killed(1, step=8)])
    assert d == Decision(Action.REPLACE, ranks=(0, 1))
    assert p.replacements_left == 1  # one replacement each


def test_a_double_fault_with_one_rank_not_replaceable_restarts_the_group_once() -> None:
    # the second rank died before its first step (say, a replacement killed while it restores):
    # the group restarts, and the first rank is not replaced for nothing
    p = policy(max_restarts=3)
    d = p.decide([killed(0, step=8), killed(1, step=None)])
    assert d.action is Action.RESTART
    assert d.not_alone == "rank 1 not replaced alone: it died before its first step"
    assert p.restarts_left == 2


def test_a_double_fault_that_needs_more_replacements_than_are_left_restarts_the_group() -> None:
    p = policy(max_restarts=1, max_replacements=1, replacement_window_s=None)
    d = p.decide([killed(0), killed(1)])
    assert d.action is Action.RESTART
    assert d.not_alone == "rank 1 not replaced alone: the replacement budget is spent (1)"
    assert (p.restarts_left, p.replacements_left) == (0, 1)  # (the group restarted: none replaced)


@pytest.mark.parametrize("replace", ["rank", "group"])
def test_spent_budgets_give_up(replace: str) -> None:
    p = policy(replace=replace, max_restarts=2, max_replacements=2)
    deaths = [p.decide([killed(1, step=s)]).action for s in (5, 6, 7, 8)]
    if replace == "rank":  # two replaced alone, then two restarts of the group
        assert deaths == [Action.REPLACE, Action.REPLACE, Action.RESTART, Action.RESTART]
    else:
        assert deaths[:2] == [Action.RESTART, Action.RESTART]
    d = p.decide([killed(1, step=9)])
    assert (d.action, d.give_up, d.exitcode) == (Action.GIVE_UP, GiveUp.BUDGET, 3)
    assert d.cause == "restarts exhausted: 2 group restarts"
    if replace == "rank":
        assert d.not_alone == "rank 1 not replaced alone: the replacement budget is spent (2 within 3600 s)"
    none = policy(replace=replace, max_restarts=0, max_replacements=0)
    assert none.decide([killed(1)]).give_up is GiveUp.BUDGET


def test_the_default_budgets_replace_a_dead_rank_though_no_group_restart_is_left() -> None:
    # torchrun's --max-restarts 0 must not stop a rank being replaced alone (the README's launch)
    p = policy(max_restarts=0)
    assert p.decide([killed(1, step=12)]).action is Action.REPLACE


def test_replacements_older_than_the_window_fall_out_of_it() -> None:
    clock = Clock()
    p = policy(clock, max_restarts=0, max_replacements=2, replacement_window_s=100.0)
    for t in (0.0, 10.0):  # two replacements, 10 s apart
        clock.now = T0 + t
        assert p.decide([killed(1, step=int(t))]).action is Action.REPLACE
    clock.now = T0 + 20.0  # a third inside the window: the group, and no restart is left
    d = p.decide([killed(1, step=20)])
    assert d.not_alone == "rank 1 not replaced alone: the replacement budget is spent (2 within 100 s)"
    assert d.give_up is GiveUp.BUDGET and d.cause == "restarts exhausted: 0 group restarts"

    q = policy(clock, max_replacements=2, replacement_window_s=100.0)
    for t in (0.0, 10.0, 105.0):  # at 105 s the replacement at 0 s has left the window
        clock.now = T0 + t
        assert q.decide([killed(1, step=int(t))]).action is Action.REPLACE
    assert q.replacements_left == 0
    clock.now = T0 + 500.0  # long after: the whole budget again
    assert q.replacements_left == 2


def test_group_restarts_older_than_their_window_fall_out_of_it() -> None:
    clock = Clock()
    p = policy(clock, replace="group", max_restarts=2, restart_window_s=100.0)
    for t in (0.0, 10.0):
        clock.now = T0 + t
        assert p.decide([killed(1, step=int(t))]).action is Action.RESTART
    clock.now = T0 + 20.0
    d = p.decide([killed(1, step=20)])
    assert d.give_up is GiveUp.BUDGET and d.cause == "restarts exhausted: 2 group restarts within 100 s"


def test_without_a_window_every_restart_of_the_job_counts() -> None:
    clock = Clock()
    p = policy(clock, replace="group", max_restarts=1)
    assert p.decide([killed(0)]).action is Action.RESTART
    clock.now = T0 + 86_400.0
    assert p.decide([killed(0, step=99)]).give_up is GiveUp.BUDGET


def test_replace_group_restarts_the_group_for_any_death() -> None:
    p = policy(replace="group")
    d = p.decide([killed(1, step=50)])
    assert d == Decision(Action.RESTART)
    assert p.cfg.replace is Replace.GROUP


def test_a_missed_heartbeat_is_a_death_like_any_other() -> None:
    p = policy()
    silent = Death(1, -9, at(12, generation=2), missed_heartbeat=True)
    assert p.decide([silent]) == Decision(Action.REPLACE, ranks=(1,))
    # silent before its first beat (the start-up timeout): the group
    d = p.decide([Death(0, -9, None, missed_heartbeat=True)])
    assert d.action is Action.RESTART and "before its first step" in (d.not_alone or "")


def test_when_the_agent_cannot_replace_alone_the_group_decides() -> None:
    d = policy().decide([killed(1)], can_replace=False)
    assert d == Decision(Action.RESTART)


def test_a_verdict_wins_over_the_repeat_rule_which_wins_over_exclusion() -> None:
    p = policy(replace="group", max_repeats=2, max_health_failures=1)
    assert p.decide([killed(0, step=5)]).action is Action.RESTART
    d = p.decide([Death(0, 76, at(5), unhealthy=True)])  # a repeat, and a health failure, and 76
    assert d.action is Action.REQUEUE
    assert p.history.health_failures == 1  # still counted

    q = policy(replace="group", max_repeats=2, max_health_failures=2)
    assert q.decide([killed(0, step=5, unhealthy=True)]).action is Action.RESTART
    d = q.decide([killed(0, step=5, unhealthy=True)])  # the second repeat and health failure
    assert (d.action, d.give_up) == (Action.GIVE_UP, GiveUp.REPEATS)


def test_a_round_needs_a_death_and_the_config_is_checked() -> None:
    with pytest.raises(ValueError, match="at least one death"):
        policy().decide([])
    with pytest.raises(ConfigError, match="max_repeats must be >= 1, got 0"):
        LaunchConfig(max_repeats=0)
    with pytest.raises(ConfigError, match="restart_window_s must be > 0"):
        LaunchConfig(restart_window_s=0.0)
    with pytest.raises(ValueError):
        LaunchConfig(replace="node")  # type: ignore[arg-type]


# ---- torch elastic's private state, behind one adapter (resilient/launcher/elastic.py) ------------
def test_every_private_name_the_adapter_reaches_is_in_the_installed_torch() -> None:
    # a torch upgrade that renames one fails here, not in a multi-process launch test
    import importlib

    from resilient.launcher.elastic import PRIVATE

    missing = []
    for where, name in PRIVATE:
        module, _, cls = where.partition(":")
        obj = importlib.import_module(module)
        obj = getattr(obj, cls) if cls else obj
        init = getattr(getattr(obj, "__init__", None), "__code__", None)  # attributes set in __init__
        if not hasattr(obj, name) and not (init is not None and name in init.co_names):
            missing.append(f"{where}.{name}")
    assert not missing, missing


class _Proc:
    def __init__(self, pid: int, code: int | None) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


class _Handler:
    def __init__(self, pid: int, code: int | None = None) -> None:
        import io

        self.proc = _Proc(pid, code)
        self._stdout, self._stderr = io.StringIO(), io.StringIO()


def _fake_agent(**handlers: _Handler) -> Any:
    """Shaped as torch's LocalElasticAgent is where the adapter reaches into it (torch 2.13)."""
    from types import SimpleNamespace as NS

    state = NS(round=4, participants={"n0": 0, "n1": 1}, wait_list={"n2"}, closed=False)
    rdzv = NS(_state_holder=NS(state=state), num_nodes_waiting=lambda: 1, calls=[])
    rdzv._stop_heartbeats = lambda: rdzv.calls.append("stop_heartbeats")
    rdzv._op_executor = NS(run=lambda op, deadline: rdzv.calls.append(type(op).__name__))
    spec = NS(max_restarts=3, rdzv_handler=rdzv, entrypoint="/usr/bin/python3")
    pc = NS(
        subprocess_handlers={int(k[1:]): h for k, h in handlers.items()},
        _running_local_ranks={int(k[1:]) for k in handlers},
        envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
        args={0: ("-u", "train.py"), 1: ("-u", "train.py")},
        stdouts={0: "", 1: "/tmp/out1"},
        stderrs={0: "", 1: ""},
    )
    group = NS(spec=spec)
    return NS(_remaining_restarts=3, _pcontext=pc, get_worker_group=lambda: group)


def test_the_adapter_reads_and_swaps_the_workers_processes() -> None:
    from resilient.launcher.elastic import Elastic

    agent = _fake_agent(r0=_Handler(100), r1=_Handler(101, -9))
    e = Elastic(agent)
    assert e.processes()
    assert e.exited() == [(1, -9)]  # the running one is not listed
    assert e.env(1) == {"RANK": "1"} and e.command(1) == ("/usr/bin/python3", ("-u", "train.py"))
    assert e.outputs(1) == ("/tmp/out1", None)
    old = e.process(1)
    new = _Handler(102)
    e.swap(1, new)
    assert e.process(1) is new and old._stdout.closed and old._stderr.closed
    assert e.exited() == []
    e.restarts_left -= 1
    assert e.restarts_left == 2 == agent._remaining_restarts
    e.unbound_restarts()
    assert e.restarts_left == agent.get_worker_group().spec.max_restarts > 10**6


def test_the_adapter_reads_the_rendezvous_counts_waiting_nodes_and_leaves() -> None:
    from resilient.launcher.elastic import Elastic, RendezvousView

    agent = _fake_agent(r0=_Handler(100))
    e = Elastic(agent)
    view = e.rendezvous()
    assert view == RendezvousView(4, frozenset({"n0", "n1"}), frozenset({"n2"}), False, {"n0": 0, "n1": 1})
    seen: list[tuple[int, RendezvousView | None]] = []
    e.count_waiting(lambda n, state: seen.append((n, state)) or 0)
    handler = agent.get_worker_group().spec.rdzv_handler
    assert handler.num_nodes_waiting() == 0 and seen == [(1, view)]  # torch's count, then ours
    e.leave_rendezvous()
    assert handler.calls == ["stop_heartbeats", "_RendezvousExitOp"]  # left, not shut down


def test_a_worker_dying_after_its_run_was_over_restarts_the_group_named_so() -> None:
    p = policy()
    d = p.decide([Death(1, 1, Beat(age_s=0.1, step=23, generation=0, exiting=True))])
    assert d.action is Action.RESTART
    assert d.not_alone == "rank 1 not replaced alone: it died after its run was over (while exiting)"
    assert p.history.deaths == [(1, "exit (exit code 1)")]


def test_a_new_node_waits_as_a_spare_and_a_vanished_member_counts_as_waiting() -> None:
    # (torch's agent restarts a healthy group whenever a node waits: only members that wait to
    # re-join, and a member lost from the rendezvous, make it do so here)
    from resilient.launcher.elastic import RendezvousView
    from resilient.launcher.waiting import Membership

    said: list[tuple[Any, dict[str, Any]]] = []
    m = Membership(lambda event, **kw: said.append((event, kw)), admit_waiting=False)
    assert m.count(3, None) == 3  # (no round yet: torch's count)
    m.round_started(RendezvousView(1, frozenset({"a", "b"}), frozenset(), False))
    spare = RendezvousView(1, frozenset({"a", "b"}), frozenset({"c"}), False)
    assert m.count(1, spare) == 0 and m.count(1, spare) == 0
    assert [e for e, _ in said] == ["spare_waiting"]  # (said once)
    rejoin = RendezvousView(1, frozenset({"a", "b"}), frozenset({"b", "c"}), False)
    assert m.count(2, rejoin) == 1
    lost = RendezvousView(1, frozenset({"a"}), frozenset({"c"}), False)
    assert m.count(1, lost) == 1 and said[-1] == ("node_lost", {"nodes": ["b"]})
    assert Membership(lambda *a, **k: None, admit_waiting=True).count(2, spare) == 2
