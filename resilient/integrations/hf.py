"""The Hugging Face ``Trainer`` and Accelerate, made resilient (``pip install "resilient[hf]"``).

**Trainer**: one line, the decorator on the function that builds the ``Trainer`` and calls
``trainer.train()``::

    from resilient.integrations import hf

    @hf.wrap()  # resilient.wrap, and every trainer.train() inside is resilient
    def main():
        args = TrainingArguments(output_dir="out", max_steps=1000, seed=0, ...)
        trainer = Trainer(model=build_model(), args=args, train_dataset=dataset)
        trainer.train()

A soft fault leaves ``trainer.train()`` with the exception; the runtime rebuilds the group and runs
``main`` again, and its new ``train()`` restores the model, optimizer, scheduler, gradient scaler,
the ``TrainerState`` (global step, epoch, log history), the stateful callbacks, the position inside
the epoch and every RNG, then continues with the next optimizer step
(:mod:`resilient.integrations._hf_trainer` says how). ``attach(trainer)`` does the same for one
trainer inside a function you decorated with ``resilient.wrap`` yourself.

**Accelerate**: ``ctx.track(**hf.trackable(model=model, optimizer=optimizer, loader=loader,
scheduler=scheduler, accelerator=accelerator))`` with what ``accelerator.prepare`` returned
(:mod:`resilient.integrations._hf_accelerate` says what each becomes).

``transformers`` and ``accelerate`` are imported by these functions, not by ``import resilient``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from resilient.integrations._hf_accelerate import NotTrackable, trackable_one
from resilient.integrations._hf_trainer import TrainerLoop, UnsupportedTrainer
from resilient.runtime.context import Context

__all__ = ["NotTrackable", "UnsupportedTrainer", "attach", "trackable", "wrap"]

_LOOP = "_resilient_loop"  # on a trainer whose train() runs resiliently now


def _run(trainer: Any, call: Callable[[], Any], ctx: Context | None) -> Any:
    if getattr(trainer, _LOOP, None) is not None:  # (a subclass's train() calling Trainer.train)
        return call()
    if ctx is None:
        import resilient

        try:
            ctx = resilient.current()
        except Exception as e:
            raise UnsupportedTrainer(
                "trainer.train() ran outside a resilient function: decorate the function that calls it "
                "with resilient.integrations.hf.wrap (or resilient.wrap)"
            ) from e
    loop = TrainerLoop(ctx, trainer)
    setattr(trainer, _LOOP, loop)
    try:
        return loop.run(call)
    finally:
        setattr(trainer, _LOOP, None)


def attach(trainer: Any, ctx: Context | None = None) -> Any:
    """Make ``trainer.train()`` resilient; call it inside a function wrapped by ``resilient.wrap``
    (``ctx``: its context, else ``resilient.current()``). Returns ``trainer``."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise UnsupportedTrainer(f"attach() takes a transformers.Trainer, not a {type(trainer).__name__}")
    train = type(trainer).train

    @functools.wraps(train)
    def resilient_train(*args: Any, **kwargs: Any) -> Any:
        return _run(trainer, lambda: train(trainer, *args, **kwargs), ctx)

    trainer.train = resilient_train  # type: ignore[method-assign]
    return trainer


@contextlib.contextmanager
def _every_trainer() -> Iterator[None]:
    """While the function runs, ``Trainer.train`` is the resilient one (subclasses' included)."""
    from transformers import Trainer

    original = Trainer.__dict__["train"]

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _run(self, lambda: original(self, *args, **kwargs), None)

    Trainer.train = train  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.train = original  # type: ignore[method-assign]


def wrap(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``resilient.wrap`` (the same ``config``, ``hooks``, ``prepare``... options) for a function
    that trains with a Hugging Face ``Trainer``: each ``trainer.train()`` it runs is resilient."""
    import resilient

    def decorate(f: Callable[..., Any]) -> Any:
        @functools.wraps(f)  # (its signature too: a ``ctx`` parameter still receives the Context)
        def entry(*args: Any, **kwargs: Any) -> Any:
            with _every_trainer():
                return f(*args, **kwargs)

        return resilient.wrap(**options)(entry)

    return decorate(fn) if fn is not None else decorate


def trackable(**objects: Any) -> dict[str, Any]:
    """What to pass to ``ctx.track`` for objects returned by ``accelerator.prepare`` (and the
    ``Accelerator``): ``ctx.track(**hf.trackable(model=model, optimizer=opt, loader=dl, ...))``.
    A prepared loader is made resumable in place: iterate the same object. An object that cannot
    be restored exactly raises :class:`NotTrackable`, naming it."""
    return {name: trackable_one(name, obj) for name, obj in objects.items()}
