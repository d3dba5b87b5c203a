"""The fault-kind registry: every kind one object, what the harness and the injector ask of it, the
one arranged-job context, and docs/chaos.md's table generated from it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from chaos import arranged, reference, schedule
from chaos.arranged import Unavailable, arranged_job
from chaos.faults import REGISTRY, ByHarness, FaultKind, InProcess, Where
from chaos.faults.link import LinkDrop
from chaos.faults.memory import CudaOom, KernelOom
from chaos.inject import KINDS, Injector

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_says_where_it_fires_and_implements_that() -> None:
    assert len(REGISTRY) >= 14 and list(REGISTRY) == [k.name for k in REGISTRY.values()]
    for name, k in REGISTRY.items():
        assert k.summary and isinstance(k.where, Where), name
        if k.in_process:  # fired by the injector: overrides inject
            assert type(k).inject is not FaultKind.inject, name
        if k.harness_lead is not None:  # done by the harness: overrides by_harness
            assert type(k).by_harness is not FaultKind.by_harness, name
        assert k.in_process or k.harness_lead is not None, name
    assert set(KINDS) == {n for n, k in REGISTRY.items() if isinstance(k, InProcess)}
    harness = REGISTRY.names(lambda k: isinstance(k, ByHarness))
    assert {"sigkill", "corrupt_checkpoint", "link_drop"} <= set(harness)


def test_a_plan_names_in_process_kinds_only() -> None:
    assert Injector.parse("segfault@7:1").faults[0].where == "step"
    with pytest.raises(ValueError, match="bad fault spec 'sigkill@7:1'"):
        Injector.parse("sigkill@7:1")  # the harness does it, not the rank itself


def test_no_kind_name_is_compared_outside_the_registry() -> None:
    names = "|".join(REGISTRY)
    pattern = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=|in\b)""")
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "chaos").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "dispatch on a kind's name belongs in its class (chaos/faults):\n" + "\n".join(hits)


def test_a_class_without_slo_gets_its_kind_s_default_and_one_with_slo_keeps_it() -> None:
    cert = schedule.Certification.model_validate({"classes": {
        "corrupt": {"fault": "corrupt_checkpoint", "step": 5},
        "slow": {"fault": "slow_disk", "step": 5, "slo": {"detect_s": 2.0}},
        "kill": {"fault": "sigkill", "step": 5},
    }})  # fmt: skip
    assert cert.classes["corrupt"].slo.previous_checkpoint_loads is True
    assert cert.classes["slow"].slo.restarts_max is None  # as written: no default merged in
    assert cert.classes["kill"].slo == schedule.SLO()


def test_stream_kinds_and_default_args_come_from_the_kinds() -> None:
    assert "link_loss" not in schedule.STREAM_KINDS and "segfault" in schedule.STREAM_KINDS
    assert "segfault" not in schedule.Stream().kinds  # not among the default stream's kinds
    p = schedule.Planned(fault="kernel_oom", step=9)
    assert p.spec(9) == "kernel_oom@9:1=700"
    with pytest.raises(ValueError, match="repeat: only in-process faults re-fire, not sigkill"):
        schedule.Planned(fault="sigkill", step=3, repeat=2)


def test_cuda_oom_without_a_gpu_is_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CudaOom().arrange(None, []) == "cuda_oom injector needs a GPU (none is present)"  # type: ignore[arg-type]


# ---- the arranged-job context --------------------------------------------------------------------


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the context did, in order: each kind's arrangement and its removal, the job's kill (the
    Runner replaced by a fake that starts nothing)."""
    done: list[str] = []

    def arrange(self: FaultKind, setup: Any, faults: Any) -> str | None:
        why = getattr(self, "_why", None)
        if why is None:
            done.append(f"{self.name} arranged")
            setup.stack.callback(done.append, f"{self.name} removed")
        return why

    class FakeRunner:
        def __init__(self, cert: Any, cwd: Path, plan: str, deadline: float, **kw: Any) -> None:
            self.plan = plan
            self.job = SimpleNamespace(kill=lambda: done.append("job killed"))

    for kind in (KernelOom, LinkDrop):
        monkeypatch.setattr(kind, "arrange", arrange)
    monkeypatch.setattr(arranged, "Runner", FakeRunner)
    return done


def _placed(*faults: tuple[int, str]) -> list[tuple[int, schedule.Planned]]:
    return [(s, schedule.Planned(fault=k, step=s)) for s, k in faults]


def test_the_job_is_killed_and_everything_removed_even_when_the_run_fails(log: list[str], tmp_path: Path):
    cert = schedule.Certification()
    placed = _placed((5, "kernel_oom"), (7, "link_drop"), (9, "exception"))
    with pytest.raises(RuntimeError, match="the run failed"), arranged_job(cert, tmp_path, placed, 0.0) as a:
        assert a.runner.plan == "kernel_oom@5:1=700,exception@9:1"  # in-process faults only
        assert a.skipped == [] and len(a.placed) == 3
        raise RuntimeError("the run failed")
    assert log == ["kernel_oom arranged", "link_drop arranged", "job killed", "link_drop removed",
                   "kernel_oom removed"]  # fmt: skip


def test_a_fault_this_machine_cannot_do_is_left_out_or_the_trial_skipped(
    log: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(KernelOom, "_why", "no cgroup v1 memory controller", raising=False)
    cert = schedule.Certification()
    with arranged_job(cert, tmp_path, _placed((5, "kernel_oom"), (9, "exception")), 0.0) as a:
        assert a.runner.plan == "exception@9:1" and [f.fault for _, f in a.placed] == ["exception"]
        assert a.skipped == ["kernel_oom: no cgroup v1 memory controller"]
    monkeypatch.setattr(LinkDrop, "_why", "network namespaces need root", raising=False)
    with arranged_job(cert, tmp_path, _placed((7, "link_drop")), 0.0) as a:
        assert a.skipped == ["link faults: network namespaces need root"]
    log.clear()
    trial = arranged_job(cert, tmp_path, _placed((5, "kernel_oom")), 0.0, partial=False)
    with pytest.raises(Unavailable, match="no cgroup v1 memory"), trial:  # a certificate's trial
        pytest.fail("the job must not start")
    assert log == []


# ---- docs/chaos.md ------------------------------------------------------------------------------------


def test_the_kinds_table_in_docs_is_generated_from_the_registry() -> None:
    current = reference.DOC.read_text()
    assert reference.render(current) == current, (
        f"docs/chaos.md's kinds table differs from chaos/faults; regenerate it with `{reference.COMMAND}`"
    )
    for name in REGISTRY:
        assert f"\n| {name} |" in current


def test_chaos_kinds_lists_every_kind_name_first(capsys: pytest.CaptureFixture[str]) -> None:
    from chaos.cli import main

    assert main(["kinds"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(REGISTRY)
    assert "needs root, cgroup v1 memory" in next(line for line in lines if line.startswith("kernel_oom"))
