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


@pytest.mark.slow  # (CI's budget: sharded 4 -> 2 with a corrupt shard stays in CI)
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


# --- the same through Checkpointer: checksummed, committed with the rest, verified before loading ----
CKPT_WORKER = str(Path(__file__).with_name("_ckpt_shard_worker.py"))


def _ckpt(tmp: Path, phase: str, nproc: int) -> None:
    res = run_ranks([CKPT_WORKER, phase, str(tmp / "ck")], nproc, cwd=tmp, run_id=f"ck-{phase}", timeout=90)
    assert res.ok, res.describe()


def test_checkpointer_sharded_4_to_2_and_corrupt_shard_falls_back(tmp_path: Path) -> None:
    from resilient.checkpoint.manifest import MANIFEST, read_manifest

    _ckpt(tmp_path, "save", 4)
    manifest = read_manifest(tmp_path / "ck" / "step-00000002" / MANIFEST)
    dcp = manifest.sharded_files()
    assert any(f.path.endswith(METADATA_FILE) for f in dcp) and len(dcp) >= 5
    assert not list((tmp_path / "ck").glob("*.tmp"))

    _ckpt(tmp_path, "load", 2)  # newest: step 2, resharded from 4 ranks to 2
    info = json.loads((tmp_path / "load.json").read_text())
    assert info == {"step": 2, "state": False}  # per-rank state is not restored at another world size
    assert _assert_equal(torch.load(tmp_path / "save2.pt"), torch.load(tmp_path / "load.pt"), "s2") > 0

    shard = next(tmp_path / "ck" / f.path for f in dcp if f.path.endswith(".distcp") and f.size > 0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of one rank's shard
    shard.write_bytes(bytes(data))
    _ckpt(tmp_path, "load", 2)  # every rank verifies every shard: all fall back to step 1 together
    assert json.loads((tmp_path / "load.json").read_text())["step"] == 1
    assert _assert_equal(torch.load(tmp_path / "save1.pt"), torch.load(tmp_path / "load.pt"), "s1") > 0


# --- the runtime's own resharding reads shards by the indices their saved layout implies -------------
def test_saved_layouts_name_the_indices_each_rank_holds_fsdp2_over_tp(tmp_path: Path) -> None:
    # FSDP2 over tensor parallel on a 2x2 mesh: Shard (uneven), _StridedShard and Replicate leaves
    worker = str(Path(__file__).with_name("_layouts_worker.py"))
    res = run_ranks([worker], 4, cwd=tmp_path, run_id="layouts", timeout=120)
    assert res.ok, res.describe()
    for r in res.ranks:
        assert "checked 18 kinds ['replicate', 'shard', 'strided']" in r.stdout, r.stdout
