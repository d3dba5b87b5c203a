"""The workload of benchmarks/work_lost_peers.py for the peers' own loops (NVRx's Wrapper, torchft).

It is examples/train_tiny.py's, taken from the example itself: its model (``TinyLM``), its data
stream (``Tokens``, seeded per rank), its optimizer and schedule, and its step order — the batch,
the planned fault (chaos's injector, which fires at the start of the step), the forward, the
padding to ``step_ms`` (before the backward, as ``--pad-at forward``), then the backward and the
update. resilient and torchrun run the example itself; the peers run this, so every system trains
the same thing.

Each completed step appends ``{"t", "step", "rank", "pid", ...}`` to the progress file (the
example's ``--progress`` lines); other records carry an ``event`` key instead of ``step``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from chaos import append_line

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    """examples/train_tiny.py as a module (examples/ is no package; its main() is not run)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train_tiny = _example()


@dataclass
class Workload:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: Any  # train_tiny.Tokens


def build(rank: int, steps: int) -> Workload:
    """What the example's train() builds, with the same seeds and hyper-parameters."""
    torch.manual_seed(0)
    model = train_tiny.TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    return Workload(model, opt, sched, train_tiny.Tokens(seed=1000 + rank))


def padded_loss(
    module: torch.nn.Module, wl: Workload, step_ms: float, fire: Callable[[], None]
) -> torch.Tensor:
    """The step up to its backward: the batch, the planned fault, the forward, the padding."""
    t0 = time.perf_counter()
    x, y = wl.data.next()
    fire()
    logits = module(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    time.sleep(max(0.0, step_ms / 1e3 - (time.perf_counter() - t0)))
    return loss


def progress(path: Path, **record: Any) -> None:
    append_line(path, {"t": time.time(), "pid": os.getpid(), **record})
