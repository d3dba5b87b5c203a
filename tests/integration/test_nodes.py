"""Several `resilient launch` agents as nodes of one job on 127.0.0.1: a node lost with a spare
waiting, a node lost with none (the job shrinks), a node that keeps failing its health checks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests._wait import wait_until
from tests.integration.conftest import EXAMPLE, STEPS, assert_bit_exact, load_states, run_example
from tests.integration.test_launcher import Launch, _finish_all

pytestmark = pytest.mark.integration

# a lost node's rendezvous keep-alive expires after 1 s x 3; a round waits 1 s for late nodes
RDZV_FAST = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1"
SPARE_STEPS = 48


class Job:
    """Agents of one c10d rendezvous on 127.0.0.1. Node 0 starts first and so hosts the rendezvous
    store (and, having the lowest agent pid, is group rank 0, whose agent hosts the workers' store)."""

    def __init__(self, tmp_path: Path, rdzv_id: str, *common: str) -> None:
        from chaos.harness import free_port

        self.tmp, self.rdzv_id = tmp_path, rdzv_id
        self.port = free_port()
        self.common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        self.common += ["--rdzv-id", rdzv_id, *common]
        self.nodes: list[Launch] = []

    def start(self, *args: str) -> Launch:
        node = Launch(self.tmp / f"node{len(self.nodes)}", *self.common, *args)
        self.nodes.append(node)

        def store_up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return True
            assert node.p.poll() is None, node.output()
            return False

        if len(self.nodes) == 1:  # the others must find node 0's rendezvous store, not host one
            wait_until(store_up, 60, lambda: f"node 0's rendezvous store:\n{node.output()}")
        return node

    def ranks(self, node: Launch) -> set[int]:
        return {e["rank"] for e in node.events() if e["event"] == "run_started" and e["rank"] >= 0}

    def lose(self, node: Launch) -> None:
        """The node is gone: its agent and workers die at once (SIGKILL; the workers by PDEATHSIG),
        and its RAM with them: the shared-memory snapshots it kept are removed."""
        os.killpg(node.p.pid, signal.SIGKILL)
        node.p.wait()
        shutil.rmtree(f"/dev/shm/resilient-{self.rdzv_id}-{node.p.pid}", ignore_errors=True)

    def finish(self) -> list[int]:
        try:
            return _finish_all(self.nodes)
        finally:
            for node in self.nodes:
                shutil.rmtree(f"/dev/shm/resilient-{self.rdzv_id}-{node.p.pid}", ignore_errors=True)


def _config(tmp_path: Path, name: str, **sections: Any) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sections))
    return str(path)


def _train(tmp_path: Path, config: str, *extra: str) -> list[str]:
    return [
        EXAMPLE, "--steps", str(STEPS), "--step-ms", "60", "--hang-timeout", "2", "--config", config,
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--out", str(tmp_path / "state"), *extra,
    ]  # fmt: skip


def _restored(node: Launch) -> list[dict[str, Any]]:
    return [e for e in node.events() if e["event"] == "state_restored" and e["generation"] == 0]


