"""Stragglers: a rank whose own work is slower than its peers', found without a collective.

In synchronous training every rank's wall step time is the same (the slowest sets the pace), and a
rank throttled by a CPU quota spends the same CPU time per step as a healthy one; neither tells
which rank is slow. What does is the time a rank spends in work that waits for no peer:

- the **forward of a module that issues no collective inside it**: DDP's inner module (DDP's own
  buffer broadcast and bucket rebuild happen outside it), or a plain module; not an FSDP2 module
  or one holding DTensors, whose forward all-gathers;
- on CPU, that module's **backward** up to the gradients of its first parameters (ready last in
  backward), before DDP waits for its all-reduces;
- the **optimizer step**, which is local under DDP, FSDP2 and TP alike.

:class:`WorkMeter` times them with module and optimizer hooks (CUDA events on a GPU, read lazily:
a pair whose end has not completed yet is read at a later step, never waited for; a CPU clock
otherwise); docs/recovery.md#stragglers has the measurement that chose this figure.

:class:`StragglerWatch` (a daemon thread, one per rank) posts the rank's mean work per step every
``straggler.check_s`` to the store: on its node's store when the rank is linked to one
(:mod:`resilient.runtime.coordination.node`), where the node's leader collects the node's figures into one
append to the job's store; else straight to the job's store. Local rank 0 of each node reads the
window's figures with one request and judges its own node's ranks (:class:`StragglerRule`), so the
job's store sees O(1) requests per node per check when nodes are linked. A straggler is reported
(``straggler_detected``) and, with ``action: replace`` under ``resilient launch``, marked next to
its heartbeat (:func:`resilient.contract.mark_replace`): its agent ends the process and a
standby takes its rank through the path of any dead rank.

Settings that may change while the job runs (``threshold``, ``window_s``, ``action``) are read
from ``<run dir>/straggler.yaml`` when that file changes.
"""

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

import torch
import torch.distributed as dist
import yaml
from loguru import logger

from resilient.config import StragglerConfig
from resilient.events import Event

_NEVER = "\x00never"  # compare_set(k, _NEVER, _NEVER): reads k without waiting for it (absent: _NEVER)


