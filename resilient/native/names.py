"""Socket addresses in torch's c10d without a reverse DNS lookup.

torch's ``TCPStore`` formats the address of every socket it accepts or connects with
``getnameinfo(..., NI_NUMERICSERV)`` and no ``NI_NUMERICHOST`` (c10d ``socket.cpp``,
``formatSockAddr``; eagerly, not only when it logs): each connection asks the system's resolver
for the peer's name. Where the name server does not answer at once (a lost UDP packet, a loaded
cluster DNS, a sandbox), the resolver waits its timeout (5 s by default) — on the store server's
event loop, so that every rank's requests stall meanwhile, and a fault-free job's step checks look
like a hang (docs/control-plane.md has the measurement). Nothing of the name is used: torch falls
back to the numeric form itself when the lookup fails.

:func:`apply` points the dynamic linker's slots for ``getnameinfo`` in torch's own loaded
libraries (and only there: the rest of the process resolves names as before) at a version that
asks for the numeric host, from a small C extension (``resilient/native/_numeric_names.c``) that
reads the loaded images' dynamic sections and overwrites a slot only where it holds what the
dynamic linker put there. Linux, ELF, x86-64 and AArch64; elsewhere, without the extension (it is
optional at install), or when anything about a library is not as expected, it changes nothing there
and says why (:func:`apply` returns the reason).

Upstream: torch 2.9.1, 2.13.0, 2.14.1 and 2.15.0 all call ``getnameinfo`` from ``libtorch_cpu.so``
with ``NI_NUMERICSERV`` only (``benchmarks/store_names.py``: an ``LD_PRELOAD`` interposer, 4 calls
for one server and one client, each with the flag after :func:`apply`), so it is applied on every
torch the project supports. Its
``formatSockAddr`` stops calling it for the rest of the process once a lookup *fails* (the
behaviour of pytorch/pytorch#159596, for #159007): a name server that never answers costs one
timeout per process, but one that loses an answer and then gives one costs the timeout on every
connection. No upstream change that adds ``NI_NUMERICHOST`` was found (docs/control-plane.md,
"Still needed upstream").
"""

from __future__ import annotations

import os
import sys
import threading

_KEEP = "torch's store sockets keep their reverse DNS lookups"
NOT_BUILT = (
    f"the C extension resilient.native._numeric_names was not built (no compiler at install?): {_KEEP}"
)
_lock = threading.Lock()
_done: dict[tuple[str, ...] | None, str | None] = {}  # each apply()'s outcome, by its prefixes
_numeric: set[str] = set()
_warned = False


def _torch_lib() -> tuple[str, ...]:
    import torch

    return (os.path.join(os.path.dirname(torch.__file__), "lib"),)


def _patch(prefixes: tuple[str, ...] | None) -> str | None:
    """Patch the loaded objects under the directories ``prefixes``; None, or why not all of them."""
    if not sys.platform.startswith("linux"):
        return f"not on {sys.platform} (Linux/ELF only)"
    try:
        from resilient.native import _numeric_names
    except ImportError:
        return NOT_BUILT
    wanted = _torch_lib() if prefixes is None else prefixes
    dirs = tuple(os.path.join(os.path.realpath(p), "") for p in wanted)  # (directories, real paths)
    problems = []
    for path, numeric, why in _numeric_names.patch(dirs):
        if numeric:
            _numeric.add(os.path.basename(path))
        if why:
            problems.append(f"{os.path.basename(path)}: {why}")
    return "; ".join(problems) or None


def apply(prefixes: tuple[str, ...] | None = None) -> str | None:
    """Point the ``getnameinfo`` of the loaded libraries in the directories ``prefixes`` (torch's
    own by default) at the numeric one, once per process; None when done (or nothing needed it),
    else why it was not done."""
    key = None if prefixes is None else tuple(prefixes)
    with _lock:
        if key not in _done:
            try:
                _done[key] = _patch(key)
            except Exception as e:  # (an optimisation of the control plane: torch works without it)
                _done[key] = f"{type(e).__name__}: {e}"
        return _done[key]


def applied() -> list[str]:
    """The libraries whose ``getnameinfo`` is the numeric one now."""
    return sorted(_numeric)


def describe() -> str:
    """What this process's store sockets do now, for its ``run_started`` event: ``numeric``
    (and where), or ``lookups`` (and why: not applied, or what :func:`apply` said)."""
    if _numeric:
        return f"numeric ({', '.join(applied())})"
    why = _done.get(None)
    return f"lookups ({why})" if why else "lookups (not applied: store_name_lookups)"


def apply_or_warn() -> None:
    """:func:`apply`, saying once why not where it cannot be done."""
    global _warned
    why = apply()
    if why is None:
        return
    with _lock:
        first, _warned = not _warned, True
    if first:
        from loguru import logger

        logger.warning("{}", why if why.endswith(_KEEP) else f"{_KEEP}: {why}")
