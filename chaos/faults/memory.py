"""Out of memory, three ways: the allocator refuses (host or GPU), or the kernel's OOM killer
SIGKILLs a rank that filled the memory cgroup the harness moved it into."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

import psutil

from chaos.cgroup import memory_cgroup, remove_cgroup
from chaos.faults.base import Arrangement, InProcess, Undo

if TYPE_CHECKING:
    from chaos.inject import Fault
    from chaos.runner import Runner
    from chaos.schedule import Planned

_OVERCOMMIT = "/proc/sys/vm/overcommit_memory"


def _overcommit_refused() -> str | None:
    """Why an over-sized allocation would not fail here: under ``vm.overcommit_memory=1`` the kernel
    grants it and the OOM killer strikes later instead."""
    try:
        with open(_OVERCOMMIT) as fh:
            mode = fh.read().strip()
    except OSError as e:
        return f"cannot read {_OVERCOMMIT}: {e.strerror or e}"
    return "oom injector needs vm.overcommit_memory != 1 (it is 1 here)" if mode == "1" else None


class HostOom(InProcess):
    name = "oom"
    summary = "an allocation 4× the machine's memory: the allocator fails for real"
    needs = ("vm.overcommit_memory ≠ 1",)

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        return _overcommit_refused()

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        import torch

        why = _overcommit_refused()
        if why is not None:  # refused, naming why: never a pretend allocation failure
            raise RuntimeError(why)
        too_much = int(psutil.virtual_memory().total * 4)
        torch.empty(too_much, dtype=torch.uint8).fill_(1)
        return None


def _gpu_missing() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "cuda_oom injector needs a GPU (none is present)"


class CudaOom(InProcess):
    name = "cuda_oom"
    summary = "an allocation 4× the GPU's memory: a real `torch.OutOfMemoryError`"
    needs = ("GPU",)

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        return _gpu_missing()

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        import torch

        why = _gpu_missing()
        if why is not None:
            raise RuntimeError(why)
        _free, total = torch.cuda.mem_get_info()
        torch.empty(int(total * 4), dtype=torch.uint8, device="cuda")
        return None


class KernelOom(InProcess):
    """The harness moves the rank into a memory cgroup a few steps before its step; the rank then
    touches memory until the kernel SIGKILLs it (refused outside a limit: it would take the whole
    machine's memory)."""

    kills = True
    name = "kernel_oom"
    summary = (
        "the rank, in a memory cgroup of `arg` MiB, fills memory until the kernel's OOM killer SIGKILLs it"
    )
    needs = ("root", "cgroup v1 memory")
    arg = "cgroup limit, MiB"
    default_arg = 700.0
    harness_lead: ClassVar[int | None] = 3  # into the cgroup a few steps before it allocates

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        mib = int(faults[0].arg or self.default_arg or 0)
        memcg, why = memory_cgroup(mib)
        if memcg is None:  # without the cgroup the injector would refuse: the faults are left out
            return why
        setup.memcg = memcg
        setup.stack.callback(remove_cgroup, memcg)
        return None

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        if run.arrangement.memcg is None:
            run.skipped.append("kernel_oom: no memory cgroup")
        else:
            (run.arrangement.memcg / "cgroup.procs").write_text(str(pid))  # the rank then allocates
        return None

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        limit = _cgroup_memory_limit()
        if limit is None or limit >= psutil.virtual_memory().total:
            raise RuntimeError("kernel_oom injector needs a memory-limited cgroup (this process has none)")
        hold = []
        while True:  # each chunk is written, so its pages are really charged to the cgroup
            chunk = bytearray(64 << 20)
            chunk[::4096] = b"\x01" * len(range(0, len(chunk), 4096))
            hold.append(chunk)


def _cgroup_memory_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()  # noqa: SIM115
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        elif controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup/unified{path}/memory.max"]
        else:
            continue
        for c in candidates:
            try:
                raw = open(c).read().strip()  # noqa: SIM115
            except OSError:
                continue
            if raw != "max":
                return int(raw)
    return None
