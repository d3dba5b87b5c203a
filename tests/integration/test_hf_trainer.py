"""The Hugging Face Trainer and an Accelerate loop as 2 real gloo ranks, hit by real faults, must
end bit for bit where their fault-free runs end (examples/train_hf_trainer.py, train_accelerate.py).

CI runs two: a SIGKILLed rank of the Trainer replaced under ``resilient launch`` (the replacement
restores through the Trainer's first step, the survivor in its process), and an exception inside
an accumulation window of the Accelerate loop. The rest are in the slow session.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the hf extra: pip install -e '.[hf]'")

from chaos.harness import run_ranks
from tests.integration.conftest import ROOT, admitted_restore, assert_bit_exact
from tests.integration.test_launcher import Launch

pytestmark = pytest.mark.integration

TRAINER = str(ROOT / "examples" / "train_hf_trainer.py")
ACCELERATE = str(ROOT / "examples" / "train_accelerate.py")


def _states(cwd: Path) -> list[dict[str, Any]]:
    return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _ranks(
    tmp: Path, name: str, argv: list[str], plan: str = "", every: int = 5, live: bool = True
) -> tuple[list[Any], Any]:
    """``argv`` as 2 env:// ranks (snapshots every ``every`` steps; ``live``: a soft fault resumes
    at its own step), ``plan``'s faults fired in their steps; the final tracked state of each
    rank, and the run."""
    cwd = tmp / name
    cwd.mkdir(parents=True)
    (cwd / "every.yaml").write_text(f"snapshot:\n  interval: {every}\n  live: {str(live).lower()}\n")
    env = {"CHAOS_FINAL_STATE": str(cwd / "state"), "HF_HUB_OFFLINE": "1"}
    if plan:
        env["CHAOS_PLAN"] = plan
    argv = [*argv, "--config", str(cwd / "every.yaml")]
    res = run_ranks(argv, 2, cwd=cwd, run_id=name, env=env, timeout=100)
    assert res.ok, res.describe()
    assert bool(res.of("fault_detected")) == bool(plan), res.of("fault_detected")
    return _states(cwd), res


def _pids(events: list[dict[str, Any]], rank: int) -> list[int]:
    return list(dict.fromkeys(e["pid"] for e in events if e["event"] == "run_started" and e["rank"] == rank))


def test_a_sigkilled_trainer_rank_is_replaced_and_the_run_ends_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 optimizer steps in 2 epochs, snapshots every 5; rank 1 is SIGKILLed in the second: a new
    # process takes its rank, restores from shared memory at the Trainer's first step and skips
    # into the epoch, while rank 0 recovers in its own process
    argv = [TRAINER, "--steps", "40", "--epochs", "2"]
    ref, _ = _ranks(tmp_path, "ref", argv)
    cwd = tmp_path / "hit"
    cwd.mkdir()
    (cwd / "every.yaml").write_text("snapshot:\n  interval: 5\n")
    for k, v in {"CHAOS_FINAL_STATE": str(cwd / "state"), "CHAOS_STEP_EVENTS": "1", "HF_HUB_OFFLINE": "1",
                 "RESILIENT_HOOKS": "chaos.hooks:from_env"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    run = Launch(cwd, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval",
                 "0.1", "--heartbeat-timeout", "3", "--startup-timeout", "60", "--backoff-initial", "0",
                 *argv, "--config", str(cwd / "every.yaml"))  # fmt: skip
    try:
        run.wait_event("step_completed", lambda e: e["rank"] == 1 and e["step"] >= 26, timeout=80)
        victim = _pids(run.events(), 1)[0]
        os.kill(victim, signal.SIGKILL)
        rc = run.finish(timeout=80)
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    events = run.events()
    (replaced,) = [e for e in events if e["event"] == "rank_replaced"]
    assert replaced["old_pid"] == victim and replaced["global_rank"] == 1, replaced
    assert len(_pids(events, 0)) == 1, "the survivor's process changed"
    restored = [e for e in events if e["event"] == "state_restored"]
    assert {e["rank"] for e in restored} == {0, 1} and len({e["step"] for e in restored}) == 1, restored
    assert 20 < restored[0]["step"] < 40, restored  # inside the second epoch
    got = _states(cwd)
    assert got[0]["trainer"]["state"]["global_step"] == 40
    assert assert_bit_exact(ref, got) > 100


# (CI's budget: accumulation windows stay in CI in test_training_stacks, the HF Trainer's SIGKILL here)
@pytest.mark.slow
def test_an_accelerate_loop_recovers_inside_an_accumulation_window_bit_exact(tmp_path: Path) -> None:
    # 24 micro-batches an epoch, 2 per optimizer step, snapshots every 5: the exception as step 28
    # begins resumes live at 28; from the ring it restores step 25, one micro-batch into a window
    # of the second epoch (its gradients, the Accelerator's step counter, the prepared loader's
    # position and synchronized generator)
    argv = [ACCELERATE, "--steps", "48", "--epochs", "2"]
    ref, _ = _ranks(tmp_path, "ref", argv)
    # (live: rank 0 may already have run its backward of step 28 under no_sync, accumulating into
    # the window's gradients: it cannot vouch then, and both restore 25 from the ring)
    for live, allowed in ((True, {(28, "live"), (25, "ring")}), (False, {(25, "ring")})):
        hit, res = _ranks(tmp_path, f"hit-{live}", argv, plan="exception@28:1", live=live)
        got = {(e["step"], e["source"]) for e in res.of("state_restored")}
        assert len(got) == 1 and got <= allowed, got
        assert hit[0]["loader"]["consumed"] == ref[0]["loader"]["consumed"]
        assert assert_bit_exact(ref, hit) > 100


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["group_by_length", "random"])
def test_a_trainer_with_evaluation_workers_and_a_global_rng_sampler_recovers_bit_exact(
    tmp_path: Path, sampler: str
) -> None:
    # the length-grouped sampler draws its permutation from the global RNG when a pass begins, a
    # RandomSampler from accelerate's synchronized generator: a restore 3 steps into the second
    # epoch must draw them as the first run did; evaluations and loader workers draw too
    argv = [TRAINER, "--steps", "24", "--epochs", "2", "--sampler", sampler, "--eval-every", "4",
            "--workers", "2"]  # fmt: skip
    ref, _ = _ranks(tmp_path, "ref", argv)
    hit, res = _ranks(tmp_path, "hit", argv, plan="exception@17:1")
    assert admitted_restore(res, snapshot=15) in (15, 17)
    assert assert_bit_exact(ref, hit) > 100


@pytest.mark.slow
def test_the_trainers_own_checkpoints_are_written_through_a_fault(tmp_path: Path) -> None:
    # save_steps=4 and an out-of-memory fault at step 14: the Trainer's checkpoints (model,
    # optimizer, trainer_state.json) are there for every 4th step, as in the fault-free run
    argv = [TRAINER, "--steps", "24", "--epochs", "2", "--hf-save-every", "4", "--accum", "1"]
    ref, _ = _ranks(tmp_path, "ref", argv)
    hit, res = _ranks(tmp_path, "hit", argv, plan="oom@14:1")
    assert admitted_restore(res, snapshot=10) in (10, 14)
    assert assert_bit_exact(ref, hit) > 100
    out = tmp_path / "hit" / "hf_out"
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in out.glob("checkpoint-*"))
    assert saved == [4, 8, 12, 16, 20, 24], saved
    state = json.loads((out / "checkpoint-24" / "trainer_state.json").read_text())
    assert state["global_step"] == 24 and (out / "checkpoint-24" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_trainer_under_bf16_autocast_recovers_bit_exact(tmp_path: Path) -> None:
    argv = [TRAINER, "--steps", "24", "--epochs", "2", "--bf16"]
    ref, _ = _ranks(tmp_path, "ref", argv)
    hit, res = _ranks(tmp_path, "hit", argv, plan="exception@8:0")
    assert admitted_restore(res, snapshot=5) in (5, 8)
    assert assert_bit_exact(ref, hit) > 100


@pytest.mark.slow
def test_the_trainers_own_resume_from_checkpoint_and_a_restore_compose_bit_exact(tmp_path: Path) -> None:
    # a job started from the Trainer's checkpoint of step 8 (8 batches into its first epoch, which
    # the Trainer skips), then an exception at step 3 of this run: the restore (live at step 3, or
    # the snapshot of step 2: global step 10) must count the batches the Trainer skipped as consumed
    argv = [TRAINER, "--steps", "24", "--epochs", "2", "--hf-save-every", "4", "--accum", "1"]
    full, _ = _ranks(tmp_path, "full", argv)
    resumed = [*argv, "--resume-from-checkpoint", str(tmp_path / "full" / "hf_out" / "checkpoint-8")]
    ref, _ = _ranks(tmp_path, "ref", resumed, every=2)
    hit, res = _ranks(tmp_path, "hit", resumed, plan="exception@3:1", every=2)
    assert admitted_restore(res, snapshot=2) in (2, 3)
    assert hit[0]["trainer"]["state"]["global_step"] == 24
    assert assert_bit_exact(ref, hit) > 100
    for a, b in zip(full, hit, strict=True):  # (the Trainer's own resume is exact here too)
        assert assert_bit_exact([a["model"], a["optimizer"]], [b["model"], b["optimizer"]]) > 100
