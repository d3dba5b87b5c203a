"""The engine core's state machine in one process, with fakes for its collaborators.

The built-in engine runs here as it does under torchrun, except that its wiring is handed in: an
in-memory store (torch's HashStore), a group builder that builds no process group, a temporary
event log. A fault is a real exception raised in the step; recovery, the restart policy, health
checks, the restore agreement and the hooks run exactly as in production.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.config import Config, load_config
from resilient.detectors import collectives as fingerprint
from resilient.errors import FaultRepeats, HealthCheckFailed, ResilienceError, StateRestoreError
from resilient.events import EventLog, read_events
from resilient.health import CheckResult, HealthInput
from resilient.launch_env import LaunchEnv
from resilient.runtime.context import Context
from resilient.runtime.coordination.agreement import common_restore_step
from resilient.runtime.engine.builtin import BuiltinEngine
from resilient.runtime.hooks import Hook, RunInfo
from resilient.runtime.run.wiring import Setup, Wiring
from resilient.runtime.steps.loop import StepLoop

STEPS = 12


class FakeGroup:
    """Stands in for a generation's process group: records what the engine did to it."""

    def __init__(self, generation: int, log: list[str]) -> None:
        self.generation = generation
        self._log = log

    def abort(self) -> int:
        self._log.append(f"abort g{self.generation}")
        return 0

    def destroy(self, abort: bool = True) -> None:
        self._log.append(f"destroy g{self.generation}")


class Fakes:
    def __init__(self, tmp: Path) -> None:
        self.store = dist.HashStore()
        self.groups: list[str] = []
        self.tmp = tmp

    def wiring(self, setup: Setup) -> Wiring:
        def build(generation: int, namespace: str) -> Any:
            self.groups.append(f"build g{generation} {namespace}")
            return FakeGroup(generation, self.groups)

        return Wiring(
            store=self.store,
            side_store=lambda _timeout: self.store,
            run_id="unit",
            events=EventLog(self.tmp / "unit" / "events.jsonl", setup.rank),
            build_group=build,
        )

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        evs = read_events(self.tmp / "unit" / "events.jsonl")
        return [e for e in evs if name is None or e["event"] == name]


def _cfg(**overrides: Any) -> Config:
    base: dict[str, Any] = {"snapshot": {"interval": 1}, "health": {"checks": ["host_memory", "store"]}}
    return load_config(None, **{**base, **overrides})


def _train(
    rt: BuiltinEngine, fault_at: Callable[[int, int], bool]
) -> Callable[[StepLoop], dict[str, torch.Tensor]]:
    """A model with dropout and an optimizer; ``fault_at(generation, step)`` raises in that step."""

    def fn(loop: StepLoop) -> dict[str, torch.Tensor]:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.track(model=model, opt=opt)
        for step in ctx.steps(STEPS):
            if fault_at(ctx.generation, step):
                raise ValueError(f"boom at step {step}")
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    return fn


def _runtime(fakes: Fakes, cfg: Config | None = None, **kw: Any) -> BuiltinEngine:
    return BuiltinEngine(
        Setup.of(cfg or _cfg(), launch=LaunchEnv.from_environ({}), **kw), wiring=fakes.wiring
    )


def test_an_exception_is_recovered_in_process_and_ends_bit_exact(tmp_path: Path) -> None:
    ref_fakes, fakes = Fakes(tmp_path / "ref"), Fakes(tmp_path / "faulty")
    ref_rt = _runtime(ref_fakes)
    ref = ref_rt.run(_train(ref_rt, lambda g, s: False))
    rt = _runtime(fakes)
    got = rt.run(_train(rt, lambda g, s: g == 0 and s == 7))
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert fakes.events("run_finished")[0]["generation"] == 1
    (fault,) = fakes.events("fault_detected")
    assert fault["kind"] == "exception" and fault["origin_step"] == 7
    (restored,) = fakes.events("state_restored")
    assert restored["step"] == 7 and restored["steps_rerun"] == 0
    # the failed generation's group was aborted and destroyed before the next one was built
    assert fakes.groups[:4] == [
        "build g0 resilient/unit/a0",
        "abort g0",
        "destroy g0",
        "build g1 resilient/unit/a0",
    ]
    assert fakes.events("run_finished")[0]["steps_completed"] == STEPS + 1 - 1  # steps 0-6 then 7-11


