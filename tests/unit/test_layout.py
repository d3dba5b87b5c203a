"""A state saved under another pipeline layout is refused before anything is loaded, naming the
layers each side holds (state/layout.py)."""

from __future__ import annotations

import pytest
import torch.nn as nn

from resilient.errors import StateRestoreError
from resilient.state.layout import check, held
from resilient.state.registry import GRAD


def _stage(blocks: range, first: bool = False, last: bool = False) -> nn.Module:
    """A stage cut from a whole model the way torchtitan cuts it: the whole model's names."""
    m = nn.Module()
    m.blocks = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in blocks})
    if first:
        m.embed = nn.Embedding(8, 4)
    if last:
        m.head = nn.Linear(4, 8)
    return m


def test_the_layers_a_module_holds_in_a_line() -> None:
    names = [*_stage(range(2, 4), last=True).state_dict()]
    assert held(names) == "blocks.2-3, head"
    assert held(["blocks.0.w", "blocks.1.w", "blocks.5.w", "pos"]) == "blocks.0-1,5, pos"


def test_the_same_layout_loads() -> None:
    stage = _stage(range(2), first=True)
    check({"stage0": stage, "optimizer0": object()}, {"stage0": {**stage.state_dict(), GRAD: {}}}, "ck")


def test_another_stage_count_is_refused_naming_both() -> None:
    """Four stages saved (rank 1: block 1), two stages now (rank 1: blocks 2-3 and the head)."""
    saved = {"stage0": _stage(range(1, 2)).state_dict()}
    with pytest.raises(StateRestoreError) as e:
        check({"stage0": _stage(range(2, 4), last=True)}, saved, "checkpoint step-10")
    msg = str(e.value)
    assert "checkpoint step-10: tracked module 'stage0' was saved holding blocks.1" in msg
    assert "this rank's holds blocks.2-3, head" in msg and "not supported" in msg
