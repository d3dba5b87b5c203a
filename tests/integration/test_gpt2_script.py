"""A script in the shape of the popular single-file GPT-2 trainers (examples/train_gpt2_shards.py:
a hand-written loader over token shards, DDP's sync set at every micro-step, bf16 autocast,
validation, sampling, its own checkpoints, a log opened "w"), under the README's launch and real
faults: bit-exact with its fault-free run, its log whole, and, its loader left untracked, the
loader named in the first steps."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._wait import wait_until
from tests.integration.conftest import ROOT, assert_bit_exact
from tests.integration.test_launcher import Launch

pytestmark = pytest.mark.integration
SCRIPT = str(ROOT / "examples" / "train_gpt2_shards.py")
STEPS = 40


def _launch(cwd: Path, *extra: str, launch: tuple[str, ...] = ()) -> Launch:
    """The README's launch (every launcher flag at its default), the data shared by all runs."""
    data = cwd.parent / "shards"
    return Launch(
        cwd, "--standalone", "--nproc-per-node", "2", *launch,
        SCRIPT, "--steps", str(STEPS), "--data-dir", str(data), "--out", str(cwd / "state"), *extra,
    )  # fmt: skip


def _finals(cwd: Path) -> list[dict[str, Any]]:
    return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _log(cwd: Path) -> list[str]:
    return (cwd / "log_gpt2" / "log.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[str]]:
    cwd = tmp_path_factory.mktemp("gpt2") / "reference"
    run = _launch(cwd)
    assert run.finish() == 0, run.output()
    assert not [e for e in run.events() if e["event"] in ("untracked_state", "fault_detected")]
    return _finals(cwd), _log(cwd)


def _whole(log: list[str], reference: list[str]) -> None:
    """The log kept every line a fault-free run writes, in order (a replayed step may add its
    line again): never truncated by a restart."""
    assert log[0] == reference[0], log[:3]
    it = iter(log)
    missing = [line for line in reference if not any(line == got for got in it)]
    assert not missing, missing[:5]


def test_an_exception_mid_accumulation_ends_bit_exact_with_the_log_whole(
    tmp_path_factory: pytest.TempPathFactory, fault_free: tuple[list[dict[str, Any]], list[str]]
) -> None:
    cwd = tmp_path_factory.mktemp("gpt2") / "exception"
    run = _launch(cwd, launch=("--fault", "exception@23:1/forward1"))  # its second micro-step
    assert run.finish() == 0, run.output()
    assert [e["kind"] for e in run.events() if e["event"] == "fault_detected" and e["rank"] == 1] == [
        "exception"
    ]
    for r, (a, b) in enumerate(zip(fault_free[0], _finals(cwd), strict=True)):
        assert_bit_exact(a, b, f"rank{r}")
    _whole(_log(cwd), fault_free[1])


def test_rank_0_killed_is_replaced_and_its_log_kept_whole(
    tmp_path_factory: pytest.TempPathFactory, fault_free: tuple[list[dict[str, Any]], list[str]]
) -> None:
    # rank 0 writes the log: its replacement opens it under ctx.job_start (False): it appends
    cwd = tmp_path_factory.mktemp("gpt2") / "sigkill"
    run = _launch(cwd, "--step-ms", "150")
    try:
        run.wait_event("standby_ready")
        victim = int(run.wait_event("run_started", lambda e: e["rank"] == 0)["pid"])
        log = cwd / "log_gpt2" / "log.txt"  # rank 0 logs each step it completes
        wait_until(lambda: log.exists() and "2 train" in log.read_text(), 60, lambda: run.output())
        os.kill(victim, signal.SIGKILL)
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    replaced = [e for e in run.events() if e["event"] == "rank_replaced"]
    assert [e["global_rank"] for e in replaced] == [0], replaced
    for r, (a, b) in enumerate(zip(fault_free[0], _finals(cwd), strict=True)):
        assert_bit_exact(a, b, f"rank{r}")
    _whole(_log(cwd), fault_free[1])


def test_the_untracked_loader_is_named_in_the_first_steps_and_costs_the_run(
    tmp_path_factory: pytest.TempPathFactory, fault_free: tuple[list[dict[str, Any]], list[str]]
) -> None:
    cwd = tmp_path_factory.mktemp("gpt2") / "untracked"
    run = _launch(cwd, "--untracked", launch=("--fault", "exception@23:1"))
    assert run.finish() == 0, run.output()  # (it finishes: nothing raises)
    said = [e for e in run.events() if e["event"] == "untracked_state"]
    assert {e["rank"] for e in said} == {0, 1} and all(e["step"] == 2 for e in said), said
    names = {f["name"] for e in said for f in e["findings"]}
    assert names == {"train_loader"}, said  # (it has a state_dict: the fix is to track it)
    with pytest.raises(AssertionError):
        assert_bit_exact(fault_free[0][1], _finals(cwd)[1], "rank1")
