"""``desync`` on a DDP model (chaos/faults/desync.py): the faulted step's gradients are not
all-reduced however the script toggles DDP's sync (gradient accumulation sets it before every
micro-step; ``no_sync()`` sets and restores it), the model is a plain DDP again once the step is
over, with the value the script set last; a step with nothing to skip says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from chaos.inject import IDLE, Injector, outcomes

ACCUM = 2  # micro-steps per step


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_script_s_writes_are_kept_while_ddp_reads_its_sync_off(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    model = DDP(torch.nn.Linear(3, 1))
    inj = Injector.parse("desync@4:0")
    inj.maybe_fire(0, 4, objects=[model])
    assert (
        isinstance(model, DDP)
        and type(model) is not DDP
        and repr(model).startswith("DistributedDataParallel(")
    )
    for micro in range(ACCUM):  # nanoGPT's train.py, before every micro-step's forward
        model.require_backward_grad_sync = micro == ACCUM - 1
        assert model.require_backward_grad_sync is False  # what DDP reads
        model(torch.ones(2, 3)).sum().backward()
    with model.no_sync():  # (the value it restores is the script's, not the False DDP reads)
        model(torch.ones(2, 3)).sum().backward()
    inj.step_over()
    assert type(model) is DDP and model.require_backward_grad_sync is True  # the last value set
    assert model.__dict__["require_backward_grad_sync"] is True
    records = _records(tmp_path / "inj.jsonl")
    assert [r["kind"] for r in records] == ["desync"] and IDLE not in records[0]  # it acted


def test_a_step_whose_forwards_the_script_kept_unsynced_is_recorded_as_not_acted(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # train_accum.py's micro-step under no_sync, an evaluation under no_grad: the rank issues no
    # gradient all-reduce in the step, so there is none to skip
    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    model = DDP(torch.nn.Linear(3, 1))
    model.require_backward_grad_sync = False  # the script's own, from its previous step
    inj = Injector.parse("desync@4:0")
    inj.maybe_fire(0, 4, objects=[model])
    model(torch.ones(2, 3)).sum().backward()
    with model.no_sync():
        model(torch.ones(2, 3)).sum().backward()
    model.require_backward_grad_sync = True
    with torch.no_grad():
        model(torch.ones(2, 3))
    inj.step_over()
    assert type(model) is DDP and model.require_backward_grad_sync is True
    acted, idle = outcomes(_records(tmp_path / "inj.jsonl"))
    assert acted == [] and [(n.kind, n.step, n.rank) for n in idle] == [("desync", 4, 0)]
    assert "no gradient all-reduce to skip" in idle[0].why
