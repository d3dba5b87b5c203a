"""One validated configuration model, loaded from YAML plus keyword overrides.

The user sets at most two timing knobs (``hang_timeout`` and, optionally, ``collective_timeout``);
every other timeout that must be ordered with them is derived in :class:`Timeouts`, so the ordering
cannot be broken by hand.
"""

from __future__ import annotations

import copy
import os
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from resilient.detectors import REGISTRY as DETECTORS
from resilient.errors import ConfigError
from resilient.sections import Section, interval_or_auto

# the built-in health checks, by name (resilient/health.py defines a function of each name)
BUILTIN_CHECKS = ("gpu", "host_memory", "checkpoint_dir", "store")


def renamed(data: Any, section: str, old: str, new: str, why: str) -> Any:
    """A section's raw ``data`` with the key ``old`` read as ``new`` (its new name), with a
    DeprecationWarning that says ``why``; both given is an error naming them."""
    if not isinstance(data, dict) or old not in data:
        return data
    data = dict(data)
    value = data.pop(old)
    if new in data:
        raise ValueError(f"{old} is the old name of {new}: give one of them")
    data[new] = value
    warnings.warn(f"{section}.{old} is now {section}.{new} ({why})", DeprecationWarning, stacklevel=3)
    return data


class RestartConfig(Section):
    """Bounds on in-process recoveries (the launcher's budgets are its own flags:
    ``resilient launch --max-replacements``, ``--max-restarts``)."""

    max_recoveries: int = Field(
        10, ge=0, description="in-process recoveries allowed within `window_s` (then exit 3)"
    )
    window_s: float = Field(3600.0, gt=0, description="sliding window for `max_recoveries`, seconds")
    max_repeats: int = Field(3, ge=1, description="same fault at the same step this many times → stop")
    backoff_initial_s: float = Field(0.1, ge=0, description="delay before the 2nd quick restart")
    backoff_max_s: float = Field(10.0, ge=0, description="cap of the exponential backoff")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """``max_restarts`` (the old name, which the launcher's ``--max-restarts`` shares) is
        read as ``max_recoveries``, with a warning."""
        why = "resilient launch's --max-restarts counts restarts of the whole group"
        return renamed(data, "restart", "max_restarts", "max_recoveries", why)

    @model_validator(mode="after")
    def _ordered(self) -> RestartConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self


class SnapshotConfig(Section):
    """In-memory snapshot of the last good step.

    ``interval: auto`` snapshots at a few sample steps while the run calibrates, then rank 0 measures
    the cost against the step time and picks the smallest interval whose cost stays under
    ``max_overhead`` (every rank adopts rank 0's choice, so all ranks hold the same steps).
    """

    interval: int | Literal["auto"] = Field("auto", description="every N completed steps, or auto")
    max_overhead: float = Field(
        0.002, gt=0, le=1, description="auto: snapshot time / step time budget (ring and shm mirror together)"
    )
    store_copy_max_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="under `resilient launch`: each rank posts its objects up to this many tensor bytes "
        "(RNG, data position, scheduler) to the job's store with every snapshot, so that a lost "
        "node's per-rank state survives it; 0 turns the copy off",
    )
    buddy: bool = Field(
        True,
        description="under `resilient launch` with more than one node: each rank also sends every "
        "snapshot it mirrors to a rank on the next node, in a background thread, unless that rank "
        "holds an equal copy already (a data-parallel replica), so that a lost node's sharded state "
        "comes back from memory (docs/recovery.md#buddy-copies); needs the store copy",
    )

    live: bool = Field(
        True,
        description="a soft fault resumes at the step it hit, from the live model and optimizer, when "
        "every rank vouches that the step changed neither (docs/recovery.md#live-resume); else the ring",
    )
    live_max_bytes: int = Field(
        1 << 20,
        ge=0,
        description="live resume copies the small tracked objects (scheduler, data position, scaler) at "
        "each step's start; one holding more tensor bytes than this makes a fault fall back to the ring",
    )

    _positive = field_validator("interval")(classmethod(lambda cls, v: interval_or_auto(v)))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        why = "a replica is a data-parallel rank's copy of the state; this is the job's store's copy"
        return renamed(data, "snapshot", "replica_max_bytes", "store_copy_max_bytes", why)


class HealthConfig(Section):
    """Health checks run between fault detection and the rebuild of the group."""

    checks: tuple[str, ...] = Field(
        BUILTIN_CHECKS,
        description="subset of gpu, host_memory, checkpoint_dir, store; add yours: `wrap(checks=[fn])`",
    )
    min_host_memory_mb: float = Field(256.0, ge=0, description="host_memory: the least available memory")
    checkpoint_dir: Path | None = Field(
        None,
        description="checkpoint_dir: the directory whose free space is checked; null: checkpoint.dir "
        "(skipped when neither is set)",
    )
    min_free_disk_mb: float = Field(1024.0, ge=0, description="checkpoint_dir: the least free space")

    @field_validator("checks")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [c for c in v if c not in BUILTIN_CHECKS]
        if unknown:
            raise ValueError(f"unknown check(s) {unknown}; built-ins are {list(BUILTIN_CHECKS)}")
        return v


