"""A rank behind a real network link: its own network namespace, joined to the host by a veth pair.

``VethLink`` makes ``rchaos-<tag>`` with one end of a veth pair inside (``10.231.X.2/30``) and the
other in the host namespace (``10.231.X.1/30``). The rank's process enters the namespace before
``import torch`` (``python -m chaos.netns SCRIPT ARGS``, the entrypoint ``resilient launch`` runs
for every rank): the target rank reaches the job's store and every other rank only across the
veth, so ``down()`` (the link goes down) or ``loss(pct)`` (netem drops real packets) cut real
traffic: store requests and gloo's sockets both.

Needs root (CAP_NET_ADMIN), ``ip`` and ``nsenter``; ``capability()`` says what is missing, and a
scenario that needs it is skipped with that reason. ``remove()`` deletes the namespace (and with
it both veth ends); it is idempotent and called from ``finally`` blocks.

The wrapper reads ``CHAOS_NETNS`` (JSON: ns, rank, host_if, ns_if, host_ip): the target rank gets
``MASTER_ADDR`` = the host end and ``GLOO_SOCKET_IFNAME`` = its end; every other rank binds gloo
to the host end, so its peers in the namespace can reach it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import psutil

ENV = "CHAOS_NETNS"
_NET = ipaddress.ip_network("10.231.0.0/16")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def capability(loss: bool = False) -> str | None:
    """Why a rank cannot be put behind a veth link here (``loss``: one netem can make lossy), or
    None when it can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
    for tool in ("ip", "nsenter", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"rchaos-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        if loss:
            args = ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "loss", "1%"]
            r = subprocess.run(args, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                return f"no netem qdisc in this kernel (sch_netem; tc: {r.stderr.strip()})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-o", "-4", "addr", "show").stdout
    rng = random.Random()
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.231.{rng.randrange(256)}.{4 * rng.randrange(64)}/30")
        if str(next(net.hosts())) not in used:
            assert net.subnet_of(_NET)  # type: ignore[arg-type]
            return net  # type: ignore[return-value]
    raise RuntimeError("no free /30 in 10.231.0.0/16")


@dataclass(frozen=True)
class VethLink:
    ns: str
    rank: int
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    @classmethod
    def create(cls, rank: int) -> VethLink:
        sweep_stale()
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"  # veth names: at most 15 chars
        net = _free_subnet()
        host_ip, ns_ip = (str(a) for a in net.hosts())
        ns = f"rchaos-{os.getpid()}-{tag}"  # the creator's pid: a SIGKILLed run's is swept later
        link = cls(ns, rank, f"rch{tag}h", f"rch{tag}n", host_ip, ns_ip)
        try:
            _ip("netns", "add", link.ns)
            _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if, "netns", link.ns)
            _ip("addr", "add", f"{host_ip}/30", "dev", link.host_if)
            _ip("link", "set", link.host_if, "up")
            _ip("-n", link.ns, "addr", "add", f"{ns_ip}/30", "dev", link.ns_if)
            _ip("-n", link.ns, "link", "set", link.ns_if, "up")
            _ip("-n", link.ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            link.remove()
            raise RuntimeError(f"cannot build the veth link ({' '.join(e.cmd)}): {e.stderr.strip()}") from e
        return link

    def env(self) -> str:
        return json.dumps(asdict(self))

    def down(self) -> None:
        """The rank's end of the link goes down: nothing passes until ``up()``."""
        _ip("-n", self.ns, "link", "set", self.ns_if, "down")

    def up(self) -> None:
        _ip("-n", self.ns, "link", "set", self.ns_if, "up")

    def loss(self, pct: float) -> None:
        """netem on the rank's end drops ``pct`` % of the packets it sends (0: none)."""
        args = ["tc", "-n", self.ns, "qdisc", "replace", "dev", self.ns_if, "root", "netem", "loss"]
        args.append(f"{pct}%")
        subprocess.run(args, capture_output=True, text=True, check=True, timeout=30)

    def remove(self) -> None:
        """Delete the namespace and both veth ends (idempotent)."""
        _ip("netns", "del", self.ns, check=False)
        _ip("link", "del", self.host_if, check=False)

    def exists(self) -> bool:
        return self.ns in _ip("netns", "list", check=False).stdout


def sweep_stale() -> list[str]:
    """Delete the namespaces of chaos runs whose process is gone (SIGKILLed before its ``finally``);
    their veth pairs go with them. Returns what was deleted."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        stale = len(parts) == 3 and parts[0] == "rchaos" and parts[1].isdigit()
        if stale and not psutil.pid_exists(int(parts[1])):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def main(argv: list[str]) -> None:
    """Entrypoint of every rank: put the target rank into the namespace, then exec the script
    (same pid, so the launcher's view of the worker is unchanged)."""
    if not argv:
        raise SystemExit("usage: python -m chaos.netns SCRIPT [ARGS...]  (with CHAOS_NETNS set)")
    cmd = [sys.executable, "-u", *argv]
    spec = os.environ.get(ENV)
    if spec:
        link = json.loads(spec)
        if int(os.environ.get("RANK", "-1")) == link["rank"]:
            os.environ["MASTER_ADDR"] = link["host_ip"]
            os.environ["GLOO_SOCKET_IFNAME"] = link["ns_if"]
            cmd = ["nsenter", f"--net=/var/run/netns/{link['ns']}", "--", *cmd]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = link["host_if"]
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
