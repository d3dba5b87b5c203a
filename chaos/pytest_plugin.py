"""pytest plugin: assert a recovery certificate in your own repository's tests.

Enabled automatically once this package is installed (entry point ``resilient_chaos``)::

    import pytest

    @pytest.mark.chaos
    def test_my_training_survives_faults(chaos_certify):
        result = chaos_certify("configs/chaos/cpu.yaml", command=["train.py", "--steps", "40"],
                               classes=["exception", "sigkill"])
        result.assert_passed()          # names every class and SLO that failed

Markers: ``chaos`` (runs real faults: processes are killed, memory is exhausted), ``gpu`` (needs a
CUDA GPU and NCCL), ``slow`` (long certification or soak runs). Select with ``-m``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: injects real faults (kills, hangs, OOM) into training jobs")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and NCCL")
    config.addinivalue_line("markers", "slow: long-running certification or soak runs")


@dataclass
class CertificateResult:
    rows: list[dict[str, Any]]
    out: Path

    @property
    def passed(self) -> bool:
        return all(not r["failed"] for r in self.rows)

    def row(self, cls: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["class"] == cls)

    def assert_passed(self) -> None:
        failed = [r for r in self.rows if r["failed"]]
        bad = [f"{r['class']}: {', '.join(r['failed'])} {r['errors'] or ''}" for r in failed]
        where = self.out / "certificate.json"
        assert not bad, f"certificate failed ({where}):\n  " + "\n  ".join(bad)


@pytest.fixture
def chaos_certify(tmp_path: Path) -> Callable[..., CertificateResult]:
    """``chaos_certify(config, command=None, classes=None, trials=None)`` → :class:`CertificateResult`.

    Runs the certificate (a fault-free reference, then every selected class) in ``tmp_path``;
    every process it starts is killed by process group before it returns."""
    from chaos import certify, report, schedule

    def run(
        config: str | Path,
        command: Sequence[str] | None = None,
        classes: Sequence[str] | None = None,
        trials: int | None = None,
    ) -> CertificateResult:
        cert = schedule.load(config)
        if command is not None:
            cert = cert.model_copy(update={"job": cert.job.model_copy(update={"command": list(command)})})
        if trials is not None:
            fixed = {n: c.model_copy(update={"trials": trials}) for n, c in cert.classes.items()}
            cert = cert.model_copy(update={"classes": fixed})
        out = tmp_path / "certificate"
        ran = certify.certify(cert, out, list(classes) if classes else None)
        return CertificateResult(report.write(cert, ran, out), out)

    return run
