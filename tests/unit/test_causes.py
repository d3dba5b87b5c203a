"""What the agent learns of a dead or silent worker's process from the kernel."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from resilient.contract import wait_exited
from resilient.launcher.causes import _stopped


def _sleeper() -> subprocess.Popen[bytes]:
    # a process that lives until its stdin closes
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_process_is_told_from_a_running_one(wait_until: Any) -> None:
    p = _sleeper()
    try:
        assert not _stopped(p.pid)
        p.send_signal(signal.SIGSTOP)
        wait_until(lambda: _stopped(p.pid), 10, "SIGSTOP to show in /proc")
        p.send_signal(signal.SIGCONT)
        wait_until(lambda: not _stopped(p.pid), 10, "SIGCONT to show in /proc")
    finally:
        p.kill()
        p.wait(10)
    assert not _stopped(p.pid)  # (gone: not stopped)


def test_waiting_for_a_predecessor_ends_with_its_exit_and_is_bounded() -> None:
    p = _sleeper()
    try:
        t0 = time.monotonic()
        assert not wait_exited(p.pid, 0.2)  # alive: the bound ends the wait
        assert time.monotonic() - t0 >= 0.15
        p.kill()
        assert wait_exited(p.pid, 10)  # exited (a zombie until reaped still counts)
    finally:
        p.kill()
        p.wait(10)
    assert wait_exited(p.pid, 0.0)  # reaped: no such process
