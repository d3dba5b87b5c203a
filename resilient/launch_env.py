"""The launch contract: every environment variable a launcher hands a worker, named once, read once.

``torchrun`` sets the ``env://`` variables (rank, world, store address, restart count);
``resilient launch`` adds its own (heartbeat files, the shared-memory snapshot, the launch round,
the preemption signals); Slurm's say which job, step and node a process runs in. The runtime
reads them through :meth:`LaunchEnv.from_environ` at start-up and nowhere else (the launcher reads
Slurm's through :meth:`SlurmPlace.from_environ`); the launcher writes its own through
:class:`Var`, so a name cannot drift between the two sides.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from resilient.errors import CoordinationError


class Var(str, enum.Enum):
    """Names of the contract's variables (``str`` values: usable as ``os.environ[Var.X]``)."""

    # torchrun's env:// rendezvous
    RANK = "RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
    RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
    ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
    # resilient launch
    RUN_ID = "RESILIENT_RUN_ID"
    LAUNCH_ROUND = "RESILIENT_LAUNCH_ROUND"
    SHM_NAME = "RESILIENT_SHM_NAME"
    HEARTBEAT_DIR = "RESILIENT_HEARTBEAT_DIR"
    HEARTBEAT_INTERVAL = "RESILIENT_HEARTBEAT_INTERVAL"
    LAUNCHER_PID = "RESILIENT_LAUNCHER_PID"
    PREEMPT_SIGNALS = "RESILIENT_PREEMPT_SIGNALS"
    JOIN_GENERATION = "RESILIENT_JOIN_GENERATION"  # a replacement: the generation its survivors left
    PREDECESSOR_PID = "RESILIENT_PREDECESSOR_PID"  # a replacement: the dead worker's pid (maybe exiting)
    METRICS_BY_AGENT = "RESILIENT_METRICS_BY_AGENT"  # the agent serves the metrics: the workers do not
    # step hooks to load besides entry points: "module:factory,..." (resilient/runtime/hooks.py)
    HOOKS = "RESILIENT_HOOKS"
    # "1": torch's store sockets keep their reverse DNS lookup (resilient/native/names.py)
    STORE_NAME_LOOKUPS = "RESILIENT_STORE_NAME_LOOKUPS"
    # `resilient launch --events-dir`: the workers' event logs go there too (not events.dir)
    EVENTS_DIR = "RESILIENT_EVENTS_DIR"
    # Slurm (srun's tasks and what they start): where a fault happened, for the operator
    SLURM_JOB_ID = "SLURM_JOB_ID"
    SLURM_STEP_ID = "SLURM_STEP_ID"
    SLURMD_NODENAME = "SLURMD_NODENAME"
    SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"  # how often the job was requeued (unset: never)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Endpoint:
    """Where the job's store is, and who this process is in the job."""

    host: str
    port: int
    rank: int
    world_size: int
    local_rank: int
    hosts_store: bool
    local_world_size: int = 1  # ranks on this node (torchrun numbers them contiguously)


