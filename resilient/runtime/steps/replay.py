"""Replay verification: a recovery that replays steps proves they are the steps it replays.

A restore from a snapshot re-runs the steps between the snapshot and the fault. If the function
keeps something between steps that the runtime cannot see (a batch prefetched into a local, a
global changed in a step, an RNG it does not know, a nondeterministic kernel), the replay goes
somewhere else, and nothing raises. So at each step's start the runtime digests what it holds of
the step: the parameters of every tracked model (by reference, summed where they live), and
the small state the live capture copied (buffers, RNGs, data position, scheduler,
hyperparameters, carried values). The digests of completed steps are kept
back to the oldest snapshot a restore can return to (:meth:`ReplayCheck.prune`). When a replay
reaches a step that has one, the two are compared: ``replay_verified`` once the replay reached
the faulted step, or ``replay_diverged`` at the first step that differs, naming the tracked
objects and leaves, and the likely causes (``verify_replay: warn``; ``stop`` ends the run,
exit 3). A live resume replays nothing: ``replay_unchecked`` says so.

The parameters' sums are reductions on their device, read back to the host only when compared;
the whole digest is taken every ``every`` steps, set from its measured cost so that it stays
under :data:`BUDGET` of a step, and at the :data:`AFTER`
steps that follow each snapshot, where every replay from the ring begins. A GradScaler's values
are left out (read from its device only at a restore); its effect shows in the parameters.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from loguru import logger

from resilient.errors import ReplayDiverged
from resilient.events import Event
from resilient.runtime.steps.live import LiveResume, _Capture, _Later
from resilient.state.snapshot import Frozen

Mode = Literal["warn", "stop", "off"]
BUDGET = 0.002  # of a step's time: what the digest may cost (the steps after a snapshot aside)
CALIBRATE = 5  # digests timed before ``every`` is set
MAX_KEPT = 4096  # digests kept at most (a snapshot further back is checked where one is kept)
AFTER = 3  # the steps after each snapshot digested whatever the cadence: a replay starts at one
CAUSES = (
    "a value carried from step to step outside ctx.track (a prefetched batch, a best loss: keep it "
    "in ctx.carry, docs/recovery.md#what-the-runtime-cannot-see)",
    "a nondeterministic op (on GPU, torch.use_deterministic_algorithms is off)",
    "a data source or RNG the function uses that is not tracked",
)


@dataclass
class _Digest:
    """One step start's digest: the parameters' sums (device tensors, one per device, read only
    when compared) and each small part's plain hash, laid out as ``layout`` says."""

    layout: tuple[tuple[str, tuple[str, ...]], ...]  # (object, its tensor leaves' labels) in order
    sums: list[tuple[torch.Tensor, list[int]]]  # per device: the sums, and their places in the layout
    plain: dict[str, int]  # object -> hash of its non-tensor leaves

    def values(self) -> list[str]:
        """Each leaf's sum, exactly as computed (a float by its bits: NaN equals NaN)."""
        out = [""] * sum(len(labels) for _, labels in self.layout)
        for sums, places in self.sums:
            for i, v in zip(places, sums.tolist(), strict=True):
                out[i] = v.hex() if isinstance(v, float) else str(v)
        return out


@dataclass
class _Window:
    """A replay under way: from the restored step to the faulted one (``fault``), checked up to
    ``end``: the faulted step, or where a silent fault may have begun (the digests of later steps
    were taken of the corrupted run and are no reference)."""

    restored: int
    fault: int
    generation: int
    end: int
    checked: list[int] = field(default_factory=list)

    @property
    def cut(self) -> bool:
        """The reference ends before the faulted step (a silent fault's window)."""
        return self.end < self.fault


