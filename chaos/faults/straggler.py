"""A straggler: one rank slowed to about ``arg``× its step time from a step on, for good.

Where the machine allows it (root, the cgroup v1 ``cpu`` controller), the harness moves the rank's
process into a cgroup whose CFS quota is ``1/arg`` of the CPU the rank was using just before: the
kernel really throttles it, as a noisy neighbour or a CPU-starved host would (the job must be
CPU-bound for it to show: the bundled example with ``--step-ms 0`` and a wider ``--dim``).
Elsewhere the rank sleeps in its model's forward ``arg - 1`` times as long as the forward took
(the injection record names why the cgroup was not used). Nothing crashes: the runtime's straggler
check reports it (``straggler_detected``), and with ``straggler.action: replace`` under
``resilient launch`` a standby takes the rank; the replacement is outside the cgroup and fires
nothing (a fault fires once per job)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loguru import logger

from chaos.cgroup import cpu_cgroup, release_blkio, set_cpu_quota
from chaos.faults.base import Arrangement, Evidence, InProcess, Undo
from resilient.events import Event

if TYPE_CHECKING:
    from chaos.inject import Fault
    from chaos.runner import Runner
    from chaos.schedule import Planned

STRAGGLER = Evidence("straggler", (Event.STRAGGLER_DETECTED,), False)


def _throttled() -> bool:
    """Whether the harness put this process into its cpu cgroup (it sets the quota there)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return False
    return any("cpu" in c.split(",") and "/chaos-cpu-" in p for _, c, p in (ln.split(":", 2) for ln in lines))


class Straggler(InProcess):
    name = "straggler"
    summary = (
        "the rank slowed to ~`arg`× its step time from the step on, for good: a CPU quota of 1/`arg` "
        "of its use (cgroup v1 cpu, root), else a sleep in its forward"
    )
    needs = ()  # (the cgroup where available; the sleep otherwise, never skipped)
    arg = "slowdown factor"
    default_arg = 2.0
    default_slo: ClassVar[Mapping[str, Any] | None] = {"detect_s": 30.0, "detect_rank": True}
    evidence: ClassVar[Evidence] = STRAGGLER
    harness_lead: ClassVar[int | None] = 3  # into the cgroup before the step (its quota set then)
    streams = False

    def check_arg(self, arg: float | None) -> str | None:
        return None if arg is None or arg > 1 else "the slowdown factor must be > 1"

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        cg, why = cpu_cgroup()
        if cg is None:
            logger.warning("straggler: the rank sleeps in its forward (no CPU quota: {})", why)
            return None
        setup.cpucg = cg
        setup.stack.callback(release_blkio, cg)
        return None

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        import psutil

        cg = run.arrangement.cpucg
        if cg is None:
            return None  # (the rank sleeps instead, in-process)
        proc = psutil.Process(pid)
        (cg / "cgroup.procs").write_text(str(pid))  # first: the injector then knows not to sleep
        proc.cpu_percent(interval=None)
        time.sleep(0.5)
        used = max(proc.cpu_percent(interval=None), 1.0) / 100  # CPUs it used just now
        quota = set_cpu_quota(cg, used / (f.arg or self.default_arg or 2.0))
        run.record(
            self.name, f.rank, done + 1, pid=pid, mode="cpu quota", used_cpus=round(used, 3), quota_us=quota
        )
        return None

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        if _throttled():
            return None  # the kernel slows it
        from resilient.detectors.stragglers import local_module

        factor = fault.arg or self.default_arg or 2.0
        module = next((m for m in map(local_module, objects) if m is not None), None)
        if module is None:
            raise RuntimeError("straggler injector: no module among the tracked objects to slow")
        began: list[float] = []
        module.register_forward_pre_hook(lambda m, a: began.append(time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o: time.sleep((factor - 1) * (time.perf_counter() - began.pop()))
        )
        return None
