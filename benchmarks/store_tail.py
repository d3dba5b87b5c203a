"""The store's tail latency: a real torch ``TCPStore`` on loopback, hammered the way the runtime asks.

Issue 29: a fault-free job's step checks looked like hangs because a store request now and then
took 5 s. The cause was torch's reverse DNS lookup of every socket it accepts or connects, on the
server's event loop (``resilient/native/names.py``). This benchmark measures the tail a client
sees, with torch's lookups and with :func:`resilient.native.names.apply`, for both server backends
(``use_libuv=True`` and ``False``), side by side in one run.

Per cell (a mode and a client count N):

- a **server** process hosts the ``TCPStore`` (``names.apply()`` first in the ``numeric`` modes);
- ``--procs`` **client** processes (``names.apply()`` too in the ``numeric`` modes) hold the N
  torch store clients between them, ``--threads`` threads each, every thread driving its clients
  in turns. A client's turn is the runtime's request mix: post its count (``set``), read its ring
  neighbour's with ``compare_set`` polls (up to 3 back to back, as ``_await`` does first), count
  itself into a barrier (``add``), ``check`` its key, ``wait`` for the barrier's release, read its
  own key (``get``: a wait and a get on the wire, as torch's client sends it), a ``multi_get`` of
  8 keys (the barrier's reduction), and delete its key of the round before;
- the N clients connect first (timed: the runtime opens 3-4 connections per process at start);
  then, while the turns run, a thread per client process opens a fresh connection every
  ``requests / connects`` requests, sends one ``add`` on it and closes it (the connects of ranks
  that start or come back while others work);
- a **probe** process (nice -10) sends a ``check`` every 10 ms on a connection of its own: the
  server's loop lag, as seen by a client that is not itself short of CPU;
- this process samples the server's threads' scheduler statistics (``/proc/<pid>/task/*/schedstat``:
  time on a core, time runnable but waiting for one) every 20 ms, so that each request or connect
  over 100 ms is classed: a **stall** when the server's threads spent more than half of it neither
  running nor waiting for a core (asleep with a request pending: blocked, on a DNS answer), else
  **cpu** (the server was busy with others' requests, or waited for a core: queueing on a 2-core
  machine shared with the clients, and here with other jobs). The criterion cannot tell a client
  that was itself starved of CPU (the server then idles too); the probe's lag says how often that is.

Every figure is a Python call as the runtime makes it (its wall time from the call to the
return); torch's ``set`` does not wait for the server's answer, the others do. Percentiles are
nearest-rank. The ``lookups`` cells cannot reach the totals (at ~1 in 25 lookups lost here, a
connect costs 5 s of the server's loop that often): they run the same mix for at most
``--lookups-budget`` seconds of set-up and as many of turns, and report what they reached.

    python benchmarks/store_tail.py [--clients 2,256,4096] [--requests 1000000] [--connects 10000]
        [--modes libuv-lookups,libuv-numeric,legacy-lookups,legacy-numeric] [--quick]

Writes ``benchmarks/results/store_tail.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import math
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SLOW = 0.1  # a request this slow is kept with its start time, to be classed
QS = (0.5, 0.99, 0.999, 0.9999)
ABSENT = "\x00absent"  # compare_set(k, ABSENT, ABSENT) reads k and creates nothing
PAYLOADS = [f"payload/{j}" for j in range(7)]
OPS = ("set", "compare_set", "add", "check", "wait", "get", "multi_get", "delete_key")
MODES = ("libuv-lookups", "libuv-numeric", "legacy-lookups", "legacy-numeric")
TARGET = {"clients": (256, 4096), "requests": 1_000_000, "connects": 10_000, "p9999_ms": 50.0}


# ---- the figures (pure) -------------------------------------------------------------------------
def tail(xs: Sequence[float]) -> dict[str, Any]:
    """Nearest-rank percentiles (the ceil(q·n)-th smallest), the max and the slow counts, in ms."""
    s = sorted(xs)
    n = len(s)
    out: dict[str, Any] = {
        "n": n,
        "over_100ms": sum(1 for x in s if x > 0.1),
        "over_1s": sum(1 for x in s if x > 1.0),
    }
    for q in QS:
        rank = math.ceil(round(q * n, 6))  # (0.999 · 10,000 is 9,990.000000000002 in floats)
        out[f"p{_qname(q)}_ms"] = 1e3 * s[max(0, rank - 1)] if n else None
    out["max_ms"] = 1e3 * s[-1] if n else None
    return out


def _qname(q: float) -> str:
    return f"{100 * q:.2f}".rstrip("0").rstrip(".").replace(".", "")  # 0.999 -> "999", 0.5 -> "50"


def classify(
    slow: Sequence[tuple[float, float]], samples: Sequence[tuple[float, float, float]]
) -> dict[str, int]:
    """Each slow request (start, duration) against the server's scheduler samples (t, seconds on a
    core, seconds waiting for one): a ``stall`` when its threads ran or waited for under half of the
    request's span (the samples around it), else ``cpu``."""
    out = {"stall": 0, "cpu": 0, "unsampled": 0}
    ts = [t for t, _, _ in samples]
    for start, dur in slow:
        i = bisect.bisect_right(ts, start) - 1
        j = bisect.bisect_left(ts, start + dur)
        if i < 0 or j >= len(ts) or ts[j] <= ts[i]:
            out["unsampled"] += 1
            continue
        dt = ts[j] - ts[i]
        awake = (samples[j][1] - samples[i][1] + samples[j][2] - samples[i][2]) / dt
        out["stall" if awake < 0.5 else "cpu"] += 1
    return out


