"""The Lightning side of a snapshot: what a ``Trainer`` holds besides its model, optimizers and
schedulers, and where in Lightning's loop a step begins and ends.

**Where a step begins.** A step is one optimizer step (with ``accumulate_grad_batches=k``, the k
batches of its window). Its boundary is the moment the training epoch loop is about to fetch the
first batch of a window: everything of the previous batch is done there (``on_train_batch_end``,
a validation it triggered, the epoch's end and the next one's start, the loggers), and nothing of
the next one has begun (not even the read of its samples, which may draw random numbers). The
epoch loop has no hook there; the one call it makes at that point is ``_on_before_fetch`` (its
profiler mark), which :class:`StepMarks` wraps on the loop object. The previous step ends and the
next begins in that one place, so a snapshot holds exactly the state a resumed run continues from.

**What is kept** (:class:`TrainerState`): what Lightning writes into its own checkpoint
(``_CheckpointConnector.dump_checkpoint``: the loops' progress and the train dataloader's position,
every callback's state, the precision plugin's, the datamodule's, what ``on_save_checkpoint``
hooks add) less the weights, optimizer and scheduler states (tracked as the runtime's own
objects) and the hyper-parameters; plus ``trainer.should_stop``, the counters ``ModelCheckpoint``
keeps outside its ``state_dict`` (the step it last saved at), the logger connector's last metrics
and what ``self.log`` accumulated in the epoch so far (:mod:`._lightning_metrics`).

**How it is restored.** Into fresh loops (the integration rebuilds ``trainer.fit_loop`` before
each re-entry of ``fit``), through Lightning's own restore code, as a resume from a checkpoint
would; then two of Lightning's restart decisions are undone, because they assume a checkpoint
saved inside a hook (``on_train_batch_end``, ``on_validation_end``) while this one was taken
between two batches: the epoch loop would skip (or repeat the tail of) a validation that ran
before the snapshot, and the fit loop would skip the plateau schedulers at the epoch's end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resilient.integrations._lightning_metrics import (
    capture_metrics,
    capture_results,
    restore_metrics,
    restore_results,
)

# what dump_checkpoint writes that is not kept here: tracked as the runtime's own objects (weights,
# optimizers, schedulers), or constant for the run and not always encodable (hyper-parameters)
_TRACKED = ("state_dict", "optimizer_states", "lr_schedulers")
_CONSTANT = (
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
)
# ModelCheckpoint's counters outside its state_dict: the step it saved at last (a replayed step
# must save again), its last file, a save deferred to the next validation
_CHECKPOINT_COUNTERS = ("_last_global_step_saved", "_last_checkpoint_saved", "_defer_save_until_validation")


# the logger connector's last values: what callbacks, the loggers and the progress bar read
_METRIC_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")


class TrainerState:
    """The ``Trainer``'s state besides the tracked torch objects (see the module docstring)."""

    def __init__(self, trainer: Any, pl: Any) -> None:
        self.trainer = trainer
        self.pl = pl
        self.loaded = False  # something was restored into this trainer in this entry

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        ckpt = t._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in (*_TRACKED, *_CONSTANT):
            ckpt.pop(key, None)
        lc = t._logger_connector
        ckpt["trainer"] = {
            "should_stop": bool(t.should_stop),
            # what callbacks read (trainer.callback_metrics: a monitored val_loss between validations)
            "metrics": {k: dict(getattr(lc, k)) for k in _METRIC_DICTS},
            "first_loop_iter": lc._first_loop_iter,
            # what self.log(on_epoch=True) and torchmetrics objects accumulated in this epoch so far
            "results": capture_results(t.fit_loop.epoch_loop._results),
            "torchmetrics": capture_metrics(t.lightning_module),
        }
        ckpt["checkpoint_counters"] = {
            cb.state_key: {k: getattr(cb, k) for k in _CHECKPOINT_COUNTERS if hasattr(cb, k)}
            for cb in self._model_checkpoints()
        }
        return ckpt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        connector = t._checkpoint_connector
        ckpt = dict(state)
        extra = ckpt.pop("trainer", {})
        counters = ckpt.pop("checkpoint_counters", {})
        # the hooks see a checkpoint of the usual shape (a user's on_load_checkpoint may read it)
        ckpt["state_dict"] = t.strategy.lightning_module_state_dict()
        connector._loaded_checkpoint = ckpt
        try:
            connector.restore_datamodule()
            self.pl.trainer.call._call_lightning_module_hook(t, "on_load_checkpoint", ckpt)
            connector.restore_callbacks()
            connector.restore_precision_plugin_state()
            if _started(ckpt):  # (a snapshot taken before the first epoch began: the loops are fresh)
                connector.restore_loops()
                continue_after_restore(t)
                _resume_built_loader(t)
        finally:
            connector._loaded_checkpoint = {}
        t.should_stop = bool(extra.get("should_stop", False))
        lc = t._logger_connector
        for k, v in extra.get("metrics", {}).items():
            setattr(lc, k, dict(v))
        lc._first_loop_iter = extra.get("first_loop_iter")
        restore_results(t.fit_loop.epoch_loop._results, extra.get("results", []), self.pl, t.strategy.reduce)
        restore_metrics(t.lightning_module, extra.get("torchmetrics", {}))
        for cb in self._model_checkpoints():
            for k, v in counters.get(cb.state_key, {}).items():
                setattr(cb, k, v)
        self.loaded = True

    def _model_checkpoints(self) -> list[Any]:
        mc = self.pl.callbacks.ModelCheckpoint
        return [cb for cb in self.trainer.callbacks if isinstance(cb, mc)]


