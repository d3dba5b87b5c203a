"""One chaos job: ``resilient launch`` of the bundled example (or the user's script) in a directory,
with the environment that makes the runtime fire planned faults, log every step and write its final
state; and what it leaves behind (event logs, the injections record).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chaos.hooks import Var, enable
from chaos.netns import ENV as NETNS_ENV
from chaos.netns import VethLink
from chaos.schedule import BadInput, Certification
from resilient.events import Event, read_events, read_run_events

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny.py"


def workdir(cert: Certification, cwd: Path) -> Path:
    """Where the job's command runs: ``job.workdir``, else the trial's directory ``cwd``."""
    return Path(cert.job.workdir).resolve() if cert.job.workdir else cwd.resolve()


def checkpoints(cert: Certification, cwd: Path) -> Path:
    """The directory the job's command checkpoints to (``job.checkpoint_dir`` where it runs)."""
    return workdir(cert, cwd) / cert.job.checkpoint_dir


@contextlib.contextmanager
def own_checkpoints(cert: Certification, cwd: Path) -> Iterator[None]:
    """A job that runs outside its trial's directory checkpoints into the user's: it must find
    that directory empty (a trial would resume from what is there), and what it writes there is
    removed when the trial is over, nothing else."""
    if cert.job.workdir is None:
        yield
        return
    ck = checkpoints(cert, cwd)
    if ck.exists() and any(ck.iterdir()):
        raise BadInput(
            f"{ck} (job.checkpoint_dir where the command runs) is not empty: a trial would resume "
            "from what is there. Move it away, or give the script another checkpoint directory"
        )
    existed = ck.exists()
    try:
        yield
    finally:
        if existed:
            for entry in ck.iterdir():
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(ck, ignore_errors=True)


def _a_file(arg: str) -> bool:
    return not os.path.isabs(arg) and not arg.startswith("-") and Path(arg).is_file()


def fresh(cwd: Path) -> Path:
    """An empty directory for one job: a previous certificate's files there (its checkpoints, its
    injection record) would be resumed from, and its faults counted as already fired."""
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    return cwd


class Job:
    """``resilient launch`` of the example in ``cwd``, one agent or several as nodes of one job
    (``job.nodes``, and a ``job.spare`` started once they run); killed by process group when done.
    ``p`` is the first agent's process (it hosts the rendezvous and the workers' store)."""

    def __init__(
        self,
        cert: Certification,
        cwd: Path,
        plan: str = "",
        attempt: str | None = "0",
        link: VethLink | None = None,
    ) -> None:
        cwd = cwd.resolve()  # the job runs inside it: paths handed to it must not be relative to it
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.spare: subprocess.Popen[bytes] | None = None  # the spare node's agent, once started
        self.lost: set[int] = set()  # agents a fault took down with their node (their exit is not the job's)
        j = cert.job
        rdzv = _Rendezvous(f"chaos{os.getpid()}x{time.monotonic_ns()}", j.nodes) if j.nodes > 1 else None
        argv = _launch_argv(cert, cwd, _command(cert, cwd), link, rdzv)
        env = _environment(cwd, plan, attempt, link)
        self.log = open(cwd / "launch.log", "a")  # noqa: SIM115 - closed in stop()
        self._start = lambda: subprocess.Popen(
            argv,
            cwd=workdir(cert, cwd),
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.p = self._start()
        self.agents = [self.p]
        if rdzv is not None:
            rdzv.wait_store(self.p)
            self.agents += [self._start() for _ in range(j.nodes - 1)]
            if j.spare:
                threading.Thread(target=self._start_spare, args=(j.nodes,), daemon=True).start()

    def _start_spare(self, nodes: int) -> None:
        """The spare node's agent, once every node's workers started (it then parks beside them)."""
        while self.p.poll() is None:
            started = {e["pid"] for e in events(self.cwd) if e["event"] == Event.WORKERS_STARTED}
            if len(started) >= nodes:
                self.spare = self._start()
                self.agents.append(self.spare)
                return
            time.sleep(0.1)  # (polls the event log the agents append to)

    def spare_ready(self) -> bool:
        """The spare node's agent parked and one of its standbys waits, ready."""
        if self.spare is None:
            return False
        said = {e["event"] for e in events(self.cwd) if e["pid"] == self.spare.pid}
        return Event.SPARE_PARKED in said and Event.STANDBY_READY in said

    def stop(self, timeout: float) -> int | None:
        """Every agent's end (the first failure's exit code; None: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        try:
            rcs = []
            for agent in list(self.agents):
                rc = agent.wait(max(0.0, deadline - time.monotonic()))
                if agent.pid not in self.lost:
                    rcs.append(rc)
            return next((rc for rc in rcs if rc != 0), 0)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()
            self.log.close()

    def kill(self) -> None:
        for agent in list(self.agents):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for e in events(self.cwd):  # workers run in sessions of their own
            if e["event"] == Event.RUN_STARTED and e["rank"] >= 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(e["pid"]), signal.SIGKILL)
        for agent in self.agents:
            for leftover in Path("/dev/shm").glob(f"resilient-*-{agent.pid}"):
                shutil.rmtree(leftover, ignore_errors=True)


class _Rendezvous:
    """A c10d rendezvous on 127.0.0.1 for a job of several agents."""

    def __init__(self, rdzv_id: str, nodes: int) -> None:
        from chaos.harness import free_port

        self.rdzv_id, self.port = rdzv_id, free_port()
        # (a spare parks outside the round: with nodes:nodes+1 a group restart after a loss would
        # wait the rendezvous' last call, 30 s, for a node more)
        self.nnodes = str(nodes)

    def argv(self) -> list[str]:
        endpoint = f"127.0.0.1:{self.port}"
        keep_alive = "keep_alive_interval=1,keep_alive_max_attempt=3"  # (a lost node: 3 s)
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", self.rdzv_id]
        return [*rdzv, "--nnodes", self.nnodes, "--rdzv-conf", keep_alive]

    def wait_store(self, first: subprocess.Popen[bytes]) -> None:
        """The first agent hosts the rendezvous' store: the others must find it, not host one."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)  # (the port opens when the agent's store listens)


