"""Every fault kind, one object each, in one registry.

Adding a kind is one class in one file (a subclass of :class:`InProcess` or :class:`ByHarness`,
see :mod:`chaos.faults.base`) and one line in :data:`REGISTRY` below; ``certify``, ``run``,
``stream``, the injector, ``chaos kinds`` and docs/chaos.md's table (``python -m
chaos.reference``) follow from it. The order here is the order they are listed in.
"""

from __future__ import annotations

from chaos.faults.base import (
    CRASH,
    SLOW_STORAGE,
    Arrangement,
    ByHarness,
    Evidence,
    FaultKind,
    InjectedFault,
    InProcess,
    KindRegistry,
    Undo,
    Where,
)
from chaos.faults.bitflip import Bitflip
from chaos.faults.desync import Desync
from chaos.faults.in_process import GilHang, Hang, RaiseException, Stall
from chaos.faults.link import LinkDrop, LinkLoss
from chaos.faults.memory import CudaOom, HostOom, KernelOom
from chaos.faults.node import LoseNode
from chaos.faults.numeric import GradSpike, NanGradient
from chaos.faults.p2p_skip import P2pSkip
from chaos.faults.segfault import Segfault
from chaos.faults.signals import Sigkill, Sigstop
from chaos.faults.storage import CorruptCheckpoint, SlowDisk
from chaos.faults.straggler import Straggler

REGISTRY = KindRegistry(
    [
        RaiseException(),
        Hang(),
        HostOom(),
        GilHang(),
        Stall(),
        KernelOom(),
        CudaOom(),
        Desync(),
        P2pSkip(),
        Segfault(),
        Sigkill(),
        Sigstop(),
        CorruptCheckpoint(),
        SlowDisk(),
        LinkDrop(),
        LinkLoss(),
        NanGradient(),
        GradSpike(),
        Bitflip(),
        Straggler(),
        LoseNode(),
    ]
)

__all__ = [
    "CRASH",
    "REGISTRY",
    "SLOW_STORAGE",
    "Arrangement",
    "ByHarness",
    "Evidence",
    "FaultKind",
    "InProcess",
    "InjectedFault",
    "KindRegistry",
    "Undo",
    "Where",
]
