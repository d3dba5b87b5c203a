"""``resilient.wrap``: the decorator that turns a training function into a restartable one."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, overload

from resilient.config import Config, load_config
from resilient.health import Check
from resilient.launch_env import Var
from resilient.runtime import hooks as hooks_mod
from resilient.runtime.context import Context
from resilient.runtime.engine.builtin import BuiltinEngine, freeze_gc
from resilient.runtime.faults.exits import excepthook_exit_codes
from resilient.runtime.hooks import StepHook
from resilient.runtime.run.wiring import Setup, numeric_names
from resilient.runtime.standby import park_until_promoted, parking
from resilient.runtime.steps.loop import StepLoop

F = TypeVar("F", bound=Callable[..., Any])


class Engine(Protocol):
    """What an engine is to the decorator: configured with a :class:`Setup`, it runs the
    function once per generation, handing it the step loop (``ctx``'s runtime side)."""

    name: str

    def run(self, fn: Callable[[StepLoop], Any]) -> Any: ...


def _config(config: str | os.PathLike[str] | Config | None, overrides: dict[str, Any]) -> Config:
    """The decorator's configuration, validated; an engine whose extra is missing is refused."""
    cfg = config if isinstance(config, Config) else load_config(config, **overrides)
    if isinstance(config, Config) and overrides:
        cfg = load_config(None, **{**config.model_dump(), **overrides})
    if cfg.engine == "nvrx":
        from resilient.runtime.engine.nvrx import nvrx_inprocess

        nvrx_inprocess()
    return cfg


def engine_for(setup: Setup) -> Engine:
    """The engine ``engine:`` names (``resilient``: the built-in one; ``nvrx``: NVRx's Wrapper)."""
    if setup.cfg.engine == "nvrx":
        from resilient.runtime.engine.nvrx import NvrxEngine

        return NvrxEngine(setup)
    return BuiltinEngine(setup)


_current: Context | None = None


def current() -> Context:
    """The context of the running wrapped function (for code that was not handed ``ctx``)."""
    if _current is None:
        from resilient.errors import ResilienceError

        raise ResilienceError("no resilient-wrapped function is running in this process")
    return _current


def _wait_as_standby(cfg: Config, prepare: Callable[[], Any] | None) -> list[Any]:
    """Where this process is a parked standby of ``resilient launch``: the set-up it can pay while
    it waits, then the wait until it is promoted to a rank (else nothing). ``prepare``'s result
    where it ran here, for the first entry (a list: empty where it did not)."""
    standby = parking()
    if standby:  # (what the engine's wiring does first, done while waiting)
        numeric_names(cfg, os.environ.get(Var.STORE_NAME_LOOKUPS) == "1")
    if standby and cfg.freeze_gc and cfg.engine == "resilient":
        freeze_gc()  # (the engine's own freeze, paid while waiting rather than once promoted)
    ahead = [prepare()] if prepare is not None and standby else []  # (a standby's, built early)
    park_until_promoted()  # (a standby of `resilient launch` waits here to be a rank)
    return ahead


@overload
def wrap(fn: F) -> F: ...


@overload
def wrap(
    fn: None = None,
    *,
    config: str | os.PathLike[str] | Config | None = None,
    checks: Sequence[Check] = (),
    hooks: Sequence[StepHook] = (),
    prepare: Callable[[], Any] | None = None,
    **overrides: Any,
) -> Callable[[F], F]: ...


def wrap(
    fn: Callable[..., Any] | None = None,
    *,
    config: str | os.PathLike[str] | Config | None = None,
    checks: Sequence[Check] = (),
    hooks: Sequence[StepHook] = (),
    prepare: Callable[[], Any] | None = None,
    **overrides: Any,
) -> Any:
    """Make ``fn`` survive soft faults in-process.

    Use as ``@resilient.wrap`` or ``@resilient.wrap(config="resilient.yaml", hang_timeout=30)`` (a YAML file
    of your own, read from the working directory; ``configs/default.yaml`` is the commented template).
    The configuration is validated here, at decoration time. If ``fn`` has a parameter named ``ctx``,
    the :class:`Context` is passed to it; otherwise ``resilient.current()`` returns it. The runtime
    creates the default process group (on a fresh store generation) before each entry of ``fn``.
    ``hooks``: :class:`~resilient.runtime.hooks.StepHook` objects called at every step, besides the
    ones installed packages register (entry-point group ``resilient.hooks``).
    ``prepare``: rank-independent set-up (build a model on the CPU, load a tokenizer), its result
    read as ``ctx.prepared``; a parked standby of ``resilient launch`` runs it before it waits, so
    a replacement finds it done. It must not read a rank or touch the process group.
    """
    cfg = _config(config, overrides)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        wants_ctx = "ctx" in inspect.signature(f).parameters

        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            global _current
            ahead = _wait_as_standby(cfg, prepare)
            excepthook_exit_codes()
            active = [*hooks, *hooks_mod.discover()]
            rt = engine_for(Setup.of(cfg, checks, hooks=active))

            def entry(loop: StepLoop) -> Any:
                global _current
                built: list[Any] = []

                def prepared() -> Any:  # once per entry: the standby's for its first, else built now
                    if not built:
                        assert prepare is not None
                        built.append(ahead.pop() if ahead else prepare())
                    return built[0]

                ctx = Context(loop, prepared if prepare is not None else None)  # (either engine)
                _current = ctx
                return f(*args, ctx=ctx, **kwargs) if wants_ctx else f(*args, **kwargs)

            try:
                return rt.run(entry)
            finally:
                _current = None

        run.resilient_config = cfg  # type: ignore[attr-defined]
        return run

    return decorate(fn) if fn is not None else decorate
