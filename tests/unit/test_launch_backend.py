"""The launcher's backend seam: its decisions and replacements run against an in-memory
:class:`~resilient.launcher.backend.WorkerBackend` (no process, no torch elastic, no sleep).

Workers beat real heartbeat files and die as the test says; each round is the agent's
(:meth:`Supervisor.tend`, then :meth:`Supervisor.act` for the group); a dead rank's fault, posted
through :mod:`resilient.contract` alone, is what the runtime's ``Coordinator`` reads, key for key
and byte for byte.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from resilient import contract
from resilient.contract import Heartbeat, beat_path, mark_replace, mark_unhealthy
from resilient.errors import ExitCode
from resilient.events import Event
from resilient.launcher.backend import Invocation, Slot, WorkerBackend
from resilient.launcher.policy import Action, Decision, GiveUp, LaunchConfig, LaunchPolicy
from resilient.launcher.replace import Replacer
from resilient.launcher.supervisor import Supervisor
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom, signature

NS = contract.run_namespace("job", "0")


def test_a_death_record_is_the_fault_record_the_runtime_writes_for_it() -> None:
    cause = "killed by SIGSEGV at 0x7f3a after 12.5 s"
    raw = contract.death_record(3, 2, 40, cause)
    rec = FaultRecord.from_json(raw)
    assert rec.to_json() == raw  # (every field, in the runtime's order)
    ours = FaultRecord(
        rank=3,
        generation=2,
        step=40,
        kind=Symptom.DIED.value,
        severity=Severity.SOFT.value,
        signature=signature(Symptom.DIED, RuntimeError(cause)),
        message=f"worker process of rank 3 {cause}",
        ts=rec.ts,
    )
    assert rec == ours
    assert rec.signature == "died: killed by SIGSEGV at N after N s"


def test_a_death_posted_through_the_contract_is_the_generations_fault_the_coordinator_reads() -> None:
    raw = contract.death_record(1, 4, 7, "exit code 1")
    by_contract, by_runtime = dist.HashStore(), dist.HashStore()
    assert contract.publish_fault(by_contract, NS, 4, 1, raw) == raw.encode()
    Coordinator(by_runtime, NS, -1, 0, 1.0).post_fault(FaultRecord.from_json(raw))
    keys = [contract.generation_key(NS, 4, *k) for k in (("fault",), ("fault", 1), ("done", "release"))]
    assert [by_contract.get(k) for k in keys] == [by_runtime.get(k) for k in keys]
    assert by_contract.get(keys[2]).decode() == contract.FAULTED

    survivor = Coordinator(by_contract, NS, 0, 2, 1.0)
    assert survivor.primary_fault(4) == FaultRecord.from_json(raw)
    assert [o["rank"] for o in survivor.observations(4)] == [1]
    assert json.loads(by_contract.get(keys[0]))["kind"] == contract.DIED
    assert survivor.finish_barrier(4) is False  # a rank that returned recovers with the others


# ---- an in-memory backend -------------------------------------------------------------------------
@dataclasses.dataclass
class _Proc:
    pid: int

    def wait(self, timeout: float | None = None) -> int:
        return 0


@dataclasses.dataclass
class _Handle:
    proc: _Proc


class FakeBackend:
    """Two workers of one node, in memory: each beats a real heartbeat file; one dies when the
    test says (its exit code is reported at the next look); what the flow asks is recorded."""

    def __init__(self, heartbeat_dir: Path, n: int = 2) -> None:
        self.store = dist.HashStore()
        self._pids = itertools.count(1000)
        self.slots = {r: Slot(r, 4 + r, next(self._pids)) for r in range(n)}  # (this node: ranks 4, 5)
        self.hearts = {r: Heartbeat(beat_path(heartbeat_dir, r)) for r in range(n)}
        self.dying: dict[int, int] = {}
        self.killed: list[int] = []
        self.spawned: list[tuple[int, dict[str, str]]] = []
        self.group: list[tuple[str, str | None]] = []  # ("restart" | "stop", why not one rank alone)

    # the backend
    def workers(self) -> list[Slot]:
        return [self.slots[r] for r in sorted(self.slots)]

    def exited(self) -> list[tuple[int, int]]:
        out, self.dying = sorted(self.dying.items()), {}
        return out

    def processes(self) -> bool:
        return True

    def invocation(self, local_rank: int) -> Invocation:
        env = {
            "RANK": str(self.slots[local_rank].global_rank),
            "TORCHELASTIC_RUN_ID": "job",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
        return Invocation("/opt/bin/train", ("--steps", "100"), env, None, None)

    def spawn(self, local_rank: int, env: dict[str, str]) -> _Handle:
        self.spawned.append((local_rank, env))
        return _Handle(_Proc(next(self._pids)))

    def adopt(self, local_rank: int, new: Any) -> None:
        self.slots[local_rank] = dataclasses.replace(self.slots[local_rank], pid=new.proc.pid)

    def kill(self, local_rank: int) -> None:
        self.killed.append(local_rank)

    def connect_store(self) -> dist.Store:
        return self.store

    def restart_group(self, reason: str | None) -> None:
        self.group.append(("restart", reason))

    def stop_group(self, reason: str | None) -> None:
        self.group.append(("stop", reason))

    # the test's hands
    def step(self, step: int, generation: int = 0) -> None:
        for heart in self.hearts.values():
            heart.generation = generation
            heart.beat(step)

    def die(self, local_rank: int, exitcode: int) -> None:
        self.dying[local_rank] = exitcode


class Node:
    """The agent's flow on one node, against :class:`FakeBackend`."""

    def __init__(self, tmp: Path, **cfg: Any) -> None:
        self.now = 100.0
        self.backend = FakeBackend(tmp)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.policy = LaunchPolicy(LaunchConfig(**cfg), clock=lambda: self.now)
        replacer = Replacer(self.backend, tmp, self.emit, standby=0, budgets=self.policy.budgets)
        self.sup = Supervisor(
            self.backend,
            self.policy,
            replacer,
            tmp,
            heartbeat_timeout=30.0,
            startup_timeout=60.0,
            emit=self.emit,
            clock=lambda: self.now,
        )
        self.sup.fault_stacks = False  # (py-spy on a pid that is no process of ours)
        self.sup.starting()
        self.sup.started()

    def emit(self, event: str, **fields: Any) -> None:
        self.events.append((Event(event).value, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == event]

    def monitor(self) -> Decision | None:
        """One of the agent's monitor rounds (``ResilientAgent._monitor_workers``)."""
        found = self.sup.tend()
        if found is not None and found.decision.action is not Action.REPLACE:
            self.sup.act(found.decision)  # (the agent: once torch stopped the others)
            return found.decision
        self.sup.keep_standbys()
        return None if found is None else found.decision


@pytest.fixture(autouse=True)
def _namespace_from_the_workers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RESILIENT_RUN_ID", "RESILIENT_LAUNCH_ROUND"):  # (set under a launcher of our own)
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_torch_elastic_and_the_fake_each_have_every_method_of_the_seam() -> None:
    from resilient.launcher.elastic import Elastic

    seam = {n for n, v in vars(WorkerBackend).items() if callable(v) and not n.startswith("_")}
    assert seam == {
        "workers",
        "exited",
        "processes",
        "invocation",
        "spawn",
        "adopt",
        "kill",
        "connect_store",
        "restart_group",
        "stop_group",
    }
    for backend in (FakeBackend, Elastic):  # (mypy holds Elastic to the signatures: the agent passes it)
        assert [n for n in sorted(seam) if not callable(getattr(backend, n, None))] == [], backend


def test_a_rank_that_dies_while_stepping_is_replaced_alone_its_death_posted(node: Node) -> None:
    b = node.backend
    b.step(12, generation=2)
    assert node.monitor() is None  # every worker beats
    old = b.slots[1].pid
    b.die(1, 1)
    d = node.monitor()
    assert d == Decision(Action.REPLACE, ranks=(5,))
    assert b.killed == [1] and b.group == []  # its session ended; the group left alone
    ((local, env),) = b.spawned
    assert (
        local == 1
        and env["RESILIENT_JOIN_GENERATION"] == "2"
        and env["RESILIENT_PREDECESSOR_PID"] == str(old)
    )
    assert b.slots[1].pid != old
    (died,) = node.named("worker_died")
    assert (died["global_rank"], died["cause"]) == (5, "exit code 1")
    (replaced,) = node.named("rank_replaced")
    assert replaced["fault_posted"] and replaced["new_pid"] == b.slots[1].pid
    assert replaced["replacements_left"] == 9 and replaced["restarts_left"] == 3
    fault = Coordinator(b.store, NS, 0, 8, 1.0).primary_fault(2)  # what the survivors' listeners read
    assert fault is not None and (fault.rank, fault.kind, fault.step) == (5, "died", 12)
    assert not beat_path(node.sup.heartbeat_dir, 1).exists()  # (its successor's beats are its own)


def test_when_the_replacement_budget_is_spent_the_group_restarts(tmp_path: Path) -> None:
    node = Node(tmp_path, max_replacements=1)
    b = node.backend
    b.step(5)
    b.die(0, 1)
    assert node.monitor() == Decision(Action.REPLACE, ranks=(4,))
    b.step(9, generation=1)
    b.die(1, 1)
    d = node.monitor()
    assert d is not None and d.action is Action.RESTART
    why = "rank 5 not replaced alone: the replacement budget is spent (1 within 3600 s)"
    assert b.group == [("restart", why)] and len(b.spawned) == 1
    assert node.sup.verdict is None


def test_a_worker_that_never_beats_is_killed_at_its_startup_limit_and_the_group_restarts(
    node: Node,
) -> None:
    assert node.monitor() is None
    assert node.sup.silence_deadline() == pytest.approx(100.0 + 60.0 + 1e-3)
    node.now += 61.0
    d = node.monitor()
    assert d is not None and d.action is Action.RESTART
    assert node.backend.killed == [0]  # the first silent one: one per round
    (missed,) = node.named("heartbeat_missed")
    assert (missed["global_rank"], missed["limit_s"], missed["last_step"]) == (4, 60.0, None)
    assert node.named("worker_died") == []  # (announced once, as missed)
    assert node.backend.group == [("restart", "rank 4 not replaced alone: it died before its first step")]


def test_a_worker_that_gives_up_stops_the_group_with_its_verdict(node: Node) -> None:
    node.backend.step(3)
    node.backend.die(1, int(ExitCode.FATAL))
    d = node.monitor()
    assert d is not None and d.action is Action.GIVE_UP and d.give_up is GiveUp.WORKER
    assert node.backend.group == [("stop", "rank 5 not replaced alone: its exit code 3 is a verdict")]
    assert node.sup.verdict == int(ExitCode.FATAL)


def test_a_node_failing_its_health_checks_is_excluded(tmp_path: Path) -> None:
    node = Node(tmp_path, max_health_failures=1)
    node.backend.step(3)
    mark_unhealthy(tmp_path, 0, "gpu_temp", 95, "over 90 C")
    node.backend.die(0, 1)
    d = node.monitor()
    assert d is not None and d.action is Action.EXCLUDE
    assert node.sup.excluded and node.backend.group[0][0] == "stop"
    (excluded,) = node.named("node_excluded")
    assert excluded["checks"][0]["check"] == "gpu_temp" and node.sup.health_failures


def test_a_rank_marked_for_replacement_is_ended_and_replaced_alone(node: Node) -> None:
    node.backend.step(20)
    assert mark_replace(node.sup.heartbeat_dir, 1, {"cause": "a straggler (2.5x its peers)"})
    assert node.monitor() == Decision(Action.REPLACE, ranks=(5,))
    assert node.backend.killed[0] == 1
    assert node.named("rank_replaced")[0]["cause"] == "a straggler (2.5x its peers)"
