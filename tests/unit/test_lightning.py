"""The Lightning integration in one process: a real ``Trainer.fit`` (one rank, DDP over gloo) under
the real runtime, a real exception raised in a chosen step, the final state compared bit for bit
with a fault-free fit's; the errors a wrong set-up gets; the step marks on their own.

The faults land where Lightning's own resume would not continue exactly (right after a
validation that ran in the middle of an epoch, at an epoch's first batch, inside a backward pass,
in an accumulation window): the integration's snapshot is taken between two batches, not inside
a hook, and the restore must continue from there as if nothing happened.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import resilient
from chaos.compare import assert_bit_exact
from resilient.events import read_run_events

pytest.importorskip(
    "lightning", reason="the Lightning integration needs lightning: pip install -e '.[lightning]'"
)
import torchmetrics  # (a dependency of lightning)

from resilient.integrations import _lightning_state
from resilient.integrations._lightning_state import StepMarks
from resilient.integrations.lightning import (
    LightningSetupError,
    ResilientDDPStrategy,
    lightning_package,
)

PACKAGES = [
    "lightning.pytorch",
    pytest.param("pytorch_lightning", marks=pytest.mark.skipif(
        importlib.util.find_spec("pytorch_lightning") is None, reason="pytorch_lightning is not installed"
    )),
]  # fmt: skip
BATCHES = 8  # per epoch (64 samples, batches of 8)


class StepFault(RuntimeError):
    """The exception a test raises inside a step (a real exception, where the chaos harness's is)."""


class Faults(resilient.Hook):
    """Raises :class:`StepFault` when step ``at`` begins, once; keeps the final tracked state."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.final: dict[str, Any] | None = None

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        if step == self.at:
            self.at = None
            raise StepFault(f"injected at the start of step {step}")

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        self.final = torch.utils._pytree.tree_map(
            lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, dict(final_state())
        )


class Jitter(Dataset):
    """A fixed regression set read with a random jitter (the read draws from the global RNG)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.rand(n, 6, generator=g), torch.rand(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.01 * torch.randn(6), self.y[i]


def _module(
    pl: Any,
    backward_fault: list[int] | None = None,
    hold: list[Any] | None = None,
    estimate: bool = True,
    manual: bool = False,
) -> Any:
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
            self.net = torch.nn.Sequential(*layers)
            self.mean_out = torchmetrics.MeanMetric()  # (its state is in no state_dict)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            hidden = self.net[1](self.net[0](batch[0]))
            if backward_fault and self.trainer.global_step == backward_fault[0]:
                backward_fault.clear()  # (once)

                def boom(grad: torch.Tensor) -> torch.Tensor:
                    raise StepFault("injected in the middle of a backward pass")

                # (the last layer's gradients are ready, and DDP's reducer has marked them, when
                # the backward reaches the hidden activation and raises)
                hidden.register_hook(boom)
            out = self.net[2](hidden)
            if hold is not None:
                hold.append(self.trainer.strategy.model)  # user code that keeps the DDP it saw
            loss = F.mse_loss(out, batch[1])
            # epoch aggregates (a weighted mean, a torchmetrics object): callback_metrics at the
            # epoch's end, what a monitoring callback reads
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            self.mean_out.update(out.detach())
            self.log("mean_out", self.mean_out, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            # (estimated_stepping_batches builds the train loader here, before anything is restored)
            total = int(self.trainer.estimated_stepping_batches) if estimate else 2 * BATCHES
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Jitter(BATCHES * 8, 1), batch_size=8, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(Jitter(16, 2), batch_size=8)

    class Manual(Net):
        """Manual optimization: the module steps its optimizer and scheduler itself."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt, sched = self.optimizers(), self.lr_schedulers()
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sched.step()
            self.log("train_loss", loss, on_epoch=True)
            return loss

    return Manual() if manual else Net()


def _fit(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    package: str = "lightning.pytorch",
    *,
    fault_at: int | None = None,
    backward_fault: int | None = None,
    hold: list[Any] | None = None,
    estimate: bool = True,
    mixed: str | None = None,
    every: int = 1,
    live: bool = True,
    ckpt_path: Path | None = None,
    manual: bool = False,
    **trainer: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """One ``fit`` in ``tmp`` (its own working directory: Lightning's paths are relative to it);
    returns the final tracked state, the run's events and the trainer. ``mixed``: a precision
    plugin (``16-mixed`` with a ``GradScaler`` whose scale grows every 3 steps, or ``bf16-mixed``);
    ``every``: the snapshot interval (a restore goes back to the newest multiple of it, unless
    ``live``: the step the fault hit, when every rank vouches for it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp)
    pl = importlib.import_module(package)
    pl.seed_everything(0)
    faults = Faults(fault_at)
    strategy = ResilientDDPStrategy(
        lightning=package, hooks=[faults], snapshot={"interval": every, "live": live},
        events={"dir": str(tmp / "runs")}, health={"checks": ["host_memory"]},
    )  # fmt: skip
    options: dict[str, Any] = {"max_epochs": 2, "val_check_interval": 0.5, **trainer}
    if mixed is not None:
        scaler = (
            None
            if mixed == "bf16-mixed"
            else torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=3)
        )
        options["plugins"] = [pl.plugins.precision.MixedPrecision(mixed, "cpu", scaler=scaler)]
    checkpoints = pl.callbacks.ModelCheckpoint(monitor="val_loss", save_top_k=2, enable_version_counter=False)
    t = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, deterministic=True, default_root_dir="out",
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
        callbacks=[checkpoints], **options,
    )  # fmt: skip
    t.fit(
        _module(pl, [backward_fault] if backward_fault is not None else None, hold, estimate, manual),
        ckpt_path=ckpt_path,
    )
    assert faults.final is not None, "the run did not finish"
    return faults.final, read_run_events(tmp / "runs"), t


Reference = Callable[..., tuple[dict[str, Any], Path]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The fault-free final state of each configuration and the directory it ran in, computed once."""
    cache: dict[tuple[Any, ...], tuple[dict[str, Any], Path]] = {}

    def get(package: str = "lightning.pytorch", **trainer: Any) -> tuple[dict[str, Any], Path]:
        key = (package, *sorted(trainer.items()))
        if key not in cache:
            where = tmp_path_factory.mktemp("ref") / "run"
            with pytest.MonkeyPatch.context() as mp:
                state, events, _ = _fit(where, mp, package, **trainer)
            assert not [e for e in events if e["event"] == "fault_detected"]
            cache[key] = state, where
        return cache[key]

    return get


def _restored(events: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in events if e["event"] == "state_restored"]


@pytest.mark.parametrize("package", PACKAGES)
def test_a_fault_right_after_a_mid_epoch_validation_resumes_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference, package: str
) -> None:
    # validation runs after batches 3 and 7 of each epoch (val_check_interval=0.5); step 4 begins
    # right after the first: Lightning's own resume would skip that validation's tail or repeat it
    state, events, trainer = _fit(tmp_path, monkeypatch, package, fault_at=4)
    assert _restored(events) == [4]
    assert trainer.global_step == 2 * BATCHES
    assert assert_bit_exact(reference(package)[0], state) > 0


@pytest.mark.parametrize("estimate", [True, False], ids=["loader-built-in-setup", "loader-built-by-the-loop"])
def test_a_fault_at_an_epoch_s_first_batch_resumes_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference, estimate: bool
) -> None:
    # step 8 begins the second epoch: after the first's end (its validation, checkpoint, the
    # epoch-end hooks) and the second's start (a new shuffle, drawn from the RNG); the train loader
    # was built in configure_optimizers (estimated_stepping_batches) or by the fit loop
    state, events, _ = _fit(tmp_path, monkeypatch, fault_at=BATCHES, estimate=estimate)
    assert _restored(events) == [BATCHES]
    ref, where = reference(estimate=estimate)
    assert_bit_exact(ref, state)  # (ModelCheckpoint's state too: its best files, their scores)
    files = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert len(files) == 2 and files == sorted(p.name for p in (where / "out" / "checkpoints").iterdir())


def test_a_fault_inside_an_accumulation_window_and_max_steps_mid_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    # a step is an optimizer step: 2 batches each; the run stops at max_steps in its second epoch
    opts = {"accumulate_grad_batches": 2, "max_steps": 6}
    state, events, trainer = _fit(tmp_path, monkeypatch, fault_at=5, **opts)
    assert _restored(events) == [5] and trainer.global_step == 6
    assert_bit_exact(reference(**opts)[0], state)


def test_manual_optimization_resumes_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    # the module calls opt.step() itself (through Lightning's optimizer wrapper): still one step each
    state, events, trainer = _fit(tmp_path, monkeypatch, fault_at=5, manual=True)
    assert _restored(events) == [5] and trainer.global_step == 2 * BATCHES
    assert_bit_exact(reference(manual=True)[0], state)


def test_a_fault_after_resuming_from_a_lightning_checkpoint_goes_back_to_the_resumed_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fit(ckpt_path=...) resumes Lightning's own checkpoint (the loops, the optimizer); the first
    # step's state is kept after that, so a fault before the next snapshot restores the resumed
    # run, not a fresh optimizer and loops around the checkpoint's weights
    _, _, first = _fit(tmp_path / "first", monkeypatch, max_epochs=1)
    first.save_checkpoint(tmp_path / "epoch0.ckpt")
    ref, _, _ = _fit(tmp_path / "ref", monkeypatch, ckpt_path=tmp_path / "epoch0.ckpt")
    state, events, trainer = _fit(
        tmp_path / "run", monkeypatch, ckpt_path=tmp_path / "epoch0.ckpt", fault_at=0
    )
    assert _restored(events) == [0] and trainer.global_step == 2 * BATCHES
    assert_bit_exact(ref, state)


@pytest.mark.parametrize("live", [True, False], ids=["live", "ring"])
@pytest.mark.parametrize("mixed", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_and_its_grad_scaler_resume_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference, mixed: str, live: bool
) -> None:
    # the scaler's scale doubles every 3 steps: restored (to step 8, or live to 11) with the
    # precision plugin's state, it goes on from that step's, not from where the failed step 11 left it
    state, events, _ = _fit(tmp_path, monkeypatch, fault_at=11, mixed=mixed, every=4, live=live)
    assert _restored(events) == [11 if live else 8]
    ref = reference(mixed=mixed)[0]
    if mixed == "16-mixed":
        assert ref["trainer"]["MixedPrecision"]["scale"] == 2.0**6 * 2 ** (2 * BATCHES // 3)
    assert_bit_exact(ref, state)


def test_a_fault_in_backward_with_the_failed_ddp_still_held_resumes_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    # the backward pass raises half-way: the failed DDP's reducer has marked some gradients
    # ready, and user code still holds that DDP; its hooks must not fire in the next entry
    held: list[Any] = []
    state, events, _ = _fit(tmp_path, monkeypatch, backward_fault=6, hold=held)
    assert _restored(events) == [6] and len({id(m) for m in held}) == 2
    assert next(e for e in events if e["event"] == "fault_detected")["signature"].startswith("exception")
    assert_bit_exact(reference()[0], state)


def test_lightnings_own_restart_decisions_would_not_continue_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    # the comparison above can fail: without the integration's two adjustments Lightning treats
    # the snapshot as one saved in on_validation_end and counts the batch after it twice
    monkeypatch.setattr(_lightning_state, "continue_after_restore", lambda trainer: None)
    state, _, _ = _fit(tmp_path, monkeypatch, fault_at=4)
    with pytest.raises(AssertionError, match="_batches_that_stepped"):
        assert_bit_exact(reference()[0], state)


# ---- a wrong set-up: an error naming the culprit ------------------------------------------------------
def test_a_keyword_that_is_neither_config_nor_ddp_is_named() -> None:
    with pytest.raises(LightningSetupError, match=r"ResilientDDPStrategy\(hang_timout=\.\.\.\)"):
        ResilientDDPStrategy(lightning="lightning.pytorch", hang_timout=30)
    with pytest.raises(LightningSetupError, match="start_method='spawn'"):
        ResilientDDPStrategy(lightning="lightning.pytorch", start_method="spawn")
    with pytest.raises(resilient.ConfigError, match="hang_timeout"):
        ResilientDDPStrategy(lightning="lightning.pytorch", hang_timeout=-1)
    with pytest.raises(LightningSetupError, match=r"one of lightning\.pytorch, pytorch_lightning"):
        ResilientDDPStrategy(lightning="lightning")


def test_the_strategy_is_the_imported_packages_ddp_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl

    s = ResilientDDPStrategy(lightning="lightning.pytorch", hang_timeout=30, find_unused_parameters=True)
    assert isinstance(s, pl.strategies.DDPStrategy) and isinstance(s, ResilientDDPStrategy)
    assert s.resilient_config.hang_timeout == 30 and s._ddp_kwargs == {"find_unused_parameters": True}
    assert not isinstance(pl.strategies.DDPStrategy(), ResilientDDPStrategy)
    # a process that imported both packages says which Trainer the strategy is for
    monkeypatch.setitem(sys.modules, "pytorch_lightning", sys.modules.get("pytorch_lightning", pl))
    with pytest.raises(LightningSetupError, match=r"both lightning\.pytorch and pytorch_lightning"):
        lightning_package()


def test_devices_without_a_launcher_and_a_scripts_own_group_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl

    monkeypatch.chdir(tmp_path)
    kw = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "max_steps": 1}
    t = pl.Trainer(devices=2, strategy=ResilientDDPStrategy(lightning="lightning.pytorch"), **kw)
    with pytest.raises(LightningSetupError, match="resilient launch --nproc-per-node 2"):
        t.fit(_module(pl))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        t = pl.Trainer(devices=1, strategy=ResilientDDPStrategy(lightning="lightning.pytorch"), **kw)
        with pytest.raises(LightningSetupError, match="drop the script's init_process_group"):
            t.fit(_module(pl))
    finally:
        torch.distributed.destroy_process_group()


def test_validate_before_fit_and_test_after_it_run_as_lightning_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # validate/test make Lightning's own process group; fit replaces one made before it with the
    # runtime's, and the group is Lightning's again for the test after it
    import lightning.pytorch as pl

    monkeypatch.chdir(tmp_path)
    strategy = ResilientDDPStrategy(lightning="lightning.pytorch", events={"dir": str(tmp_path / "runs")})
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=3,
                   enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    model = _module(pl)
    assert t.validate(model)[0]["val_loss"] > 0
    t.fit(model)
    assert t.global_step == 3 and [e["step"] for e in read_run_events(tmp_path / "runs")
                                   if e["event"] == "run_finished"] == [2]  # fmt: skip
    model.test_step = model.validation_step
    t.test(model, dataloaders=model.val_dataloader())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_a_training_step_that_fetches_its_own_batches_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl

    class Iterating(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(6, 1)

        def training_step(self, dataloader_iter: Any) -> torch.Tensor:
            return self.net(next(dataloader_iter)[0][0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Jitter(16, 1), batch_size=8)

    monkeypatch.chdir(tmp_path)
    strategy = ResilientDDPStrategy(lightning="lightning.pytorch", events={"dir": str(tmp_path / "runs")})
    t = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=2,
                   enable_progress_bar=False)  # fmt: skip
    with pytest.raises(LightningSetupError, match="dataloader_iter"):
        t.fit(Iterating())


def test_lightning_is_imported_by_the_integration_only() -> None:
    # `import resilient` (the runtime, the launcher, the harness's imports) must work without
    # Lightning and not pay its import: no module outside the integration imports it, and the
    # integration's own modules import it only when a strategy is built
    import ast

    root = Path(resilient.__file__).parent
    lightning = ("lightning", "pytorch_lightning", "lightning_fabric")
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        at_top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        mine = path.parent.name == "integrations" and path.stem in (
            "lightning",
            "_lightning_state",
            "_lightning_strategy",
            "_lightning_metrics",
        )
        for node in at_top if mine else list(ast.walk(tree)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.split(".")[0] in lightning]
            assert not bad, f"{path.relative_to(root.parent)}:{node.lineno} imports {bad}"


# ---- the step marks --------------------------------------------------------------------------------
def test_a_step_is_an_optimizer_step_begun_before_its_first_batch_is_fetched() -> None:
    log: list[str] = []
    steps = iter(range(100))
    marks = StepMarks(lambda: (log.append(f"begin {next(steps)}"), 0)[1], lambda: log.append("end"))
    marks.begin()  # (in the strategy's setup: the restore point)
    for batch in range(6):  # accumulate_grad_batches=2: the optimizer steps after batches 1, 3, 5
        marks.before_fetch()
        log.append(f"batch {batch}")
        if batch % 2 == 1:
            marks.optimizer_stepped()
    marks.train_end()
    marks.train_end()  # (once)
    assert log == [
        "begin 0", "batch 0", "batch 1", "end", "begin 1", "batch 2", "batch 3", "end", "begin 2",
        "batch 4", "batch 5", "end",
    ]  # fmt: skip
