"""The stragglers' exchange and verdicts (the detector is :mod:`resilient.detectors.stragglers`):
each rank's mean work per step posted every ``straggler.check_s``, its node's ranks judged by the
node's first rank, a straggler reported or replaced. See that module's docstring."""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml
from loguru import logger

from resilient.detectors.stragglers import StragglerConfig, WorkMeter
from resilient.events import Event

_NEVER = "\x00never"  # compare_set(k, _NEVER, _NEVER): reads k without waiting for it (absent: _NEVER)


# ---- the rule -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    slowdown: float  # its mean work per step over the window / the median of its peers' means
    work_s: float
    median_s: float
    for_s: float  # the span of the checks judged


@dataclass
class StragglerRule:
    """A rank whose mean work per step over the last ``window_s`` is ``threshold`` × the median
    of its peers' means over the same checks (every other rank that posted) is a straggler, once
    its figures span ``window_s``; reported once until its mean is under the threshold again. One
    check's figure is noisy (a CPU quota throttles in 100 ms periods, and a second's throttling
    may fall in a collective's wait, which is not counted as work), so one fast check does not
    restart the window: the window's mean is what is judged. The clock comes in: tests never sleep."""

    clock: Callable[[], float] = time.monotonic
    seen: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)  # rank -> (t, work)
    since: dict[int, float] = field(default_factory=dict)  # rank -> its first figure (this episode)
    reported: set[int] = field(default_factory=set)

    def judge(
        self,
        figures: Mapping[int, tuple[float, str]],
        ranks: Collection[int],
        threshold: float,
        window_s: float,
    ) -> list[Straggler]:
        """``figures``: rank -> (work per step, host) of one check; ``ranks``: those judged here."""
        now, out = self.clock(), []
        for r, (work, _) in figures.items():
            self.since.setdefault(r, now)
            self.seen.setdefault(r, deque()).append((now, work))
        for r, seen in list(self.seen.items()):
            while seen and seen[0][0] < now - window_s:
                seen.popleft()
            if not seen:
                del self.seen[r]
        means = {r: statistics.fmean(w for _, w in seen) for r, seen in self.seen.items()}
        for r in ranks:
            if r not in figures:
                continue  # no figure this check (no step completed): neither cleared nor advanced
            peers = [m for q, m in means.items() if q != r and q in figures]
            median = statistics.median(peers) if peers else 0.0
            mean = means[r]
            if median <= 0 or mean < threshold * median:
                self.reported.discard(r)
                continue
            span = now - self.since[r]
            if span >= window_s and r not in self.reported:
                self.reported.add(r)
                out.append(Straggler(r, figures[r][1], mean / median, mean, median, min(span, window_s)))
        return out

    def forget(self, rank: int) -> None:
        """``rank`` was replaced: its successor is judged afresh."""
        self.since.pop(rank, None)
        self.seen.pop(rank, None)
        self.reported.discard(rank)


# ---- live settings ----------------------------------------------------------------------------------
class LiveSettings:
    """``threshold``, ``window_s`` and ``action`` from the config, overridden by the YAML file
    ``path`` while it exists (re-read when its modification time changes; an invalid file is
    named in a warning and the previous settings stay)."""

    def __init__(self, cfg: StragglerConfig, path: Path | None) -> None:
        self.base = self.cfg = cfg
        self.path = path
        self._mtime: float | None = None

    def current(self) -> StragglerConfig:
        if self.path is None:
            return self.cfg
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            self._mtime, self.cfg = None, self.base
            return self.cfg
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                over = yaml.safe_load(self.path.read_text()) or {}
                unknown = set(over) - {"threshold", "window_s", "action"}
                if unknown:
                    raise ValueError(f"only threshold, window_s, action may change; not {sorted(unknown)}")
                self.cfg = StragglerConfig.model_validate({**self.base.model_dump(), **over})
                logger.info("straggler settings from {}: {}", self.path, over)
            except Exception as e:  # a bad edit must not stop detection
                logger.warning("{}: ignored ({}: {})", self.path, type(e).__name__, e)
        return self.cfg


# ---- the exchange -----------------------------------------------------------------------------------
@dataclass
class Place:
    """Where this rank is: its ranks, its node's, and what it reports through."""

    rank: int
    local_rank: int
    local_world_size: int
    ns: str  # the run's store namespace

    @property
    def node_ranks(self) -> range:
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)


def _read(store: dist.Store, key: str) -> str:
    """A key's value without waiting for it ('' while it is absent): one request."""
    raw = store.compare_set(key, _NEVER, _NEVER).decode()
    return "" if raw == _NEVER else raw


