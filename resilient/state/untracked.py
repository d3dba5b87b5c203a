"""State a training function keeps outside what the runtime restores, found in its first steps.

After a fault the function runs again from its top and the runtime restores what it tracks;
anything else that changes every step (a hand-written loader's position in plain attributes, an
EMA model not given to ``ctx.track``, a generator of its own, a counter or a prefetched batch
carried in a local, a global written in the step) silently restarts, and the run no longer ends
where a fault-free run ends. :class:`UntrackedScan` looks at the frame that iterates
``ctx.steps`` at the start of its first few steps and names each such value with the line that
fixes it (a :class:`Finding`).

Candidates are the frame's locals (one level of a plain object's attributes), the globals its
code writes, and the locals its step loop carries from one step to the next by rebinding
(:mod:`resilient.state.liveness`). Only those whose state changes at *every* sampled step are
findings, and anything reachable from a tracked object is not a candidate. Fingerprints are cheap
and copy nothing (:mod:`resilient.state.fingerprint`). Pure: no collectives, no I/O, no events.
"""

from __future__ import annotations

import dis
import inspect
import random
import time
import types
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader

from resilient.errors import ConfigError
from resilient.state.fingerprint import LOADER_ITERS, PRIMITIVE, fingerprint
from resilient.state.liveness import LoopNames, step_loop_names

FindingKind = Literal["object", "carried local", "global"]
LOADER_DOC = "docs/recovery.md#a-hand-written-loader"
CLOCKS: tuple[Callable[[], float], ...] = (time.perf_counter, time.time, time.monotonic)
_ATTRS = 64  # attributes of a plain object looked at
_NEVER = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.FrameType,
    types.CodeType,
)
_RNGS = (random.Random, np.random.Generator, np.random.RandomState)
_NOT_PLAIN = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Generator, *_RNGS, *LOADER_ITERS)


@dataclass(frozen=True)
class Finding:
    """One value the function keeps that changes every step and a restart would lose."""

    name: str  # dotted: ``iter_num``, ``ema``, ``train_loader.current_position``
    kind: FindingKind
    type_name: str  # the type of the object that holds the state (the owner, for an attribute)
    fix: str  # the line to add


def message(findings: Sequence[Finding]) -> str:
    """One sentence for a log warning naming every finding and its fix ("" for none)."""
    by_fix: dict[str, list[str]] = {}
    for f in findings:
        by_fix.setdefault(f.fix, []).append(f.name)
    if not by_fix:
        return ""
    parts = "; ".join(f"{', '.join(names)}: {fix}" for fix, names in by_fix.items())
    return (
        "state that changes every step is neither tracked nor carried, so a restart loses it and "
        f"the run ends elsewhere than a fault-free run ({parts})"
    )


class UntrackedScan:
    """Samples the frame that iterates ``ctx.steps`` at the start of its first ``samples`` steps
    (one scan per process, one frame per scan: after a restart, start a new one)."""

    def __init__(self, samples: int = 3, *, clocks: Sequence[Callable[[], float]] = CLOCKS) -> None:
        if samples < 2:
            raise ConfigError(f"UntrackedScan: samples={samples}, but it takes 2 steps to tell what changes")
        self._samples = samples
        self._clocks = tuple(clocks)
        self._history: list[dict[str, _Seen]] = []
        self._times: list[tuple[float, ...]] = []
        self._code: types.CodeType | None = None
        self._names: LoopNames | None = None
        self._globals: frozenset[str] = frozenset()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def observe(
        self, frame: types.FrameType, tracked: Iterable[Any] = (), carried_names: Collection[str] = ()
    ) -> list[Finding] | None:
        """Sample ``frame``; the findings once ``samples`` steps were seen, None before and after.

        ``tracked``: the objects the runtime tracks; ``carried_names``: ``ctx.carry``'s fields."""
        if self._done:
            return None
        if frame.f_code is not self._code:  # the first call (source is read once per scan)
            self._code, self._history, self._times = frame.f_code, [], []
            self._names = _loop_names(frame)
            self._globals = frozenset(_written_globals(frame.f_code))
        reach = _Reach.of(tracked)
        self._history.append(_sample(frame, self._names, self._globals, reach, frozenset(carried_names)))
        self._times.append(tuple(clock() for clock in self._clocks))
        if len(self._history) < self._samples:
            return None
        self._done = True
        findings = _decide(self._history, self._times)
        self._history, self._times = [], []
        return findings


@dataclass(frozen=True)
class _Seen:
    """One candidate at one sampled step (no reference to the value itself is kept)."""

    kind: FindingKind  # "object" for a local not known to be carried
    ident: int
    state: Hashable | None  # None: nothing of its own to fingerprint
    attrs: dict[str, Hashable] = field(hash=False)  # a plain object's attributes
    number: float | None  # a float's value (a clock reading is not state)
    type_name: str
    has_state_dict: bool
    fix: str


