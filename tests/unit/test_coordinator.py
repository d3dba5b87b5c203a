"""The store protocol, with one in-process HashStore shared by one Coordinator per simulated rank."""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from resilient.errors import CoordinationError, PeerAborted, SetupFailed, StateRestoreError
from resilient.runtime.coordination.agreement import RestorePlan
from resilient.runtime.coordination.coordinator import Coordinator, Endpoint, agree_run_id, endpoint_from_env
from resilient.runtime.faults.records import FaultRecord

NS = "resilient/run1/a0"


def ranks(world: int, timeout: float = 2.0, store: dist.Store | None = None) -> list[Coordinator]:
    store = store if store is not None else dist.HashStore()
    return [Coordinator(store, NS, r, world, timeout) for r in range(world)]


def record(
    rank: int, generation: int = 0, step: int = 7, sig: str = "exception: ValueError: x"
) -> FaultRecord:
    return FaultRecord(rank, generation, step, "exception", "soft", sig, f"ValueError: from rank {rank}")


class Concurrently:
    """Run callables in threads (ranks that must wait at the same time); collect results or errors."""

    def __init__(self, *fns: Callable[[], Any]) -> None:
        self.results: list[Any] = [None] * len(fns)
        self.errors: list[BaseException | None] = [None] * len(fns)
        self._threads = [
            threading.Thread(target=self._run, args=(i, f), daemon=True) for i, f in enumerate(fns)
        ]
        for t in self._threads:
            t.start()

    def _run(self, i: int, fn: Callable[[], Any]) -> None:
        try:
            self.results[i] = fn()
        except BaseException as e:
            self.errors[i] = e

    @classmethod
    def each(cls, coords: list[Coordinator], fn: Callable[[Coordinator], Any]) -> Concurrently:
        """Every rank runs ``fn(its coordinator)`` at the same time."""
        return cls(*[lambda co=co: fn(co) for co in coords])

    def join(self, timeout: float = 10.0) -> Concurrently:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            assert not t.is_alive(), "a simulated rank is still blocked"
        return self


def test_first_poster_is_the_primary_for_everyone():
    c = ranks(3)
    first = record(rank=2, sig="collective: RuntimeError: Connection closed by peer")
    assert c[2].post_fault(first) == first
    assert c[0].post_fault(record(rank=0)) == first
    assert c[1].post_fault(record(rank=1)) == first
    for co in c:
        assert co.primary_fault(0) == first
    obs = c[0].observations(0)
    assert sorted(o["rank"] for o in obs) == [0, 1, 2]


def test_concurrent_posters_agree_on_one_primary():
    c = ranks(4)
    run = Concurrently.each(c, lambda co: co.post_fault(record(rank=co.rank))).join()
    assert run.errors == [None] * 4
    assert len({r.rank for r in run.results}) == 1
    assert c[0].primary_fault(0) == run.results[0]


def test_faults_are_scoped_to_their_generation_and_namespace():
    store = dist.HashStore()
    c = ranks(2, store=store)
    c[0].post_fault(record(rank=0, generation=0))
    assert c[1].primary_fault(0) is not None
    assert c[1].primary_fault(1) is None
    other_attempt = Coordinator(store, "resilient/run1/a1", 0, 2, 2.0)
    assert other_attempt.primary_fault(0) is None


