"""Who a rank is in its run: the one protocol the runtime's session satisfies and everything
that asks about the rank reads (``ctx``, a detector, a hook)."""

from __future__ import annotations

from typing import Protocol


class Identity(Protocol):
    """This rank in the run; ``generation``: the generation being run (or recovered from)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def generation(self) -> int: ...