@dataclass
class _Reach:
    """Everything reachable from the tracked objects, by identity (tensors also by storage)."""

    ids: set[int] = field(default_factory=set)
    storages: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, tracked: Iterable[Any]) -> _Reach:
        reach = cls()
        for obj in tracked:
            reach.add(obj)
            if isinstance(obj, torch.nn.Module):
                reach.add_module(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                reach.add_optimizer(obj)
            for value in _attributes(obj):  # a loader's dataset, a scheduler's optimizer
                reach.add(value)
        return reach

    def add(self, obj: Any) -> None:
        if isinstance(obj, (*PRIMITIVE, tuple)):
            return  # small ints and interned strings are shared: their identity says nothing
        self.ids.add(id(obj))
        if isinstance(obj, torch.Tensor):
            ptr = _storage(obj)
            if ptr is not None:
                self.storages.add(ptr)

    def add_module(self, module: torch.nn.Module) -> None:
        for m in module.modules():  # a DDP wrapper's ``.module`` among them
            self.add(m)
        for t in chain(module.parameters(), module.buffers()):
            self.add(t)
            if t.grad is not None:
                self.add(t.grad)

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            self.add(group)
            for p in group["params"]:
                self.add(p)
        for per_param in opt.state.values():
            self.add(per_param)
            for value in per_param.values():
                self.add(value)

    def has(self, obj: Any) -> bool:
        if isinstance(obj, (*PRIMITIVE, tuple)):
            return False
        if id(obj) in self.ids:
            return True
        return isinstance(obj, torch.Tensor) and _storage(obj) in self.storages  # a view of one


def _storage(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # sparse, meta, a tensor subclass without storage: identity alone then
        return None
    return ptr or None  # every empty tensor's storage is at 0


def _attributes(obj: Any) -> list[Any]:
    try:
        return list(vars(obj).values())[:_ATTRS] if not isinstance(obj, torch.nn.Module) else []
    except TypeError:  # no __dict__
        return []


def _loop_names(frame: types.FrameType) -> LoopNames | None:
    """The step loop's names, or None where the source cannot be read (exec'd code)."""
    try:
        lines, start = inspect.getsourcelines(frame.f_code)
        line = frame.f_lineno - max(start, 1) + 1 if frame.f_lineno is not None else None
        return step_loop_names("".join(lines), line)
    except Exception:  # no file, a file changed since, a syntax the parser refuses: no static part
        return None


def _written_globals(code: types.CodeType) -> Iterator[str]:
    """The globals ``code`` and the code nested in it write (``global x; x = ...``)."""
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            yield str(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _written_globals(const)


def _candidates(
    frame: types.FrameType, local_vars: dict[str, Any], names: LoopNames | None, written: frozenset[str]
) -> Iterator[tuple[str, FindingKind, Any]]:
    # only what a step surely hands to the next: a loss read after the accumulation loop that
    # assigns it is carried only if that loop can run zero times, and is a temporary here
    carried = names.steady if names else frozenset()
    # bound afresh in every step before they are read: a loss, the loop's own targets
    temporaries = (names.assigned | names.targets) - carried if names else frozenset()
    for name, value in local_vars.items():
        if name not in temporaries:
            yield name, ("carried local" if name in carried else "object"), value
    for name in sorted(written - local_vars.keys()):
        if name in frame.f_globals:
            yield name, "global", frame.f_globals[name]


def _sample(
    frame: types.FrameType,
    names: LoopNames | None,
    written: frozenset[str],
    reach: _Reach,
    carried_names: frozenset[str],
) -> dict[str, _Seen]:
    local_vars = dict(frame.f_locals)
    seen: dict[str, _Seen] = {}
    for name, kind, value in _candidates(frame, local_vars, names, written):
        if (name.startswith("__") and name.endswith("__")) or name in carried_names:
            continue
        try:
            one = _see(name, kind, value, reach, local_vars)
        except Exception:  # an object that cannot be looked at is never a finding
            continue
        if one is not None:
            seen[name] = one
    return seen


def _see(name: str, kind: FindingKind, value: Any, reach: _Reach, local_vars: dict[str, Any]) -> _Seen | None:
    if _ignored(value, reach) or (kind == "object" and isinstance(value, PRIMITIVE)):
        return None  # a primitive not rebound in the loop cannot change
    attrs = _plain_attrs(value, reach) if _is_plain(value) else {}
    state = fingerprint(value, reach.has)
    if kind == "object" and state is None and not attrs:
        return None
    return _Seen(
        kind=kind,
        ident=id(value),
        state=state,
        attrs=attrs,
        number=value if type(value) is float else None,
        type_name=type(value).__name__,
        has_state_dict=callable(getattr(value, "state_dict", None)),
        fix=_fix(name, kind, value, local_vars),
    )


def _ignored(value: Any, reach: _Reach) -> bool:
    if isinstance(value, _NEVER) or reach.has(value):
        return True
    module = getattr(type(value), "__module__", None) or ""
    if module == "resilient" or module.startswith("resilient."):
        return True  # ctx, its carry, the runtime's own objects
    if isinstance(value, LOADER_ITERS):  # over a tracked loader: its dataset is reachable
        return reach.has(getattr(value, "_dataset", None))
    if (module == "torch" or module.startswith("torch.")) and _is_plain(value):
        # torch's own machinery (a pipeline stage's per-step buffers, a schedule): what of it
        # must be restored has a state_dict (an LR scheduler), and is still looked at
        return not callable(getattr(value, "state_dict", None))
    return False


def _is_plain(value: Any) -> bool:
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, _NOT_PLAIN)
        and getattr(type(value), "__module__", None) != "builtins"
    )


def _plain_attrs(value: Any, reach: _Reach) -> dict[str, Hashable]:
    """One level of a plain object's attributes: those with a fingerprint of their own."""
    out: dict[str, Hashable] = {}
    for key, attr in list(vars(value).items())[:_ATTRS]:
        if key.startswith("__") or _ignored(attr, reach) or _is_plain(attr):
            continue
        state = fingerprint(attr, reach.has)
        if state is not None:
            out[key] = state
    return out


def _fix(name: str, kind: FindingKind, value: Any, local_vars: dict[str, Any]) -> str:
    """The line that makes a restart keep ``value`` (named ``name``)."""
    carry = f"carry = ctx.carry({name}={name}) and use carry.{name}"
    if isinstance(value, LOADER_ITERS):
        loader = _loader_name(value, local_vars)
        return f"ctx.track({loader}={loader}) and iterate ctx.steps({loader}) in place of next({name})"
    for rng, get, put in _RNG_ACCESS:
        if isinstance(value, rng):
            s = f"{name}_state"
            return (
                f"carry = ctx.carry({s}={name}{get}), then {name}{put.format(f'carry.{s}')} after it "
                f"and carry.{s} = {name}{get} at each step's end"
            )
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer | torch.Generator):
        return f"ctx.track({name}={name})"
    if callable(getattr(value, "state_dict", None)):
        return f"ctx.track({name}={name})"
    if kind == "global":
        return f"keep it in ctx.carry instead of a global: {carry}"
    if kind == "carried local" or not _is_plain(value):
        return carry
    return (
        f"give {type(value).__name__} a state_dict()/load_state_dict() ({LOADER_DOC}) "
        f"and ctx.track({name}={name})"
    )


