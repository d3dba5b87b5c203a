"""What the decorated training function sees: ``ctx.track(...)`` and ``ctx.steps(n)``."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar, overload

import torch

from resilient.identity import Identity
from resilient.state.carry import Carried

T = TypeVar("T")


class Session(Identity, Protocol):
    """What ``ctx`` reads of the run besides who this rank is (:class:`~resilient.identity.Identity`;
    the engine's session: :class:`~resilient.runtime.run.session.Session`)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def run_dir(self) -> Path: ...


class Loop(Protocol):
    """What a :class:`Context` needs of the runtime: the step loop (:class:`~resilient.runtime.
    steps.loop.StepLoop`, the same under both engines) and, through it, the run's identity."""

    @property
    def session(self) -> Session: ...

    @property
    def restored_step(self) -> int | None: ...

    @property
    def job_start(self) -> bool: ...

    step: int | None

    def track(self, objects: dict[str, Any]) -> None: ...

    def carry(self, carried: Carried) -> None: ...

    def steps(self, total: int) -> Iterator[int]: ...

    def steps_over(self, batches: Iterable[Any]) -> Iterator[Any]: ...

    def epochs(self, total: int) -> Iterator[int]: ...

    def observe(self, loss: Any) -> None: ...

    def begin_step(self) -> int: ...

    def end_step(self) -> None: ...


class Context:
    """Handle to the runtime for one entry of the training function (one generation)."""

    def __init__(self, runtime: Loop, prepared: Callable[[], Any] | None = None) -> None:
        self._rt = runtime
        self._prepared = prepared

    @property
    def prepared(self) -> Any:
        """What ``resilient.wrap(prepare=...)`` built for this entry: rank-independent set-up (a
        model built on the CPU, a tokenizer) that a parked standby of ``resilient launch`` runs
        before it is promoted; any other entry builds it when first asked."""
        if self._prepared is None:
            from resilient.errors import ResilienceError

            raise ResilienceError("ctx.prepared: resilient.wrap was given no prepare= function")
        return self._prepared()

    @property
    def rank(self) -> int:
        """This process's global rank in the current group (``dist.get_rank()``); a replacement
        started by ``resilient launch`` has its dead predecessor's."""
        return self._rt.session.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the current group (``dist.get_world_size()``)."""
        return self._rt.session.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``): the GPU it uses on NCCL."""
        return self._rt.session.local_rank

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` on NCCL, ``cpu`` on gloo."""
        return self._rt.session.device

    @property
    def generation(self) -> int:
        """How many in-process restarts happened so far (0 on the first entry)."""
        return self._rt.session.generation

    @property
    def restored_step(self) -> int | None:
        """The step this entry resumed at after a restart, else ``None``: after an in-process
        restart, from the function's entry on; in a process that ``resilient launch`` started
        again (or that replaced a dead rank), once ``ctx.steps``/``ctx.epochs`` restored it."""
        return self._rt.restored_step

    @property
    def job_start(self) -> bool:
        """True only in the entry that begins the job from nothing: the first entry of a process
        that is not a replacement and finds no state of this job to resume (no snapshot in shared
        memory, no checkpoint ``checkpoint.resume`` would load). False after any fault: in a
        re-entry, a replaced rank, a relaunched job that resumes. Set-up that must happen once
        per job goes under it, before ``ctx.steps``::

            log = open(log_file, "w" if ctx.job_start else "a")  # a re-entry appends, never truncates
            if ctx.job_start and ctx.rank == 0:
                run = wandb.init(...)                            # (else wandb.init(resume=...))

        Read it before the loop (it is False once a step ran)."""
        return self._rt.job_start

    @property
    def step(self) -> int | None:
        """The step being run (inside ``ctx.steps``)."""
        return self._rt.step

    @property
    def run_dir(self) -> Any:
        """The directory of this run's event log (``resilient_runs/<run_id>``, a ``Path``):
        ``resilient events`` and ``resilient report`` read it."""
        return self._rt.session.run_dir

    def track(self, **objects: Any) -> None:
        """Register state to snapshot after good steps and restore after a fault.

        Anything with ``state_dict``/``load_state_dict`` (model, optimizer, LR scheduler, grad scaler,
        a stateful sampler or data iterator) or a ``torch.Generator``. RNGs are always tracked.
        After a restart, the objects passed here are loaded from the snapshot immediately.
        """
        self._rt.track(objects)

    def carry(self, **initial: Any) -> Carried:
        """Values the loop carries from one step to the next outside any tracked object (a batch
        prefetched for the next step, a best loss, an EMA, a counter), kept and restored with the
        tracked state. Returns an object whose fields are read and set as attributes; after a
        fault it holds the values of the step the run resumes at, not ``initial``::

            carry = ctx.carry(batch=get_batch("train"), best_val_loss=1e9)
            for step in ctx.steps(n):
                x, y = carry.batch
                ...
                carry.batch = get_batch("train")  # the next step's, drawn in this one

        A field holds tensors, arrays, numbers, strings, bytes, ``None``, or dicts, lists and
        tuples of those. Call it once per entry of the function, before ``ctx.steps``.
        """
        carried = Carried(**initial)
        self._rt.carry(carried)
        return carried

    def observe(self, **values: Any) -> None:
        """Report this step's ``loss`` (a tensor or a number) to the step guard: a non-finite
        loss, or one ``guard.loss_spike`` times the median of the recent ones, is a fault raised
        here, before the step is applied (every rank rolls back and replays). It reads the
        value (a device sync on GPU): call it where the loop reads the loss anyway."""
        unknown = sorted(set(values) - {"loss"})
        if unknown:
            raise TypeError(f"ctx.observe() takes loss=...; got {', '.join(unknown)}")
        if "loss" in values:
            self._rt.observe(values["loss"])

    @overload
    def steps(self, total: int) -> Iterator[int]: ...

    @overload
    def steps(self, total: Iterable[T]) -> Iterator[T]: ...

    def steps(self, total: int | Iterable[Any]) -> Iterator[Any]:
        """Yield step indices up to ``total``; after a restart, resume at the last good step.

        Completing a loop body is the progress signal (watchdog) and the snapshot point.

        Given a tracked ``DataLoader`` (or any iterable) instead of a count, yield its batches, each
        one step; the step count runs on across epochs (``ctx.step``), and after a restart the
        epoch resumes after the batches already consumed::

            for epoch in ctx.epochs(10):
                sampler.set_epoch(epoch)
                for batch in ctx.steps(loader):
                    ...
        """
        if not isinstance(total, bool) and hasattr(total, "__iter__") and not hasattr(total, "__index__"):
            return self._rt.steps_over(total)
        if isinstance(total, bool) or not hasattr(total, "__index__"):
            raise TypeError(
                "ctx.steps(total): total must be an int or an iterable of batches, "
                f"got {type(total).__name__} {total!r}"
            )
        count = operator.index(total)  # type: ignore[arg-type]  # (checked above: it has __index__)
        if count < 0:
            raise ValueError(f"total steps must be >= 0, got {count}")
        return self._rt.steps(count)

    def begin_step(self) -> int:
        """For a loop that is not yours (a trainer's: Lightning, the Hugging Face Trainer), called
        where each optimizer step begins, with :meth:`end_step` where it ends: the two halves of
        one pass of ``ctx.steps``. Returns the step's index, counted on from the restored step;
        the first call of an entry restores what a previous process left (as ``ctx.steps``
        does), so track every object before it. ``resilient.integrations`` calls both for you."""
        return self._rt.begin_step()

    def end_step(self) -> None:
        """The step :meth:`begin_step` began is complete: the progress signal for the hang
        watchdog, the checks, and the snapshot where the schedule keeps one."""
        self._rt.end_step()

    def epochs(self, total: int) -> Iterator[int]:
        """Yield epoch numbers up to ``total``; after a restart, resume at the restored step's epoch
        (its batches already consumed are skipped by ``ctx.steps(loader)``)."""
        if isinstance(total, bool) or not hasattr(total, "__index__") or operator.index(total) < 0:
            raise ValueError(f"ctx.epochs(total): total must be an int >= 0, got {total!r}")
        return self._rt.epochs(operator.index(total))
