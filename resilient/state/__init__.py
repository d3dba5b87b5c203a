"""Tracked state: the registry of objects and RNGs, and in-memory snapshots."""

from resilient.state.registry import Registry, capture_rng, restore_rng
from resilient.state.snapshot import SnapshotRing

__all__ = ["Registry", "SnapshotRing", "capture_rng", "restore_rng"]
