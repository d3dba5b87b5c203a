"""Checkpointing: async sharded saves with an atomic commit, verified loads, tiers, shm snapshots.

``Checkpointer`` (manager.py) is the entry point; ``sharded`` holds the DCP path for DTensor/FSDP2
state; ``shm.ShmSnapshot`` keeps the newest state in shared memory across a worker's death.
"""

from resilient.checkpoint.manager import Checkpointer, OnBusy
from resilient.checkpoint.reader import Loaded
from resilient.checkpoint.shm import ShmSnapshot

__all__ = ["Checkpointer", "Loaded", "OnBusy", "ShmSnapshot"]
