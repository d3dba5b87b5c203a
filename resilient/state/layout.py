"""Which parameters each rank's tracked modules hold, compared before a saved state is loaded.

A pipeline's ranks hold different stages; a data-parallel or sharded job's ranks hold the same
parameter names. A state saved under one pipeline layout (the number of stages, the stages per
rank, the pipeline and data-parallel dimensions of the mesh) and loaded under another gives a rank
another stage's state: with other shapes the load fails late and confusingly (an optimizer's
parameter groups "don't match"), with the same shapes it succeeds, with the wrong weights. The
saved state holds each module's parameter names (its keys), so they are the record of the layout:
before anything is loaded, each tracked module's names are compared with those it is about to be
given, and a difference is refused naming both (resharding a pipeline from N stages to M is not
supported: its stages would have to be re-cut, layer by layer, and their optimizers with them).

Parameter names are the layout only where they say which layers a stage holds: the whole model's
names (torchtitan's manual split, which deletes the layers a stage does not own, as
examples/train_pipeline.py does), not a fresh ``nn.Sequential`` per stage numbered from 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from resilient.errors import ExitCode, StateRestoreError
from resilient.state.registry import GRAD

_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


class LayoutMismatch(StateRestoreError):
    """A state saved under another layout: a relaunch would read the same bytes, so it is fatal."""

    exit_code = ExitCode.FATAL


def held(names: Iterable[str]) -> str:
    """A module's parameter names in a line: numbered layers as ranges (``blocks.2-3``), then
    the other top-level names (``embed, head``)."""
    layers: dict[str, set[int]] = {}
    other: list[str] = []
    for n in names:
        m = _INDEX.match(n)
        if m:
            layers.setdefault(m.group(1), set()).add(int(m.group(2)))
        elif (top := n.split(".", 1)[0]) not in other:
            other.append(top)
    parts = [f"{prefix}.{_ranges(sorted(ix))}" for prefix, ix in layers.items()]
    return ", ".join(parts + other) or "nothing"


def _ranges(ix: list[int]) -> str:
    out, start = [], ix[0]
    for a, b in zip(ix, [*ix[1:], None], strict=True):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b if b is not None else a
    return ",".join(out)


def check(objects: Mapping[str, Any], state: Mapping[str, Any], source: str) -> None:
    """Raise :class:`LayoutMismatch` when a tracked module is about to be given another
    module's parameters (a state saved under another pipeline layout), naming both."""
    for name, obj in objects.items():
        saved = state.get(name)
        if not isinstance(obj, torch.nn.Module) or not isinstance(saved, Mapping):
            continue
        mine = list(obj.state_dict().keys())
        theirs = [k for k in saved if k != GRAD]
        if set(mine) != set(theirs):
            raise LayoutMismatch(
                f"{source}: tracked module {name!r} was saved holding {held(theirs)}; this rank's holds "
                f"{held(mine)}. The state was written under another layout (a pipeline's stage count, "
                "stages per rank, or mesh): resume on the layout that wrote it (resharding a pipeline "
                "to another number of stages is not supported)"
            )
