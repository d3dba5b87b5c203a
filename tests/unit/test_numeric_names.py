"""torch's store sockets format addresses without a reverse DNS lookup (resilient/native/names.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chaos import netns
from resilient.native import names

ROOT = Path(__file__).resolve().parents[2]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects: Linux only")


@linux
def test_torchs_import_of_getnameinfo_points_at_the_numeric_one() -> None:
    import torch

    from resilient.native import _numeric_names  # type: ignore[attr-defined]

    assert names.apply() is None
    assert "libtorch_cpu.so" in names.applied()
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    maps = names._mappings()
    path = next(p for p in maps if os.path.realpath(p) == os.path.realpath(lib))
    start = next(lo for lo, _, off, _ in sorted(maps[path]) if off == 0)
    slots = names._slots(path)
    assert slots, "libtorch_cpu.so imports getnameinfo"
    page = os.sysconf("SC_PAGE_SIZE")
    for s in slots:
        held = ctypes.c_void_p.from_address(start + s.offset - (s.first_load_vaddr & ~(page - 1))).value
        assert held == _numeric_names.address()
    assert names.apply() is None  # (once per process)


_PROBE = textwrap.dedent(
    """
    import datetime, socket, sys, time
    sys.path.insert(0, {root!r})
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hole.bind(("127.0.0.1", 53))  # the name server: it is asked, and never answers
    if sys.argv[1] == "numeric":
        from resilient.native import names
        assert names.apply() is None
    import torch.distributed as dist
    t = datetime.timedelta(seconds=30)
    t0 = time.monotonic()
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=t, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=t)
    client.set("k", "v")
    print(time.monotonic() - t0)
    """
)


@pytest.fixture
def deaf_resolver(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A network namespace whose resolver (``ip netns exec`` mounts its resolv.conf) waits 2 s
    for a name server that never answers; removed even when the test fails."""
    why = netns.capability()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    name = f"rnames-{os.getpid()}"
    conf = Path("/etc/netns") / name
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        conf.mkdir(parents=True)
        (conf / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:2 attempts:1\n")
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        for f in conf.glob("*"):
            f.unlink()
        if conf.exists():
            conf.rmdir()


@linux
def test_a_name_server_that_never_answers_no_longer_delays_the_store(
    deaf_resolver: str, tmp_path: Path
) -> None:
    # torch's own formatting of a socket's address waits the resolver's timeout (2 s here) for
    # a reverse lookup; the numeric form asks nobody
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE.format(root=str(ROOT)))
    took = {}
    for mode in ("torch", "numeric"):
        r = subprocess.run(["ip", "netns", "exec", deaf_resolver, sys.executable, str(probe), mode],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        took[mode] = float(r.stdout.split()[-1])
    assert took["torch"] >= 1.9, took  # (the control: the lookup did wait for the deaf server)
    assert took["numeric"] < 0.5, took