class CheckpointConfig(Section):
    """Durable checkpoints (off while ``dir`` is unset).

    ``interval: auto`` sets the interval from the measured write time and the observed fault rate
    (Young: √(2·write·MTBF)); until a fault is seen, ``mtbf_s`` is the prior for the MTBF.
    """

    dir: Path | None = Field(None, description="fast local directory, visible to every rank; None = off")
    interval: int | Literal["auto"] = Field(100, description="checkpoint every N completed steps, or auto")
    keep: int = Field(3, ge=1, description="committed checkpoints kept (the newest is never deleted)")
    incremental: bool = Field(True, description="do not rewrite tensors unchanged since the last checkpoint")
    on_busy: Literal["wait", "skip"] = Field("wait", description="a save is due while one is in flight")
    writer: Literal["thread", "process"] = Field(
        "thread", description="who persists: a thread, or a child process (no GIL hand-offs)"
    )
    pipelined: bool = Field(
        False, description="copy during the next forward/backward; only the optimizers' step waits for it"
    )
    persistent_url: str | None = Field(None, description="fsspec URL the committed checkpoints upload to")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for persistent_url (e.g. endpoint_url)"
    )
    commit_timeout_s: float = Field(600.0, gt=0, description="rank 0 waits this long for every shard")
    resume: bool = Field(True, description="start from the newest valid checkpoint in `dir`")
    preempt_signals: tuple[str, ...] = Field(
        ("SIGUSR1", "SIGTERM"), description="final checkpoint, then exit with the requeue code (76)"
    )
    mtbf_s: float = Field(86400.0, gt=0, description="auto: MTBF prior until faults are observed")
    flush_on_death: bool = Field(
        False,
        description="under `resilient launch`: a dead worker's newest shared-memory snapshots are "
        "written to `<dir>/flushed` by its agent (every rank's when the agent gives up), so that a "
        "later loss of the node, or a requeue of the job, resumes there instead of at the last checkpoint",
    )

    @model_validator(mode="after")
    def _flush_needs_dir(self) -> CheckpointConfig:
        if self.flush_on_death and self.dir is None:
            raise ValueError("flush_on_death needs checkpoint.dir (where the snapshots are written)")
        return self

    @field_validator("interval")
    @classmethod
    def _interval(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @field_validator("preempt_signals")
    @classmethod
    def _signals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not name.startswith("SIG") or not isinstance(getattr(signal, name, None), int):
                raise ValueError(f"not a usable signal name: {name!r} (e.g. SIGUSR1)")
        return v


class EventsConfig(Section):
    """Where the per-run JSONL event log goes."""

    dir: Path = Field(Path("resilient_runs"), description="event logs go to `<dir>/<run_id>/events.jsonl`")
    steps: bool = Field(False, description="a step_completed event per step (certificates, timelines)")
    progress_s: float = Field(
        10.0, gt=0, description="a progress event per rank this often (step, step time, runtime cost)"
    )


class MetricsConfig(Section):
    """The Prometheus endpoint of a run under plain torchrun (``resilient launch --metrics-port``
    serves it from the agent instead)."""

    port: int | None = Field(
        None, ge=0, le=65535, description="local rank 0 serves the run's metrics on this port; null: off"
    )
    addr: str = Field("0.0.0.0", description="the address the endpoint binds to")
    refresh_s: float = Field(
        5.0, gt=0, description="the figures are recomputed from the event log this often"
    )


class Config(Section):
    """Runtime configuration. Defaults live here; ``configs/default.yaml`` mirrors them."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="`gloo`, `nccl`, or `auto` (nccl when CUDA is available)"
    )
    engine: Literal["resilient", "nvrx"] = Field(
        "resilient",
        description="who detects faults and restarts: this runtime, or NVRx's in-process Wrapper "
        "(its monitor process, timeouts and restart barriers; our state restore and events)",
    )
    hang_timeout: float = Field(60.0, gt=0, description="seconds without step progress → hang")
    collective_timeout: float | None = Field(
        None, gt=0, description="per-collective timeout; default 2 × hang_timeout (the watchdog fires first)"
    )
    interrupt_signal: str = Field(
        "SIGUSR2", description="the signal that interrupts the main thread when a step must be left"
    )
    freeze_gc: bool = Field(
        True,
        description="gc.freeze() the objects alive at start so the full collection that frees a failed "
        "generation (its model, optimizer state, group) takes milliseconds instead of ~80 ms",
    )
    store_name_lookups: bool = Field(
        False,
        description="torch's store sockets ask the resolver for each peer's name (a reverse DNS lookup per "
        "connection, on the store server's event loop); false: numeric names (docs/control-plane.md), "
        "as RESILIENT_STORE_NAME_LOOKUPS=1 turns them back on for the launcher too",
    )
    node_aggregation: Literal["auto", "on", "off"] = Field(
        "auto",
        description="a node's ranks reach the job's store through a store of their node (control-plane.md);"
        " auto: when the job spans more than one node",
    )
    verify_replay: Literal["warn", "stop", "off"] = Field(
        "warn",
        description="after a restore, compare each replayed step's digests with the run it replays "
        "(docs/recovery.md#replay-verification): warn names the first step and objects that differ, "
        "stop also ends the run (exit 3), off takes no digests",
    )
    restart: RestartConfig = Field(default_factory=RestartConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # each detector's section (guard, sdc, collective_check, straggler), modelled in its own file
    # (resilient/detectors): the registry lists them, so adding a detector adds its section here
    for _key, (_type, _field) in DETECTORS.fields().items():
        __annotations__[_key] = _type
        locals()[_key] = _field
    del _key, _type, _field

    @field_validator("interrupt_signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        if not isinstance(getattr(signal, v, None), signal.Signals) or v in (
            "SIGKILL",
            "SIGSTOP",
            "SIGALRM",
            "SIGINT",
        ):
            raise ValueError(f"not a usable signal name: {v!r} (e.g. SIGUSR2)")
        return v

    @model_validator(mode="after")
    def _distinct_signals(self) -> Config:
        if self.interrupt_signal in self.checkpoint.preempt_signals:
            raise ValueError(
                f"checkpoint.preempt_signals contains {self.interrupt_signal}, the runtime's interrupt_signal"
            )
        return self

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts.derive(self.hang_timeout, self.collective_timeout)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: where, and what."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


@dataclass(frozen=True)
class Timeouts:
    """Every timeout the runtime uses, derived from one or two knobs so they stay ordered.

    hang < hard (GIL-holding backstop) < barrier; startup applies to the first step of a generation.
    """

    hang: float
    collective: float
    startup: float
    hard: float
    barrier: float
    monitor_interval: float
    victim_grace: float
    # a step check waiting on a peer longer than this says what it waits for (peer_wait)
    peer_report: float = 1.0

    @classmethod
    def derive(cls, hang: float, collective: float | None) -> Timeouts:
        collective = collective if collective is not None else 2.0 * hang
        grace = max(2.0, 0.5 * hang)
        startup = 5.0 * hang
        hard = hang + grace
        barrier = max(collective, startup + grace) + 10.0
        return cls(
            hang=hang,
            collective=collective,
            startup=startup,
            hard=hard,
            barrier=barrier,
            monitor_interval=min(0.05, hang / 40.0),
            victim_grace=min(1.0, 0.25 * hang),
            peer_report=min(1.0, 0.25 * hang),
        )

    def progress_limit(self, stepped: bool) -> float:
        """How long a rank may go without completing a step: ``startup`` until its generation's
        first step completed (``stepped``), ``hang`` after."""
        return self.hang if stepped else self.startup


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _lookup(data: Any, loc: tuple[Any, ...]) -> tuple[bool, Any]:
    value = data
    for p in loc:
        in_dict = isinstance(value, dict) and p in value
        in_list = isinstance(value, list | tuple) and isinstance(p, int) and p < len(value)
        if not (in_dict or in_list):
            return False, "<missing>"
        value = value[p]
    return True, value


def _describe(err: ValidationError, data: dict[str, Any], file: str | None, overrides: dict[str, Any]) -> str:
    """One line per error: where the value came from (the file or a keyword override), the
    dotted field name, the value and what is wrong with it."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        _, value = _lookup(data, e["loc"])
        overridden, _ = _lookup(overrides, e["loc"])
        source = "keyword override" if overridden or file is None else file
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown field {loc!r} (value {value!r})")
        else:
            lines.append(f"{source}: {loc} = {value!r}: {e['msg']}")
    return "invalid resilient config\n  " + "\n  ".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Load ``path`` (YAML) if given, apply keyword overrides (nested dicts merge), validate.

    Raises :class:`ConfigError` naming the field, the value and where it came from.
    """
    data: dict[str, Any] = {}
    file = None
    if path is not None:
        p = Path(path)
        file = str(p)
        if not p.is_file():
            raise ConfigError(
                f"config file not found: {p} (looked for {p.absolute()}; a relative path is read from "
                "the working directory; leave config out for the built-in defaults)"
            )
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {yaml_problem(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = _deep_merge(data, overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, data, file, overrides)) from e
