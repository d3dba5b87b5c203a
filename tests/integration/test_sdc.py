"""A real flipped bit in one DDP rank's weights (chaos kind ``bitflip``): the replicas' digests
differ where the collective count is compared, every rank rolls back to the newest snapshot whose
digests agreed and replays, and the run ends bit-exact with a fault-free one; with three replicas
the corrupt one is named."""

from __future__ import annotations

import pytest

from tests.integration.conftest import STEPS, load_states, run_example
from tests.integration.test_recovery import _check_recovered

pytestmark = pytest.mark.integration


def _sdc_faults(res) -> list[dict]:
    faults = res.of("fault_detected")
    assert faults and {e["kind"] for e in faults} == {"sdc"}, faults
    return faults


def test_a_flipped_bit_is_found_rolled_back_and_replayed_bit_exact(tmp_path, reference):
    res = run_example(tmp_path, 2, "--fault", "bitflip@9:1")
    _check_recovered(res, reference, 2, tmp_path)
    faults = _sdc_faults(res)
    assert all("replicas differ" in e["local"] or "peer" in e["local"] for e in faults)
    (restored,) = {e["step"] for e in res.of("state_restored")}
    assert restored <= 9  # the snapshot taken before the flip, never one after it
    assert load_states(tmp_path, 2)[1]["fired"] == {"bitflip@9:1": 1}
    # two replicas: no majority; each rank says so and awaits the replay's verdict
    pending = [e for e in res.of("sdc_detected") if e["how"] == "replay pending"]
    assert {e["rank"] for e in pending} == {0, 1} and all(e["suspects"] == [0, 1] for e in pending)
    assert all(e["step"] <= STEPS - 1 for e in pending)


def test_with_three_replicas_the_corrupt_one_is_named(tmp_path, reference):
    res = run_example(tmp_path, 3, "--fault", "bitflip@9:2")
    _check_recovered(res, reference, 3, tmp_path)
    _sdc_faults(res)
    named = res.of("sdc_detected")
    assert {e["rank"] for e in named} == {0, 1, 2}  # every rank reaches the same verdict
    assert all(e["ranks"] == [2] and e["how"] == "majority" for e in named), named
    (digests,) = {tuple(sorted(e["digests"].items())) for e in named}
    d = dict(digests)
    assert d["0"] == d["1"] != d["2"]


@pytest.mark.slow  # (CI's budget: a flipped bit rolled back and the corrupt replica named stay in CI)
def test_a_replica_corrupt_twice_is_replaced_by_a_standby_alone(tmp_path, reference):
    # rank 2's weights flipped twice (the second time after the first roll-back): named by the
    # majority both times, it marks itself for replacement and its agent puts a standby in its
    # place; ranks 0 and 1 stay in their processes and the run ends bit-exact. (Rank 0 compares
    # with rank 1 alone: before the first roll-back it mirrored a step the corrupt gradients had
    # reached, which a roll-back must drop, or it is restored after the replacement.)
    from tests.integration.test_launcher import _example, _final_states
    from tests.integration.test_replace import _bit_exact, _pids

    cfg = tmp_path / "sdc.yaml"
    cfg.write_text("sdc:\n  interval: 4\n")
    run = _example(
        tmp_path / "run", "--config", str(cfg), "--fault", "bitflip@9:2,bitflip@14:2", "--fault-attempt", "0",
        nproc=3, replace="rank", launch=("--standby", "1"),
    )  # fmt: skip
    try:
        rc = run.finish(timeout=180)
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    events = run.events()
    named = [e for e in events if e["event"] == "sdc_detected" and e["how"] == "majority"]
    assert {tuple(e["ranks"]) for e in named} == {(2,)} and len({e["generation"] for e in named}) == 2
    died = [e for e in events if e["event"] == "worker_died"]
    assert [(e["global_rank"], e["cause"].split(":")[0]) for e in died] == [(2, "sdc")], died
    assert len([e for e in events if e["event"] == "rank_replaced"]) == 1
    assert len(_pids(events, 0)) == len(_pids(events, 1)) == 1  # the healthy replicas stayed
    _bit_exact(reference[3], _final_states(tmp_path / "run", 3))