def test_a_fault_that_repeats_at_the_same_step_is_diagnosed_not_looped_on(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    rt = _runtime(fakes, _cfg(restart={"max_repeats": 2, "max_recoveries": 10}))
    with pytest.raises(FaultRepeats) as ei:
        rt.run(_train(rt, lambda g, s: s == 5))
    assert "step 5" in str(ei.value) and "ValueError" in str(ei.value)
    assert len(fakes.events("fault_detected")) == 2  # the first restart, then the verdict
    assert fakes.events("run_failed")


def test_a_failed_health_check_tells_the_agent_and_is_raised_typed(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    hb = tmp_path / "hb"
    hb.mkdir()
    launch = LaunchEnv.from_environ({"RESILIENT_HEARTBEAT_DIR": str(hb)})

    def disk_gone(inp: HealthInput) -> CheckResult:
        return CheckResult("scratch_disk", False, "0 MB", "the node's scratch disk vanished")

    rt = BuiltinEngine(Setup.of(_cfg(), [disk_gone], launch=launch), wiring=fakes.wiring)
    with pytest.raises(HealthCheckFailed, match="scratch_disk"):
        rt.run(_train(rt, lambda g, s: s == 3))
    verdict = json.loads((hb / "rank00000.unhealthy").read_text())
    assert verdict["check"] == "scratch_disk"


class Recorder(Hook):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.final: Mapping[str, Any] = {}

    def on_start(self, run: RunInfo) -> None:
        self.calls.append(("start", run.rank, run.engine))

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        self.calls.append(("before", step, len(objects)))

    def after_step(self, generation: int, step: int, step_s: float | None) -> None:
        self.calls.append(("after", generation, step))

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        self.final = final_state()


def test_hooks_see_every_step_the_re_run_included_and_the_final_state(tmp_path: Path) -> None:
    fakes, rec = Fakes(tmp_path), Recorder()
    rt = _runtime(fakes, hooks=[rec])
    out = rt.run(_train(rt, lambda g, s: g == 0 and s == 4))
    assert rec.calls[0] == ("start", 0, "resilient")
    befores = [c[1] for c in rec.calls if c[0] == "before"]
    assert befores == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11]  # step 4 again after the restore
    assert ("after", 1, 4) in rec.calls and ("after", 0, 4) not in rec.calls
    assert all(c[2] == 2 for c in rec.calls if c[0] == "before")  # the tracked model and optimizer
    assert torch.equal(rec.final["model"]["0.weight"], out["0.weight"])


def test_a_hook_raising_before_a_step_is_a_fault_in_that_step(tmp_path: Path) -> None:
    class Inject(Hook):
        fired = False

        def before_step(self, step: int, objects: Sequence[object]) -> None:
            if step == 6 and not self.fired:
                self.fired = True
                raise RuntimeError("injected by a hook")

    fakes = Fakes(tmp_path)
    rt = _runtime(fakes, hooks=[Inject()])
    rt.run(_train(rt, lambda g, s: False))
    (fault,) = fakes.events("fault_detected")
    assert fault["origin_step"] == 6 and "injected by a hook" in fault["local"]


def test_the_collective_check_runs_only_where_state_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[int] = []
    real = fingerprint.CollectiveCount.close_window

    def spy(self: fingerprint.CollectiveCount, step: int, digests: Any = None) -> None:
        closed.append(step)
        real(self, step, digests)

    monkeypatch.setattr(fingerprint.CollectiveCount, "close_window", spy)
    fakes = Fakes(tmp_path)
    rt = _runtime(fakes, _cfg(snapshot={"interval": 4}))
    rt.run(_train(rt, lambda g, s: False))
    assert closed == [3, 7, 11]  # before the snapshots of steps 4, 8 and 12, not at every step


def test_a_restart_that_tracks_fewer_objects_is_refused_by_name(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    rt = _runtime(fakes)

    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        model = torch.nn.Linear(2, 2)
        ctx.track(**({"model": model} if ctx.generation else {"model": model, "ema": torch.nn.Linear(2, 2)}))
        for step in ctx.steps(6):
            if ctx.generation == 0 and step == 2:
                raise ValueError("boom")

    with pytest.raises(StateRestoreError, match="ema"):
        rt.run(fn)


def test_the_restore_step_is_the_newest_every_rank_holds() -> None:
    assert common_restore_step([[0, 4, 8], [4, 8, 9], [8, 4]]) == 8
    with pytest.raises(StateRestoreError, match="no snapshot step held by every rank"):
        common_restore_step([[0, 4], [8]])


def test_a_rank_holding_no_snapshot_failed_before_its_first_step() -> None:
    from resilient.errors import ExitCode, SetupFailed
    from resilient.runtime.faults.records import FaultRecord

    culprit = FaultRecord(1, 0, None, "exception", "soft", "exception: ImportError: x", "ImportError: x")
    with pytest.raises(SetupFailed, match=r"^rank 1 failed before the first step: ImportError: x$") as e:
        common_restore_step([[0], []], culprit)
    assert e.value.ranks == [1] and e.value.exit_code == ExitCode.FATAL
    # the first fault came from a rank that had a snapshot: the empty ones are named, not it
    with pytest.raises(SetupFailed, match=r"ranks \[0\] hold no snapshot"):
        common_restore_step([[], [0]], culprit)


def _epochs_train(
    rt: BuiltinEngine, fault_at: Callable[[int, int], bool]
) -> Callable[[StepLoop], dict[str, Any]]:
    """A tutorial epoch loop: a shuffled DataLoader, dropout, and end-of-epoch code that uses the
    epoch's last loss and steps a per-epoch scheduler."""
    from torch.utils.data import DataLoader, TensorDataset

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
        loader = DataLoader(data, batch_size=4, shuffle=True)  # 4 batches a pass: steps 0-3, 4-7, 8-11
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ctx.track(model=model, opt=opt, sched=sched, loader=loader)
        ends = []
        for epoch in ctx.epochs(3):
            for x, y in ctx.steps(loader):
                if fault_at(ctx.generation, ctx.step):
                    raise ValueError(f"boom at step {ctx.step}")
                loss = (model(x) - y).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()  # once per epoch: an epoch's end that ran twice would halve the rate again
            ends.append((epoch, loss.item()))
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "lr": sched.get_last_lr()}

    return fn


def test_a_restore_at_an_epochs_end_resumes_at_the_next_epoch_bit_exact(tmp_path: Path) -> None:
    # the snapshot after step 3 (the first epoch's last batch, and the code after its batch loop)
    # is the one restored: the run goes on with epoch 1; it neither re-enters epoch 0's finished
    # pass (no batches: `loss` unbound) nor loses or repeats the end-of-epoch scheduler step
    ref_rt = _runtime(Fakes(tmp_path / "ref"))
    ref = ref_rt.run(_epochs_train(ref_rt, lambda g, s: False))
    fakes = Fakes(tmp_path / "faulty")
    rt = _runtime(fakes)
    got = rt.run(_epochs_train(rt, lambda g, s: g == 0 and s == 4))
    (restored,) = fakes.events("state_restored")
    assert restored["step"] == 4, restored  # (the state after 4 completed steps: epoch 0's end)
    assert got["lr"] == ref["lr"]
    for k in ref["model"]:
        assert torch.equal(ref["model"][k], got["model"][k]), k


def test_job_start_is_true_only_in_the_entry_that_begins_the_job(tmp_path: Path) -> None:
    # a log opened "w" under ctx.job_start keeps every line through an in-process restart and a
    # second process that resumes the job's checkpoint; a job begun afresh truncates it
    cfg = _cfg(checkpoint={"dir": str(tmp_path / "ck"), "interval": 4})
    log = tmp_path / "train.log"
    seen: list[bool] = []

    def fn(loop: StepLoop, fault: bool) -> None:
        ctx = Context(loop)
        seen.append(ctx.job_start)
        with open(log, "w" if ctx.job_start else "a") as f:
            ctx.track(model=torch.nn.Linear(2, 2))
            for step in ctx.steps(10):
                f.write(f"{step}\n")
                f.flush()
                if fault and ctx.generation == 0 and step == 6:
                    raise ValueError("boom")
                assert not ctx.job_start  # (a step ran: it is no longer the job's start)

    _runtime(Fakes(tmp_path / "first"), cfg).run(lambda loop: fn(loop, True))
    assert seen == [True, False]
    assert log.read_text().split() == [str(s) for s in [*range(7), *range(6, 10)]]
    _runtime(Fakes(tmp_path / "second"), cfg).run(lambda loop: fn(loop, False))  # resumes at 10
    assert seen == [True, False, False] and log.read_text().split()[:3] == ["0", "1", "2"]
    fresh = _cfg(checkpoint={"dir": str(tmp_path / "other"), "interval": 4})
    _runtime(Fakes(tmp_path / "third"), fresh).run(lambda loop: fn(loop, False))
    assert seen[-1] is True and log.read_text().split() == [str(s) for s in range(10)]


def test_a_restarted_process_knows_the_step_it_restored(tmp_path: Path) -> None:
    # a process started again (here: a second run on the same checkpoint directory) restores the
    # newest checkpoint at its first ctx.steps; ctx.restored_step says which step that was
    cfg = _cfg(checkpoint={"dir": str(tmp_path / "ck"), "interval": 4})
    seen: list[tuple[int | None, int | None]] = []

    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        ctx.track(model=torch.nn.Linear(2, 2))
        before = ctx.restored_step
        for _ in ctx.steps(10):
            pass
        seen.append((before, ctx.restored_step))

    _runtime(Fakes(tmp_path / "first"), cfg).run(fn)
    _runtime(Fakes(tmp_path / "second"), cfg).run(fn)
    assert seen == [(None, None), (None, 10)]  # (the last step is always checkpointed)


def test_an_evicted_shared_memory_snapshot_is_a_typed_restore_error(tmp_path: Path) -> None:
    from resilient.checkpoint.shm import ShmSnapshot
    from resilient.runtime.keeping.builtin_keeper import shm_state

    shm = ShmSnapshot("unit-evicted", 0, base=tmp_path)
    try:
        with pytest.raises(StateRestoreError, match="the snapshot of step 5 is gone"):
            shm_state(shm, 5)
    finally:
        shm.unlink()


def test_a_loop_that_is_not_ctx_steps_marks_its_steps_and_recovers_bit_exact(tmp_path: Path) -> None:
    # a trainer's own loop (Lightning, the HF Trainer) calls begin_step/end_step from its
    # callbacks: the same restore, the same steps, the same final state as ctx.steps
    def fn_for(fault_at: Callable[[int, int], bool]) -> Callable[[StepLoop], dict[str, torch.Tensor]]:
        def fn(loop: StepLoop) -> dict[str, torch.Tensor]:
            ctx = Context(loop)
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ctx.track(model=model, opt=opt)
            while True:
                step = ctx.begin_step()
                if step >= STEPS:
                    break
                if fault_at(ctx.generation, step):
                    raise ValueError(f"boom at step {step}")
                loss = model(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctx.end_step()
            return {k: v.clone() for k, v in model.state_dict().items()}

        return fn

    ref_rt = _runtime(Fakes(tmp_path / "ref"))
    ref = ref_rt.run(_train(ref_rt, lambda g, s: False))  # (ctx.steps: the same random stream)
    fakes = Fakes(tmp_path / "faulty")
    got = _runtime(fakes).run(fn_for(lambda g, s: g == 0 and s == 7))
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    (restored,) = fakes.events("state_restored")
    assert restored["step"] == 7
    with pytest.raises(ResilienceError, match="was begun and not ended"):

        def twice(loop: StepLoop) -> None:
            ctx = Context(loop)
            ctx.begin_step()
            ctx.begin_step()

        _runtime(Fakes(tmp_path / "misuse"), _cfg(restart={"max_recoveries": 0})).run(twice)
