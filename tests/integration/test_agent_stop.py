"""The agent's SIGTERM ends a worker at once, even one blocked in C++ in a recovery barrier.

Under `resilient launch` a worker's SIGTERM is also a preemption signal (Slurm sends one to every
process of a job step): the runtime installs a Python handler for it, and tells the agent's own
SIGTERM (``agent.stopping`` marked first) from a scheduler's. A Python handler runs only when the
main thread is back in the interpreter: one blocked in a store ``wait`` (a recovery barrier waiting
for a dead peer) ran it only when the barrier timed out, and torch's agent SIGKILLed it 30 s after
its SIGTERM first (a lost node's survivor held up its whole group's restart so).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from resilient.contract import wait_exited
from tests._wait import wait_until
from tests.integration.conftest import EXAMPLE
from tests.integration.test_launcher import Launch

pytestmark = pytest.mark.integration

PROMPT_S = 3.0  # the agent's SIGTERM → the worker gone; without the fix: the barrier's timeout (27 s)


def _sleeping_in_the_kernel(pid: int) -> bool:
    """The process's main thread waits in a system call (not running Python code)."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "S"


@pytest.mark.timeout(180)
def test_the_agents_sigterm_ends_a_worker_blocked_in_a_recovery_barrier_at_once(tmp_path: Path) -> None:
    run = Launch(
        tmp_path,
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "0.2",
        "--replace", "group", "--heartbeat-timeout", "120", "--startup-timeout", "120",
        EXAMPLE, "--steps", "100000", "--step-ms", "20", "--hang-timeout", "3",
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1000",
    )  # fmt: skip
    try:
        survivor = int(run.wait_event("run_started", lambda e: e["rank"] == 0, timeout=120)["pid"])
        peer = int(run.wait_event("run_started", lambda e: e["rank"] == 1, timeout=120)["pid"])
        run.wait_event("progress", lambda e: e["rank"] == 0, timeout=120)
        # rank 1 stops (a node gone silent): rank 0 sees the hang, leaves its step and waits for
        # rank 1 in the recovery barrier (27 s at most), in the store's C++ ``wait``
        os.kill(peer, signal.SIGSTOP)
        run.wait_event("health_checked", lambda e: e["rank"] == 0 and e["step"] is not None, timeout=60)
        wait_until(lambda: _sleeping_in_the_kernel(survivor), 10, "rank 0 blocked in the recovery barrier")
        # rank 1 dies: its agent stops the group (max-restarts 0), rank 0 with a SIGTERM
        os.kill(peer, signal.SIGKILL)
        died = run.wait_event("worker_died", lambda e: e["global_rank"] == 1, timeout=30)  # (SIGTERM next)
        assert wait_exited(survivor, 60), run.output()
        late = time.time() - died["ts"]
        assert not [e for e in run.events() if e["event"] == "restore_agreed"], "rank 0 was not blocked"
        assert late < PROMPT_S, f"rank 0 outlived its agent's SIGTERM by {late:.1f} s:\n{run.output()}"
        assert run.finish(timeout=30) != 0, run.output()
    finally:
        if not run.log.closed:  # (whatever failed: the launcher and every worker, rank 1 stopped or not)
            run.finish(timeout=1)
