"""gloo abort ("free") and rebuild: the runtime's own paths against torch's core mechanisms.

For the torch this runs under, two ranks (subprocesses of this script, gloo over a TCPStore on
127.0.0.1) measure:

- free: a collective blocked in ``all_reduce`` of the default group (60 s group timeout) is
  aborted from another thread ~0.5 s after it blocked, either
  ``sockets`` (the project: ``pg.build_group`` + ``Group.abort()``, which shuts down gloo's TCP
  connections) or ``core`` (``dist.distributed_c10d._get_default_group().abort()``). ``local``: rank 1 is
  blocked and aborts its own group; ``peer``: rank 0 is blocked and rank 1 aborts its group.
  Measured: seconds from the abort call until the blocked ``all_reduce`` raises, or "never"
  within 20 s.
- rebuild, after every rank aborted: ``today`` (``dist.destroy_process_group()`` then
  ``init_process_group`` on the next ``PrefixStore`` generation, as ``build_group`` does) or
  ``reconfigure`` (torch 2.14+: exchange ``dist._get_reconfigure_handle()`` through the store,
  then ``dist._reconfigure(uuid=<fresh>, handles=[...]).wait()`` on the same group object), each
  verified by a real ``all_reduce`` that must sum to 3 on both ranks. Timed: the slower rank.

Run (any of the project's virtualenvs; ``--python`` runs it under each interpreter given, one
stamped result for all)::

    OMP_NUM_THREADS=1 python benchmarks/gloo_core_paths.py --trials 5 --out /tmp/gloo_core.json
    OMP_NUM_THREADS=1 python benchmarks/gloo_core_paths.py --python venv-a/bin/python venv-b/bin/python \
        --out benchmarks/results/gloo_core_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

NEVER_S = 20.0  # a blocked collective still blocked this long after the abort: "never"
DELAY_S = 0.5  # how long the collective is blocked before the abort
GROUP_TIMEOUT_S = 60.0  # well past NEVER_S, so gloo's own timeout never ends a collective
PAIR_LIMIT_S = 240.0  # one scenario's pair of workers, all trials

# (abort, side, rebuild): the free matrix rebuilds with today's path; reconfigure is tried
# after either abort (it reuses the aborted group object, so what the abort left matters).
# "idle": no collective is blocked, every rank aborts its group: the core abort leaves a
# blocked collective blocked, so only that way does a rebuild after it get measured.
SCENARIOS = [
    ("sockets", "local", "today"),
    ("sockets", "peer", "today"),
    ("sockets", "local", "reconfigure"),
    ("core", "local", "today"),
    ("core", "peer", "today"),
    ("core", "idle", "today"),
    ("core", "idle", "reconfigure"),
]


# ---------------------------------------------------------------- worker (one rank)


class Rank:
    """One rank's state across trials: the store, the current group and its generation."""

    def __init__(self, rank: int, port: int, abort_mode: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = rank
        self.port = port
        self.abort_mode = abort_mode
        self.store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        self.generation = 0
        self.group: Any = None  # the project's Group (sockets path)
        self.aborted = False

    def build(self) -> None:
        """Today's path: the default group on a fresh PrefixStore generation."""
        dist = self.dist
        if self.abort_mode == "sockets":
            from resilient.runtime.coordination import pg

            self.group = pg.build_group(
                backend="gloo",
                store=self.store,
                store_port=self.port,
                rank=self.rank,
                world_size=2,
                generation=self.generation,
                timeout=GROUP_TIMEOUT_S,
            )
        else:  # the same store layout as build_group, without recording connections
            prefixed = dist.PrefixStore(f"/g{self.generation}/pg", self.store)
            dist.init_process_group(
                "gloo",
                store=prefixed,
                rank=self.rank,
                world_size=2,
                timeout=timedelta(seconds=GROUP_TIMEOUT_S),
            )
        self.aborted = False

    def abort(self) -> None:
        if self.abort_mode == "sockets":
            self.group.abort()
        elif not self.aborted:  # (a second core abort of the same backend is not needed)
            self.dist.distributed_c10d._get_default_group().abort()
        self.aborted = True

    def destroy(self) -> None:
        if self.abort_mode == "sockets":
            self.group.destroy(abort=False)  # (aborted already)
        else:
            self.dist.destroy_process_group()

    def barrier(self, key: str) -> None:
        """Out of band: the group may be aborted, the store never is."""
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.wait([f"{key}/0", f"{key}/1"])

    def sum_ok(self) -> bool:
        import torch

        x = torch.ones(4) * (self.rank + 1)
        self.dist.all_reduce(x)
        return bool((x == 3).all())


def _emit(kind: str, **fields: Any) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def _watchdog(deadline: float, done: threading.Event, trial: int) -> None:
    """Ends this rank when the blocked collective outlives the abort by NEVER_S: the main
    thread cannot be reached any other way while gloo holds it."""
    if not done.wait(max(0.0, deadline - time.perf_counter())):
        _emit("TRIAL", trial=trial, free_s=None, error=f"still blocked {NEVER_S:.0f} s after the abort")
        os._exit(3)


def _aborter(r: Rank, trial: int) -> None:
    time.sleep(DELAY_S)
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes on one host
    r.abort()
    r.store.set(f"t{trial}/t0", repr(t0))
    r.store.set(f"t{trial}/abort_call", repr(time.perf_counter() - t0))


def free_trial(r: Rank, trial: int, side: str) -> dict[str, Any]:
    """Block one rank's all_reduce, abort from a thread; how long until it raises."""
    blocked = {"local": 1, "peer": 0}.get(side)
    out: dict[str, Any] = {}
    if side == "idle":
        t0 = time.perf_counter()
        r.abort()
        out["abort_call_s"] = time.perf_counter() - t0
        return out
    if r.rank == blocked:
        import torch

        if side == "local":
            threading.Thread(target=_aborter, args=(r, trial), daemon=True).start()
        else:
            r.store.set(f"t{trial}/entering", "1")
        done = threading.Event()
        deadline = time.perf_counter() + DELAY_S + NEVER_S + 1.0
        threading.Thread(target=_watchdog, args=(deadline, done, trial), daemon=True).start()
        try:
            r.dist.all_reduce(torch.ones(4))
            out["error"] = "all_reduce returned although the peer never joined"
        except Exception as e:
            t1 = time.perf_counter()
            done.set()
            t0 = float(r.store.get(f"t{trial}/t0"))
            out["free_s"] = t1 - t0
            out["raised"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        done.set()
    elif side == "peer":  # rank 1 aborts its own group while rank 0 is blocked
        r.store.wait([f"t{trial}/entering"])
        _aborter(r, trial)
    r.barrier(f"t{trial}/freed")
    if r.rank == 1:
        out["abort_call_s"] = float(r.store.get(f"t{trial}/abort_call"))
    r.abort()  # the runtime aborts every rank's group before it rebuilds
    return out


def rebuild_today(r: Rank) -> None:
    r.destroy()
    r.generation += 1
    r.build()


def rebuild_reconfigure(r: Rank, trial: int) -> None:
    dist = r.dist
    before = _socket_inodes() if r.abort_mode == "sockets" else {}
    r.store.set(f"t{trial}/h{r.rank}", dist._get_reconfigure_handle())
    handles = [r.store.get(f"t{trial}/h{i}").decode() for i in range(2)]
    # A fresh uuid per (re)initialization, the same on every rank.
    dist._reconfigure(uuid=trial + 1, handles=handles, timeout=timedelta(seconds=NEVER_S)).wait()
    r.aborted = False
    if r.abort_mode == "sockets":
        _rerecord(r, before)


def _socket_inodes() -> dict[int, str]:
    from resilient.runtime.coordination import pg

    return pg._socket_inodes()


def _rerecord(r: Rank, before: dict[int, str]) -> None:
    """The sockets path only knows connections opened by build_group; a reconfigured backend
    has new ones, so a later abort needs them recorded (a warm-up collective opens them)."""
    from resilient.runtime.coordination import pg

    r.sum_ok()
    after = _socket_inodes()
    new = {fd: ino for fd, ino in after.items() if before.get(fd) != ino}
    r.group = pg.Group(backend="gloo", generation=r.generation, store_port=r.port, _sockets=new)


def worker(rank: int, port: int, scenario: str, trials: int) -> None:
    abort_mode, side, rebuild = scenario.split("/")
    import torch

    r = Rank(rank, port, abort_mode)
    _emit("INFO", torch=torch.__version__)
    r.build()
    if not r.sum_ok():  # also opens gloo's connections before the sockets path records them
        _emit("TRIAL", trial=-1, error="the first group computed a wrong sum")
        return
    for trial in range(trials):
        r.barrier(f"t{trial}/start")
        out = free_trial(r, trial, side)
        r.barrier(f"t{trial}/rebuild")
        t = time.perf_counter()
        try:
            if rebuild == "today":
                rebuild_today(r)
            else:
                rebuild_reconfigure(r, trial)
            out["rebuild_s"] = time.perf_counter() - t
            out["sum_ok"] = r.sum_ok()
        except Exception as e:
            out["rebuild_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            _emit("TRIAL", trial=trial, **out)
            return
        _emit("TRIAL", trial=trial, **out)
    r.barrier("end")  # rank 0 hosts the store: it leaves last
    r.dist.destroy_process_group()


# ---------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections on loopback too
    env["PYTHONWARNINGS"] = "ignore"  # (pynvml's FutureWarning in the CUDA wheels)
    return env


def _parse(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        kind, _, body = line.partition(" ")
        if kind in ("TRIAL", "INFO"):
            rows.append({"kind": kind, **json.loads(body)})
    return rows


def run_pair(scenario: str, trials: int) -> list[list[dict[str, Any]]]:
    """Both ranks of one scenario; neither outlives this call."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(port), scenario, str(trials)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for rank in range(2)
    ]
    outs = ["", ""]
    try:
        _wait_pair(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        errs = ["", ""]
        for i, p in enumerate(procs):
            outs[i], errs[i] = p.communicate()
        # A rank whose peer gave up fails on the store: only a pair with no result says why.
        if not any("TRIAL" in out for out in outs):
            for i, p in enumerate(procs):
                sys.stderr.write(f"[{scenario} rank {i} rc={p.returncode}] {errs[i][-1500:]}\n")
    return [_parse(o) for o in outs]


def _wait_pair(procs: list[subprocess.Popen[str]]) -> None:
    """Until both exit; once one has, the other gets a short grace (it may wait on a store its
    peer hosted, or on a peer that gave up)."""
    end = time.monotonic() + PAIR_LIMIT_S
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        if any(p.poll() is not None for p in procs):
            end = min(end, time.monotonic() + 3.0)
        time.sleep(0.05)


def _stats(xs: list[float]) -> dict[str, Any] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(scenario: str, ranks: list[list[dict[str, Any]]], trials: int) -> dict[str, Any]:
    abort_mode, side, rebuild = scenario.split("/")
    blocked = {"local": 1, "peer": 0}.get(side)
    by_trial: dict[int, list[dict[str, Any]]] = {}
    for rows in ranks:
        for row in rows:
            if row["kind"] == "TRIAL":
                by_trial.setdefault(row["trial"], []).append(row)
    free, rebuilt, calls, errors, raised = [], [], [], [], None
    for trial, rows in sorted(by_trial.items()):
        for row in rows:
            if row.get("error") or row.get("rebuild_error"):
                errors.append(f"trial {trial}: {row.get('error') or row.get('rebuild_error')}")
            raised = raised or row.get("raised")
        calls += [row["abort_call_s"] for row in rows if "abort_call_s" in row]
        f = [row["free_s"] for row in rows if row.get("free_s") is not None]
        free += f
        rb = [row["rebuild_s"] for row in rows if "rebuild_s" in row]
        if len(rb) == 2 and all(row.get("sum_ok") for row in rows):
            rebuilt.append(max(rb))  # the slower rank: both must be ready
    never = any("still blocked" in e for e in errors)
    return {
        "abort": abort_mode,
        "side": side,
        "rebuild": rebuild,
        "blocked_rank": blocked,
        "free": _free_status(side, free, never),
        "free_s": _stats(free),
        "raised": raised,
        "abort_call_s": _stats(calls),  # how long the abort call itself took to return
        "rebuild_status": _rebuild_status(rebuilt, errors, never, trials),
        "rebuild_s": _stats(rebuilt),
        "errors": errors[:6],
    }


def _free_status(side: str, free: list[float], never: bool) -> str:
    if side == "idle":
        return "not measured (nothing blocked)"
    return "does not unblock" if never else ("works" if free else "failed")


def _rebuild_status(rebuilt: list[float], errors: list[str], never: bool, trials: int) -> str:
    if never and not rebuilt:
        return "not reached (the blocked collective never ended)"
    if any("AttributeError" in e for e in errors):
        return "unsupported"
    if len(rebuilt) == trials:
        return "works"
    return "failed" if not rebuilt else f"partial ({len(rebuilt)}/{trials})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--only", help="comma-separated scenarios, e.g. core/local/today")
    ap.add_argument("--python", nargs="+", help="run under each of these interpreters, one result for all")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        rank, port, scenario, trials = args.worker
        worker(int(rank), int(port), scenario, int(trials))
        return
    if args.python:
        _each_python(args)
        return
    wanted = set(args.only.split(",")) if args.only else None
    result: dict[str, Any] = {"python": platform.python_version(), "trials": args.trials, "scenarios": {}}
    for abort_mode, side, rebuild in SCENARIOS:
        name = f"{abort_mode}/{side}/{rebuild}"
        if wanted and name not in wanted:
            continue
        ranks = run_pair(name, args.trials)
        info = [row for rows in ranks for row in rows if row["kind"] == "INFO"]
        result["torch"] = info[0]["torch"] if info else result.get("torch")
        result["scenarios"][name] = s = summarize(name, ranks, args.trials)
        free = f"free={s['free']} {_fmt(s['free_s'])}"
        print(f"{name:28s} {free:55s} rebuild={s['rebuild_status']} {_fmt(s['rebuild_s'])}")
        for e in s["errors"][:2]:
            print(f"    {e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _each_python(args: argparse.Namespace) -> None:
    """This script under each interpreter, its results side by side in one stamped file."""
    import tempfile
    from pathlib import Path

    from chaos import results

    st = results.begin(trials=args.trials)
    by_torch = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, python in enumerate(args.python):
            out = Path(tmp) / f"{i}.json"
            cmd = [python, __file__, "--trials", str(args.trials), "--out", str(out)]
            subprocess.run([*cmd, *(["--only", args.only] if args.only else [])], check=True)
            by_torch.append(json.loads(out.read_text()))
    if args.out:
        results.write(Path(args.out), by_torch, st)


def _fmt(st: dict[str, Any] | None) -> str:
    if not st:
        return "-"
    return f"{st['median'] * 1e3:.1f} ms [{st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f}] n={st['n']}"


if __name__ == "__main__":
    main()
