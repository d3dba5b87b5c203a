"""What a detector reaches of the run it is part of (:class:`resilient.detectors.Run`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resilient.contract import mark_replace

if TYPE_CHECKING:
    from resilient.runtime.steps.loop import StepLoop


class DetectorRun:
    """What a detector reaches of this run (:class:`resilient.detectors.Run`): the session's
    identity and event log, the step loop's step and batch, the launcher's replace mark."""

    def __init__(self, loop: StepLoop) -> None:
        self._loop, self._s = loop, loop.session
        self.rank, self.world_size, self.local_rank = self._s.rank, self._s.world_size, self._s.local_rank
        self.events = self._s.events

    @property
    def generation(self) -> int:
        return self._s.generation

    @property
    def step(self) -> int | None:
        return self._loop.step

    def where(self) -> str | None:
        return self._loop.gen.batch()

    def mark_replace(self, detail: dict[str, Any]) -> bool:
        beats = self._s.launch.heartbeat_dir
        return beats is not None and mark_replace(beats, self._s.local_rank, detail)
