"""Warm standby workers: processes that have imported torch and the runtime and wait to be a rank.

``resilient launch --standby N`` keeps N of them per node. When a worker dies, its agent promotes
one: it writes the dead rank's environment, command and output files to the standby's stdin, and
the standby runs the user's script as ``python -u script.py args`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), so the script's top level runs fresh, as under torchrun, minus the interpreter's
start and the imports already done. A standby dies with its launcher (PDEATHSIG) and exits when its
stdin closes without an order.

Only a Python entry point can be promoted: ``python [-u] script.py ...`` or ``python [-u] -m mod``
(torchrun's and our launcher's form unless ``--no-python``). :func:`target` says which.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "resilient.runtime.native",
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
    promoted: ``proc``, ``local_rank_id``, ``close``)."""

    def __init__(self, env: dict[str, str], ready_dir: Path) -> None:
        self.local_rank_id = -1
        self.announced = False
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "resilient.launcher.standby", str(ready_dir)],
            env=env,
            stdin=subprocess.PIPE,
            start_new_session=True,  # as torch starts its workers: a group the agent can signal
        )
        self._ready_path = ready_dir / f"standby-{self.proc.pid}.ready"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Its imports are done (it said so in a file named after its pid)."""
        return self._ready_path.exists()

    def promote(
        self, local_rank: int, env: dict[str, str], tgt: Target, stdout: str | None, stderr: str | None
    ) -> None:
        order = {"env": env, "module": tgt.module, "name": tgt.name, "args": list(tgt.args),
                 "stdout": stdout, "stderr": stderr}  # fmt: skip
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


def _redirect(path: str | None, fd: int) -> None:
    if path:
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _warm_up() -> None:
    """What torch imports lazily the first time a script builds a model and steps an optimizer
    (torch._dynamo and sympy among them: most of a fresh worker's first second). The RNG comes
    back as a fresh interpreter has it: the script's top level must run as it would under torchrun."""
    import torch

    rng = torch.get_rng_state()
    try:
        m = torch.nn.Sequential(torch.nn.Embedding(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        for opt in (torch.optim.AdamW(m.parameters()), torch.optim.SGD(m.parameters(), lr=0.1)):
            m(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception:  # warming is an optimisation; the promoted script runs either way
        pass
    finally:
        torch.set_rng_state(rng)


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
    _warm_up()
    ready = Path(sys.argv[1]) / f"standby-{os.getpid()}.ready"
    ready.touch()
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
    if order["module"]:
        sys.argv = [order["name"], *order["args"]]
        runpy.run_module(order["name"], run_name="__main__", alter_sys=True)
    else:
        script = order["name"]
        sys.argv = [script, *order["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
