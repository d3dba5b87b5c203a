"""The pipeline example on NCCL (point-to-point sends between GPUs): run on a machine with two GPUs
or more, `pytest -m gpu tests/gpu`. One rank per GPU (NCCL refuses two ranks on one device): two
stages, a real exception in the last stage's backward, recovered in-process, bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chaos.compare import assert_bit_exact
from chaos.harness import run_ranks
from tests.integration.conftest import ROOT

_GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_GPUS < 2, reason=f"needs 2 CUDA GPUs, one a stage (NCCL: one a rank); {_GPUS} here"),
]


def test_nccl_pipeline_recovers_a_fault_in_a_backward_bit_exact(tmp_path: Path) -> None:
    states = []
    for name, plan in (("ref", ""), ("hit", "exception@9:1/backward2")):
        cwd = tmp_path / name
        cwd.mkdir()
        env = {"CHAOS_FINAL_STATE": str(cwd / "state"), **({"CHAOS_PLAN": plan} if plan else {})}
        argv = [str(ROOT / "examples" / "train_pipeline.py"), "--steps", "16", "--backend", "nccl"]
        res = run_ranks(argv, 2, cwd=cwd, run_id=name, env=env, timeout=300)
        assert res.ok, res.describe()
        assert {e["backend"] for e in res.of("run_started")} == {"nccl"}
        if plan:
            restored = res.of("state_restored")
            assert {(e["rank"], e["step"]) for e in restored} == {(0, 9), (1, 9)}, restored
        states.append([torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in (0, 1)])
    for r in (0, 1):
        assert assert_bit_exact(states[0][r], states[1][r], f"rank{r}") > 50