# ---- the figure ---------------------------------------------------------------------------------
def local_module(obj: object) -> torch.nn.Module | None:
    """The module whose forward is this rank's own work (no collective inside), or None."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(obj, DistributedDataParallel):
        return obj.module
    if not isinstance(obj, torch.nn.Module):
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - an old torch
        return obj
    for m in obj.modules():
        if isinstance(m, FSDPModule) or any(isinstance(p, DTensor) for p in m.parameters(recurse=False)):
            return None
    return obj


class WorkMeter:
    """Main thread: the time of this rank's own work (see the module docstring), per step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._open: dict[int, Any] = {}  # id(hooked object) -> its start (a clock value or a CUDA event)
        self._pending: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not read yet
        self._acc = 0.0  # this step's work so far (main thread only)
        self._fwd_end: float | None = None  # a CPU module's forward ended here; its backward follows
        self._last_grad: float | None = None  # ... and its last hooked gradient was ready here
        self._lock = threading.Lock()
        self._work_s = 0.0  # since the last take()
        self._steps = 0

    def track(self, obj: object) -> None:
        """Hook ``obj``'s local work: a module's forward (:func:`local_module`), an optimizer's step."""
        module = local_module(obj)
        if module is not None and id(module) not in self._hooked:
            cuda = any(p.is_cuda for p in module.parameters())
            self._hooked.add(id(module))
            self._handles += [
                module.register_forward_pre_hook(lambda m, a: self._begin(id(m), cuda)),
                module.register_forward_hook(lambda m, a, o: self._forward_done(id(m), cuda)),
            ]
            if not cuda:
                # the backward's own compute: from the forward's end until the gradients of the
                # first parameters (ready last in backward) were accumulated; DDP's wait for its
                # all-reduces comes after that, and is not this rank's work
                for p in [p for p in module.parameters() if p.requires_grad][:4]:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooked:
            cuda = any(p.is_cuda for g in obj.param_groups for p in g["params"])
            self._hooked.add(id(obj))
            self._handles += [
                obj.register_step_pre_hook(lambda o, a, k: self._optimizer_begins(id(o), cuda)),
                obj.register_step_post_hook(lambda o, a, k: self._end(id(o), cuda)),
            ]

    def _forward_done(self, key: int, cuda: bool) -> None:
        self._end(key, cuda)
        self._backward_done()
        if not cuda:
            self._fwd_end = self.clock()

    def _grad_ready(self, _p: torch.Tensor) -> None:
        self._last_grad = self.clock()

    def _backward_done(self) -> None:
        """The backward since the last forward (if its gradients were seen) counts as work."""
        start, end = self._fwd_end, self._last_grad
        if start is not None and end is not None and end > start:
            self._acc += end - start
        self._fwd_end = self._last_grad = None

    def _optimizer_begins(self, key: int, cuda: bool) -> None:
        self._backward_done()
        self._begin(key, cuda)

    def _begin(self, key: int, cuda: bool) -> None:
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[key] = ev
        else:
            self._open[key] = self.clock()

    def _end(self, key: int, cuda: bool) -> None:
        start = self._open.pop(key, None)
        if start is None:
            return
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((start, end))
        else:
            self._acc += self.clock() - start

    def step_done(self) -> None:
        """At a step's end: its work counts (CUDA pairs that completed meanwhile are read now)."""
        self._backward_done()
        if self._pending:
            done = [p for p in self._pending if p[1].query()]
            if done:
                self._pending = [p for p in self._pending if p not in done]
                self._acc += sum(s.elapsed_time(e) for s, e in done) / 1e3
        with self._lock:
            self._work_s += self._acc
            self._steps += 1
        self._acc = 0.0

    def take(self) -> float | None:
        """(Any thread) The mean work per step since the last take, None if no step completed."""
        with self._lock:
            if self._steps == 0:
                return None
            work, self._work_s, n, self._steps = self._work_s, 0.0, self._steps, 0
        return work / n

    def clear(self) -> None:
        """A new generation tracks new objects: the old ones' hooks go."""
        for h in self._handles:
            h.remove()
        self._handles, self._hooked, self._open, self._pending = [], set(), {}, []
        self._acc = 0.0
        self._fwd_end = self._last_grad = None


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
            logger.debug("straggler check {}: work per step by rank {}", judged,
                         {r: round(w * 1e3, 2) for r, (w, _) in sorted(figures.items())})  # fmt: skip
        found = self.rule.judge(figures, p.node_ranks, cfg.threshold, cfg.window_s)
        for s in found:
            self._report(s, cfg)
        return found

    def _node(self, link: Any) -> dist.Store:
        """This thread's own connection to the node's store."""
        if self._node_store is None:
            self._node_store = dist.TCPStore(
                "127.0.0.1", link.store.port, None, False,
                timeout=timedelta(seconds=30), wait_for_workers=False,
            )  # fmt: skip
        return self._node_store

    def _report(self, s: Straggler, cfg: StragglerConfig) -> None:
        action = cfg.action
        if action == "replace":
            marked = self.mark is not None and self.mark(s.rank - (self.place.rank - self.place.local_rank), {
                "slowdown": round(s.slowdown, 3), "work_s": s.work_s, "median_s": s.median_s,
            })  # fmt: skip
            if not marked:
                logger.warning("straggler rank {}: not replaced (only under `resilient launch`)", s.rank)
                action = "report"
            else:
                self.rule.forget(s.rank)
        self.emit(
            Event.STRAGGLER_DETECTED, rank=s.rank, host=s.host, slowdown=round(s.slowdown, 3),
            work_s=s.work_s, median_s=s.median_s, for_s=round(s.for_s, 3), action=action,
            threshold=cfg.threshold, window_s=cfg.window_s, judged_by=self.place.rank,
        )  # fmt: skip

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
