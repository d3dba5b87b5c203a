"""Peer benchmark: NVIDIA Resiliency Extension (NVRx) in-process restart on CPU/gloo.

What it measures
----------------
N ranks (separate processes launched by this script, env-var rendezvous the way NVRx's
``examples/inprocess/optimal_example.py`` expects) train a tiny DDP MLP with the gloo backend.
The training loop is wrapped in ``nvidia_resiliency_ext.inprocess.Wrapper``; model, optimizer and
the application TCPStore are created once outside it and survive restarts (NVRx's "optimal" usage),
so the restarted loop resumes from the in-memory step counter.

At ``--fault-step`` rank ``--fault-rank`` raises a Python exception after the forward pass and
before backward (first attempt only, tracked with a marker file). The other ranks are then blocked
in DDP's gradient all-reduce. NVRx detects the fault through its store, runs its ``abort`` hook
(destroy_process_group) on every rank, interrupts the main threads with an async exception and
restarts the wrapped function, which re-creates the gloo process group and DDP.

gloo caveat: nothing in torch 2.13 aborts a gloo collective already in flight (NVRx's abort only
handles NCCL; ProcessGroupGloo.abort()/shutdown() do not wake a pending recv). Blocked peers are
released only when the faulting rank's gloo sockets close, i.e. when its PG object is freed, so
train() drops its DDP (the PG's last owner) on the way out; otherwise peers wait the gloo timeout
(``--pg-timeout``, measured ~5.3 s with 5 s). See the comment in train() for a deadlock avoided there.

``fault_to_next_step_s`` (per rank) = time.time() at the first optimizer step completed after the
restart on that rank minus time.time() at the raise on the fault rank (same host, same clock).
``fault_free_step_ms`` = median wall time of the steps before the fault (step 0 excluded), i.e.
compute plus the ``--step-ms`` sleep padding. ``breakdown_s`` splits the latency (median over
ranks): fault -> wrapped fn re-entered -> gloo PG up -> DDP rebuilt -> first step done. With
``--repeat K`` the per-rank values and ``median_s`` are medians over finished trials.

Workload (identical to our own benchmark): torch.manual_seed(0); Linear(32,64)-ReLU-Linear(64,64)-
ReLU-Linear(64,8); AdamW(lr=1e-3); per step data from Generator().manual_seed(1000*rank+step):
x=randn(16,32), y=randn(16,8); MSE loss.

Usage: python benchmarks/peers/nvrx_inprocess.py --nproc 2 --repeat 3
Prints one JSON line on stdout; per-trial lines and diagnostics go to stderr.
"""

import argparse
import contextlib
import datetime
import faulthandler
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import nvidia_resiliency_ext.inprocess as inprocess  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

S = datetime.timedelta
# Wrapper timing knobs (seconds). NVRx requires soft < hard < barrier, every interval < soft, and
# heartbeat_interval < heartbeat_timeout < barrier. Defaults are 60/90/120 s, 1 s intervals and
# last_call_wait 1 s; these are shortened for a single host but leave room for 4 ranks on 2 cores.
TIMEOUTS = {
    "soft_timeout": 5,  # no progress for 5 s -> monitor process flags an interruption (restart)
    "hard_timeout": 10,  # no progress for 10 s -> monitor process SIGTERMs the rank
    "barrier_timeout": 30,  # NVRx store barriers between restart iterations
    "completion_timeout": 30,
    "heartbeat_timeout": 5,  # sibling monitor: a rank silent for 5 s is declared dead
    "heartbeat_interval": 0.5,
    "monitor_thread_interval": 0.5,
    "monitor_process_interval": 0.5,
    "progress_watchdog_interval": 0.5,
    "termination_grace_time": 2,  # SIGTERM -> SIGKILL
}


def make_wrapper(args, out_dir):
    return inprocess.Wrapper(
        store_factory=inprocess.store.TCPStore,
        store_kwargs={
            "host_name": "127.0.0.1",
            "port": int(os.environ["NVRX_STORE_PORT"]),
            "timeout": S(seconds=30),
        },
        initialize=inprocess.initialize.RetryController(max_iterations=3),
        # stock abort: destroy_process_group(); its NCCL-only abort step is a no-op for gloo (the
        # backend looked up for 'cuda' is the gloo one) and needs no GPU. It cannot interrupt a
        # gloo collective already in flight; gloo's abort()/shutdown() can't either (torch 2.13).
        abort=inprocess.abort.AbortTorchDistributed(),
        finalize=None,  # nothing rank-local to tear down besides the PG (done by abort)
        health_check=inprocess.health_check.FaultCounter(max_rank_faults=2),  # no CUDA checks
        last_call_wait=S(seconds=args.last_call_wait),  # wait for concurrent faults before abort
        **{k: S(seconds=v) for k, v in TIMEOUTS.items()},
        monitor_process_logfile=os.path.join(out_dir, "monitor_{rank}.log"),
    )


