"""Worker → agent heartbeats, and how the agent names a worker's death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resilient.contract import beat_path, read_beat
from resilient.launcher.causes import describe_exit


def test_beat_is_read_by_another_process_with_its_age_step_and_generation(tmp_path: Path) -> None:
    path = beat_path(tmp_path, 3)
    code = (
        "import sys; from pathlib import Path; from resilient.contract import Heartbeat;"
        f"h = Heartbeat(Path({str(path)!r})); h.generation = 5; h.beat(41); h.close()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    got = read_beat(path)
    # the generation is the one a replacement for this worker joins
    assert got is not None and got.step == 41 and got.generation == 5 and 0 <= got.age_s < 30


def test_no_file_or_no_beat_reads_as_none(tmp_path: Path) -> None:
    assert read_beat(tmp_path / "missing.hb") is None
    (tmp_path / "empty.hb").write_bytes(bytes(32))
    assert read_beat(tmp_path / "empty.hb") is None


def test_beating_thread_stops_when_the_process_is_stopped(tmp_path: Path, wait_until: Any) -> None:
    path = beat_path(tmp_path, 0)
    code = (
        "import time; from pathlib import Path; from resilient.contract import Heartbeat;"
        f"h = Heartbeat(Path({str(path)!r})); h.start(lambda: 7, interval=0.05); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code])

    def stepped() -> bool:  # the thread's first beat with a step
        if (b := read_beat(path)) is not None and b[1] == 7:
            return True
        assert p.poll() is None
        return False

    try:
        wait_until(stepped, 30, "the beating thread's first beat with step 7", interval=0.02)
        os.kill(p.pid, signal.SIGSTOP)  # a real freeze: no thread of it runs any more
        stopped_at = time.monotonic()
        time.sleep(0.5)  # the time span under test: the beat must age while the process is stopped
        age = read_beat(path)
        assert age is not None and age[0] >= 0.4 and time.monotonic() - stopped_at >= 0.5
        os.kill(p.pid, signal.SIGCONT)
        wait_until(  # beats resume
            lambda: (b := read_beat(path)) is None or b[0] <= 0.2,
            10,
            "the beats to resume after SIGCONT (a beat at most 0.2 s old)",
            interval=0.02,
        )
    finally:
        p.kill()
        p.wait()


def test_exit_descriptions() -> None:
    assert describe_exit(75, 1, None, None) == "exit code 75"
    assert describe_exit(-signal.SIGSEGV, 1, None, None) == "killed by SIGSEGV"
    cause = describe_exit(-signal.SIGKILL, 2**22 + 12345, 0, 0)  # a pid no kernel log line names
    assert cause == "killed by SIGKILL (not an OOM kill)"


def test_the_last_beat_says_the_worker_is_exiting(tmp_path: Path) -> None:
    # what a process does after the runtime closed (the script's end, the interpreter's teardown)
    # is not a hang: the agent reads that from the last beat
    from resilient.contract import Heartbeat

    path = beat_path(tmp_path, 0)
    h = Heartbeat(path)
    h.beat(7)
    beat = read_beat(path)
    assert beat is not None and beat.step == 7 and not beat.exiting
    h.close()
    beat = read_beat(path)
    assert beat is not None and beat.exiting and beat.step == 7  # (the step the metrics show)
