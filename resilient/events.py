"""Typed recovery events → one JSONL file per run (every rank appends) and loguru.

The event log is the single source of truth for timings: detection and recovery figures in
benchmarks and certificates are computed from these records, not from an injector's clock.
Each record is written with a single ``os.write`` on an ``O_APPEND`` descriptor, so lines from
different ranks never interleave. A failing sink never kills training.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from loguru import logger


class Event(str, enum.Enum):
    """Phases of a run and of one recovery, in the order they happen."""

    RUN_STARTED = "run_started"
    FAULT_DETECTED = "fault_detected"
    GROUP_ABORTED = "group_aborted"
    HEALTH_CHECKED = "health_checked"
    # the ranks agreed on the step to restore and it was materialized: what the agreement's parts took
    RESTORE_AGREED = "restore_agreed"
    GROUP_REBUILT = "group_rebuilt"
    STATE_RESTORED = "state_restored"
    STEP_RESUMED = "step_resumed"
    RUN_FINISHED = "run_finished"
    RUN_FAILED = "run_failed"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_REJECTED = "checkpoint_rejected"  # a committed checkpoint did not verify at load
    CHECKPOINT_SLOW = "checkpoint_slow"  # a save came due while the previous one was still being written
    RUN_PREEMPTED = "run_preempted"
    WORKER_DIED = "worker_died"  # the launcher's agent: a worker exited or was killed (with the cause)
    HEARTBEAT_MISSED = "heartbeat_missed"
    GROUP_STOPPED = "group_stopped"
    RELAUNCHED = "relaunched"
    RANK_REPLACED = "rank_replaced"  # the agent: one dead worker replaced, its survivors kept
    STANDBY_READY = "standby_ready"  # the agent: a warm standby waits (warmth: parked | imported)
    STANDBY_FALLBACK = "standby_fallback"  # the agent: a standby could not park in the script, and why
    NODE_LOST = "node_lost"
    NODE_REPLACED = "node_replaced"  # a member's agent: a lost node's seat was taken by a spare node
    SEAT_TAKEN = "seat_taken"  # a spare node's agent: it started a lost node's ranks (their survivors kept)
    SPARE_PARKED = "spare_parked"  # a spare node's agent: it waits, warm, to take a lost node's seat
    NODE_FENCED = "node_fenced"  # a member's agent: its seat was taken (it was thought lost): it stops
    SPARE_WAITING = "spare_waiting"  # the agent: nodes wait in the rendezvous to take a lost node's place
    NODE_EXCLUDED = "node_excluded"
    # the agent: a dead worker's shared-memory snapshots written to checkpoint.dir (flush_on_death)
    SNAPSHOT_FLUSHED = "snapshot_flushed"
    STEP_COMPLETED = "step_completed"  # only with events.steps: true (one line per rank per step)
    PROGRESS = "progress"  # a process's first completed step, then one every events.progress_s
    WORKERS_STARTED = "workers_started"  # the agent started (or restarted) its workers
    CHECKPOINT_DURABLE = "checkpoint_durable"  # a rank's part of a checkpoint is written (its write time)
    FAULT_REPORT = "fault_report"  # what the rank that faulted (or the agent) saw: stacks, traceback
    NODE_LINK = "node_link"  # at start: this rank reaches the job's store through its node's, or why not
    NODE_LINK_LOST = "node_link_lost"  # the node's store (local rank 0's) is gone: the job's store alone
    SPIKE_ACCEPTED = "spike_accepted"  # a spike came back at the same step on replay: the data's own, applied
    BATCH_SKIPPED = "batch_skipped"  # a step rejected twice (guard.on_*: skip_batch): its update not applied
    # a step check waited on a peer's collective count longer than timeouts.peer_report: for whom,
    # which key, and what holds it up (cause: store | peer); again with ended: true when it ended
    PEER_WAIT = "peer_wait"
    SDC_DETECTED = "sdc_detected"  # replicas differed: who was corrupt (detectors/replicas.py), or who may be
    STRAGGLER_DETECTED = "straggler_detected"  # rank: the one slower than its peers
    # a replay after a restore (runtime/steps/replay.py): its digests equal the run it replays up to
    # the faulted step; or the first step that differs, and what; or why nothing could be compared
    REPLAY_VERIFIED = "replay_verified"
    REPLAY_DIVERGED = "replay_diverged"
    REPLAY_UNCHECKED = "replay_unchecked"
    # state the function keeps that changes every step and is neither tracked nor carried, found in
    # its first steps (runtime/steps/untracked_watch.py): each value's name and the line that fixes it
    UNTRACKED_STATE = "untracked_state"


class EventLog:
    """Append-only JSONL event sink shared by the ranks of one run."""

    def __init__(self, path: Path | None, rank: int, **static: Any) -> None:
        self.path = path
        self.rank = rank
        # every record names its host (a fault report's "where"; a node's exporter keeps its own)
        self.static = {"host": socket.gethostname(), **static}
        self._fd: int | None = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:
                logger.warning("event log {} unavailable ({}); events go to the log only", path, e)

    def emit(
        self, event: Event, *, generation: int, step: int | None, log: bool = True, **fields: Any
    ) -> dict[str, Any]:
        record = {
            "ts": time.time(),
            "event": event.value,
            "rank": self.rank,
            "pid": os.getpid(),
            "generation": generation,
            "step": step,
            **self.static,
            **fields,
        }
        if self._fd is not None:
            try:
                os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
            except OSError as e:  # a full disk must not stop training
                logger.warning("event log write failed: {}", e)
        if not log:
            return record
        extras = " ".join(f"{k}={v}" for k, v in fields.items())
        logger.bind(rank=self.rank).info(
            "[rank {} gen {} step {}] {} {}", self.rank, generation, step, event.value, extras
        )
        return record

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read an events.jsonl file (or any JSON-lines record); a torn line (a killed writer, a line
    being written now) is skipped, a missing file is no records."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_run_events(runs_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every run's events under ``runs_dir`` (``<dir>/<run_id>/events.jsonl``), in time order."""
    out: list[dict[str, Any]] = []
    for f in Path(runs_dir).glob("*/events.jsonl"):
        out += read_events(f)
    return sorted(out, key=lambda e: e["ts"])


class LogTail:
    """One events.jsonl file, read incrementally: each :meth:`poll` returns the records appended
    since the last one (a line still being written waits for the next poll; a torn or foreign
    line is skipped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._pos = 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._pos += end
        out = []
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out


class EventTail:
    """The event logs under ``runs_dir``, read incrementally: each :meth:`poll` returns the records
    appended since the last one (a long run's log grows to ~10^5 lines; re-reading all of it on
    every poll would make a watcher late)."""

    def __init__(self, runs_dir: str | os.PathLike[str]) -> None:
        self.runs_dir = Path(runs_dir)
        self._tails: dict[Path, LogTail] = {}

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for f in self.runs_dir.glob("*/events.jsonl"):
            new += self._tails.setdefault(f, LogTail(f)).poll()
        return new