# NVRx injects its CallWrapper into the parameter annotated Optional[CallWrapper] (its documented form)
def train(app_store, model, opt, st, args, call_wrapper: Optional[inprocess.CallWrapper] = None):  # noqa: UP045
    it, t_enter = call_wrapper.iteration, time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = args.out_dir
    if it == 0:  # the monitor daemon setsid()s out of our process group; let the parent reap it
        with open(os.path.join(out, f"monitor_pid_{st['rank0']}"), "w") as f:
            json.dump(call_wrapper.monitor_process.process_monitor_proc.pid, f)
    store = dist.PrefixStore(f"iter{it}", app_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=S(seconds=args.pg_timeout)
    )
    t_pg = time.time()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    t_ddp = time.time()
    marker, loss = os.path.join(out, "fault_injected"), None
    try:
        while st["step"] < args.steps:
            step, t0 = st["step"], time.time()
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if step == args.fault_step and rank == args.fault_rank and not os.path.exists(marker):
                with open(marker, "w") as f:
                    json.dump(time.time(), f)
                raise RuntimeError(f"injected fault at step {step} on rank {rank}")
            loss.backward()
            opt.step()
            t1 = time.time()
            st["step"] = step + 1
            if it > 0 and "resume_t" not in st:
                st["resume_t"] = t1
                with open(os.path.join(out, f"resume_{st['rank0']}"), "w") as f:
                    json.dump({"enter": t_enter, "pg": t_pg, "ddp": t_ddp, "step": t1}, f)
            time.sleep(max(0.0, args.step_ms / 1000 - (time.time() - t0)))
            if it == 0 and step > 0:
                st["durations"].append(time.time() - t0)
        dist.barrier()
    finally:
        # On a fault, drop DDP (it holds the last ref to the gloo PG that NVRx's abort already
        # destroyed) right here, so this rank's gloo sockets close and peers blocked in a
        # collective fail fast instead of waiting out the gloo timeout; this also removes DDP's
        # autograd hooks before the restart wraps the same model again. Sleep first, releasing
        # the GIL: a gloo worker thread finishing a failed collective needs the GIL to free its
        # work object, and ~ProcessGroupGloo joins that thread while holding the GIL, so freeing
        # the PG too early deadlocks (seen with torch 2.13; the rank is then hard-timeout killed).
        if sys.exc_info()[0] is not None:
            time.sleep(args.drop_grace)
        ddp = loss = None
    dist.destroy_process_group()


