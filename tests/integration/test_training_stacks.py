"""User-style training scripts (examples/): an FSDP2 transformer and a DDP epoch loop over a
DataLoader, each under a real fault, must end bit for bit where the fault-free run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.harness import run_ranks
from tests.integration.conftest import ROOT, assert_bit_exact

pytestmark = pytest.mark.integration

FSDP2 = str(ROOT / "examples" / "train_fsdp2.py")
EPOCHS = str(ROOT / "examples" / "train_ddp_epochs.py")


def _run(
    tmp: Path, name: str, argv: list[str], plan: str = "", restored: int | None = None
) -> list[dict[str, Any]]:
    cwd = tmp / name
    cwd.mkdir(parents=True)
    env = {"CHAOS_FINAL_STATE": str(cwd / "state")}
    if plan:
        env["CHAOS_PLAN"] = plan
    res = run_ranks(argv, 2, cwd=cwd, run_id=name, env=env, timeout=180)
    assert res.ok, res.describe()
    fired = res.of("fault_detected")
    assert bool(fired) == bool(plan), fired
    if restored is not None:
        assert {e["step"] for e in res.of("state_restored")} == {restored}, res.of("state_restored")
    return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _same(ref: list[dict[str, Any]], hit: list[dict[str, Any]]) -> int:
    n = 0
    for r, (a, b) in enumerate(zip(ref, hit, strict=True)):
        for s in (a, b):  # the RNG state the loader's current pass began from: compared via the stream
            s.get("loader", {}).pop("rng", None)
        n += assert_bit_exact(a, b, f"rank{r}")
    return n


def test_fsdp2_transformer_recovers_bit_exact(tmp_path: Path) -> None:
    argv = [FSDP2, "--steps", "24"]
    ref = _run(tmp_path, "ref", argv)
    hit = _run(tmp_path, "hit", argv, plan="exception@13:1")
    # the model and AdamW state are each rank's local shards (FSDP2 keeps them as DTensors)
    assert "__dtensor__" in next(iter(ref[0]["model"].values()))
    assert _same(ref, hit) > 60


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_epoch_loop_resumes_mid_epoch_bit_exact(tmp_path: Path, workers: int) -> None:
    # snapshots every 5 steps, 16 batches an epoch: the fault at step 23 restores step 20, the
    # 5th batch of the 2nd epoch; dropout and the loader's worker RNGs must continue as they were
    cfg = tmp_path / "every5.yaml"
    cfg.write_text("snapshot:\n  interval: 5\n")
    argv = [EPOCHS, "--epochs", "2", "--num-workers", str(workers)]
    ref = _run(tmp_path, "ref", argv)
    hit = _run(tmp_path, "hit", [*argv, "--config", str(cfg)], plan="exception@23:1", restored=20)
    assert _same(ref, hit) >= 8


def test_hsdp_on_a_2d_mesh_recovers_bit_exact_at_4_ranks(tmp_path: Path) -> None:
    # the peers of the failing rank block in an all-gather on a mesh dimension's own group: the
    # abort must reach that group too, or they wait out the collective timeout and die
    argv = [FSDP2, "--steps", "16", "--hsdp"]

    def run(name: str, plan: str = "") -> list[dict[str, Any]]:
        cwd = tmp_path / name
        cwd.mkdir()
        env = {"CHAOS_FINAL_STATE": str(cwd / "state"), **({"CHAOS_PLAN": plan} if plan else {})}
        res = run_ranks(argv, 4, cwd=cwd, run_id=name, env=env, timeout=240)
        assert res.ok, res.describe()
        assert len({e["pid"] for e in res.events if e["rank"] == 0}) == 1  # in-process
        return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in range(4)]

    ref, hit = run("ref"), run("hit", "exception@9:3")
    placements = next(iter(ref[0]["model"].values()))["__dtensor__"]["placements"]
    assert placements == [["replicate"], ["shard", 0]]  # a 2-D (HSDP) layout was really kept
    pairs = enumerate(zip(ref, hit, strict=True))
    assert sum(assert_bit_exact(a, b, f"rank{r}") for r, (a, b) in pairs) > 400