def _command(cert: Certification, cwd: Path) -> list[str]:
    """The script and its arguments: the job's command, or the bundled example with the job's
    settings (and its ``runtime`` section as a config file); its files named so that they are
    found from where it runs."""
    j = cert.job
    command = j.command or [
        str(EXAMPLE),
        "--steps",
        str(j.steps),
        "--step-ms",
        str(j.step_ms),
        "--pad-at",
        j.pad_at,
        "--hang-timeout",
        str(j.hang_timeout),
        "--ckpt-dir",
        j.checkpoint_dir,
        "--ckpt-every",
        str(j.checkpoint_every),
        "--backend",
        j.backend,
    ]
    if j.runtime and not j.command:
        import yaml

        (cwd / "runtime.yaml").write_text(yaml.safe_dump(j.runtime))
        command += ["--config", str(cwd / "runtime.yaml")]
    if command[0] in ("python", "python3", sys.executable):  # `resilient launch` runs python itself
        command = command[1:]
    runs_in = workdir(cert, cwd)
    if j.command and not os.path.isabs(command[0]) and (runs_in / command[0]).exists():
        command = [str((runs_in / command[0]).resolve()), *command[1:]]
    elif j.command and j.workdir is None:
        # a config's command runs in the trial's directory: its files (the script, a --config)
        # named from where chaos runs are handed over whole
        command = [str(Path(a).resolve()) if _a_file(a) else a for a in command]
    return command


def _launch_argv(
    cert: Certification, cwd: Path, command: list[str], link: VethLink | None, rdzv: _Rendezvous | None
) -> list[str]:
    """``resilient launch`` of ``command`` with the job's launcher settings, its event logs in
    ``cwd``, every rank started through ``chaos.netns`` where a link is cut; one node of
    ``rdzv``'s where the job spans several."""
    j = cert.job
    return [
        sys.executable,
        "-m",
        "resilient.cli",
        "launch",
        *(rdzv.argv() if rdzv is not None else ["--standalone"]),
        "--nproc-per-node",
        str(j.nproc // j.nodes),
        "--max-restarts",
        str(j.max_restarts),
        "--max-replacements",
        str(j.max_replacements),
        "--monitor-interval",
        "0.1",
        "--heartbeat-timeout",
        str(j.heartbeat_timeout),
        "--startup-timeout",
        "60",
        "--backoff-initial",
        "0",
        "--events-dir",
        str(cwd / "resilient_runs"),
        *(["-m", "chaos.netns"] if link else []),
        *command,
    ]


def _environment(cwd: Path, plan: str, attempt: str | None, link: VethLink | None) -> dict[str, str]:
    """The job's environment: this one, plus what makes the harness's hook fire the plan."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # the harness's step hook (chaos/hooks.py, loaded through RESILIENT_HOOKS) fires the fault
    # inside the step (any wrapped script, unchanged), logs every step and dumps the final
    # state the certificate compares
    env[Var.INJECTIONS] = str(cwd / "injections.jsonl")
    env[Var.STEP_EVENTS] = "1"
    env[Var.FINAL_STATE] = str(cwd / "state")
    env[Var.DIGESTS] = str(cwd / "digests")
    if plan:  # attempt None: every launch fires the plan's faults it reaches
        env[Var.PLAN] = plan
        if attempt is not None:
            env[Var.PLAN_ATTEMPT] = attempt
    enable(env)
    env.pop("RESILIENT_RUN_ID", None)
    if link is not None:  # every rank starts through chaos.netns; the target one enters the netns
        env[NETNS_ENV] = link.env()
    return env


jsonl = read_events  # injections.jsonl is JSON lines too


def events(cwd: Path) -> list[dict[str, Any]]:
    """Every event of the job run in ``cwd`` (its agent's and every worker's), in time order."""
    return read_run_events(cwd / "resilient_runs")


def record_injection(cwd: Path, kind: str, rank: int, step: int, **extra: Any) -> float:
    ts = time.time()
    with open(cwd / "injections.jsonl", "a") as f:
        rec = {"ts": ts, "kind": kind, "rank": rank, "step": step, "by": "harness", **extra}
        f.write(json.dumps(rec) + "\n")
    return ts
