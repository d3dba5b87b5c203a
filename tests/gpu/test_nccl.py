"""The NCCL/CUDA path for real: run on a GPU machine with `pytest -m gpu tests/gpu`.

One rank per GPU (NCCL refuses two ranks on one device). A real exception and a real CUDA OOM
are recovered in-process and the final state equals the fault-free run's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from chaos.compare import assert_bit_exact
from tests.integration.conftest import load_states, run_example

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is present)"),
]


def _nproc() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def test_nccl_recovers_exception_and_cuda_oom_bit_exact(tmp_path):
    n = _nproc()
    ref = run_example(tmp_path / "ref", n, "--backend", "nccl")
    assert ref.ok, ref.describe()
    hit = run_example(
        tmp_path / "hit", n, "--backend", "nccl", "--fault", f"exception@6:{n - 1},cuda_oom@14:0"
    )
    assert hit.ok, hit.describe()
    kinds = [e["kind"] for e in hit.of("fault_detected") if e["rank"] == 0]
    assert kinds == ["exception", "oom"], kinds
    a, b = load_states(tmp_path / "ref", n), load_states(tmp_path / "hit", n)
    for r in range(n):
        assert assert_bit_exact(a[r]["model"], b[r]["model"]) > 20
        assert assert_bit_exact(a[r]["optimizer"], b[r]["optimizer"]) > 20
    assert {e["backend"] for e in hit.of("run_started")} == {"nccl"}
