"""Where this process's threads are: what a fault report records, and how a hang is told apart
from a wait for a peer (the main thread blocked in a collective is a victim, not a culprit)."""

from __future__ import annotations

import sys
import threading
import traceback
import types

# Files whose frames, innermost on the main thread, mean "blocked waiting for peers".
_COLLECTIVE_MODULES = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/distributed.py",
    "resilient/detectors/collectives.py",  # waiting for a peer's collective count: a victim's wait too
)


def all_stacks(limit: int = 16000) -> str:
    """The Python stack of every thread of this process, main thread first (a fault report's)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + "\n... (cut)"


def main_thread_where() -> tuple[str, bool]:
    """Innermost frame of the main thread, and whether it sits in a collective / backward pass
    (a victim waiting for a peer) rather than in the rank's own code (a culprit, when it hangs)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?", False
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    f: types.FrameType | None = frame
    for _ in range(4):  # the innermost Python frames around the blocking C++ call
        if f is None:
            break
        if any(m in f.f_code.co_filename for m in _COLLECTIVE_MODULES):
            return where, True
        f = f.f_back
    return where, False
