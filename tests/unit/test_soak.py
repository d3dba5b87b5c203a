"""The soak's schedule: seeded, every fault at its own step, second faults one per kind, point
and rank in a job; and its summary's figures."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from chaos import soak

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_parses_and_every_stack_names_its_kinds() -> None:
    spec = soak.load(ROOT / "configs" / "chaos" / "soak.yaml")
    assert spec.faults >= 1000 and set(spec.stacks) >= {
        "ddp_epochs",
        "fsdp2",
        "pipeline",
        "hf_trainer",
        "lightning",
    }
    for stack in spec.stacks.values():
        assert (ROOT / stack.config).exists()


def test_a_job_s_faults_are_seeded_and_apart_and_its_second_faults_distinct() -> None:
    spec = soak.load(ROOT / "configs" / "chaos" / "soak.yaml").model_copy(update={"compound": 1.0})
    stack = spec.stacks["tiny"]
    a = soak.deal(spec, stack, 2, 10, random.Random("s"))
    b = soak.deal(spec, stack, 2, 10, random.Random("s"))
    assert a == b
    steps = [f.step for f in a]
    assert steps == sorted(steps) and all(
        y - x >= spec.steps_per_fault - 4 for x, y in itertools.pairwise(steps)
    )
    seconds = [f.during.spec() for f in a if f.during is not None]
    assert seconds and len(seconds) == len(set(seconds))  # (each fires once per job)


def test_the_summary_counts_faults_jobs_and_work_lost() -> None:
    fault = {"kind": "exception", "recovered": True, "work_lost_s": 0.1, "recover_s": 0.3}
    job = {
        "faults": [fault, {**fault, "work_lost_s": 2.0, "recover_s": 4.0, "during": "agree"}],
        "faults_planned": 2,
        "by_kind": {"exception": {"injected": 2, "detected": 2, "recovered": 2}},
        "replays": {"verified": 1, "diverged": 0, "unchecked": 1},
        "bit_exact": True,
        "failed": [],
        "stack": "tiny",
        "lost_committed_checkpoints": 0,
        "harness_hangs": 0,
        "faults_injected": 2,
    }
    s = soak.summary([job, {**job, "bit_exact": False, "failed": ["bit_exact"]}], 10.0)
    assert (s["faults_fired"], s["second_faults_fired"], s["jobs_bit_exact"]) == (4, 2, 1)
    assert s["work_lost_s"]["max"] == 2.0 and s["longest_recovery_s"] == 4.0
    assert soak.failed(s) == ["jobs"]


def test_a_resumed_soak_deals_the_next_job_as_the_whole_soak_would(tmp_path: Path) -> None:
    import json

    import pytest

    from chaos.schedule import BadInput

    spec = soak.load(ROOT / "configs" / "chaos" / "soak.yaml")
    rng = random.Random(f"{spec.seed}/soak")
    names = list(spec.stacks)
    jobs = []
    for i in range(3):
        stack = spec.stacks[names[i]]
        nproc = soak.job_of(spec, stack, 100).job.nproc
        dealt = soak.deal(spec, stack, nproc, spec.per_job, rng)
        jobs.append(
            {
                "stack": names[i],
                "faults_planned": spec.per_job,
                "planned": [f.spec(f.step or 0) for f in dealt],
            }
        )
    (tmp_path / "soak.json").write_text(json.dumps({"per_job": jobs[:2], "wall_s": 5.0}))
    again = random.Random(f"{spec.seed}/soak")
    kept, wall, _ = soak._resumed(spec, tmp_path, again)
    assert (len(kept), wall) == (2, 5.0)
    third = spec.stacks[names[2]]
    nxt = soak.deal(spec, third, soak.job_of(spec, third, 100).job.nproc, spec.per_job, again)
    assert [f.spec(f.step or 0) for f in nxt] == jobs[2]["planned"]
    jobs[1]["planned"] = jobs[1]["planned"][::-1]  # another config's soak is not taken for this one's
    (tmp_path / "soak.json").write_text(json.dumps({"per_job": jobs[:2], "wall_s": 5.0}))
    with pytest.raises(BadInput, match=r"soak\.json: job"):
        soak._resumed(spec, tmp_path, random.Random(f"{spec.seed}/soak"))
