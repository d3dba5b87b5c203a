"""A lost node with a spare waiting: the spare's rank comes back from a survivor's memory, or from
the checkpoint on disk, side by side in one run.

Per trial: one c10d rendezvous on 127.0.0.1, two agents of `resilient launch` (one rank each) run
examples/train_tiny.py (DDP, gloo; ``--dim`` sets the model's size) and a third agent waits as a
spare. After rank 0 completed ``--kill-at`` steps, node 1 is lost: its agent and worker SIGKILLed,
its ``/dev/shm`` removed. The rendezvous admits the spare; then, by mode:

- memory: the lost rank's model and optimizer come from the survivor's shared-memory snapshot,
  sent over the new group and checked against the fingerprint the lost rank posted to the job's
  store; its RNG and data position from the store copy (``snapshot.store_copy_max_bytes``);
- checkpoint: the store copy off (``store_copy_max_bytes: 0``): nothing vouches for the
  survivor's copy, so every rank loads the newest checkpoint (every ``--ckpt-every`` steps);
- flushed (with ``--cascade``): the store copy off too, and ``checkpoint.flush_on_death``: node 1's
  agent wrote its dead worker's snapshots to the checkpoint directory before the node went, and
  the spare reads them back.

``--cascade``: node 1's worker dies first (SIGKILL), then, once its agent has seen the death (and,
in mode flushed, has flushed it), the whole node: a GPU failure that takes its node down. Its
agents run no standby there (a replacement on a failing node would not get far either).

Both modes snapshot every ``--snapshot-interval`` steps (1: what a job that wants a lost node to
re-run at most one step sets) and checkpoint every ``--ckpt-every``.

- torchrun (the peer, as its docs set up an elastic job): two ``torchrun --nnodes 1:2`` agents
  run the example without the runtime (``--plain``: torch.save + fsync every ``--ckpt-every``
  steps, a started worker loads the newest step every rank wrote); no spare: node 0's agent
  restarts its worker in a rendezvous of the one node left, at world size 1, from the checkpoint.

The spare arrives once the job runs, so it parks (its standby in the script) and takes the lost
node's seat: in mode memory the survivor keeps its process (``survivor_kept``); in mode
checkpoint nothing vouches for the lost rank's state in memory and the group restarts.

Figures, from the nodes' event logs: ``recovery_s`` (the kill → every rank completed a step after
its restore),
``catchup_s`` (the kill → rank 0 completed again the last step it had completed before the kill),
``restore_s`` (the restore itself, the slowest rank), ``rerun`` (steps done again: the last step
rank 0 completed before the kill, + 1, - the step restored), and where the spare's state came from.

    python benchmarks/lost_node.py [--trials 5] [--dim 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import results  # noqa: E402
from chaos.harness import free_port  # noqa: E402
from resilient.events import Event  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
MODES = ("memory", "checkpoint", "torchrun")
CASCADE_MODES = ("memory", "flushed", "checkpoint")
RDZV_FAST = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1"
# torchrun's first round must hold both agents (a node joining a running job makes torchrun
# restart every worker, and on torch 2.13 that scale-up timed out on its role keys): 3 s of last
# call, which its re-rendezvous after the loss waits too (torch's default is 30 s)
RDZV_TORCHRUN = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"


class Node:
    def __init__(self, cwd: Path, argv: list[str]) -> None:
        cwd.mkdir(parents=True)
        self.cwd = cwd
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(cwd)}
        env.pop("RESILIENT_RUN_ID", None)
        with open(cwd / "launch.log", "w") as log:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "resilient.cli", "launch", *argv],
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for f in (self.cwd / "resilient_runs").glob("*/events.jsonl"):
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError):  # (a line being written)
                    out.append(json.loads(line))
        return out

    def kill(self, rdzv_id: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        for e in self.events():  # workers run in sessions of their own
            if e["event"] == Event.RUN_STARTED and e.get("pid"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(e["pid"], signal.SIGKILL)
        for leftover in Path("/dev/shm").glob(f"resilient-*{rdzv_id}-{self.p.pid}"):  # snapshots, heartbeats
            shutil.rmtree(leftover, ignore_errors=True)


def _wait(what: str, fn: Any, timeout: float, nodes: list[Node]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # polls files other processes append to
        got = fn()
        if got:
            return got
        for n in nodes:
            if n.p.poll() is not None:
                raise RuntimeError(f"{n.cwd.name} exited {n.p.returncode} waiting for {what}")
        time.sleep(0.05)
    raise TimeoutError(what)


def trial(mode: str, cwd: Path, args: argparse.Namespace) -> dict[str, Any]:
    rdzv_id = f"lost{os.getpid()}{cwd.name}"
    port = free_port()
    cfg = cwd / "cfg.yaml"
    cwd.mkdir(parents=True)
    interval = args.snapshot_interval
    snapshot: dict[str, Any] = {"interval": int(interval) if interval.isdigit() else interval}
    if mode in ("checkpoint", "flushed"):
        snapshot["store_copy_max_bytes"] = 0
    sections: dict[str, Any] = {"events": {"steps": True}, "snapshot": snapshot}
    if mode == "flushed":
        sections["checkpoint"] = {"flush_on_death": True}
    cfg.write_text(yaml.safe_dump(sections))
    standby = ("--standby", "0") if args.cascade else ()
    argv = [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        "--heartbeat-timeout",
        "30",
        "--rdzv-conf",
        RDZV_FAST,
        *standby,
        EXAMPLE,
        "--steps",
        str(args.steps),
        "--dim",
        str(args.dim),
        "--config",
        str(cfg),
        "--ckpt-dir",
        str(cwd / "ck"),
        "--ckpt-every",
        str(args.ckpt_every),
    ]
    nodes: list[Node] = []
    out: dict[str, Any] = {"mode": mode, "recovered": False}

    def steps_of(node: Node, rank: int, after: float = 0.0) -> list[dict[str, Any]]:
        return [
            e
            for e in node.events()
            if e["event"] == Event.STEP_COMPLETED and e["rank"] == rank and e["ts"] > after
        ]

    try:
        nodes.append(Node(cwd / "node0", argv))

        def store_up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return True
            return False

        _wait("node 0's rendezvous store", store_up, 60, nodes)
        nodes.append(Node(cwd / "node1", argv))
        _wait("rank 0 stepping", lambda: steps_of(nodes[0], 0), 120, nodes)
        if not any(e["event"] == Event.RUN_STARTED and e["rank"] == 1 for e in nodes[1].events()):
            out["error"] = "node 1 does not hold rank 1"
            return out
        nodes.append(Node(cwd / "spare", argv))

        def spare_ready() -> bool:
            said = {e["event"] for e in nodes[2].events()}
            return Event.SPARE_PARKED in said and (args.cascade or Event.STANDBY_READY in said)

        _wait("the spare parked, its standby ready", spare_ready, 120, nodes)
        pid0 = next(e["pid"] for e in nodes[0].events() if e["event"] == Event.RUN_STARTED and e["rank"] == 0)
        last = _wait(
            f"rank 0 at step {args.kill_at}",
            lambda: [e for e in steps_of(nodes[0], 0) if e["step"] >= args.kill_at],
            300,
            nodes,
        )
        t_kill = time.time()
        if args.cascade:
            worker = next(
                e["pid"] for e in nodes[1].events() if e["event"] == Event.RUN_STARTED and e["rank"] == 1
            )
            os.kill(worker, signal.SIGKILL)
            seen = Event.SNAPSHOT_FLUSHED if mode == "flushed" else Event.WORKER_DIED
            said = _wait(
                f"node 1's agent: {seen.value}",
                lambda: [e for e in nodes[1].events() if e["event"] == seen],
                60,
                nodes,
            )
            out["flush"] = {k: said[0].get(k) for k in ("steps", "nbytes", "duration_s", "gb_per_s", "error")}
        nodes[1].kill(rdzv_id)
        done_before = max(e["step"] for e in steps_of(nodes[0], 0) if e["ts"] <= t_kill)
        survivors = [nodes[0], nodes[2]]

        def restored() -> list[dict[str, Any]] | None:
            got = [
                e
                for n in survivors
                for e in n.events()
                if e["event"] == Event.STATE_RESTORED and e["ts"] > t_kill
            ]
            return got if len(got) == 2 else None

        def stepping() -> list[float] | None:
            got = restored()
            if got is None:
                return None
            firsts = []
            for n, e in ((n, e) for n in survivors for e in got if e in n.events()):
                after = steps_of(n, e["rank"], e["ts"])
                if not after:
                    return None
                firsts.append(min(x["ts"] for x in after))
            return firsts if len(firsts) == 2 else None

        firsts = _wait("every rank stepping after the restore", stepping, args.timeout, survivors)
        got = restored() or []
        t_restored = min(e["ts"] for e in got)

        def back() -> list[float]:
            return [e["ts"] for e in steps_of(nodes[0], 0, t_restored) if e["step"] >= done_before]

        again = _wait(f"rank 0 back at step {done_before}", back, args.timeout, survivors)
        spare = next(e for e in got if e in nodes[2].events())
        out.update(
            recovered=True,
            recovery_s=max(firsts) - t_kill,
            catchup_s=min(again) - t_kill,
            killed_after=last[0]["step"],
            # (an in-process restore's time is its load; a restarted worker's, its duration)
            restore_s=max(e.get("duration_s", e.get("load_s", 0.0)) for e in got),
            restored_step=got[0]["step"],
            rerun=done_before + 1 - got[0]["step"],
            source=Path(spare["source"]).name,  # (a checkpoint's dir)
            spare_sources=spare.get("sources", {}),
            survivor_kept=pid0 == next(e["pid"] for e in got if e in nodes[0].events()),
            seat=next((e for e in nodes[2].events() if e["event"] == Event.SEAT_TAKEN), None),
        )
        return out
    except (TimeoutError, RuntimeError) as e:
        out["error"] = str(e)
        return out
    finally:
        for n in nodes:
            n.kill(rdzv_id)


def torchrun_trial(cwd: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The peer, as torchrun's docs set up an elastic job: two ``torchrun --nnodes 1:2`` agents on
    a c10d rendezvous run the example without the runtime (``--plain``: every rank torch.saves
    and fsyncs its state every ``--ckpt-every`` steps; a started worker loads the newest step
    every rank wrote). Node 1 is lost (agent and worker SIGKILLed); node 0's agent restarts its
    worker in a rendezvous of the one node left, which resumes from the checkpoint at world 1."""
    rdzv_id = f"lostrun{os.getpid()}{cwd.name}"
    port = free_port()
    cwd.mkdir(parents=True)
    progress = cwd / "progress.jsonl"
    argv = [
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id),
        *("--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2", "--monitor-interval", "0.2"),
        *("--rdzv-conf", RDZV_TORCHRUN, EXAMPLE, "--plain"),
        *("--steps", str(args.steps), "--dim", str(args.dim)),
        *("--hang-timeout", "2", "--ckpt-dir", str(cwd / "ck"), "--ckpt-every", str(args.ckpt_every)),
        *("--progress", str(progress)),
    ]
    out: dict[str, Any] = {"mode": "torchrun", "recovered": False}
    nodes: list[subprocess.Popen[bytes]] = []

    def lines() -> list[dict[str, Any]]:
        got = []
        with contextlib.suppress(FileNotFoundError):
            for line in progress.read_text().splitlines():
                with contextlib.suppress(ValueError):  # (a line being written)
                    got.append(json.loads(line))
        return [e for e in got if "step" in e]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        for i in range(2):
            with open(cwd / f"node{i}.log", "w") as log:
                nodes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", *argv],
                        cwd=cwd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if i == 0:  # (node 0 hosts the rendezvous store: node 1 is the one lost)
                _wait_lines("node 0's store", lambda: [{"up": 1}] if _listening(port) else [], bool, nodes)
        at = _wait_lines(f"rank 0 at step {args.kill_at}", lines, lambda e: e["step"] >= args.kill_at, nodes)
        worker1 = next(e["pid"] for e in lines() if e["rank"] == 1)
        t_kill = time.time()
        for pgid in (nodes[1].pid, worker1):  # (its workers run in sessions of their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        nodes[1].wait()
        done_before = max(e["step"] for e in lines() if e["rank"] == 0 and e["t"] <= t_kill)
        nodes = nodes[:1]
        first = _wait_lines(
            "rank 0 stepping again", lines, lambda e: e["t"] > t_kill and e["attempt"] > 0, nodes
        )
        again = _wait_lines(
            f"rank 0 back at step {done_before}",
            lines,
            lambda e: e["t"] > t_kill and e["attempt"] > 0 and e["step"] >= done_before,
            nodes,
        )
        restarted = min(e["step"] for e in lines() if e["t"] > t_kill and e["attempt"] > 0)
        out.update(
            recovered=True,
            recovery_s=first[0]["t"] - t_kill,
            catchup_s=again[0]["t"] - t_kill,
            killed_after=at[0]["step"],
            restored_step=restarted,
            rerun=done_before + 1 - restarted,
            world_after=1,
            survivor_kept=False,
        )
        return out
    except (TimeoutError, RuntimeError) as e:
        out["error"] = str(e)
        return out
    finally:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for e in lines():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(e["pid"], signal.SIGKILL)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def _wait_lines(
    what: str, lines: Any, match: Any, nodes: list[subprocess.Popen[bytes]]
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # polls a file other processes append to
        got = [e for e in lines() if match(e)]
        if got:
            return got
        if all(p.poll() is not None for p in nodes):
            raise RuntimeError(f"every agent exited waiting for {what}")
        time.sleep(0.05)
    raise TimeoutError(what)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024, help="train_tiny's model width (1024: ~290 MB of state)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--snapshot-interval", default="1", help="snapshot.interval (both modes): N or auto")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--modes", default=None, help="comma-separated subset of " + ", ".join(CASCADE_MODES))
    ap.add_argument("--cascade", action="store_true", help="node 1's worker dies first, then the node")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lost_node.json")
    args = ap.parse_args()
    modes = tuple(args.modes.split(",")) if args.modes else CASCADE_MODES if args.cascade else MODES
    if "flushed" in modes and not args.cascade:
        ap.error("mode flushed needs --cascade (an agent flushes a dead worker's snapshots, not its own)")
    st = results.begin(trials=args.trials)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        for t in range(args.trials):
            for mode in modes:  # alternating: a slow minute of the machine hits both alike
                run = torchrun_trial if mode == "torchrun" else lambda c, a, m=mode: trial(m, c, a)
                r = run(Path(d) / f"{mode}{t}", args)
                rows.append(r)
                print(json.dumps(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, rows, st)
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and r["recovered"]]
        n = sum(r["mode"] == mode for r in rows)
        if not ok:
            print(f"{mode:10s} recovered 0/{n}")
            continue

        def med(key: str, rs: list[dict[str, Any]] = ok) -> float:
            return statistics.median(r[key] for r in rs)

        rerun = f"steps re-run {med('rerun'):.0f} (max {max(r['rerun'] for r in ok)})"
        restore = f"  restore {med('restore_s'):.2f} s" if all("restore_s" in r for r in ok) else ""
        print(
            f"{mode:10s} recovered {len(ok)}/{n}  recovery {med('recovery_s'):.2f} s  back at the step "
            f"{med('catchup_s'):.2f} s{restore}  {rerun}"
        )


if __name__ == "__main__":
    main()
