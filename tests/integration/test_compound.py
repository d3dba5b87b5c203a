"""Faults inside a recovery (configs/chaos/compound.yaml): a second fault fired by a rank when its
recovery from the first reaches a named point; the job still ends where a fault-free run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_certify import ROOT, _chaos, _time_slos_scaled

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_an_exception_in_the_restore_and_a_death_in_the_agreement_end_bit_exact(tmp_path: Path) -> None:
    # (the rest of compound.yaml: nox -s certify-compound)
    cfg = _time_slos_scaled(ROOT / "configs" / "chaos" / "compound.yaml", tmp_path / "compound.yaml", 2.0)
    out = tmp_path / "cert"
    classes = "exception_in_restore,sigkill_in_agree"
    r = _chaos(tmp_path, "certify", str(cfg), "--out", str(out), "--trials", "1", "--classes", classes)
    cert = json.loads((out / "certificate.json").read_text())
    assert r.returncode == 0 and cert["passed"], r.stdout + r.stderr
    trials = {t["cls"]: t for t in cert["trials"]}
    for t in trials.values():
        assert t["second_fired"] and t["fired"] == 2, t  # both faults fired, the second inside the recovery
        assert t["bit_exact"] and t["lost_checkpoints"] == 0, t
    restored = trials["exception_in_restore"]
    assert restored["second"] == "exception@restore:1"
    # rank 0 died in the agreement: its replacement joined the survivor, which kept its process
    assert trials["sigkill_in_agree"]["restarts"] >= 1


@pytest.mark.slow  # (two nodes; nox -s slow)
@pytest.mark.timeout(600)
def test_the_store_s_node_lost_ends_the_job_at_once_with_74_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "cert"
    cfg = ROOT / "configs" / "chaos" / "nodes.yaml"
    r = _chaos(tmp_path, "certify", str(cfg), "--out", str(out), "--classes", "store_node_lost")
    cert = json.loads((out / "certificate.json").read_text())
    assert r.returncode == 0 and cert["passed"], r.stdout + r.stderr
    (t,) = cert["trials"]
    assert t["exit_code"] == 74 and t["ended_s"] < 30 and t["lost_checkpoints"] == 0, t
    assert "rendezvous store" in t["end_reason"] and "requeue" in t["end_reason"], t
