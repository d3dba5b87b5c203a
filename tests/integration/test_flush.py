"""Flush on death (``checkpoint.flush_on_death``): a dead worker's newest shared-memory snapshots
reach ``checkpoint.dir`` through its agent, so a requeued job or a lost node loses nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient.checkpoint import flushed
from resilient.errors import ExitCode
from tests.integration.conftest import assert_bit_exact
from tests.integration.test_launcher import _example, _final_states

pytestmark = pytest.mark.integration


def _config(tmp_path: Path) -> str:
    path = tmp_path / "flush.yaml"
    # (the example sets checkpoint.dir from --ckpt-dir; every step is mirrored)
    path.write_text(yaml.safe_dump({"snapshot": {"interval": 1}, "checkpoint": {"flush_on_death": True}}))
    return str(path)


# (CI's budget: the flush and its resume are unit-tested in test_resume.py; this runs a job twice)
@pytest.mark.slow
def test_a_job_that_gives_up_resumes_where_it_died_not_at_its_last_checkpoint(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # rank 1 segfaults at step 15 and the launcher may neither replace it nor restart the group
    # (--max-replacements 0 --max-restarts 0): it gives
    # up. Its agent flushed the dead rank's snapshots at the death and rank 0's before its shared
    # memory went; the same job launched again resumes at the step they hold, not at the last
    # checkpoint (step 10), and ends bit for bit where a fault-free run ends.
    cfg = _config(tmp_path)
    common = ("--config", cfg, "--step-ms", "60", "--ckpt-every", "10")
    first = _example(tmp_path, *common, "--fault", "segfault@15:1", replace="rank",
                     launch=("--max-restarts", "0", "--max-replacements", "0"))  # fmt: skip
    rc = first.finish()
    assert rc == int(ExitCode.FATAL), first.output()
    events = first.events()
    flushes = {e["global_rank"]: e for e in events if e["event"] == "snapshot_flushed"}
    assert set(flushes) == {0, 1}, [e for e in events if e["rank"] == -1]
    assert flushes[1]["why"] == "death" and flushes[0]["why"] == "exit", flushes
    assert all("error" not in e and e["nbytes"] > 0 for e in flushes.values()), flushes
    died_at = max(flushes[1]["steps"])
    assert died_at >= 14, flushes  # (step 15 was in flight when it died)

    second = _example(tmp_path, *common)  # the requeue: the same job, fault-free this time
    assert second.finish() == 0, second.output()
    restored = [e for e in second.events() if e["event"] == "state_restored" and e["ts"] > events[-1]["ts"]]
    assert {e["rank"] for e in restored} == {0, 1}, restored
    assert all(e["source"] == "flushed" and e["step"] == died_at for e in restored), restored
    assert {e["rank"]: set(e["sources"].values()) for e in restored} == {0: {"flushed"}, 1: {"flushed"}}
    assert_bit_exact(reference[2], _final_states(tmp_path))
    # the checkpoints committed since made the flushed copies obsolete: rank 0 removed them
    assert not list(flushed.root(tmp_path / "ck").glob("rank*")), list(
        flushed.root(tmp_path / "ck").iterdir()
    )


@pytest.mark.slow
def test_a_node_lost_after_its_worker_died_comes_back_from_the_flushed_snapshot(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # two nodes of one rank each and a spare; no store copy (nothing in memory vouches for a
    # lost rank's state). Node 1's worker is SIGKILLed, its agent flushes the dead rank's
    # snapshots, then the whole node is lost (a failing GPU taking its node down). The spare takes
    # rank 1 from the flushed snapshot: at most the step in flight re-runs, not the 4 since the
    # last checkpoint. (Nothing in memory vouches for it: the spare's new rank cannot join the
    # survivor in its process; the group restarts and reads the flushed copy back.)
    import os
    import signal
    import time

    from tests.integration.test_nodes import RDZV_FAST, Job, _config, _restored, _train

    snapshot = {"interval": 1, "store_copy_max_bytes": 0}
    cfg = _config(tmp_path, "cfg", snapshot=snapshot, events={"steps": True},
                  checkpoint={"flush_on_death": True})  # fmt: skip
    job = Job(tmp_path, "cascade", "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2",
              "--monitor-interval", "0.2", "--heartbeat-timeout", "10", "--standby", "0",
              "--rdzv-conf", RDZV_FAST)  # fmt: skip
    try:
        a, b = (job.start(*_train(tmp_path, cfg, "--step-ms", "300")) for _ in range(2))
        b.wait_event("checkpoint_saved", lambda e: e["step"] >= 4 and e["rank"] >= 0)
        assert job.ranks(b) == {1}, "node 1 should hold rank 1 (node 0 started first)"
        spare = job.start(*_train(tmp_path, cfg, "--step-ms", "300"))
        spare.wait_event("spare_parked")  # (it parks beside the running round)
        a.wait_event("step_completed", lambda e: e["step"] >= 10 and e["rank"] == 0)
        worker = next(e["pid"] for e in b.events() if e["event"] == "run_started" and e["rank"] == 1)
        t_kill = time.time()
        os.kill(worker, signal.SIGKILL)
        flush = b.wait_event("snapshot_flushed")
        job.lose(b)
        rcs = [job.nodes[i].finish() for i in (0, 2)]
    finally:
        job.finish()
    assert rcs == [0, 0], [a.output(), spare.output()]
    assert "error" not in flush and flush["global_rank"] == 1, flush
    assert job.ranks(spare) == {1}, spare.output()
    restored = _restored(a) + _restored(spare)
    restored = [e for e in restored if e["ts"] > t_kill]
    assert len(restored) == 2 and len({e["step"] for e in restored}) == 1, restored
    assert set(_restored(spare)[-1]["sources"].values()) == {"flushed"}, restored
    done = max(e["step"] for e in a.events() if e["event"] == "step_completed" and e["ts"] < t_kill)
    assert done + 1 - restored[0]["step"] <= 1, (done, restored)  # at most the step in flight re-runs
    assert_bit_exact(reference[2], _final_states(tmp_path))
