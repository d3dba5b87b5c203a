"""Faults that raise nothing: a NaN or a spike in a step's gradient, on real gloo ranks. The guard
must keep it from the weights, and the run end bit for bit where the fault-free run ends."""

from __future__ import annotations

import pytest
import torch

from resilient.errors import ExitCode
from tests.integration.conftest import assert_bit_exact, load_states, run_example

pytestmark = pytest.mark.integration


def test_a_nan_and_a_spike_are_rolled_back_and_the_run_ends_bit_exact(tmp_path, reference):
    res = run_example(tmp_path, 2, "--fault", "nan@12:1,grad_spike@18:0")
    assert res.ok, res.describe()
    primaries = sorted({(e["kind"], e["origin_step"]) for e in res.of("fault_detected")})
    assert primaries == [("nonfinite", 12), ("spike", 18)]  # each at the step it happened
    states = load_states(tmp_path, 2)
    for rank in range(2):
        n = assert_bit_exact(reference[2][rank]["model"], states[rank]["model"], f"rank{rank}/model")
        n += assert_bit_exact(reference[2][rank]["optimizer"], states[rank]["optimizer"], f"rank{rank}/opt")
        assert n > 50
        assert len({e["pid"] for e in res.events if e["rank"] == rank}) == 1  # in-process


def test_a_nan_that_comes_back_on_replay_stops_naming_the_step(tmp_path):
    res = run_example(tmp_path, 2, "--fault", "nan@12:1x2")
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert r.returncode == ExitCode.FATAL, res.describe()
        assert "FaultRepeats: fault repeats at step 12: non-finite gradient" in r.stderr
        assert "came back on replay" in r.stderr


def test_skip_batch_drops_a_bad_batch_on_every_rank(tmp_path, reference):
    cfg = tmp_path / "skip.yaml"
    cfg.write_text("guard:\n  on_nonfinite: skip_batch\n")
    res = run_example(tmp_path / "run", 2, "--fault", "nan@12:1x2", "--config", str(cfg))
    assert res.ok, res.describe()
    assert sorted(e["rank"] for e in res.of("batch_skipped") if e["step"] == 12) == [0, 1]
    a, b = load_states(tmp_path / "run", 2)
    assert_bit_exact(a["model"], b["model"], "rank0 vs rank1")  # the replicas did the same
    assert all(torch.isfinite(t).all() for t in a["model"].values())
    assert not all(torch.equal(t, reference[2][0]["model"][k]) for k, t in a["model"].items())
