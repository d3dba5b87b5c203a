"""DDP's rebuilt bucket layouts across restarts (:mod:`resilient.state.ddp` says why): noted after
steps, written to the run's directory for relaunched workers, and applied while the function
re-enters — on every rank or on none, since ranks whose buckets differ add up unrelated
gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from resilient.state.ddp import BucketLayouts

DDP_BUCKETS = "ddp-buckets.json"  # in the run directory: DDP's rebuilt layouts, for relaunched workers

AllSame = Callable[[str, str, float], bool]  # (name, this rank's value, timeout) -> every rank holds it


class DdpBuckets:
    def __init__(self, run_dir: Path | None) -> None:
        self.layouts = BucketLayouts()
        self.path = run_dir / DDP_BUCKETS if run_dir is not None else None
        self._applied = contextlib.ExitStack()  # while the function re-enters after a fault

    def load(self) -> None:
        """The layouts a previous process of this run wrote (a relaunched worker's, a replacement's)."""
        if self.path is not None:
            self.layouts.load(self.path)

    def agree_at_start(self, all_same: AllSame, timeout: float) -> None:
        """A relaunched group starts its DDP with the buckets the previous processes had rebuilt,
        if every rank holds the same ones (a replacement for one rank agrees with its survivors
        at their recovery instead)."""
        same = all_same("ddp_layout/start", self.layouts.digest(), timeout)
        if same and len(self.layouts):
            self._applied.enter_context(self.layouts.applied())

    def ended(self, objects: Iterable[Any]) -> str:
        """The layouts' digest once the generation that ended (``objects``: its objects) is noted:
        what this rank offers at the recovery barrier (see :func:`agreed`)."""
        self.layouts.observe(objects)
        return self.layouts.digest()

    def at_recovery(
        self, ended: Iterable[Any], generation: int, step: int, all_same: AllSame, timeout: float
    ) -> None:
        """Before re-entry: note the layouts of the generation that ended (``ended``: its objects)
        and apply them to the next if every rank holds the same ones and it resumes past step 0."""
        self.layouts.observe(ended)
        self.release()
        same = all_same(f"ddp_layout/g{generation}", self.layouts.digest(), timeout)
        if step > 0 and same and len(self.layouts):
            self._applied.enter_context(self.layouts.applied())

    def observe(self, objects: Iterable[Any]) -> None:
        """After a step whose state is kept: a layout DDP rebuilt since is noted and written."""
        if self.layouts.observe(objects) and self.path is not None:
            with contextlib.suppress(OSError):  # (a relaunched worker then starts as DDP did)
                self.layouts.dump(self.path)

    def release(self) -> None:
        """Every tracked DDP is built by now: later ones build their buckets as DDP would."""
        self._applied.close()


def agreed(posted: str, same: bool | None, fallback: AllSame) -> AllSame:
    """An :data:`AllSame` that answers from the recovery barrier (``same``: its ``layout_same``
    for the digest this rank ``posted``); anything else is asked through ``fallback``."""

    def all_same(name: str, value: str, timeout: float) -> bool:
        if same is not None and value == posted:
            return same
        return fallback(name, value, timeout)

    return all_same
