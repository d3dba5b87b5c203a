"""The README's snippet, copied into a directory of its own (a user's project, not this
repository), runs under torchrun as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def _snippet() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("Three lines added to a DDP script")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None, "the README lost its snippet"
    return block.group(1)


def test_the_readme_snippet_runs_as_written_outside_the_repository(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_snippet())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "CHAOS_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)  # (the installed package, as a user has it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "resilient_runs").glob("*/events.jsonl"))
    assert runs and '"run_finished"' in runs[0].read_text()
