"""The control plane at scale: N simulated ranks against one real TCPStore server.

The runtime's coordination goes through the job's ``TCPStore`` (one server, on rank 0 or the
launcher's agent). This simulator starts a real torch ``TCPStore`` server in a process of its own
and N simulated ranks, in a few client processes, each rank a connection of its own speaking the
store's wire protocol (the bytes torch's client sends: validate + ping, then one message per
request; a ``get`` is a ``wait`` and a ``get``, as torch's client does it). The ranks replay the
runtime's store protocol, request for request:

- **check**: what each rank asks the store when a snapshot is kept (the collective count compared
  with the ring neighbour's);
- **recovery**: a fault posted by one rank; every rank's listener sees it, then every rank enters
  the recovery barrier and is released with the step to restore. Timed from the post to the
  last rank released.

for three protocols side by side:

- ``before``: the protocol as it was (a count key per check, deleted after; the barrier's
  release, then a ``multi_get`` of every rank's payload by every rank: O(N²) keys);
- ``flat``: the runtime's protocol now: the neighbour's count read in one request (a
  compare-and-set that never matches), the listener's one blocking ``get``; the barrier reduced
  by its last arrival, which reads every payload once and writes the result into the release
  key every rank reads in one request: O(N);
- ``node``: the runtime's protocol when the job spans nodes (``node_aggregation``, 8 ranks per
  node here): a node's ranks meet on their node's own store and reach the job's as one (the
  leader's listener, the node's block in each barrier, the ring's node-crossing pairs). Only the
  job's server is simulated: the node-local hand-offs go to other servers, one per node.

Every protocol includes what a recovering rank asks between the fault and its release: the
listener's read, its own account of the fault, the ``store`` health check, the barrier.

Reported per N and protocol: store requests, the server's CPU time (read from /proc: the server
is single-threaded, so this is the time it is busy, the floor of any latency), and the wall time.
The client processes share this machine's 2 cores with the server, so wall times here are upper
bounds; the server CPU is the figure that carries to a cluster, where the clients are elsewhere.
A least-squares model (server CPU = a + b·N per phase, + c·N² for the old barrier's every-rank
``multi_get``) projects what was not measured.

The server formats every socket it accepts with ``getnameinfo()`` (a reverse DNS lookup: issue 29)
unless ``--names numeric`` (the default, as the runtime runs it) applies
``resilient.native.names`` in its process first; the simulated ranks are Python sockets, which
look nothing up. Each N's connects are reported (``connect``: their wall time, the slowest, the
validations retried after ``--connect-timeout``); ``--protocols ''`` measures only them.

    python benchmarks/control_plane.py [--ranks 256,1024,4096,16384] [--procs 8] [--interval 100]
        [--names numeric|torch]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NODE = 8  # ranks per node
MAGIC = 0x3C85F7CE
SET, COMPARE_SET, GET, ADD, CHECK, WAIT, DELETE_KEY, APPEND, MULTI_GET, PING = 1, 2, 3, 4, 5, 6, 8, 9, 10, 13


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


class Client:
    """One simulated rank's connection, speaking TCPStore's wire protocol."""

    def __init__(self) -> None:
        self.requests = 0
        self.r: asyncio.StreamReader
        self.w: asyncio.StreamWriter

    async def connect(self, port: int, timeout: float | None = None, retries: int = 5) -> int:
        """Connect, validate and ping; a validation unanswered within ``timeout`` is tried again on
        a fresh connection (at most ``retries`` times, as torch's client retries): the retries taken."""
        for retry in range(retries + 1):
            for attempt in range(50):
                try:
                    self.r, self.w = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    await asyncio.sleep(0.05 * (attempt + 1))
            self.w.write(struct.pack("<BI", 0, MAGIC) + struct.pack("<BI", PING, 7))
            try:
                await asyncio.wait_for(self.r.readexactly(4), timeout)
                return retry
            except asyncio.TimeoutError:
                self.w.close()
        raise OSError(f"no answer to a validation in {retries + 1} tries of {timeout} s")

    async def _u64(self) -> int:
        return int(struct.unpack("<Q", await self.r.readexactly(8))[0])

    async def _val(self) -> bytes:
        return await self.r.readexactly(await self._u64())

    async def set(self, k: str, v: str) -> None:
        self.requests += 1
        self.w.write(bytes([SET]) + _s(k.encode()) + _s(v.encode()))

    async def append(self, k: str, v: str) -> None:
        self.requests += 1
        self.w.write(bytes([APPEND]) + _s(k.encode()) + _s(v.encode()))

    async def wait(self, keys: list[str]) -> None:
        self.requests += 1
        self.w.write(bytes([WAIT]) + struct.pack("<Q", len(keys)) + b"".join(_s(k.encode()) for k in keys))
        await self.r.readexactly(1)

    async def get(self, k: str) -> bytes:  # torch's client: wait for the key, then get it
        await self.wait([k])
        self.requests += 1
        self.w.write(bytes([GET]) + _s(k.encode()))
        return await self._val()

    async def multi_get(self, keys: list[str]) -> list[bytes]:
        await self.wait(keys)
        self.requests += 1
        self.w.write(
            bytes([MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(_s(k.encode()) for k in keys)
        )
        return [await self._val() for _ in keys]

    async def add(self, k: str, n: int) -> int:
        self.requests += 1
        self.w.write(bytes([ADD]) + _s(k.encode()) + struct.pack("<q", n))
        return int(struct.unpack("<q", await self.r.readexactly(8))[0])

    async def check(self, keys: list[str]) -> bool:
        self.requests += 1
        self.w.write(bytes([CHECK]) + struct.pack("<Q", len(keys)) + b"".join(_s(k.encode()) for k in keys))
        return (await self.r.readexactly(1)) == b"\x00"

    async def compare_set(self, k: str, expected: str, desired: str) -> bytes:
        self.requests += 1
        self.w.write(bytes([COMPARE_SET]) + _s(k.encode()) + _s(expected.encode()) + _s(desired.encode()))
        return await self._val()

    async def delete(self, k: str) -> None:
        self.requests += 1
        self.w.write(bytes([DELETE_KEY]) + _s(k.encode()))
        await self._u64()


# ---- the protocols, per simulated rank -------------------------------------------------------------
async def check_before(c: Client, rank: int, world: int, k: int, _local: Any) -> None:
    """A kept snapshot, as it was: post the count under a new key, poll the neighbour's, read it,
    delete the key of the window before."""
    await c.set(f"fp/{k}/{rank}", "12")
    peer = f"fp/{k}/{(rank + 1) % world}"
    while not await c.check([peer]):
        await asyncio.sleep(0.0003)
    await c.get(peer)
    if k > 0:
        await c.delete(f"fp/{k - 1}/{rank}")


async def check_flat(c: Client, rank: int, world: int, k: int, _local: Any) -> None:
    """Now: post the count; read the neighbour's in one request (a compare-and-set that never
    matches), polling while it is absent; delete the key of the window before."""
    await c.set(f"fp/{k}/{rank}", "12")
    peer = f"fp/{k}/{(rank + 1) % world}"
    while await c.compare_set(peer, "\x00absent", "\x00absent") == b"\x00absent":
        await asyncio.sleep(0.0003)
    if k > 0:
        await c.delete(f"fp/{k - 1}/{rank}")


async def check_node(c: Client, rank: int, world: int, k: int, _local: Any) -> None:
    """Node-linked (as built): neighbours on one node compare on their node's store (not the job's:
    not simulated); a node's first rank posts its count to the job's store too, where the previous
    node's last rank reads it (one compare-and-set, polled while absent), and deletes its key of
    the window before."""
    if world <= NODE:
        return
    if rank % NODE == 0:
        await c.set(f"fp/{k}/{rank}", "12")
        if k > 0:
            await c.delete(f"fp/{k - 1}/{rank}")
    if (rank + 1) % NODE == 0 or rank == world - 1:  # its ring successor is the next node's first
        peer = f"fp/{k}/{(rank + 1) % world}"
        while await c.compare_set(peer, "\x00absent", "\x00absent") == b"\x00absent":
            await asyncio.sleep(0.0003)


async def _health(c: Client, rank: int, g: int) -> None:
    """The ``store`` health check every recovering rank runs: a set and a get (a wait + a get)."""
    await c.set(f"health/g{g}/r{rank}", "1")
    await c.get(f"health/g{g}/r{rank}")


async def recover_before(c: Client, rank: int, world: int, g: int, local: Any) -> float:
    await c.wait([f"g{g}/fault"])  # the listener's pending wait returns
    await c.get(f"g{g}/fault")
    # each interrupted rank posted its own fault: observation, primary, the done barrier's release
    await c.set(f"g{g}/fault/{rank}", "{}")
    await c.compare_set(f"g{g}/fault", "", "{}")
    await c.compare_set(f"g{g}/done/release", "", "fault")
    await _health(c, rank, g)
    await c.set(f"g{g}/recover/{rank}", "[40, 30]")
    if await c.add(f"g{g}/recover/count", 1) == world:
        await c.compare_set(f"g{g}/recover/release", "", "ok")
    await c.wait([f"g{g}/recover/release"])
    await c.get(f"g{g}/recover/release")
    await c.multi_get([f"g{g}/recover/{r}" for r in range(world)])
    return time.monotonic()


async def recover_flat(c: Client, rank: int, world: int, g: int, local: Any) -> float:
    await c.get(f"g{g}/fault")  # the listener's one blocking get
    await c.set(f"g{g}/fault/{rank}", "{}")  # its own account; the primary is already known
    await _health(c, rank, g)
    await c.set(f"g{g}/recover/{rank}", "[40, 30]")
    if await c.add(f"g{g}/recover/count", 1) == world:
        await c.multi_get([f"g{g}/recover/{r}" for r in range(world)])  # read once, reduced here
        await c.compare_set(f"g{g}/recover/release", "", "ok:40")
    await c.wait([f"g{g}/recover/release"])  # (with the barrier's timeout), then one read
    await c.compare_set(f"g{g}/recover/release", "\x00never", "\x00never")
    return time.monotonic()


async def recover_node(c: Client, rank: int, world: int, g: int, local: Any) -> float:
    """Node-linked (as built): the leader's listener hears the fault and hands it to its node; each
    rank's account and health check go to the node's store; the node's last arrival carries the
    node's payloads as one block (here the leader: the same requests) and hands the verdict back.
    The node-local hand-offs are not simulated (loopback, the node's own server)."""
    seen, released = local
    if rank % NODE:
        await seen.wait()
        await released.wait()
        return time.monotonic()
    await c.get(f"g{g}/fault")
    seen.set()
    await _health(c, rank, g)
    size = min(NODE, world - rank)
    await c.set(f"g{g}/recover/b/{rank}", json.dumps(["[40, 30]"] * size))
    await c.append(f"g{g}/recover/blocks", f"{rank},")
    if await c.add(f"g{g}/recover/count", size) == world:
        firsts = sorted(int(f) for f in (await c.get(f"g{g}/recover/blocks")).decode().split(",") if f)
        await c.multi_get([f"g{g}/recover/b/{f}" for f in firsts])
        await c.compare_set(f"g{g}/recover/release", "", "ok:40")
    await c.wait([f"g{g}/recover/release"])
    await c.compare_set(f"g{g}/recover/release", "\x00never", "\x00never")
    released.set()
    return time.monotonic()


PROTOCOLS = {
    "before": (check_before, recover_before),
    "flat": (check_flat, recover_flat),
    "node": (check_node, recover_node),
}


# ---- the processes ------------------------------------------------------------------------------------
def _client_proc(conn: Any, port: int, ranks: list[int], world: int, timeout: float | None) -> None:
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2
    )

    async def main() -> None:
        clients = {r: Client() for r in ranks}
        sem = asyncio.Semaphore(128)
        took: list[float] = []

        async def connect(c: Client) -> int:
            async with sem:
                t = time.monotonic()
                retried = await c.connect(port, timeout)
                took.append(time.monotonic() - t)
                return retried

        retried = await asyncio.gather(*(connect(c) for c in clients.values()))
        conn.send({"slowest": max(took, default=0.0), "over_1s": sum(t > 1 for t in took),
                   "retried": sum(retried)})  # fmt: skip
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg is None:
                break
            proto, phase, idx = msg
            check, recover = PROTOCOLS[proto]
            before = sum(c.requests for c in clients.values())
            if phase == "check":
                t0 = time.monotonic()
                await asyncio.gather(*(check(clients[r], r, world, idx, None) for r in ranks))
                conn.send(
                    {
                        "end": time.monotonic(),
                        "t0": t0,
                        "requests": sum(c.requests for c in clients.values()) - before,
                    }
                )
            else:
                nodes: dict[int, tuple[asyncio.Event, asyncio.Event]] = {}
                for r in ranks:
                    nodes.setdefault(r // NODE, (asyncio.Event(), asyncio.Event()))
                tasks = [
                    asyncio.ensure_future(recover(clients[r], r, world, idx, nodes[r // NODE])) for r in ranks
                ]
                await asyncio.sleep(0.2)  # every listener is waiting
                conn.send("listening")
                ends = await asyncio.gather(*tasks)
                conn.send({"end": max(ends), "requests": sum(c.requests for c in clients.values()) - before})

    asyncio.run(main())


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVER = """
import resource, sys, time
from datetime import timedelta
if sys.argv[1] == "numeric":
    from resilient.native import names
    why = names.apply()
    assert why is None, why
import torch.distributed as dist
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
print(s.port, flush=True)
sys.stdin.read()
"""


async def _post(port: int, g: int) -> float:
    """The faulting rank posts its record (and is the primary: the compare-and-set wins)."""
    poster = Client()
    await poster.connect(port)
    t = time.monotonic()
    await poster.set(f"g{g}/fault/0", "{}")
    await poster.compare_set(f"g{g}/fault", "", "{fault}")
    return t


def measure(
    world: int,
    procs: int,
    checks: int,
    recoveries: int,
    protocols: list[str],
    names: str = "numeric",
    connect_timeout: float | None = None,
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", SERVER, names]
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    nodes = list(range((world + NODE - 1) // NODE))
    share = [
        [r for n in nodes[i::procs] for r in range(n * NODE, min(world, (n + 1) * NODE))]
        for i in range(procs)
    ]
    ctx = mp.get_context("fork")
    pipes, workers = [], []
    t_connect = time.monotonic()
    for ranks in share:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_client_proc, args=(b, port, ranks, world, connect_timeout), daemon=True)
        p.start()
        pipes.append(a)
        workers.append(p)
    out: dict[str, Any] = {"ranks": world, "names": names}
    gen = 0
    try:
        got = [a.recv() for a in pipes]
        out["connect"] = {"connect_s": time.monotonic() - t_connect,
                          "slowest_s": max(g["slowest"] for g in got),
                          "over_1s": sum(g["over_1s"] for g in got),
                          "retried": sum(g["retried"] for g in got)}  # fmt: skip
        print(
            f"  N={world:6d} connect " + " ".join(f"{k}={v:.4g}" for k, v in out["connect"].items()),
            flush=True,
        )
        for proto in protocols:
            rows: dict[str, list[float]] = {"check_cpu": [], "check_wall": [], "check_req": [],
                                            "rec_cpu": [], "rec_wall": [], "rec_req": []}  # fmt: skip
            cpu0 = _server_cpu(server.pid)  # (/proc counts in clock ticks: summed over repetitions)
            for k in range(checks):
                t0 = time.monotonic()
                for a in pipes:
                    a.send((proto, "check", gen + k))
                res = [a.recv() for a in pipes]
                rows["check_wall"].append(max(r["end"] for r in res) - t0)
                rows["check_req"].append(sum(r["requests"] for r in res))
            rows["check_cpu"].append((_server_cpu(server.pid) - cpu0) / checks)
            gen += checks
            cpu_total = 0.0
            for _ in range(recoveries):
                for a in pipes:
                    a.send((proto, "recover", gen))
                for a in pipes:
                    assert a.recv() == "listening"
                cpu0 = _server_cpu(server.pid)
                t0 = asyncio.run(_post(port, gen))
                res = [a.recv() for a in pipes]
                cpu_total += _server_cpu(server.pid) - cpu0
                rows["rec_wall"].append(max(r["end"] for r in res) - t0)
                rows["rec_req"].append(sum(r["requests"] for r in res) + 2)
                gen += 1
            rows["rec_cpu"].append(cpu_total / recoveries)
            out[proto] = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}  # medians
            print(
                f"  N={world:6d} {proto:6s} " + " ".join(f"{k}={v:.4g}" for k, v in out[proto].items()),
                flush=True,
            )
    finally:
        for a in pipes:
            with contextlib.suppress(OSError):
                a.send(None)
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        server.kill()
        server.wait()
    return out


def fit(points: list[tuple[int, float]], deg: int) -> tuple[float, float, float]:
    """Least squares a + b·N (+ c·N² where the protocol reads every rank's key on every rank)."""
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    deg = min(deg, len(points) - 1)
    coef = list(np.polyfit(n, y, deg)[::-1]) + [0.0] * (2 - deg)
    return float(coef[0]), float(coef[1]), float(coef[2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="256,1024,4096,16384")
    p.add_argument("--procs", type=int, default=8, help="client processes the simulated ranks share")
    p.add_argument("--checks", type=int, default=5, help="kept snapshots per protocol and N")
    p.add_argument("--recoveries", type=int, default=3, help="faults per protocol and N")
    p.add_argument(
        "--interval", type=int, default=100, help="steps between kept snapshots (for per-step figures)"
    )
    p.add_argument("--project", default="1024,4096,16384", help="N the model reports")
    p.add_argument(
        "--before-up-to",
        type=int,
        default=4096,
        help="the old protocol's O(N²) barrier takes minutes of server time beyond this: modelled there",
    )
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="'' for the connects alone")
    p.add_argument(
        "--names",
        choices=("numeric", "torch"),
        default="numeric",
        help="the server's getnameinfo: numeric (resilient.native.names, as the runtime runs it) or torch's",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=60.0, help="a validation unanswered this long is retried (s)"
    )
    p.add_argument(
        "--from-log", type=Path, default=None, help="the table from an earlier run's printed lines"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "control_plane.json")
    a = p.parse_args()
    results = _results()
    st = results.begin(checks=a.checks, recoveries=a.recoveries)
    measured = _parse_log(a.from_log) if a.from_log is not None else []
    for n in [] if a.from_log is not None else [int(x) for x in a.ranks.split(",")]:
        try:
            protos = [p for p in a.protocols.split(",") if p and (p != "before" or n <= a.before_up_to)]
            measured.append(measure(n, a.procs, a.checks, a.recoveries, protos, a.names, a.connect_timeout))
        except (OSError, AssertionError, EOFError) as e:
            print(f"  N={n}: not measured on this machine ({type(e).__name__}: {e})", flush=True)
            break
    table = []
    for proto in PROTOCOLS:
        pts_c = [(r["ranks"], r[proto]["check_cpu"]) for r in measured if proto in r]
        pts_r = [(r["ranks"], r[proto]["rec_cpu"]) for r in measured if proto in r]
        if not pts_c:
            continue
        # the work grows with the requests, O(N); the old barrier's every-rank multi_get, O(N²)
        fc, fr = fit(pts_c, 1), fit(pts_r, 2 if proto == "before" else 1)
        for n in [int(x) for x in a.project.split(",")]:
            got = next((r for r in measured if r["ranks"] == n and proto in r), None)
            row = {"protocol": proto, "ranks": n, "measured": got is not None}
            if got is not None:
                m = got[proto]
                row.update(
                    check_req=m["check_req"], check_cpu_ms=1e3 * m["check_cpu"],
                    check_wall_ms=1e3 * m["check_wall"], rec_req=m["rec_req"],
                    rec_cpu_ms=1e3 * m["rec_cpu"], rec_wall_ms=1e3 * m["rec_wall"],
                )  # fmt: skip
            else:
                row.update(check_cpu_ms=1e3 * (fc[0] + fc[1] * n + fc[2] * n * n),
                           rec_cpu_ms=1e3 * (fr[0] + fr[1] * n + fr[2] * n * n))  # fmt: skip
            row["step_cpu_ms"] = row["check_cpu_ms"] / a.interval
            table.append(row)
    print(f"\n{'protocol':8s} {'N':>6s}  {'check: requests':>15s} {'server ms':>9s} {'per step':>9s} "
          f"{'wall ms':>8s}   {'recovery: requests':>18s} {'server ms':>9s} {'wall ms':>8s}")  # fmt: skip
    for r in table:
        star = "" if r["measured"] else " (model)"

        def cell(k: str, w: int, f: str = "{:.1f}", r: dict[str, Any] = r) -> str:
            return (f.format(r[k]) if k in r else "—").rjust(w)

        print(
            f"{r['protocol']:8s} {r['ranks']:6d}  {cell('check_req', 15, '{:.0f}')} "
            f"{cell('check_cpu_ms', 9)} {cell('step_cpu_ms', 9, '{:.3f}')} {cell('check_wall_ms', 8)}   "
            f"{cell('rec_req', 18, '{:.0f}')} {cell('rec_cpu_ms', 9)} {cell('rec_wall_ms', 8)}{star}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(a.out, {"measured": measured, "table": table, "interval": a.interval}, st)
    if table:  # (none with --protocols '')
        _plot(table, a.out.with_suffix(".png"))


def _results() -> Any:
    """chaos/results.py on its own (stdlib only): ``from chaos import results`` would load torch into this
    process, which the simulated ranks fork from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_results", ROOT / "chaos" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse_log(path: Path) -> list[dict[str, Any]]:
    """The ``N=... protocol key=value`` lines :func:`measure` prints, back into its results."""
    by_n: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        parts = line.replace("N=", "N= ").split()
        if len(parts) < 4 or parts[0] != "N=":
            continue
        n, proto, kv = int(parts[1]), parts[2], dict(x.split("=") for x in parts[3:])
        by_n.setdefault(n, {"ranks": n})[proto] = {k: float(v) for k, v in kv.items()}
    return [by_n[n] for n in sorted(by_n)]


def _plot(table: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for proto in PROTOCOLS:
        rows = [r for r in table if r["protocol"] == proto]
        xs = [r["ranks"] for r in rows]
        axes[0].plot(xs, [r["step_cpu_ms"] for r in rows], marker="o", label=proto)
        axes[1].plot(xs, [r["rec_cpu_ms"] for r in rows], marker="o", label=proto)
    axes[0].axhline(5, color="red", ls=":", label="target 5 ms")
    axes[1].axhline(1000, color="red", ls=":", label="target 1 s")
    for ax, t in zip(
        axes, ("server CPU per training step (ms)", "server CPU per recovery (ms)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(t)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
