"""The strategy and launcher classes, built once per Lightning package (``lightning.pytorch`` and
``pytorch_lightning`` are two class hierarchies: a ``Trainer`` accepts only its own package's
``Strategy``). Everything Lightning-version-specific of the integration sits here and in
:mod:`resilient.integrations._lightning_state`.

How ``Trainer.fit`` runs under it: Lightning hands ``fit``'s body (``Trainer._fit_impl``) to the
strategy's launcher; the launcher runs it inside ``resilient.wrap``, so the runtime owns the
process group (``setup_distributed`` finds it made) and re-enters the body on the same objects
after a soft fault. In each entry the strategy's ``setup`` (the model wrapped in DDP, the
optimizers built) tracks the state and begins the first step, which restores a snapshot when
there is one: before the fit loop starts, as a resume from a Lightning checkpoint would.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from loguru import logger
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from resilient.config import Config, load_config
from resilient.errors import ResilienceError
from resilient.integrations._lightning_state import StepMarks, TrainerState, fit_loop_continues, set_epoch
from resilient.launch_env import LaunchEnv
from resilient.runtime.standby import parking
from resilient.state.loader import is_stateful_loader, make_resumable

# DDPStrategy's own arguments besides the DistributedDataParallel keywords it passes through
_CONFIG_KEYS = frozenset(Config.model_fields)
_DDP_KEYS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
_UNSUPPORTED_STARTS = ("spawn", "fork", "forkserver")
_fits = 0  # trainer.fit runs under the runtime in this process
BUILT: list[type] = []  # the strategy classes built so far, one per Lightning package


class LightningSetupError(ResilienceError):
    """A ``Trainer`` set-up the integration cannot run (named, with what to do instead)."""


class FitRun:
    """One ``trainer.fit`` under the runtime: its entries (one per generation) and what each
    attaches to the trainer."""

    def __init__(self, strategy: Any, trainer: Any, pl: ModuleType) -> None:
        self.strategy = strategy
        self.trainer = trainer
        self.pl = pl
        self.entries = 0
        self.ctx: Any = None  # this entry's resilient.Context
        self.marks: StepMarks | None = None
        self.state: TrainerState | None = None

    def run(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import resilient

        global _fits
        s = self.strategy
        if _fits and LaunchEnv.from_environ().run_id is not None:
            raise LightningSetupError(
                "trainer.fit under ResilientDDPStrategy ran in this process already: the runtime keys "
                "its store by the launcher's run id, and a second run would wait on the first's keys; "
                "run the second fit in a job of its own (validate, test and predict are fine)"
            )
        s.release_group()
        bound = inspect.signature(function).bind(*args, **kwargs)

        @resilient.wrap(config=s.resilient_config, checks=s.resilient_checks, hooks=s.resilient_hooks)
        def fit(ctx: resilient.Context | None = None) -> Any:  # (wrap hands every entry its ctx)
            assert ctx is not None
            if self.entries:
                self._reenter()
                bound.arguments["ckpt_path"] = None  # (the snapshot is newer than the file fit was given)
            self.entries += 1
            self.ctx, self.state = ctx, None
            self.marks = StepMarks(ctx.begin_step, ctx.end_step)
            return function(*bound.args, **bound.kwargs)

        s._fit_run = self
        _fits += 1
        try:
            return fit()
        finally:
            s._fit_run = None
            loop = self.trainer.fit_loop.epoch_loop
            for patched in ("_on_before_fetch", "on_run_start"):  # (the trainer's loop as Lightning made it)
                loop.__dict__.pop(patched, None)

    def _reenter(self) -> None:
        """What ``fit`` set before its body ran, again, on a trainer cleared of the failed entry:
        its loops (their data iterators, loader workers and progress are the failed step's) are
        replaced by new ones; its DDP and optimizers are let go, the DDP's hooks removed first."""
        t, s, pl = self.trainer, self.strategy, self.pl
        model = s.model
        if isinstance(model, DistributedDataParallel):
            # the next entry's DDP wraps the same parameters: the failed one's gradient hooks
            # (a reducer stopped mid-backward, a group that is gone) must not fire with it, even
            # if something still holds that DDP
            model._remove_autograd_hooks()
        old = t.fit_loop
        for undo in (old.teardown, t._logger_connector.teardown, t._signal_connector.teardown):
            try:
                undo()
            except Exception as e:  # what the failed entry left may be half-built: nothing to undo
                logger.debug("lightning: {} after a fault: {}", undo.__qualname__, e)
        fit_loop = type(old)(t, min_epochs=old.min_epochs, max_epochs=old.max_epochs)
        epoch = old.epoch_loop
        fit_loop.epoch_loop = type(epoch)(t, min_steps=epoch.min_steps, max_steps=epoch.max_steps)
        t.fit_loop = fit_loop
        s.model = s.lightning_module
        s.optimizers, s.lr_scheduler_configs = [], []
        del model, old, epoch
        gc.collect()  # (the failed entry's DDP, optimizers and loader workers go now, not at random later)
        t.state.fn = pl.trainer.states.TrainerFn.FITTING
        t.state.status = pl.trainer.states.TrainerStatus.RUNNING
        t.training = True
        t.should_stop = False

    # -- called by the strategy ------------------------------------------------------------------
    def attach(self, trainer: Any) -> None:
        """After the strategy's ``setup`` (the DDP and the optimizers exist): track the state (a
        re-entry loads the snapshot into it here) and mark the loop's steps."""
        if "dataloader_iter" in inspect.signature(trainer.lightning_module.training_step).parameters:
            raise LightningSetupError(
                "training_step(self, dataloader_iter) fetches its own batches: a step cannot be "
                "marked before them; take `batch, batch_idx` instead"
            )
        s = self.strategy
        objects: dict[str, Any] = {"model": s.model}
        opts = list(s.optimizers)
        scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
        objects.update(_named("optimizer", opts))
        objects.update(_named("scheduler", scheds))
        self.state = TrainerState(trainer, self.pl)
        objects["trainer"] = self.state  # (last: sorted by name too, as a relaunch loads them)
        assert self.ctx is not None and self.marks is not None
        self.ctx.track(**objects)
        self.marks.install(trainer, before_first=self._not_begun)

    def stage_begins(self) -> None:
        """The fit stage begins (``Trainer._run_stage``'s barrier): Lightning has restored the
        checkpoint ``fit`` was given, if any, and its loop has not started. The first step begins
        here; in a new process it restores what a predecessor left (the snapshot is newer than
        that file), otherwise the state it keeps for step 0 is the resumed one."""
        assert self.marks is not None
        if not self.marks.open:
            self.marks.begin()

    def _not_begun(self) -> None:
        raise LightningSetupError(
            f"the fit loop fetched a batch before Trainer._run_stage's barrier('run-stage'), where the "
            f"first step begins: this Lightning ({self.pl.__name__} {self.pl.__version__}) is not one the "
            "integration supports (tested: 2.6)"
        )

    def on_train_start(self) -> None:
        if self.state is not None and self.state.loaded:
            fit_loop_continues(self.trainer)

    def process_train_dataloader(self, loader: Any) -> Any:
        """A plain ``DataLoader`` gets a position (``resilient.state.loader``) that Lightning keeps
        with its loops and restores mid-epoch; its sampler is set to the epoch it resumes in
        before the resumed pass draws its order (Lightning sets it only after)."""
        if isinstance(loader, DataLoader) and (
            not callable(getattr(loader, "state_dict", None)) or is_stateful_loader(loader)
        ):  # (torchdata's StatefulDataLoader: its resumed iterator must not draw its seeds again)
            make_resumable(loader)
        set_epoch(loader, self.trainer.fit_loop.epoch_progress.current.processed)
        return loader

    def optimizer_stepped(self) -> None:
        if self.marks is not None:
            self.marks.optimizer_stepped()

    def train_end(self) -> None:
        if self.marks is not None:
            self.marks.train_end()


def _named(prefix: str, objs: Sequence[Any]) -> dict[str, Any]:
    if len(objs) == 1:
        return {prefix: objs[0]}
    return {f"{prefix}_{i}": o for i, o in enumerate(objs)}


# The bodies below are put on each package's own base classes by strategy_class: to the type
# checker that base is unknown (Any), so that their calls up to it are not refused.
if TYPE_CHECKING:
    _LightningBase = Any
else:
    _LightningBase = object


@functools.cache
def strategy_class(pl: ModuleType) -> type:
    """``ResilientDDPStrategy`` for the Lightning package ``pl`` (``lightning.pytorch`` or
    ``pytorch_lightning``)."""
    import importlib

    for sub in ("strategies", "strategies.launchers.launcher", "trainer.states", "trainer.call", "callbacks"):
        importlib.import_module(f"{pl.__name__}.{sub}")
    ddp_base = pl.strategies.DDPStrategy
    launcher_base = pl.strategies.launchers.launcher._Launcher

    class ResilientLauncher(_Launcher, launcher_base):  # type: ignore[misc, valid-type]
        """Runs ``fit`` inside ``resilient.wrap``; ``validate``/``test``/``predict`` as Lightning does."""

        _lightning = pl

    class ResilientDDPStrategy(_Strategy, ddp_base):  # type: ignore[misc, valid-type]
        """Lightning's ``DDPStrategy`` whose ``fit`` survives faults (resilient.integrations.lightning)."""

        _lightning = pl
        _launcher_class = ResilientLauncher

    ResilientDDPStrategy.__module__ = "resilient.integrations.lightning"
    ResilientDDPStrategy.__qualname__ = "ResilientDDPStrategy"
    BUILT.append(ResilientDDPStrategy)
    return ResilientDDPStrategy


class _Launcher(_LightningBase):
    """``ResilientLauncher``: runs ``fit`` inside ``resilient.wrap`` (a :class:`FitRun`), and
    ``validate``/``test``/``predict`` as Lightning does."""

    _lightning: ModuleType  # the Lightning package of the class built on this one

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return False

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        s = self._strategy
        env = s.cluster_environment
        # (a standby of `resilient launch` runs the script before it has a rank, its worker
        # variables hidden: it goes on to resilient.wrap, which parks it or says why it cannot)
        spawning = env is not None and not env.creates_processes_externally and not parking()
        if spawning and s.num_processes * s.num_nodes > 1:
            raise LightningSetupError(
                f"Trainer(devices={s.num_processes}, num_nodes={s.num_nodes}) with "
                f"{type(self._strategy).__name__}: start the processes with `resilient launch "
                f"--nproc-per-node {s.num_processes} script.py` (or torchrun); the strategy does "
                "not spawn them"
            )
        if env is not None and not parking():
            env.validate_settings(num_devices=s.num_processes, num_nodes=s.num_nodes)
        if trainer is None or getattr(function, "__name__", "") != "_fit_impl":
            return function(*args, **kwargs)
        return FitRun(s, trainer, self._lightning).run(function, args, kwargs)

    def kill(self, signum: Any) -> None:
        return None  # (no process of its own: the launcher outside owns the workers)


def _arguments(ddp_base: Any, config: Any, kwargs: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """``ResilientDDPStrategy``'s keywords split: the runtime's configuration (``config`` with the
    keys of :class:`resilient.Config` among ``kwargs``), and what goes on to ``ddp_base`` (the
    package's ``DDPStrategy``)."""
    overrides = {k: v for k, v in kwargs.items() if k in _CONFIG_KEYS}
    kwargs = {k: v for k, v in kwargs.items() if k not in _CONFIG_KEYS}
    own = set(inspect.signature(ddp_base.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(kwargs) - own - _DDP_KEYS)
    if unknown:
        raise LightningSetupError(
            f"ResilientDDPStrategy({unknown[0]}=...): neither a key of resilient.Config "
            f"({', '.join(sorted(_CONFIG_KEYS))}) nor an argument of DDPStrategy or "
            "DistributedDataParallel"
        )
    start = kwargs.get("start_method", "popen")
    if start in _UNSUPPORTED_STARTS:
        raise LightningSetupError(
            f"ResilientDDPStrategy(start_method={start!r}): the processes must be started outside "
            "Lightning (`resilient launch` or torchrun); leave start_method unset"
        )
    backend = kwargs.get("process_group_backend")
    if backend is not None and "backend" not in overrides:
        overrides["backend"] = backend
    if isinstance(config, Config):  # (as resilient.wrap takes it)
        cfg = load_config(None, **{**config.model_dump(), **overrides}) if overrides else config
    else:
        cfg = load_config(config, **overrides)
    return cfg, kwargs


class _Strategy(_LightningBase):
    """``ResilientDDPStrategy``: Lightning's ``DDPStrategy`` whose ``fit`` runs under the runtime
    (the process group is the runtime's, the state tracked after ``setup``, the steps marked)."""

    strategy_name = "resilient_ddp"
    _lightning: ModuleType  # the Lightning package of the class built on this one
    _launcher_class: type

    def __init__(
        self,
        *,
        config: Any = None,
        checks: Sequence[Any] = (),
        hooks: Sequence[Any] = (),
        **kwargs: Any,
    ) -> None:
        cfg, kwargs = _arguments(self._lightning.strategies.DDPStrategy, config, kwargs)
        self.resilient_config = cfg
        self.resilient_checks = tuple(checks)
        self.resilient_hooks = tuple(hooks)
        self._fit_run: FitRun | None = None
        self._made_group = False  # Lightning made the default group (validate/test/predict)
        super().__init__(**kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = self._launcher_class(self)

    def setup_distributed(self) -> None:
        import torch.distributed as dist

        if self._fit_run is None or not dist.is_initialized():
            made = not dist.is_initialized()
            super().setup_distributed()  # (validate/test/predict: Lightning's own group)
            self._made_group = self._made_group or (made and dist.is_initialized())
            return
        # the runtime made this entry's group: Lightning's init would find it and skip, but its
        # seed reset and rank bookkeeping still apply
        super().setup_distributed()
        if dist.get_rank() != self.global_rank or dist.get_world_size() != self.world_size:
            raise LightningSetupError(
                f"Lightning sees rank {self.global_rank} of {self.world_size}; the process group, "
                f"rank {dist.get_rank()} of {dist.get_world_size()}: give the Trainer devices and "
                "num_nodes matching the launcher's --nproc-per-node and --nnodes"
            )

    def release_group(self) -> None:
        """Before ``fit``: the runtime makes the default group; one that Lightning made for a
        ``validate``/``test`` before goes, one made by the script is refused."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if not self._made_group:
            raise LightningSetupError(
                "a default process group exists before trainer.fit: under ResilientDDPStrategy the "
                "runtime makes it (and remakes it after a fault); drop the script's init_process_group"
            )
        dist.destroy_process_group()
        self._made_group = False

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        fitting = trainer.state.fn == self._lightning.trainer.states.TrainerFn.FITTING
        if self._fit_run is not None and fitting:
            self._fit_run.attach(trainer)

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        run = self._fit_run
        if (
            run is not None
            and run.trainer.state.stage == self._lightning.trainer.states.RunningStage.TRAINING
        ):
            dataloader = run.process_train_dataloader(dataloader)
        return dataloader

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().barrier(name, *args, **kwargs)
        if name == "run-stage" and self._fit_run is not None and self._fit_run.state is not None:
            self._fit_run.stage_begins()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        if self._fit_run is not None:
            self._fit_run.optimizer_stepped()
        return out

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._fit_run is not None:
            self._fit_run.on_train_start()

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._fit_run is not None:
            self._fit_run.train_end()
