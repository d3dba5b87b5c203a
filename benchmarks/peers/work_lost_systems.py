"""The systems benchmarks/work_lost_peers.py runs side by side, one small object each: how to start
a job of it, whether a SIGKILL may be sent yet, and when it first acted on a fault (that module's
docstring says what each system is and how it is set up)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.suite import _lines, _standby_waiting
from resilient.events import Event

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
PEERS = ROOT / "benchmarks" / "peers"
CKPT_EVERY = 10
DETECTED = {Event.FAULT_DETECTED.value, Event.WORKER_DIED.value, Event.HEARTBEAT_MISSED.value}


@dataclass(frozen=True)
class Setup:
    """One job's plan: the same for every system."""

    nproc: int
    fault: str
    fault_step: int
    after: int
    step_ms: float
    timeout: float  # every system's stand-in for hang detection (see work_lost_peers.py)
    wait: float  # how long after the fault a job may take to have every rank back

    @property
    def victim(self) -> int:
        return self.nproc - 1

    @property
    def steps(self) -> int:
        # far beyond f+m: a job is stopped once measured, and a torchft survivor that ran ahead
        # must still be there for the relaunched group to heal from
        return self.fault_step + self.after + 400

    @property
    def plan(self) -> str:
        return "" if self.fault == "sigkill" else f"{self.fault}@{self.fault_step}:{self.victim}"

    def work(self, progress: Path) -> list[str]:
        out = ["--steps", str(self.steps), "--step-ms", str(self.step_ms), "--progress", str(progress)]
        return [*out, "--fault", self.plan] if self.plan else out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(cmd: list[str], d: Path, env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A process in the job's directory (how cleanup finds what it forks) and its own session."""
    return subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class Observed:
    """What a trial saw: its directory, the progress lines, the fault's time, and the start time of
    every process that wrote a line (read while it lived: a relaunch's time)."""

    d: Path
    lines: list[dict[str, Any]]
    fault_ts: float
    started: dict[int, float]


# ---- the systems ------------------------------------------------------------------------------------
class System(Protocol):
    name: str

    def available(self) -> str | None:
        """None if it can run here, else why not."""

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]: ...

    def ready(self, d: Path) -> bool:
        """Whether a SIGKILL may be sent now (what the system keeps ready for one is)."""

    def detected(self, o: Observed) -> float | None:
        """When the system first acted on the fault (work_lost_peers.py says what that is)."""


def _launcher(s: Setup) -> list[str]:
    return [
        "--standalone",
        "--nproc-per-node",
        str(s.nproc),
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
    ]


def _first_relaunch(o: Observed) -> float | None:
    """The start of the first process that stepped after the fault and not before it."""
    old = {x["pid"] for x in o.lines if "step" in x and x["t"] <= o.fault_ts}
    return min(
        (o.started[x["pid"]] for x in o.lines if x["pid"] not in old and x["pid"] in o.started), default=None
    )


def _first(o: Observed, event: str) -> float | None:
    return min((x["t"] for x in o.lines if x.get("event") == event and x["t"] >= o.fault_ts), default=None)


class Resilient:
    name = "resilient"

    def available(self) -> str | None:
        return None

    def ready(self, d: Path) -> bool:
        # a long run's standby is warm when a rank dies; a short benchmark's can still be starting
        # on loaded cores (as replace.py, the kill waits for it, at a later step if need be)
        return _standby_waiting(d) != "none"

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]:
        t = str(s.timeout)
        cmd = [sys.executable, "-m", "resilient.cli", "launch", *_launcher(s), "--standby", "1",
               "--heartbeat-timeout", t, "--backoff-initial", "0", EXAMPLE, *s.work(d / "progress.jsonl"),
               "--pad-at", "forward", "--hang-timeout", t]  # fmt: skip
        return [_spawn(cmd, d, env, log)]

    def detected(self, o: Observed) -> float | None:
        evs = [e for f in o.d.glob("resilient_runs/*/events.jsonl") for e in _lines(f)]
        return min(
            (e["ts"] for e in evs if e.get("event") in DETECTED and e["ts"] >= o.fault_ts), default=None
        )


class Torchrun:
    name = "torchrun"

    def ready(self, d: Path) -> bool:
        return True

    def available(self) -> str | None:
        return None

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]:
        cmd = [sys.executable, "-m", "torch.distributed.run", *_launcher(s),
               EXAMPLE, *s.work(d / "progress.jsonl"), "--pad-at", "forward", "--plain",
               "--ckpt-dir", str(d / "ckpt"), "--ckpt-every", str(CKPT_EVERY), "--plain-ckpt", "dcp-async",
               "--collective-timeout", str(s.timeout)]  # fmt: skip
        return [_spawn(cmd, d, env, log)]

    def detected(self, o: Observed) -> float | None:
        return _first_relaunch(o)


