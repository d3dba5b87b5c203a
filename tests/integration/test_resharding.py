"""Sharded state written by 4 gloo ranks loads into 2 ranks (DTensor and FSDP2), bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.harness import run_ranks
from resilient.checkpoint.sharded import METADATA_FILE

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("_reshard_worker.py"))
GLOBAL = torch.arange(60, dtype=torch.float32).reshape(10, 6) / 7


def _run(tmp: Path, phase: str, nproc: int) -> None:
    # run_ranks kills every rank's process group in a finally, on success, failure and timeout alike
    res = run_ranks([WORKER, phase, str(tmp / "dcp")], nproc, cwd=tmp, run_id=phase, timeout=60)
    assert res.ok, res.describe()


def _assert_equal(expected: Any, got: Any, where: str) -> int:
    """Bit-exact comparison of two trees; returns how many tensors were compared."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), where
        return 1
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        return sum(_assert_equal(expected[k], got[k], f"{where}.{k}") for k in expected)
    if isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        return sum(
            _assert_equal(e, g, f"{where}[{i}]") for i, (e, g) in enumerate(zip(expected, got, strict=True))
        )
    assert got == expected, where
    return 0


def test_written_at_4_loads_at_2(tmp_path: Path) -> None:
    _run(tmp_path, "save", 4)
    written = [json.loads((tmp_path / f"written-{r}.json").read_text()) for r in range(4)]
    assert METADATA_FILE in written[0] and all(METADATA_FILE not in w for w in written[1:])
    on_disk = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert sorted(f for w in written for f in w) == on_disk  # every file is reported by one rank

    _run(tmp_path, "load", 2)
    saved = torch.load(tmp_path / "save.pt", weights_only=True)
    loaded = torch.load(tmp_path / "load.pt", weights_only=True)
    assert torch.equal(saved["dt"], GLOBAL)
    assert saved["extra"] == {"step": 2, "tag": "run-a"}
    assert saved["optim"]["param_groups"][0]["lr"] == 1e-2  # the load phase starts from lr=0.5
    # 4 parameters, and Adam's exp_avg, exp_avg_sq and step for each
    assert _assert_equal(saved, loaded, "state") == 1 + 4 + 4 * 3