def verdict(cell: dict[str, Any]) -> str:
    """The issue's target for a numeric cell at 256 or 4,096 clients: 'met', or what missed it."""
    if cell["names"] != "numeric" or cell["clients"] not in TARGET["clients"]:
        return ""
    r, c = cell["requests"], cell["connects"]
    miss = []
    if r["n"] < TARGET["requests"]:
        miss.append(f"{r['n']:,} requests < {TARGET['requests']:,}")
    if c["n"] < TARGET["connects"]:
        miss.append(f"{c['n']:,} connects < {TARGET['connects']:,}")
    if r["over_1s"]:
        miss.append(f"{r['over_1s']} requests > 1 s")
    if c["over_1s"]:
        miss.append(f"{c['over_1s']} connects > 1 s")
    if r["p9999_ms"] is not None and r["p9999_ms"] > TARGET["p9999_ms"]:
        miss.append(f"p99.99 {r['p9999_ms']:.1f} ms > {TARGET['p9999_ms']:.0f} ms")
    return "met" if not miss else "missed: " + "; ".join(miss)


def table(cells: Sequence[dict[str, Any]]) -> str:
    """The printed table: one row per cell, lookups and numeric side by side per backend and N."""

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:,.0f}"

    head = ("backend", "names", "clients", "requests", "p50", "p99", "p99.9", "p99.99", "max",
            ">100ms", ">1s", "stall/cpu", "connects", "c.p99.99", "c.max", "c>100ms", "c>1s", "probe p99",
            "probe max", "server run/wait", "req/s")  # fmt: skip
    rows = [head]
    for c in cells:
        r, k, p = c["requests"], c["connects"], c["probe"]
        rows.append((
            c["backend"], c["names"], f"{c['connected']:,}" + ("" if c["connected"] == c["clients"] else
            f"/{c['clients']:,}"), f"{r['n']:,}", ms(r["p50_ms"]), ms(r["p99_ms"]), ms(r["p999_ms"]),
            ms(r["p9999_ms"]), ms(r["max_ms"]), f"{r['over_100ms']:,}", f"{r['over_1s']:,}",
            f"{c['slow']['stall']}/{c['slow']['cpu']}", f"{k['n']:,}", ms(k["p9999_ms"]), ms(k["max_ms"]),
            f"{k['over_100ms']:,}", f"{k['over_1s']:,}", ms(p["p99_ms"]), ms(p["max_ms"]),
            f"{100 * c['server_cpu']:.0f}%/{100 * c['server_wait']:.0f}%", f"{r['n'] / c['load_s']:,.0f}",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + (
        "\n(times in ms; stall/cpu: the requests over 100 ms by cause; server run/wait: the share of the"
        "\n turns' wall time its threads ran on a core / waited for one)"
    )


# ---- the processes ------------------------------------------------------------------------------
def _nofile() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (65536, max(hard, 65536)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _torch(numeric: bool) -> Any:
    """torch.distributed, with torch's name lookups or with the numeric getnameinfo."""
    if numeric:
        from resilient.native import names

        why = names.apply()
        if why is not None:
            raise SystemExit(f"names.apply(): {why}")
    import torch.distributed as dist

    return dist


def _results() -> Any:
    """chaos/results.py on its own (stdlib only): ``from chaos import results`` would load torch into this
    process, which never imports it (each child chooses its names before torch loads)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_results", ROOT / "chaos" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SERVER = """
import sys, datetime
sys.path.insert(0, {root!r})
from benchmarks.store_tail import _nofile, _torch
_nofile()
dist = _torch(sys.argv[1] == "1")
s = dist.TCPStore({host!r}, 0, None, True, timeout=datetime.timedelta(seconds=600),
                  wait_for_workers=False, use_libuv=sys.argv[2] == "1")
for k in {payloads!r}:
    s.set(k, "[40, 30]")
s.set("release", "ok:40")
print(s.port, int(s.libuvBackend), flush=True)
sys.stdin.read()
"""


class _Load:
    """One client process's clients, threads and figures."""

    def __init__(self, w: dict[str, Any]) -> None:
        self.w = w
        self.dist = _torch(w["numeric"])
        self.lat: dict[str, array] = {}
        self.slow: list[tuple[float, float]] = []
        self.slow_connects: list[tuple[float, float]] = []
        self.connect_setup, self.connect_churn = array("d"), array("d")
        self.lock = threading.Lock()
        self.clients: dict[int, Any] = {}
        self.done = [0] * w["threads"]

    def connect(self) -> Any:
        from datetime import timedelta

        t = timedelta(seconds=self.w["timeout"])
        return self.dist.TCPStore(HOST, self.w["port"], None, False, timeout=t, wait_for_workers=False)

    def _timed_connect(self, into: array) -> Any:
        t0 = time.monotonic()
        c = self.connect()
        dt = time.monotonic() - t0
        with self.lock:
            into.append(dt)
            if dt > SLOW:
                self.slow_connects.append((t0, dt))
        return c

    def setup(self, deadline: float) -> None:
        def run(ids: list[int]) -> None:
            for i in ids:
                if time.monotonic() > deadline:
                    return
                c = self._timed_connect(self.connect_setup)
                with self.lock:
                    self.clients[i] = c

        ids, t = self.w["ids"], self.w["threads"]
        threads = [threading.Thread(target=run, args=(ids[k::t],)) for k in range(t)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    def turns(self, k: int, deadline: float) -> None:
        """Thread k: its clients in turns, until its share of the requests is done or the deadline."""
        world, t = self.w["world"], self.w["threads"]
        mine = [(i, self.clients[i]) for i in self.w["ids"][k::t] if i in self.clients]
        quota = self.w["requests"] // t + (k < self.w["requests"] % t)
        lat: dict[str, array] = {op: array("d") for op in OPS}
        slow: list[tuple[float, float]] = []
        done = 0

        def req(c: Any, op: str, *args: Any) -> Any:
            nonlocal done
            t0 = time.monotonic()
            out = getattr(c, op)(*args)
            dt = time.monotonic() - t0
            lat[op].append(dt)
            if dt > SLOW:
                slow.append((t0, dt))
            done += 1
            self.done[k] = done
            return out

        r = 0
        while mine and done < quota and time.monotonic() < deadline:
            for i, c in mine:
                own = f"fp/{r}/{i}"
                req(c, "set", own, "12")
                peer = f"fp/{r}/{(i - 1) % world}"
                for _ in range(3):
                    if req(c, "compare_set", peer, ABSENT, ABSENT) != ABSENT.encode():
                        break
                req(c, "add", f"count/{r % 16}", 1)
                req(c, "check", [own])
                req(c, "wait", ["release"])
                req(c, "get", own)
                req(c, "multi_get", [own, *PAYLOADS])
                if r:
                    req(c, "delete_key", f"fp/{r - 1}/{i}")
                if done >= quota or time.monotonic() > deadline:
                    break
            r += 1
        with self.lock:
            for op, xs in lat.items():
                self.lat.setdefault(op, array("d")).extend(xs)
            self.slow.extend(slow)

    def churn(self, deadline: float) -> None:
        """Fresh connections, paced by the requests done: one per requests/connects of them."""
        n, per = self.w["connects"], self.w["requests"] / max(1, self.w["connects"])
        j = 0
        while j < n and time.monotonic() < deadline:
            if sum(self.done) < j * per and any(th.is_alive() for th in self._turns):
                time.sleep(0.001)
                continue
            c = self._timed_connect(self.connect_churn)
            t0 = time.monotonic()
            c.add("connects", 1)
            dt = time.monotonic() - t0
            with self.lock:
                self.lat.setdefault("add", array("d")).append(dt)
                if dt > SLOW:
                    self.slow.append((t0, dt))
            del c
            j += 1

    def run(self, deadline: float) -> None:
        self._turns = [
            threading.Thread(target=self.turns, args=(k, deadline)) for k in range(self.w["threads"])
        ]
        churn = threading.Thread(target=self.churn, args=(deadline,))
        for th in [*self._turns, churn]:
            th.start()
        for th in [*self._turns, churn]:
            th.join()


def _client_proc(conn: Any, w: dict[str, Any]) -> None:
    _nofile()
    load = _Load(w)  # (torch imported, the names chosen: the set-up's clock starts after)
    conn.send("ready")
    load.setup(conn.recv())
    conn.send(len(load.clients))
    deadline = conn.recv()
    load.run(deadline)
    conn.send({"lat": {op: xs.tobytes() for op, xs in load.lat.items()}, "slow": load.slow,
               "slow_connects": load.slow_connects,
               "setup": load.connect_setup.tobytes(), "churn": load.connect_churn.tobytes()})  # fmt: skip
    conn.recv()  # the clients close when the cell is over, not while others still measure
    os._exit(0)  # (thousands of store clients: their destructors are not worth the wait)


def _probe_proc(conn: Any, port: int, numeric: bool, interval: float) -> None:
    with contextlib.suppress(OSError):
        os.nice(-10)
    from datetime import timedelta

    c = _torch(numeric).TCPStore(
        HOST, port, None, False, timeout=timedelta(seconds=600), wait_for_workers=False
    )
    conn.send("ready")
    out = array("d")
    while not conn.poll(interval):
        t0 = time.monotonic()
        c.check(["release"])
        out.append(time.monotonic() - t0)
    conn.send(out.tobytes())


def _sched(pid: int) -> tuple[float, float]:
    """The seconds the process's threads have run on a core, and waited runnable for one."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            r, w, _ = (task / "schedstat").read_text().split()
            run, wait = run + int(r), wait + int(w)
    return run / 1e9, wait / 1e9


def _machine() -> float:
    """The machine's busy CPU seconds, every core (/proc/stat)."""
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (sum(int(x) for x in cpu[:8]) - int(cpu[3]) - int(cpu[4])) / os.sysconf("SC_CLK_TCK")


def _floats(b: bytes) -> array:
    a = array("d")
    a.frombytes(b)
    return a


def measure(mode: str, clients: int, a: argparse.Namespace) -> dict[str, Any]:
    backend, names = mode.split("-")
    numeric, uv = names == "numeric", backend == "libuv"
    budget = a.budget if numeric else a.lookups_budget
    setup_budget = a.setup_budget if numeric else a.lookups_budget
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = SERVER.format(root=str(ROOT), host=HOST, payloads=PAYLOADS)
    argv = [sys.executable, "-c", code, str(int(numeric)), str(int(uv))]
    server = subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdout is not None
    port_s, is_uv = server.stdout.readline().split()
    assert int(is_uv) == uv, f"asked use_libuv={uv}, the server has {is_uv}"
    port = int(port_s)
    ctx = mp.get_context("fork")  # (this process never imports torch: each child chooses its names)
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            samples.append((time.monotonic(), *_sched(server.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = min(a.procs, clients)
    pipes, kids = [], []
    try:
        pa, pb = ctx.Pipe()
        probe = ctx.Process(target=_probe_proc, args=(pb, port, numeric, 0.01), daemon=True)
        probe.start()
        kids.append(probe)
        assert pa.recv() == "ready"
        for p in range(procs):
            ids = list(range(p * clients // procs, (p + 1) * clients // procs))
            w = {"port": port, "ids": ids, "threads": min(a.threads, len(ids)), "numeric": numeric,
                 "world": clients, "requests": a.requests // procs + (p < a.requests % procs),
                 "connects": a.connects // procs + (p < a.connects % procs), "timeout": 600.0}  # fmt: skip
            x, y = ctx.Pipe()
            kid = ctx.Process(target=_client_proc, args=(y, w), daemon=True)
            kid.start()
            pipes.append(x)
            kids.append(kid)
        for x in pipes:
            assert x.recv() == "ready"
        t_setup = time.monotonic()
        for x in pipes:
            x.send(t_setup + setup_budget)
        connected = sum(x.recv() for x in pipes)
        t_load = time.monotonic()
        cpu0, busy0 = _sched(server.pid), _machine()
        for x in pipes:
            x.send(t_load + budget)
        got = [x.recv() for x in pipes]
        t_end = time.monotonic()
        cpu1, busy1 = _sched(server.pid), _machine()
        pa.send("stop")
        probe_lat = _floats(pa.recv())
    finally:
        stop.set()
        for x in pipes:
            with contextlib.suppress(OSError):
                x.send("exit")
        for kid in kids:
            kid.join(timeout=30)
            if kid.is_alive():
                kid.kill()
        server.kill()
        server.wait()
    lat: dict[str, array] = {}
    for g in got:
        for op, b in g["lat"].items():
            lat.setdefault(op, array("d")).extend(_floats(b))
    every = array("d")
    for xs in lat.values():
        every.extend(xs)
    setup = array("d", (x for g in got for x in _floats(g["setup"])))
    churn = array("d", (x for g in got for x in _floats(g["churn"])))
    slow = [s for g in got for s in g["slow"]]
    slow_connects = [s for g in got for s in g["slow_connects"]]
    return {
        "mode": mode, "backend": backend, "names": names, "clients": clients, "connected": connected,
        "procs": procs, "threads": a.threads, "setup_s": t_load - t_setup, "load_s": t_end - t_load,
        "requests": tail(every), "by_op": {op: tail(xs) for op, xs in sorted(lat.items())},
        "connects": tail([*setup, *churn]), "connects_setup": tail(setup), "connects_churn": tail(churn),
        "probe": tail(probe_lat), "server_cpu": (cpu1[0] - cpu0[0]) / (t_end - t_load),
        "server_wait": (cpu1[1] - cpu0[1]) / (t_end - t_load),
        "machine_cpu": (busy1 - busy0) / (t_end - t_load),
        "slow": classify(slow, samples), "slow_connects": classify(slow_connects, samples),
        "slowest": sorted((round(d, 4) for _, d in slow), reverse=True)[:20],
        "slowest_connects": sorted((round(d, 4) for _, d in slow_connects), reverse=True)[:20],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="2,256,4096", help="client counts, each a cell per mode")
    p.add_argument("--requests", type=int, default=1_000_000, help="requests per cell (turns' calls)")
    p.add_argument("--connects", type=int, default=10_000, help="fresh connects per cell, besides the N")
    p.add_argument("--modes", default=",".join(MODES), help="backend-names: libuv|legacy - lookups|numeric")
    p.add_argument("--procs", type=int, default=4, help="client processes the clients share")
    p.add_argument("--threads", type=int, default=4, help="threads per client process")
    p.add_argument("--budget", type=float, default=300.0, help="a numeric cell's turns stop after this (s)")
    p.add_argument("--setup-budget", type=float, default=120.0, help="a numeric cell's connects at start (s)")
    p.add_argument(
        "--lookups-budget", type=float, default=40.0, help="a lookups cell's set-up, and its turns (s)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 2 and 64 clients, 20k requests, 200 connects"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "store_tail.json")
    a = p.parse_args()
    if a.quick:
        a.clients, a.requests, a.connects, a.lookups_budget, a.budget = "2,64", 20_000, 200, 8.0, 60.0
    modes = a.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"--modes: {sorted(unknown)} not among {MODES}")
    results = _results()
    st = results.begin()
    cells = []
    t0 = time.monotonic()
    for n in (int(x) for x in a.clients.split(",")):
        for mode in modes:
            cell = measure(mode, n, a)
            cell["verdict"] = verdict(cell)
            cells.append(cell)
            r = cell["requests"]
            k = cell["connects"]
            print(f"  {mode:15s} N={n:5d} connected={cell['connected']} requests={r['n']} "
                  f"p99.99={r['p9999_ms']}ms >1s={r['over_1s']} connects={k['n']} >1s={k['over_1s']} "
                  f"setup={cell['setup_s']:.1f}s load={cell['load_s']:.1f}s {cell['verdict']}",
                  flush=True)  # fmt: skip
    print()
    print(table(cells))
    for c in cells:
        if c["verdict"]:
            print(f"target at {c['clients']:,} clients, {c['backend']}: {c['verdict']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    args = {k: str(v) for k, v in vars(a).items()}
    results.write(a.out, {"args": args, "wall_s": time.monotonic() - t0, "cells": cells}, st)
    print(f"wrote {a.out} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
