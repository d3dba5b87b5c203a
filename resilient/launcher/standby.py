"""Warm standby workers, the agent's side: processes that wait to be a rank, started and promoted.

``resilient launch --standby N`` keeps N of them per node. When a worker dies, its agent promotes
one: it writes the dead rank's environment, command and output files to the standby's stdin.
What the standby itself does (park in the script's ``resilient.wrap``, or import only; fall back;
take the order) is the runtime's: :mod:`resilient.runtime.standby`.

Only a Python entry point can be promoted: ``python [-u] script.py ...`` or ``python [-u] -m mod``
(torchrun's and our launcher's form unless ``--no-python``). :func:`target` says which.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resilient.contract import STANDBY_ENTRY

# what torch gives a worker that says who it is and where the job is: hidden from a parking
# standby's script (its top level must not depend on them)
RANK_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RESILIENT_JOIN_GENERATION",
        "RESILIENT_LAUNCH_ROUND",
    }
)


@dataclass(frozen=True)
class Target:
    module: bool  # ``-m name`` rather than a script path
    name: str
    args: tuple[str, ...]


def target(entrypoint: str, args: tuple[str, ...] | list[str]) -> Target | None:
    """What a standby would run for a worker started as ``entrypoint *args``; None when it cannot
    (not a Python interpreter, or interpreter options other than ``-u``)."""
    if "python" not in os.path.basename(entrypoint):
        return None
    rest = [str(a) for a in args]
    if rest and rest[0] == "-u":
        rest = rest[1:]
    if rest and rest[0] == "-m":
        return Target(True, rest[1], tuple(rest[2:])) if len(rest) > 1 else None
    if not rest or rest[0].startswith("-"):
        return None
    return Target(False, rest[0], tuple(rest[1:]))


class Standby:
    """The agent's handle on one standby process (shaped like torch's ``SubprocessHandler`` once
    promoted: ``proc``, ``local_rank_id``, ``close``). ``park``: the entry point it runs and parks
    in (None: an importing standby); ``hide``: the worker variables its script's top level must
    not see (a rank's: ``RANK``, the store, ...)."""

    def __init__(
        self, env: dict[str, str], ready_dir: Path, park: Target | None = None, hide: tuple[str, ...] = ()
    ) -> None:
        self.local_rank_id = -1
        self.announced = False
        self.fallback_seen = False
        self.target = park
        argv = [*STANDBY_ENTRY, str(ready_dir)]
        if park is not None:
            argv += ["--park", json.dumps({**asdict(park), "hide": list(hide)})]
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            start_new_session=True,  # as torch starts its workers: a group the agent can signal
        )
        self._ready_path = ready_dir / f"standby-{self.proc.pid}.ready"
        self._fallback_path = ready_dir / f"standby-{self.proc.pid}.fallback"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """It waits for an order: parked in the script's ``wrap``, or its imports done (it said
        so in a file named after its pid)."""
        return self._ready_path.exists()

    def warmth(self) -> str:
        """``parked`` (in the script's ``resilient.wrap``) or ``imported`` (torch and the runtime)."""
        with contextlib.suppress(OSError):
            return self._ready_path.read_text().strip() or "imported"
        return "imported"

    def fallback(self) -> str | None:
        """Why this standby could not park in the script (it then imports only), if it could not."""
        with contextlib.suppress(OSError):
            return self._fallback_path.read_text().strip()
        return None

    def takes(self, tgt: Target) -> bool:
        """Whether it can become a worker started as ``tgt``: an importing standby runs any script;
        a parked one only the script (and arguments) it parked in."""
        return self.target is None or self.target == tgt or self.fallback() is not None

    def promote(
        self, local_rank: int, env: dict[str, str], tgt: Target, stdout: str | None, stderr: str | None
    ) -> None:
        order = {
            "env": env,
            "module": tgt.module,
            "name": tgt.name,
            "args": list(tgt.args),
            "stdout": stdout,
            "stderr": stderr,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(order) + "\n").encode())
        self.proc.stdin.close()
        self.local_rank_id = local_rank

    def close(self, death_sig: Any = None) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self._ready_path.unlink(missing_ok=True)
        self._fallback_path.unlink(missing_ok=True)
