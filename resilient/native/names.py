"""Socket addresses in torch's c10d without a reverse DNS lookup.

torch's ``TCPStore`` formats the address of every socket it accepts or connects with
``getnameinfo()`` and no ``NI_NUMERICHOST`` (c10d ``socket.cpp``; eagerly, not only when it
logs): each connection asks the system's resolver for the peer's name. Where the name server
does not answer at once (a lost UDP packet, a loaded cluster DNS, a sandbox), the resolver waits
its timeout (5 s by default) — on the store server's event loop, so that every rank's requests
stall meanwhile, and a fault-free job's step checks look like a hang (docs/control-plane.md has
the measurement). Nothing of the name is used: torch falls back to the numeric form itself when
the lookup fails.

:func:`apply` points the dynamic linker's slot for ``getnameinfo`` in torch's own libraries (and
only there: the rest of the process resolves names as before) at a version that asks for the
numeric host, from a small C extension (``resilient/native/_numeric_names.c``). Linux, ELF, x86-64
and AArch64; elsewhere, or when anything about the library is not as expected, it changes nothing
and says why (:func:`apply` returns the reason).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_SYMBOL = b"getnameinfo"
# relocation types that hold a function's address: (JUMP_SLOT, GLOB_DAT) per machine
_SLOT_TYPES = {62: (7, 6), 183: (1026, 1025)}  # EM_X86_64, EM_AARCH64
_SHT_RELA = 4
_PT_LOAD = 1
_lock = threading.Lock()
_applied: list[str] | None = None
_why_not: str | None = None
_warned = threading.Event()


@dataclass(frozen=True)
class _Slot:
    offset: int  # r_offset: where the address lives, relative to the load bias
    first_load_vaddr: int  # the first PT_LOAD's virtual address (the bias is computed against it)


def _slots(path: str) -> list[_Slot]:
    """The relocation slots of ``getnameinfo`` in the ELF shared object at ``path``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return []
    (machine,) = struct.unpack_from("<H", data, 18)
    types = _SLOT_TYPES.get(machine)
    if types is None:
        return []
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    loads = [struct.unpack_from("<IIQQ", data, phoff + i * phentsize) for i in range(phnum)]
    first = min((vaddr for ptype, _, _, vaddr in loads if ptype == _PT_LOAD), default=0)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _name, stype, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if stype != _SHT_RELA or not entsize:
            continue
        _, _, _, _, symoff, _, strlink, _, _, symentsize = sections[link]
        stroff = sections[strlink][4]
        for i in range(size // entsize):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, off + i * entsize)
            if (r_info & 0xFFFFFFFF) not in types:
                continue
            (st_name,) = struct.unpack_from("<I", data, symoff + (r_info >> 32) * symentsize)
            end = data.index(b"\0", stroff + st_name)
            if data[stroff + st_name : end] == _SYMBOL:
                out.append(_Slot(r_offset, first))
    return out


def _mappings() -> dict[str, list[tuple[int, int, int, str]]]:
    """Each mapped file of this process: its (start, end, file offset, permissions) mappings."""
    maps: dict[str, list[tuple[int, int, int, str]]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.setdefault(parts[5], []).append((lo, hi, int(parts[2], 16), parts[1]))
    return maps


def _torch_libraries(maps: dict[str, list[tuple[int, int, int, str]]]) -> list[str]:
    import torch

    lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib")) + os.sep
    return sorted(p for p in maps if os.path.realpath(p).startswith(lib) and ".so" in os.path.basename(p))


def _write(addr: int, value: int, maps: list[tuple[int, int, int, str]]) -> None:
    """Store ``value`` at ``addr`` (a slot of a mapped library), making its page writable for
    the store if it is not (a RELRO page) and putting its protection back."""
    perms = next((p for lo, hi, _, p in maps if lo <= addr < hi), None)
    if perms is None:
        raise OSError(f"{addr:#x} is not mapped")
    if "w" in perms:
        ctypes.c_void_p.from_address(addr).value = value
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    base = addr & ~(page - 1)
    prot = (1 if "r" in perms else 0) | (4 if "x" in perms else 0)
    if libc.mprotect(base, page, prot | 2) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    try:
        ctypes.c_void_p.from_address(addr).value = value
    finally:
        libc.mprotect(base, page, prot)


def apply() -> str | None:
    """Point torch's libraries' ``getnameinfo`` at the numeric one (once per process); None when
    done (or nothing needed it), else why it was not done."""
    global _applied, _why_not
    with _lock:
        if _applied is not None or _why_not is not None:
            return _why_not
        if not sys.platform.startswith("linux"):
            _why_not = f"not on {sys.platform} (Linux/ELF only)"
            return _why_not
        try:
            from resilient.native import _numeric_names  # type: ignore[attr-defined]

            target = int(_numeric_names.address())
            maps = _mappings()
            done = []
            for path in _torch_libraries(maps):
                slots = _slots(path)
                mine = sorted(maps[path])
                at_zero = next((lo for lo, _, off, _ in mine if off == 0), None)
                if not slots or at_zero is None:
                    continue
                for slot in slots:
                    bias = at_zero - (slot.first_load_vaddr & ~(os.sysconf("SC_PAGE_SIZE") - 1))
                    _write(bias + slot.offset, target, mine)
                done.append(os.path.basename(path))
            _applied = done
            return None
        except Exception as e:  # (an optimisation of the control plane: torch works without it)
            _why_not = f"{type(e).__name__}: {e}"
            return _why_not


def applied() -> list[str]:
    """The libraries whose ``getnameinfo`` is the numeric one now."""
    return list(_applied or [])


def apply_or_warn() -> None:
    """:func:`apply`, saying once why not where it cannot be done."""
    why = apply()
    if why is not None and not _warned.is_set():
        _warned.set()
        from loguru import logger

        logger.warning("torch's store sockets keep their reverse DNS lookups: {}", why)
