"""Health checks run on every rank between fault detection and the rebuild of the group.

A check is any callable ``(HealthInput) -> CheckResult``. Built-ins: ``gpu`` (NVML, only when a
GPU is present — auto-detected, never forced), ``host_memory`` (available RAM), ``checkpoint_dir``
(writable, with free space: ``health.checkpoint_dir``, else ``checkpoint.dir``) and ``store`` (a
write read back). A failing check makes the rank exit with :attr:`ExitCode.HARD_FAULT` after a log
line naming the check and the value.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from resilient.config import BUILTIN_CHECKS, Config, HealthConfig


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    value: object
    detail: str = ""


@dataclass(frozen=True)
class HealthInput:
    """What a check is given. ``checkpoint_dir``: the directory the ``checkpoint_dir`` check
    looks at (:meth:`of` takes ``health.checkpoint_dir``, else ``checkpoint.dir``)."""

    rank: int
    generation: int
    store: dist.Store | None
    cfg: HealthConfig
    checkpoint_dir: Path | None = None

    @classmethod
    def of(cls, rank: int, generation: int, store: dist.Store | None, cfg: Config) -> HealthInput:
        return cls(rank, generation, store, cfg.health, cfg.health.checkpoint_dir or cfg.checkpoint.dir)


Check = Callable[[HealthInput], CheckResult]


def gpu(inp: HealthInput) -> CheckResult:
    """NVML query of the local GPU; skipped (ok) when no GPU is present."""
    if not torch.cuda.is_available():
        return CheckResult("gpu", True, "absent", "no GPU present; skipped")
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            idx = torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML itself failing is the finding
        return CheckResult("gpu", False, type(e).__name__, f"NVML query failed: {e}")
    return CheckResult("gpu", True, {"free_mb": mem.free // 2**20, "temp_c": temp})


def host_memory(inp: HealthInput) -> CheckResult:
    avail_mb = psutil.virtual_memory().available / 2**20
    ok = avail_mb >= inp.cfg.min_host_memory_mb
    return CheckResult(
        "host_memory", ok, f"{avail_mb:.0f} MB available", f"need >= {inp.cfg.min_host_memory_mb:g} MB"
    )


def checkpoint_dir(inp: HealthInput) -> CheckResult:
    d = inp.checkpoint_dir
    if d is None:
        return CheckResult("checkpoint_dir", True, None, "no checkpoint directory configured; skipped")
    path = Path(d)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".health-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        free_mb = shutil.disk_usage(path).free / 2**20
    except OSError as e:
        return CheckResult("checkpoint_dir", False, str(path), f"not writable: {e}")
    ok = free_mb >= inp.cfg.min_free_disk_mb
    return CheckResult(
        "checkpoint_dir", ok, f"{free_mb:.0f} MB free at {path}", f"need >= {inp.cfg.min_free_disk_mb:g} MB"
    )


def store(inp: HealthInput) -> CheckResult:
    if inp.store is None:
        return CheckResult("store", True, None, "no store; skipped")
    key = f"health/g{inp.generation}/r{inp.rank}"
    t0 = time.perf_counter()
    try:  # a write read back in one request (a set and a get are two: get waits for the key first)
        ok = inp.store.compare_set(key, "", "1") == b"1"
    except Exception as e:
        return CheckResult("store", False, type(e).__name__, f"store round trip failed: {e}")
    return CheckResult("store", ok, f"{(time.perf_counter() - t0) * 1e3:.1f} ms round trip")


# the built-ins by name: the config's list of names (it validates health.checks), each a function here
BUILTINS: dict[str, Check] = {name: globals()[name] for name in BUILTIN_CHECKS}


def run_checks(inp: HealthInput, extra: Sequence[Check] = ()) -> list[CheckResult]:
    """Run the configured built-ins then the user's checks; a check that raises counts as failed."""
    results = []
    for check in [BUILTINS[n] for n in inp.cfg.checks] + list(extra):
        name = getattr(check, "__name__", repr(check))
        try:
            results.append(check(inp))
        except Exception as e:
            results.append(CheckResult(name, False, type(e).__name__, f"check raised: {e}"))
    return results