class ReplayCheck:
    """See the module docstring. One per run: the digests outlive generations."""

    TAKES: ClassVar[tuple[str, ...]] = ("live", "peer")  # sources that replay nothing

    def __init__(
        self,
        mode: Mode,
        emit: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
        budget: float | None = None,
        suspects: Callable[[], list[str]] = list,
    ) -> None:
        self.mode = mode
        self.suspects = suspects  # what the run is known to keep untracked: the first causes named
        self.budget = BUDGET if budget is None else budget
        self.emit = emit
        self.clock = clock
        self.kept: dict[int, _Digest] = {}
        self.every = 1
        self._costs: list[float] = []
        self._starts: list[float] = []
        self._window: _Window | None = None
        self._after: set[int] = set()  # the steps after the newest snapshot (always digested)
        self._labels: dict[int, tuple[str, ...]] = {}  # id(module) -> its parameters' names

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def generation(self) -> None:
        self._labels.clear()  # (a new generation's models are new objects)

    # -- the loop's fixed points ------------------------------------------------------------------
    def restored(
        self, step: int, fault_step: int | None, source: str, generation: int, since: int | None = None
    ) -> None:
        """A restore at ``step`` after a fault at ``fault_step`` (from ``source``): the replay to
        come is checked against the digests kept, until it reaches the faulted step. ``since``: a
        silent fault found at the end of a check window that began there; the digests kept of
        later steps were taken of a run it may have corrupted, so they go and the check ends at
        ``since``."""
        if not self.enabled:
            return
        if since is not None:
            for s in [s for s in self.kept if s > since]:
                del self.kept[s]
        self._abandon("another fault came before the replay reached step {fault}", generation)
        if source in self.TAKES:
            self.emit(
                Event.REPLAY_UNCHECKED,
                generation=generation,
                step=step,
                restored_step=step,
                fault_step=fault_step,
                why=f"resumed {source} at the faulted step: no step was replayed",
            )
            return
        if fault_step is None or fault_step < step:
            return
        end = fault_step if since is None else max(step, min(fault_step, since))
        self._window = _Window(step, fault_step, generation, end)

    def at_start(self, step: int, cap: _Capture | None, objects: dict[str, Any], live: LiveResume) -> None:
        """``step`` begins (its small state just captured): digest it when due, and compare it
        with the kept digest of the same step when a replay reaches it."""
        if not self.enabled or cap is None:
            return
        now = self.clock()
        self._starts = [*self._starts[-8:], now]
        w = self._window
        checking = w is not None and w.restored <= step <= w.end and step in self.kept
        if checking or step % self.every == 0 or step in self._after:
            d = self._digest(cap, objects, live)
            self._costs.append(self.clock() - now)
            if len(self._costs) == CALIBRATE:
                self._calibrate()
            if checking:
                assert w is not None
                self._compare(w, step, self.kept[step], d)
            self.kept[step] = d
        if w is not None and step >= w.end and self._window is w:
            self._window = None
            self._verdict(w, step)

    def _verdict(self, w: _Window, step: int) -> None:
        """The replay reached the end of its reference: verified where a replayed step was
        compared, else unchecked and why."""
        replayed = [s for s in w.checked if s > w.restored]  # (the restored step checks the restore)
        if replayed:
            extra = {"reference_end": w.end} if w.cut else {}
            self.emit(
                Event.REPLAY_VERIFIED,
                generation=w.generation,
                step=step,
                restored_step=w.restored,
                fault_step=w.fault,
                steps_checked=len(replayed),
                first=replayed[0],
                last=replayed[-1],
                restore_checked=w.restored in w.checked,
                **extra,
            )
            return
        kept = "the restored state matched; " if w.checked else ""
        why = f"no digest was kept of steps {w.restored + 1}..{w.end} (one every {self.every})"
        if w.cut:
            why = (
                f"a silent fault found at step {w.fault} (or a hang, which a skipped collective "
                f"causes) may have begun at step {w.end}: the run after it is no reference, and no "
                "step before it was replayed"
            )
        elif w.fault == w.restored:
            why = "nothing was replayed: the snapshot restored is the faulted step's start"
        self._unchecked(w, kept + why)

    def snapshot_at(self, step: int, oldest: int | None) -> None:
        """A snapshot of ``step``'s start was kept (``oldest``: the oldest one kept now): a restore
        starts there, so the steps that follow it are digested whatever ``every`` says, and every
        replay from it is checked; digests older than ``oldest`` go."""
        self._after = set(range(step, step + AFTER + 1))
        self.prune(oldest)

    def prune(self, oldest: int | None) -> None:
        """Digests of steps before ``oldest`` (the oldest snapshot a restore can return to) go."""
        if oldest is not None:
            for s in [s for s in self.kept if s < oldest]:
                del self.kept[s]
        while len(self.kept) > MAX_KEPT:
            del self.kept[min(self.kept)]

    # -- the digest -------------------------------------------------------------------------------
    def _digest(self, cap: _Capture, objects: dict[str, Any], live: LiveResume) -> _Digest:
        layout: list[tuple[str, tuple[str, ...]]] = []
        tensors: list[torch.Tensor] = []
        plain: dict[str, int] = {}
        for name, kept in cap.objects.items():
            obj = objects.get(name)
            labels: list[str] = []
            if isinstance(obj, _SCALERS):  # (its values read back from the device only at a restore)
                layout.append((name, ()))
                plain[name] = 0
                continue
            if isinstance(obj, torch.nn.Module):
                names = self._param_names(obj)
                ts = kept.tensors  # (the parameters, then gradients pending in an accumulation window)
                labels = [
                    names[i] if i < len(names) else f"{names[i - len(names)]}.grad" for i in range(len(ts))
                ]
                tensors += ts
                small: Any = kept.buffers
            elif isinstance(obj, torch.optim.Optimizer):
                small = kept.groups  # (its moments follow the parameters: a step later, they differ too)
            else:
                small = kept.state
            found: list[tuple[str, torch.Tensor]] = []
            plain[name] = _plain_hash(small, "", found)
            labels += [p or "/" for p, _ in found]
            tensors += [t for _, t in found]
            layout.append((name, tuple(labels)))
        found_rng: list[tuple[str, torch.Tensor]] = []
        plain["rng"] = _plain_hash(cap.rng, "", found_rng)
        layout.append(("rng", tuple(p for p, _ in found_rng)))
        tensors += [t for _, t in found_rng]
        return _Digest(tuple(layout), _sums(tensors), plain)

    def _param_names(self, m: torch.nn.Module) -> tuple[str, ...]:
        names = self._labels.get(id(m))
        if names is None:
            ids = {id(p) for p in m.parameters()}
            entries = m.state_dict(keep_vars=True)
            names = self._labels[id(m)] = tuple(k for k, v in entries.items() if id(v) in ids)
        return names

    def _calibrate(self) -> None:
        """``every``: the digest's median cost against the median step, under ``budget``."""
        steps = [b - a for a, b in zip(self._starts, self._starts[1:], strict=False)]
        if not steps:
            return
        step_s, cost_s = statistics.median(steps), statistics.median(self._costs)
        self.every = max(1, math.ceil(cost_s / (self.budget * step_s))) if step_s > 0 else 1

    # -- the verdicts -----------------------------------------------------------------------------
    def _compare(self, w: _Window, step: int, then: _Digest, now: _Digest) -> None:
        if then.layout != now.layout:
            self._unchecked(w, f"the tracked objects at step {step} are not those the run had there")
            self._window = None
            return
        a, b = then.values(), now.values()
        differ: dict[str, list[str]] = {}
        i = 0
        for name, labels in then.layout:
            for label in labels:
                if a[i] != b[i]:
                    differ.setdefault(name, []).append(label)
                i += 1
            if then.plain.get(name) != now.plain.get(name):
                differ.setdefault(name, []).append("(its non-tensor values)")
        if not differ:
            w.checked.append(step)
            return
        self._window = None
        what = "the restored state" if step == w.restored else f"the replay of step {step - 1}"
        objects = {k: v[:8] + ([f"... {len(v) - 8} more"] if len(v) > 8 else []) for k, v in differ.items()}
        causes = [*self.suspects(), *CAUSES]
        self.emit(
            Event.REPLAY_DIVERGED,
            generation=w.generation,
            step=step,
            restored_step=w.restored,
            fault_step=w.fault,
            first_step=step,
            objects=objects,
            steps_checked=len(w.checked),
            causes=causes,
        )
        msg = (
            f"the replay after the fault at step {w.fault} diverged: {what} differs from the run it "
            f"replays at step {step} ({', '.join(f'{k}: {len(v)}' for k, v in differ.items())} leaves). "
            f"Likely causes: {'; '.join(causes)}"
        )
        logger.warning(msg)
        if self.mode == "stop":
            raise ReplayDiverged(f"{msg} (verify_replay: stop)")

    def _unchecked(self, w: _Window, why: str) -> None:
        self.emit(
            Event.REPLAY_UNCHECKED,
            generation=w.generation,
            step=w.restored,
            restored_step=w.restored,
            fault_step=w.fault,
            why=why,
        )

    def _abandon(self, why: str, generation: int) -> None:
        w, self._window = self._window, None
        if w is not None:
            self._unchecked(w, why.format(fault=w.fault))


