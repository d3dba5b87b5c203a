"""What a detector reaches of the run it is part of (:class:`resilient.detectors.Run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resilient.contract import mark_replace
from resilient.runtime.run.session import Session


class DetectorRun:
    """What a detector reaches of this run (:class:`resilient.detectors.Run`): the session's
    identity and event log, the step being run and its batch (``step``, ``where``: the step
    loop's, asked when a detector wants them), the launcher's replace mark."""

    def __init__(
        self, session: Session, step: Callable[[], int | None], where: Callable[[], str | None]
    ) -> None:
        self._s, self._step, self._where = session, step, where
        self.rank, self.world_size, self.local_rank = session.rank, session.world_size, session.local_rank
        self.events = session.events

    @property
    def generation(self) -> int:
        return self._s.generation

    @property
    def step(self) -> int | None:
        return self._step()

    def where(self) -> str | None:
        return self._where()

    def mark_replace(self, detail: dict[str, Any]) -> bool:
        beats = self._s.launch.heartbeat_dir
        return beats is not None and mark_replace(beats, self._s.local_rank, detail)
