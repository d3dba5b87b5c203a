"""The collaborators a run gets from outside: connections, the identity agreed with the peers,
sinks, a clock. :func:`wire` builds the real ones from the launch contract; a test builds fakes
(an in-memory store, a group builder that builds no group, a temporary event log)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from resilient.config import Config
from resilient.contract import Heartbeat
from resilient.detectors import REGISTRY as DETECTORS
from resilient.detectors import DetectorRegistry
from resilient.events import EventLog
from resilient.health import Check
from resilient.launch_env import LaunchEnv
from resilient.native import names
from resilient.runtime.coordination import coordinator as coord_mod
from resilient.runtime.coordination.pg import Group, build_group, resolve_backend
from resilient.runtime.hooks import StepHook

GroupBuilder = Callable[[int, str], Group]  # (generation, namespace) -> that generation's group


@dataclass(frozen=True)
class Setup:
    """What an engine is configured with, before anything is connected: the validated config,
    the launch contract, the caller's hooks and health checks, the backend and device they imply,
    and the detectors the run builds (the registry's, unless a test hands it others)."""

    cfg: Config
    launch: LaunchEnv
    hooks: tuple[StepHook, ...] = ()
    checks: tuple[Check, ...] = ()
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    detectors: DetectorRegistry = DETECTORS

    @classmethod
    def of(
        cls,
        cfg: Config,
        checks: Sequence[Check] = (),
        *,
        launch: LaunchEnv | None = None,
        hooks: Sequence[StepHook] = (),
        detectors: DetectorRegistry = DETECTORS,
    ) -> Setup:
        launch = launch if launch is not None else LaunchEnv.from_environ()
        backend = resolve_backend(cfg.backend)
        local = launch.endpoint.local_rank
        device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        return cls(cfg, launch, tuple(hooks), tuple(checks), backend, device, detectors)

    @property
    def rank(self) -> int:
        return self.launch.endpoint.rank


@dataclass
class Wiring:
    """The collaborators of one run: connections, identity agreed with the peers, sinks."""

    store: dist.Store  # the main thread's connection to the job's store
    side_store: Callable[[float], dist.Store]  # another connection (a thread's own), given a timeout
    run_id: str
    events: EventLog
    build_group: GroupBuilder
    heartbeat: Heartbeat | None = None
    clock: Callable[[], float] = time.monotonic  # step progress; wall time stays time.time
    on_close: list[Callable[[], None]] = field(default_factory=list)


WiringFactory = Callable[[Setup], Wiring]


def numeric_names(cfg: Config, lookups: bool) -> None:
    """torch's store sockets without reverse DNS lookups (resilient/native/names.py), unless the
    config (``store_name_lookups``) or the launcher's ``RESILIENT_STORE_NAME_LOOKUPS=1`` (``lookups``)
    keeps them; once per process (a parked standby did it before it waited)."""
    if not (lookups or cfg.store_name_lookups):
        names.apply_or_warn()


def wire(setup: Setup) -> Wiring:
    """The real collaborators: the job's TCPStore (rank 0 hosts it without an agent store), the run
    id agreed over it, the run's event log, groups built with the backend, the launcher's heartbeat."""
    cfg, launch, backend, device = setup.cfg, setup.launch, setup.backend, setup.device
    ep, t = launch.endpoint, cfg.timeouts
    numeric_names(cfg, launch.store_name_lookups)  # (before any store connection of this process)
    store = coord_mod.connect(ep, t.barrier)
    run_id = launch.run_id or coord_mod.agree_run_id(store, {})
    port = store.port

    def group(generation: int, namespace: str) -> Group:
        return build_group(
            backend=backend,
            store=store,
            store_port=port,
            rank=ep.rank,
            world_size=ep.world_size,
            generation=generation,
            timeout=t.collective,
            device_id=device if backend == "nccl" else None,
            namespace=namespace,
        )

    return Wiring(
        store=store,
        side_store=lambda timeout: coord_mod.client(ep.host, port, timeout),
        run_id=run_id,
        events=EventLog(
            (launch.events_dir or cfg.events.dir) / run_id / "events.jsonl",
            ep.rank,
            attempt=launch.attempt,
            **(launch.slurm.fields() if launch.slurm is not None else {}),
        ),
        build_group=group,
        heartbeat=Heartbeat.for_worker(launch),
    )
