"""torch's store sockets format addresses without a reverse DNS lookup (resilient/native/names.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from chaos import netns
from resilient.native import names

ROOT = Path(__file__).resolve().parents[2]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects: Linux only")


def _extension() -> ModuleType:
    """The C extension, imported when a test needs it (the fallback's test needs it absent)."""
    from resilient.native import _numeric_names

    return _numeric_names


@linux
def test_torchs_slots_of_getnameinfo_point_at_the_numeric_one() -> None:
    ext = _extension()
    assert names.apply() is None
    assert "libtorch_cpu.so" in names.applied()
    cpu = os.path.realpath(os.path.join(names._torch_lib()[0], "libtorch_cpu.so"))
    slots = ext.slots(cpu)
    assert slots, "libtorch_cpu.so imports getnameinfo"
    assert [held for _, held, _ in slots] == [ext.address()] * len(slots)
    assert names.apply() is None  # (once per process)
    again = {path: (numeric, why) for path, numeric, why in ext.patch((os.path.dirname(cpu) + os.sep,))}
    assert again[cpu] == (len(slots), "")  # (already numeric: nothing written, nothing refused)


_LIBRARY = r"""
#include <arpa/inet.h>
#include <netdb.h>
#include <string.h>
#include <sys/socket.h>

static const struct sockaddr *address_of(const char *ip, struct sockaddr_in *sa) {
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    inet_pton(AF_INET, ip, &sa->sin_addr);
    return (const struct sockaddr *)sa;
}

#ifdef BY_ADDRESS
typedef int (*gni)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);

/* takes getnameinfo's address: its slot is a GLOB_DAT (a linker makes the calls of an object
 * that also takes the address go through that slot, hence a library of its own) */
int fmt(const char *ip, char *out, int n) {
    struct sockaddr_in sa;
    gni volatile f = getnameinfo;
    return f(address_of(ip, &sa), sizeof sa, out, (socklen_t)n, NULL, 0, 0);
}

/* someone else's getnameinfo (in another object than the slot's: not its PLT) */
int foreign(const struct sockaddr *sa, socklen_t salen, char *out, socklen_t n, char *serv,
            socklen_t servlen, int flags) {
    (void)sa; (void)salen; (void)serv; (void)servlen; (void)flags;
    strncpy(out, "foreign", n);
    return 0;
}
#else
/* calls getnameinfo: its slot is a JUMP_SLOT */
int fmt(const char *ip, char *out, int n) {
    struct sockaddr_in sa;
    return getnameinfo(address_of(ip, &sa), sizeof sa, out, (socklen_t)n, NULL, 0, 0);
}

int fmt_flags(const char *ip, char *out, int n, int flags) {
    struct sockaddr_in sa;
    return getnameinfo(address_of(ip, &sa), sizeof sa, out, (socklen_t)n, NULL, 0, flags);
}
#endif
"""

# each library by the kind of its getnameinfo slot: its name, its defines
_BUILDS = {"JUMP_SLOT": ("libcalls.so", ()), "GLOB_DAT": ("libaddress.so", ("-DBY_ADDRESS",))}


class _Library:
    """One of the test's own shared objects, loaded with lazy or immediate binding."""

    def __init__(self, path: Path, binding: str) -> None:
        self.path = os.path.realpath(path)
        self.lazy = binding == "lazy"
        self._libc = ctypes.CDLL(None)
        self._libc.dlopen.restype = ctypes.c_void_p
        self._libc.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._libc.dlclose.argtypes = [ctypes.c_void_p]
        self._handle = self._libc.dlopen(self.path.encode(), os.RTLD_LAZY if self.lazy else os.RTLD_NOW)
        assert self._handle, f"dlopen({self.path}) failed"
        self.lib = ctypes.CDLL(self.path, handle=self._handle)

    def call(self, fn: str = "fmt", *flags: int) -> str:
        out = ctypes.create_string_buffer(256)
        assert getattr(self.lib, fn)(b"127.0.0.1", out, len(out), *flags) == 0
        return out.value.decode()

    def slots(self) -> dict[str, tuple[int, int]]:
        """Its getnameinfo slots by kind: (address, what it holds)."""
        return {kind: (at, held) for at, held, kind in _extension().slots(self.path)}

    def close(self) -> None:
        self._libc.dlclose(self._handle)


@pytest.fixture
def libraries(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, _Library]]:
    """The test's two libraries by the kind of their slot (``JUMP_SLOT``: it calls getnameinfo;
    ``GLOB_DAT``: it takes its address), linked and loaded with ``request.param`` binding ("lazy"
    or "now"); unloaded after the test (pytest removes their directory)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (`cc`) to build the test's libraries")
    src = tmp_path / "fmt.c"
    src.write_text(_LIBRARY)
    loaded: dict[str, _Library] = {}
    try:
        for kind, (name, define) in _BUILDS.items():
            so = tmp_path / name
            link = [f"-Wl,-z,{request.param}", "-Wl,-z,relro"]
            r = subprocess.run([cc, "-shared", "-fPIC", "-O2", *define, *link, "-o", str(so), str(src)],
                               capture_output=True, text=True)  # fmt: skip
            assert r.returncode == 0, r.stderr
            loaded[kind] = _Library(so, request.param)
        yield loaded
    finally:
        for lib in loaded.values():
            lib.close()


def _real_getnameinfo() -> int:
    address = ctypes.cast(ctypes.CDLL(None).getnameinfo, ctypes.c_void_p).value
    assert address
    return address


def _page_perms(address: int) -> str:
    """The protection of the mapping holding ``address`` (the test's check; the patch reads no maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return perms
    raise AssertionError(f"{address:#x} is not mapped")


@linux
@pytest.mark.parametrize("libraries", ["lazy", "now"], indirect=True)
def test_a_library_of_its_own_formats_numerically_once_patched(
    libraries: dict[str, _Library], tmp_path: Path
) -> None:
    ext = _extension()
    calls, by_address = libraries["JUMP_SLOT"], libraries["GLOB_DAT"]
    assert list(calls.slots()) == ["JUMP_SLOT"] and list(by_address.slots()) == ["GLOB_DAT"]
    assert by_address.slots()["GLOB_DAT"][1] == _real_getnameinfo()
    named = by_address.call()
    if named == "127.0.0.1":
        pytest.skip("the resolver has no name for 127.0.0.1 here (/etc/hosts): nothing to tell apart")
    if calls.lazy and not os.environ.get("LD_BIND_NOW"):
        # not called yet: the slot still holds the object's own PLT stub, which is accepted
        assert calls.slots()["JUMP_SLOT"][1] != _real_getnameinfo()
    else:
        assert calls.call() == named

    assert names.apply(prefixes=(str(tmp_path),)) is None
    assert {"libcalls.so", "libaddress.so"} <= set(names.applied())
    for lib in (calls, by_address):
        ((kind, (at, held)),) = lib.slots().items()
        assert held == ext.address()
        assert lib.call() == "127.0.0.1"
        # a read-only (RELRO) page is read-only again; only a lazy JUMP_SLOT's page was writable
        assert ("w" in _page_perms(at)) == (lib.lazy and kind == "JUMP_SLOT")
    assert calls.call("fmt_flags", socket.NI_NAMEREQD) == named  # (a name required: still asked for)


@linux
@pytest.mark.parametrize("libraries", ["lazy"], indirect=True)
def test_a_slot_someone_else_pointed_elsewhere_is_left_alone_and_reported(
    libraries: dict[str, _Library], tmp_path: Path
) -> None:
    ext = _extension()
    calls, by_address = libraries["JUMP_SLOT"], libraries["GLOB_DAT"]
    foreign = ctypes.cast(by_address.lib.foreign, ctypes.c_void_p).value
    assert foreign
    at, _ = calls.slots()["JUMP_SLOT"]  # (lazy binding: its page is writable)
    ctypes.c_void_p.from_address(at).value = foreign

    why = names.apply(prefixes=(str(tmp_path),))
    assert why is not None and "libcalls.so" in why and "left alone" in why and f"{foreign:#x}" in why, why
    assert "libaddress.so" not in why
    assert calls.slots()["JUMP_SLOT"][1] == foreign
    assert by_address.slots()["GLOB_DAT"][1] == ext.address()
    assert calls.call() == "foreign"
    assert by_address.call() == "127.0.0.1"


_WITHOUT_EXTENSION = textwrap.dedent(
    """
    import datetime, sys
    sys.path.insert(0, {root!r})
    sys.modules["resilient.native._numeric_names"] = None  # (as if no compiler had built it)
    from loguru import logger
    logger.remove()
    warnings = []
    logger.add(warnings.append, level="WARNING")
    from resilient.native import names
    assert names.apply() == names.NOT_BUILT, names.apply()
    names.apply_or_warn()
    names.apply_or_warn()
    assert len(warnings) == 1 and names.NOT_BUILT in warnings[0], warnings
    assert names.applied() == []
    import torch.distributed as dist
    t = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=t, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=t)
    client.set("k", "v")
    assert server.get("k") == b"v"
    print("ok")
    """
)


@linux
def test_without_the_extension_apply_says_why_warns_once_and_the_store_works(tmp_path: Path) -> None:
    script = tmp_path / "without.py"
    script.write_text(_WITHOUT_EXTENSION.format(root=str(ROOT)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["ok"], r.stderr[-2000:]


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
def deaf_resolver(tmp_path: Path) -> Iterator[str]:
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


_OPT_OUT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    import torch
    from resilient.config import load_config
    from resilient.native import _numeric_names as ext, names
    from resilient.runtime.run.wiring import numeric_names
    cpu = os.path.realpath(os.path.join(names._torch_lib()[0], "libtorch_cpu.so"))
    ours = lambda: {{held == ext.address() for _, held, _ in ext.slots(cpu)}}
    numeric_names(load_config(None, store_name_lookups=True), False)  # the config's opt-out
    assert ours() == {{False}}, "store_name_lookups: true left torch's slots alone"
    numeric_names(load_config(None), True)  # RESILIENT_STORE_NAME_LOOKUPS=1
    assert ours() == {{False}}, "the launcher's variable left torch's slots alone"
    numeric_names(load_config(None), False)  # the default
    assert ours() == {{True}}
    print("ok")
    """
)


@linux
def test_the_opt_outs_keep_torchs_lookups_and_the_default_does_not(tmp_path: Path) -> None:
    probe = tmp_path / "opt_out.py"
    probe.write_text(_OPT_OUT.format(root=str(ROOT)))
    r = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1] == "ok", r.stderr[-2000:]
