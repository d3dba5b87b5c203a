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
