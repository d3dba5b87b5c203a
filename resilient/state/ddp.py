"""DDP's gradient buckets after an in-process restart: the layout the interrupted run had.

DDP (``find_unused_parameters=False``) reduces its first iteration in one bucket with the
parameters in definition order, then rebuilds its buckets in the order the gradients became ready.
A DDP built again after a restart starts over with the first layout, so the resumed step reduces a
flat buffer laid out differently from the uninterrupted run's at that step. With three or more
ranks a ring all-reduce then adds the ranks' values in another order for some elements, and the
run no longer ends bit for bit where the fault-free one does (with two, ``a + b`` is the same sum).

So the runtime notes each tracked DDP's rebuilt layout once DDP has rebuilt it, and while the
function re-enters after a restart to a step past the first, DDP's own bucket assignment returns
that layout for a parameter list of the same shapes and dtypes. The resumed step reduces the
buffer the uninterrupted run reduced; DDP's own rebuild after it arrives at the same layout again.
The layouts are also written to the run's directory, so a worker relaunched by ``resilient
launch`` starts its DDP the same way. Every rank must build its buckets alike (DDP pairs them by
position), so the runtime hands a layout over only when every rank holds the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def _signature(params: Iterable[torch.Tensor]) -> Signature:
    return tuple((tuple(p.shape), p.dtype) for p in params)


def _rebuilt(ddp: Any) -> list[list[int]] | None:
    """The bucket layout DDP rebuilt (parameter indices per bucket, in reduction order), if it has."""
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return None
    try:
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    except Exception:  # (a DDP without a logger: nothing to learn)
        return None
    if not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


def _reducer_params(ddp: Any) -> list[torch.Tensor]:
    """The parameters DDP gave its reducer, in the same order (what bucket indices refer to)."""
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    seen: set[int] = set()
    out = []
    for name, p in ddp.module.named_parameters():
        if p.requires_grad and name not in ignored and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class BucketLayouts:
    """Rebuilt layouts of the tracked DDP modules, by their parameters' shapes and dtypes."""

    def __init__(self) -> None:
        self._known: dict[Signature, list[list[int]]] = {}
        self._done: weakref.WeakSet[Any] = weakref.WeakSet()  # DDPs whose layout is noted

    def __len__(self) -> int:
        return len(self._known)

    def observe(self, objects: Iterable[Any]) -> bool:
        """Note the layout of every DDP among ``objects`` that has rebuilt its buckets; True if a
        layout not known before was noted."""
        new = False
        for obj in objects:
            if not isinstance(obj, torch.nn.parallel.DistributedDataParallel) or obj in self._done:
                continue
            if not getattr(obj, "_has_rebuilt_buckets", False):
                continue
            params = _reducer_params(obj)
            layout = _rebuilt(obj)  # (DDP's logging data shows it a step or so after the rebuild)
            if layout is not None and sorted(i for b in layout for i in b) == list(range(len(params))):
                new |= self._known.setdefault(_signature(params), layout) is layout
                self._done.add(obj)
        return new

    def digest(self) -> str:
        """The same on ranks that know the same layouts ('' when none is known)."""
        if not self._known:
            return ""
        doc = sorted((repr(sig), buckets) for sig, buckets in self._known.items())
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()

    def dump(self, path: Path) -> None:
        """Write the known layouts to ``path`` (atomically: ranks of a node may write at once)."""
        doc = [
            {"params": [[list(shape), str(dt).removeprefix("torch.")] for shape, dt in sig], "buckets": b}
            for sig, b in self._known.items()
        ]
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """The layouts a previous process of this run wrote, if any (a bad file is ignored)."""
        try:
            doc = json.loads(path.read_text())
            for entry in doc:
                params = [(tuple(int(n) for n in s), vars(torch).get(dt)) for s, dt in entry["params"]]
                sig: Signature = tuple((shape, d) for shape, d in params if isinstance(d, torch.dtype))
                if len(sig) == len(params):
                    self._known.setdefault(sig, [[int(i) for i in b] for b in entry["buckets"]])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """While active, a DDP built on parameters of a known signature starts with its layout."""
        if not self._known:
            yield
            return
        original = dist._compute_bucket_assignment_by_size
        known = self._known

        def assign(tensors: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
            layout = known.get(_signature(tensors))
            if layout is None or len(args) > 1 or kwargs.get("tensor_indices") is not None:
                return original(tensors, limits, *args, **kwargs)
            # DDP reverses the list of buckets it is given (to approximate the ready order)
            return [list(b) for b in reversed(layout)], [max(limits)] * len(layout)

        dist._compute_bucket_assignment_by_size = assign  # type: ignore[assignment]
        try:
            yield
        finally:
            dist._compute_bucket_assignment_by_size = original
