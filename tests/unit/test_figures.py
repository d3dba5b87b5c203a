"""The figures the README and docs/ quote are the committed results' (chaos/figures.py)."""

from __future__ import annotations

import pytest

from chaos import figures


def test_every_quoted_block_is_its_result_s_current_text() -> None:
    assert figures.stale() == [], "regenerate with `python -m chaos.figures`"


def test_a_block_names_its_result_and_what_made_it() -> None:
    for _name, (_doc, make) in figures.BLOCKS.items():
        first = make().splitlines()[0]
        assert "benchmarks/results/" in first and ("stamped" in first or "torch" in first)


def test_a_document_without_its_block_is_an_error_not_a_silent_skip() -> None:
    with pytest.raises(ValueError, match="figures:certificate"):
        figures.render("no markers here", "certificate", "x")


def test_what_made_a_result_is_read_from_its_stamp() -> None:
    stamp = {
        "date": "2026-12-06 23:00:00 UTC",
        "commit": "abc1234",
        "tree_clean": False,
        "torch": "2.15.0",
        "load_before": [0.4, 0, 0],
        "load_after": [2.5, 0, 0],
        "cores": 2,
    }
    said = figures.made_by({"stamp": stamp})
    assert said == "2026-12-06, abc1234, uncommitted changes, torch 2.15.0, load 0.4-2.5 on 2 cores"
    assert figures.made_by({}).startswith("unstamped")
