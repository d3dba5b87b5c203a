"""The Lightning example (examples/train_lightning.py: ``Trainer(strategy=ResilientDDPStrategy())``)
as 2 real gloo ranks under real faults, ending bit for bit where its fault-free run ends.

The CI smoke is an exception on rank 1 in the step right after a validation that ran in the middle
of an epoch, recovered in-process: the spot where resuming Lightning's loops is hardest (its own
resume from a checkpoint saved there would repeat the tail of that validation). The slow ones: a
SIGKILLed rank replaced under ``resilient launch``, and the ``pytorch_lightning`` package with
gradient accumulation, loader worker processes and ``max_steps`` ending mid-epoch.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.compare import assert_bit_exact
from chaos.harness import RunResult, run_ranks
from chaos.hooks import Var, enable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning: .[lightning]"),
]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_lightning.py")
_ids = itertools.count()


def _args(tmp: Path, *extra: str) -> list[str]:
    """The example's arguments: every step's state kept (a restore lands on the faulted step)."""
    (tmp / "runtime.yaml").write_text("snapshot:\n  interval: 1\n")
    return [EXAMPLE, "--hang-timeout", "10", "--config", str(tmp / "runtime.yaml"), *extra]


def _chaos_env(tmp: Path, plan: str = "") -> dict[str, str]:
    """What the chaos harness hands a job: the planned faults, its final state's directory."""
    env = {Var.FINAL_STATE.value: str(tmp / "state"), Var.INJECTIONS.value: str(tmp / "injections.jsonl")}
    if plan:
        env[Var.PLAN.value] = plan
    return env


def _ranks(tmp: Path, *extra: str, plan: str = "", timeout: float = 100.0) -> RunResult:
    tmp.mkdir(parents=True, exist_ok=True)
    return run_ranks(
        _args(tmp, *extra), 2, cwd=tmp, run_id=f"lt{next(_ids)}", timeout=timeout, env=_chaos_env(tmp, plan)
    )


def _states(tmp: Path) -> list[dict[str, Any]]:
    return [torch.load(tmp / "state" / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_an_exception_after_a_mid_epoch_validation_is_recovered_bit_exact(tmp_path: Path) -> None:
    # 8 steps per rank per epoch (256 samples, batches of 16, 2 ranks); validation after steps 3
    # and 7 (val_check_interval=0.5); the fault comes as step 4 begins, after the first validation
    opts = ("--epochs", "1", "--size", "256", "--val-every", "0.5")
    ref = _ranks(tmp_path / "ref", *opts)
    assert ref.ok and not ref.of("fault_detected"), ref.describe()
    run = _ranks(tmp_path / "run", *opts, plan="exception@4:1")
    assert run.ok, run.describe()
    (fault,) = {(e["origin_rank"], e["origin_step"]) for e in run.of("fault_detected")}
    assert fault == (1, 4)
    restored = run.of("state_restored")
    # both ranks resume at one step: 4, or 3 where rank 0 was interrupted before it completed step
    # 3 (then step 3 and the validation after it run again, bit-exact too)
    (step,) = {e["step"] for e in restored}
    assert step in (3, 4) and sorted((e["rank"], e["generation"]) for e in restored) == [(0, 1), (1, 1)]
    assert [len(run.of("run_started"))] == [2], "a rank was started again: the recovery was not in-process"
    for r, (a, b) in enumerate(zip(_states(tmp_path / "ref"), _states(tmp_path / "run"), strict=True)):
        assert assert_bit_exact(a, b, f"rank{r}") > 0
    # Lightning's own ModelCheckpoint and CSVLogger kept working through the fault
    ckpts = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        p.name for p in (tmp_path / "ref" / "lightning_logs" / "version_0" / "checkpoints").iterdir()
    )
    assert (tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv").stat().st_size > 0


@pytest.mark.slow
def test_a_sigkilled_rank_is_replaced_and_the_run_ends_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.test_launcher import Launch, _signal_after_checkpoint
    from tests.integration.test_replace import _pids

    opts = ("--epochs", "2", "--ckpt-dir", "ck", "--ckpt-every", "4")
    ref = _ranks(tmp_path / "ref", *opts)
    assert ref.ok, ref.describe()
    cwd = tmp_path / "run"
    cwd.mkdir()
    for k, v in enable(_chaos_env(cwd)).items():  # (Launch hands its workers this process's environment)
        monkeypatch.setenv(k, v)
    run = Launch(
        cwd, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
        "--replace", "rank", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--backoff-initial", "0",
        *_args(cwd, *opts),
    )  # fmt: skip
    victim = _signal_after_checkpoint(run, 1)
    events = run.events()
    replaced = [e for e in events if e["event"] == "rank_replaced"]
    assert len(replaced) == 1 and replaced[0]["old_pid"] == victim, replaced
    assert len(_pids(events, 0)) == 1, "the survivor's process changed"
    restored = [e for e in events if e["event"] == "state_restored"]
    assert {e["rank"] for e in restored} == {0, 1} and len({e["step"] for e in restored}) == 1, restored
    for r, (a, b) in enumerate(zip(_states(tmp_path / "ref"), _states(cwd), strict=True)):
        assert_bit_exact(a, b, f"rank{r}")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning")
def test_pytorch_lightning_with_accumulation_workers_and_max_steps_recovers_bit_exact(tmp_path: Path) -> None:
    # 2 batches a step (4 steps an epoch), 2 loader worker processes per rank (the batches before
    # the position are read again, so that their RNGs advance alike), max_steps=11 ending in the
    # third epoch; the fault as the first epoch's last window begins
    opts = ("--lightning", "pytorch_lightning", "--accumulate", "2", "--num-workers", "2", "--steps", "11",
            "--size", "256")  # fmt: skip
    ref = _ranks(tmp_path / "ref", *opts)
    assert ref.ok, ref.describe()
    run = _ranks(tmp_path / "run", *opts, plan="exception@3:0")
    assert run.ok, run.describe()
    assert {e["step"] for e in run.of("state_restored")} == {3}
    for r, (a, b) in enumerate(zip(_states(tmp_path / "ref"), _states(tmp_path / "run"), strict=True)):
        assert b["trainer"]["global_step"] == 11
        assert_bit_exact(a, b, f"rank{r}")
