"""A rank of the NVRx ``ft_launcher`` peer of benchmarks/work_lost_peers.py (NVRx 0.4.1, CPU, gloo).

As NVRx's fault-tolerance docs set a workload up: ``ft_launcher`` starts the ranks (torchrun's
environment), each rank opens a ``RankMonitorClient`` once its process group is up
(``init_workload_monitoring``) and sends a heartbeat after every step; a rank silent for
``--ft-rank-heartbeat-timeout`` is killed by its monitor and the launcher restarts the whole group
(in-job restart), which resumes from the newest checkpoint. The workload is the shared one
(benchmarks/peers/tiny_workload.py: the example's model, data, optimizer, schedule, step order)
in DDP; its checkpoints are the example's ``--plain-ckpt dcp-async`` ones (``dcp.async_save``
every N steps): NVRx's own async checkpoint entry points need CUDA
(benchmarks/peers/nvrx_async_ckpt.py, caveat 1), so a CPU job cannot use them as documented.

Each completed step appends ``{"t", "step", "rank", "pid", "attempt"}`` to the progress file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.tiny_workload import build, padded_loss, progress, train_tiny  # noqa: E402
from chaos import Injector  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--fault", default="", help="chaos plan, kind@step:rank")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=5.0, help="the gloo group's timeout, s")
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    wl = build(rank, args.steps)
    ddp = torch.nn.parallel.DistributedDataParallel(wl.model)
    ckpt = train_tiny._PlainDcp(args.ckpt_dir, args.ckpt_every)
    ckpt.track(model=ddp, optimizer=wl.opt, scheduler=wl.sched, data=wl.data)
    injector = Injector.parse(args.fault)
    for step in ckpt.steps(args.steps):
        loss = padded_loss(ddp, wl, args.step_ms, lambda: injector.maybe_fire(rank, step))  # noqa: B023
        wl.opt.zero_grad(set_to_none=True)
        loss.backward()
        wl.opt.step()
        wl.sched.step()
        client.send_heartbeat()
        progress(args.progress, step=step, rank=rank, attempt=attempt)
        ckpt.completed(step)
    ckpt.close()
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
