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

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field

from resilient.detectors.base import Detector, Run
from resilient.events import Event
from resilient.sections import Section


class StragglerConfig(Section):
    """A rank slower than its peers (docs/recovery.md#stragglers): each rank's own work per step
    (forward of a local module + optimizer step) compared across ranks through the store.
    ``threshold``, ``window_s`` and ``action`` may change while the job runs:
    ``<events.dir>/<run_id>/straggler.yaml``."""

    enabled: bool = Field(True, description="measure and compare each rank's own work per step")
    check_s: float = Field(
        5.0, gt=0, description="each rank posts its figure this often (steps must be shorter)"
    )
    threshold: float = Field(
        1.3, gt=1, description="a rank this many times slower than the median of its peers is slow"
    )
    window_s: float = Field(30.0, ge=0, description="a rank slow on average over this long: a straggler")
    action: Literal["report", "replace"] = Field(
        "report",
        description="report: a `straggler_detected` event; replace (under `resilient launch`): its "
        "process is ended and a standby takes its rank",
    )


class Stragglers(Detector):
    """The detector: each rank's :class:`WorkMeter` in the step loop; the built-in engine runs the
    exchange (:class:`~resilient.detectors.straggler_watch.StragglerWatch`) on the meter's figures.
    A straggler raises nothing in the rank (it is slow, not wrong): it is reported, or replaced."""

    name = "stragglers"
    summary = "a rank whose own work per step is slower than its peers' (reported, or replaced)"
    section = "straggler"
    config = StragglerConfig
    evidence = (Event.STRAGGLER_DETECTED,)

    @classmethod
    def wanted(cls, section: StragglerConfig, world_size: int) -> bool:
        """Whether a run measures and compares (on, and peers to compare with)."""
        return section.enabled and world_size > 1

    @classmethod
    def build(cls, section: StragglerConfig, run: Run) -> Stragglers | None:
        return cls(section) if cls.wanted(section, run.world_size) else None

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self.meter = WorkMeter()

    def generation(self, number: int) -> None:
        self.meter.clear()  # (the objects the function tracks afresh are hooked afresh)

    def tracked(self, name: str, obj: Any) -> None:
        self.meter.track(obj)

    def step_done(self, step: int) -> None:
        self.meter.step_done()

    def uninstall(self) -> None:
        self.meter.clear()


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
