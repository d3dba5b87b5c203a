"""Where a (re)started worker group takes its state from: shared memory, else the newest checkpoint.

After a relaunch by ``resilient launch`` every node's ``/dev/shm`` still holds the snapshots its
dead workers took (the agent keeps them). Ranks exchange the steps they hold through the store;
the newest step *every* rank holds wins if it is not older than the newest committed checkpoint.
Each rank then loads its slot and the ranks vote again: if any fails, everyone falls back to the
checkpoint path together.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loguru import logger

from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import CheckpointError

Exchange = Callable[[str, str], list[str]]


def from_shm(shm: ShmSnapshot, exchange: Exchange, newest_checkpoint: int) -> tuple[int, Any] | None:
    held = [set(json.loads(v)) for v in exchange("resume_shm_steps", json.dumps(shm.steps()))]
    common = set.intersection(*held) if held else set()
    best = max(common, default=-1)
    if best < 0 or best < newest_checkpoint:
        return None
    got: tuple[int, Any] | None = None
    try:
        got = shm.load(best)
    except CheckpointError as e:
        logger.warning(f"shared-memory snapshot of step {best} does not load: {e}")
    votes = exchange("resume_shm_ok", "1" if got is not None else "0")
    return got if all(v == "1" for v in votes) else None
