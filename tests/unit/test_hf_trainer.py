"""The Hugging Face Trainer and Accelerate integration in one process, no process group.

The built-in engine runs with the fakes of test_core (an in-memory store, no group): a real
``transformers.Trainer`` (a small GPT-2 from a config, dropout on, shuffled data, a cosine
schedule) and a real Accelerate loop, each hit by a real exception at a planned step, must end
bit for bit where the fault-free run ends: model, optimizer, scheduler, the Trainer's state and
log history, the loader's position.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
accelerate = pytest.importorskip("accelerate", reason="the hf extra: pip install -e '.[hf]'")

from chaos.compare import assert_bit_exact  # noqa: E402
from resilient.errors import ResilienceError  # noqa: E402
from resilient.integrations import hf  # noqa: E402
from resilient.runtime.context import Context  # noqa: E402
from resilient.runtime.hooks import Hook  # noqa: E402
from resilient.runtime.steps.loop import StepLoop  # noqa: E402
from resilient.state.registry import RNG  # noqa: E402
from tests.unit.test_core import Fakes, _cfg, _runtime  # noqa: E402

STEPS = 12  # optimizer steps; the data set holds 6 of them: two epochs
ACCUM = 2


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class FaultAt(Hook):
    """A real exception at the start of ``step``, once (the chaos harness fires faults so)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        if step == self.step:
            self.step = None
            raise ValueError(f"injected at step {step}")


class StepCounter(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
    """A user's stateful callback (the kind the Trainer saves in its checkpoints): it counts steps."""

    def __init__(self) -> None:
        self.seen = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen += 1

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"seen": self.seen}}


def _model() -> Any:
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _args(tmp: Path, **kw: Any) -> Any:
    base: dict[str, Any] = dict(
        output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM, learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=2,
        seed=0, logging_steps=2, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


def _final(loop: StepLoop) -> dict[str, Any]:
    """What the certificate compares: every tracked object's state at the end (RNGs aside)."""
    state = loop.gen.registry.capture()
    return {k: _copy(v) for k, v in state.items() if k != RNG}


def _copy(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_copy(v) for v in tree)
    return tree


def _trainer_run(
    tmp: Path, fault: int | None, interval: int = 3, live: bool = True, **args: Any
) -> tuple[dict[str, Any], Fakes]:
    fakes = Fakes(tmp)
    rt = _runtime(fakes, _cfg(snapshot={"interval": interval, "live": live}), hooks=[FaultAt(fault)])

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        trainer = transformers.Trainer(
            model=_model(), args=_args(tmp, **args), train_dataset=Tokens(6 * ACCUM * 2),
            eval_dataset=Tokens(4) if args.get("eval_strategy") else None, callbacks=[StepCounter()],
        )  # fmt: skip
        hf.attach(trainer, ctx).train()
        return _final(loop)

    return rt.run(fn), fakes


@pytest.fixture(scope="module")
def trainer_ref(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    got, fakes = _trainer_run(tmp_path_factory.mktemp("ref"), None)
    assert not fakes.events("fault_detected")
    return got


@pytest.mark.parametrize("live", [True, False], ids=["live", "ring"])
@pytest.mark.parametrize(
    ("fault", "restored", "where"),
    [(8, 6, "epoch 1 at its first batch"), (5, 3, "epoch 0, 3 optimizer steps in")],
)
def test_a_fault_in_trainer_train_resumes_the_epoch_where_it_was_bit_exact(
    tmp_path: Path, trainer_ref: dict[str, Any], fault: int, restored: int, where: str, live: bool
) -> None:
    # live: the faulted step itself (the fault comes as it begins); the ring: its snapshot's
    got, fakes = _trainer_run(tmp_path, fault, live=live)
    (restore,) = fakes.events("state_restored")
    assert (restore["step"], restore["source"]) == ((fault, "live") if live else (restored, "ring")), where
    assert sorted(restore["objects"]) == ["model", "optimizer", "scheduler", "trainer"]
    assert got["trainer"]["state"]["global_step"] == STEPS
    counter = [c["state"] for c in got["trainer"]["callbacks"] if c["name"] == "StepCounter"]
    assert counter == [{"args": {}, "attributes": {"seen": STEPS}}]  # each step counted once
    assert assert_bit_exact(trainer_ref, got) > 20
    # the log history is the fault-free run's: losses, learning rates, gradient norms (no timings)
    logged = [e for e in got["trainer"]["state"]["log_history"] if "loss" in e]
    assert [e["step"] for e in logged] == list(range(2, STEPS + 1, 2))


@pytest.mark.parametrize("live", [True, False], ids=["live", "ring"])
def test_evaluation_inside_a_step_and_a_restore_at_an_epoch_start_stay_bit_exact(
    tmp_path: Path, live: bool
) -> None:
    # an evaluation draws from the global RNG (its loader's seed); it belongs to the step before
    ref, _ = _trainer_run(tmp_path / "ref", None, eval_strategy="steps", eval_steps=2)
    got, fakes = _trainer_run(tmp_path / "hit", 7, live=live, eval_strategy="steps", eval_steps=2)
    assert fakes.events("state_restored")[0]["step"] == (7 if live else 6)
    assert assert_bit_exact(ref, got) > 20
    evals = [e["step"] for e in got["trainer"]["state"]["log_history"] if "eval_loss" in e]
    assert evals == list(range(2, STEPS + 1, 2))  # each once: neither lost nor run twice


@pytest.mark.parametrize("flag", ["auto_find_batch_size", "ignore_data_skip"])
def test_refused_arguments_are_named(tmp_path: Path, flag: str) -> None:
    rt = _runtime(Fakes(tmp_path), _cfg(restart={"max_recoveries": 0}))

    def fn(loop: StepLoop) -> None:
        trainer = transformers.Trainer(model=_model(), args=_args(tmp_path, **{flag: True}),
                                       train_dataset=Tokens(8))  # fmt: skip
        hf.attach(trainer, Context(loop)).train()

    with pytest.raises(hf.UnsupportedTrainer, match=rf"TrainingArguments\({flag}=True\) is not supported"):
        rt.run(fn)


def test_a_second_train_in_one_entry_is_refused(tmp_path: Path) -> None:
    rt = _runtime(Fakes(tmp_path), _cfg(restart={"max_recoveries": 0}))

    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        for _ in range(2):
            trainer = transformers.Trainer(model=_model(), args=_args(tmp_path, max_steps=2),
                                           train_dataset=Tokens(8))  # fmt: skip
            hf.attach(trainer, ctx).train()

    with pytest.raises(ResilienceError, match=r"a second trainer.train\(\) in one entry"):
        rt.run(fn)


def test_train_outside_a_resilient_function_says_what_to_do(tmp_path: Path) -> None:
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path, max_steps=1), train_dataset=Tokens(4))
    with pytest.raises(hf.UnsupportedTrainer, match=r"decorate the function that calls it"):
        hf.attach(trainer).train()
    with pytest.raises(hf.UnsupportedTrainer, match=r"takes a transformers.Trainer, not a Linear"):
        hf.attach(torch.nn.Linear(1, 1))


