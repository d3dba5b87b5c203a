"""A warm standby's own side: a process that waits to be a rank, as far into the user's script
as it allows (the agent's side, which starts and promotes it, is ``resilient.launcher.standby``).

A standby **parks** (the default): it runs the user's entry point itself, as ``python -u
script.py args`` would (``__main__``, ``sys.argv``, ``sys.path[0]``) — the interpreter, every
import, the argument parsing, the module's top level — and waits inside the ``resilient.wrap``
call, before the user's function runs (:func:`park_until_promoted`). Promoted, it takes the dead
rank's environment and output files there and the function runs as that rank's would, joining its
survivors. The script's top level ran without a rank: a top level that reads one (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, the store's address: any variable torch gives a worker) or raises
before ``wrap`` cannot be trusted as any rank's, so the standby starts afresh (exec, same pid)
as an **importing** standby and says why (``standby-<pid>.fallback``, the agent's
``standby_fallback`` event). An importing standby has imported torch and the runtime only and
runs the whole script once promoted.

It lives in the runtime because ``resilient.wrap`` (and the integrations) call it: the runtime
never imports the launcher. A standby dies with its launcher (PDEATHSIG) and exits when its stdin
closes without an order.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, ClassVar

from resilient.contract import STANDBY_ENTRY

PARK = "RESILIENT_STANDBY_PARK"  # set in a parking standby's script: the fd its order comes on
PARK_READY = "RESILIENT_STANDBY_READY"  # ... and its ready file (a fallback is reported next to it)

# what a training script imports anyway: paid while the standby waits, not after a fault
WARM = (
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.optim",
    "torch.utils.data",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "resilient",
    "resilient.runtime.engine.builtin",
)


def _redirect(path: str | None, fd: int) -> None:
    if path:
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


# ---- in the standby process -------------------------------------------------------------------------
class _Watched(os._Environ):
    """``os.environ`` of a parking standby's script: reads of a hidden (rank) variable are noted,
    with where they came from, unless the runtime's own code read it."""

    hidden: ClassVar[frozenset[str]] = frozenset()
    seen: ClassVar[list[str]] = []

    def _note(self, key: Any) -> None:
        if key not in self.hidden:
            return
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in _MAPPING_MODULES:
            frame = frame.f_back  # type: ignore[assignment]
        if frame is None or os.path.realpath(frame.f_code.co_filename).startswith(_PACKAGE):
            return  # (the runtime reads its own variables after the promotion)
        self.seen.append(f"{key} read at {frame.f_code.co_filename}:{frame.f_lineno}")

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return super().__contains__(key)


_MAPPING_MODULES = ("os", "_collections_abc", "collections.abc")  # (os.getenv, Mapping.get: not the reader)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
_parked: dict[str, Any] = {}  # the parking standby's order fd and ready file, until promoted


def parking() -> bool:
    """Whether this process is a standby that runs the script and has not been promoted yet."""
    return bool(_parked) and PARK in os.environ


def park_until_promoted() -> None:
    """Called by ``resilient.wrap`` before the function runs: in a parking standby, wait here for
    the order (the dead rank's environment and output files), then return as that rank. Anywhere
    else, return at once. A top level that read a rank's variable cannot be trusted as this rank's:
    the standby starts afresh as an importing one (this call does not return then)."""
    fd = os.environ.get(PARK)
    if fd is None:
        return
    if not _parked:
        # a parking standby's entry point replaced its process (exec: a wrapper such as nsenter
        # re-running the script) and lost the order pipe: this process is no rank and never will be
        Path(os.environ[PARK_READY]).with_suffix(".fallback").write_text(
            "the entry point replaced its process (exec) before resilient.wrap: a standby cannot wait in it"
        )
        os._exit(0)
    if _Watched.seen:
        _fall_back(f"the script's top level read {'; '.join(dict.fromkeys(_Watched.seen))}")
    ready: Path = _parked["ready"]
    ready.write_text("parked")
    with os.fdopen(int(fd), "rb") as pipe:
        line = pipe.readline()
    ready.unlink(missing_ok=True)
    if not line:  # the agent closed the pipe without an order: not needed
        os._exit(0)
    order = json.loads(line)
    own = _parked.pop("own")
    _parked.clear()
    os.environ.__class__ = os._Environ  # (the script's own environment from here on)
    for path, std, mine in ((order["stdout"], 1, own[0]), (order["stderr"], 2, own[1])):
        if path:
            _redirect(path, std)
        else:
            os.dup2(mine, std)
        os.close(mine)
    os.environ.clear()
    os.environ.update(order["env"])


