import os
import warnings
from collections.abc import Iterator

import pytest

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