# -- Accelerate --------------------------------------------------------------------------------------
def _accelerate_run(tmp: Path, fault: int | None, live: bool = True) -> tuple[dict[str, Any], Fakes]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    fakes = Fakes(tmp)
    rt = _runtime(fakes, _cfg(snapshot={"interval": 3, "live": live}), hooks=[FaultAt(fault)])

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        set_seed(0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        loader = torch.utils.data.DataLoader(Tokens(16), batch_size=2, shuffle=True,
                                             collate_fn=transformers.default_data_collator)  # fmt: skip
        sched = transformers.get_cosine_schedule_with_warmup(opt, 1, 8)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        ctx.track(**hf.trackable(model=model, optimizer=opt, loader=loader, scheduler=sched, accelerator=acc))
        for _ in ctx.epochs(2):
            for batch in ctx.steps(loader):
                with acc.accumulate(model):
                    acc.backward(model(**batch).loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        return _final(loop)

    return rt.run(fn), fakes


@pytest.mark.parametrize("live", [True, False], ids=["live", "ring"])
def test_an_accelerate_loop_over_prepared_objects_recovers_inside_a_window_bit_exact(
    tmp_path: Path, live: bool
) -> None:
    # live: the step in the window's middle, its gradients carried (the fault comes before its backward)
    ref, _ = _accelerate_run(tmp_path / "ref", None)
    got, fakes = _accelerate_run(
        tmp_path / "hit", 11, live
    )  # 8 batches an epoch: epoch 1, batch 1 of a window
    (restore,) = fakes.events("state_restored")
    assert restore["step"] == (11 if live else 9)
    assert assert_bit_exact(ref, got) > 20
    assert got["accelerator"]["step"] == ref["accelerator"]["step"]


def test_prepared_objects_that_cannot_be_restored_are_named() -> None:
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
    from accelerate.optimizer import AcceleratedOptimizer

    data = Tokens(8)
    with pytest.raises(hf.NotTrackable, match=r"loader=DataLoaderDispatcher \(dispatch_batches=True"):
        hf.trackable(loader=DataLoaderDispatcher(data, batch_size=2))
    stateful = DataLoaderShard(data, batch_size=2, use_stateful_dataloader=True)
    with pytest.raises(hf.NotTrackable, match=r"loader=DataLoaderShard over torchdata's StatefulDataLoader"):
        hf.trackable(loader=stateful)
    # the optimizer accelerate wraps cannot take the runtime's hooks: its inner one is tracked
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    accelerate.Accelerator(cpu=True)
    wrapped = AcceleratedOptimizer(inner, device_placement=False)
    assert hf.trackable(optimizer=wrapped) == {"optimizer": inner}


def test_a_prepared_loaders_position_is_what_it_yielded() -> None:
    from accelerate.data_loader import DataLoaderShard

    shard = DataLoaderShard(Tokens(8), batch_size=2)
    (loader,) = hf.trackable(loader=shard).values()
    assert loader is shard  # made resumable in place: the loop iterates the same object
    it = iter(shard)
    seen = [int(next(it)["input_ids"][0, 0]) for _ in range(2)]  # it reads a batch ahead
    assert shard._resilient_pos.consumed == 2 == shard.state_dict()["consumed"]
    rest = [int(b["input_ids"][0, 0]) for b in it]
    assert shard._resilient_pos.consumed == 4 and len(seen + rest) == 4