def _loader_name(iterator: Any, local_vars: dict[str, Any]) -> str:
    """The local that holds the DataLoader ``iterator`` iterates (its dataset is the same)."""
    dataset = getattr(iterator, "_dataset", None)
    for name, value in local_vars.items():
        if isinstance(value, DataLoader) and value.dataset is dataset:
            return name
    return "loader"


# how a generator's state is read and set back, for the ones ctx.track does not take
_RNG_ACCESS: tuple[tuple[type, str, str], ...] = (
    (random.Random, ".getstate()", ".setstate({})"),
    (np.random.Generator, ".bit_generator.state", ".bit_generator.state = {}"),
    (np.random.RandomState, ".get_state()", ".set_state({})"),
)


def _decide(history: Sequence[dict[str, _Seen]], times: Sequence[tuple[float, ...]]) -> list[Finding]:
    """The candidates whose state changed between every two sampled steps."""
    gap = max((b[0] - a[0] for a, b in pairwise(times) if a), default=0.0)
    findings: list[Finding] = []
    for name, last in history[-1].items():
        seen = [h.get(name) for h in history]
        runs = [s for s in seen if s is not None]
        same = len(runs) == len(seen) and all(s.ident == last.ident for s in runs)
        if last.kind == "object" and not same:
            continue  # a new object every step is a temporary, not state kept
        # a carried local first bound in the loop (``running = loss if step == 0 else ...``)
        # is unbound at the first step: that is a state it changes from
        if _every([_key(s) for s in seen]):
            if last.number is None or not _clock_like(last.number, times[-1], 1.0 + 2 * gap):
                kind: FindingKind = "object" if last.kind == "carried local" and same else last.kind
                findings.append(Finding(name, kind, last.type_name, last.fix))
        elif same:
            findings += _attribute_findings(name, runs)
    return findings


def _attribute_findings(name: str, runs: Sequence[_Seen]) -> list[Finding]:
    last = runs[-1]
    changed = [
        a for a in last.attrs if all(a in s.attrs for s in runs) and _every([s.attrs[a] for s in runs])
    ]
    kind: FindingKind = "global" if last.kind == "global" else "object"
    if not changed:
        return []
    if last.has_state_dict:  # it can be tracked as it is: one finding for the object
        return [Finding(name, kind, last.type_name, last.fix)]
    return [Finding(f"{name}.{a}", kind, last.type_name, last.fix) for a in changed]


def _key(seen: _Seen | None) -> Hashable:
    if seen is None:
        return ("unbound",)
    return seen.state if seen.state is not None else ("id", seen.ident)


def _every(states: Sequence[Hashable]) -> bool:
    return all(a != b for a, b in pairwise(states))


def _clock_like(value: float, now: tuple[float, ...], slack: float) -> bool:
    """A float near what a clock reads now (``t0 = time.time()`` carried for a step's timing)."""
    return any(abs(reading - value) <= slack for reading in now)