def test_lost_node_is_replaced_by_a_parked_spare_its_survivor_kept_bit_exact(tmp_path: Path) -> None:
    # 2 nodes train; a third node arrives while they run and parks as their spare (a standby in
    # the script, nothing restarted); the second node is lost (agent, workers and /dev/shm). The
    # spare sees its agent's connection drop, claims its seat and starts rank 1 from its standby;
    # rank 0 recovers in its own process. The new rank 1's RNG and data position come from the
    # store copy, its model and optimizer (too large for the 16 KiB allowed here) from rank 0's
    # snapshot of the same step, whose fingerprints equal those the lost rank posted.
    snapshot = {"interval": 1, "store_copy_max_bytes": 16384}
    cfg = _config(tmp_path, "cfg", snapshot=snapshot, events={"steps": True})
    # A run long enough for the spare's standby to be ready (a fresh process that imports torch, ~7 s
    # after the job's start on 2 busy cores) with steps left to recover in: 48 x 250 ms.
    longer = ["--steps", str(SPARE_STEPS), "--step-ms", "250"]
    job = Job(tmp_path, "spare", "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2",
              "--monitor-interval", "0.2", "--heartbeat-timeout", "10", "--rdzv-conf", RDZV_FAST)  # fmt: skip
    try:
        # (slower steps than the others': the spare's agent starts and parks before the loss)
        a, b = (job.start(*_train(tmp_path, cfg, *longer)) for _ in range(2))
        b.wait_event("checkpoint_saved", lambda e: e["step"] >= 4 and e["rank"] >= 0)
        assert job.ranks(b) == {1}, "node 1 should hold rank 1 (node 0 started first)"
        spare = job.start(*_train(tmp_path, cfg, *longer))
        spare.wait_event("spare_parked")
        spare.wait_event("standby_ready")
        pid0 = _pid(a, 0)
        t_loss = time.time()
        job.lose(b)
        rcs = [job.nodes[i].finish() for i in (0, 2)]
    finally:
        job.finish()
    assert rcs == [0, 0], [a.output(), spare.output()]
    said = [e["event"] for e in a.events() if e["rank"] == -1]
    assert "relaunched" not in said and "group_stopped" not in said, said
    assert _pid(a, 0) == pid0 and len([e for e in a.events() if e["event"] == "run_started"]) == 1
    (taken,) = [e for e in spare.events() if e["event"] == "seat_taken"]
    assert taken["ranks"] == [1] and taken["warm"] == 1, taken
    assert job.ranks(spare) == {1}, spare.output()
    restored = [e for n in (a, spare) for e in _restored_since(n, t_loss)]
    assert len(restored) == 2 and len({e["step"] for e in restored}) == 1, restored
    assert {e["rank"]: e["source"] for e in restored} == {0: "ring", 1: "store+peer"}, restored
    done = max(e["step"] for e in a.events() if e["event"] == "step_completed" and e["ts"] < t_loss)
    assert done + 1 - restored[0]["step"] <= 1, (done, restored)  # at most the step in flight re-runs
    ref = run_example(tmp_path / "ref", 2, "--steps", str(SPARE_STEPS))
    assert ref.ok, ref.describe()
    finals = [torch.load(tmp_path / "state" / f"rank{r}.pt") for r in range(2)]
    assert_bit_exact(load_states(tmp_path / "ref", 2), finals)


def _restored_since(node: Launch, ts: float) -> list[dict[str, Any]]:
    return [e for e in node.events() if e["event"] == "state_restored" and e["ts"] > ts]


def _pid(node: Launch, rank: int) -> int:
    return int(next(e["pid"] for e in node.events() if e["event"] == "run_started" and e["rank"] == rank))