def worker(args):
    rank = int(os.environ["RANK"])
    # NVRx's hard timeout SIGTERMs a stuck rank: dump every thread's stack first (diagnostics)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s",
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lin, relu = torch.nn.Linear, torch.nn.ReLU
    model = torch.nn.Sequential(lin(32, 64), relu(), lin(64, 64), relu(), lin(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # application store (created once, reused by every restart through a per-iteration prefix)
    addr, port, world = (
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
    )
    app_store = dist.TCPStore(addr, port, world, rank == 0, S(seconds=30), multi_tenant=True, use_libuv=True)
    st = {"step": 0, "durations": [], "rank0": rank}
    try:
        make_wrapper(args, args.out_dir)(train)(app_store, model, opt, st, args)
    finally:
        with open(os.path.join(args.out_dir, f"rank_{rank}.json"), "w") as f:
            json.dump({"steps": st["step"], "durations": st["durations"]}, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_trial(args, trial):
    out = tempfile.mkdtemp(prefix=f"nvrx_trial{trial}_")
    port, store_port = free_port(), free_port()
    procs, logs, start = [], [], time.time()
    for r in range(args.nproc):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(args.nproc),
            NVRX_STORE_PORT=str(store_port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore::FutureWarning",
        )
        log = open(os.path.join(out, f"rank_{r}.out"), "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", "--out-dir", out],
                env=env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    deadline = start + args.trial_timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    wall = time.time() - start
    timed_out = any(p.poll() is None for p in procs)
    for p in procs:  # each rank leads its own session: kill it and any forked helpers
        kill_group(p.pid)
        p.wait()
    for r in range(args.nproc):  # NVRx monitor daemons live in their own session
        pid = read_json(os.path.join(out, f"monitor_pid_{r}"))
        try:
            proc = psutil.Process(int(pid)) if pid else None
            if proc and proc.create_time() >= start - 1:
                proc.kill()
                proc.wait(5)
        except psutil.Error:
            pass
    for log in logs:
        log.close()
    fault_t = read_json(os.path.join(out, "fault_injected"))
    resumes = [read_json(os.path.join(out, f"resume_{r}")) for r in range(args.nproc)]
    ranks = [
        read_json(os.path.join(out, f"rank_{r}.json"), {"steps": 0, "durations": []})
        for r in range(args.nproc)
    ]
    lat = [round(t["step"] - fault_t, 4) if t and fault_t else None for t in resumes]
    # where the time goes (median over ranks): fault -> wrapped fn re-entered -> gloo PG
    # re-initialised -> DDP rebuilt (param broadcast) -> first optimizer step done
    marks = [("restart", "enter"), ("pg_init", "pg"), ("ddp", "ddp"), ("first_step", "step")]
    phases = {}
    if fault_t and None not in resumes:
        prev = [fault_t] * args.nproc
        for name, key in marks:
            phases[name] = round(statistics.median(t[key] - p for t, p in zip(resumes, prev, strict=True)), 4)
            prev = [t[key] for t in resumes]
    steps = min(r["steps"] for r in ranks)
    finished = (
        not timed_out and all(p.returncode == 0 for p in procs) and steps == args.steps and None not in lat
    )
    durs = [d for r in ranks for d in r["durations"]]
    res = {
        "trial": trial,
        "fault_to_next_step_s": lat,
        "median_s": statistics.median(lat) if None not in lat else None,
        "steps_completed": steps,
        "finished": finished,
        "timed_out": timed_out,
        "returncodes": [p.returncode for p in procs],
        "trial_wall_s": round(wall, 2),
        "fault_free_step_ms": round(1000 * statistics.median(durs), 2) if durs else None,
        "breakdown_s": phases,
    }
    print(json.dumps(res), file=sys.stderr, flush=True)
    if finished and not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    else:
        print(f"trial {trial}: logs kept in {out}", file=sys.stderr)
        for r in range(args.nproc):
            with open(os.path.join(out, f"rank_{r}.out")) as f:
                tail = f.read()[-1500:]
            print(f"--- rank {r} output tail ---\n{tail}", file=sys.stderr)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--trial-timeout", type=float, default=120.0)
    p.add_argument("--pg-timeout", type=float, default=5.0, help="gloo process group timeout, s")
    p.add_argument("--last-call-wait", type=float, default=0.1, help="Wrapper last_call_wait, s")
    p.add_argument("--drop-grace", type=float, default=0.05, help="GIL-free sleep before freeing DDP, s")
    p.add_argument("--keep", action="store_true", help="keep per-trial log dirs")
    p.add_argument("--log-level", default="INFO", help="worker/NVRx logging level (logs in trial dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    trials = [run_trial(args, t) for t in range(args.repeat)]
    ok = [t for t in trials if t["finished"]]
    per_rank = (
        [statistics.median(t["fault_to_next_step_s"][r] for t in ok) for r in range(args.nproc)] if ok else []
    )
    ff = [t["fault_free_step_ms"] for t in trials if t["fault_free_step_ms"]]
    summary = {
        "peer": "nvrx-inprocess",
        "nproc": args.nproc,
        "fault_to_next_step_s": [round(v, 4) for v in per_rank],
        "median_s": round(statistics.median(t["median_s"] for t in ok), 4) if ok else None,
        "steps_completed": min(t["steps_completed"] for t in trials),
        "finished": len(ok) == len(trials),
        "fault_free_step_ms": round(statistics.median(ff), 2) if ff else None,
        "trials": len(trials),
        "trials_finished": len(ok),
        "breakdown_s": {
            k: round(statistics.median(t["breakdown_s"][k] for t in ok), 4)
            for k in (ok[0]["breakdown_s"] if ok else {})
        },
        "trial_wall_s": [t["trial_wall_s"] for t in trials],
        "config": {
            **TIMEOUTS,
            **{k: getattr(args, k) for k in ("pg_timeout", "last_call_wait", "drop_grace", "step_ms")},
            **{k: getattr(args, k) for k in ("steps", "fault_step", "fault_rank")},
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