_SCALERS = tuple(
    c for c in (getattr(torch.amp, "GradScaler", None), torch.cuda.amp.GradScaler) if c is not None
)


def _sums(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """Each tensor's sum in its own dtype (a half-precision one in float32), stacked by device and
    dtype. Not the exact byte sums of the replicas' digests: a replay is compared with its own
    process's run, where the same bits sum to the same bits, and a native sum costs a third."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for i, t in enumerate(tensors):
        t = (t.to_local() if hasattr(t, "to_local") else t).detach()  # (a DTensor's shard)
        total = t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()
        got, places = groups.setdefault((total.device, total.dtype), ([], []))
        got.append(total)
        places.append(i)
    return [(torch.stack(got), places) for got, places in groups.values()]


_HALF = (torch.float16, torch.bfloat16)


def _plain_hash(tree: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> int:
    """A hash of ``tree``'s non-tensor leaves (stable within a process, which is where digests
    are compared); its tensors are appended to ``tensors`` with their paths."""
    if isinstance(tree, torch.Tensor):
        tensors.append((path, tree))
        return 0
    if isinstance(tree, Frozen):
        return _plain_hash(tree.value, path, tensors)
    if isinstance(tree, dict):
        return hash(tuple((str(k), _plain_hash(v, f"{path}/{k}", tensors)) for k, v in tree.items()))
    if isinstance(tree, tuple) and len(tree) > 64 and type(tree[0]) is int:
        try:  # (an RNG's 625 words: hashed as they are)
            return hash(tree)
        except TypeError:
            pass
    if isinstance(tree, list | tuple):
        return hash(tuple(_plain_hash(v, f"{path}/{i}", tensors) for i, v in enumerate(tree)))
    if isinstance(tree, np.ndarray):
        return hash((tree.dtype.str, tree.shape, tree.tobytes()))
    if isinstance(tree, _Later) or tree is None:
        return 0  # (a device GradScaler's values: not read back at every step)
    if isinstance(tree, float):
        return hash(tree.hex())  # (hash(nan) differs between two NaN objects)
    return hash(repr(tree))
