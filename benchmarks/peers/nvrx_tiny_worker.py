"""A rank of the NVRx in-process peer of benchmarks/work_lost_peers.py (NVRx 0.4.1, CPU, gloo).

The pattern of benchmarks/peers/nvrx_inprocess.py (NVRx's "optimal" usage) on the shared workload
(benchmarks/peers/tiny_workload.py): the model, optimizer, schedule and data stream are built once
outside ``inprocess.Wrapper`` and survive its restarts, so a restarted function resumes at the
step counter it keeps in memory; each iteration builds its gloo group on a fresh prefix of one
application TCPStore. The driver starts the ranks itself with the rendezvous in the environment
(``MASTER_ADDR``/``MASTER_PORT`` for the application store, ``NVRX_STORE_PORT`` for NVRx's own,
``RANK``, ``WORLD_SIZE``). Nothing relaunches a dead process: NVRx's default rank assignment
(``ShiftRanks``) restarts the survivors as a smaller world.

Besides the step lines, the Wrapper's abort (the first thing NVRx runs on a rank once it has seen
a fault) appends ``{"event": "abort"}``: the driver's detection time. Step lines carry ``rank`` =
the rank this process started as and ``world`` = the world it trains in now.
"""

# (no `from __future__ import annotations`, nor parameterized generics in train()'s signature: NVRx
# finds its CallWrapper parameter by issubclass() on every evaluated annotation)
import argparse
import datetime
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import nvidia_resiliency_ext.inprocess as inprocess  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.tiny_workload import Workload, build, padded_loss, progress  # noqa: E402
from chaos import Injector  # noqa: E402

S = datetime.timedelta


class RecordedAbort(inprocess.abort.Abort):
    """NVRx's stock abort, after a line saying when this rank's Wrapper acted on a fault."""

    def __init__(self, path: Path, rank: int) -> None:
        self.inner, self.path, self.rank = inprocess.abort.AbortTorchDistributed(), path, rank

    def __call__(self, state: Any) -> Any:
        progress(self.path, event="abort", rank=self.rank)
        return self.inner(state)


def wrapper(args: argparse.Namespace, rank: int) -> inprocess.Wrapper:
    """NVRx's Wrapper at its defaults, but for what every system of the benchmark shares: the hang
    timeout (soft progress and heartbeat timeouts = ``--timeout``, the hard one twice that, as
    NVRx needs soft < hard), the store's port, and the abort, its default wrapped to say when it
    ran."""
    t = args.timeout
    return inprocess.Wrapper(
        store_kwargs={"host_name": "127.0.0.1", "port": int(os.environ["NVRX_STORE_PORT"])},
        abort=RecordedAbort(args.progress, rank),
        soft_timeout=S(seconds=t),
        hard_timeout=S(seconds=2 * t),
        heartbeat_timeout=S(seconds=t),
        monitor_process_logfile=str(args.progress.parent / "nvrx_monitor_{rank}.log"),
    )


# NVRx injects its CallWrapper into the parameter annotated Optional[CallWrapper] (its documented form)
def train(
    app_store: dist.Store,
    wl: Workload,
    injector: Injector,
    st: dict,
    args: argparse.Namespace,
    call_wrapper: Optional[inprocess.CallWrapper] = None,  # noqa: UP045
) -> None:
    assert call_wrapper is not None
    rank, world, me = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), st["rank0"]
    wl.data.load_state_dict(st["data"])  # (the interrupted step draws its batch again)
    store = dist.PrefixStore(f"iter{call_wrapper.iteration}", app_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=S(seconds=args.timeout))
    ddp = torch.nn.parallel.DistributedDataParallel(wl.model)
    loss = None
    try:
        while st["step"] < args.steps:
            step = st["step"]
            loss = padded_loss(ddp, wl, args.step_ms, lambda: injector.maybe_fire(me, step))  # noqa: B023
            wl.opt.zero_grad(set_to_none=True)
            loss.backward()
            wl.opt.step()
            wl.sched.step()
            st["step"], st["data"] = step + 1, wl.data.state_dict()
            progress(args.progress, step=step, rank=me, world=world)
        dist.barrier()
    finally:
        # gloo cannot abort a collective in flight: this rank's sockets close only when its group
        # is freed, and freeing it while a gloo thread still needs the GIL deadlocks (see
        # nvrx_inprocess.py), so a faulted rank yields the GIL briefly, then drops DDP, also from
        # the frames of the exception's traceback (padded_loss holds it there)
        if sys.exc_info()[0] is not None:
            time.sleep(0.05)
            traceback.clear_frames(sys.exc_info()[2])
        del ddp, loss
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--fault", default="", help="chaos plan, kind@step:rank")
    p.add_argument("--timeout", type=float, default=5.0, help="soft progress and heartbeat timeout, s")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    wl = build(rank, args.steps)
    app_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, S(seconds=30),
        multi_tenant=True, use_libuv=True,
    )  # fmt: skip
    st = {"step": 0, "rank0": rank, "data": wl.data.state_dict()}
    wrapper(args, rank)(train)(app_store, wl, Injector.parse(args.fault), st, args)


if __name__ == "__main__":
    main()
