"""Fixed points a process reaches outside a run's recovery (a checkpoint's commit), told to the
hooks of the run in this process (``Hook.on_phase``, resilient/runtime/hooks.py). The code that
reaches one (the checkpoint writer) knows nothing of runs or hooks; a run listens while it lasts.
What a listener raises is raised at the point, as if that code had raised it."""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[str, "int | None"], None]
_listeners: list[Listener] = []


def listen(fn: Listener) -> Callable[[], None]:
    """Tell ``fn`` of every point reached in this process (any thread); returns its removal."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn) if fn in _listeners else None


def reached(point: str, step: int | None) -> None:
    for fn in list(_listeners):
        fn(point, step)