def parse_figures(text: str) -> dict[int, tuple[float, str]]:
    """``rank work host`` lines (a torn or foreign line is skipped)."""
    out: dict[int, tuple[float, str]] = {}
    for line in text.splitlines():
        parts = line.split()
        with contextlib.suppress(ValueError, IndexError):
            out[int(parts[0])] = (float(parts[1]), parts[2])
    return out


class StragglerWatch:
    """The exchange and the verdicts of one rank (see the module docstring). :meth:`tick` is one
    check, called by the thread at each multiple of ``check_s`` on the wall clock (every rank's
    ticks line up without talking); tests call it directly with fake stores."""

    def __init__(
        self,
        cfg: StragglerConfig,
        place: Place,
        meter: WorkMeter,
        store: dist.Store,
        emit: Callable[..., Any],
        *,
        node: Callable[[], Any] = lambda: None,
        mark: Callable[[int, dict[str, Any]], bool] | None = None,
        settings: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.place = place
        self.meter = meter
        self.store = store
        self.emit = emit  # (event, **fields)
        self.node = node  # the node link (resilient.runtime.coordination.node.NodeLink) or None
        self.mark = mark  # (local rank, detail) -> marked for its agent; None: not under the launcher
        self.settings = LiveSettings(cfg, settings)
        self.rule = StragglerRule(clock)
        self.host = socket.gethostname()
        self._node_store: Any = None
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self, k: int) -> str:
        return f"{self.place.ns}/straggler/{k}"

    def tick(self, k: int) -> list[Straggler]:
        """Check ``k`` (window k-1 just ended): post this rank's figure, carry the node's figures
        of k-2 to the job's store (a linked leader), judge the newest complete window (local rank 0)."""
        p, work = self.place, self.meter.take()
        line = f"{p.rank} {work:.6g} {self.host}\n" if work is not None else None
        link = self.node()
        if link is not None:
            ns = self._node(link)
            if line:
                ns.append(f"straggler/{k - 1}", line)  # type: ignore[attr-defined]
            if not link.leader:
                return []
            block = _read(ns, f"straggler/{k - 2}")
            if block:
                self.store.append(self.key(k - 2), block)  # type: ignore[attr-defined]
                ns.delete_key(f"straggler/{k - 2}")
            judged = k - 3
        else:
            if line:
                self.store.append(self.key(k - 1), line)  # type: ignore[attr-defined]
            if p.local_rank != 0:
                return []
            judged = k - 2
        figures = parse_figures(_read(self.store, self.key(judged)))
        if p.rank == 0:  # read by every node's judge by now: the oldest window goes
            self.store.delete_key(self.key(judged - 3))
        cfg = self.settings.current()
        if figures:
            logger.debug(
                "straggler check {}: work per step by rank {}",
                judged,
                {r: round(w * 1e3, 2) for r, (w, _) in sorted(figures.items())},
            )
        found = self.rule.judge(figures, p.node_ranks, cfg.threshold, cfg.window_s)
        for s in found:
            self._report(s, cfg)
        return found

    def _node(self, link: Any) -> dist.Store:
        """This thread's own connection to the node's store."""
        if self._node_store is None:
            self._node_store = dist.TCPStore(
                "127.0.0.1",
                link.store.port,
                None,
                False,
                timeout=timedelta(seconds=30),
                wait_for_workers=False,
            )
        return self._node_store

    def _report(self, s: Straggler, cfg: StragglerConfig) -> None:
        action = cfg.action
        if action == "replace":
            marked = self.mark is not None and self.mark(
                s.rank - (self.place.rank - self.place.local_rank),
                {
                    "slowdown": round(s.slowdown, 3),
                    "work_s": s.work_s,
                    "median_s": s.median_s,
                },
            )
            if not marked:
                logger.warning("straggler rank {}: not replaced (only under `resilient launch`)", s.rank)
                action = "report"
            else:
                self.rule.forget(s.rank)
        self.emit(
            Event.STRAGGLER_DETECTED,
            rank=s.rank,
            host=s.host,
            slowdown=round(s.slowdown, 3),
            work_s=s.work_s,
            median_s=s.median_s,
            for_s=round(s.for_s, 3),
            action=action,
            threshold=cfg.threshold,
            window_s=cfg.window_s,
            judged_by=self.place.rank,
        )

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="resilient-straggler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        every = self.cfg.check_s
        while True:
            now = time.time()
            k = int(now // every) + 1
            if self._halt.wait(k * every - now + 0.01 * every):
                return
            try:
                self.tick(k)
            except Exception as e:  # a store that went away must not stop training
                logger.debug("rank {}: straggler check {} skipped: {}", self.place.rank, k, e)
                self._node_store = None

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
