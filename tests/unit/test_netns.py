"""The veth link a link fault cuts: built, really cut, restored, removed (needs root: skipped otherwise)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from chaos import netns

WHY = netns.capability()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


def _reach(link: netns.VethLink, port: int) -> bool:
    """From inside the namespace, connect to the host end (1 s budget)."""
    code = (f"import socket,sys\ns=socket.socket();s.settimeout(1)\n"
            f"sys.exit(s.connect_ex(({link.host_ip!r},{port})))")  # fmt: skip
    r = subprocess.run(["nsenter", f"--net=/var/run/netns/{link.ns}", sys.executable, "-c", code], timeout=20)
    return r.returncode == 0


def test_link_carries_traffic_until_it_goes_down_and_after_it_returns() -> None:
    link = netns.VethLink.create(rank=1)
    srv = socket.socket()
    try:
        srv.bind((link.host_ip, 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        assert _reach(link, port)
        link.down()
        assert not _reach(link, port)  # a real dropped link: the connection cannot be made
        link.up()
        assert _reach(link, port)
    finally:
        srv.close()
        link.remove()
    assert not link.exists()
    link.remove()  # idempotent


def test_wrapper_needs_a_script() -> None:
    r = subprocess.run([sys.executable, "-m", "chaos.netns"], capture_output=True, text=True)
    assert r.returncode != 0 and "usage" in r.stderr


def test_a_killed_runs_namespace_is_swept_by_the_next_run() -> None:
    import subprocess as sp

    dead = sp.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: its namespace was left by a SIGKILLed harness
    name = f"rchaos-{dead.pid}-0"
    sp.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.sweep_stale()
        assert name not in sp.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        sp.run(["ip", "netns", "del", name], capture_output=True)
