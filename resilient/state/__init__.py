"""Tracked state: the registry of objects and RNGs, in-memory snapshots, the interval planner."""

from resilient.state.registry import Registry, capture_rng, restore_rng
from resilient.state.snapshot import SnapshotRing

__all__ = ["Registry", "SnapshotRing", "capture_rng", "restore_rng"]
