"""How a run ends its process: a resilient error's documented exit code, and the user's own
exception — raised before the first step, so that there is nothing to restore — as itself."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from loguru import logger

from resilient.errors import ExitCode


def raised_as_itself(exc: BaseException, rank: int) -> BaseException:
    """The user's exception raised before this rank's first step, to be raised as itself (its own
    type and traceback) once every rank knows: nothing to restore, not retried. The process then
    ends with ``FATAL``, the exit code of an error a relaunch repeats."""
    note = (
        f"resilient: rank {rank} raised this before its first step; there is no state to "
        f"restore and a retry would repeat it (exit code {int(ExitCode.FATAL)}, not relaunched)"
    )
    if hasattr(exc, "add_note"):  # Python >= 3.11: printed with the traceback
        exc.add_note(note)
    else:  # 3.10 prints no notes: the log line says it instead
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]
        logger.error(note)
    exc._resilient_exit_code = ExitCode.FATAL  # type: ignore[attr-defined]
    return exc


def excepthook_exit_codes() -> None:
    """Make an uncaught resilient error end the process with its documented exit code."""
    previous = sys.excepthook
    if getattr(previous, "_resilient", False):
        return

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if previous is sys.__excepthook__:
            # the C hook printed nothing here for exceptions raised out of the restart loop (seen on
            # CPython 3.11); the traceback module always prints the chain
            traceback.print_exception(tp, value, tb, file=sys.stderr)
        else:
            previous(tp, value, tb)
        code = getattr(value, "exit_code", None) or getattr(value, "_resilient_exit_code", None)
        if code is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))

    hook._resilient = True  # type: ignore[attr-defined]
    sys.excepthook = hook