@dataclass(frozen=True)
class SlurmPlace:
    """The Slurm job, step and node a process runs in: every event it writes names them."""

    job: str
    step: str | None  # None in the batch script itself (no srun step)
    node: str | None
    requeues: int = 0  # this run of the job follows that many requeues

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmPlace | None:
        """None outside Slurm (no ``SLURM_JOB_ID``)."""
        env = os.environ if environ is None else environ
        job = env.get(Var.SLURM_JOB_ID.value)
        if not job:
            return None
        requeues = env.get(Var.SLURM_RESTART_COUNT.value) or "0"
        return cls(
            job=job,
            step=env.get(Var.SLURM_STEP_ID.value) or None,
            node=env.get(Var.SLURMD_NODENAME.value) or None,
            requeues=int(requeues) if requeues.isdigit() else 0,
        )

    def fields(self) -> dict[str, object]:
        """The event log's static field ``slurm``: one key, so records outside Slurm stay as they were."""
        return {"slurm": {"job": self.job, "step": self.step, "node": self.node, "requeues": self.requeues}}


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this worker. A plain ``python train.py`` is a world of one."""

    endpoint: Endpoint
    run_id: str | None  # agreed over the store when neither launcher names one
    attempt: str  # the launch attempt: every rank of one attempt has the same value
    restart_count: int  # torchrun's relaunch counter on this node
    shm_name: str | None  # `resilient launch`: the snapshot mirror it keeps across relaunches
    heartbeat_dir: Path | None  # `resilient launch`: where the agent reads this worker's beats
    heartbeat_interval: float
    launcher_pid: int | None  # `resilient launch`: this worker dies with it
    preempt_signals: tuple[str, ...] | None  # None: the checkpoint config's own list
    join_generation: int | None = None  # a replacement for a dead rank: joins its survivors' recovery
    predecessor_pid: int | None = None  # ... and the pid of the worker it replaces, perhaps still exiting
    hooks: tuple[str, ...] = ()  # step-hook factories ("module:factory") this process loads
    store_name_lookups: bool = False  # torch's store sockets ask the resolver for their peers' names
    events_dir: Path | None = None  # `resilient launch --events-dir`: overrides the config's events.dir
    slurm: SlurmPlace | None = None  # under Slurm: the job, step and node (named in every event)

    @property
    def under_launcher(self) -> bool:
        """Started by ``resilient launch`` (which keeps a snapshot mirror and watches heartbeats)."""
        return self.shm_name is not None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ

        def get(var: Var) -> str | None:
            v = env.get(var.value)
            return v if v not in (None, "") else None

        try:
            rank = int(get(Var.RANK) or 0)
            world = int(get(Var.WORLD_SIZE) or 1)
            local_rank = int(get(Var.LOCAL_RANK) or rank)
            local_world = int(get(Var.LOCAL_WORLD_SIZE) or 1)
            restart_count = int(get(Var.RESTART_COUNT) or 0)
            interval = float(get(Var.HEARTBEAT_INTERVAL) or 1.0)
            launcher = get(Var.LAUNCHER_PID)
            launcher_pid = int(launcher) if launcher else None
            join = get(Var.JOIN_GENERATION)
            join_generation = int(join) if join else None
            pred = get(Var.PREDECESSOR_PID)
            predecessor_pid = int(pred) if pred else None
        except ValueError as e:
            raise CoordinationError(f"malformed launch environment: {e}") from e
        ep = _endpoint(get, rank, world, local_rank, local_world)
        run_id = get(Var.RUN_ID) or get(Var.ELASTIC_RUN_ID)
        signals = get(Var.PREEMPT_SIGNALS)
        hb_dir = get(Var.HEARTBEAT_DIR)
        return cls(
            endpoint=ep,
            run_id=run_id if run_id != "none" else None,
            # `resilient launch` passes its rendezvous round, the same on every node; torchrun's
            # restart count can differ between nodes after a peer-triggered restart
            attempt=get(Var.LAUNCH_ROUND) or str(restart_count),
            restart_count=restart_count,
            shm_name=get(Var.SHM_NAME),
            heartbeat_dir=Path(hb_dir) if hb_dir else None,
            heartbeat_interval=interval,
            launcher_pid=launcher_pid,
            preempt_signals=tuple(s for s in signals.split(",") if s) if signals else None,
            join_generation=join_generation,
            predecessor_pid=predecessor_pid,
            hooks=tuple(h.strip() for h in (get(Var.HOOKS) or "").split(",") if h.strip()),
            store_name_lookups=get(Var.STORE_NAME_LOOKUPS) == "1",
            events_dir=Path(events) if (events := get(Var.EVENTS_DIR)) else None,
            slurm=SlurmPlace.from_environ(env),
        )


def _endpoint(
    get: Callable[[Var], str | None], rank: int, world: int, local_rank: int, local_world: int
) -> Endpoint:
    """This worker's place in the job and the store's address, from the parsed numbers and the
    rendezvous variables (``get``: a variable's value, None where unset or empty)."""
    if not 0 <= rank < world:
        raise CoordinationError(f"{Var.RANK}={rank} is outside {Var.WORLD_SIZE}={world}")
    if not (0 <= local_rank <= rank and local_rank < local_world <= world):
        local_world = 1  # not torchrun's numbering: no node is assumed
    host, port = get(Var.MASTER_ADDR), get(Var.MASTER_PORT)
    if host is None or port is None:
        if world > 1:
            raise CoordinationError(
                f"{Var.WORLD_SIZE}={world} but {Var.MASTER_ADDR}/{Var.MASTER_PORT} are not set; "
                "launch with torchrun or `resilient launch`"
            )
        return Endpoint("127.0.0.1", 0, 0, 1, 0, True)
    agent_store = (get(Var.USE_AGENT_STORE) or "").lower() == "true"
    hosts = rank == 0 and not agent_store
    return Endpoint(host, int(port), rank, world, local_rank, hosts_store=hosts, local_world_size=local_world)


def local_address(towards: tuple[str, int]) -> str:
    """This host's address on the route to ``towards``: what a process there can reach (a spare
    node's agent, a buddy rank on another node)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(towards)
        return str(s.getsockname()[0])
    return "127.0.0.1"
