import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests._wait import wait_until as _wait_until

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)


@pytest.fixture
def caplog_loguru() -> Iterator[list[str]]:
    """Messages logged through loguru while the test runs (warnings and above)."""
    from loguru import logger

    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(sink)


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """:func:`tests._wait.wait_until`: poll a predicate until it holds, failing the test after a timeout.

    ``wait_until(predicate, timeout, what, *, interval=0.05)`` returns the predicate's first truthy value.
    """
    return _wait_until
