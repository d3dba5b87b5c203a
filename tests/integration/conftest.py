"""Multi-process fixtures: the example as real gloo ranks, and its fault-free reference state."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.compare import assert_bit_exact  # noqa: F401 - re-exported for the tests
from chaos.harness import RunResult, run_ranks
from tests.integration.slurm_cluster import slurm_cluster  # noqa: F401 - the fixture (test_slurm.py)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
STEPS = 24
_ids = itertools.count()


def run_example(
    tmp: Path,
    nproc: int,
    *args: str,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    on_start: Any = None,
) -> RunResult:
    tmp.mkdir(parents=True, exist_ok=True)
    return run_ranks(
        [EXAMPLE, "--steps", str(STEPS), "--out", str(tmp / "state"), *args],
        nproc,
        cwd=tmp,
        run_id=f"t{next(_ids)}",
        timeout=timeout,
        env=env,
        on_start=on_start,
    )


def load_states(tmp: Path, nproc: int) -> list[dict[str, Any]]:
    return [torch.load(tmp / "state" / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Fault-free final states, by world size (computed lazily, once per session)."""
    cache: dict[int, list[dict[str, Any]]] = {}

    class Ref(dict):  # type: ignore[type-arg]
        def __missing__(self, nproc: int) -> list[dict[str, Any]]:
            d = tmp_path_factory.mktemp(f"ref{nproc}")
            res = run_example(d, nproc)
            assert res.ok, res.describe()
            assert not res.of("fault_detected")
            assert not res.of("untracked_state"), res.of("untracked_state")  # (the example keeps none)
            self[nproc] = load_states(d, nproc)
            return self[nproc]

    return Ref(cache)


@pytest.fixture
def memory_cgroup() -> Any:
    """A real cgroup v1 memory limit of 700 MiB (root only); removed even if the test fails."""
    from chaos.cgroup import memory_cgroup as make
    from chaos.cgroup import remove_cgroup

    cg, why = make(700)
    if cg is None:
        pytest.skip(why)
    try:
        yield cg
    finally:
        remove_cgroup(cg, strict=True)


def admitted_restore(res: Any, snapshot: int) -> int:
    """The step every rank restored after one soft fault, held to what the rules admit, not to
    what a quiet machine happens to do: the step in flight where every rank vouched for its live
    state (``source: live``: the faulted rank's step, whichever step a peer had reached), else
    ``snapshot`` (the newest one every rank holds), with each rank's reason in ``live_refused``."""
    agreed = res.of("restore_agreed")
    (faulted,) = {e["origin_step"] for e in res.of("fault_detected")}
    restored = {e["step"] for e in res.of("state_restored")}
    assert agreed and len(restored) == 1, (agreed, res.of("state_restored"))
    step = int(restored.pop())
    for e in agreed:
        if e["source"] in ("live", "peer"):
            assert e["step"] == faulted == step, e
        else:
            assert e["step"] == step == snapshot and e.get("live_refused"), e
    return step