# (slow session, to keep CI within its budget: a lost node with a spare runs in CI)
@pytest.mark.slow
def test_lost_node_without_a_spare_shrinks_the_job(tmp_path: Path) -> None:
    # 3 nodes x 1 rank (a late third node is admitted: --admit-waiting); the middle one is lost and
    # nothing waits: the job goes on with 2 ranks. New rank 1 takes old rank 1's RNG and data
    # position from the store copy, and its model and optimizer from its own node's copy (old
    # rank 2's), whose fingerprint is the one old rank 1 posted: nothing is sent.
    cfg = _config(tmp_path, "cfg", snapshot={"interval": 1, "store_copy_max_bytes": 16384})
    job = Job(tmp_path, "shrink", "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2",
              "--monitor-interval", "0.2", "--heartbeat-timeout", "10", "--admit-waiting",
              "--rdzv-conf", RDZV_FAST)  # fmt: skip
    try:
        nodes = [job.start(*_train(tmp_path, cfg)) for _ in range(3)]

        def saved_step_8(n: Launch) -> bool:
            return any(
                e["event"] == "checkpoint_saved" and e["rank"] >= 0 and e["step"] >= 8 for e in n.events()
            )

        wait_until(  # all three train (a late one was admitted with a restart)
            lambda: all(saved_step_8(n) for n in nodes),
            120,
            lambda: f"all three nodes to save a checkpoint at step >= 8: {[n.output() for n in nodes]}",
            interval=0.1,
        )
        victim = next(n for n in nodes[1:] if 1 in job.ranks(n) and 0 not in job.ranks(n))
        job.lose(victim)
        survivors = [n for n in nodes if n is not victim]
        rcs = [n.finish() for n in survivors]
    finally:
        job.finish()
    assert rcs == [0, 0], [n.output() for n in survivors]
    restored = [e for n in survivors for e in _restored(n) if e.get("world_from") == 3]
    assert len(restored) == 2 and all(e["world"] == 2 for e in restored), restored
    orphan = next(e for e in restored if e["rank"] == 1)
    assert orphan["sources"]["data"] == "store" and orphan["sources"]["model"] == "shm", orphan
    finals = [torch.load(tmp_path / "state" / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(finals[0]["model"]["head.weight"], finals[1]["model"]["head.weight"])
    finished = [e for n in survivors for e in n.events() if e["event"] == "run_finished"]
    assert {e["step"] for e in finished} == {STEPS - 1}, finished


@pytest.fixture
def full_disk(tmp_path: Path) -> Any:
    """A real, full 1 MiB tmpfs (root only); unmounted even if the test fails."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        with contextlib.suppress(OSError), open(mnt / "fill", "wb") as f:
            f.write(b"\0" * (2 << 20))  # ENOSPC: the disk is full
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # (CI: health checks unit-tested; a lost node's exclusion is the spare tests')
def test_node_failing_health_checks_is_excluded(
    tmp_path: Path, full_disk: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # node 1's checkpoint disk is full: its worker fails the health check every time it starts.
    # After two such restarts its agent leaves the job (exit 75) and node 0 trains alone.
    ok = _config(tmp_path, "ok")
    bad = _config(tmp_path, "bad", health={"checkpoint_dir": str(full_disk), "min_free_disk_mb": 1})
    job = Job(tmp_path, "exclude", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
              "--monitor-interval", "0.2", "--heartbeat-timeout", "10", "--max-health-failures", "2",
              "--rdzv-conf", RDZV_FAST.replace("last_call_timeout=1", "last_call_timeout=10"))  # fmt: skip
    try:
        a = job.start(EXAMPLE, "--steps", str(STEPS), "--config", ok, "--out", str(tmp_path / "state"))
        b = job.start(EXAMPLE, "--steps", str(STEPS), "--config", bad, "--out", str(tmp_path / "bad"))
        rcs = job.finish()
    finally:
        job.finish()
    assert rcs == [0, 75], [a.output(), b.output()]
    excluded = [e for e in b.events() if e["event"] == "node_excluded"]
    assert len(excluded) == 1 and excluded[0]["checks"][0]["check"] == "checkpoint_dir", excluded
    assert "left the job after 2 failed health checks" in b.output()
    assert_bit_exact(reference[1], [torch.load(tmp_path / "state" / "rank0.pt")])


@pytest.mark.slow  # (CI runs the parked spare above; this is the start every node at once, as srun does)
def test_a_node_started_with_the_others_beyond_nnodes_parks_as_their_spare(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # three agents started together for --nnodes 2 (an allocation of three nodes, one launcher
    # each): the one that finds the round full parks as its spare; the node holding rank 1 is
    # lost and the spare takes its seat; every agent ends with 0, the spare too.
    cfg = _config(tmp_path, "cfg", snapshot={"interval": 1, "store_copy_max_bytes": 16384})
    job = Job(tmp_path, "together", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2",
              "--monitor-interval", "0.2", "--heartbeat-timeout", "10", "--rdzv-conf", RDZV_FAST)  # fmt: skip
    try:
        nodes = [job.start(*_train(tmp_path, cfg, "--step-ms", "300")) for _ in range(3)]
        wait_until(
            lambda: sum(any(e["event"] == "spare_parked" for e in n.events()) for n in nodes) == 1,
            120,
            lambda: f"one node parked as the spare: {[n.output()[-2000:] for n in nodes]}",
            interval=0.1,
        )
        spare = next(n for n in nodes if any(e["event"] == "spare_parked" for e in n.events()))
        spare.wait_event("standby_ready")
        victim = next(n for n in nodes if 1 in job.ranks(n))
        victim.wait_event("checkpoint_saved", lambda e: e["step"] >= 4 and e["rank"] >= 0)
        job.lose(victim)
        rcs = [n.finish() for n in nodes if n is not victim]
    finally:
        job.finish()
    assert rcs == [0, 0], [n.output()[-3000:] for n in nodes]
    assert [e["ranks"] for e in spare.events() if e["event"] == "seat_taken"] == [[1]]
    assert_bit_exact(reference[2], [torch.load(tmp_path / "state" / f"rank{r}.pt") for r in range(2)])