def _nvrx_missing(module: str) -> str | None:
    """None if NVRx's ``module`` imports here, else why not."""
    try:
        importlib.import_module(module)
    except Exception as e:  # (an import error, or NVRx's own checks failing at import)
        return f"nvidia-resiliency-ext does not import ({type(e).__name__}: {e})"
    return None


class FtLauncher:
    name = "ft_launcher"

    def ready(self, d: Path) -> bool:
        return True

    def available(self) -> str | None:
        return _nvrx_missing("nvidia_resiliency_ext.fault_tolerance")

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]:
        # its defaults but the rank heartbeat timeout (every system's hang timeout) and the NIC
        # monitor (no NICs or GPUs here)
        launcher = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", *_launcher(s)]
        knobs = ["--ft-rank-heartbeat-timeout", str(s.timeout), "--ft-enable-nic-monitor", "false"]
        worker = [str(PEERS / "ft_launcher_tiny_worker.py"), *s.work(d / "progress.jsonl")]
        ckpt = ["--ckpt-dir", str(d / "ckpt"), "--ckpt-every", str(CKPT_EVERY), "--timeout", str(s.timeout)]
        cmd = [*launcher, *knobs, *worker, *ckpt]
        return [_spawn(cmd, d, env, log)]

    def detected(self, o: Observed) -> float | None:
        return _first_relaunch(o)


class Nvrx:
    name = "nvrx"

    def ready(self, d: Path) -> bool:
        return True

    def available(self) -> str | None:
        return _nvrx_missing("nvidia_resiliency_ext.inprocess")

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]:
        ports = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "NVRX_STORE_PORT": str(_free_port()),
        }
        cmd = [sys.executable, str(PEERS / "nvrx_tiny_worker.py"), *s.work(d / "progress.jsonl"),
               "--timeout", str(s.timeout)]  # fmt: skip
        return [
            _spawn(
                cmd,
                d,
                {**env, **ports, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(s.nproc)},
                log,
            )
            for r in range(s.nproc)
        ]

    def detected(self, o: Observed) -> float | None:
        return _first(o, "abort")


class Torchft:
    name = "torchft"

    def ready(self, d: Path) -> bool:
        return True

    @staticmethod
    def _lighthouse() -> str | None:
        here = Path(sys.executable).with_name("torchft_lighthouse")
        return str(here) if here.exists() else shutil.which("torchft_lighthouse")

    def available(self) -> str | None:
        try:
            import torchft  # noqa: F401
        except ImportError as e:
            return f"torchft is not installed ({e})"
        return None if self._lighthouse() else "torchft_lighthouse is not beside this Python nor on PATH"

    def start(self, s: Setup, d: Path, env: dict[str, str], log: Any) -> list[subprocess.Popen[bytes]]:
        port = _free_port()
        env = {**env, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
        house = [str(self._lighthouse()), "--min_replicas", "1", "--quorum_tick_ms", "100",
                 "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"]  # fmt: skip
        with open(d / "lighthouse.log", "w") as own:  # (its own file: detected() reads its quorum changes)
            procs = [_spawn(house, d, env, own)]
        for group in range(s.nproc):  # (one rank per replica group: see work_lost_peers.py)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                   "--max-restarts", "3", "--monitor-interval", "0.1", "--master-port", str(_free_port()),
                   str(PEERS / "torchft_tiny_worker.py"), *s.work(d / "progress.jsonl"),
                   "--timeout", str(s.timeout)]  # fmt: skip
            procs.append(_spawn(cmd, d, {**env, "REPLICA_GROUP_ID": str(group)}, log))
        return procs

    def detected(self, o: Observed) -> float | None:
        # a survivor's step that did not commit, or the Lighthouse's first quorum without a group
        changed = []
        for line in (o.d / "lighthouse.log").read_text(errors="replace").splitlines():
            if "Detected quorum change" in line:  # (its time stamps are local time, to the millisecond)
                with contextlib.suppress(ValueError):
                    changed.append(datetime.datetime.fromisoformat(line.split()[0]).timestamp())
        seen = [t for t in (_first(o, "uncommitted"), *changed) if t is not None and t >= o.fault_ts]
        return min(seen, default=None)


SYSTEMS: dict[str, System] = {s.name: s for s in (Resilient(), Torchrun(), FtLauncher(), Nvrx(), Torchft())}
