"""Faults of the checkpoint disk: its newest checkpoint corrupted (the whole job restarted on it), or
the rank's writes to it throttled for a while."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from chaos.cgroup import blkio_cgroup, release_blkio
from chaos.faults.base import SLOW_STORAGE, ByHarness, Evidence

if TYPE_CHECKING:
    from chaos.runner import Runner
    from chaos.schedule import Planned


class CorruptCheckpoint(ByHarness):
    """Flip 64 bytes in the middle of the newest committed checkpoint's first shard (two must be
    committed), kill the whole job with its shared memory, start it again: the restart must read
    the disk, reject that checkpoint and load the one before."""

    name = "corrupt_checkpoint"
    summary = (
        "64 bytes flipped in the newest committed checkpoint, then the whole job killed and restarted: "
        "the previous checkpoint must load"
    )
    default_slo: ClassVar[Mapping[str, Any] | None] = {"previous_checkpoint_loads": True}
    breaks_checkpoint = True

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        from chaos.job import checkpoints
        from resilient.checkpoint.manifest import committed_steps

        ck = checkpoints(run.cert, run.cwd)
        while time.monotonic() < run.deadline and run.job.p.poll() is None:
            if ck.exists() and len(committed_steps(ck)) >= 2:
                break
            time.sleep(0.05)
        else:
            return None
        run.job.kill()
        newest = committed_steps(ck)[0]
        victim = sorted((ck / f"step-{newest:08d}").glob("rank*.bin"))[0]
        with open(victim, "r+b") as fh:
            fh.seek(os.path.getsize(victim) // 2)
            chunk = fh.read(64)
            fh.seek(-len(chunk), os.SEEK_CUR)
            fh.write(bytes(b ^ 0xFF for b in chunk))
        run.record(self.name, -1, newest, file=victim.name)
        run.restart()
        return None


class SlowDisk(ByHarness):
    """The rank's process and its children (the checkpoint writer) in a blkio cgroup that throttles
    their writes to the checkpoint disk, for ``duration`` seconds. No crash: a save waiting on the
    disk shows (``checkpoint_slow``), nothing restarts."""

    name = "slow_disk"
    summary = "the rank's checkpoint writes throttled to `arg` KiB/s for `duration` s"
    needs = ("root", "cgroup v1 blkio", "a block device")
    arg = "KiB/s"
    default_arg = 16.0
    default_slo: ClassVar[Mapping[str, Any] | None] = {"restarts_max": 0}  # a slow disk is no crash
    evidence: ClassVar[Evidence] = SLOW_STORAGE
    lasting = "disk throttled"

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        import psutil

        from chaos.job import checkpoints

        ck = checkpoints(run.cert, run.cwd)
        ck.mkdir(parents=True, exist_ok=True)
        bps = int((f.arg or self.default_arg or 0) * 1024)
        cg, why = blkio_cgroup(ck, bps)  # (the device is known once the directory exists)
        if cg is None:
            run.skipped.append(f"{self.name}: {why}")
            return None
        try:
            proc = psutil.Process(pid)
            for p in [proc.pid, *(c.pid for c in proc.children(recursive=True))]:  # writer children too
                (cg / "cgroup.procs").write_text(str(p))
            run.record(self.name, f.rank, done + 1, pid=pid, duration_s=f.duration, write_bps=bps)
            return run.lasts(f.duration)
        except psutil.NoSuchProcess:
            return None
        finally:
            release_blkio(cg)
