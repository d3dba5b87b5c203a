"""The figures the README and docs/ quote are the committed results' (chaos/figures.py)."""

from __future__ import annotations

import pytest

from chaos import figures


def test_every_quoted_block_is_its_result_s_current_text_of_the_current_recovery_path() -> None:
    assert figures.stale() == [], "regenerate with `python -m chaos.figures`"


def test_every_decimal_next_to_a_result_link_is_one_of_its_values() -> None:
    assert figures.unsourced() == []


def test_a_block_names_its_result_and_what_made_it() -> None:
    for name, (_docs, make, sources) in figures.BLOCKS.items():
        body = make()
        assert all(f"benchmarks/results/{s}" in body for s in sources), name
        # its stamp in words, or the block above it of the same result has it
        assert "torch" in body or "same run" in body, name


def test_a_result_of_an_older_recovery_path_is_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    real = figures._load

    def older(name: str) -> dict:
        data = real(name)
        return {**data, "stamp": {**data.get("stamp", {}), "recovery_path": 0}}

    monkeypatch.setattr(figures, "_load", older)
    said = figures.stale()
    assert said and all("recovery path 0" in s for s in said if "differs" not in s)


def test_a_quoted_decimal_matches_at_its_own_precision() -> None:
    assert figures._matches("0.38", [0.3842])
    assert figures._matches("99.3", [0.99335])  # a share shown as a percentage
    assert figures._matches("4.41", [0.004412])  # seconds shown in ms
    assert not figures._matches("0.43", [0.17, 0.2])


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


def test_every_result_is_stamped_but_the_older_ones_listed() -> None:
    import json

    unstamped = set()
    for path in figures.RESULTS.rglob("*.json"):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and data.get("stamp")):
            unstamped.add(str(path.relative_to(figures.RESULTS)))
    assert unstamped <= figures.UNSTAMPED, "a new result without a stamp: write it with chaos.results"
    assert unstamped >= figures.UNSTAMPED, "a listed result is stamped now: take it off the list"