def _started(ckpt: dict[str, Any]) -> bool:
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    return int(progress.get("total", {}).get("ready", 0)) > 0


def set_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on the loader's sampler(s), as Lightning does at each epoch's start."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        set_it = getattr(sampler, "set_epoch", None)
        if callable(set_it):
            set_it(epoch)


def _resume_built_loader(trainer: Any) -> None:
    """The train loader was built already in this entry (``trainer.estimated_stepping_batches``
    in ``configure_optimizers`` builds it, and its iterator, before anything is restored):
    Lightning would not load its position any more, so it is loaded here and its iterator made
    again, in the restored epoch."""
    fit_loop = trainer.fit_loop
    combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if combined is None or fetcher is None:
        return  # (the fit loop builds it and loads the position itself)
    if not (fit_loop.restarting and fit_loop._combined_loader_states_to_load):
        return  # (a finished epoch: the pass made in setup is the next epoch's, as in the first run)
    fit_loop._load_combined_loader_states()
    for loader in combined.flattened:
        set_epoch(loader, fit_loop.epoch_progress.current.processed)
    fetcher.teardown()  # (the iterator made before the restore, and its workers)
    fetcher.setup(combined)
    iter(fetcher)


def continue_after_restore(trainer: Any) -> None:
    """Undo Lightning's restart decisions that assume a checkpoint saved inside a hook (see the
    module docstring): once the epoch loop has re-entered its epoch (its ``reset`` kept the
    restored counters, its ``on_run_start`` did not create a new data iterator) it runs on as an
    uninterrupted loop, and so does the fit loop once it has picked its restart stage (the strategy
    calls :func:`fit_loop_continues` from ``on_train_start``)."""
    loop = trainer.fit_loop.epoch_loop
    original = type(loop).on_run_start

    def on_run_start(data_fetcher: Any) -> None:
        del loop.on_run_start  # (once: the class's own from now on)
        original(loop, data_fetcher)
        loop.restarting = False  # (and its children: the validation loop, the optimization loops)

    loop.on_run_start = on_run_start


def fit_loop_continues(trainer: Any) -> None:
    """The fit loop has chosen where to re-enter (mid-epoch: no ``on_train_epoch_start`` again):
    from here on it runs as an uninterrupted loop (its epoch-end plateau schedulers step)."""
    trainer.fit_loop._restarting = False


class StepMarks:
    """Where Lightning's loop begins and ends the runtime's steps (see the module docstring).
    ``begin``/``end``: ``ctx.begin_step``/``ctx.end_step``."""

    def __init__(self, begin: Callable[[], int], end: Callable[[], None]) -> None:
        self._begin, self._end = begin, end
        self.open = False  # a step was begun and not ended
        self.began = False  # a step was begun in this entry
        self.stepped = 0  # optimizer steps since it began

    def begin(self) -> int:
        step = self._begin()
        self.open, self.began, self.stepped = True, True, 0
        return step

    def optimizer_stepped(self) -> None:
        self.stepped += 1

    def before_fetch(self) -> None:
        """The epoch loop is about to fetch a batch: a window's first one begins a step."""
        if not self.open:
            self.begin()
        elif self.stepped:
            self._end()
            self.open = False
            self.begin()

    def train_end(self) -> None:
        """The fit loop ended: the last step is complete (one that stepped no optimizer is not a step)."""
        if self.open and self.stepped:
            self._end()
            self.open = False

    def install(self, trainer: Any, before_first: Callable[[], None]) -> None:
        """Mark the epoch loop's fetches (its ``_on_before_fetch``, wrapped on the loop object);
        ``before_first``: called at a fetch when no step was begun yet (the first one begins
        before the loop starts)."""
        loop = trainer.fit_loop.epoch_loop
        original = type(loop)._on_before_fetch

        def on_before_fetch() -> None:
            if not self.began:
                before_first()
            self.before_fetch()
            original(loop)

        loop._on_before_fetch = on_before_fetch
