"""Detectors: the checks that turn a silent fault (a NaN about to reach the weights, replicas that
differ, a skipped collective, a slow rank) into one the runtime recovers from.

Adding one is one file in this package (a :class:`~resilient.detectors.base.Detector` subclass
with its config section, its faults and its evidence: ``guard.py`` is the example) and one entry
in :data:`REGISTRY` below; the config's section, the fault records' kinds, the classification
of its errors and the runtime's calls of its hooks follow from the registry.
"""

from __future__ import annotations

from resilient.detectors.base import AgreedFault, Detector, DetectorRegistry, Detectors, Run
from resilient.detectors.collectives import CollectiveCheck
from resilient.detectors.guard import StepGuard
from resilient.detectors.replicas import ReplicaCheck
from resilient.detectors.stragglers import Stragglers

REGISTRY = DetectorRegistry([StepGuard, ReplicaCheck, CollectiveCheck, Stragglers])

__all__ = ["REGISTRY", "AgreedFault", "Detector", "DetectorRegistry", "Detectors", "Run"]