class Counting:
    """A store that counts the requests each method gets (and the keys a multi_get reads)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.calls, self.keys_read = store, collections.Counter(), 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def counted(*a: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            if name == "multi_get":
                self.keys_read += len(a[0])
            return fn(*a, **kw)

        return counted


def test_recovery_barrier_returns_the_step_every_rank_holds_read_once():
    store = Counting(dist.HashStore())
    c = ranks(4, store=store)  # type: ignore[arg-type]
    steps = [[12, 11], [12, 11], [12, 10], [11, 12]]
    run = Concurrently.each(c, lambda co: co.recovery_barrier(0, steps[co.rank])).join()
    assert run.errors == [None] * 4
    assert run.results == [RestorePlan(step=12, empty=[])] * 4
    # the last to arrive read every payload, once; the others read only the release key
    assert store.calls["multi_get"] == 1 and store.keys_read == 4


@pytest.mark.parametrize(
    ("steps", "error", "match"),
    [
        ([[3], [], [3]], SetupFailed, r"ranks \[1\] hold no snapshot"),
        ([[3], [4], [3]], StateRestoreError, r"no snapshot step held by every rank: \[\[3\], \[4\], \[3\]\]"),
    ],
)
def test_every_rank_raises_the_same_error_from_the_plan(steps: list[list[int]], error: type, match: str):
    c = ranks(3)
    run = Concurrently.each(c, lambda co: co.recovery_barrier(0, steps[co.rank]).restore_step()).join()
    for e in run.errors:
        assert isinstance(e, error) and re.search(match, str(e)), e


def test_agree_reduces_a_vote_to_one_value():
    c = ranks(3)
    for how, votes, want in (
        ("any", "010", "1"),
        ("all", "110", "0"),
        ("all", "111", "1"),
        ("first", "abc", "a"),
    ):
        run = Concurrently.each(c, lambda co, v=votes, h=how: co.agree(0, f"v{h}{v}", v[co.rank], h)).join()
        assert run.results == [want] * 3, (how, votes)


def test_abort_generation_releases_waiting_ranks_with_the_reason():
    c = ranks(3)
    run = Concurrently(lambda: c[0].recovery_barrier(1, [5]), lambda: c[1].recovery_barrier(1, [5]))
    c[2].abort_generation(1, "health check 'gpu' failed")
    run.join()
    for e in run.errors:
        assert isinstance(e, PeerAborted)
        assert "generation 1" in str(e) and "rank 2: health check 'gpu' failed" in str(e)
    # a rank arriving at the done barrier of that generation is turned away too
    with pytest.raises(PeerAborted, match="rank 2: health check"):
        c[0].finish_barrier(1)


def test_barrier_times_out_naming_how_many_arrived():
    c = ranks(3, timeout=0.3)
    run = Concurrently(lambda: c[0].recovery_barrier(0, [3]), lambda: c[1].recovery_barrier(0, [3])).join()
    for e in run.errors:
        assert isinstance(e, CoordinationError)
        assert "only 2/3 ranks arrived" in str(e)
        assert "'recover'" in str(e)


def test_finish_barrier_true_when_every_rank_returned():
    c = ranks(3)
    run = Concurrently.each(c, lambda co: co.finish_barrier(0)).join()
    assert run.errors == [None] * 3
    assert run.results == [True] * 3


def test_finish_barrier_false_when_a_fault_was_posted():
    c = ranks(3)
    # ranks 0 and 1 returned from the function; rank 2 fails its last step
    run = Concurrently(lambda: c[0].finish_barrier(2), lambda: c[1].finish_barrier(2))
    c[2].post_fault(record(rank=2, generation=2))
    run.join()
    assert run.errors == [None, None]
    assert run.results == [False, False]
    # all three then meet in the recovery barrier of the same generation
    rec = Concurrently.each(c, lambda co: co.recovery_barrier(2, [co.rank])).join()
    assert rec.results == [RestorePlan(step=None, empty=[], held=[[0], [1], [2]])] * 3


def test_finish_barrier_times_out():
    c = ranks(2, timeout=0.2)
    with pytest.raises(CoordinationError, match="generation 0"):
        c[0].finish_barrier(0)


# -- endpoint and run id --------------------------------------------------------------------------

TORCHRUN = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "RANK": "5"}


def test_single_process_defaults():
    assert endpoint_from_env({}) == Endpoint("127.0.0.1", 0, 0, 1, 0, True)


def test_torchrun_variables():
    env = dict(TORCHRUN, RANK="1", WORLD_SIZE="8")
    assert endpoint_from_env(env) == Endpoint("node0", 29500, 1, 8, 1, False)
    assert endpoint_from_env(dict(env, RANK="0", LOCAL_RANK="0")).hosts_store is True


def test_agent_store_makes_rank_zero_a_client():
    env = dict(TORCHRUN, RANK="0", LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
    ep = endpoint_from_env(env)
    assert ep.rank == 0 and ep.hosts_store is False


def test_multi_rank_without_master_addr_is_an_error():
    with pytest.raises(CoordinationError, match="MASTER_ADDR"):
        endpoint_from_env({"WORLD_SIZE": "2", "RANK": "1"})


def test_rank_outside_world_is_an_error():
    with pytest.raises(CoordinationError, match="RANK=5"):
        endpoint_from_env(TORCHRUN)


def test_run_id_from_env_or_agreed_through_the_store():
    store = dist.HashStore()
    assert agree_run_id(store, {"RESILIENT_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "tel"}) == "mine"
    assert agree_run_id(store, {"TORCHELASTIC_RUN_ID": "tel"}) == "tel"
    a = agree_run_id(store, {"TORCHELASTIC_RUN_ID": "none"})
    b = agree_run_id(store, {})
    assert a == b and len(a) == 12


def test_the_store_host_departs_last() -> None:
    host, peer = ranks(2)
    left = threading.Event()

    def host_leaves() -> None:
        host.depart(0, hosting=True, timeout=10.0)
        left.set()

    t = threading.Thread(target=host_leaves, daemon=True)
    t.start()
    assert not left.wait(0.3)  # the peer has not left: the host stays
    peer.depart(0, hosting=False)  # a peer never waits
    assert left.wait(5.0)
    t.join()


def test_the_store_host_stops_waiting_for_a_dead_peer() -> None:
    host, _ = ranks(2)
    t0 = time.monotonic()
    host.depart(0, hosting=True, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_ddp_layouts_are_agreed_in_the_recovery_barrier_not_in_a_second_one() -> None:
    import json

    from resilient.runtime.coordination.agreement import restore_plan
    from resilient.runtime.keeping.buckets import agreed

    def post(steps: list[int], layout: str) -> str:
        return json.dumps({"steps": steps, "layout": layout})

    same = RestorePlan.parse(restore_plan([post([8, 4], "a"), post([8, 4], "a")]))
    assert same == RestorePlan(step=8, empty=[], layout_same=True)
    differ = RestorePlan.parse(restore_plan([post([8, 4], "a"), post([4], "b")]))
    assert differ.step == 4 and differ.layout_same is False
    assert RestorePlan.parse(restore_plan(["[8, 4]", "[8]"])).layout_same is None  # (lists: as before)
    asked: list[str] = []

    def fallback(name: str, value: str, timeout: float) -> bool:
        asked.append(value)
        return True

    all_same = agreed("a", False, fallback)
    assert all_same("layouts", "a", 1.0) is False and asked == []  # the barrier's verdict, no request
    assert all_same("layouts", "changed", 1.0) is True and asked == ["changed"]  # another: asked
    assert agreed("a", None, fallback)("layouts", "a", 1.0) is True and asked == ["changed", "a"]