def _fall_back(why: str) -> None:
    """Start afresh as an importing standby (same pid, the order pipe back on stdin): the agent
    reads ``why`` next to the ready file."""
    ready: Path = _parked["ready"]
    ready.with_suffix(".fallback").write_text(why)
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os.dup2(_parked["own"][0], 1)
    os.dup2(_parked["own"][1], 2)
    os.dup2(int(os.environ[PARK]), 0)
    os.environ.__class__ = os._Environ
    os.environ.pop(PARK, None)
    os.environ.pop(PARK_READY, None)
    os.execv(sys.executable, [*STANDBY_ENTRY, str(ready.parent)])


def _run(module: bool, name: str, args: list[str]) -> None:
    """The entry point, as ``python -u`` would run it."""
    if module:
        sys.argv = [name, *args]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [name, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(name))
        runpy.run_path(name, run_name="__main__")


def main() -> None:
    from resilient.contract import die_with_launcher
    from resilient.launch_env import Var

    launcher = os.environ.get(Var.LAUNCHER_PID.value)
    die_with_launcher(int(launcher) if launcher else None)
    import importlib

    for name in WARM:
        try:
            importlib.import_module(name)
        except Exception:  # a module this torch lacks: nothing to warm
            continue
    from resilient.runtime.engine.warmup import first_use_imports

    first_use_imports()
    ready = Path(sys.argv[1]) / f"standby-{os.getpid()}.ready"
    if len(sys.argv) > 3 and sys.argv[2] == "--park":
        _park(ready, json.loads(sys.argv[3]))
        return
    ready.write_text("imported")
    line = sys.stdin.buffer.readline()
    ready.unlink(missing_ok=True)
    if not line:  # the agent closed our stdin without an order: not needed
        return
    order = json.loads(line)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the script gets the stdin a torchrun worker gets, not the order pipe
    os.close(null)
    _redirect(order["stdout"], 1)
    _redirect(order["stderr"], 2)
    os.environ.clear()
    os.environ.update(order["env"])
    _run(order["module"], order["name"], order["args"])


def _park(ready: Path, spec: dict[str, Any]) -> None:
    """Run the entry point up to its ``resilient.wrap`` call and wait there (see the module
    docstring); what it prints before its promotion goes to ``standby-<pid>.log``."""
    order_fd = os.dup(0)
    os.set_inheritable(order_fd, False)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    own = (os.dup(1), os.dup(2))  # where a promoted rank's output goes unless its order says
    for fd in own:
        os.set_inheritable(fd, False)
    log = os.open(ready.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for key in spec["hide"]:
        os.environ.pop(key, None)
    os.environ[PARK] = str(order_fd)
    os.environ[PARK_READY] = str(ready)
    _Watched.hidden = frozenset(spec["hide"])
    _Watched.seen = []
    os.environ.__class__ = _Watched
    _parked.update(ready=ready, own=own)
    try:
        _run(spec["module"], spec["name"], spec["args"])
    except BaseException as e:
        if not _parked:  # promoted: the rank's own failure (SystemExit too), as under torchrun
            raise
        _fall_back(f"the script's top level raised {type(e).__name__}: {e}"[:500])
    if _parked:
        _fall_back("the script ended without calling resilient.wrap")
