"""``wait_until``: poll for what another process or thread brings about, always bounded by a timeout.

Tests and fixtures take it as the ``wait_until`` fixture (tests/conftest.py); helpers outside a test
function (a class wrapping a subprocess, say) import it: ``from tests._wait import wait_until``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    interval: float = 0.05,
) -> T:
    """Call ``predicate()`` every ``interval`` seconds until it returns a truthy value; return that value.

    ``predicate`` is called at least once, and once more when ``timeout`` seconds have passed; if it
    never returned a truthy value the test fails with "timed out after {timeout}s waiting for {what}".
    ``what`` is a description, or a zero-argument callable that makes one only then (e.g. to show a
    process's output so far). Whatever ``predicate`` raises propagates at once: raise (or assert)
    in it to fail fast, e.g. when the process that should bring the condition about has exited.
    """
    __tracebackhide__ = True  # a failure points at the caller's line, not at this loop
    if not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"wait_until needs a finite timeout >= 0, got {timeout!r}")
    if not interval > 0:
        raise ValueError(f"wait_until needs an interval > 0, got {interval!r}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(interval, left))
    description = what() if callable(what) else what
    pytest.fail(f"timed out after {timeout}s waiting for {description}")
